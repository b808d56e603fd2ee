"""The progress thread of one :class:`~kvwire_ucx.backend.UcxBackend`: it owns the UCX worker,
the control connections and every pull, and it alone calls UCX.

It is the thin layer between the parts: the :class:`~kvwire_ucx.reactor.Reactor` runs the loop
(commands, timers, wakes, the sleep on the fds); :mod:`kvwire_ucx.connection` frames the control
sockets and keeps the endpoints; the protocol machines (:mod:`kvwire_ucx.protocol`) decide what a
pull does; the row movers (:mod:`kvwire_ucx.tag_rows`, :mod:`kvwire_ucx.nixl_reads`) move the
rows. The engine routes each frame, completion and timer to the pull it belongs to as an event,
and carries out the actions the machine returns (:meth:`Engine._feed`).

One rule of order: a holder's cancel, once it concluded an attempt, reaches that attempt's
machine before any later event does. Outcomes and quiescence are set under the engine lock, and
each attempt's ``wake`` is called after the lock is released (W1).

Why this file is longer than 500 lines: it is the one place where the holder's threads meet the
progress thread (the lock, the live attempts, the tickets) and where every event is routed; the
protocol, the reactor, the connections and the movers are already outside it. Splitting the
serving side's routing (``_on_pull`` to ``_send_read_offer``) into its own module is the next
step."""

from __future__ import annotations

import collections
import logging
import secrets
import selectors
import threading
import time
import weakref
from typing import Any

import numpy as np

from kvwire.contract import Attempt, Cause, Hint, InvalidSubmission, Outcome, SubmissionRejected, View
from kvwire.contract.backend import WakeFn
from kvwire.contract.serving import PullRequest
from kvwire_ucx import wire
from kvwire_ucx._ucx import context_config, ucx_api
from kvwire_ucx.address import PeerAddress, is_loopback
from kvwire_ucx.attempt import AttemptKind, UcxAttempt, WireStats
from kvwire_ucx.connection import Connection, Connections, ConnectionState, Endpoints
from kvwire_ucx.jobs import FetchJob, ReplyJob, Ticket
from kvwire_ucx.nixl import NixlAgent, NixlError
from kvwire_ucx.nixl_reads import RangeReads
from kvwire_ucx.protocol import events as ev
from kvwire_ucx.protocol.requester import PullRequester, PullSpec
from kvwire_ucx.protocol.server import PullServer, ReplySpec, ServerState
from kvwire_ucx.reactor import Reactor
from kvwire_ucx.regions import GroupRows
from kvwire_ucx.settings import UcxSettings
from kvwire_ucx.tag_rows import PostError, SelfDrain, TagReceives, TagSends

__all__ = ["Engine"]

log = logging.getLogger(__name__)

#: How many times one loop iteration progresses the worker before it looks at the sockets.
_PROGRESS_ROUNDS = 64
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

_engines: weakref.WeakSet[Engine] = weakref.WeakSet()

Job = FetchJob | ReplyJob


class Engine:
    """Owns the UCX worker, the control listener and every transfer of one backend."""

    def __init__(self, settings: UcxSettings) -> None:
        self.settings = settings
        self.instance = secrets.randbits(63)
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self._live: set[UcxAttempt] = set()
        self._tickets: dict[int, ReplyJob] = {}  # pull id -> reply, for tickets (guarded by the lock)
        self._incoming: collections.deque[ReplyJob] = collections.deque()
        self._serve_wake: WakeFn | None = None
        self._stats = collections.Counter[str]()
        self._transfer_ids = iter(range(1, 1 << 63))
        self._last_transfer = 0
        self._pull_ids = iter(range(1, 1 << 63))
        # Tag bases are handed out in order from a random start and never reused (2**40 of
        # them), so a stale message left by a drained receive can never match a later pull.
        self._next_tag_base = secrets.randbelow(wire.MAX_TAG_BASE)
        self._busy: set[Job] = set()               # pulls with receives or sends posted
        self._reading: set[FetchJob] = set()       # one-sided fetches with a read in flight
        self._read_replies: set[ReplyJob] = set()  # one-sided offers the requester has not finished
        self._forget_agents: set[bytes] = set()
        self._wiring_until = 0.0  # until then a peer may be wiring up to this end's NIXL agent
        self._stop_deadline: float | None = None

        net_devices = settings.net_devices or ("lo" if is_loopback(settings.listen_host) else "all")
        self._context = ucx_api.UCXContext(
            config_dict=context_config(net_devices), feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._worker_fd = self._worker.epoll_file_descriptor
        # Before the listener, so that a missing or failing NIXL leaves nothing behind.
        self.nixl: NixlAgent | None = None
        if settings.mode == "one-sided":
            self.nixl = NixlAgent(f"kvwire-ucx-{self.instance:016x}", loopback=is_loopback(settings.listen_host))
        self.reactor = Reactor()
        try:
            self.wires = Connections(self.reactor, settings.listen_host, settings.listen_port,
                                     settings.max_connections)
        except OSError:
            self.reactor.close()
            raise
        self.port = self.wires.port
        self.address = PeerAddress(settings.advertise_host or settings.listen_host, self.port, self.instance)
        self.endpoints = Endpoints(self._worker)
        self._drain = SelfDrain(self._worker, self.endpoints)
        self.reactor.register(self._worker_fd, selectors.EVENT_READ, "worker")
        self._thread = threading.Thread(target=self._run, name=f"kvwire-ucx:{self.port}", daemon=True)
        _engines.add(self)
        self._thread.start()

    # ================================================================ holder-side entry points

    def submit(self, fn: Any, *args: Any) -> None:
        self.reactor.submit(fn, *args)

    def live(self) -> int:
        with self._lock:
            return len(self._live)

    def _admit(self, attempt: UcxAttempt) -> None:
        with self._lock:
            if len(self._live) >= self.settings.max_in_flight:
                raise SubmissionRejected(f"kvwire-ucx has {self.settings.max_in_flight} attempts in flight "
                                         "(max_in_flight); retry later")
            self._live.add(attempt)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no attempt is in flight; whether that happened within ``timeout``."""
        with self.changed:
            return self.changed.wait_for(lambda: not self._live, timeout)

    def not_quiesced(self) -> frozenset[Attempt]:
        with self._lock:
            return frozenset(a for a in self._live if not a._quiesced)

    def concluded_at_once(self, view: View, kind: AttemptKind, wake: WakeFn, outcome: Outcome) -> UcxAttempt:
        """An attempt that needs no transfer: concluded and quiesced now, woken from the thread."""
        attempt = UcxAttempt(self, view, kind, wake)
        with self._lock:
            attempt._outcome = outcome
            attempt._quiesced = True
            attempt._reached("concluded")
            attempt._reached("quiesced")
        self.submit(self.reactor.wake_later, id(attempt), wake)
        return attempt

    def fetch(self, view: View, wake: WakeFn, address: PeerAddress, timeout_s: float, groups: tuple[GroupRows, ...],
              width: int, names: bytes, credentials: bytes) -> UcxAttempt:
        """Engine side of ``fetch()``: the attempt, taken up on the thread."""
        with self._lock:
            transfer = next(self._transfer_ids)
            self._last_transfer = transfer
            tag_base = self._next_tag_base
            self._next_tag_base = (tag_base + 1) % wire.MAX_TAG_BASE  # MAX_TAG_BASE is the probe's
        spec = PullSpec(transfer, tag_base, tuple(g.group_id for g in groups), tuple(g.slot_bytes for g in groups),
                        view.groups[0].rows, width, names, timeout_s, self.settings.window_bytes,
                        one_sided=self.nixl is not None, credentials=credentials, peer=str(address))
        machine = PullRequester(spec)
        attempt = UcxAttempt(self, view, AttemptKind.FETCH, wake, masks=machine.masks)
        self._admit(attempt)
        job = FetchJob(attempt, machine, address, time.monotonic() + timeout_s, groups)
        attempt._job = job
        self.submit(self._start_fetch, job)
        return attempt

    def publish(self, view: View, wake: WakeFn, pull_id: int, groups: tuple[GroupRows, ...],
                refusal_of: Any, timeout_s: float | None) -> UcxAttempt:
        """Engine side of ``publish(view, ticket)``: claim the ticket, then answer on the thread."""
        with self._lock:
            job = self._tickets.get(pull_id)
            if job is None or job.ticket is Ticket.CLAIMED:
                raise InvalidSubmission(f"pull {pull_id} is unknown or was already answered; answer each request once")
            job.claimed_from, job.ticket = job.ticket, Ticket.CLAIMED
        attempt = UcxAttempt(self, view, AttemptKind.PUBLISH, wake)
        try:
            self._admit(attempt)
        except SubmissionRejected:
            with self._lock:  # give the ticket back: nothing escaped
                if job.ticket is Ticket.CLAIMED:
                    job.ticket = job.claimed_from
            raise
        refusal = refusal_of(view, job.request)
        deadline = job.expires_at if timeout_s is None else min(job.expires_at, time.monotonic() + timeout_s)
        self.submit(self._answer, job, attempt, groups, tuple(g.rows for g in view.groups), refusal, deadline)
        return attempt

    def decline(self, pull_id: int, reason: str) -> bool:
        """Engine side of ``decline()``; whether the request was still answerable."""
        with self._lock:
            job = self._tickets.get(pull_id)
            if job is None or job.ticket is Ticket.CLAIMED:
                return False
            job.claimed_from, job.ticket = job.ticket, Ticket.CLAIMED
        self.submit(self._feed, job, ev.HolderDeclined(reason))
        return True

    def cancel(self, attempt: UcxAttempt) -> None:
        """Conclude ``attempt`` cancelled now unless it concluded already; its machine hears of
        it on the thread before anything else that happens to it."""
        masks = tuple(m.copy() for m in attempt._masks)
        outcome = Outcome.cancelled(masks, reason="cancelled by the holder", cause=Cause.HOLDER_CANCELLED)
        with self._lock:
            if attempt._outcome is not None:
                return
            attempt._outcome = outcome
            attempt._cancel_requested = True
            attempt._reached("concluded")
            if attempt._quiesced:
                self._retire(attempt)
        self.submit(self._holder_cancelled, attempt)

    def start_serving(self, wake: WakeFn) -> None:
        with self._lock:
            self._serve_wake = wake

    def take_incoming(self) -> tuple[PullRequest, ...]:
        out = []
        with self._lock:
            while self._incoming:
                job = self._incoming.popleft()
                if job.ticket is Ticket.OPEN:
                    job.surfaced = True
                    out.append(job.request)
        return tuple(out)

    def stats(self) -> WireStats:
        with self._lock:
            return WireStats(**{k: self._stats[k] for k in WireStats.__dataclass_fields__})

    def begin_shutdown(self) -> None:
        self.submit(self._shutdown)

    def force_close(self) -> None:
        """Shut down, and give up on peers that do not finish (``close()``)."""
        self.submit(self._shutdown)
        self.submit(self._force_all)

    def join(self, timeout: float) -> bool:
        """Wait for the thread to exit (it does once shut down with nothing in flight)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ================================================================ conclusion and waking

    def _retire(self, attempt: UcxAttempt) -> None:  # under the lock
        self._live.discard(attempt)
        self.changed.notify_all()

    def _conclude(self, attempt: UcxAttempt, outcome: Outcome) -> None:
        with self._lock:
            if attempt._outcome is not None:
                return
            attempt._outcome = outcome
            attempt._reached("concluded")
            if attempt._quiesced:
                self._retire(attempt)
        self.reactor.wake_later(id(attempt), attempt._wake)

    def _quiesce(self, attempt: UcxAttempt) -> None:
        with self._lock:
            if attempt._quiesced:
                return
            attempt._quiesced = True
            attempt._reached("quiesced")
            if attempt._outcome is not None:
                self._retire(attempt)
        self.reactor.wake_later(id(attempt), attempt._wake)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    # ================================================================ feeding the machines

    def _feed(self, job: Job, event: Any) -> None:
        """Hand ``event`` to the job's machine and carry out its actions (and the events those
        give rise to, in order)."""
        pending = collections.deque([event])
        while pending and not job.finished:
            event = pending.popleft()
            attempt = job.attempt
            if isinstance(event, ev.HolderCancelled):
                if job.cancel_fed:
                    continue
                job.cancel_fed = True
            elif attempt is not None and not job.cancel_fed and attempt._cancel_requested:
                job.cancel_fed = True
                pending.appendleft(event)
                event = ev.HolderCancelled()
            for action in job.machine.handle(event):
                follow = self._do(job, action)
                if follow is not None:
                    pending.append(follow)
        if job.finished:
            self._forget(job)
        elif isinstance(job, ReplyJob) and job.machine.state is ServerState.GONE:
            self._reply_gone(job)

    def _do(self, job: Job, action: ev.Action) -> Any:
        """Carry out one action; the event it gave rise to at once, if any."""
        conn = job.conn
        if isinstance(action, ev.Send):
            if isinstance(action.message, wire.Ack | wire.Cancel) and isinstance(job, FetchJob):
                self._tell(job, action.message)
            elif conn is not None:
                self._send(conn, action.message)
        elif isinstance(action, ev.PostReceives):
            assert isinstance(job, FetchJob) and job.receives is not None
            self._busy.add(job)
            try:
                job.receives.post(self._worker, action.start, action.end, action.counts)
            except PostError as exc:
                return ev.PostFailed(str(exc), exc.reached)
        elif isinstance(action, ev.Drain):
            assert isinstance(job, FetchJob) and job.receives is not None
            self._drain.send(job.receives.drain_tags(action.counts))
        elif isinstance(action, ev.SendRows):
            assert isinstance(job, ReplyJob) and job.sends is not None and conn is not None
            self._busy.add(job)
            try:
                job.sends.post(conn.ep, action.start, action.end, action.counts, job.machine.limit)
            except PostError as exc:
                return ev.SendFailed(str(exc), exc.posted)
        elif isinstance(action, ev.SendReadOffer):
            assert isinstance(job, ReplyJob)
            self._send_read_offer(job, action.counts)
        elif isinstance(action, ev.PlanReads):
            assert isinstance(job, FetchJob) and job.reads is not None
            job.reads.plan(action.counts, action.ranges)
        elif isinstance(action, ev.StartRead):
            assert isinstance(job, FetchJob) and job.reads is not None
            self._reading.add(job)
            return job.reads.start(action.index)
        elif isinstance(action, ev.ReleaseRead):
            assert isinstance(job, FetchJob) and job.reads is not None
            if job.reads.release():
                return ev.ReadStopped()
        elif isinstance(action, ev.Conclude):
            if job.attempt is not None:
                self._conclude(job.attempt, action.outcome)
        elif isinstance(action, ev.Quiesce):
            if job.attempt is not None:
                self._quiesce(job.attempt)
        elif isinstance(action, ev.Note):
            if job.attempt is not None:
                job.attempt._reached(action.step)
        elif isinstance(action, ev.ArmDeadline):
            self.reactor.call_later(job.deadline - time.monotonic(), lambda: self._on_timer(job, ev.DeadlinePassed()))
        elif isinstance(action, ev.ArmGrace):
            self.reactor.call_later(self.settings.grace_s, lambda: self._on_timer(job, ev.GraceExpired()))
        elif isinstance(action, ev.Violation):
            if conn is not None:
                self._drop(conn, action.reason)
        elif isinstance(action, ev.CloseConnection):
            if conn is not None:
                self._close(conn, action.reason, lost=action.lost)
        elif isinstance(action, ev.Count):
            self._count(action.key, action.n)
        else:  # pragma: no cover
            raise TypeError(f"unknown action {action!r}")
        return None

    def _on_timer(self, job: Job, event: Any) -> None:
        if not job.finished:
            self._feed(job, event)

    def _tell(self, job: FetchJob, message: wire.Ack | wire.Cancel) -> None:
        """Send the serving end a fetch's last word (its machine says it once). A seam that
        tests/runtime/test_worker_peer.py wraps to slow the Ack down."""
        if job.conn is not None:
            self._send(job.conn, message)

    def _timer(self, delay: float, fn: Any) -> None:
        """Run ``fn`` on the thread after ``delay`` seconds (a seam tests use)."""
        self.reactor.call_later(delay, fn)

    def _holder_cancelled(self, attempt: UcxAttempt) -> None:
        job = attempt._job
        if isinstance(job, FetchJob) and job.machine.state.name != "NEW" or isinstance(job, ReplyJob):
            self._feed(job, ev.HolderCancelled())
        # a fetch not yet taken up hears of it when it is (_start_fetch)

    def _forget(self, job: Job) -> None:
        self._busy.discard(job)
        if isinstance(job, FetchJob):
            self._reading.discard(job)
            if job.conn is not None and job.conn.fetches.get(job.transfer) is job:
                del job.conn.fetches[job.transfer]
            return
        self._read_replies.discard(job)
        if job.conn.replies.get(job.transfer) is job:
            del job.conn.replies[job.transfer]
        with self._lock:
            if self._tickets.get(job.pull_id) is job:
                del self._tickets[job.pull_id]

    # ================================================================ the loop (reactor driver)

    def _run(self) -> None:
        try:
            self.reactor.run(self, self.port)
        finally:
            self._teardown()
            with self._lock:
                self.changed.notify_all()

    def progress(self) -> None:
        for _ in range(_PROGRESS_ROUNDS):
            if not self._worker.progress_once():
                break
        if self.endpoints.failed:
            for conn in self.endpoints.take_failed():
                # What the peer said before it went (a Cancel, an Ack) is still in the socket;
                # hear it out first, so the outcome says what the peer meant.
                while not conn.closed and self._on_readable(conn):
                    pass
                self._close(conn, f"peer {conn.label} is gone: its UCX endpoint failed", lost=True)

    def reap(self) -> None:
        if self._read_replies and self.nixl is not None:
            self.nixl.progress()
        for job in list(self._reading):
            assert job.reads is not None
            if not job.reads.running:
                self._reading.discard(job)
                continue
            event = job.reads.poll()
            if event is not None:
                self._feed(job, event)
        if self._forget_agents and self.nixl is not None:
            reading = {j.reads.peer_agent for j in self._reading if j.reads is not None}
            for agent in self._forget_agents - reading:
                if not any(c.nixl_peer == agent and not c.closed for c in self.wires.all):
                    self.nixl.forget_peer(agent)
            self._forget_agents &= reading
        if self.endpoints.dying:
            self.endpoints.bury()
        self.endpoints.reap()
        for job in list(self._busy):
            mover = job.receives if isinstance(job, FetchJob) else job.sends
            done = mover.reap() if mover is not None else None
            if done is not None:
                self._feed(job, done)
            if mover is None or not mover.posted:
                self._busy.discard(job)

    def spinning(self) -> bool:
        return bool(self._reading)

    def arm(self) -> bool:
        return bool(self._worker.arm())

    def sleep_cap(self) -> float:
        if self._read_replies:
            return _NIXL_WIREUP_POLL_S if time.monotonic() < self._wiring_until else _NIXL_SERVE_POLL_S
        return 1.0

    def on_ready(self, data: Any, events: int) -> None:
        if data is self.wires:
            for _ in self.wires.accept():
                self._count("connections_opened")
        elif isinstance(data, Connection):
            if events & selectors.EVENT_WRITE:
                problem = self.wires.writable(data)
                if problem is not None:
                    self._close(data, problem, lost=True)
            if events & selectors.EVENT_READ and not data.closed:
                self._on_readable(data)

    def can_exit(self) -> bool:
        with self._lock:
            if self._live:
                return False
        return not any(c.out for c in self.wires.all) or (
            self._stop_deadline is not None and time.monotonic() >= self._stop_deadline)

    def _teardown(self) -> None:
        for conn in list(self.wires.all):
            self._close(conn, "the backend shut down")
        self.endpoints.teardown(self._worker_fd)
        self._drain.close()
        self.endpoints.release()
        with self._lock:
            self._tickets.clear()
            self._incoming.clear()
        self.wires.close_listener()
        self.reactor.close()
        if self.nixl is not None:
            self.nixl.close()
        # endpoints went with their connections; the worker before its context
        self._worker = None
        self._context = None

    # ================================================================ connections

    def _send(self, conn: Connection, message: wire.Message) -> None:
        problem = self.wires.send(conn, message)
        if problem is not None:
            self._close(conn, problem, lost=True)

    def _on_readable(self, conn: Connection) -> bool:
        """Read and handle what arrived; whether anything did."""
        messages, problem, malformed = self.wires.read(conn)
        if problem is not None:
            if malformed:
                self._drop(conn, problem)
            else:
                self._close(conn, problem, lost=True)
            return False
        if messages is None:
            return False
        for message in messages:
            if conn.closed:
                return False
            self._dispatch(conn, message)
        return True

    def _drop(self, conn: Connection, reason: str) -> None:
        """Close a connection whose peer sent garbage or broke the protocol, and count it."""
        log.warning("kvwire-ucx on port %d drops a connection: %s", self.port, reason)
        self._count("connections_dropped")
        self._close(conn, reason, cause=Cause.FAULT)

    def _close(self, conn: Connection, reason: str, *, lost: bool = False, cause: Cause | None = None) -> None:
        """End the connection and every pull on it (each hears :class:`ConnectionLost`)."""
        if not self.wires.close(conn):
            return
        if lost:
            self._count("connections_lost")
        log.debug("kvwire-ucx on port %d closes connection to %s: %s", self.port, conn.label, reason)
        if conn.nixl_peer:
            self._forget_agents.add(conn.nixl_peer)  # once no read from it is in flight (reap)
        if lost:
            self.endpoints.lost(conn)
        else:
            self.endpoints.close(conn)
        event = ev.ConnectionLost(reason, cause or (Cause.PEER_GONE if lost else Cause.FAULT))
        for fetch in list(conn.fetches.values()):
            self._feed(fetch, event)
        for reply in list(conn.replies.values()):
            self._feed(reply, event)

    def _dispatch(self, conn: Connection, message: wire.Message) -> None:
        if isinstance(message, wire.Hello):
            self._on_hello(conn, message)
            return
        if conn.state is not ConnectionState.OPEN:
            self._drop(conn, f"peer {conn.label} sent {type(message).__name__} before Hello")
            return
        if conn.outbound:
            if isinstance(message, wire.Offer | wire.ReadOffer | wire.Decline):
                self._on_answer(conn, message)
            else:
                self._drop(conn, f"serving peer {conn.label} sent {type(message).__name__}, which only requesters send")
            return
        if isinstance(message, wire.Pull):
            self._on_pull(conn, message)
            return
        if not isinstance(message, wire.Go | wire.Cancel | wire.Ack):
            self._drop(conn, f"requesting peer {conn.label} sent {type(message).__name__}, which only servers send")
            return
        reply = conn.replies.get(message.transfer)
        if reply is None:
            if isinstance(message, wire.Go):
                self._drop(conn, f"peer {conn.label} named rows of transfer {message.transfer}, which was not offered")
            return  # an Ack or Cancel for a pull over at this end
        if isinstance(message, wire.Go):
            self._feed(reply, ev.GoReceived(message.start, message.end))
        elif isinstance(message, wire.Cancel):
            self._feed(reply, ev.CancelReceived(message.reason))
        else:
            self._feed(reply, ev.AckReceived(message.rows))

    def _on_hello(self, conn: Connection, message: wire.Hello) -> None:
        if conn.state is ConnectionState.OPEN:
            self._drop(conn, f"peer {conn.label} sent a second Hello")
            return
        if conn.outbound and conn.address is not None and message.instance != conn.address.instance:
            log.warning("kvwire-ucx on port %d: %s answers as instance %#x, its address names %#x; closing it as stale",
                        self.port, conn.label, message.instance, conn.address.instance)
            self._close(conn, f"another kvwire-ucx backend answers at {conn.label} (instance {message.instance:#x}, "
                              f"the address names {conn.address.instance:#x}); the address is stale", lost=True)
            return
        problem = self.endpoints.make(conn, message.worker_address)
        if problem is not None:
            self._close(conn, problem, lost=True)
            return
        conn.state = ConnectionState.OPEN
        if not conn.outbound:
            self._send(conn, wire.Hello(self.instance, bytes(self._worker.address)))

    # ================================================================ requesting side

    def _start_fetch(self, job: FetchJob) -> None:
        if job.attempt._cancel_requested:  # cancelled before it was taken up
            self._feed(job, ev.HolderCancelled())
            return
        if self.reactor.stopping:
            self._feed(job, ev.Shutdown())
            return
        conn = self.wires.outbound(job.address)
        if conn is None:
            self._count("connections_opened")
            conn, problem = self.wires.connect(job.address, wire.Hello(self.instance, bytes(self._worker.address)))
            if problem is not None:
                failed = conn
                self.reactor.call_later(0.0, lambda: self._close(failed, problem, lost=True))
        job.conn = conn
        conn.fetches[job.transfer] = job
        if self.nixl is not None:
            job.reads = RangeReads(self.nixl, job.groups, str(job.address))
        else:
            job.receives = TagReceives(job.groups, job.machine.spec.tag_base)
        remaining_ms = int((job.deadline - time.monotonic()) * 1000)
        self._feed(job, ev.Start(remaining_ms))

    def _on_answer(self, conn: Connection, message: wire.Offer | wire.ReadOffer | wire.Decline) -> None:
        job = conn.fetches.get(message.transfer)
        known = job is not None or message.transfer <= self._last_transfer
        if isinstance(message, wire.ReadOffer):
            problem, agent_known = self._load_agent(conn, message)
            if job is not None:
                assert job.reads is not None or self.nixl is None
                if job.reads is not None:
                    job.reads.peer_agent, job.reads.remote = message.agent, message.addresses
                self._feed(job, ev.ReadOffered(message.counts, problem, agent_known))
                return
        elif job is not None:
            self._feed(job, ev.Offered(message.counts) if isinstance(message, wire.Offer) else ev.Declined(message.reason))
            return
        if not known and not isinstance(message, wire.Decline):
            self._drop(conn, f"peer {conn.label} answered a pull it was not asked (transfer {message.transfer})")
        # else: a pull given up on already; it needs no answer any more

    def _load_agent(self, conn: Connection, message: wire.ReadOffer) -> tuple[str | None, bool]:
        """Load a ReadOffer's NIXL metadata (sent once per generation, so it is loaded even
        for a pull given up on): why it is unusable, and whether the agent is known."""
        if self.nixl is None:
            return None, True
        try:
            if message.metadata:
                self.nixl.load_peer(message.agent, message.generation, message.metadata)
                conn.nixl_peer = message.agent
        except NixlError as exc:
            return f"peer {conn.label}'s NIXL agent is unusable: {exc}", True
        return None, self.nixl.knows(message.agent, message.generation)

    # ================================================================ serving side

    def _on_pull(self, conn: Connection, message: wire.Pull) -> None:
        self._count("pulls_received")
        if message.transfer in conn.replies:
            self._drop(conn, f"peer {conn.label} reused transfer id {message.transfer}")
            return
        if self.reactor.stopping:
            self._decline_now(conn, message.transfer, "not serving: the serving end is shutting down")
            return
        with self._lock:
            wake = self._serve_wake
            waiting = sum(1 for r in self._tickets.values() if r.ticket is Ticket.OPEN)
        if wake is None:
            self._decline_now(conn, message.transfer, "not serving: the peer's holder has not started serving pulls")
            return
        mode = "one-sided" if self.nixl is not None else "two-sided"
        if message.one_sided != (self.nixl is not None):
            # Modes never mix: a process that loaded NIXL must not run two-sided rendezvous
            # (see the README: UCX 1.21 can crash there when a peer dies).
            asked = "one-sided" if message.one_sided else "two-sided"
            self._decline_now(conn, message.transfer, f"this end serves {mode} pulls only (option mode={mode!r}); "
                                                      f"the pull is {asked}")
            return
        if waiting >= self.settings.max_pending_pulls:
            self._decline_now(conn, message.transfer, f"busy: {waiting} pulls are already waiting for the serving holder")
            return
        pull_id = next(self._pull_ids)
        timeout_s = message.timeout_ms / 1000.0
        request = PullRequest(
            ticket=Hint.of("ticket", timeout_s=timeout_s, backend=self.instance, pull=pull_id),
            groups=tuple(g for g, _ in message.groups),
            slot_bytes=tuple(s for _, s in message.groups),
            names=np.frombuffer(message.names, dtype=np.uint8).reshape(message.count, message.width),
            peer=conn.label,
            credentials=message.credentials,
        )
        spec = ReplySpec(message.transfer, message.credit, len(message.groups), message.count,
                         one_sided=message.one_sided, peer=conn.label)
        job = ReplyJob(pull_id, conn, PullServer(spec), request, time.monotonic() + timeout_s, message.tag_base)
        conn.replies[message.transfer] = job
        with self._lock:
            self._tickets[pull_id] = job
            self._incoming.append(job)
        self.reactor.call_later(timeout_s, lambda: self._wait_expired(job))
        self.reactor.wake_later("serve", wake)

    def _decline_now(self, conn: Connection, transfer: int, reason: str) -> None:
        self._count("pulls_declined")
        self._send(conn, wire.Decline(transfer, wire.clip_reason(reason)))

    def _wait_expired(self, job: ReplyJob) -> None:
        with self._lock:
            unclaimed = job.ticket is Ticket.OPEN
        if unclaimed and job.machine.state is ServerState.WAITING:
            self._feed(job, ev.WaitExpired())

    def _reply_gone(self, job: ReplyJob) -> None:
        """A reply that went GONE is no longer the connection's; its ticket lingers if the holder
        saw the request (so a late answer learns why), else it goes."""
        if job.conn.replies.get(job.transfer) is job:
            del job.conn.replies[job.transfer]
        with self._lock:
            if job.ticket is Ticket.OPEN:
                job.ticket = Ticket.EXPIRED
            linger = job.ticket is Ticket.EXPIRED and job.surfaced
            if job.ticket is Ticket.EXPIRED and not linger:
                self._tickets.pop(job.pull_id, None)
        if linger:
            self.reactor.call_later(max(0.0, job.expires_at - time.monotonic()) + _TICKET_LINGER_S,
                                    lambda: self._drop_ticket(job))

    def _drop_ticket(self, job: ReplyJob) -> None:
        with self._lock:
            if self._tickets.get(job.pull_id) is job and job.ticket is Ticket.EXPIRED:
                del self._tickets[job.pull_id]

    def _answer(self, job: ReplyJob, attempt: UcxAttempt, groups: tuple[GroupRows, ...], rows: tuple[int, ...],
                refusal: str | None, deadline: float) -> None:
        job.attempt = attempt
        attempt._job = job
        job.groups = groups
        job.deadline = deadline
        if attempt._cancel_requested:  # the holder cancelled it before it went out
            job.cancel_fed = True
            self._feed(job, ev.AnswerWithdrawn())
            return
        counts = rows
        if job.machine.state is ServerState.WAITING and refusal is None:
            if self.nixl is not None:
                counts = self._prepare_read_offer(job, rows)
            else:
                job.sends = TagSends(groups, job.tag_base)
        self._feed(job, ev.Answered(counts, rows, refusal))

    def _prepare_read_offer(self, job: ReplyJob, counts: tuple[int, ...]) -> tuple[int, ...]:
        """This end's NIXL metadata (when the connection was not sent this generation) and the
        longest common block prefix whose ReadOffer fits in one frame (still a valid answer)."""
        assert self.nixl is not None
        generation, metadata = self.nixl.metadata()
        if job.conn.nixl_sent == generation:
            metadata = b""
        agent = self.nixl.name.encode()
        job.read_offer = (generation, metadata, agent)
        return _fit_read_offer(counts, agent, metadata)

    def _send_read_offer(self, job: ReplyJob, counts: tuple[int, ...]) -> None:
        assert job.read_offer is not None
        generation, metadata, agent = job.read_offer
        addresses = []
        for group, count in zip(job.groups, counts, strict=True):
            if count == 0 or group.span is None:
                addresses.append(np.zeros(0, dtype=np.uint64))
                continue
            base = group.span.__array_interface__["data"][0]
            addresses.append(group.offsets[:count] + np.uint64(base))
        self._send(job.conn, wire.ReadOffer(job.transfer, counts, agent, generation, metadata, tuple(addresses)))
        if metadata:
            self._wiring_until = time.monotonic() + _NIXL_WIREUP_S
        job.conn.nixl_sent = generation
        self._read_replies.add(job)

    # ================================================================ shutdown

    def _shutdown(self) -> None:
        if self.reactor.stopping:
            return
        self.reactor.stopping = True
        self._stop_deadline = time.monotonic() + self.settings.grace_s
        self.wires.close_listener()
        for conn in list(self.wires.all):
            for fetch in list(conn.fetches.values()):
                self._feed(fetch, ev.Shutdown())
            for reply in list(conn.replies.values()):
                if reply.machine.state is ServerState.WAITING or reply.attempt is not None:
                    self._feed(reply, ev.Shutdown())
        self.reactor.call_later(self.settings.grace_s, self._force_all)

    def _force_all(self) -> None:
        for conn in list(self.wires.all):
            if conn.fetches or conn.replies:
                self._close(conn, "the backend shut down and the peer did not finish within the grace")

    @classmethod
    def stop_all(cls, timeout: float = 2.0) -> None:
        """At interpreter exit: shut every engine down and wait briefly for its thread."""
        for engine in list(_engines):
            engine.force_close()
        for engine in list(_engines):
            engine.join(timeout)


def _fit_read_offer(counts: tuple[int, ...], agent: bytes, metadata: bytes) -> tuple[int, ...]:
    """``counts`` cut to the longest common block prefix whose ReadOffer fits in one frame."""
    if wire.ReadOffer.body_bytes(counts, agent, metadata) <= wire.MAX_MESSAGE_BYTES:
        return counts
    lo, hi = 0, max(counts)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if wire.ReadOffer.body_bytes(tuple(min(c, mid) for c in counts), agent, metadata) <= wire.MAX_MESSAGE_BYTES:
            lo = mid
        else:
            hi = mid - 1
    return tuple(min(c, lo) for c in counts)
