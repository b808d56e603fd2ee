"""The progress thread of one :class:`~kvwire_ucx.backend.UcxBackend`: it owns the UCX worker,
the control connections and every pull, and it alone calls UCX.

It is the thin layer between the parts: the :class:`~kvwire_ucx.reactor.Reactor` runs the loop
(commands, timers, wakes, the sleep on the fds); :mod:`kvwire_ucx.connection` frames the control
sockets and keeps the endpoints; the protocol machines (:mod:`kvwire_ucx.protocol`) decide what a
pull does; the row movers (:mod:`kvwire_ucx.tag_rows`, :mod:`kvwire_ucx.nixl_reads`) move the
rows; the two sides (:mod:`kvwire_ucx.requesting`, :mod:`kvwire_ucx.serving`) keep the pulls of
each end. The engine routes each frame, completion and timer to the pull it belongs to as an
event, and carries out the actions the machine returns (:meth:`Engine.feed`).

One rule of order: a holder's cancel, once it concluded an attempt, reaches that attempt's
machine before any later event does. Outcomes and quiescence are set under the engine lock
(kvwire's one :class:`~kvwire.attempts.AttemptTable`), and the wakes they owe are called after the
lock is released, once per distinct wake callable (W1, the W1.8 note: the reactor's wakes).

Why one file of this size: the engine is the one router between the parts above;
its holder entry points, its action table (:meth:`Engine._do`) and its connection handling all
feed the same machines and are read together when following one pull."""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import selectors
import threading
import time
import weakref
from typing import Any

from kvwire import waiting
from kvwire.attempts import AttemptTable, deadline_after
from kvwire.contract import Attempt, Cause, Outcome, SubmissionRejected, View
from kvwire.contract.backend import WakeFn
from kvwire.contract.serving import PullRequest
from kvwire_ucx import wire
from kvwire_ucx._ucx import context_config, ucx_api
from kvwire_ucx.address import PeerAddress, is_loopback
from kvwire_ucx.attempt import AttemptKind, UcxAttempt, WireStats
from kvwire_ucx.connection import Connection, Connections, ConnectionState, Endpoints
from kvwire_ucx.cuda import CudaError, make_current, reaches_cuda
from kvwire_ucx.faults import Faults, FrameFlow
from kvwire_ucx.jobs import FetchJob, Job, ReplyJob
from kvwire_ucx.nixl import NixlAgent
from kvwire_ucx.offers import OfferedGroup, StandingOffer
from kvwire_ucx.protocol import events as ev
from kvwire_ucx.protocol.server import ServerState
from kvwire_ucx.reactor import Reactor
from kvwire_ucx.regions import GroupRows
from kvwire_ucx.requesting import PushedAnswer, Requesting
from kvwire_ucx.serving import Serving
from kvwire_ucx.settings import MEMORY_KINDS, WITH_DEVICE, UcxSettings
from kvwire_ucx.tag_rows import PostError, SelfDrain

__all__ = ["Engine"]

log = logging.getLogger(__name__)

#: How many times one loop iteration progresses the worker before it looks at the sockets.
_PROGRESS_ROUNDS = 64

_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


def _use_device(device: int) -> None:
    try:
        make_current(device)
    except CudaError as exc:  # UCX then copies device rows without a context and fails them, each named
        log.error("kvwire-ucx cannot make CUDA device %d current on its progress thread: %s", device, exc)


class Engine:
    """Owns the UCX worker, the control listener and every transfer of one backend.

    :attr:`faults` is the seam tests inject faults through (:mod:`kvwire_ucx.faults`)."""

    def __init__(self, settings: UcxSettings) -> None:
        self.settings = settings
        self.instance = secrets.randbits(63)
        self._lock = threading.Lock()
        self.attempts: AttemptTable[UcxAttempt] = AttemptTable(settings.max_in_flight, lock=self._lock,
                                                               name="kvwire-ucx")
        self._stats = collections.Counter[str]()  # guarded by the lock
        self._busy: set[Job] = set()  # pulls with receives or sends posted
        self._stop_deadline: float | None = None

        net_devices = settings.net_devices or ("lo" if is_loopback(settings.listen_host) else "all")
        self._context = ucx_api.UCXContext(
            config_dict=context_config(net_devices), feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        #: HOST, and DEVICE where this process's UCX reaches CUDA memory (its cuda module loaded).
        self.memory_kinds = WITH_DEVICE if reaches_cuda(self._context) else MEMORY_KINDS
        self._worker = ucx_api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._worker_fd = self._worker.epoll_file_descriptor
        # Before the listener, so that a missing or failing NIXL leaves nothing behind.
        self.nixl: NixlAgent | None = None
        if settings.mode == "one-sided":
            self.nixl = NixlAgent(f"kvwire-ucx-{self.instance:016x}", loopback=is_loopback(settings.listen_host))
        self.reactor = Reactor(spin_s=settings.spin_us / 1e6)
        try:
            self.wires = Connections(self.reactor, settings.listen_host, settings.listen_port,
                                     settings.max_connections)
        except OSError:
            self.reactor.close()
            raise
        self.port = self.wires.port
        self.address = PeerAddress(settings.advertise_host or settings.listen_host, self.port, self.instance)
        # A one-sided end takes pushed offers (wire version 4): its fetches read what they cover
        # without asking.
        self._hello = wire.Hello(self.instance, bytes(self._worker.address),
                                 wire.HELLO_TAKES_PUSHES if self.nixl is not None else 0)
        self._offer_ids = itertools.count(1)
        self.endpoints = Endpoints(self._worker)
        self._drain = SelfDrain(self._worker, self.endpoints)
        self.requesting = Requesting(self, self._lock, settings, self.nixl, self.reactor, self.wires, self._hello)
        self.serving = Serving(self, self._lock, settings, self.nixl, self.reactor, self.instance)
        self.faults = Faults(self.reactor, self.send, self._dispatch)
        self.reactor.register(self._worker_fd, selectors.EVENT_READ, "worker")
        self._thread = threading.Thread(target=self._run, name=f"kvwire-ucx:{self.port}", daemon=True)
        _engines.add(self)
        self._thread.start()

    # ================================================================ holder-side entry points

    def submit(self, fn: Any, *args: Any) -> None:
        self.reactor.submit(fn, *args)

    def use_device(self, device: int) -> None:
        """Make ``device``'s CUDA context current on the progress thread, which posts the UCX
        requests of device rows (UCX's CUDA copies run in the calling thread's context)."""
        self.submit(_use_device, device)

    def live(self) -> int:

        return len(self.attempts)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no attempt is in flight; whether that happened within ``timeout`` (any
        finite number of seconds: a large ``grace_s`` is fine)."""
        return self.attempts.wait_idle(timeout)

    def not_quiesced(self) -> frozenset[Attempt]:
        return self.attempts.not_quiesced()

    def concluded_at_once(self, view: View, kind: AttemptKind, wake: WakeFn, outcome: Outcome) -> UcxAttempt:
        """An attempt that needs no transfer: concluded and quiesced now, woken from the thread."""
        attempt = UcxAttempt(self.cancel, view, kind, wake)
        self.attempts.settle(attempt, outcome)
        attempt.reached("concluded")
        attempt.reached("quiesced")
        self.submit(self.reactor.wake_later, wake)
        return attempt

    def fetch(self, view: View, wake: WakeFn, address: PeerAddress, timeout_s: float, groups: tuple[GroupRows, ...],
              width: int, names: bytes, credentials: bytes) -> UcxAttempt:
        """Engine side of ``fetch()``: the attempt, taken up on the thread."""
        machine = self.requesting.machine(view, address, timeout_s, groups, width, names, credentials)
        attempt = UcxAttempt(self.cancel, view, AttemptKind.FETCH, wake, masks=machine.masks,
                             deadline=deadline_after(timeout_s))
        self.attempts.admit(attempt)
        job = FetchJob(attempt, machine, address, attempt.deadline, groups)
        attempt.job = job
        if self.nixl is not None:  # one-sided: taking a fetch up sends its Pull and calls no UCX
            self.reactor.run_here(self.requesting.start, job)
        else:  # two-sided: it posts the first window's receives, which are the progress thread's
            self.submit(self.requesting.start, job)
        return attempt

    def publish(self, view: View, wake: WakeFn, pull_id: int, groups: tuple[GroupRows, ...],
                refusal_of: Any, timeout_s: float | None) -> UcxAttempt:
        """Engine side of ``publish(view, ticket)``: claim the ticket, then answer on the thread."""
        job = self.serving.claim(pull_id)
        attempt = UcxAttempt(self.cancel, view, AttemptKind.PUBLISH, wake)
        try:
            self.attempts.admit(attempt)
        except SubmissionRejected:
            self.serving.unclaim(job)  # nothing escaped
            raise
        refusal = refusal_of(view, job.request)
        deadline = job.expires_at if timeout_s is None else min(job.expires_at, deadline_after(timeout_s))
        attempt.deadline = deadline
        answer = (self.serving.answer, job, attempt, groups, tuple(g.rows for g in view.groups), refusal, deadline)
        if self.nixl is not None:  # one-sided: the answer is a ReadOffer on the socket, no UCX call
            self.reactor.run_here(*answer)
        else:  # two-sided: it posts the first rows' sends
            self.submit(*answer)
        return attempt

    def offer(self, view: View, wake: WakeFn, groups: dict[int, OfferedGroup], timeout_s: float) -> UcxAttempt:
        """Engine side of ``offer()`` (O1): the attempt, standing once the thread takes it up."""
        attempt = UcxAttempt(self.cancel, view, AttemptKind.OFFER, wake, deadline=deadline_after(timeout_s))
        self.attempts.admit(attempt)
        offer = StandingOffer(attempt, groups, attempt.deadline, next(self._offer_ids))
        attempt.job = offer
        self.serving.offers.add(offer)  # standing from here (O1.4); its timer is the thread's
        self.submit(self.serving.arm_offer, offer)
        return attempt

    def decline(self, pull_id: int, reason: str) -> bool:
        """Engine side of ``decline()``; whether the request was still answerable."""
        return self.serving.decline(pull_id, reason)

    def cancel(self, attempt: UcxAttempt) -> None:
        """Conclude ``attempt`` cancelled now unless it concluded already; its machine hears of
        it on the thread before anything else that happens to it."""
        masks = tuple(m.copy() for m in attempt.masks)
        outcome = Outcome.cancelled(masks, reason="cancelled by the holder", cause=Cause.HOLDER_CANCELLED)
        with self._lock:
            if not self.attempts.conclude_locked(attempt, outcome):
                return
            attempt._cancel_requested = True  # with the conclusion: the thread's next event sees both
        attempt.reached("concluded")
        self.submit(self._holder_cancelled, attempt)

    def start_serving(self, wake: WakeFn) -> None:
        self.serving.start(wake)

    def take_incoming(self) -> tuple[PullRequest, ...]:
        return self.serving.take_incoming()

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
        """Wait for the thread to exit (it does once shut down with nothing in flight); any
        finite ``timeout``."""
        return waiting.join(self._thread, timeout)

    # ================================================================ feeding the machines (Router)

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def conclude(self, attempt: UcxAttempt, outcome: Outcome) -> None:
        if self.attempts.conclude(attempt, outcome):
            attempt.reached("concluded")
            self.reactor.wake_later(attempt.wake)

    def quiesce(self, attempt: UcxAttempt) -> None:
        if self.attempts.quiesce(attempt):
            attempt.reached("quiesced")
            self.reactor.wake_later(attempt.wake)

    def feed(self, job: Job, event: Any) -> None:
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
            elif attempt is not None and not job.cancel_fed and attempt.cancel_requested:
                job.cancel_fed = True
                pending.appendleft(event)
                event = ev.HolderCancelled()
            for action in job.machine.handle(event):
                follow = self._do(job, action)
                if follow is not None:
                    pending.append(follow)
        if job.finished:
            self._busy.discard(job)
            if isinstance(job, FetchJob):
                self.requesting.forget(job)
            else:
                self.serving.forget(job)
        elif isinstance(job, ReplyJob) and job.machine.state is ServerState.GONE:
            self.serving.gone(job)

    def _do(self, job: Job, action: ev.Action) -> Any:
        """Carry out one action; the event it gave rise to at once, if any."""
        conn = job.conn
        if isinstance(action, ev.Send):
            if conn is not None:
                if action.after_wakes:
                    self.reactor.after_wakes(self.send, conn, action.message)
                else:
                    self.send(conn, action.message)
        elif isinstance(action, ev.PostReceives):
            assert isinstance(job, FetchJob) and job.receives is not None
            self._busy.add(job)
            try:
                job.receives.post(self._worker, action.start, action.end, action.counts)
            except PostError as exc:
                return ev.PostFailed(str(exc), exc.reached, exc.unposted, exc.unposted_receives)
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
            self.serving.send_read_offer(job, action.counts)
        elif isinstance(action, ev.PlanReads):
            assert isinstance(job, FetchJob) and job.reads is not None
            job.reads.plan(action.counts, action.ranges)
        elif isinstance(action, ev.StartRead):
            assert isinstance(job, FetchJob) and job.reads is not None
            self.requesting.reading.add(job)
            return job.reads.start(action.first, action.last)
        elif isinstance(action, ev.ReleaseRead):
            assert isinstance(job, FetchJob) and job.reads is not None
            if job.reads.release():
                return ev.ReadStopped()
        elif isinstance(action, ev.Conclude):
            if job.attempt is not None:
                self.conclude(job.attempt, action.outcome)
        elif isinstance(action, ev.Quiesce):
            if job.attempt is not None:
                self.quiesce(job.attempt)
        elif isinstance(action, ev.Note):
            if job.attempt is not None:
                job.attempt.reached(action.step)
        elif isinstance(action, ev.ArmDeadline):
            self.reactor.call_later(job.deadline - time.monotonic(), lambda: self._on_timer(job, ev.DeadlinePassed()))
        elif isinstance(action, ev.ArmGrace):
            self.reactor.call_later(self.settings.grace_s, lambda: self._on_timer(job, ev.GraceExpired()))
        elif isinstance(action, ev.Violation):
            if conn is not None:
                self.drop(conn, action.reason)
        elif isinstance(action, ev.CloseConnection):
            if conn is not None:
                self.close_connection(conn, action.reason, lost=action.lost)
        elif isinstance(action, ev.Count):
            self.count(action.key, action.n)
        else:  # pragma: no cover
            raise TypeError(f"unknown action {action!r}")
        return None

    def _on_timer(self, job: Job, event: Any) -> None:
        if not job.finished:
            self.feed(job, event)

    def _holder_cancelled(self, attempt: UcxAttempt) -> None:
        job = attempt.job
        if isinstance(job, FetchJob):
            self.requesting.cancelled(job)  # a fetch not yet taken up hears of it when it is
        elif isinstance(job, ReplyJob):
            self.feed(job, ev.HolderCancelled())
        elif isinstance(job, StandingOffer):
            self.serving.end_offer(job, None, stop_answers=True)  # O1.8
        # a publish not yet taken up hears of it when it is (Serving.answer)

    # ================================================================ the loop (reactor driver)

    def _run(self) -> None:
        try:
            self.reactor.run(self, self.port)
        finally:
            self._teardown()
            self.attempts.notify()

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
                self.close_connection(conn, f"peer {conn.label} is gone: its UCX endpoint failed", lost=True)

    def reap(self) -> None:
        if self.nixl is not None and self.serving.offering_reads():
            self.nixl.progress()
        self.requesting.reap_reads()
        if self.endpoints.dying:
            self.endpoints.bury()
        self.endpoints.reap()
        for job in list(self._busy):
            mover = job.receives if isinstance(job, FetchJob) else job.sends
            done = mover.reap() if mover is not None else None
            if done is not None:
                self.feed(job, done)
            if mover is None or not mover.posted:
                self._busy.discard(job)

    def spinning(self) -> bool:
        return bool(self.requesting.reading)

    def arm(self) -> bool:
        return bool(self._worker.arm())

    def sleep_cap(self) -> float:
        if self.requesting.reading:  # a read started on a holder's thread (run_here): poll it now
            return 0.0
        return self.serving.sleep_cap()

    def on_ready(self, data: Any, events: int) -> None:
        if data is self.wires:
            for _ in self.wires.accept():
                self.count("connections_opened")
        elif isinstance(data, Connection):
            if events & selectors.EVENT_WRITE:
                problem = self.wires.writable(data)
                if problem is not None:
                    self.close_connection(data, problem, lost=True)
            if events & selectors.EVENT_READ and not data.closed:
                self._on_readable(data)

    def can_exit(self) -> bool:
        if len(self.attempts):
            return False
        return not any(c.out for c in self.wires.all) or (
            self._stop_deadline is not None and time.monotonic() >= self._stop_deadline)

    def _teardown(self) -> None:
        for conn in list(self.wires.all):
            self.close_connection(conn, "the backend shut down")
        self.endpoints.teardown(self._worker_fd)
        self._drain.close()
        self.endpoints.release()
        self.serving.clear()
        self.wires.close_listener()
        self.reactor.close()
        if self.nixl is not None:
            self.nixl.close()
        # endpoints went with their connections; the worker before its context
        self._worker = None
        self._context = None

    # ================================================================ connections (Router)

    def send(self, conn: Connection, message: wire.Message) -> None:
        if self.faults.active and self.faults.held(FrameFlow.OUTGOING, conn, message):
            return
        problem = self.wires.send(conn, message)
        if problem is not None:
            if self.reactor.inline:  # a holder's thread (run_here): closing calls UCX, the thread's
                self.reactor.call_later(0.0, lambda: self.close_connection(conn, problem, lost=True))
            else:
                self.close_connection(conn, problem, lost=True)

    def arrived(self, conn: Connection, message: Any) -> None:
        """Route ``message`` as a frame that arrived on ``conn`` (a pushed offer's answer, made
        at this end): a hold of the fault seam may take it."""
        if self.faults.active and self.faults.held(FrameFlow.INCOMING, conn, message):
            return
        self._dispatch(conn, message)

    def _on_readable(self, conn: Connection) -> bool:
        """Read and handle what arrived; whether anything did."""
        messages, problem, malformed = self.wires.read(conn)
        if problem is not None:
            if malformed:
                self.drop(conn, problem)
            else:
                self.close_connection(conn, problem, lost=True)
            return False
        if messages is None:
            return False
        for message in messages:
            if conn.closed:
                return False
            if self.faults.active and self.faults.held(FrameFlow.INCOMING, conn, message):
                continue
            self._dispatch(conn, message)
        return True

    def drop(self, conn: Connection, reason: str) -> None:
        """Close a connection whose peer sent garbage or broke the protocol, and count it."""
        log.warning("kvwire-ucx on port %d drops a connection: %s", self.port, reason)
        self.count("connections_dropped")
        self.close_connection(conn, reason, cause=Cause.FAULT)

    def close_connection(self, conn: Connection, reason: str, *, lost: bool = False,
                         cause: Cause | None = None, untrusted: bool = False) -> None:
        """End the connection and every pull on it (each hears :class:`ConnectionLost`);
        ``untrusted``: the peer is not the one its address names, and nothing it sent counts."""
        if not self.wires.close(conn):
            return
        if lost:
            self.count("connections_lost")
        log.debug("kvwire-ucx on port %d closes connection to %s: %s", self.port, conn.label, reason)
        self.requesting.connection_closed(conn)
        self.serving.connection_closed(conn)
        if lost:
            self.endpoints.lost(conn)
        else:
            self.endpoints.close(conn)
        event = ev.ConnectionLost(reason, cause or (Cause.PEER_GONE if lost else Cause.FAULT), untrusted)
        for fetch in self.requesting.on(conn):
            self.feed(fetch, event)
        for reply in self.serving.on(conn):
            self.feed(reply, event)

    def _dispatch(self, conn: Connection, message: wire.Message) -> None:
        if isinstance(message, wire.Hello):
            self._on_hello(conn, message)
            return
        if conn.state is not ConnectionState.OPEN:
            self.drop(conn, f"peer {conn.label} sent {type(message).__name__} before Hello")
            return
        if conn.outbound:
            if isinstance(message, wire.Offer | wire.ReadOffer | wire.Decline):
                self.requesting.on_answer(conn, message)
            elif isinstance(message, PushedAnswer):
                self.requesting.on_pushed_answer(conn, message)
            elif isinstance(message, wire.PushOffer):
                self.requesting.on_push(conn, message)
            elif isinstance(message, wire.Withdraw):
                self.requesting.on_withdraw(conn, message)
            else:
                self.drop(conn, f"serving peer {conn.label} sent {type(message).__name__}, which only requesters send")
        elif isinstance(message, wire.Pull):
            self.serving.on_pull(conn, message)
        elif isinstance(message, wire.Go | wire.Cancel | wire.Ack):
            self.serving.on_word(conn, message)
        elif isinstance(message, wire.Withdrawn):
            self.serving.on_withdrawn(conn, message)
        else:
            self.drop(conn, f"requesting peer {conn.label} sent {type(message).__name__}, which only servers send")

    def _on_hello(self, conn: Connection, message: wire.Hello) -> None:
        if conn.state is ConnectionState.OPEN:
            self.drop(conn, f"peer {conn.label} sent a second Hello")
            return
        if conn.outbound and conn.address is not None and message.instance != conn.address.instance:
            log.warning("kvwire-ucx on port %d: %s answers as instance %#x, its address names %#x; closing it as stale",
                        self.port, conn.label, message.instance, conn.address.instance)
            self.close_connection(
                conn, f"another kvwire-ucx backend answers at {conn.label} (instance {message.instance:#x}, "
                      f"the address names {conn.address.instance:#x}); the address is stale", lost=True,
                untrusted=True)
            return
        problem = self.endpoints.make(conn, message.worker_address)
        if problem is not None:
            self.close_connection(conn, problem, lost=True)
            return
        conn.state = ConnectionState.OPEN
        if not conn.outbound:
            self.send(conn, self._hello)
            if not conn.closed:
                self.serving.on_hello(conn, message)  # the offers standing, pushed after the Hello

    # ================================================================ shutdown

    def _shutdown(self) -> None:
        if self.reactor.stopping:
            return
        self.reactor.stopping = True
        self._stop_deadline = time.monotonic() + self.settings.grace_s
        self.wires.close_listener()
        for conn in list(self.wires.all):
            for fetch in self.requesting.on(conn):
                self.feed(fetch, ev.Shutdown())
            for reply in self.serving.on(conn):
                if reply.machine.state is ServerState.WAITING or reply.attempt is not None:
                    self.feed(reply, ev.Shutdown())
        self.serving.shutdown_offers()
        self.reactor.call_later(self.settings.grace_s, self._force_all)

    def _force_all(self) -> None:
        for conn in list(self.wires.all):
            if self.requesting.on(conn) or self.serving.on(conn) or self.serving.withdrawing(conn):
                self.close_connection(conn, "the backend shut down and the peer did not finish within the grace")

    @classmethod
    def stop_all(cls, timeout: float = 2.0) -> None:
        """At interpreter exit: shut every engine down and wait briefly for its thread."""
        for engine in list(_engines):
            engine.force_close()
        for engine in list(_engines):
            engine.join(timeout)
