"""What goes into and comes out of the pull protocol's two state machines: events (something
happened: a frame arrived, receives completed, a read finished, a timer fired, the peer went
away, the holder cancelled, the backend shuts down) and actions (what the engine is to do: send
a frame, post receives, send rows, start a read, conclude, quiesce, arm a timer, close the
connection). Plain frozen data; nothing here touches a socket, a thread or a clock.

Rows are numbered block-major: row ``ri`` of group index ``gi`` is ``ri * groups + gi``
(:mod:`kvwire_ucx.wire`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvwire.contract import Cause, Outcome
from kvwire_ucx import wire

__all__ = [
    # errors
    "ProtocolError",
    # events both machines take
    "HolderCancelled", "Shutdown", "DeadlinePassed", "GraceExpired", "ConnectionLost",
    # events of the requesting side
    "Start", "Offered", "ReadOffered", "Declined", "RowsCompleted", "PostFailed", "ReadCompleted",
    "ReadFailed", "ReadStopped",
    # events of the serving side
    "Answered", "AnswerWithdrawn", "HolderDeclined", "AnswerUnclaimed", "GoReceived", "AckReceived",
    "CancelReceived", "SendsCompleted", "SendFailed",
    # actions
    "Action", "Send", "PostReceives", "Drain", "SendRows", "SendReadOffer", "PlanReads", "StartRead",
    "ReleaseRead", "Conclude", "Quiesce", "Note", "ArmDeadline", "ArmGrace", "Violation", "CloseConnection",
    "Count",
    # helpers
    "offered_limit", "rows_between", "message_cuts", "messages",
]


class ProtocolError(RuntimeError):
    """An event reached a machine in a state where it cannot happen: a bug of the engine that
    feeds it (a peer's mistakes are :class:`Violation` actions, never this)."""


# ---------------------------------------------------------------- events both machines take

@dataclass(frozen=True, slots=True)
class HolderCancelled:
    """The holder called ``cancel()`` (the engine concluded the attempt cancelled already)."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """The backend shuts down with this pull in flight (B3)."""


@dataclass(frozen=True, slots=True)
class DeadlinePassed:
    """The attempt's deadline timer fired."""


@dataclass(frozen=True, slots=True)
class GraceExpired:
    """The grace timer armed when the pull stopped fired (:class:`ArmGrace`)."""


@dataclass(frozen=True, slots=True)
class ConnectionLost:
    """The control connection to the peer closed, taking its UCX endpoint: ``cause`` is
    ``PEER_GONE`` (it died, hung up, could not be reached, or another backend answers at its
    address) or ``FAULT`` (this end dropped it for a protocol violation, or closed it after a
    grace)."""

    reason: str
    cause: Cause = Cause.PEER_GONE
    #: The peer that answered is not the one the address names (a stale address): nothing it
    #: sent counts, so no row of the pull stays marked delivered.
    untrusted: bool = False


# ---------------------------------------------------------------- requesting side

@dataclass(frozen=True, slots=True)
class Start:
    """The engine took the fetch up: the connection is there (or on its way)."""

    remaining_ms: int
    #: one-sided, answered by an offer the serving end pushed (wire version 4): no ``Pull`` goes
    #: out, the answer is made at this end, and the serving end hears no ``Ack`` or ``Cancel``
    pushed: bool = False


@dataclass(frozen=True, slots=True)
class Offered:
    """The serving end's ``Offer``: rows served per group (a two-sided pull's answer), and where
    its rows stop being adjacent (``breaks``, as on the wire; empty: every row on its own)."""

    counts: tuple[int, ...]
    breaks: tuple[tuple[int, ...] | None, ...] = ()


@dataclass(frozen=True, slots=True)
class ReadOffered:
    """The serving end's ``ReadOffer`` (a one-sided pull's answer). ``problem``: why its NIXL
    metadata could not be loaded; ``agent_known``: whether this end has the metadata of the
    agent and generation it names."""

    counts: tuple[int, ...]
    problem: str | None = None
    agent_known: bool = True


@dataclass(frozen=True, slots=True)
class Declined:
    """The serving end's ``Decline``: the answer, or after an offer a stop."""

    reason: str


@dataclass(frozen=True, slots=True, eq=False)
class RowsCompleted:
    """Posted receives completed, in posting order: ``groups``/``rows`` of those that completed
    without error, ``failures`` of the others as ``(group index, row, error, peer gone)``."""

    groups: np.ndarray
    rows: np.ndarray
    failures: tuple[tuple[int, int, str, bool], ...] = ()
    #: how many receives completed (a message carries a run of rows); ``None``: one per row
    receives: int | None = None

    @classmethod
    def of(cls, ok: Sequence[tuple[int, int]], failures: Sequence[tuple[int, int, str, bool]] = ()) -> RowsCompleted:
        """From ``(group index, row)`` pairs (for tests and small batches)."""
        array = np.asarray(list(ok), dtype=np.int64).reshape(-1, 2)
        return cls(array[:, 0], array[:, 1], tuple(failures))

    @property
    def count(self) -> int:
        return len(self.groups) + len(self.failures)

    @property
    def receive_count(self) -> int:
        return self.count if self.receives is None else self.receives


@dataclass(frozen=True, slots=True)
class PostFailed:
    """Posting the receives of a :class:`PostReceives` stopped at the message whose first row is
    block-major number ``reached``; ``unposted``: the group index of every row of it not posted
    (``None``: the rows from ``reached`` on; a message of several rows reaches past it)."""

    reason: str
    reached: int
    unposted: np.ndarray | None = None
    unposted_receives: int | None = None  #: receives not posted (``None``: one per unposted row)


@dataclass(frozen=True, slots=True)
class ReadCompleted:
    """The read in flight finished whole."""


@dataclass(frozen=True, slots=True)
class ReadFailed:
    """The read in flight (or its start) failed; ``stopped``: NIXL let go of it (else it may
    still run until :class:`ReadStopped`)."""

    reason: str
    cause: Cause = Cause.FAULT
    stopped: bool = True


@dataclass(frozen=True, slots=True)
class ReadStopped:
    """A failed or released read that was still running has stopped."""


# ---------------------------------------------------------------- serving side

@dataclass(frozen=True, slots=True)
class Answered:
    """The holder's ``publish``: of a view of ``rows`` rows per group, ``counts`` served per
    group (a one-sided answer may serve a shorter prefix), or ``refusal`` (the rows do not fit
    the pull)."""

    counts: tuple[int, ...]
    rows: tuple[int, ...]
    refusal: str | None = None
    #: two-sided: this end's breaks among the offered rows, for the Offer (empty: every row alone)
    breaks: tuple[tuple[int, ...] | None, ...] = ()


@dataclass(frozen=True, slots=True)
class AnswerWithdrawn:
    """The holder cancelled its ``publish`` before the answer went out."""


@dataclass(frozen=True, slots=True)
class HolderDeclined:
    """The holder's ``decline(request, reason)``."""

    reason: str


@dataclass(frozen=True, slots=True)
class AnswerUnclaimed:
    """The pull's deadline passed with the holder's answer not even claimed."""


@dataclass(frozen=True, slots=True)
class GoReceived:
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class AckReceived:
    rows: int


@dataclass(frozen=True, slots=True)
class CancelReceived:
    reason: str


@dataclass(frozen=True, slots=True)
class SendsCompleted:
    """Posted sends completed: ``ok`` of them fine, ``failures`` as ``(group index, row,
    error)``."""

    ok: int
    failures: tuple[tuple[int, int, str], ...] = ()

    @property
    def count(self) -> int:
        return self.ok + len(self.failures)


@dataclass(frozen=True, slots=True)
class SendFailed:
    """Posting the sends of a :class:`SendRows` failed after ``posted`` of them."""

    reason: str
    posted: int


# ---------------------------------------------------------------- actions

@dataclass(frozen=True, slots=True)
class Send:
    """Send this frame on the pull's connection (a no-op once it closed). ``after_wakes``: a
    last word no holder waits for (a fetch's Ack as it concludes), written after this pass's
    wakes so that the holder does not wait for the write."""

    message: wire.Message
    after_wakes: bool = False


@dataclass(frozen=True, slots=True)
class PostReceives:
    """Post one receive per offered row among block-major numbers ``[start, end)``, straight
    into the lent row; with ``counts`` unknown (before the answer), every row."""

    start: int
    end: int
    counts: tuple[int, ...] | None


@dataclass(frozen=True, slots=True)
class Drain:
    """Complete the posted receives no peer will match: with ``counts``, those of rows not
    offered (row >= counts[group]); without, all of them."""

    counts: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class SendRows:
    """Send the offered rows among block-major numbers ``[start, end)`` (serving side)."""

    start: int
    end: int
    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SendReadOffer:
    """Send the ``ReadOffer`` for these counts (the engine adds addresses and metadata)."""

    counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PlanReads:
    """Build the read descriptors of every block range now (one-sided requester)."""

    counts: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class StartRead:
    """Start reading planned ranges ``[first, last)``, all at once; report :class:`ReadCompleted`
    once every one of them is read, or :class:`ReadFailed`."""

    first: int
    last: int


@dataclass(frozen=True, slots=True)
class ReleaseRead:
    """Let go of the read in flight (cancelling it); report :class:`ReadStopped` once NIXL did."""


@dataclass(frozen=True, slots=True, eq=False)
class Conclude:
    """Set the attempt's outcome unless it has one (the holder's cancel may have won)."""

    outcome: Outcome = field(repr=True)


@dataclass(frozen=True, slots=True)
class Quiesce:
    """The attempt's memory is never touched again (A2)."""


@dataclass(frozen=True, slots=True)
class Note:
    """Record a step of the attempt's timeline (``asked``, ``answered``)."""

    step: str


@dataclass(frozen=True, slots=True)
class ArmDeadline:
    """Fire :class:`DeadlinePassed` at the attempt's deadline."""


@dataclass(frozen=True, slots=True)
class ArmGrace:
    """Fire :class:`GraceExpired` one grace from now."""


@dataclass(frozen=True, slots=True)
class Violation:
    """The peer broke the protocol: drop the connection and count it (the engine then feeds
    :class:`ConnectionLost` with cause ``FAULT``)."""

    reason: str


@dataclass(frozen=True, slots=True)
class CloseConnection:
    """Force the connection closed (a peer that stopped answering, or a failed post);
    ``lost``: count it as a lost connection."""

    reason: str
    lost: bool = False


@dataclass(frozen=True, slots=True)
class Count:
    """Add ``n`` to counter ``key`` of :class:`~kvwire_ucx.attempt.WireStats`."""

    key: str
    n: int = 1


Action = (Send | PostReceives | Drain | SendRows | SendReadOffer | PlanReads | StartRead | ReleaseRead | Conclude
          | Quiesce | Note | ArmDeadline | ArmGrace | Violation | CloseConnection | Count)


# ---------------------------------------------------------------- block-major arithmetic

def offered_limit(counts: Sequence[int]) -> int:
    """One past the block-major number of the last offered row (0 when none is)."""
    width = len(counts)
    return max(((c - 1) * width + g + 1 for g, c in enumerate(counts) if c), default=0)


def rows_between(start: int, end: int, counts: Sequence[int] | None, width: int) -> np.ndarray:
    """The group index of every row (offered ones only, given ``counts``) among block-major
    numbers ``[start, end)``, in order."""
    seqs = np.arange(start, end, dtype=np.int64)
    groups = seqs % width
    if counts is not None:
        seqs_rows = seqs // width
        groups = groups[seqs_rows < np.asarray(counts, dtype=np.int64)[groups]]
    return groups


def message_cuts(here: Sequence[tuple[int, ...] | None], there: Sequence[tuple[int, ...] | None]
                 ) -> tuple[np.ndarray | None, ...]:
    """Per group, the rows that start a message (beyond row 0): where either end's rows stop
    being adjacent; ``None`` where either end sends every row on its own."""
    return tuple(None if a is None or b is None else np.union1d(np.asarray(a, dtype=np.int64),
                                                                np.asarray(b, dtype=np.int64))
                 for a, b in zip(here, there, strict=True))


def messages(start: int, end: int, rows: Sequence[int], counts: Sequence[int] | None,
             cuts: Sequence[np.ndarray | None] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The messages that carry the rows among block-major numbers ``[start, end)`` of groups of
    ``rows`` rows each (offered ones only, given ``counts``), in the order of their first rows'
    numbers: ``(number of the first row, group index, first row, rows)``. A message is a run of
    one group's rows, adjacent at both ends (never crossing ``cuts``) and within ``[start,
    end)``; without ``cuts`` every row is one message. Both ends compute the same messages for the
    same window."""
    width = len(rows)
    seqs, gis, firsts, lengths = [], [], [], []
    for gi in range(width):
        lo = max(0, -(-(start - gi) // width))
        hi = min(-(-(end - gi) // width), rows[gi] if counts is None else counts[gi])
        if hi <= lo:
            continue
        cut = None if cuts is None else cuts[gi]
        if cut is None:
            first = np.arange(lo, hi, dtype=np.int64)
        else:
            inner = cut[(cut > lo) & (cut < hi)]
            first = np.concatenate((np.array([lo], dtype=np.int64), inner.astype(np.int64)))
        seqs.append(first * width + gi)
        gis.append(np.full(len(first), gi, dtype=np.int64))
        firsts.append(first)
        lengths.append(np.diff(np.concatenate((first, np.array([hi], dtype=np.int64)))))
    if not seqs:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    seq, gi_all, first_all, length_all = (np.concatenate(x) for x in (seqs, gis, firsts, lengths))
    order = np.argsort(seq, kind="stable")
    return seq[order], gi_all[order], first_all[order], length_all[order]
