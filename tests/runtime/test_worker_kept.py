"""Leases a Worker keeps because the backend may still touch their rows (S2.1, S4.2). One whose
attempt did not quiesce within its deadline and grace comes back at the worker's first call after
that attempt has quiesced, not only at close(); until then it stays kept, whatever else the
worker does. Over the embedded in-memory store, its driver wrapped to hold a put (fault injection
on the real store)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest
from kvwire_memory.driver import MemoryDriver
from kvwire_memory.store import named_store
from worker_support import worker_pool

import kvwire.runtime.worker as worker_module
from kvwire.blob import BlobBackend
from kvwire.contract import Attempt, Backend, Capabilities, Hint, SlotRegion, View
from kvwire.contract.backend import Registration, WakeFn
from kvwire.registry import BackendConfig
from kvwire.runtime import ModelConfig, Worker
from kvwire.runtime.worker import TransferError
from kvwire.testing.faults import Block, FaultyDriver
from kvwire.testing.holder import wait_for

MODEL = ModelConfig(layers=2, layers_per_group=1, heads=2, head_dim=8, block_tokens=16, max_tokens=512, seed=5)


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MODEL.vocab, n)


def test_a_lease_kept_for_an_attempt_that_quiesced_late_comes_back_before_close(monkeypatch: pytest.MonkeyPatch):
    """A publish whose put is stuck in the store concludes at its deadline but cannot quiesce:
    the worker raises TransferError and keeps the lease. While the put is stuck, the pins stay,
    through other publishes, generations and pins() calls. Once the put returns and the attempt
    quiesces, the next call returns the lease: pins are back to zero before close(). (The lease
    used to stay kept until close(): its pins outlived the fault.)"""
    # The worker gives up after the deadline plus two graces; 0.2 s keeps the wait short.
    monkeypatch.setattr(worker_module, "QUIESCE_GRACE_S", 0.2)
    name = f"kept-{time.monotonic_ns()}"
    stuck = Block("put", call=1)
    driver = FaultyDriver(MemoryDriver(named_store(name, capacity_bytes=1 << 30, eviction=True)), [stuck])
    config = BackendConfig("memory", {"store": name})

    def build(worker: str, **kw: object) -> Worker:
        backend = BlobBackend(driver, namespace="default", timeout_s=10.0, owns_driver=True)
        return Worker(MODEL, config=config, name=worker, num_blocks=64, timeout_s=10, instance=backend)

    with worker_pool(build) as make:
        a = make("A")
        try:
            p, q = prompt(64, 1), prompt(64, 2)
            a.generate(p)
            a.generate(q)
            assert a.pins() == 0
            with pytest.raises(TransferError, match="the publish did not quiesce in time"):
                a.publish(p, timeout_s=0.3)
            assert driver.blocked == 1, "the put is no longer stuck: the test proves nothing"
            held = a.pins()
            assert held > 0, "the lease of a publish that may still read its rows was released"

            # The attempt has not quiesced: every call leaves the lease kept.
            assert a.publish(q).blocks_moved == 4
            a.generate(prompt(40, 3))
            assert a.pins() == held and driver.blocked == 1

            stuck.release.set()  # the put returns; the attempt quiesces
            wait_for(lambda: a.pins() == 0, 10, "the kept lease coming back once its attempt quiesced")
            assert a.publish(p).status == "delivered"
            assert a.pins() == 0
        finally:
            driver.release_all()


class RaisingPublish(Backend):
    """The memory backend, except that every publish raises after handing the rows on: access
    may have escaped, and the contract says nothing ends it before shutdown (S4.2)."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        return self.inner.register_regions(regions)

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self.inner.fetch(view, hint, wake)

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        self.inner.publish(view, hint, wake)
        raise RuntimeError("injected: the publish raised after its rows escaped")

    def shutdown(self) -> frozenset[Attempt]:
        return self.inner.shutdown()

    def close(self) -> None:
        self.inner.close()


def test_a_lease_kept_because_a_submission_raised_stays_until_close():
    """A lease kept with no attempt to ask (the publish call raised) is not returned by later
    calls; close() returns it once the backend has shut down (S4.2, B3.7)."""
    options = {"store": f"kept-raise-{time.monotonic_ns()}"}
    config = BackendConfig("memory", options)
    a = Worker(MODEL, config=config, name="A", num_blocks=64, timeout_s=10,
               instance=RaisingPublish(config.build()))
    try:
        p = prompt(64, 4)
        a.generate(p)
        with pytest.raises(RuntimeError, match="injected"):
            a.publish(p)
        held = a.pins()
        assert held > 0
        a.generate(prompt(40, 5))
        assert a.pins() == held
    finally:
        a.close()
    assert a.pins() == 0
