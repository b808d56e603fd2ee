"""The fault matrix on real components, at the level a runtime sees: each case concludes within
its deadline, pins and leases return to zero on both sides, no corrupt row is committed, and the
workers keep serving. ``docs/reliability.md`` maps each case to its test."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
from kvwire_memory.driver import MemoryDriver
from kvwire_memory.store import named_store
from test_cancel_and_faults import assert_committed_rows_equal_the_source, configured, settle  # noqa: E402

from kvwire.blob import BlobBackend
from kvwire.registry import BackendConfig
from kvwire.runtime import ModelConfig, Worker
from kvwire.testing.faults import FaultyDriver, Slow

MODEL = ModelConfig(layers=4, layers_per_group=2, heads=2, head_dim=16, block_tokens=16, max_tokens=4096, seed=8)


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MODEL.vocab, n)


def test_store_full_publishes_a_prefix_and_the_pull_gets_it():
    row = MODEL.layout(1).groups[0].slot_bytes
    store = f"full-{time.monotonic_ns()}"
    options = {"store": store, "capacity_bytes": 10 * row, "eviction": False}   # room for 5 blocks × 2 groups
    with Worker(MODEL, backend="memory", options=options, name="A", num_blocks=64) as a, \
         Worker(MODEL, backend="memory", options=options, name="B", num_blocks=64) as b:
        p = prompt(16 * 8 + 1, 1)
        a.generate(p)
        published = a.publish(p)
        assert published.status == "delivered" and published.blocks_moved == 5   # declined is not failed: whole blocks first
        pulled = b.pull(p, source=a.transceiver_state())
        assert pulled.status == "delivered" and pulled.cached_tokens == 5 * 16
        assert assert_committed_rows_equal_the_source(a, b, p) == 5
        assert torch.allclose(b.generate(p).logits, a.generate(p).logits, rtol=1e-4, atol=1e-5)
    assert a.pins() == 0 and b.pins() == 0


def test_a_slow_store_fails_at_the_deadline_and_commits_nothing():
    name = f"slow-{time.monotonic_ns()}"
    store = named_store(name, capacity_bytes=1 << 30, eviction=True)
    config = BackendConfig("memory", {"store": name})
    slow = BlobBackend(FaultyDriver(MemoryDriver(store), [Slow(op="get", call=None, delay_s=1.5)]),
                       namespace="default", timeout_s=0.5, owns_driver=True)
    with Worker(MODEL, config=config, name="A", num_blocks=32) as a, \
         Worker(MODEL, config=config, name="B", num_blocks=32, instance=slow) as b:
        p = prompt(64, 2)
        a.generate(p)
        a.publish(p)
        began = time.monotonic()
        pulled = b.pull(p, source=a.transceiver_state(), timeout_s=0.5)
        assert time.monotonic() - began < 0.5 + 1.5 + 1.0     # deadline, then the store call returns
        assert pulled.status == "failed" and "deadline" in pulled.reason
        assert pulled.cached_tokens == 0 and b.cached_tokens(p) == 0
        assert settle(b) == 0
        assert b.generate(p).cached_tokens == 0                # still working, recomputes
        assert b.counters.deadline_expiries == 1


def test_mooncake_master_killed_before_and_during_a_pull():
    from kvwire.testing.require import backend_usable

    backend_usable("mooncake")  # skips, or fails when the run requires the backend
    from kvwire_mooncake.master import MasterProcess
    with MasterProcess() as master:
        config = BackendConfig("mooncake", {"master": master.address, "timeout_s": 6.0})
        with Worker(MODEL, config=config, name="A", num_blocks=200) as a, \
             Worker(MODEL, config=config, name="B", num_blocks=200) as b:
            p, q = prompt(16 * 64, 3), prompt(16 * 64, 4)
            from kvwire.cli.bench import _fill

            _fill(a, [p, q])
            a.publish(p)
            a.publish(q)
            state = a.transceiver_state()
            killer = threading.Timer(0.002, master.kill)   # during the pull of p
            killer.start()
            began = time.monotonic()
            during = b.pull(p, source=state, timeout_s=6)
            killer.join()
            after = b.pull(q, source=state, timeout_s=6)    # before: the master is already dead
            took = time.monotonic() - began
            assert took < 2 * (6 + 5), f"{took:.1f} s"
            for r, tokens in ((during, p), (after, q)):
                assert r.status in ("delivered", "failed"), r
                if r.status == "failed":
                    assert r.reason
                assert assert_committed_rows_equal_the_source(a, b, tokens) * 16 == r.cached_tokens
            assert after.status == "failed"
            assert settle(a) == 0 and settle(b) == 0
            assert b.generate(prompt(40, 5)).tokens            # still serving requests


def test_blocks_under_eviction_pressure_are_pinned_while_served():
    with configured("ucx") as config, \
         Worker(MODEL, config=config, name="A", num_blocks=40, timeout_s=10) as a, \
         Worker(MODEL, config=config, name="B", num_blocks=400, timeout_s=10) as b:
        stop = threading.Event()
        errors: list[BaseException] = []

        def churn() -> None:          # A keeps computing new prompts, evicting idle blocks LRU
            i = 0
            try:
                while not stop.is_set():
                    a.generate(prompt(16 * 6 + 1, 10_000 + i))
                    i += 1
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        thread = threading.Thread(target=churn)
        thread.start()
        try:
            for i in range(20):
                p = prompt(16 * 4, 20_000 + i)
                a.generate(p)
                pulled = b.pull(p, source=a.transceiver_state())
                assert pulled.status == "delivered" and pulled.cached_tokens > 0
                # A may evict p's blocks right after serving them, so the proof is what B computes
                # on the rows it committed: the same logits as a reference that computed p itself
                assert torch.allclose(b.generate(p).logits, workers_reference(p), rtol=1e-4, atol=1e-5)
        finally:
            stop.set()
            thread.join()
        assert not errors, errors
        assert settle(a) == 0 and settle(b) == 0


_REFERENCE: dict[bytes, torch.Tensor] = {}


def workers_reference(p: np.ndarray) -> torch.Tensor:
    key = p.tobytes()
    if key not in _REFERENCE:
        with Worker(MODEL, backend="memory", options={"store": "reference"}, name="ref", num_blocks=16) as ref:
            _REFERENCE[key] = ref.generate(p).logits
    return _REFERENCE[key]
