"""The requesting side of one engine: the fetches it runs on each connection, a fetch taken up
on the progress thread (its connection, its row mover, its first event), the serving end's
answers routed to the fetch they answer, and the NIXL agents it reads from.

Everything but :meth:`Requesting.machine` runs on the progress thread; what a fetch does is its
machine's (:mod:`kvwire_ucx.protocol.requester`), and every event goes to it through the
engine (:class:`~kvwire_ucx.jobs.Router`)."""

from __future__ import annotations

import secrets
import threading
import time

from kvwire.contract import View
from kvwire_ucx import wire
from kvwire_ucx.address import PeerAddress
from kvwire_ucx.connection import Connection, Connections
from kvwire_ucx.jobs import EngineContext, FetchJob, Router
from kvwire_ucx.nixl import NixlAgent, NixlError
from kvwire_ucx.nixl_reads import RangeReads
from kvwire_ucx.protocol import events as ev
from kvwire_ucx.protocol.requester import PullRequester, PullSpec, RequesterState
from kvwire_ucx.reactor import Reactor
from kvwire_ucx.regions import GroupRows
from kvwire_ucx.settings import UcxSettings
from kvwire_ucx.tag_rows import TagReceives, own_breaks

__all__ = ["Requesting"]


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
            job.reads = RangeReads(self._nixl, job.groups, str(job.address))
        else:
            job.receives = TagReceives(job.groups, job.machine.spec.tag_base, job.machine.breaks)
        remaining_ms = int((job.deadline - time.monotonic()) * 1000)
        self._router.feed(job, ev.Start(remaining_ms))

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
        on = self._on.get(job.conn) if job.conn is not None else None
        if on is not None and on.get(job.transfer) is job:
            del on[job.transfer]
            if not on:
                del self._on[job.conn]  # type: ignore[arg-type]
