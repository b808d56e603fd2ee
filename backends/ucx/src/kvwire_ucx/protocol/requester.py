"""The requesting side of one pull, as a state machine without I/O: events in, actions out.

States (:class:`RequesterState`)::

    NEW ──Start──▶ ASKED ──Offered──▶ RECEIVING ──rows all arrived──▶ DONE
                     │  └──ReadOffered──▶ READING ──last ranges read──▶ DONE
                     │                                 (or DRAINING while drained receives complete)
                     └─stopped before the answer─▶ STOPPED_UNANSWERED ──answer / connection lost──▶ DRAINING
    any live state ──stopped or failed──▶ DRAINING (receives or a read still touch memory) ──▶ DONE

``NEW``, ``ASKED``, ``RECEIVING`` and ``READING`` are live: the attempt has not concluded and the
serving end has not heard this end's last word. Every other state has concluded and said its last
word (an ``Ack`` or a ``Cancel``; or none was needed: declined, never asked, connection gone).
``DONE`` alone is quiesced. The table :data:`TRANSITIONS` is the whole machine: an event with no
entry for the current state raises :class:`ProtocolError`.

Why one file of this size: one machine, its steps and its transition table belong together; a
reader checks a step against its table entry without leaving the file."""

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
    Action,
    ArmDeadline,
    ArmGrace,
    CloseConnection,
    Conclude,
    ConnectionLost,
    Count,
    DeadlinePassed,
    Declined,
    Drain,
    GraceExpired,
    HolderCancelled,
    Note,
    Offered,
    PlanReads,
    PostFailed,
    PostReceives,
    ProtocolError,
    Quiesce,
    ReadCompleted,
    ReadFailed,
    ReadOffered,
    ReadStopped,
    ReleaseRead,
    RowsCompleted,
    Send,
    Shutdown,
    Start,
    StartRead,
    Violation,
    message_cuts,
    messages,
    offered_limit,
    rows_between,
)

__all__ = ["RequesterState", "PullRequester", "PullSpec", "TRANSITIONS"]


class RequesterState(enum.Enum):
    NEW = "new"                                 #: submitted; the engine has not taken it up
    ASKED = "asked"                             #: the Pull went out; two-sided: receives posted on credit
    RECEIVING = "receiving"                     #: two-sided Offer taken; rows arrive, windows named by Go
    READING = "reading"                         #: one-sided ReadOffer taken; ranges read in flight
    STOPPED_UNANSWERED = "stopped-unanswered"   #: concluded and Cancel sent before the answer came
    DRAINING = "draining"                       #: concluded; receives or a read still touch memory
    DONE = "done"                               #: concluded and quiesced


S = RequesterState
#: Two-sided: the credit's receives are posted before the answer tells this end where the
#: serving end's rows are adjacent, so they are one per row (a UCX message each, ~25 us for a
#: device row); the credit is at most this many bytes (or the window), and every later window
#: goes as one message per run of rows adjacent at both ends. It still hides the round trip of
#: a small pull.
CREDIT_BYTES = 1 << 20
#: One-sided: how many planned ranges (``window_bytes`` each) are read at once: every range of a
#: pull up to this many (64 MiB each by default: 4 GiB) goes out in one batch of NIXL reads; the
#: next batch starts when the last one is read. Reading the ranges one after another took twice
#: a bare read of the span on an H100 (bench/results/gpu-ucx-2026-12-06.txt).
READ_RANGES_AT_ONCE = 64
_LIVE = frozenset({S.NEW, S.ASKED, S.RECEIVING, S.READING})


@dataclass(frozen=True, slots=True)
class PullSpec:
    """What one pull asks for, as the protocol needs it."""

    transfer: int
    tag_base: int
    group_ids: tuple[int, ...]
    slot_bytes: tuple[int, ...]
    blocks: int
    width: int
    names: bytes
    timeout_s: float
    window_bytes: int
    one_sided: bool = False
    credentials: bytes = b""
    peer: str = "the peer"
    ranges_at_once: int = READ_RANGES_AT_ONCE  #: one-sided: planned ranges read at once
    #: two-sided: per group, the rows whose lent slot does not follow the row before's (see
    #: wire.Pull.breaks); empty: every row on its own
    breaks: tuple[tuple[int, ...] | None, ...] = ()
    credit_bytes: int = CREDIT_BYTES  #: two-sided: the credit's window (its rows go one per message)


class PullRequester:
    """One pull's requesting side. :meth:`handle` takes an event and returns the actions; the
    delivery masks it marks are :attr:`masks` (one bool array per group)."""

    def __init__(self, spec: PullSpec) -> None:
        self.spec = spec
        self.state = S.NEW
        groups = len(spec.group_ids)
        self.masks: tuple[np.ndarray, ...] = tuple(np.zeros(spec.blocks, dtype=bool) for _ in range(groups))
        self.counts: tuple[int, ...] | None = None  # the answer's rows per group
        self.total = 0          # rows offered
        self.received = 0       # offered rows arrived (or read) whole
        self.next_seq = 0       # block-major number of the next row to post a receive for
        self.limit = spec.blocks * groups  # receives are posted below it: every row, then the offered ones
        self.outstanding = 0    # rows whose receives are posted and not completed
        self.receives_out = 0   # receives posted and not completed (a message's receive takes a run of rows)
        self._cuts: tuple[np.ndarray | None, ...] | None = None  # after the Offer: where messages start
        self.inflight_bytes = 0
        self.ranges: tuple[tuple[int, int], ...] = ()  # one-sided: block ranges to read
        self.range_index = 0    # the first range of the batch being read
        self.range_end = 0      # and the end of that batch
        self.reads = 0          # batches of reads in flight (0 or 1)
        self._sizes = np.asarray(spec.slot_bytes, dtype=np.int64)
        #: the breaks the Pull names (fitted to its frame: a group whose breaks do not fit goes
        #: every row on its own); the receives are cut by these
        self.breaks: tuple[tuple[int, ...] | None, ...] = () if spec.one_sided else wire.fit_breaks(
            spec.breaks or (None,) * groups, wire.pull_breaks_room(groups, len(spec.names), len(spec.credentials)))
        self.history: collections.deque[tuple[str, str, str]] = collections.deque(maxlen=256)
        #: answered from an offer the serving end pushed: no Pull went out, and no Ack or Cancel
        #: goes out (the serving end keeps no reply for it)
        self.pushed = False
        #: one-sided: the reason of a Cancel held back until the read in flight has stopped
        self.cancel_after_read: str | None = None

    # ------------------------------------------------------------------ driving

    def handle(self, event: Any) -> list[Action]:
        entry = TRANSITIONS.get((self.state, type(event)))
        if entry is None:
            raise ProtocolError(f"pull {self.spec.transfer}: {type(event).__name__} cannot happen in state "
                                f"{self.state.name}")
        targets, step = entry
        before = self.state
        actions: list[Action] = []
        step(self, event, actions)
        if self.state not in targets:
            raise ProtocolError(f"pull {self.spec.transfer}: {type(event).__name__} in {before.name} led to "
                                f"{self.state.name}, not one of {sorted(t.name for t in targets)}")
        self.history.append((before.name, type(event).__name__, self.state.name))
        return actions

    @property
    def live(self) -> bool:
        """Not concluded, and the serving end still waits for this end's last word."""
        return self.state in _LIVE

    def events(self) -> list[str]:
        """The names of the events handled so far, in order (the last 256)."""
        return [event for _, event, _ in self.history]

    # ------------------------------------------------------------------ helpers

    def _fail(self, out: list[Action], reason: str, cause: Cause) -> None:
        out.append(Conclude(Outcome.failed(reason, self.masks, cause=cause)))

    def _cancel(self, out: list[Action], reason: str) -> None:
        """Tell the serving end this pull is over. While a one-sided read is still in flight the
        Cancel waits for it to stop (:meth:`_settle` sends it): the serving end takes a Cancel
        as "nothing reads your rows any more" and quiesces its answer, unpinning them, so a
        Cancel ahead of the read would let the requester read rows the serving end has
        already given back (a block of another request, once it is reused)."""
        if self.pushed:
            return
        if self.reads:
            self.cancel_after_read = reason
            return
        out.append(Send(wire.Cancel(self.spec.transfer, wire.clip_reason(reason))))

    def _ack(self, out: list[Action]) -> None:
        if not self.pushed:
            out.append(Send(wire.Ack(self.spec.transfer, self.received), after_wakes=True))

    def _settle(self, out: list[Action]) -> None:
        """From a concluded state: DONE once nothing touches memory, else DRAINING. A Cancel held
        back for the read goes out once the read has stopped."""
        if self.reads == 0 and self.cancel_after_read is not None:
            reason, self.cancel_after_read = self.cancel_after_read, None
            out.append(Send(wire.Cancel(self.spec.transfer, wire.clip_reason(reason))))
        if self.outstanding == 0 and self.reads == 0:
            self.state = S.DONE
            out.append(Quiesce())
        else:
            self.state = S.DRAINING

    def _take_counts(self, out: list[Action], counts: tuple[int, ...]) -> bool:
        """Take the answer's rows per group; whether they fit the pull (else a violation)."""
        out.append(Note("answered"))
        spec = self.spec
        if len(counts) != len(spec.group_ids) or any(c > spec.blocks for c in counts):
            out.append(Violation(f"peer {spec.peer} offered {list(counts)} rows for a pull of {spec.blocks} "
                                 f"blocks in {len(spec.group_ids)} groups"))
            return False
        self.counts = counts
        self.total = sum(counts)
        return True

    def _budget(self) -> int:
        """After the Offer, the window counts receives: as many as ``window_bytes`` of the
        smallest rows, one receive each, would take (a receive takes a whole run of rows
        adjacent at both ends, so adjacent rows are posted all at once)."""
        return max(1, self.spec.window_bytes // int(self._sizes.min()))

    def _window(self, window: int | None = None) -> tuple[int, int, int, int]:
        """The next receives to post: ``(end, rows, bytes, receives)`` from :attr:`next_seq`
        while the window allows: before the Offer (the credit, one receive per row) a row is
        posted while fewer than ``window`` bytes, else ``window_bytes``, are in flight; after it,
        messages while fewer than :meth:`_budget` receives are."""
        if self.counts is not None:
            return self._message_window()
        start, limit, width = self.next_seq, self.limit, len(self.spec.group_ids)
        window = self.spec.window_bytes if window is None else window
        inflight = self.inflight_bytes
        counts = None if self.counts is None else np.asarray(self.counts, dtype=np.int64)
        smallest = int(self._sizes.min())
        seq, rows, nbytes = start, 0, 0
        while seq < limit and inflight < window:
            span = min(limit - seq, ((window - inflight) // smallest + 1) * width)
            seqs = np.arange(seq, seq + span, dtype=np.int64)
            groups = seqs % width
            sizes = self._sizes[groups]
            if counts is not None:
                sizes = np.where(seqs // width < counts[groups], sizes, 0)
            before = inflight + np.cumsum(sizes) - sizes
            stop = np.flatnonzero(before >= window)
            taken = sizes[: int(stop[0])] if len(stop) else sizes
            rows += int(np.count_nonzero(taken))
            nbytes += int(taken.sum())
            inflight += int(taken.sum())
            seq += len(taken)
            if len(stop):
                break
        return seq, rows, nbytes, rows

    def _message_window(self) -> tuple[int, int, int, int]:
        assert self.counts is not None
        start, width = self.next_seq, len(self.spec.group_ids)
        budget = self._budget() - self.receives_out
        if budget <= 0 or start >= self.limit:
            return start, 0, 0, 0
        seq, gi, first, length = messages(start, self.limit, (self.spec.blocks,) * width, self.counts, self._cuts)
        end = self.limit
        if len(seq) > budget:  # cut before the first message over the budget; the last ones end there
            end = int(seq[budget])
            seq, gi, first, length = seq[:budget], gi[:budget], first[:budget], length[:budget]
            length = np.minimum(length, -(-(end - gi) // width) - first)
        return end, int(length.sum()), int((length * self._sizes[gi]).sum()), len(seq)

    def _post(self, out: list[Action], window: int | None = None) -> tuple[int, int]:
        """Post receives for the next window; the block-major range it covers."""
        start = self.next_seq
        end, rows, nbytes, receives = self._window(window)
        if end > start:
            out.append(PostReceives(start, end, self.counts))
            self.next_seq = end
            self.outstanding += rows
            self.inflight_bytes += nbytes
            self.receives_out += receives
        return start, end

    def _mark(self, event: RowsCompleted) -> int:
        """Mark the rows that arrived and count the receives down; how many rows it marked."""
        groups, rows = event.groups, event.rows
        self.outstanding -= event.count
        self.receives_out -= event.receive_count
        freed = int(self._sizes[groups].sum()) if len(groups) else 0
        freed += sum(int(self._sizes[gi]) for gi, _, _, _ in event.failures)
        self.inflight_bytes -= freed
        if not len(groups):
            return 0
        if self.counts is not None:
            keep = rows < np.asarray(self.counts, dtype=np.int64)[groups]
            groups, rows = groups[keep], rows[keep]
        for gi in range(len(self.masks)):
            self.masks[gi][rows[groups == gi]] = True
        return len(rows)

    def _first_failure(self, event: RowsCompleted) -> tuple[int, int, str, bool] | None:
        for failure in event.failures:
            gi, ri, _, _ = failure
            if self.counts is None or ri < self.counts[gi]:
                return failure
        return None

    def _stop(self, out: list[Action], outcome: Outcome, cancel_reason: str) -> None:
        """Conclude a live pull with ``outcome`` and tell the serving end, arming the grace."""
        out.append(Conclude(outcome))
        if self.state is S.NEW:
            self.state = S.DONE
            out.append(Quiesce())
            return
        self._cancel(out, cancel_reason)
        if self.state is S.ASKED and self.outstanding:
            self.state = S.STOPPED_UNANSWERED
        else:
            self._settle(out)
        if self.state is not S.DONE:
            out.append(ArmGrace())

    def _deadline_reason(self) -> str:
        phase = "before the peer answered" if self.counts is None else (
            f"with {self.received} of {self.total} rows arrived")
        return f"the deadline of {self.spec.timeout_s:g}s passed {phase} (peer {self.spec.peer})"

    # ------------------------------------------------------------------ transitions

    def _start(self, event: Start, out: list[Action]) -> None:
        spec = self.spec
        if event.pushed and spec.one_sided:  # the answer is made here, from the pushed offer: no Pull
            self.pushed = True
            out.append(Note("pushed"))
            out.append(ArmDeadline())
            self.state = S.ASKED
            return
        credit_window = min(spec.window_bytes, spec.credit_bytes)
        credit = 0 if spec.one_sided else self._window(credit_window)[0]  # the first window, posted below
        groups = tuple(zip(spec.group_ids, spec.slot_bytes, strict=True))
        try:
            pull = wire.Pull(spec.transfer, spec.tag_base, max(1, min(event.remaining_ms, 2**32 - 1)), groups,
                             spec.width, spec.names, spec.credentials, credit, one_sided=spec.one_sided,
                             breaks=self.breaks)
        except wire.WireError as exc:
            # The submission checks what the wire carries; should a pull still not fit it, fail
            # the attempt with the reason before anything is posted or sent (nothing escaped).
            out.append(Conclude(Outcome.failed(f"the pull cannot be sent: {exc}", self.masks, cause=Cause.FAULT)))
            out.append(Quiesce())
            self.state = S.DONE
            return
        if not spec.one_sided:
            self._post(out, credit_window)
        out.append(Send(pull))
        out.append(Note("asked"))
        out.append(ArmDeadline())
        self.state = S.ASKED

    def _holder_cancelled(self, event: HolderCancelled, out: list[Action]) -> None:
        self._stop(out, Outcome.cancelled(self.masks, reason="cancelled by the holder", cause=Cause.HOLDER_CANCELLED),
                   "the requester cancelled the pull")

    def _shutdown(self, event: Shutdown, out: list[Action]) -> None:
        self._stop(out, Outcome.cancelled(self.masks, reason="the backend shut down", cause=Cause.SHUTDOWN),
                   "the requester shut down")

    def _deadline(self, event: DeadlinePassed, out: list[Action]) -> None:
        self._stop(out, Outcome.failed(self._deadline_reason(), self.masks, cause=Cause.DEADLINE),
                   "the requester's deadline passed")

    def _offered(self, event: Offered, out: list[Action]) -> None:
        if self.spec.one_sided:
            out.append(Note("answered"))
            out.append(Violation(f"peer {self.spec.peer} offered rows for a pull it was asked to answer with a "
                                 f"ReadOffer (transfer {self.spec.transfer})"))
            return
        if not self._take_counts(out, event.counts):
            return
        counts = event.counts
        self.limit = offered_limit(counts)
        if len(event.breaks) == len(self.breaks):  # as the receives cut them (TagReceives.learn)
            self._cuts = message_cuts(self.breaks, event.breaks)
        if self.outstanding:  # receives posted on credit for rows the peer does not hold
            out.append(Drain(counts))
        if self.state is S.STOPPED_UNANSWERED:
            self._settle(out)  # the Cancel went out already; what was sent on credit still arrives
            return
        self.state = S.RECEIVING
        self._progress(out)

    def _progress(self, out: list[Action]) -> None:
        """RECEIVING: conclude once every offered row arrived, else refill the window."""
        if self.received == self.total:
            self._ack(out)
            out.append(Conclude(Outcome.delivered(self.masks)))
            self._settle(out)
            return
        if self.receives_out <= self._budget() // 2 or not self.outstanding:
            # refill in batches: fewer Go messages, longer runs of sends
            start, end = self._post(out)
            if end > start:
                out.append(Send(wire.Go(self.spec.transfer, start, end)))

    def _read_offered(self, event: ReadOffered, out: list[Action]) -> None:
        spec = self.spec
        if not spec.one_sided:
            out.append(Note("answered"))
            out.append(Violation(f"peer {spec.peer} sent a ReadOffer for a pull it was not asked to answer so "
                                 f"(transfer {spec.transfer})"))
            return
        if not self._take_counts(out, event.counts):
            return
        if self.total == 0:
            self._ack(out)
            out.append(Conclude(Outcome.delivered(self.masks)))
            self._settle(out)
            return
        if event.problem is None and not event.agent_known:
            self.counts, self.total = None, 0
            out.append(Violation(f"peer {spec.peer} offered reads from a NIXL agent without sending its metadata"))
            return
        if event.problem is not None:
            self._fail(out, event.problem, Cause.FAULT)
            self._cancel(out, event.problem)
            self._settle(out)
            return
        per_block = sum(spec.slot_bytes)
        step = max(1, spec.window_bytes // max(1, per_block))
        longest = max(event.counts)
        self.ranges = tuple((b, min(b + step, longest)) for b in range(0, longest, step))
        out.append(PlanReads(event.counts, self.ranges))
        self.state = S.READING
        self._start_batch(out, 0)

    def _start_batch(self, out: list[Action], first: int) -> None:
        """Read the planned ranges from ``first`` on, as many as are read at once."""
        self.range_index, self.range_end = first, min(len(self.ranges), first + max(1, self.spec.ranges_at_once))
        self.reads = 1
        out.append(StartRead(self.range_index, self.range_end))

    def _violating_answer(self, event: Offered | ReadOffered, out: list[Action]) -> None:
        out.append(Violation(f"peer {self.spec.peer} answered transfer {self.spec.transfer} twice"))

    def _declined(self, event: Declined, out: list[Action]) -> None:
        peer = self.spec.peer
        if self.state is S.ASKED:
            # the answer: nothing will be sent, so every receive posted on credit is ours to end
            out.append(Note("answered"))
            if self.outstanding:
                out.append(Drain())
            self._fail(out, f"peer {peer} declined the pull: {event.reason}", Cause.DECLINED)
            self._settle(out)
        elif self.state is S.STOPPED_UNANSWERED:
            out.append(Note("answered"))
            out.append(Drain())
            self._settle(out)
        elif self.state in (S.RECEIVING, S.READING):
            self._fail(out, f"peer {peer} stopped the pull: {event.reason}", Cause.DECLINED)
            self._cancel(out, "acknowledging the stop")
            self._settle(out)
        # DRAINING: a stop that crossed this end's last word; nothing to do

    def _rows(self, event: RowsCompleted, out: list[Action]) -> None:
        counting = self.state in (S.ASKED, S.RECEIVING, S.STOPPED_UNANSWERED)
        marked = self._mark(event)
        if counting and marked:  # before the answer every completed receive is one of the peer's rows
            self.received += marked
            out.append(Count("rows_received", marked))
        if self.state in (S.ASKED, S.RECEIVING):
            failure = self._first_failure(event)
            if failure is not None:
                gi, ri, error, gone = failure
                self._fail(out, f"row {ri} of group {self.spec.group_ids[gi]} did not arrive from {self.spec.peer}: "
                                f"{error}", Cause.PEER_GONE if gone else Cause.FAULT)
                self._cancel(out, f"a row did not arrive: {error}")
                if self.state is S.ASKED and self.outstanding:
                    self.state = S.STOPPED_UNANSWERED
                else:
                    self._settle(out)
                return
            if self.state is S.RECEIVING:
                self._progress(out)
            return
        if self.state is S.STOPPED_UNANSWERED:
            if not self.outstanding:
                self.state = S.DONE
                out.append(Quiesce())
            return
        self._settle(out)  # DRAINING

    def _post_failed(self, event: PostFailed, out: list[Action]) -> None:
        width = len(self.spec.group_ids)
        unposted = (event.unposted if event.unposted is not None
                    else rows_between(event.reached, self.next_seq, self.counts, width))
        self.outstanding -= len(unposted)
        self.receives_out -= len(unposted) if event.unposted_receives is None else event.unposted_receives
        self.inflight_bytes -= int(self._sizes[unposted].sum())
        self.next_seq = event.reached
        self._fail(out, f"posting receives failed: {event.reason}", Cause.FAULT)
        self._cancel(out, f"posting receives failed: {event.reason}")
        if self.outstanding:
            out.append(Drain())
        self._settle(out)

    def _read_completed(self, event: ReadCompleted, out: list[Action]) -> None:
        assert self.counts is not None
        start, end = self.ranges[self.range_index][0], self.ranges[self.range_end - 1][1]
        rows = 0
        for mask, count in zip(self.masks, self.counts, strict=True):
            hi = min(end, count)
            if hi > start:
                mask[start:hi] = True
                rows += hi - start
        self.received += rows
        out.append(Count("rows_received", rows))
        out.append(Count("rows_read", rows))
        self.reads = 0
        if self.state is S.DRAINING:
            self._settle(out)
            return
        if self.range_end < len(self.ranges):
            self._start_batch(out, self.range_end)
            return
        self._ack(out)
        out.append(Conclude(Outcome.delivered(self.masks)))
        self._settle(out)

    def _read_failed(self, event: ReadFailed, out: list[Action]) -> None:
        self.reads = 0 if event.stopped else 1
        if self.state is S.READING:
            self._fail(out, event.reason, event.cause)
            self._cancel(out, event.reason)
        self._settle(out)

    def _read_stopped(self, event: ReadStopped, out: list[Action]) -> None:
        self.reads = 0
        self._settle(out)

    def _connection_lost(self, event: ConnectionLost, out: list[Action]) -> None:
        self.cancel_after_read = None  # no one is left to tell
        if self.state in _LIVE:
            if event.untrusted:
                for mask in self.masks:
                    mask[:] = False  # rows from a peer the address does not name never count
            self._fail(out, event.reason, event.cause)
        if self.outstanding:
            out.append(Drain())
        self._settle(out)

    def _rearm_grace(self, event: DeadlinePassed, out: list[Action]) -> None:
        out.append(ArmGrace())

    def _grace(self, event: GraceExpired, out: list[Action]) -> None:
        if self.reads:
            out.append(ReleaseRead())
            # The path to the peer stalls (a link that came back after a fault, a peer that stopped
            # answering): this end keeps nothing of it. The connection closes, and with it the
            # offers pushed on it and this end's load of the peer's agent (forgotten once no read
            # of it is in flight); the next pull connects anew, and its answer brings the agent's
            # metadata again. Kept, a control connection the serving end had closed at its own
            # grace while the link was down failed the next pull, and an agent whose reads
            # stalled was read from again. (UCX's TCP transport may keep its socket between the
            # two workers all the same: a stall of that socket's own recovery is not cut short.)
            out.append(CloseConnection(f"reads of a stopped pull did not finish within the grace; the path to "
                                       f"{self.spec.peer} stalls"))
        if self.outstanding:
            out.append(CloseConnection(f"rows of a stopped pull did not finish within the grace; the peer "
                                       f"{self.spec.peer} stopped answering"))

    def _ignore(self, event: Any, out: list[Action]) -> None:
        """Already concluded and told: a later cancel or shutdown changes nothing."""


_Step = Callable[[PullRequester, Any, list[Action]], None]
_R = PullRequester

#: (state, event) -> (the states it may lead to, the step). The whole machine.
TRANSITIONS: dict[tuple[RequesterState, type], tuple[frozenset[RequesterState], _Step]] = {
    (S.NEW, Start): (frozenset({S.ASKED, S.DONE}), _R._start),
    (S.NEW, HolderCancelled): (frozenset({S.DONE}), _R._holder_cancelled),
    (S.NEW, Shutdown): (frozenset({S.DONE}), _R._shutdown),

    (S.ASKED, Offered): (frozenset({S.ASKED, S.RECEIVING, S.DRAINING, S.DONE}), _R._offered),
    (S.ASKED, ReadOffered): (frozenset({S.ASKED, S.READING, S.DONE}), _R._read_offered),
    (S.ASKED, Declined): (frozenset({S.DRAINING, S.DONE}), _R._declined),
    (S.ASKED, RowsCompleted): (frozenset({S.ASKED, S.STOPPED_UNANSWERED, S.DONE}), _R._rows),
    (S.ASKED, PostFailed): (frozenset({S.DRAINING, S.DONE}), _R._post_failed),
    (S.ASKED, DeadlinePassed): (frozenset({S.STOPPED_UNANSWERED, S.DONE}), _R._deadline),
    (S.ASKED, HolderCancelled): (frozenset({S.STOPPED_UNANSWERED, S.DONE}), _R._holder_cancelled),
    (S.ASKED, Shutdown): (frozenset({S.STOPPED_UNANSWERED, S.DONE}), _R._shutdown),
    (S.ASKED, ConnectionLost): (frozenset({S.DRAINING, S.DONE}), _R._connection_lost),

    (S.RECEIVING, RowsCompleted): (frozenset({S.RECEIVING, S.DRAINING, S.DONE}), _R._rows),
    (S.RECEIVING, PostFailed): (frozenset({S.DRAINING, S.DONE}), _R._post_failed),
    (S.RECEIVING, Declined): (frozenset({S.DRAINING, S.DONE}), _R._declined),
    (S.RECEIVING, DeadlinePassed): (frozenset({S.DRAINING, S.DONE}), _R._deadline),
    (S.RECEIVING, HolderCancelled): (frozenset({S.DRAINING, S.DONE}), _R._holder_cancelled),
    (S.RECEIVING, Shutdown): (frozenset({S.DRAINING, S.DONE}), _R._shutdown),
    (S.RECEIVING, ConnectionLost): (frozenset({S.DRAINING, S.DONE}), _R._connection_lost),
    (S.RECEIVING, Offered): (frozenset({S.RECEIVING}), _R._violating_answer),
    (S.RECEIVING, ReadOffered): (frozenset({S.RECEIVING}), _R._violating_answer),

    (S.READING, ReadCompleted): (frozenset({S.READING, S.DONE}), _R._read_completed),
    (S.READING, ReadFailed): (frozenset({S.DRAINING, S.DONE}), _R._read_failed),
    (S.READING, Declined): (frozenset({S.DRAINING}), _R._declined),
    (S.READING, DeadlinePassed): (frozenset({S.DRAINING}), _R._deadline),
    (S.READING, HolderCancelled): (frozenset({S.DRAINING}), _R._holder_cancelled),
    (S.READING, Shutdown): (frozenset({S.DRAINING}), _R._shutdown),
    (S.READING, ConnectionLost): (frozenset({S.DRAINING}), _R._connection_lost),
    (S.READING, Offered): (frozenset({S.READING}), _R._violating_answer),
    (S.READING, ReadOffered): (frozenset({S.READING}), _R._violating_answer),

    (S.STOPPED_UNANSWERED, Offered): (frozenset({S.STOPPED_UNANSWERED, S.DRAINING, S.DONE}), _R._offered),
    (S.STOPPED_UNANSWERED, Declined): (frozenset({S.DRAINING, S.DONE}), _R._declined),
    (S.STOPPED_UNANSWERED, RowsCompleted): (frozenset({S.STOPPED_UNANSWERED, S.DONE}), _R._rows),
    (S.STOPPED_UNANSWERED, ConnectionLost): (frozenset({S.DRAINING, S.DONE}), _R._connection_lost),
    (S.STOPPED_UNANSWERED, DeadlinePassed): (frozenset({S.STOPPED_UNANSWERED}), _R._rearm_grace),
    (S.STOPPED_UNANSWERED, GraceExpired): (frozenset({S.STOPPED_UNANSWERED}), _R._grace),
    (S.STOPPED_UNANSWERED, HolderCancelled): (frozenset({S.STOPPED_UNANSWERED}), _R._ignore),
    (S.STOPPED_UNANSWERED, Shutdown): (frozenset({S.STOPPED_UNANSWERED}), _R._ignore),

    (S.DRAINING, RowsCompleted): (frozenset({S.DRAINING, S.DONE}), _R._rows),
    (S.DRAINING, ReadCompleted): (frozenset({S.DONE}), _R._read_completed),
    (S.DRAINING, ReadFailed): (frozenset({S.DRAINING, S.DONE}), _R._read_failed),
    (S.DRAINING, ReadStopped): (frozenset({S.DONE}), _R._read_stopped),
    (S.DRAINING, ConnectionLost): (frozenset({S.DRAINING, S.DONE}), _R._connection_lost),
    (S.DRAINING, Declined): (frozenset({S.DRAINING}), _R._declined),
    (S.DRAINING, Offered): (frozenset({S.DRAINING}), _R._violating_answer),
    (S.DRAINING, ReadOffered): (frozenset({S.DRAINING}), _R._violating_answer),
    (S.DRAINING, DeadlinePassed): (frozenset({S.DRAINING}), _R._rearm_grace),
    (S.DRAINING, GraceExpired): (frozenset({S.DRAINING}), _R._grace),
    (S.DRAINING, HolderCancelled): (frozenset({S.DRAINING}), _R._ignore),
    (S.DRAINING, Shutdown): (frozenset({S.DRAINING}), _R._ignore),
}
