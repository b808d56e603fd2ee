"""A driver's ``chunks_at_once``: how many calls of one submission the blob backend makes at once
(Mooncake's client moves one call fastest alone). The default keeps a submission's chunks side
by side on the workers; 1 sends them one after another, and the contract's clauses hold for a
submission whose chunks wait their turn (A4 cancel, A5 masks, A7 bytes, W1)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from blobkit import Slab, Waker, group, settle, view
from kvwire_memory import MemoryDriver, MemoryStore

from kvwire.blob import BlobBackend
from kvwire.contract import Hint
from kvwire.testing.faults import Block, FaultyDriver

STORE = Hint.of("store")
#: How long a call waits for a second call of the same submission to join it: long enough for a
#: queued chunk to reach an idle worker on a loaded machine, short enough to cost the test little.
OVERLAP_S = 0.1


class _OverlapDriver(MemoryDriver):
    """The memory driver, recording how many of its calls were inside it at once: each call waits
    up to :data:`OVERLAP_S` for another to arrive, so calls that may run side by side do."""

    def __init__(self, store: MemoryStore, at_once: int | None) -> None:
        super().__init__(store)
        self.chunks_at_once = at_once
        self.cond = threading.Condition()
        self.inside = 0
        self.most = 0
        self.calls = 0

    def _enter(self) -> None:
        with self.cond:
            self.inside += 1
            self.calls += 1
            self.most = max(self.most, self.inside)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.inside >= 2, OVERLAP_S)

    def _leave(self) -> None:
        with self.cond:
            self.inside -= 1

    def put(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        self._enter()
        try:
            return super().put(keys, addresses, sizes)
        finally:
            self._leave()

    def get_into(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        self._enter()
        try:
            return super().get_into(keys, addresses, sizes)
        finally:
            self._leave()


@pytest.mark.parametrize(("at_once", "most"), [(None, 2), (1, 1)], ids=["default: side by side", "one at a time"])
def test_a_submissions_chunks_run_as_many_at_once_as_the_driver_takes(store, make_backend, at_once, most):
    """Three chunks on four workers: a driver that declares nothing gets two calls at once (the
    default, unchanged for drivers written before ``chunks_at_once``); one that declares 1 never
    gets a second call while one is inside it. Every row moves whole either way."""
    writer, reader = _OverlapDriver(store, at_once), _OverlapDriver(store, at_once)
    a = make_backend(writer, chunk_bytes=128, workers=4)
    b = make_backend(reader, chunk_bytes=128, workers=4)
    src, dst = Slab.make(6, 64, seed=3), Slab.make(6, 64)
    a.register_regions([src.region])
    b.register_regions([dst.region])
    sent = settle(a.publish(view(group(src, range(6), range(6))), STORE, waker := Waker()), waker)
    got = settle(b.fetch(view(group(dst, range(6), range(6))), STORE, waker := Waker()), waker)
    assert sent.is_delivered and sent.masks[0].all() and got.is_delivered and got.masks[0].all()
    np.testing.assert_array_equal(dst.array, src.array)
    assert (writer.calls, reader.calls) == (3, 3)
    assert (writer.most, reader.most) == (most, most)


def test_a_cancel_while_one_chunk_is_inside_the_store_calls_no_later_chunk(store, make_backend):
    """With chunks one at a time, a cancel while the first is inside the store concludes at once
    (A4), the attempt quiesces when that call returns, and the chunks that waited their turn
    never reach the store: nothing of them escapes after the cancel."""
    inner = MemoryDriver(store)
    inner.chunks_at_once = 1
    gate = Block("put", call=1)
    driver = FaultyDriver(inner, [gate])
    backend = make_backend(driver, chunk_bytes=64, workers=2)
    src = Slab.make(4, 64, seed=4)
    backend.register_regions([src.region])
    waker = Waker()
    attempt = backend.publish(view(group(src, range(4), range(4))), STORE, waker)
    assert driver.wait_blocked(1)
    attempt.cancel()
    assert attempt.poll() is not None and attempt.poll().is_cancelled
    assert not attempt.quiesced()
    gate.release.set()
    waker.until(attempt.quiesced)
    assert driver.calls["put"] == 1
    assert len(store) == 1  # the first chunk's row, which was inside the store at the cancel


def test_a_driver_bound_on_calls_at_once_that_is_no_positive_int_is_refused(store):
    for wrong in (0, True, 1.0):
        driver = MemoryDriver(store)
        driver.chunks_at_once = wrong  # type: ignore[assignment]
        with pytest.raises(ValueError, match="chunks_at_once"):
            BlobBackend(driver)
