"""The seed's flow across two processes, over real UCX endpoints: worker 0 serves from its own
process; worker 1 pulls with nothing but worker 0's transceiver state and decodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvwire.registry import ConfigError, PluginError, load

try:
    _why = load("ucx").check() if load("ucx").check else None
except (ConfigError, PluginError) as exc:
    _why = str(exc)
if _why:
    pytest.skip(f"the ucx backend is unavailable: {_why}", allow_module_level=True)

from kvwire.runtime import ModelConfig, Worker  # noqa: E402

HERE = Path(__file__).parent
MODEL = dict(layers=4, layers_per_group=2, heads=4, head_dim=32, block_tokens=16, max_tokens=4096, seed=13)


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, n)


class Sender:
    def __init__(self, prompts: list[np.ndarray], blocks: int = 512) -> None:
        spec = {"model": MODEL, "backend": "ucx", "blocks": blocks, "name": "worker-0",
                "prompts": [p.tolist() for p in prompts]}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "worker_process.py"), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        line = self._line(60)
        self.state = bytes.fromhex(json.loads(line)["state"])

    def _line(self, timeout: float) -> str:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()))
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            raise AssertionError(f"the sender process said nothing within {timeout} s (rc={self.proc.poll()})")
        return box[0]

    def pins(self) -> dict:
        self.proc.stdin.write("pins\n")
        self.proc.stdin.flush()
        return json.loads(self._line(10))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def test_pull_from_another_process_then_decode():
    p = prompt(1000, 1)
    sender = Sender([p])
    try:
        with Worker(ModelConfig(**MODEL), backend="ucx", num_blocks=128, name="worker-1", timeout_s=10) as b, \
             Worker(ModelConfig(**MODEL), backend="memory", options={"store": "ref-proc"}, num_blocks=128) as ref:
            pulled = b.pull(p, source=sender.state)
            assert pulled.status == "delivered" and pulled.blocks_moved == 62 and pulled.cached_tokens == 992
            remote = b.generate(p, max_tokens=4)
            assert remote.cached_tokens == 992
            local = ref.generate(p, max_tokens=4)
            assert torch.allclose(remote.logits, local.logits, rtol=1e-4, atol=1e-5)
            assert remote.tokens == local.tokens
            assert b.generate(prompt(100, 2)).cached_tokens < remote.cached_tokens
            assert b.pull(p, source=sender.state).blocks_moved == 0
            deadline = time.monotonic() + 10
            while (seen := sender.pins())["pins"] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert seen == {"pins": 0, "served": 1}
    finally:
        sender.stop()
    assert sender.proc.returncode == 0


def test_a_sender_killed_mid_pull_fails_within_the_deadline_with_no_pins_left():
    prompts = [prompt(4000, 10 + i) for i in range(3)]
    sender = Sender(prompts, blocks=1024)
    try:
        with Worker(ModelConfig(**MODEL), backend="ucx", num_blocks=1024, name="worker-1", timeout_s=5) as b:
            assert b.pull(prompts[0], source=sender.state).status == "delivered"   # it works...
            threading.Timer(0.005, lambda: os.kill(sender.proc.pid, signal.SIGKILL)).start()
            began = time.monotonic()
            killed = b.pull(prompts[1], source=sender.state, timeout_s=5)           # ...until it dies
            assert time.monotonic() - began < 5 + 5
            assert killed.status in ("failed", "delivered")
            if killed.cached_tokens:   # whatever was committed is exactly the sender's bytes
                with Worker(ModelConfig(**MODEL), backend="memory", options={"store": "ref-kill"},
                            num_blocks=512) as ref:
                    got = b.generate(prompts[1][: killed.cached_tokens + 1])
                    want = ref.generate(prompts[1][: killed.cached_tokens + 1])
                    assert got.cached_tokens == killed.cached_tokens
                    assert torch.allclose(got.logits, want.logits, rtol=1e-4, atol=1e-5)
            after = b.pull(prompts[2], source=sender.state, timeout_s=5)
            assert after.status == "failed" and after.reason
            assert b.pins() == 0
            assert b.generate(prompt(64, 99)).tokens                               # still working
    finally:
        sender.stop()
