"""What the holder holds of a transfer: :class:`UcxAttempt`, and the backend's counters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvwire.contract import Attempt, Outcome, View
from kvwire.contract.backend import WakeFn

if TYPE_CHECKING:
    from kvwire_ucx.engine import Engine

__all__ = ["UcxAttempt", "AttemptKind", "WireStats"]


class AttemptKind(enum.Enum):
    FETCH = "fetch"
    PUBLISH = "publish"


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


class UcxAttempt(Attempt):
    """A fetch or publish in flight. Its outcome and quiescence change only through its engine,
    under the engine's lock, each once (the holder's :meth:`cancel` concludes it there too)."""

    def __init__(self, engine: Engine, view: View, kind: AttemptKind, wake: WakeFn,
                 masks: tuple[np.ndarray, ...] | None = None) -> None:
        self._engine = engine
        self.view = view
        self.kind = kind
        self._wake = wake
        #: the delivery masks the protocol marks (a fetch's); a cancel copies them
        self._masks = view.row_masks() if masks is None else masks
        self._outcome: Outcome | None = None
        self._quiesced = False
        self._cancel_requested = False  # the holder's cancel concluded it; the protocol is told
        self._job: Any = None
        self._times = {"submitted": time.perf_counter()}

    def poll(self) -> Outcome | None:
        return self._outcome

    def quiesced(self) -> bool:
        return self._quiesced

    def timeline(self) -> dict[str, float]:
        """Seconds from the submission to each step the attempt reached so far, in order:
        ``asked`` (a fetch's request went out), ``answered`` (a fetch heard the serving end's
        answer; a publish sent it), ``concluded`` and ``quiesced``. For finding where a pull's
        time goes: the request-answer round trip versus moving the rows."""
        times = dict(self._times)
        start = times.pop("submitted")
        return {step: at - start for step, at in sorted(times.items(), key=lambda item: item[1])}

    def _reached(self, step: str) -> None:
        self._times.setdefault(step, time.perf_counter())

    def cancel(self) -> None:
        self._engine.cancel(self)

    def __repr__(self) -> str:
        state = "quiesced" if self._quiesced else "touching memory"
        return f"UcxAttempt({self.kind.value}, {self._outcome!r}, {state})"
