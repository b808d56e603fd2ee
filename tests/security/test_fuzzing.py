"""Coverage-guided fuzzing (atheris, where it installs) of every decoder of received bytes, and a
check that decoding garbage does not grow memory."""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from kvwire.contract import Hint
from kvwire.holding import StateError, TransceiverState

HERE = Path(__file__).parent


def test_atheris_finds_no_crash_in_the_decoders(tmp_path):
    pytest.importorskip("atheris", reason="atheris does not install on this platform")
    r = subprocess.run(
        [sys.executable, str(HERE / "fuzz_decoders.py"), "-runs=30000", "-max_len=600", "-timeout=10",
         f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONHASHSEED="0"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Done 30000 runs" in r.stderr


def test_decoding_garbage_does_not_grow_memory():
    rng = np.random.default_rng(0)
    inputs = [rng.bytes(int(n)) for n in rng.integers(0, 400, 4000)]
    inputs += [b"KVWS\x01" + x for x in inputs[:1000]] + [b"KVWH\x01" + x for x in inputs[:1000]]

    def decode_all() -> None:
        for raw in inputs:
            try:
                TransceiverState.from_bytes(raw)
            except StateError:
                pass
            try:
                Hint.from_bytes(raw)
            except ValueError:
                pass

    decode_all()  # warm caches
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            decode_all()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, f"decoding {3 * len(inputs)} garbage inputs kept {grown} bytes"
