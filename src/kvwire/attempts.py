"""The one attempt lifecycle for the backends kvwire ships: :class:`AttemptTable`.

Beside :class:`~kvwire.contract.RegionTable` (M3, M4), this is the other mechanism every backend
needs and none should write again. It keeps these rules of ``docs/contract.md``:

- **Admission (S3.9-S3.11).** An attempt takes a slot when it is admitted and holds it until it
  has both concluded and quiesced; a submission while ``max_in_flight`` hold one is refused with
  ``SubmissionRejected``. A freed slot is free whether or not the holder looked.
- **Once (A1.3, A1.4, A2.2).** An attempt concludes once and quiesces once: a later conclusion
  is refused (the first outcome stays), and quiescence never goes back.
- **Wakes after the lock (W1.1, W1.6, W1.7).** The table only says whether a change happened; the
  wakes it owes are collected in :class:`OwedWakes` and called by the backend's own thread once the
  lock is released, never inside a holder's call, each exception logged. Wakes owed together are
  called once per distinct wake callable (the note under W1.8): one call reports every change of
  every attempt that shares that wake.
- **The deadline clock (A8.1).** :func:`deadline_after` reads one monotonic clock when the
  submission is made; :meth:`AttemptTable.overdue_locked` finds the attempts whose deadline passed.
- **Waits of any length.** :meth:`AttemptTable.wait_idle` and :meth:`AttemptTable.wait_quiesced`
  wait through :mod:`kvwire.waiting`, so a grace or a timeout of any finite length never raises
  ``OverflowError``.

The reference backends in :mod:`kvwire.testing.reference` do not use this table, on purpose: they
are the second, independent implementation the conformance suite is checked against.

Thread-safe: every change happens under :attr:`AttemptTable.lock`, which a backend may share with
its own state (its ``*_locked`` methods are for callers that already hold it)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from kvwire import waiting
from kvwire.contract.backend import Attempt, WakeFn
from kvwire.contract.errors import SubmissionRejected
from kvwire.contract.outcome import Outcome

__all__ = ["AttemptTable", "TableAttempt", "OwedWakes", "call_wakes", "deadline_after", "clock"]

log = logging.getLogger(__name__)

#: The clock every deadline is read on: monotonic seconds.
clock: Callable[[], float] = time.monotonic


def deadline_after(timeout_s: float) -> float:
    """The :data:`clock` reading ``timeout_s`` seconds from now (A8.1: from the submission call)."""
    return clock() + timeout_s


class TableAttempt(Attempt):
    """An attempt whose outcome and quiescence only the :class:`AttemptTable` that admitted it
    sets, each once, under the table's lock; :meth:`poll` and :meth:`quiesced` read them without
    blocking (A1.1, A2.1). ``wake`` is the holder's; ``deadline`` a :data:`clock` reading."""

    def __init__(self, wake: WakeFn, deadline: float = math.inf) -> None:
        self.wake = wake
        self.deadline = deadline
        self._outcome: Outcome | None = None
        self._quiesced = False

    def poll(self) -> Outcome | None:
        return self._outcome

    def quiesced(self) -> bool:
        return self._quiesced


A = TypeVar("A", bound=TableAttempt)


class AttemptTable(Generic[A]):
    """The attempts of one backend instance that have not both concluded and quiesced (B1.5:
    never shared between instances). ``name`` is how a refusal names the backend."""

    def __init__(self, max_in_flight: int, *, lock: threading.Lock | None = None, name: str = "this backend") -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        #: Guards every attempt's outcome and quiescence and the table itself.
        self.lock = lock if lock is not None else threading.Lock()
        self._changed = threading.Condition(self.lock)
        self._live: dict[A, None] = {}  # an ordered set
        self._waiters = 0  # threads in wait_*: a slot freed only notifies when someone waits
        self._name = name

    # -- reading ---------------------------------------------------------------------------

    def __len__(self) -> int:
        with self.lock:
            return len(self._live)

    def live_locked(self) -> list[A]:
        """The attempts in flight now, in admission order (the lock held)."""
        return list(self._live)

    def not_quiesced(self) -> frozenset[Attempt]:
        """The attempts in flight that have not quiesced (B3.3)."""
        with self.lock:
            return frozenset(a for a in self._live if not a._quiesced)

    # -- changes ---------------------------------------------------------------------------

    def admit_locked(self, attempt: A) -> None:
        """Give ``attempt`` a slot, or raise ``SubmissionRejected`` when every slot is held (S3.9)."""
        if len(self._live) >= self.max_in_flight:
            raise SubmissionRejected(
                f"{self._name}'s queue is full ({self.max_in_flight} attempts in flight, its max_in_flight); retry "
                "once one has concluded and quiesced")
        self._live[attempt] = None

    def admit(self, attempt: A) -> None:
        with self.lock:
            self.admit_locked(attempt)

    def conclude_locked(self, attempt: A, outcome: Outcome) -> bool:
        """Conclude ``attempt`` with ``outcome`` unless it has concluded; whether it did now."""
        if attempt._outcome is not None:
            return False
        attempt._outcome = outcome
        if attempt._quiesced:
            self._retire_locked(attempt)
        return True

    def conclude(self, attempt: A, outcome: Outcome) -> bool:
        with self.lock:
            return self.conclude_locked(attempt, outcome)

    def quiesce_locked(self, attempt: A) -> bool:
        """Mark ``attempt`` quiesced unless it is; whether it was now."""
        if attempt._quiesced:
            return False
        attempt._quiesced = True
        if attempt._outcome is not None:
            self._retire_locked(attempt)
        elif self._waiters:  # a wait_quiesced() waits for this, not for the slot
            self._changed.notify_all()
        return True

    def quiesce(self, attempt: A) -> bool:
        with self.lock:
            return self.quiesce_locked(attempt)

    def settle_locked(self, attempt: A, outcome: Outcome) -> bool:
        """Conclude ``attempt`` with ``outcome`` and quiesce it in one step (its access to memory
        has ended), unless it has concluded; whether it did now. For an attempt never admitted
        (it needed no thread of the backend) too: it takes no slot."""
        if attempt._outcome is not None:
            return False
        attempt._outcome = outcome
        attempt._quiesced = True
        self._retire_locked(attempt)
        return True

    def settle(self, attempt: A, outcome: Outcome) -> bool:
        with self.lock:
            return self.settle_locked(attempt, outcome)

    def _retire_locked(self, attempt: A) -> None:
        self._live.pop(attempt, None)
        if self._waiters:
            self._changed.notify_all()

    def overdue_locked(self, now: float) -> tuple[list[A], float]:
        """The attempts in flight, not concluded, whose deadline is ``now`` or earlier; and the
        nearest deadline of the others not concluded (``math.inf`` if none)."""
        overdue = []
        nearest = math.inf
        for attempt in self._live:
            if attempt._outcome is None:
                if attempt.deadline <= now:
                    overdue.append(attempt)
                elif attempt.deadline < nearest:
                    nearest = attempt.deadline
        return overdue, nearest

    # -- waiting ---------------------------------------------------------------------------

    def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until no attempt is in flight; whether that happened within ``timeout_s`` (any
        finite length, or ``None``: until it happens)."""
        return self._wait(lambda: not self._live, timeout_s)

    def wait_quiesced(self, attempts: Iterable[Attempt], timeout_s: float | None) -> bool:
        """Wait until every one of ``attempts`` has quiesced; whether that happened in time."""
        chosen = tuple(attempts)
        return self._wait(lambda: all(a.quiesced() for a in chosen), timeout_s)

    def _wait(self, done: Callable[[], bool], timeout_s: float | None) -> bool:
        with self._changed:
            self._waiters += 1
            try:
                return waiting.wait_for(self._changed, done, None if timeout_s is None else max(0.0, timeout_s))
            finally:
                self._waiters -= 1

    def notify(self) -> None:
        """Wake every waiter to look again (the backend's threads are gone: nothing will change)."""
        with self.lock:
            self.notify_locked()

    def notify_locked(self) -> None:
        """:meth:`notify` for a caller that holds the lock."""
        self._changed.notify_all()


class OwedWakes:
    """OwedWakes owed and not yet called, one per distinct wake callable (the W1.8 note). The
    backend adds them under its lock and calls :meth:`take`'s answer with :func:`call_wakes`
    after releasing it (W1.1, W1.6)."""

    __slots__ = ("_due",)

    def __init__(self) -> None:
        self._due: dict[int, WakeFn] = {}  # by identity (equal is not enough); the value keeps the id taken

    def add(self, wake: WakeFn) -> bool:
        """Owe ``wake`` a call; whether none was owed before (then the caller signals its thread)."""
        first = not self._due
        self._due[id(wake)] = wake
        return first

    def __bool__(self) -> bool:
        return bool(self._due)

    def take(self) -> list[WakeFn]:
        """The wakes owed, each once; none is owed afterwards."""
        due = list(self._due.values())
        self._due.clear()
        return due


def call_wakes(wakes: Iterable[WakeFn]) -> None:
    """Call each of ``wakes`` (with no lock held: W1.6); one that raises is logged and the rest
    are still called (W1.7)."""
    for wake in wakes:
        try:
            wake()
        except Exception:  # a holder's wake must never stop the backend
            log.exception("a wake callback %r raised; ignored", wake)
