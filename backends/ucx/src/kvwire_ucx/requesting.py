"""The requesting side of one engine: the fetches it runs on each connection, a fetch taken up
on the progress thread (its connection, its row mover, its first event), the serving end's
answers routed to the fetch they answer, and the NIXL agents it reads from.

Everything but :meth:`Requesting.machine` runs on the progress thread; what a fetch does is its
machine's (:mod:`kvwire_ucx.protocol.requester`), and every event goes to it through the
engine (:class:`~kvwire_ucx.jobs.Router`)."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvwire.contract import View
from kvwire_ucx import wire
from kvwire_ucx.address import PeerAddress
from kvwire_ucx.connection import Connection, Connections
from kvwire_ucx.jobs import EngineContext, FetchJob, Router
from kvwire_ucx.nixl import NixlAgent, NixlError
from kvwire_ucx.nixl_reads import RangeReads
from kvwire_ucx.offers import PushedOffer
from kvwire_ucx.protocol import events as ev
from kvwire_ucx.protocol.requester import PullRequester, PullSpec, RequesterState
from kvwire_ucx.reactor import Reactor
from kvwire_ucx.regions import GroupRows
from kvwire_ucx.settings import UcxSettings
from kvwire_ucx.tag_rows import TagReceives, own_breaks

log = logging.getLogger(__name__)

__all__ = ["PushedAnswer", "Requesting", "PUSH_DEADLINE_MARGIN_S", "PUSH_READ_RATE"]

#: A pushed offer's local deadline is the push's arrival plus the time it had left, less this:
#: a push that took longer than this to arrive could let a read start that much after the offer's
#: deadline (the serving end still withdraws it then, and its offer quiesces only once this end
#: answered: pins hold).
PUSH_DEADLINE_MARGIN_S = 0.05
#: Bytes per second a read from a pushed offer is assumed to move at least, as the serving end
#: assumes for an answer from an offer (kvwire_ucx.serving.OFFER_ANSWER_RATE): a fetch is answered
#: from a pushed offer only if it stands until the grace plus its bytes at this rate (O1.12).
PUSH_READ_RATE = 0.5e9


@dataclass(frozen=True, slots=True, eq=False)
class PushedAnswer:
    """The answer to a fetch that a pushed offer covers, made at this end instead of a
    ``ReadOffer`` from the serving end. It goes through the engine's fault seam as a frame that
    arrived would (a test can hold it, as it holds an answer on the wire)."""

    transfer: int
    offer: PushedOffer
    counts: tuple[int, ...]
    runs: tuple[np.ndarray, ...]
    memories: tuple[int, ...]


class Requesting(EngineContext):
    """The fetches of one engine, by connection and transfer id; ``wires`` open their
    connections, greeting with ``hello``."""

    def __init__(self, router: Router, lock: threading.Lock, settings: UcxSettings, nixl: NixlAgent | None,
                 reactor: Reactor, wires: Connections, hello: wire.Hello) -> None:
        super().__init__(router, lock, settings, nixl, reactor)
        self._wires = wires
        self._hello = hello
        self._transfer_ids = iter(range(1, 1 << 63))
        self._last_transfer = 0  # guarded by the lock
        # Tag bases are handed out in order from a random start and never reused (2**40 of
        # them), so a stale message left by a drained receive can never match a later pull.
        self._next_tag_base = secrets.randbelow(wire.MAX_TAG_BASE)
        self._on: dict[Connection, dict[int, FetchJob]] = {}
        self.reading: set[FetchJob] = set()  # one-sided fetches with a read in flight
        self._forget_agents: set[bytes] = set()
        #: the offers each serving end pushed on its connection (one-sided), by offer id
        self._pushed: dict[Connection, dict[int, PushedOffer]] = {}

    def machine(self, view: View, address: PeerAddress, timeout_s: float, groups: tuple[GroupRows, ...],
                width: int, names: bytes, credentials: bytes) -> PullRequester:
        """A new fetch's machine, with its transfer id and tag base (on the holder's thread)."""
        with self._lock:
            transfer = next(self._transfer_ids)
            self._last_transfer = transfer
            tag_base = self._next_tag_base
            self._next_tag_base = (tag_base + 1) % wire.MAX_TAG_BASE  # MAX_TAG_BASE is the probe's
        one_sided = self._nixl is not None
        spec = PullSpec(transfer, tag_base, tuple(g.group_id for g in groups), tuple(g.slot_bytes for g in groups),
                        view.groups[0].rows, width, names, timeout_s, self._settings.window_bytes,
                        one_sided=one_sided, credentials=credentials, peer=str(address),
                        breaks=() if one_sided else own_breaks(groups))
        return PullRequester(spec)

    def on(self, conn: Connection) -> list[FetchJob]:
        """The fetches running on ``conn``."""
        return list(self._on.get(conn, {}).values())

    def start(self, job: FetchJob) -> None:
        """Take up a fetch: its connection (opened if need be), its row mover, its first event."""
        if job.attempt.cancel_requested:  # cancelled before it was taken up
            self._router.feed(job, ev.HolderCancelled())
            return
        if self._reactor.stopping:
            self._router.feed(job, ev.Shutdown())
            return
        conn = self._wires.outbound(job.address)
        if conn is None:
            self._router.count("connections_opened")
            conn, problem = self._wires.connect(job.address, self._hello)
            if problem is not None:
                failed = conn
                self._reactor.call_later(0.0, lambda: self._router.close_connection(failed, problem, lost=True))
        job.conn = conn
        self._on.setdefault(conn, {})[job.transfer] = job
        if self._nixl is not None:
            job.reads = RangeReads(self._nixl, job.groups, job.machine.spec.peer)
        else:
            job.receives = TagReceives(job.groups, job.machine.spec.tag_base, job.machine.breaks)
        now = time.monotonic()
        remaining_ms = int((job.deadline - now) * 1000)
        answer = self._pushed_answer(job, conn, now) if conn in self._pushed else None
        if answer is None:
            self._router.feed(job, ev.Start(remaining_ms))
            return
        job.pushed = answer.offer
        answer.offer.fetches.add(job)
        self._router.count("pulls_pushed")
        self._router.feed(job, ev.Start(remaining_ms, pushed=True))
        if not job.finished:
            self._router.arrived(conn, answer)  # through the fault seam, as a ReadOffer would come

    def _pushed_answer(self, job: FetchJob, conn: Connection, now: float) -> PushedAnswer | None:
        """The answer a pushed offer of ``conn`` gives ``job`` when one covers it whole and
        stands until the read could finish (O1.4, O1.12), else ``None``."""
        spec = job.machine.spec
        moved = spec.blocks * sum(spec.slot_bytes)
        stands_until = now + self._settings.grace_s + moved / PUSH_READ_RATE
        groups = tuple(zip(spec.group_ids, spec.slot_bytes, strict=True))
        for offer in reversed(list(self._pushed[conn].values())):  # the newest first, as the serving end
            if offer.withdrawn or offer.deadline < stands_until:
                continue
            covered = offer.cover(groups, spec.width, spec.names, spec.blocks)
            if covered is not None:
                _, runs = covered
                return PushedAnswer(spec.transfer, offer, (spec.blocks,) * len(groups), runs,
                                    tuple(offer.memories[g] for g in spec.group_ids))
        return None

    def on_pushed_answer(self, conn: Connection, answer: PushedAnswer) -> None:
        """The answer a pushed offer gave, taken up as a ``ReadOffer`` is (unless the offer was
        withdrawn meanwhile: then the fetch fails as one whose answer its offer's end cut)."""
        job = self._on.get(conn, {}).get(answer.transfer)
        if job is None or job.finished:
            return
        assert job.reads is not None
        if answer.offer.withdrawn:
            self._router.feed(job, ev.Declined(_WITHDRAWN))
            return
        job.reads.peer_agent, job.reads.remote = answer.offer.agent, answer.runs
        job.reads.remote_memories = answer.memories if any(m >= 0 for m in answer.memories) else ()
        self._router.feed(job, ev.ReadOffered(answer.counts))

    def on_push(self, conn: Connection, message: wire.PushOffer) -> None:
        """A serving end pushed a standing offer: kept for this connection's fetches."""
        if self._nixl is None:
            self._router.drop(conn, f"peer {conn.label} pushed an offer to an end that takes none (two-sided)")
            return
        pushed = self._pushed.setdefault(conn, {})
        if message.offer in pushed:
            self._router.drop(conn, f"peer {conn.label} pushed offer {message.offer} twice")
            return
        try:
            if message.metadata:
                self._nixl.load_peer(message.agent, message.generation, message.metadata)
                conn.nixl_peer = message.agent
            elif self._nixl.generation_of(message.agent) is None:
                self._router.drop(conn, f"peer {conn.label} pushed an offer from a NIXL agent without sending its "
                                        "metadata")
                return
            offer = PushedOffer(message, time.monotonic() + message.remaining_ms / 1000.0 - PUSH_DEADLINE_MARGIN_S)
        except NixlError as exc:  # kept, never read from: its withdrawal is still answered
            log.warning("kvwire-ucx: offer %d pushed by %s cannot be read: %s", message.offer, conn.label, exc)
            offer = PushedOffer(message, 0.0)
        except wire.WireError as exc:
            self._router.drop(conn, f"peer {conn.label} pushed an offer that cannot be read: {exc}")
            return
        pushed[message.offer] = offer
        self._router.count("pushes_received")

    def on_withdraw(self, conn: Connection, message: wire.Withdraw) -> None:
        """The serving end withdrew an offer it pushed: no read of it starts any more, those in
        flight fail (O1.8), and it hears ``Withdrawn`` once none is left."""
        offer = self._pushed.get(conn, {}).get(message.offer)
        if offer is None or offer.withdrawn:
            self._router.drop(conn, f"peer {conn.label} withdrew offer {message.offer}, which it had not pushed here")
            return
        offer.withdrawn = True
        for job in list(offer.fetches):
            self._router.feed(job, ev.Declined(_WITHDRAWN))
            if not job.finished and job.reads is not None and job.reads.running and job.reads.release():
                self._router.feed(job, ev.ReadStopped())  # NIXL let go of its reads: none reads the rows
        self._answer_withdrawal(conn, offer)

    def _answer_withdrawal(self, conn: Connection, offer: PushedOffer) -> None:
        if offer.withdrawn and not offer.fetches:
            pushed = self._pushed.get(conn)
            if pushed is not None and pushed.get(offer.offer_id) is offer:
                del pushed[offer.offer_id]
                if not conn.closed:
                    self._router.send(conn, wire.Withdrawn(offer.offer_id))

    def cancelled(self, job: FetchJob) -> None:
        """The holder cancelled ``job``: its machine hears of it now, or when it is taken up."""
        if job.machine.state is not RequesterState.NEW:
            self._router.feed(job, ev.HolderCancelled())

    def on_answer(self, conn: Connection, message: wire.Offer | wire.ReadOffer | wire.Decline) -> None:
        """The serving end's answer to the fetch it names."""
        job = self._on.get(conn, {}).get(message.transfer)
        with self._lock:
            known = job is not None or message.transfer <= self._last_transfer
        if isinstance(message, wire.ReadOffer):
            problem, agent_known = self._load_agent(conn, message)
            if job is not None:
                assert job.reads is not None or self._nixl is None
                if job.reads is not None and problem is None and len(message.counts) == len(job.groups):
                    try:  # the runs there (cut again at this end's breaks when planned)
                        remote = tuple(message.checked_runs(g, group.slot_bytes) for g, group in enumerate(job.groups))
                    except wire.WireError as exc:
                        problem = f"peer {conn.label} offered rows that cannot lie in its memory: {exc}"
                    else:
                        job.reads.peer_agent, job.reads.remote = message.agent, remote
                        job.reads.remote_memories = message.memories
                self._router.feed(job, ev.ReadOffered(message.counts, problem, agent_known))
                return
        elif job is not None:
            if isinstance(message, wire.Offer) and job.receives is not None:
                job.receives.learn(message.breaks)  # later windows go as one message per run
            answer = (ev.Offered(message.counts, message.breaks) if isinstance(message, wire.Offer)
                      else ev.Declined(message.reason))
            self._router.feed(job, answer)
            return
        if not known and not isinstance(message, wire.Decline):
            self._router.drop(conn, f"peer {conn.label} answered a pull it was not asked (transfer {message.transfer})")
        # else: a pull given up on already; it needs no answer any more

    def _load_agent(self, conn: Connection, message: wire.ReadOffer) -> tuple[str | None, bool]:
        """Load a ReadOffer's NIXL metadata (sent once per generation, so it is loaded even
        for a pull given up on): why it is unusable, and whether the agent is known."""
        if self._nixl is None:
            return None, True
        try:
            if message.metadata:
                self._nixl.load_peer(message.agent, message.generation, message.metadata)
                conn.nixl_peer = message.agent
        except NixlError as exc:
            return f"peer {conn.label}'s NIXL agent is unusable: {exc}", True
        return None, self._nixl.knows(message.agent, message.generation)

    def connection_closed(self, conn: Connection) -> None:
        self._pushed.pop(conn, None)  # its fetches hear of the loss; nothing reads from them any more
        if conn.nixl_peer:
            self._forget_agents.add(conn.nixl_peer)  # once no read from it is in flight (reap_reads)

    def reap_reads(self) -> None:
        """Poll the reads in flight; forget the NIXL agents of closed connections no read uses."""
        for job in list(self.reading):
            assert job.reads is not None
            if not job.reads.running:
                self.reading.discard(job)
                continue
            event = job.reads.poll()
            if event is not None:
                self._router.feed(job, event)
        if self._forget_agents and self._nixl is not None:
            reading = {j.reads.peer_agent for j in self.reading if j.reads is not None}
            for agent in self._forget_agents - reading:
                if not any(c.nixl_peer == agent and not c.closed for c in self._wires.all):
                    self._nixl.forget_peer(agent)
            self._forget_agents &= reading

    def forget(self, job: FetchJob) -> None:
        """``job`` is done: it is no longer its connection's."""
        self.reading.discard(job)
        if job.pushed is not None:
            offer, job.pushed = job.pushed, None
            offer.fetches.discard(job)
            if job.conn is not None:
                self._answer_withdrawal(job.conn, offer)
        on = self._on.get(job.conn) if job.conn is not None else None
        if on is not None and on.get(job.transfer) is job:
            del on[job.transfer]
            if not on:
                del self._on[job.conn]  # type: ignore[arg-type]


#: Why a fetch answered from a pushed offer fails when the serving end withdrew that offer (its
#: holder cancelled it, it ran out, or the serving end shut down): as a ReadOffer's reader is told.
_WITHDRAWN = "the serving end withdrew the standing offer answering this pull (cancelled, ran out or shut down)"
