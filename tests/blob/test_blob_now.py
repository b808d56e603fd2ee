"""Reads tried inside the holder's call (``get_into_now``, ``contains_now``): a driver that
answers moves the rows before ``fetch`` returns; one that answers ``None`` (it would have
waited) gets the same rows moved by a worker, or the lookup answered by the lookup thread; an
attempt whose deadline passed while the driver was asked still quiesces and wakes."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
from blobkit import Slab, Waker, group, names, settle, view
from kvwire_memory import MemoryDriver

from kvwire.blob import BatchResult, store_keys
from kvwire.contract import Cause, Hint

HINT = Hint.of("store", namespace="ns")


class Deferring(MemoryDriver):
    """A memory driver that reads inside the holder's call only when ``answer_now`` is set,
    and records which thread each read ran on."""

    inline_contains = True

    def __init__(self, store, answer_now: bool) -> None:  # type: ignore[no-untyped-def]
        super().__init__(store)
        self.answer_now = answer_now
        self.gate: threading.Event | None = None
        self.asked_now = threading.Event()
        self.calls: list[tuple[str, int]] = []

    def get_into_now(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        self.calls.append(("get_into_now", threading.get_ident()))
        self.asked_now.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        return self.get_into(keys, addresses, sizes, record=False) if self.answer_now else None

    def get_into(self, keys, addresses, sizes, record: bool = True):  # type: ignore[no-untyped-def]
        if record:
            self.calls.append(("get_into", threading.get_ident()))
        return super().get_into(keys, addresses, sizes)

    def contains_now(self, keys: Sequence[str]) -> BatchResult | None:
        self.calls.append(("contains_now", threading.get_ident()))
        return super().contains(keys) if self.answer_now else None

    def contains(self, keys: Sequence[str]) -> BatchResult:
        self.calls.append(("contains", threading.get_ident()))
        return super().contains(keys)


def _published(backend, rows: int, seed: int) -> tuple[Slab, np.ndarray]:  # type: ignore[no-untyped-def]
    source = Slab.make(rows, 4096, seed=seed)
    ids = np.arange(rows) + 1000 * seed
    with backend.register_regions([source.region]):
        waker = Waker()
        assert settle(backend.publish(view(group(source, range(rows), ids)), HINT, waker), waker).is_delivered
    return source, ids


def test_a_driver_that_answers_now_has_moved_the_rows_when_fetch_returns(store, make_backend) -> None:  # type: ignore[no-untyped-def]
    driver = Deferring(store, answer_now=True)
    backend = make_backend(driver)
    source, ids = _published(backend, 4, seed=1)
    sink = Slab.make(4, 4096)
    with backend.register_regions([sink.region]):
        waker = Waker()
        attempt = backend.fetch(view(group(sink, range(4), ids)), HINT, waker)
        outcome = attempt.poll()
        assert outcome is not None and attempt.quiesced(), "the fetch had not ended when fetch() returned"
        assert outcome.is_delivered and outcome.masks[0].all(), outcome
        waker.until(lambda: waker.calls >= 1)
    np.testing.assert_array_equal(sink.array, source.array)
    me = threading.get_ident()
    assert driver.calls == [("get_into_now", me)], driver.calls


def test_a_driver_that_would_wait_gets_the_fetch_moved_by_a_worker(store, make_backend) -> None:  # type: ignore[no-untyped-def]
    driver = Deferring(store, answer_now=False)
    backend = make_backend(driver)
    source, ids = _published(backend, 4, seed=2)
    sink = Slab.make(4, 4096)
    with backend.register_regions([sink.region]):
        waker = Waker()
        outcome = settle(backend.fetch(view(group(sink, range(4), ids)), HINT, waker), waker)
    assert outcome.is_delivered and outcome.masks[0].all(), outcome
    np.testing.assert_array_equal(sink.array, source.array)
    me = threading.get_ident()
    assert [name for name, _ in driver.calls] == ["get_into_now", "get_into"], driver.calls
    assert driver.calls[0][1] == me and driver.calls[1][1] != me, "the fallback did not run on a worker"


def test_a_fetch_whose_deadline_passed_while_the_driver_was_asked_quiesces_and_wakes(store, make_backend) -> None:  # type: ignore[no-untyped-def]
    """The deadline thread concludes the attempt while ``get_into_now`` is still inside the
    driver; the driver then answers ``None``. Nothing is left inside the driver: the attempt
    quiesces, a wake follows, and no worker reads for it."""
    driver = Deferring(store, answer_now=False)
    backend = make_backend(driver, inline_bytes=8192)
    _, ids = _published(backend, 2, seed=3)
    sink = Slab.make(2, 4096)
    big = Slab.make(4, 4096)
    driver.gate = threading.Event()
    waker, other_waker = Waker(), Waker()
    made: list[object] = []
    with backend.register_regions([sink.region, big.region]):
        caller = threading.Thread(target=lambda: made.append(
            backend.fetch(view(group(sink, range(2), ids)), Hint.of("store", namespace="ns", timeout_s=0.05), waker)))
        caller.start()
        assert driver.asked_now.wait(10)
        # A second fetch, too big to be tried inline: its submission has the deadline thread
        # look at every attempt in flight, and so find the first one's deadline.
        other = backend.fetch(view(group(big, range(4), np.arange(4) + 77)), HINT, other_waker)
        waker.until(lambda: waker.calls >= 1)  # the first one concluded at its deadline
        driver.gate.set()
        caller.join(10)
        assert made, "fetch() did not return"
        attempt = made[0]
        waker.until(lambda: attempt.poll() is not None and attempt.quiesced())  # type: ignore[attr-defined]
        settle(other, other_waker)
    outcome = attempt.poll()  # type: ignore[attr-defined]
    assert outcome.is_failed and outcome.cause is Cause.DEADLINE, outcome
    assert [name for name, _ in driver.calls].count("get_into") == 1, driver.calls  # the second fetch only


def test_a_lookup_is_answered_on_the_callers_thread_or_by_the_lookup_thread(store, make_backend) -> None:  # type: ignore[no-untyped-def]
    asked = names([1, 2])
    store.insert(store_keys("ns", 0, asked)[0], b"x")
    me = threading.get_ident()
    now = Deferring(store, answer_now=True)
    assert make_backend(now).lookup([0], asked, HINT).tolist() == [True, False]
    assert now.calls == [("contains_now", me)], now.calls
    later = Deferring(store, answer_now=False)
    assert make_backend(later).lookup([0], asked, HINT).tolist() == [True, False]
    assert [name for name, _ in later.calls] == ["contains_now", "contains"], later.calls
    assert later.calls[1][1] != me, "the fallback did not run on the lookup thread"
