"""Load: 1000 pulls from 8 concurrent receivers against one sender, over UCX and over the
Mooncake store. No pull fails, every one moves its blocks, pin counts return to zero, and the
throughput is printed (run with ``-s`` to see it)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from test_cancel_and_faults import configured, settle  # noqa: E402  (same folder)

from kvwire.runtime import ModelConfig, Worker

MODEL = ModelConfig(layers=2, layers_per_group=1, heads=2, head_dim=16, block_tokens=16, max_tokens=256, seed=4)
RECEIVERS, PULLS_EACH, BLOCKS = 8, 125, 4


@pytest.mark.parametrize("backend", ["ucx", "mooncake"])
def test_a_thousand_pulls_from_eight_receivers(backend):
    prompts = [np.random.default_rng(5000 + i).integers(0, MODEL.vocab, BLOCKS * 16) for i in range(PULLS_EACH)]
    with configured(backend) as config:
        sender = Worker(MODEL, config=config, num_blocks=PULLS_EACH * BLOCKS + 8, name="sender", timeout_s=30)
        receivers = [Worker(MODEL, config=config, num_blocks=PULLS_EACH * BLOCKS + 8, name=f"r{i}", timeout_s=30)
                     for i in range(RECEIVERS)]
        try:
            from kvwire.cli.bench import _fill

            _fill(sender, prompts)
            if sender.capabilities.other_end.value == "store":
                for p in prompts:
                    assert sender.publish(p).status == "delivered"
            state = sender.transceiver_state()
            results, errors = [], []

            def run(worker: Worker, k: int) -> None:
                try:
                    for j in range(PULLS_EACH):
                        results.append(worker.pull(prompts[(k * 17 + j) % PULLS_EACH], source=state))
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(w, i)) for i, w in enumerate(receivers)]
            began = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            seconds = time.perf_counter() - began
            assert not errors, errors[:3]
            assert len(results) == RECEIVERS * PULLS_EACH >= 1000
            bad = [r for r in results if r.status != "delivered" or r.blocks_moved != BLOCKS]
            assert not bad, bad[:3]
            moved = sum(r.bytes_moved for r in results)
            print(f"\n{backend}: {len(results)} pulls from {RECEIVERS} receivers in {seconds:.1f} s: "
                  f"{len(results) / seconds:.0f} pulls/s, {moved / seconds / 1e6:.0f} MB/s")
            assert settle(sender) == 0
            assert all(settle(w) == 0 for w in receivers)
        finally:
            for w in (sender, *receivers):
                w.close()
