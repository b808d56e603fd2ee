"""The serving side of one engine: a ``Pull`` frame turned into the holder's :class:`PullRequest`
and its ticket, the holder's answer (or decline) taken up, the requester's later words (``Go``,
``Cancel``, ``Ack``) routed to the reply they name, the one-sided offers out, and the pulls
answered from the holder's standing offers (O1) without the holder.

The tickets are the one part the holder's threads touch (:meth:`Serving.claim`,
:meth:`Serving.decline`, :meth:`Serving.take_incoming`), under the engine's lock; everything else
runs on the progress thread. What a reply does is its machine's
(:mod:`kvwire_ucx.protocol.server`), and every event goes to it through the engine
(:class:`~kvwire_ucx.jobs.Router`)."""

from __future__ import annotations

import collections
import threading
import time
import weakref

import numpy as np

from kvwire.contract import Cause, Hint, InvalidSubmission, Outcome
from kvwire.contract.backend import WakeFn
from kvwire.contract.serving import PullRequest
from kvwire_ucx import wire
from kvwire_ucx.attempt import AttemptKind, UcxAttempt
from kvwire_ucx.connection import Connection
from kvwire_ucx.jobs import EngineContext, ReplyJob, Router, Ticket
from kvwire_ucx.nixl import NixlAgent
from kvwire_ucx.offers import OfferIndex, StandingOffer, push_groups
from kvwire_ucx.protocol import events as ev
from kvwire_ucx.protocol.server import PullServer, ReplySpec, ServerState
from kvwire_ucx.reactor import Reactor
from kvwire_ucx.regions import GroupRows, RowRuns
from kvwire_ucx.settings import UcxSettings
from kvwire_ucx.tag_rows import TagSends

__all__ = ["Serving"]

#: How long the ticket of a request the holder took but never answered stays answerable after
#: the request went away (so the late answer learns why instead of 'unknown ticket').
_TICKET_LINGER_S = 60.0
#: While a one-sided offer is out, the serving end progresses its NIXL agent this often (NIXL
#: has no fd). A peer that was just sent the metadata is probably wiring up a connection, which
#: waits for that progress: then often; afterwards a cma or RDMA read needs nothing of the serving
#: end, and polling every millisecond took a quarter of the reader's speed on two shared cores.
_NIXL_WIREUP_POLL_S = 0.001
_NIXL_WIREUP_S = 0.25
_NIXL_SERVE_POLL_S = 0.005
#: Bytes per second an answer from a standing offer is assumed to move at least (the two-sided
#: mode moved 0.6-1.2 GB/s on loopback here): an offer answers a pull only if it stands until
#: the pull's bytes could have moved at this rate, plus the grace (contract O1.12).
OFFER_ANSWER_RATE = 0.5e9


class Serving(EngineContext):
    """The replies of one engine, by connection and transfer id, and the holder's tickets (each
    names this end's ``instance``)."""

    def __init__(self, router: Router, lock: threading.Lock, settings: UcxSettings, nixl: NixlAgent | None,
                 reactor: Reactor, instance: int) -> None:
        super().__init__(router, lock, settings, nixl, reactor)
        self._instance = instance
        self._pull_ids = iter(range(1, 1 << 63))
        self._tickets: dict[int, ReplyJob] = {}  # pull id -> reply (guarded by the lock)
        self._incoming: collections.deque[ReplyJob] = collections.deque()  # guarded by the lock
        self._wake: WakeFn | None = None  # the serving holder's (guarded by the lock)
        self._on: dict[Connection, dict[int, ReplyJob]] = {}
        self._read_replies: set[ReplyJob] = set()  # one-sided offers the requester has not finished
        self._wiring_until = 0.0  # until then a peer may be wiring up to this end's NIXL agent
        self.offers = OfferIndex()  # the holder's standing offers (O1)
        #: one-sided: the requesters' connections that take pushed offers (their Hello said so)
        self._pushable: set[Connection] = set()
        #: the offers pushed to a connection that has not answered their withdrawal, by id
        self._pushed: dict[int, StandingOffer] = {}

    # ================================================================ the holder's threads

    def start(self, wake: WakeFn) -> None:
        with self._lock:
            self._wake = wake
        if self._nixl is not None:
            self._reactor.submit(self._push_all)  # offers made before serve() stand from now on

    def take_incoming(self) -> tuple[PullRequest, ...]:
        out: list[PullRequest] = []
        with self._lock:
            while self._incoming:
                job = self._incoming.popleft()
                if job.ticket is Ticket.OPEN and job.request is not None:  # (an offer's answer never queues)
                    job.surfaced = True
                    out.append(job.request)
        return tuple(out)

    def claim(self, pull_id: int) -> ReplyJob:
        """Take the ticket of pull ``pull_id`` for an answer (:meth:`unclaim` gives it back)."""
        with self._lock:
            job = self._tickets.get(pull_id)
            if job is None or job.ticket is Ticket.CLAIMED:
                raise InvalidSubmission(f"pull {pull_id} is unknown or was already answered; answer each request once")
            job.claimed_from, job.ticket = job.ticket, Ticket.CLAIMED
        return job

    def unclaim(self, job: ReplyJob) -> None:
        """Give a claimed ticket back: the answer never left the holder."""
        with self._lock:
            if job.ticket is Ticket.CLAIMED:
                job.ticket = job.claimed_from

    def decline(self, pull_id: int, reason: str) -> bool:
        """The holder declines pull ``pull_id``; whether it was still answerable."""
        with self._lock:
            job = self._tickets.get(pull_id)
            if job is None or job.ticket is Ticket.CLAIMED:
                return False
            job.claimed_from, job.ticket = job.ticket, Ticket.CLAIMED
        self._reactor.submit(self._router.feed, job, ev.HolderDeclined(reason))
        return True

    # ================================================================ the progress thread

    def on(self, conn: Connection) -> list[ReplyJob]:
        """The replies running on ``conn``."""
        return list(self._on.get(conn, {}).values())

    def on_pull(self, conn: Connection, message: wire.Pull) -> None:
        """A requester's ``Pull``: declined at once, or a request for the holder."""
        self._router.count("pulls_received")
        if message.transfer in self._on.get(conn, {}):
            self._router.drop(conn, f"peer {conn.label} reused transfer id {message.transfer}")
            return
        if self._reactor.stopping:
            self._decline_now(conn, message.transfer, "not serving: the serving end is shutting down")
            return
        with self._lock:
            wake = self._wake
            waiting = sum(1 for r in self._tickets.values() if r.ticket is Ticket.OPEN)
        if wake is None:
            self._decline_now(conn, message.transfer, "not serving: the peer's holder has not started serving pulls")
            return
        mode = "one-sided" if self._nixl is not None else "two-sided"
        if message.one_sided != (self._nixl is not None):
            # Modes never mix: a process that loaded NIXL must not run two-sided rendezvous
            # (see the README: UCX 1.21 can crash there when a peer dies).
            asked = "one-sided" if message.one_sided else "two-sided"
            self._decline_now(conn, message.transfer, f"this end serves {mode} pulls only (option mode={mode!r}); "
                                                      f"the pull is {asked}")
            return
        if self.offers and self._answer_from_offer(conn, message):
            return
        if waiting >= self._settings.max_pending_pulls:
            self._decline_now(conn, message.transfer, f"busy: {waiting} pulls are already waiting for the serving holder")
            return
        pull_id = next(self._pull_ids)
        timeout_s = message.timeout_ms / 1000.0
        request = PullRequest(
            ticket=Hint.of("ticket", timeout_s=timeout_s, backend=self._instance, pull=pull_id),
            groups=tuple(g for g, _ in message.groups),
            slot_bytes=tuple(s for _, s in message.groups),
            names=np.frombuffer(message.names, dtype=np.uint8).reshape(message.count, message.width),
            peer=conn.label,
            credentials=message.credentials,
        )
        spec = ReplySpec(message.transfer, message.credit, len(message.groups), message.count,
                         one_sided=message.one_sided, peer=conn.label)
        job = ReplyJob(pull_id, conn, PullServer(spec), request, time.monotonic() + timeout_s, message.tag_base)
        job.peer_breaks = message.breaks
        self._on.setdefault(conn, {})[message.transfer] = job
        with self._lock:
            self._tickets[pull_id] = job
            self._incoming.append(job)
        self._reactor.call_later(timeout_s, lambda: self._deadline_passed(job))
        self._reactor.wake_later(wake)

    def on_word(self, conn: Connection, message: wire.Go | wire.Cancel | wire.Ack) -> None:
        """A requester's later word about the reply it names."""
        reply = self._on.get(conn, {}).get(message.transfer)
        if reply is None:
            if isinstance(message, wire.Go):
                self._router.drop(conn, f"peer {conn.label} named rows of transfer {message.transfer}, "
                                        "which was not offered")
            return  # an Ack or Cancel for a pull over at this end
        if isinstance(message, wire.Go):
            self._router.feed(reply, ev.GoReceived(message.start, message.end))
        elif isinstance(message, wire.Cancel):
            self._router.feed(reply, ev.CancelReceived(message.reason))
        else:
            self._router.feed(reply, ev.AckReceived(message.rows))

    def _answer_from_offer(self, conn: Connection, message: wire.Pull) -> bool:
        """Answer ``message`` from the standing offer that covers it whole (O1.4); whether one
        did. The answer is a reply like the holder's, owned by the offer instead of a publish."""
        if self.offers.answers() >= self._settings.max_pending_pulls:
            return False  # as many answers from offers as pulls may wait for the holder: it decides (O1.12)
        now = time.monotonic()
        # An offer that ends before this answer could finish is left out: the answer would be cut
        # (O1.12). Finishing takes the grace plus the pull's bytes at a rate any mode here beats.
        moved = message.count * sum(slot for _, slot in message.groups)
        found = self.offers.cover(message.groups, message.width, message.names, message.count,
                                  now + self._settings.grace_s + moved / OFFER_ANSWER_RATE)
        if found is None:
            return False
        offer, (groups, runs) = found
        counts = tuple(message.count for _ in groups)
        job = ReplyJob(0, conn, PullServer(ReplySpec(message.transfer, message.credit, len(groups), message.count,
                                                     one_sided=message.one_sided, peer=conn.label, offered=True)),
                       None, min(now + message.timeout_ms / 1000.0, offer.deadline), message.tag_base)
        if self._nixl is not None and self._prepare_read_offer(job, counts, groups, runs) != counts:
            return False  # its addresses need more than one frame: the holder answers a prefix
        breaks: tuple[tuple[int, ...] | None, ...] = ()
        if self._nixl is None:
            job.sends = TagSends(groups, job.tag_base, message.credit, message.breaks)
            breaks = job.sends.offer_breaks(counts)
        job.ticket = Ticket.CLAIMED
        job.offer = offer
        job.groups = groups
        job.attempt = UcxAttempt(_not_cancelled, offer.attempt.view, AttemptKind.PUBLISH, _no_wake)
        job.attempt.job = job
        offer.answers.add(job)
        self._on.setdefault(conn, {})[message.transfer] = job
        self._router.count("pulls_offered")
        self._router.feed(job, ev.Answered(counts, counts, None, breaks))
        return True

    def arm_offer(self, offer: StandingOffer) -> None:
        """A standing offer ``offer()`` put in the index gets its deadline (or, made as the
        backend shut down, ends at once), and is pushed to the requesters that take pushes."""
        if self._reactor.stopping:
            self.end_offer(offer, _shut_down(offer))
            return
        # The timer holds the offer weakly: one withdrawn long before its deadline (an offer of an
        # hour, withdrawn after a second) is not kept, with its view, until then. While it stands
        # the index holds it.
        ref = weakref.ref(offer)
        self._reactor.call_later(offer.deadline - time.monotonic(), lambda: self._offer_expired(ref()))
        if self._pushable and self._serving():
            for conn in list(self._pushable):
                self._push(offer, conn)

    # ---------------------------------------------------------------- pushed offers (one-sided)

    def _serving(self) -> bool:
        with self._lock:
            return self._wake is not None

    def on_hello(self, conn: Connection, message: wire.Hello) -> None:
        """A requester said hello: one that runs one-sided and takes pushes is pushed every
        offer standing now, and every later one."""
        if self._nixl is None or not message.flags & wire.HELLO_TAKES_PUSHES:
            return
        self._pushable.add(conn)
        if self._serving():
            for offer in self.offers:
                self._push(offer, conn)

    def _push_all(self) -> None:
        for conn in list(self._pushable):
            for offer in self.offers:
                if conn not in offer.pushed_to:
                    self._push(offer, conn)

    def _push(self, offer: StandingOffer, conn: Connection) -> None:
        """Push ``offer`` on ``conn``, unless it is beyond a push's bounds (O1.12) or about to
        run out: its pulls then go the old way."""
        assert self._nixl is not None
        remaining_ms = int((offer.deadline - time.monotonic()) * 1000)
        if (not offer.standing or conn.closed or conn in offer.pushed_to or remaining_ms < 1
                or offer.attempt.poll() is not None):
            return  # (an offer made as the connection said hello reaches it from both: once)
        groups = push_groups(offer)
        if groups is None:
            return
        generation, metadata = self._nixl.metadata()
        if conn.nixl_sent == generation:
            metadata = b""
        agent = self._nixl.name.encode()
        size = wire.PushOffer.body_bytes(tuple((g.rows, g.width, len(g.runs)) for g in groups), agent, metadata)
        if size > wire.MAX_MESSAGE_BYTES:
            return
        self._router.send(conn, wire.PushOffer(offer.offer_id, min(remaining_ms, 2**32 - 1), agent, generation,
                                               metadata, groups))
        if conn.closed:
            return
        if metadata:
            self._wiring_until = time.monotonic() + _NIXL_WIREUP_S
            conn.nixl_sent = generation
        offer.pushed_to.add(conn)
        self._pushed[offer.offer_id] = offer
        self._router.count("offers_pushed")

    def _withdraw(self, offer: StandingOffer) -> None:
        """The offer concluded: every connection it was pushed to hears so; one that has not
        answered within the grace is closed (its requester stalled), so the offer quiesces by
        then at the latest."""
        if not offer.pushed_to:
            return
        for conn in list(offer.pushed_to):
            self._router.send(conn, wire.Withdraw(offer.offer_id))
        ref = weakref.ref(offer)
        self._reactor.call_later(self._settings.grace_s, lambda: self._withdrawal_overdue(ref()))

    def _withdrawal_overdue(self, offer: StandingOffer | None) -> None:
        if offer is None:
            return
        for conn in list(offer.pushed_to):
            self._router.close_connection(conn, f"requester {conn.label} did not answer the withdrawal of a pushed "
                                                "offer within the grace")

    def on_withdrawn(self, conn: Connection, message: wire.Withdrawn) -> None:
        """The requester answered a withdrawal: it reads the offer's rows no more."""
        offer = self._pushed.get(message.offer)
        if offer is None or offer.standing or conn not in offer.pushed_to:
            self._router.drop(conn, f"peer {conn.label} answered the withdrawal of offer {message.offer}, which it "
                                    "was not sent")
            return
        offer.pushed_to.discard(conn)
        self._settle_offer(offer)

    def connection_closed(self, conn: Connection) -> None:
        """A connection ended: it reads no pushed offer any more (counted as answered)."""
        self._pushable.discard(conn)
        for offer in [o for o in self._pushed.values() if conn in o.pushed_to]:
            offer.pushed_to.discard(conn)
            self._settle_offer(offer)

    def withdrawing(self, conn: Connection) -> bool:
        """Whether an offer pushed on ``conn`` waits for its withdrawal's answer there."""
        return any(conn in offer.pushed_to and not offer.standing for offer in self._pushed.values())

    def _offer_expired(self, offer: StandingOffer | None) -> None:
        if offer is None:
            return
        # Its answers' deadlines were no later than its own: they end by theirs (O1.8).
        masks = tuple(np.ones(g.rows, dtype=bool) for g in offer.attempt.view.groups)
        self.end_offer(offer, Outcome.delivered(masks))

    def end_offer(self, offer: StandingOffer, outcome: Outcome | None, *, stop_answers: bool = False) -> None:
        """The offer stops answering pulls, concluded with ``outcome`` (``None``: the holder's
        cancel concluded it already); ``stop_answers`` ends the answers still reading its rows.
        It quiesces once none is left."""
        if offer.standing:
            offer.standing = False
            self.offers.remove(offer)
            if outcome is not None:
                self._router.conclude(offer.attempt, outcome)
            self._withdraw(offer)
        if stop_answers:
            for job in list(offer.answers):
                self._router.feed(job, ev.HolderCancelled())
        self._settle_offer(offer)

    def shutdown_offers(self) -> None:
        """Shutdown: every standing offer concludes (its answers hear of the shutdown as every
        reply does)."""
        for offer in self.offers:
            self.end_offer(offer, _shut_down(offer))

    def _settle_offer(self, offer: StandingOffer) -> None:
        if not offer.standing and not offer.answers and not offer.pushed_to:
            if self._pushed.get(offer.offer_id) is offer:
                del self._pushed[offer.offer_id]
            self._router.quiesce(offer.attempt)

    def _decline_now(self, conn: Connection, transfer: int, reason: str) -> None:
        self._router.count("pulls_declined")
        self._router.send(conn, wire.Decline(transfer, wire.clip_reason(reason)))

    def _deadline_passed(self, job: ReplyJob) -> None:
        with self._lock:
            unclaimed = job.ticket is Ticket.OPEN
        if unclaimed and job.machine.state is ServerState.WAITING:
            self._router.feed(job, ev.AnswerUnclaimed())

    def answer(self, job: ReplyJob, attempt: UcxAttempt, groups: tuple[GroupRows, ...], rows: tuple[int, ...],
               refusal: str | None, deadline: float) -> None:
        """Take up the holder's answer (``publish``): its row mover, then the machine's event."""
        job.attempt = attempt
        attempt.job = job
        job.groups = groups
        job.deadline = deadline
        if attempt.cancel_requested:  # the holder cancelled it before it went out
            job.cancel_fed = True
            self._router.feed(job, ev.AnswerWithdrawn())
            return
        counts = rows
        breaks: tuple[tuple[int, ...] | None, ...] = ()
        if job.machine.state is ServerState.WAITING and refusal is None:
            if self._nixl is not None:
                counts = self._prepare_read_offer(job, rows, groups)
            else:
                job.sends = TagSends(groups, job.tag_base, job.machine.spec.credit, job.peer_breaks)
                breaks = job.sends.offer_breaks(counts)
        self._router.feed(job, ev.Answered(counts, rows, refusal, breaks))

    def _prepare_read_offer(self, job: ReplyJob, counts: tuple[int, ...], groups: tuple[GroupRows, ...],
                            runs: tuple[np.ndarray, ...] | None = None) -> tuple[int, ...]:
        """This end's NIXL metadata (when the connection was not sent this generation) and the
        longest common block prefix whose ReadOffer fits in one frame (still a valid answer),
        with its runs (``runs``: those of ``counts``, known already)."""
        assert self._nixl is not None
        generation, metadata = self._nixl.metadata()
        if job.conn.nixl_sent == generation:
            metadata = b""
        agent = self._nixl.name.encode()
        if runs is None or not _fits(runs, agent, metadata):
            counts, runs = read_offer_runs(counts, groups, agent, metadata)
        job.read_offer = (generation, metadata, agent, counts, runs)
        return counts

    def send_read_offer(self, job: ReplyJob, counts: tuple[int, ...]) -> None:
        assert job.read_offer is not None
        generation, metadata, agent, prepared, runs = job.read_offer
        if prepared != counts:  # the machine answers with the counts prepared; should it not, runs of its own
            runs = offer_runs(job.groups, counts)
        memories = tuple(group.memory for group in job.groups)
        self._router.send(job.conn, wire.ReadOffer(job.transfer, counts, agent, generation, metadata, runs, memories))

        if metadata:
            self._wiring_until = time.monotonic() + _NIXL_WIREUP_S
        job.conn.nixl_sent = generation
        self._read_replies.add(job)

    def offering_reads(self) -> bool:
        """Whether a one-sided offer is out, or a pushed one (the NIXL agent then needs progress)."""
        return bool(self._read_replies) or bool(self._pushed)

    def sleep_cap(self) -> float:
        """How long the progress thread may sleep, as far as the offers out are concerned."""
        if self._read_replies or self._pushed:
            return _NIXL_WIREUP_POLL_S if time.monotonic() < self._wiring_until else _NIXL_SERVE_POLL_S
        return 1.0

    def gone(self, job: ReplyJob) -> None:
        """A reply that went GONE is no longer the connection's; its ticket lingers if the holder
        saw the request (so a late answer learns why), else it goes."""
        self._unlist(job)
        with self._lock:
            if job.ticket is Ticket.OPEN:
                job.ticket = Ticket.EXPIRED
            linger = job.ticket is Ticket.EXPIRED and job.surfaced
            if job.ticket is Ticket.EXPIRED and not linger:
                self._tickets.pop(job.pull_id, None)
        if linger:
            self._reactor.call_later(max(0.0, job.expires_at - time.monotonic()) + _TICKET_LINGER_S,
                                     lambda: self._drop_ticket(job))

    def _drop_ticket(self, job: ReplyJob) -> None:
        with self._lock:
            if self._tickets.get(job.pull_id) is job and job.ticket is Ticket.EXPIRED:
                del self._tickets[job.pull_id]

    def forget(self, job: ReplyJob) -> None:
        """``job`` is done: no longer its connection's, nor answerable; an offer's answer no
        longer reads the offer's rows."""
        self._read_replies.discard(job)
        self._unlist(job)
        if job.offer is not None:
            offer, job.offer = job.offer, None  # the job's timers may outlive it: they keep no offer
            offer.answers.discard(job)
            self._settle_offer(offer)
            return
        with self._lock:
            if self._tickets.get(job.pull_id) is job:
                del self._tickets[job.pull_id]

    def _unlist(self, job: ReplyJob) -> None:
        on = self._on.get(job.conn)
        if on is not None and on.get(job.transfer) is job:
            del on[job.transfer]
            if not on:
                del self._on[job.conn]

    def clear(self) -> None:
        """The engine is torn down: no request is answerable any more."""
        with self._lock:
            self._tickets.clear()
            self._incoming.clear()


def _shut_down(offer: StandingOffer) -> Outcome:
    """A standing offer's outcome when the backend shut down before its deadline (O1.7)."""
    return Outcome.cancelled(offer.attempt.view.row_masks(), reason="the backend shut down", cause=Cause.SHUTDOWN)


def _not_cancelled(attempt: UcxAttempt) -> None:
    """An answer from an offer is no holder's attempt: nobody cancels it but its offer."""


def _no_wake() -> None:
    """An answer from an offer wakes nobody; its offer's attempt wakes the holder (O1.10)."""


def offer_runs(groups: tuple[GroupRows, ...], counts: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Where each group's first ``counts`` rows lie in this end's memory, as a ReadOffer names
    it: runs of rows adjacent there (address, rows)."""
    return tuple(RowRuns.of(group, count).runs for group, count in zip(groups, counts, strict=True))


def _fits(runs: tuple[np.ndarray, ...], agent: bytes, metadata: bytes) -> bool:
    return wire.ReadOffer.body_bytes(len(runs), sum(len(r) for r in runs), agent, metadata) <= wire.MAX_MESSAGE_BYTES


def read_offer_runs(counts: tuple[int, ...], groups: tuple[GroupRows, ...], agent: bytes, metadata: bytes
                    ) -> tuple[tuple[int, ...], tuple[np.ndarray, ...]]:
    """``counts`` cut to the longest common block prefix whose ReadOffer fits in one frame (its
    size is that of the runs of adjacent rows the prefix makes in each group), and those runs.
    One pass over each group's rows; the cut, if any, over its runs."""
    made = [RowRuns.of(g, c) for g, c in zip(groups, counts, strict=True)]

    def fits(cut: tuple[int, ...]) -> bool:
        runs = sum(r.count(c) for r, c in zip(made, cut, strict=True))
        return wire.ReadOffer.body_bytes(len(cut), runs, agent, metadata) <= wire.MAX_MESSAGE_BYTES

    if not fits(counts):
        lo, hi = 0, max(counts)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(tuple(min(c, mid) for c in counts)):
                lo = mid
            else:
                hi = mid - 1
        counts = tuple(min(c, lo) for c in counts)
    return counts, tuple(r.prefix(c) for r, c in zip(made, counts, strict=True))


def fit_read_offer(counts: tuple[int, ...], groups: tuple[GroupRows, ...], agent: bytes, metadata: bytes
                   ) -> tuple[int, ...]:
    """``counts`` cut to the longest common block prefix whose ReadOffer fits in one frame."""
    return read_offer_runs(counts, groups, agent, metadata)[0]
