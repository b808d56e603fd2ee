"""The worker core's idle doze (``kvwire_vllm.holder.doze``): an idle step sleeps on the backend's
wake, and a device copy that ends sends no wake. With an attempt in flight and a chunk's gather
queued on the device, the doze must end when the copy completes, not sleep to its limit while the
chunk's publish waits for it."""

from __future__ import annotations

import threading
import time

import numpy as np
from kvwire_vllm.holder import Move, doze

from kvwire.holding import Direction, Submission, Wakes


class StuckAttempt:
    """An attempt that never concludes and whose backend never wakes (a slow store)."""

    def poll(self) -> None:
        return None

    def quiesced(self) -> bool:
        return False

    def cancel(self) -> None:
        pass


class CopyEvent:
    """A device copy's event, done from its ``done_after``-th query on (no clock involved)."""

    def __init__(self, done_after: int) -> None:
        self.queries = 0
        self.done_after = done_after
        self.synchronized = False

    def query(self) -> bool:
        self.queries += 1
        return self.queries >= self.done_after

    def synchronize(self) -> None:
        self.synchronized = True


class Pending(Move):
    def __init__(self, subs: list[Submission], events: list[CopyEvent]) -> None:
        self._subs, self._events = subs, events

    def whole(self) -> np.ndarray:
        return np.zeros(0, dtype=bool)

    def submissions(self) -> list[Submission]:
        return self._subs

    def events(self) -> list[CopyEvent]:  # type: ignore[override]
        return self._events

    def cancel(self) -> None:
        pass


def stuck_submission() -> Submission:
    return Submission(op=Direction.PUBLISH, backend=None, view=None, attempt=StuckAttempt(),  # type: ignore[arg-type]
                      wakes=Wakes())


def doze_in_thread(moves: list[Move], seconds: float) -> threading.Thread:
    thread = threading.Thread(target=doze, args=(moves, seconds), daemon=True)
    thread.start()
    return thread


def test_an_idle_doze_ends_when_a_queued_device_copy_completes_though_no_backend_wakes() -> None:
    copy = CopyEvent(done_after=3)
    thread = doze_in_thread([Pending([stuck_submission()], []), Pending([], [copy])], seconds=600)
    thread.join(timeout=30)
    assert not thread.is_alive(), "the doze slept on the backend's wake while the device copy had completed"
    assert copy.queries >= 3 and not copy.synchronized  # looked at, never a blocking wait beside attempts


def test_an_idle_doze_ends_when_the_backend_wakes_though_the_copy_is_still_queued() -> None:
    sub = stuck_submission()
    copy = CopyEvent(done_after=10**9)
    thread = doze_in_thread([Pending([sub], [copy])], seconds=600)
    deadline = time.monotonic() + 30
    while copy.queries < 2:  # the doze is under way, looking at the copy
        assert time.monotonic() < deadline, "the doze never looked at the queued device copy"
        thread.join(timeout=0.01)
        assert thread.is_alive(), "the doze ended before anything happened"
    sub.attempt = DoneAttempt()
    sub.wakes()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the doze did not end on the backend's wake"


class DoneAttempt(StuckAttempt):
    def poll(self) -> object:  # type: ignore[override]
        return object()

    def quiesced(self) -> bool:
        return True
