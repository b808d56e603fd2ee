"""Progress without polling, the bounded queue, cancel, deadlines, waking and shutdown
(A1-A4, A8, W1, B3, S3), with workers stuck inside the store on purpose."""

from __future__ import annotations

import gc
import threading
import time

import pytest
from blobkit import Slab, Waker, group, names, settle, view
from kvwire_memory import MemoryDriver

from kvwire.blob import BlobBackend, KeyStatus, store_keys
from kvwire.contract import Hint, SubmissionRejected
from kvwire.contract.outcome import OutcomeStatus
from kvwire.testing.faults import Block, FaultyDriver

STORE = Hint.of("store")


def blocked_backend(store, make_backend, op="put", call=None, **options):  # type: ignore[no-untyped-def]
    gate = Block(op, call=call)
    driver = FaultyDriver(MemoryDriver(store), [gate])
    return make_backend(driver, **options), driver, gate


def new_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t not in before}


def test_poll_never_blocks_while_every_worker_is_stuck_in_the_store(store, make_backend):
    backend, driver, gate = blocked_backend(store, make_backend, workers=2)
    src = Slab.make(3, 64, seed=1)
    backend.register_regions([src.region])
    wakers = [Waker() for _ in range(3)]
    attempts = [backend.publish(view(group(src, [i], [i])), STORE, w) for i, w in enumerate(wakers)]
    assert driver.wait_blocked(2)
    answers: list[tuple[object, bool]] = []

    def ask() -> None:
        for _ in range(1000):
            for attempt in attempts:
                answers.append((attempt.poll(), attempt.quiesced()))

    # 6000 calls while the store is held: a poll or quiesced that waited for the store could
    # only finish after the release below, so the asking thread must be done before it.
    asker = threading.Thread(target=ask)
    asker.start()
    asker.join(60.0)
    assert not asker.is_alive(), "poll()/quiesced() waited for the held store"
    assert answers == [(None, False)] * 3000
    gate.release.set()
    for attempt, waker in zip(attempts, wakers, strict=True):
        assert settle(attempt, waker).is_delivered
    assert len(store) == 3


def test_work_advances_without_anyone_polling(store, make_backend):
    backend = make_backend(MemoryDriver(store))
    src = Slab.make(4, 64, seed=2)
    backend.register_regions([src.region])
    waker = Waker()
    backend.publish(view(group(src, range(4), range(4))), STORE, waker)
    waker.until(lambda: len(store) == 4)  # never polled: the workers did it


def test_the_queue_bound_rejects_and_nothing_escapes(store, make_backend):
    backend, driver, gate = blocked_backend(store, make_backend, max_in_flight=2, workers=1)
    src = Slab.make(3, 64, seed=3)
    backend.register_regions([src.region])
    waker = Waker()
    first = backend.publish(view(group(src, [0], [0])), STORE, waker)
    second = backend.publish(view(group(src, [1], [1])), STORE, waker)
    assert driver.wait_blocked(1)
    first.cancel()  # concluded, but still inside the store: it still takes a place
    with pytest.raises(SubmissionRejected, match="queue is full"):
        backend.publish(view(group(src, [2], [2])), STORE, waker)
    gate.release.set()
    waker.until(lambda: first.quiesced() and second.quiesced())
    rejected_key = store_keys("default", 0, names([2]))[0]
    assert rejected_key not in store
    assert driver.calls["put"] == 2  # the rejected publish never reached the store
    third = backend.publish(view(group(src, [2], [2])), STORE, waker)
    assert settle(third, waker).is_delivered
    assert rejected_key in store


def test_cancel_concludes_at_once_and_quiesces_when_the_store_call_returns(store, make_backend):
    backend, driver, gate = blocked_backend(store, make_backend, workers=1)
    src = Slab.make(2, 64, seed=4)
    backend.register_regions([src.region])
    waker = Waker()
    running = backend.publish(view(group(src, [0], [0])), STORE, waker)
    queued = backend.publish(view(group(src, [1], [1])), STORE, waker)
    assert driver.wait_blocked(1)
    running.cancel()
    queued.cancel()
    outcome = running.poll()
    assert outcome is not None and outcome.status is OutcomeStatus.CANCELLED
    assert not running.quiesced()  # a worker is still inside the store for it
    assert queued.poll().is_cancelled and queued.quiesced()  # never started
    running.cancel()
    assert running.poll() is outcome  # idempotent
    gate.release.set()
    waker.until(running.quiesced)
    assert running.poll() is outcome and not outcome.masks[0].any()
    assert store_keys("default", 0, names([1]))[0] not in store  # the cancelled queued row never escaped


def test_cancel_after_conclusion_changes_nothing(store, make_backend):
    backend = make_backend(MemoryDriver(store))
    src = Slab.make(1, 64, seed=5)
    backend.register_regions([src.region])
    waker = Waker()
    attempt = backend.publish(view(group(src, [0], [0])), STORE, waker)
    outcome = settle(attempt, waker)
    attempt.cancel()
    assert attempt.poll() is outcome and outcome.is_delivered


@pytest.mark.parametrize("where", ["hint", "option"])
def test_the_deadline_fires_while_a_worker_is_stuck_in_the_store(store, make_backend, where):
    options = {"timeout_s": 0.2} if where == "option" else {}
    backend, driver, gate = blocked_backend(store, make_backend, op="get", **options)
    dst = Slab.make(2, 64)
    backend.register_regions([dst.region])
    hint = Hint.of("store", timeout_s=0.2) if where == "hint" else STORE
    waker = Waker()
    started = time.monotonic()
    attempt = backend.fetch(view(group(dst, range(2), range(2))), hint, waker)
    waker.until(lambda: attempt.poll() is not None)
    elapsed = time.monotonic() - started
    outcome = attempt.poll()
    assert outcome.status is OutcomeStatus.FAILED and "deadline" in outcome.reason
    assert 0.15 <= elapsed < 3.0
    assert driver.blocked == 1 and not attempt.quiesced()  # the grace: the store call is still running
    gate.release.set()
    waker.until(attempt.quiesced)
    assert attempt.poll() is outcome


def test_a_short_deadline_fires_on_time_after_attempts_with_long_deadlines(store, make_backend):
    # The deadline thread sleeps towards the nearest deadline it knows of, and attempts that
    # conclude early do not wake it. An attempt with an earlier deadline, submitted after a
    # long-deadline attempt concluded and while another is stuck in the store, still fails on time.
    backend, driver, gate = blocked_backend(store, make_backend, op="get", call=None, timeout_s=60.0, workers=2)
    src, dst = Slab.make(2, 64, seed=3), Slab.make(2, 64)
    backend.register_regions([src.region, dst.region])
    waker = Waker()
    assert settle(backend.publish(view(group(src, [0, 1], [0, 1])), STORE, waker), waker).is_delivered
    stuck_waker = Waker()
    stuck = backend.fetch(view(group(dst, [0], [0])), STORE, stuck_waker)
    assert driver.wait_blocked(1)
    short_waker = Waker()
    started = time.monotonic()
    short = backend.fetch(view(group(dst, [1], [1])), Hint.of("store", timeout_s=0.2), short_waker)
    short_waker.until(lambda: short.poll() is not None)
    elapsed = time.monotonic() - started
    assert short.poll().status is OutcomeStatus.FAILED and "deadline" in short.poll().reason
    assert 0.15 <= elapsed < 3.0
    assert stuck.poll() is None  # its own deadline is a minute away
    gate.release.set()
    assert settle(stuck, stuck_waker).is_delivered
    assert settle(short, short_waker).is_failed


def test_wake_comes_only_after_the_change_is_visible(store, make_backend):
    backend, driver, gate = blocked_backend(store, make_backend, op="put", call=1)
    src = Slab.make(2, 64, seed=6)
    backend.register_regions([src.region])
    box: list = []
    waker = Waker(probe=lambda: (box[0].poll() is not None, box[0].quiesced()))
    box.append(backend.publish(view(group(src, range(2), range(2))), STORE, waker))
    gate.release.set()
    settle(box[0], waker)
    assert waker.seen and all(concluded for concluded, _ in waker.seen)
    assert waker.seen[-1] == (True, True)


def test_wake_sees_conclusion_then_quiescence_after_a_deadline(store, make_backend):
    backend, driver, gate = blocked_backend(store, make_backend, op="get", call=1)
    dst = Slab.make(1, 64)
    backend.register_regions([dst.region])
    box: list = []
    waker = Waker(probe=lambda: (box[0].poll() is not None, box[0].quiesced()))
    box.append(backend.fetch(view(group(dst, [0], [0])), Hint.of("store", timeout_s=0.1), waker))
    waker.until(lambda: waker.calls >= 1)
    assert waker.seen == [(True, False)]
    gate.release.set()
    waker.until(lambda: waker.calls >= 2)
    assert waker.seen[-1] == (True, True)


def test_shutdown_cancels_returns_the_stuck_attempts_then_empty_and_joins_threads(store, make_backend):
    before = set(threading.enumerate())
    backend, driver, gate = blocked_backend(store, make_backend, workers=2)
    mine = new_threads(before)
    assert len(mine) == 3  # two workers and the deadline thread
    src = Slab.make(3, 64, seed=7)
    backend.register_regions([src.region])
    waker = Waker()
    attempts = [backend.publish(view(group(src, [i], [i])), STORE, waker) for i in range(3)]
    assert driver.wait_blocked(2)
    pending = backend.shutdown()
    assert len(pending) == 2 and pending < set(attempts)
    assert all(a.poll().is_cancelled for a in attempts)
    assert backend.shutdown() == pending  # idempotent while stuck
    with pytest.raises(SubmissionRejected, match="shut down"):
        backend.publish(view(group(src, [0], [0])), STORE, waker)
    assert all(t.is_alive() for t in mine)
    gate.release.set()
    waker.until(lambda: all(a.quiesced() for a in attempts))
    assert backend.shutdown() == frozenset()
    assert not any(t.is_alive() for t in mine)
    assert backend.shutdown() == frozenset()


def test_close_leaves_no_threads_and_no_registrations(store, make_backend):
    before = set(threading.enumerate())
    driver = MemoryDriver(store)
    backend = BlobBackend(driver, owns_driver=True)
    mine = new_threads(before)
    a, b = Slab.make(2, 64, seed=8), Slab.make(2, 64)
    first = backend.register_regions([a.region])
    backend.register_regions([b.region])
    assert driver.registered_bytes == 256
    waker = Waker()
    settle(backend.publish(view(group(a, range(2), range(2))), STORE, waker), waker)
    backend.close()
    assert driver.registered_bytes == 0
    assert first.closed
    assert not any(t.is_alive() for t in mine)
    # The backend owned the driver, so the driver is closed; the store keeps its objects.
    assert driver.remove(store.keys()).where(KeyStatus.FAILED).all()
    assert len(store) == 2
    backend.close()  # idempotent


def test_close_times_out_while_the_store_is_stuck_and_keeps_the_driver(store, make_backend):
    backend, driver, gate = blocked_backend(store, make_backend, owns_driver=True)
    src = Slab.make(1, 64, seed=9)
    registration = backend.register_regions([src.region])
    attempt = backend.publish(view(group(src, [0], [0])), STORE, Waker())
    assert driver.wait_blocked(1)
    with pytest.raises(TimeoutError, match="still inside the store driver"):
        backend.close(timeout_s=0.05)
    assert not registration.closed
    gate.release.set()
    backend.close()
    assert registration.closed and attempt.quiesced()


def test_a_backend_dropped_without_shutdown_stops_its_threads(store):
    before = set(threading.enumerate())
    backend = BlobBackend(MemoryDriver(store))
    mine = new_threads(before)
    del backend
    gc.collect()
    for thread in mine:
        thread.join(timeout=5.0)
        assert not thread.is_alive()


def test_a_wake_that_raises_does_not_stop_the_workers(store, make_backend):
    backend = make_backend(MemoryDriver(store), workers=1)
    src = Slab.make(2, 64, seed=10)
    backend.register_regions([src.region])

    def broken() -> None:
        raise RuntimeError("holder bug")

    first = backend.publish(view(group(src, [0], [0])), STORE, broken)
    waker = Waker()
    second = backend.publish(view(group(src, [1], [1])), STORE, waker)
    assert settle(second, waker).is_delivered
    assert first.poll().is_delivered and first.quiesced()


def test_cancel_wakes_from_a_backend_thread_never_inside_the_call(store, make_backend):
    backend, driver, gate = blocked_backend(store, make_backend, workers=1)
    src = Slab.make(1, 64, seed=11)
    backend.register_regions([src.region])
    caller = threading.current_thread()
    waker = Waker(probe=threading.current_thread)
    attempt = backend.publish(view(group(src, [0], [0])), STORE, waker)
    assert driver.wait_blocked(1)
    attempt.cancel()
    waker.until(lambda: waker.calls >= 1)
    assert caller not in waker.seen
    gate.release.set()
    waker.until(attempt.quiesced)


def test_chunks_go_in_order_to_the_worker_that_went_idle_last():
    from kvwire.blob.backend import _Dispatch

    dispatch = _Dispatch()
    got: dict[str, list] = {"first": [], "second": []}

    def worker(name: str) -> None:
        parking = threading.Lock()
        parking.acquire()
        while (item := dispatch.get(parking)) is not None:
            got[name].append(item)

    def until(condition) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 5.0
        while not condition():
            assert time.monotonic() < deadline, "condition not reached in time"
            time.sleep(0.001)

    def idle() -> int:
        with dispatch._lock:
            return len(dispatch._idle)

    first = threading.Thread(target=worker, args=("first",))
    first.start()
    until(lambda: idle() == 1)
    second = threading.Thread(target=worker, args=("second",))
    second.start()
    until(lambda: idle() == 2)
    for i in range(3):  # one at a time: each goes to the worker parked last, which parks again
        dispatch.put(("chunk", i, i + 1))  # type: ignore[arg-type]
        until(lambda i=i: len(got["second"]) == i + 1 and idle() == 2)
    assert got == {"first": [], "second": [("chunk", 0, 1), ("chunk", 1, 2), ("chunk", 2, 3)]}
    for i in range(3, 6):  # queued back to back: each runs exactly once, on one worker or the other
        dispatch.put(("chunk", i, i + 1))  # type: ignore[arg-type]
    until(lambda: len(got["first"]) + len(got["second"]) == 6)
    assert sorted(got["first"] + got["second"][3:]) == [("chunk", i, i + 1) for i in range(3, 6)]
    dispatch.put(None)
    dispatch.put(None)
    first.join(5)
    second.join(5)
    assert not first.is_alive() and not second.is_alive()
