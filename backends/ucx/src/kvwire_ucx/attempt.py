"""What the holder holds of a transfer (:class:`UcxAttempt`) and the backend's counters
(:class:`WireStats`). The attempts in flight, and the lock under which each concludes and
quiesces, are kvwire's one :class:`~kvwire.attempts.AttemptTable` (the engine's)."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvwire.attempts import TableAttempt
from kvwire.contract import View
from kvwire.contract.backend import WakeFn

__all__ = ["UcxAttempt", "AttemptKind", "WireStats"]


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
    #: fetches of this end answered from an offer the serving end pushed (no Pull frame went out)
    pulls_pushed: int = 0
    offers_pushed: int = 0  #: standing offers this end pushed, one per connection it pushed to
    pushes_received: int = 0  #: offers serving ends pushed to this end


class UcxAttempt(TableAttempt):
    """A fetch, publish or offer in flight. Its outcome and quiescence change only through the
    engine's :class:`~kvwire.attempts.AttemptTable`, under the engine's lock, each once (the
    holder's :meth:`cancel` concludes it there too). ``deadline`` is read on
    :data:`kvwire.attempts.clock`."""

    def __init__(self, cancel: Callable[[UcxAttempt], None], view: View, kind: AttemptKind, wake: WakeFn,
                 masks: tuple[np.ndarray, ...] | None = None, deadline: float = math.inf) -> None:
        super().__init__(wake, deadline)
        self._cancel = cancel
        self.view = view
        self.kind = kind
        #: the delivery masks the protocol marks (a fetch's); a cancel copies them
        self.masks = view.row_masks() if masks is None else masks
        self._cancel_requested = False
        #: the engine's record of this pull (:mod:`kvwire_ucx.jobs`) once the progress thread took
        #: it up: its ``machine`` tells the protocol's history (for tests and debugging)
        self.job: Any = None
        self._times = {"submitted": time.perf_counter()}

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
