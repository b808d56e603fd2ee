"""The serving side of one pull, as a state machine without I/O: events in, actions out.

States (:class:`ServerState`)::

    WAITING ──Answered──▶ SENDING ──every offered row sent──▶ AWAITING_ACK ──Ack──▶ DONE
       │          └──(one-sided)──▶ OFFERED_READS ──Ack or Cancel──▶ DONE
       │          └──refused, nothing held, withdrawn, declined──▶ DONE
       └──Cancel, deadline, connection lost, shutdown──▶ GONE ──the answer still comes──▶ DONE
    SENDING/AWAITING_ACK/OFFERED_READS ──deadline, cancel, shutdown, a send failed──▶ STOPPING
    STOPPING ──quiesced──▶ STOPPED ──the requester's Ack or Cancel──▶ DONE
    SENDING/STOPPING ──Ack, Cancel, connection lost──▶ DRAINING (sends still completing) ──▶ DONE

``WAITING``, ``SENDING``, ``AWAITING_ACK`` and ``OFFERED_READS`` have not concluded; ``STOPPING``,
``STOPPED``, ``DRAINING`` and ``DONE`` have, and in ``STOPPING``/``STOPPED`` the requester was
told to stop (a ``Decline`` after the offer) and may still name rows it posted receives for, which
are honoured. ``AWAITING_ACK``, ``STOPPED`` and ``DONE`` are quiesced. ``GONE`` has no attempt
yet: the holder's answer, when it comes, concludes at once. The table :data:`TRANSITIONS` is the
whole machine: an event with no entry for the current state raises :class:`ProtocolError`."""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvwire.contract import Cause, Outcome
from kvwire_ucx import wire
from kvwire_ucx.protocol.events import (
    AckReceived,
    Action,
    Answered,
    AnswerUnclaimed,
    AnswerWithdrawn,
    ArmDeadline,
    ArmGrace,
    CancelReceived,
    CloseConnection,
    Conclude,
    ConnectionLost,
    Count,
    DeadlinePassed,
    GoReceived,
    GraceExpired,
    HolderCancelled,
    HolderDeclined,
    Note,
    ProtocolError,
    Quiesce,
    Send,
    SendFailed,
    SendReadOffer,
    SendRows,
    SendsCompleted,
    Shutdown,
    Violation,
    offered_limit,
    rows_between,
)

__all__ = ["ServerState", "PullServer", "ReplySpec", "TRANSITIONS"]


class ServerState(enum.Enum):
    WAITING = "waiting"              #: the pull is its holder's to answer
    GONE = "gone"                    #: the pull ended before the answer; an answer concludes at once
    SENDING = "sending"              #: Offer sent; the rows the credit and each Go name go out
    AWAITING_ACK = "awaiting-ack"    #: every offered row sent (quiesced); waiting for the Ack
    OFFERED_READS = "offered-reads"  #: ReadOffer sent; the requester reads until its Ack or Cancel
    STOPPING = "stopping"            #: concluded, the requester told to stop; sends or named rows pending
    STOPPED = "stopped"              #: concluded, told and quiesced; waiting for the requester's last word
    DRAINING = "draining"            #: concluded, the requester done; sends still completing
    DONE = "done"                    #: concluded and quiesced


S = ServerState


@dataclass(frozen=True, slots=True)
class ReplySpec:
    """What the pull asked, as the serving side needs it."""

    transfer: int
    credit: int
    groups: int
    blocks: int
    one_sided: bool = False
    peer: str = "the requester"
    offered: bool = False  #: answered from a standing offer (O1), not by the holder

    @property
    def rows(self) -> int:
        """Block-major numbers a Go may name: ``[0, rows)``."""
        return self.blocks * self.groups


_GONE_OUTCOMES: dict[Cause, tuple[str, Cause, bool]] = {
    Cause.PEER_GONE: ("the requester went away before the answer", Cause.PEER_GONE, False),
    Cause.PEER_CANCELLED: ("the requester cancelled the pull", Cause.PEER_CANCELLED, True),
    Cause.DEADLINE: ("the pull's deadline passed before the answer", Cause.DEADLINE, False),
    Cause.SHUTDOWN: ("the backend shut down", Cause.SHUTDOWN, True),
}


class PullServer:
    """One pull's serving side. :meth:`handle` takes an event and returns the actions."""

    def __init__(self, spec: ReplySpec) -> None:
        self.spec = spec
        self.state = S.WAITING
        self.view_rows: tuple[int, ...] = ()  # rows per group of the view that answered
        self.counts: tuple[int, ...] = ()     # rows offered per group
        self.total = 0
        self.limit = 0        # one past the last offered row's block-major number
        self.go_end = 0       # rows named so far (the credit, then each Go)
        self.outstanding = 0  # sends posted and not completed
        self.gone: Cause | None = None  # GONE: why the pull ended before the answer
        self._batch = 0       # sends the last SendRows asked for
        self.history: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=256)

    def handle(self, event: Any) -> list[Action]:
        entry = TRANSITIONS.get((self.state, type(event)))
        if entry is None:
            raise ProtocolError(f"reply to transfer {self.spec.transfer}: {type(event).__name__} cannot happen in "
                                f"state {self.state.name}")
        targets, step = entry
        before = self.state
        actions: list[Action] = []
        step(self, event, actions)
        if self.state not in targets:
            raise ProtocolError(f"reply to transfer {self.spec.transfer}: {type(event).__name__} in {before.name} "
                                f"led to {self.state.name}, not one of {sorted(t.name for t in targets)}")
        self.history.append((before.name, type(event).__name__, self.state.name))
        return actions

    def events(self) -> list[str]:
        return [event for _, event, _ in self.history]

    # ------------------------------------------------------------------ helpers

    def _none(self) -> tuple[np.ndarray, ...]:
        return tuple(np.zeros(r, dtype=bool) for r in self.view_rows)

    def _served(self) -> tuple[np.ndarray, ...]:
        return tuple(np.arange(r) < c for r, c in zip(self.view_rows, self.counts, strict=True))

    def _answer(self, out: list[Action], message: wire.Decline | wire.Offer) -> None:
        if isinstance(message, wire.Decline):
            out.append(Count("pulls_declined"))
        out.append(Send(message))

    def _decline(self, out: list[Action], reason: str) -> None:
        self._answer(out, wire.Decline(self.spec.transfer, wire.clip_reason(reason)))

    def _quiet(self) -> bool:
        """Nothing sent is in flight and nothing more can be named (two-sided)."""
        return self.outstanding == 0 and not self.spec.one_sided and self.go_end >= self.limit

    def _send(self, out: list[Action], start: int, end: int) -> None:
        rows = len(rows_between(start, min(end, self.limit), self.counts, self.spec.groups)) if start < self.limit else 0
        out.append(SendRows(start, end, self.counts))
        self.outstanding += rows
        self._batch = rows
        self.go_end = end

    def _stop(self, out: list[Action], outcome: Outcome, reason: str) -> None:
        """Conclude a live reply and tell the requester to stop; rows it named still go out."""
        out.append(Conclude(outcome))
        self._decline(out, reason)
        out.append(ArmGrace())
        quiesced = self.state is S.AWAITING_ACK
        if quiesced or self._quiet():
            if not quiesced:
                out.append(Quiesce())
            self.state = S.STOPPED
        else:
            self.state = S.STOPPING

    def _finish(self, out: list[Action]) -> None:
        """The requester is done with the pull: DONE once no send is in flight."""
        if self.outstanding:
            self.state = S.DRAINING
            return
        if self.state not in (S.AWAITING_ACK, S.STOPPED):
            out.append(Quiesce())
        self.state = S.DONE

    # ------------------------------------------------------------------ before the answer

    def _answered(self, event: Answered, out: list[Action]) -> None:
        spec = self.spec
        self.view_rows = tuple(event.rows)
        if event.refusal is not None:
            self._decline(out, event.refusal)
            out.append(Note("answered"))
            out.append(Conclude(Outcome.failed(event.refusal, self._none(), cause=Cause.DECLINED)))
            out.append(Quiesce())
            self.state = S.DONE
            return
        self.counts = tuple(event.counts)
        self.total = sum(self.counts)
        self.limit = offered_limit(self.counts)
        if spec.one_sided:
            out.append(SendReadOffer(self.counts))
        else:
            self._answer(out, wire.Offer(spec.transfer, self.counts, event.breaks))
        out.append(Note("answered"))
        if self.total == 0:  # nothing to send; the requester concludes on the answer alone
            out.append(Conclude(Outcome.delivered(self._served())))
            out.append(Quiesce())
            self.state = S.DONE
            return
        out.append(ArmDeadline())
        if spec.one_sided:
            self.state = S.OFFERED_READS
            return
        self._send(out, 0, spec.credit)
        self.state = S.SENDING
        if self._quiet():
            out.append(Quiesce())
            self.state = S.AWAITING_ACK

    def _answer_when_gone(self, event: Answered, out: list[Action]) -> None:
        self.view_rows = tuple(event.rows)
        assert self.gone is not None
        reason, cause, cancelled = _GONE_OUTCOMES[self.gone]
        outcome = (Outcome.cancelled(self._none(), by_peer=cause is Cause.PEER_CANCELLED, reason=reason, cause=cause)
                   if cancelled else Outcome.failed(reason, self._none(), cause=cause))
        out.append(Conclude(outcome))
        out.append(Quiesce())
        self.state = S.DONE

    def _withdrawn(self, event: AnswerWithdrawn, out: list[Action]) -> None:
        if self.state is S.WAITING:
            self._decline(out, "the serving end cancelled its answer")
            out.append(Note("answered"))
        out.append(Quiesce())
        self.state = S.DONE

    def _holder_declined(self, event: HolderDeclined, out: list[Action]) -> None:
        if self.state is S.WAITING:
            self._decline(out, event.reason)
        self.state = S.DONE

    def _expired(self, event: AnswerUnclaimed, out: list[Action]) -> None:
        self._decline(out, "the serving holder did not answer within the pull's deadline")
        self._go(out, Cause.DEADLINE)

    def _cancel_before_answer(self, event: CancelReceived, out: list[Action]) -> None:
        # said now, so the requester can end the receives it posted on credit
        self._decline(out, "the requester cancelled the pull")
        self._go(out, Cause.PEER_CANCELLED)

    def _lost_before_answer(self, event: ConnectionLost, out: list[Action]) -> None:
        self._go(out, Cause.PEER_GONE)

    def _shutdown_before_answer(self, event: Shutdown, out: list[Action]) -> None:
        self._decline(out, "not serving: the serving end is shutting down")
        self._go(out, Cause.SHUTDOWN)

    def _go(self, out: list[Action], cause: Cause) -> None:
        self.gone = cause
        self.state = S.GONE

    def _unasked_go(self, event: GoReceived, out: list[Action]) -> None:
        out.append(Violation(f"peer {self.spec.peer} named rows of transfer {self.spec.transfer}, which was not "
                             "offered"))

    def _early_ack(self, event: AckReceived, out: list[Action]) -> None:
        """An Ack for a pull not answered yet: nothing to confirm (tolerated, as before)."""

    # ------------------------------------------------------------------ after the answer

    def _go_received(self, event: GoReceived, out: list[Action]) -> None:
        if self.spec.one_sided:
            self._unasked_go(event, out)
            return
        if event.start != self.go_end or event.end > self.spec.rows:
            out.append(Violation(f"peer {self.spec.peer} named rows [{event.start}, {event.end}) of transfer "
                                 f"{self.spec.transfer}; expected rows from {self.go_end} up to {self.spec.rows}"))
            return
        self._send(out, event.start, event.end)
        if self.state is S.SENDING and self._quiet():
            out.append(Quiesce())
            self.state = S.AWAITING_ACK

    def _sends(self, event: SendsCompleted, out: list[Action]) -> None:
        self.outstanding -= event.count
        if event.ok:
            out.append(Count("rows_sent", event.ok))
        if self.state is S.SENDING and event.failures:
            gi, ri, error = event.failures[0]
            reason = f"row {ri} of group index {gi} could not be sent to {self.spec.peer}: {error}"
            self._stop(out, Outcome.failed(reason, self._none(), cause=Cause.PEER_GONE),
                       wire.clip_reason(f"a row could not be sent: {error}"))
            return
        if self.state is S.SENDING:
            if self._quiet():
                out.append(Quiesce())
                self.state = S.AWAITING_ACK
        elif self.state is S.STOPPING:
            if self._quiet():
                out.append(Quiesce())
                self.state = S.STOPPED
        elif self.outstanding == 0:  # DRAINING
            out.append(Quiesce())
            self.state = S.DONE

    def _send_failed(self, event: SendFailed, out: list[Action]) -> None:
        self.outstanding -= self._batch - event.posted  # the sends of the last SendRows never posted
        out.append(CloseConnection(f"sending to {self.spec.peer} failed: {event.reason}", lost=True))

    def _ack(self, event: AckReceived, out: list[Action]) -> None:
        if event.rows != self.total:
            out.append(Violation(f"peer {self.spec.peer} acknowledged {event.rows} rows of a transfer of "
                                 f"{self.total}"))
            return
        if self.state in (S.SENDING, S.AWAITING_ACK, S.OFFERED_READS):
            out.append(Conclude(Outcome.delivered(self._served())))
        self._finish(out)

    def _cancelled_by_peer(self, event: CancelReceived, out: list[Action]) -> None:
        if self.state in (S.SENDING, S.AWAITING_ACK, S.OFFERED_READS):
            out.append(Conclude(Outcome.cancelled(self._none(), by_peer=True, reason=event.reason or None,
                                                  cause=Cause.PEER_CANCELLED)))
        self._finish(out)

    def _lost(self, event: ConnectionLost, out: list[Action]) -> None:
        if self.state in (S.SENDING, S.AWAITING_ACK, S.OFFERED_READS):
            out.append(Conclude(Outcome.failed(f"the requester went away: {event.reason}", self._none(),
                                               cause=event.cause)))
        if self.state is not S.DRAINING:
            self._finish(out)

    def _deadline(self, event: DeadlinePassed, out: list[Action]) -> None:
        reason = (f"the deadline passed while serving {self.spec.peer} before it confirmed the {self.total} rows "
                  "offered")
        told = ("the standing offer answering this pull ran out" if self.spec.offered
                else "the serving end's deadline passed")
        self._stop(out, Outcome.failed(reason, self._none(), cause=Cause.DEADLINE), told)

    def _holder_cancelled(self, event: HolderCancelled, out: list[Action]) -> None:
        told = ("the serving holder withdrew the standing offer answering this pull" if self.spec.offered
                else "the serving end cancelled its reply")
        self._stop(out, Outcome.cancelled(self._none(), reason="cancelled by the holder", cause=Cause.HOLDER_CANCELLED),
                   told)

    def _shutdown(self, event: Shutdown, out: list[Action]) -> None:
        self._stop(out, Outcome.cancelled(self._none(), reason="the backend shut down", cause=Cause.SHUTDOWN),
                   "the serving end shut down")

    def _grace(self, event: GraceExpired, out: list[Action]) -> None:
        out.append(CloseConnection(f"requester {self.spec.peer} did not finish a stopped transfer within the grace"))

    def _ignore(self, event: Any, out: list[Action]) -> None:
        """Concluded already (and the requester told, or done): nothing changes."""


_Step = Callable[[PullServer, Any, list[Action]], None]
_P = PullServer
_LIVE_ANSWERED = (S.SENDING, S.AWAITING_ACK, S.OFFERED_READS)

#: (state, event) -> (the states it may lead to, the step). The whole machine.
TRANSITIONS: dict[tuple[ServerState, type], tuple[frozenset[ServerState], _Step]] = {
    (S.WAITING, Answered): (frozenset({S.SENDING, S.AWAITING_ACK, S.OFFERED_READS, S.DONE}), _P._answered),
    (S.WAITING, AnswerWithdrawn): (frozenset({S.DONE}), _P._withdrawn),
    (S.WAITING, HolderDeclined): (frozenset({S.DONE}), _P._holder_declined),
    (S.WAITING, AnswerUnclaimed): (frozenset({S.GONE}), _P._expired),
    (S.WAITING, CancelReceived): (frozenset({S.GONE}), _P._cancel_before_answer),
    (S.WAITING, ConnectionLost): (frozenset({S.GONE}), _P._lost_before_answer),
    (S.WAITING, Shutdown): (frozenset({S.GONE}), _P._shutdown_before_answer),
    (S.WAITING, GoReceived): (frozenset({S.WAITING}), _P._unasked_go),
    (S.WAITING, AckReceived): (frozenset({S.WAITING}), _P._early_ack),

    (S.GONE, Answered): (frozenset({S.DONE}), _P._answer_when_gone),
    (S.GONE, AnswerWithdrawn): (frozenset({S.DONE}), _P._withdrawn),
    (S.GONE, HolderDeclined): (frozenset({S.DONE}), _P._holder_declined),

    (S.SENDING, GoReceived): (frozenset({S.SENDING, S.AWAITING_ACK}), _P._go_received),
    (S.SENDING, SendsCompleted): (frozenset({S.SENDING, S.AWAITING_ACK, S.STOPPING, S.STOPPED}), _P._sends),
    (S.SENDING, SendFailed): (frozenset({S.SENDING}), _P._send_failed),
    (S.SENDING, AckReceived): (frozenset({S.SENDING, S.DRAINING, S.DONE}), _P._ack),
    (S.SENDING, CancelReceived): (frozenset({S.DRAINING, S.DONE}), _P._cancelled_by_peer),
    (S.SENDING, ConnectionLost): (frozenset({S.DRAINING, S.DONE}), _P._lost),
    (S.SENDING, DeadlinePassed): (frozenset({S.STOPPING, S.STOPPED}), _P._deadline),
    (S.SENDING, HolderCancelled): (frozenset({S.STOPPING, S.STOPPED}), _P._holder_cancelled),
    (S.SENDING, Shutdown): (frozenset({S.STOPPING, S.STOPPED}), _P._shutdown),

    (S.AWAITING_ACK, GoReceived): (frozenset({S.AWAITING_ACK}), _P._go_received),
    (S.AWAITING_ACK, AckReceived): (frozenset({S.AWAITING_ACK, S.DONE}), _P._ack),
    (S.AWAITING_ACK, CancelReceived): (frozenset({S.DONE}), _P._cancelled_by_peer),
    (S.AWAITING_ACK, ConnectionLost): (frozenset({S.DONE}), _P._lost),
    (S.AWAITING_ACK, DeadlinePassed): (frozenset({S.STOPPED}), _P._deadline),
    (S.AWAITING_ACK, HolderCancelled): (frozenset({S.STOPPED}), _P._holder_cancelled),
    (S.AWAITING_ACK, Shutdown): (frozenset({S.STOPPED}), _P._shutdown),

    (S.OFFERED_READS, AckReceived): (frozenset({S.OFFERED_READS, S.DONE}), _P._ack),
    (S.OFFERED_READS, CancelReceived): (frozenset({S.DONE}), _P._cancelled_by_peer),
    (S.OFFERED_READS, ConnectionLost): (frozenset({S.DONE}), _P._lost),
    (S.OFFERED_READS, DeadlinePassed): (frozenset({S.STOPPING}), _P._deadline),
    (S.OFFERED_READS, HolderCancelled): (frozenset({S.STOPPING}), _P._holder_cancelled),
    (S.OFFERED_READS, Shutdown): (frozenset({S.STOPPING}), _P._shutdown),
    (S.OFFERED_READS, GoReceived): (frozenset({S.OFFERED_READS}), _P._go_received),

    (S.STOPPING, SendsCompleted): (frozenset({S.STOPPING, S.STOPPED}), _P._sends),
    (S.STOPPING, SendFailed): (frozenset({S.STOPPING}), _P._send_failed),
    (S.STOPPING, GoReceived): (frozenset({S.STOPPING}), _P._go_received),
    (S.STOPPING, AckReceived): (frozenset({S.STOPPING, S.DRAINING, S.DONE}), _P._ack),
    (S.STOPPING, CancelReceived): (frozenset({S.DRAINING, S.DONE}), _P._cancelled_by_peer),
    (S.STOPPING, ConnectionLost): (frozenset({S.DRAINING, S.DONE}), _P._lost),
    (S.STOPPING, GraceExpired): (frozenset({S.STOPPING}), _P._grace),
    (S.STOPPING, DeadlinePassed): (frozenset({S.STOPPING}), _P._ignore),
    (S.STOPPING, HolderCancelled): (frozenset({S.STOPPING}), _P._ignore),
    (S.STOPPING, Shutdown): (frozenset({S.STOPPING}), _P._ignore),

    (S.STOPPED, GoReceived): (frozenset({S.STOPPED}), _P._go_received),
    (S.STOPPED, AckReceived): (frozenset({S.STOPPED, S.DONE}), _P._ack),
    (S.STOPPED, CancelReceived): (frozenset({S.DONE}), _P._cancelled_by_peer),
    (S.STOPPED, ConnectionLost): (frozenset({S.DONE}), _P._lost),
    (S.STOPPED, GraceExpired): (frozenset({S.STOPPED}), _P._grace),
    (S.STOPPED, DeadlinePassed): (frozenset({S.STOPPED}), _P._ignore),
    (S.STOPPED, HolderCancelled): (frozenset({S.STOPPED}), _P._ignore),
    (S.STOPPED, Shutdown): (frozenset({S.STOPPED}), _P._ignore),

    (S.DRAINING, SendsCompleted): (frozenset({S.DRAINING, S.DONE}), _P._sends),
    (S.DRAINING, ConnectionLost): (frozenset({S.DRAINING}), _P._lost),
    (S.DRAINING, GraceExpired): (frozenset({S.DRAINING}), _P._grace),
    (S.DRAINING, GoReceived): (frozenset({S.DRAINING}), _P._unasked_go),
    (S.DRAINING, AckReceived): (frozenset({S.DRAINING}), _P._ignore),
    (S.DRAINING, CancelReceived): (frozenset({S.DRAINING}), _P._ignore),
    (S.DRAINING, DeadlinePassed): (frozenset({S.DRAINING}), _P._ignore),
    (S.DRAINING, HolderCancelled): (frozenset({S.DRAINING}), _P._ignore),
    (S.DRAINING, Shutdown): (frozenset({S.DRAINING}), _P._ignore),
}
