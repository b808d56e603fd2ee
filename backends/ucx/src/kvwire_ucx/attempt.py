"""What the holder holds of a transfer (:class:`UcxAttempt`), the set of those in flight and the
one lock under which each concludes and quiesces (:class:`LiveAttempts`), and the backend's
counters (:class:`WireStats`)."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvwire.contract import Attempt, Outcome, SubmissionRejected, View
from kvwire.contract.backend import WakeFn

__all__ = ["UcxAttempt", "AttemptKind", "LiveAttempts", "WireStats"]


class AttemptKind(enum.Enum):
    FETCH = "fetch"
    PUBLISH = "publish"
    OFFER = "offer"  #: a standing offer (O1)


@dataclass(frozen=True, slots=True)
class WireStats:
    """Counters of one backend's control channel."""

    connections_opened: int = 0
    connections_lost: int = 0
    connections_dropped: int = 0  #: dropped because the peer sent garbage or broke the protocol
    pulls_received: int = 0
    pulls_declined: int = 0
    rows_sent: int = 0
    rows_received: int = 0
    rows_read: int = 0  #: of rows_received, those read one-sided (NIXL READ)
    pulls_offered: int = 0  #: of pulls_received, those answered from a standing offer (O1)


class UcxAttempt(Attempt):
    """A fetch or publish in flight. Its outcome and quiescence change only through the
    :class:`LiveAttempts` that admitted it, under the engine's lock, each once (the holder's
    :meth:`cancel` concludes it there too)."""

    def __init__(self, cancel: Callable[[UcxAttempt], None], view: View, kind: AttemptKind, wake: WakeFn,
                 masks: tuple[np.ndarray, ...] | None = None) -> None:
        self._cancel = cancel
        self.view = view
        self.kind = kind
        self.wake = wake
        #: the delivery masks the protocol marks (a fetch's); a cancel copies them
        self.masks = view.row_masks() if masks is None else masks
        self._outcome: Outcome | None = None
        self._quiesced = False
        self._cancel_requested = False
        #: the engine's record of this pull (:mod:`kvwire_ucx.jobs`) once the progress thread took
        #: it up: its ``machine`` tells the protocol's history (for tests and debugging)
        self.job: Any = None
        self._times = {"submitted": time.perf_counter()}

    def poll(self) -> Outcome | None:
        return self._outcome

    def quiesced(self) -> bool:
        return self._quiesced

    @property
    def cancel_requested(self) -> bool:
        """Whether the holder's cancel concluded it (the protocol is told on the thread)."""
        return self._cancel_requested

    def timeline(self) -> dict[str, float]:
        """Seconds from the submission to each step the attempt reached so far, in order:
        ``asked`` (a fetch's request went out), ``answered`` (a fetch heard the serving end's
        answer; a publish sent it), ``concluded`` and ``quiesced``. For finding where a pull's
        time goes: the request-answer round trip versus moving the rows."""
        times = dict(self._times)
        start = times.pop("submitted")
        return {step: at - start for step, at in sorted(times.items(), key=lambda item: item[1])}

    @property
    def submitted_at(self) -> float:
        """The ``time.perf_counter()`` reading :meth:`timeline` counts from: when the backend
        made this attempt, after the submission's checks."""
        return self._times["submitted"]

    def reached(self, step: str) -> None:
        """Note the first time the attempt reached ``step`` (see :meth:`timeline`)."""
        self._times.setdefault(step, time.perf_counter())

    def cancel(self) -> None:
        self._cancel(self)

    def __repr__(self) -> str:
        state = "quiesced" if self._quiesced else "touching memory"
        return f"UcxAttempt({self.kind.value}, {self._outcome!r}, {state})"


class LiveAttempts:
    """The attempts of one engine that have not both concluded and quiesced, and the lock under
    which an attempt's outcome and quiescence are set, each once. Holder threads and the progress
    thread meet here; the wakes these changes owe are the caller's to send, after the lock."""

    def __init__(self, lock: threading.Lock, max_in_flight: int) -> None:
        self._lock = lock
        self.changed = threading.Condition(lock)
        self._live: set[UcxAttempt] = set()
        self._max = max_in_flight

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def admit(self, attempt: UcxAttempt) -> None:
        with self._lock:
            if len(self._live) >= self._max:
                raise SubmissionRejected(f"kvwire-ucx has {self._max} attempts in flight (max_in_flight); retry later")
            self._live.add(attempt)

    def settled(self, attempt: UcxAttempt, outcome: Outcome) -> None:
        """``attempt`` concluded with ``outcome`` and quiesced, from the start (it never needs the
        thread, and was never admitted)."""
        with self._lock:
            attempt._outcome = outcome
            attempt._quiesced = True
            attempt.reached("concluded")
            attempt.reached("quiesced")

    def conclude(self, attempt: UcxAttempt, outcome: Outcome, *, by_holder: bool = False) -> bool:
        """Conclude ``attempt`` with ``outcome`` unless it concluded already; whether it did now.
        ``by_holder``: the holder's cancel, which its machine hears of later."""
        with self._lock:
            if attempt._outcome is not None:
                return False
            attempt._outcome = outcome
            attempt._cancel_requested = by_holder
            attempt.reached("concluded")
            if attempt._quiesced:
                self._retire(attempt)
            return True

    def quiesce(self, attempt: UcxAttempt) -> bool:
        """Mark ``attempt`` quiesced unless it was already; whether it was now."""
        with self._lock:
            if attempt._quiesced:
                return False
            attempt._quiesced = True
            attempt.reached("quiesced")
            if attempt._outcome is not None:
                self._retire(attempt)
            return True

    def _retire(self, attempt: UcxAttempt) -> None:  # under the lock
        self._live.discard(attempt)
        self.changed.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no attempt is in flight; whether that happened within ``timeout``."""
        with self.changed:
            return self.changed.wait_for(lambda: not self._live, timeout)

    def not_quiesced(self) -> frozenset[Attempt]:
        with self._lock:
            return frozenset(a for a in self._live if not a._quiesced)

    def notify(self) -> None:
        """Wake every waiter (the thread is gone: nothing will change any more)."""
        with self._lock:
            self.changed.notify_all()
