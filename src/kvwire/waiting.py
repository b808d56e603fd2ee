"""Waits of any length on threading primitives.

A deadline may be any finite number of seconds (contract A8, H1.6), but Python refuses a single
wait on a lock, condition or event beyond ``threading.TIMEOUT_MAX`` (about 9.2e9 s, 292 years, on
Linux) with ``OverflowError``. A thread that keeps deadlines and meets that error dies, and keeps none
afterwards. So every wait on a caller's deadline waits in pieces of at most
:data:`LONGEST_WAIT_S`, looking at the clock again after each."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["LONGEST_WAIT_S", "join", "piece", "wait_event", "wait_for"]

#: The longest single wait handed to a threading primitive.
LONGEST_WAIT_S = 3600.0


def piece(seconds: float | None) -> float | None:
    """``seconds`` cut to at most :data:`LONGEST_WAIT_S`; ``None`` (wait until notified) stays."""
    return None if seconds is None else min(seconds, LONGEST_WAIT_S)


def wait_for(cond: threading.Condition, predicate: Callable[[], object], timeout_s: float | None) -> bool:
    """``cond.wait_for(predicate, timeout_s)`` for a timeout of any length (``cond`` held)."""
    if timeout_s is None:
        return bool(cond.wait_for(predicate))
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if cond.wait_for(predicate, timeout=max(0.0, min(left, LONGEST_WAIT_S))):
            return True
        if left <= LONGEST_WAIT_S:
            return bool(predicate())


def wait_event(event: threading.Event, timeout_s: float) -> bool:
    """``event.wait(timeout_s)`` for a timeout of any length."""
    deadline = time.monotonic() + timeout_s
    while not event.wait(piece(max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            return event.is_set()
    return True


def join(thread: threading.Thread, timeout_s: float) -> bool:
    """``thread.join(timeout_s)`` for a timeout of any length; whether the thread has ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        thread.join(piece(max(0.0, deadline - time.monotonic())))
        if not thread.is_alive():
            return True
        if time.monotonic() >= deadline:
            return False
