"""The progress thread of one :class:`~kvwire_ucx.backend.UcxBackend`: it owns the UCX worker,
the control sockets and every transfer, and it alone calls UCX.

One loop: run the holder's commands, progress the worker, reap finished UCX requests, fire
timers, then ``arm()`` the worker and sleep in ``select`` on the worker's epoll fd, the control
sockets and a doorbell pipe. Holder threads only enqueue commands and ring the doorbell (A3).
Outcomes and quiescence are set under the engine lock, and each attempt's ``wake`` is called
after the lock is released (W1)."""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import os
import secrets
import select
import selectors
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwire.contract import Attempt, Hint, Outcome, View
from kvwire.contract.backend import WakeFn
from kvwire.contract.serving import PullRequest
from kvwire_ucx import wire
from kvwire_ucx._ucx import Array, UCXError, context_config, ucx_api
from kvwire_ucx.address import PeerAddress, is_loopback
from kvwire_ucx.nixl import NixlAgent, NixlError, coalesce
from kvwire_ucx.settings import UcxSettings

__all__ = ["Engine", "UcxAttempt", "WireStats", "GroupRows"]

log = logging.getLogger(__name__)

_ROW_MASK = (1 << wire.TAG_ROW_BITS) - 1
#: Upper bound on one sleep, so a lost wake-up of the worker fd costs at most this much.
_MAX_SLEEP_S = 0.5
#: Bytes read from a control socket per call, and how many calls one readable event may make
#: while each fills its buffer (a pull naming 8192 blocks is a 256 KiB frame).
_READ_BYTES = 1 << 16
_READS_PER_EVENT = 16
#: How many times one loop iteration progresses the worker before it looks at the sockets.
_PROGRESS_ROUNDS = 64
#: While UCX has events pending, the control sockets are looked at no more often than this.
_SOCKET_POLL_S = 0.0002
#: How long the ticket of a request the holder took but never answered stays answerable after
#: the request went away (so the late answer learns why instead of 'unknown ticket').
_TICKET_LINGER_S = 60.0
#: How long the endpoint of a lost peer is left to UCX's failure handling before it is closed.
_DYING_WAIT_S = 2.0
#: The tag of the zero-byte probe sent to a peer presumed dead; no transfer ever uses it.
_PROBE_TAG = (wire.MAX_TAG_BASE << wire.TAG_ROW_BITS) | _ROW_MASK
#: While a one-sided offer is out, the serving end progresses its NIXL agent this often (NIXL
#: has no fd). A peer that was just sent the metadata is probably wiring up a connection, which
#: waits for that progress: then often; afterwards a cma or RDMA read needs nothing of the serving
#: end, and polling every millisecond took a quarter of the reader's speed on two shared cores.
_NIXL_WIREUP_POLL_S = 0.001
_NIXL_WIREUP_S = 0.25
_NIXL_SERVE_POLL_S = 0.005

_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


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


@dataclass(frozen=True, slots=True, eq=False)
class GroupRows:
    """One group's rows as this engine moves them: byte views of the registered span and each
    row's byte offset in it (read-only uint64)."""

    group_id: int
    slot_bytes: int
    span: np.ndarray | None = field(repr=False)
    offsets: np.ndarray = field(repr=False)


class UcxAttempt(Attempt):
    """A fetch or publish in flight. Its outcome and quiescence are set by the engine thread
    (or by :meth:`cancel`), each once, and never change afterwards."""

    def __init__(self, engine: Engine, view: View, kind: str, wake: WakeFn) -> None:
        self._engine = engine
        self.view = view
        self.kind = kind
        self._wake = wake
        self._masks = view.row_masks()
        self._outcome: Outcome | None = None
        self._quiesced = False
        self._job: _Fetch | _Reply | None = None
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
        return f"UcxAttempt({self.kind}, {self._outcome!r}, {state})"


class _Fetch:
    """Requester side of one pull."""

    def __init__(self, attempt: UcxAttempt, address: PeerAddress, timeout_s: float,
                 groups: tuple[GroupRows, ...], width: int, names: bytes, credentials: bytes = b"") -> None:
        self.attempt = attempt
        self.credentials = credentials
        self.address = address
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.groups = groups
        self.width = width
        self.names = names
        self.transfer = 0
        self.tag_base = 0
        self.rows = attempt.view.groups[0].rows if attempt.view.groups else 0
        self.conn: _Connection | None = None
        self.asked = False  # the Pull went out
        self.told = False  # the serving end got this end's last word (Ack or Cancel), or needs none
        self.counts: tuple[int, ...] | None = None
        self.total = 0  # rows offered
        # rows are numbered block-major (row * groups + group); receives are posted below limit:
        # every row until the offer, then up to the last offered one
        self.limit = self.rows * len(groups)
        self.next_seq = 0
        self.posted: collections.deque[tuple[Any, Any, int, int, int]] = collections.deque()
        self.inflight_bytes = 0
        self.received = 0
        self.drained = False  # every receive was completed by this end; no more rows count
        self.ended = False  # nothing more will be posted
        self.done = False  # forgotten by the engine
        # one-sided (NIXL READ) pulls
        self.one_sided = False
        self.peer_agent = b""
        # block ranges still to read, each with its local and remote NIXL descriptors
        self.chunks: collections.deque[tuple[int, int, np.ndarray, np.ndarray]] = collections.deque()
        self.chunk = (0, 0)
        self.xfer: Any = None  # the NIXL read in flight
        self.remote: tuple[np.ndarray, ...] = ()  # the offered rows' addresses at the peer


class _Reply:
    """Serving side of one pull: waiting for the holder, then sending what each Go names."""

    def __init__(self, pull_id: int, conn: _Connection, message: wire.Pull, request: PullRequest,
                 expires_at: float) -> None:
        self.pull_id = pull_id
        self.conn = conn
        self.transfer = message.transfer
        self.tag_base = message.tag_base
        self.credit = message.credit
        self.rows = message.count * len(message.groups)
        self.request = request
        self.expires_at = expires_at
        self.state = "waiting"  # waiting -> answered | gone
        self.surfaced = False
        self.attempt: UcxAttempt | None = None
        self.groups: tuple[GroupRows, ...] = ()
        self.counts: tuple[int, ...] = ()
        self.total = 0
        self.limit = 0  # one past the last offered row's block-major number
        self.go_end = 0  # rows named so far (credit, then Go)
        self.posted: collections.deque[tuple[Any, Any, int, int]] = collections.deque()
        self.answered = False  # the pull's one Offer or Decline went out
        self.peer_done = False  # no more Go can come: the peer acked, cancelled or vanished
        self.done = False
        self.one_sided = False  # answered with a ReadOffer: the requester reads the rows itself


class _Connection:
    """One control socket and the UCX endpoint to the same peer."""

    def __init__(self, sock: socket.socket, outbound: bool, label: str,
                 address: PeerAddress | None = None) -> None:
        self.sock = sock
        self.outbound = outbound
        self.label = label
        self.address = address
        self.reader = wire.FrameReader()
        self.out = bytearray()
        self.connecting = outbound
        self.hello = False
        self.ep: Any = None
        self.fetches: dict[int, _Fetch] = {}
        self.replies: dict[int, _Reply] = {}
        self.closed = False
        self.want_write = False
        self.nixl_sent = -1  # generation of this end's NIXL metadata the peer was sent
        self.nixl_peer = b""  # the peer's NIXL agent, loaded from a ReadOffer on this connection


class Engine:
    """Owns the UCX worker, the control listener and every transfer of one backend."""

    def __init__(self, settings: UcxSettings) -> None:
        self.settings = settings
        self.instance = secrets.randbits(63)
        self._reads: set[_Fetch] = set()  # one-sided fetches with rows still to read, or a read in flight
        self._read_replies: set[_Reply] = set()  # one-sided offers the requester has not finished
        self._forget_agents: set[bytes] = set()
        self._wiring_until = 0.0  # until then a peer may be wiring up to this end's NIXL agent
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self._commands: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self._live: set[UcxAttempt] = set()
        self._replies: dict[int, _Reply] = {}  # pull id -> reply, for tickets
        self._incoming: collections.deque[_Reply] = collections.deque()
        self._serve_wake: WakeFn | None = None
        self._stats = collections.Counter[str]()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._transfer_ids = itertools.count(1)
        self._last_transfer = 0
        self._pull_ids = itertools.count(1)
        # Tag bases are handed out in order from a random start and never reused (2**40 of
        # them), so a stale message left by a drained receive can never match a later pull.
        self._next_tag_base = secrets.randbelow(wire.MAX_TAG_BASE)
        self._self_ep: Any = None
        self._drains: list[tuple[Any, Any]] = []
        self._empty = np.zeros(0, dtype=np.uint8)
        self._outbound: dict[tuple[str, int, int], _Connection] = {}
        self._connections: set[_Connection] = set()
        self._busy: set[_Fetch | _Reply] = set()
        self._failed_eps: list[_Connection] = []
        self._dying: list[tuple[_Connection, float]] = []
        self._wakes: dict[int, WakeFn] = {}
        self._stopping = False
        self._stop_deadline: float | None = None
        self._exited = threading.Event()

        net_devices = settings.net_devices or ("lo" if is_loopback(settings.listen_host) else "all")
        config = context_config(net_devices)
        self._context = ucx_api.UCXContext(
            config_dict=config, feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP)
        )
        self._worker = ucx_api.UCXWorker(self._context)
        self._worker.init_blocking_progress_mode()
        self._worker_fd = self._worker.epoll_file_descriptor
        # Before the listener, so that a missing or failing NIXL leaves nothing behind.
        self.nixl: NixlAgent | None = None
        if settings.mode == "one-sided":
            self.nixl = NixlAgent(f"kvwire-ucx-{self.instance:016x}", loopback=is_loopback(settings.listen_host))

        family = socket.AF_INET6 if ":" in settings.listen_host else socket.AF_INET
        self._listener: socket.socket | None = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((settings.listen_host, settings.listen_port))
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError as exc:
            self._listener.close()
            raise OSError(
                exc.errno, f"kvwire-ucx cannot listen on {settings.listen_host}:{settings.listen_port}: {exc.strerror}"
            ) from None
        self.port = self._listener.getsockname()[1]
        self.address = PeerAddress(settings.advertise_host or settings.listen_host, self.port, self.instance)
        self._doorbell_r, self._doorbell_w = os.pipe()
        os.set_blocking(self._doorbell_r, False)
        os.set_blocking(self._doorbell_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._worker_fd, selectors.EVENT_READ, "worker")
        self._selector.register(self._doorbell_r, selectors.EVENT_READ, "doorbell")
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")
        self._thread = threading.Thread(target=self._run, name=f"kvwire-ucx:{self.port}", daemon=True)
        _engines.add(self)
        self._thread.start()

    # ---------------------------------------------------------------- holder-side entry points

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the engine thread soon."""
        self._commands.append((fn, args))
        try:
            os.write(self._doorbell_w, b"!")
        except BlockingIOError:
            pass  # the pipe is full of unread rings: the engine is awake anyway
        except OSError:
            pass  # closed at exit

    def live(self) -> int:
        with self._lock:
            return len(self._live)

    def admit(self, attempt: UcxAttempt) -> bool:
        """Count ``attempt`` as in flight unless that would exceed the bound."""
        with self._lock:
            if len(self._live) >= self.settings.max_in_flight:
                return False
            self._live.add(attempt)
            return True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no attempt is in flight; whether that happened within ``timeout``."""
        with self.changed:
            return self.changed.wait_for(lambda: not self._live, timeout)

    def not_quiesced(self) -> frozenset[Attempt]:
        with self._lock:
            return frozenset(a for a in self._live if not a._quiesced)

    def cancel(self, attempt: UcxAttempt) -> None:
        """Conclude ``attempt`` cancelled now unless it concluded already; the wire work follows
        on the engine thread."""
        if attempt._outcome is not None:
            return
        masks = tuple(m.copy() for m in attempt._masks)
        if self._conclude(attempt, Outcome.cancelled(masks, reason="cancelled by the holder")):
            self.submit(self._after_local_cancel, attempt)

    def start_serving(self, wake: WakeFn) -> None:
        with self._lock:
            self._serve_wake = wake

    def take_incoming(self) -> tuple[PullRequest, ...]:
        out = []
        with self._lock:
            while self._incoming:
                reply = self._incoming.popleft()
                if reply.state == "waiting":
                    reply.surfaced = True
                    out.append(reply.request)
        return tuple(out)

    def claim_reply(self, pull_id: int) -> _Reply | None:
        """The waiting reply for ``pull_id``, now marked answered; ``None`` if it is unknown or
        answered. A reply that went away meanwhile is returned as it is (state ``gone``)."""
        with self._lock:
            reply = self._replies.get(pull_id)
            if reply is None or reply.state == "answered":
                return None
            if reply.state == "waiting":
                reply.state = "answered"
            return reply

    def unclaim_reply(self, reply: _Reply) -> None:
        """Undo :meth:`claim_reply` for a publish that was refused before anything escaped."""
        with self._lock:
            if reply.state == "answered" and reply.attempt is None:
                reply.state = "waiting"

    def stats(self) -> WireStats:
        with self._lock:
            return WireStats(**{k: self._stats[k] for k in WireStats.__dataclass_fields__})

    def begin_shutdown(self) -> None:
        self.submit(self._shutdown)

    def join(self, timeout: float) -> bool:
        """Wait for the thread to exit (it does once shut down with nothing in flight)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def new_transfer(self) -> tuple[int, int]:
        """A transfer id and a tag base, neither ever used before by this engine."""
        with self._lock:
            transfer = next(self._transfer_ids)
            self._last_transfer = transfer
            tag_base = self._next_tag_base
            self._next_tag_base = (tag_base + 1) % wire.MAX_TAG_BASE  # MAX_TAG_BASE is the probe's
            return transfer, tag_base

    # ---------------------------------------------------------------- conclusion and waking

    def _conclude(self, attempt: UcxAttempt, outcome: Outcome, *, quiesced: bool = False) -> bool:
        """Set the outcome if none is set; returns whether this call set it."""
        with self._lock:
            if attempt._outcome is not None:
                if quiesced:
                    self._quiesce_locked(attempt)
                return False
            attempt._outcome = outcome
            attempt._reached("concluded")
            if quiesced:
                self._quiesce_locked(attempt)
            elif attempt._quiesced:
                self._live.discard(attempt)
                self.changed.notify_all()
        self._wakes[id(attempt)] = attempt._wake
        return True

    def _quiesce(self, attempt: UcxAttempt) -> None:
        with self._lock:
            if attempt._quiesced:
                return
            self._quiesce_locked(attempt)
        self._wakes[id(attempt)] = attempt._wake

    def _quiesce_locked(self, attempt: UcxAttempt) -> None:
        attempt._quiesced = True
        attempt._reached("quiesced")
        if attempt._outcome is not None:
            self._live.discard(attempt)
            self.changed.notify_all()

    def _flush_wakes(self) -> None:
        wakes, self._wakes = self._wakes, {}
        for wake in wakes.values():
            try:
                wake()
            except Exception:  # a holder's wake must never stop the engine
                log.exception("a wake callback raised")

    def schedule_wake(self, attempt: UcxAttempt) -> None:
        """Call the attempt's wake from the engine thread (for attempts concluded at submission)."""
        self.submit(self._wake_later, attempt)

    def _wake_later(self, attempt: UcxAttempt) -> None:
        self._wakes[id(attempt)] = attempt._wake

    def _timer(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time.monotonic() + max(0.0, delay), next(self._timer_seq), fn))

    # ---------------------------------------------------------------- the loop

    def _run(self) -> None:
        polled = 0.0
        try:
            while True:
                try:
                    self._run_commands()
                    self._progress()
                    self._reap()
                    self._fire_timers()
                    self._flush_wakes()
                    if self._stopping and self._can_exit():
                        break
                    if self._commands:
                        continue
                    if self._reads:
                        # reads in progress (NIXL has no fd): keep going, glancing at the sockets
                        if time.monotonic() - polled >= _SOCKET_POLL_S:
                            self._wait_and_handle(0.0)
                            polled = time.monotonic()
                        continue
                    if self._worker.arm():
                        self._wait_and_handle(self._sleep_timeout())
                        polled = time.monotonic()
                    elif time.monotonic() - polled >= _SOCKET_POLL_S:
                        # UCX has events pending: progress on, but look at the sockets (and the
                        # doorbell) now and then; commands are read from their queue directly.
                        self._wait_and_handle(0.0)
                        polled = time.monotonic()
                except Exception:
                    log.exception("kvwire-ucx engine on port %d hit an unexpected error; continuing", self.port)
                    time.sleep(0.01)  # no tight loop on a persistent fault
        finally:
            self._teardown()
            self._exited.set()
            with self._lock:
                self.changed.notify_all()

    def _run_commands(self) -> None:
        while self._commands:
            fn, args = self._commands.popleft()
            fn(*args)

    def _progress(self) -> None:
        for _ in range(_PROGRESS_ROUNDS):
            if not self._worker.progress_once():
                break
        if self._failed_eps:
            failed, self._failed_eps = self._failed_eps, []
            for conn in failed:
                # What the peer said before it went (a Cancel, an Ack) is still in the socket;
                # hear it out first, so the outcome says what the peer meant.
                while not conn.closed and self._on_readable(conn):
                    pass
                self._close(conn, f"peer {conn.label} is gone: its UCX endpoint failed", lost=True)

    def _sleep_timeout(self) -> float:
        cap = _MAX_SLEEP_S
        if self._read_replies:
            cap = _NIXL_WIREUP_POLL_S if time.monotonic() < self._wiring_until else _NIXL_SERVE_POLL_S
        if not self._timers:
            return cap
        return min(cap, max(0.0, self._timers[0][0] - time.monotonic()))

    def _wait_and_handle(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the worker fd, the doorbell or a socket; handle sockets."""
        for key, events in self._selector.select(timeout):
            what = key.data
            if what == "worker":
                continue
            if what == "doorbell":
                try:
                    while os.read(self._doorbell_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif what == "listener":
                self._accept()
            elif isinstance(what, _Connection):
                if events & selectors.EVENT_WRITE:
                    self._on_writable(what)
                if events & selectors.EVENT_READ and not what.closed:
                    self._on_readable(what)

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            fn()

    def _can_exit(self) -> bool:
        with self._lock:
            if self._live:
                return False
        return not any(c.out for c in self._connections if not c.closed) or (
            self._stop_deadline is not None and time.monotonic() >= self._stop_deadline
        )

    def _teardown(self) -> None:
        for conn in list(self._connections):
            self._close(conn, "the backend shut down")
        # Endpoints of peers that died moments ago: give UCX the rest of their wait to fail
        # them (closing them earlier is what crashes), progressing the worker meanwhile.
        wait_until = max((until for _, until in self._dying), default=0.0)
        while self._dying and time.monotonic() < wait_until:
            self._worker.progress()
            self._bury()
            if self._dying and self._worker.arm():
                select.select([self._worker_fd], [], [], 0.01)
        self._bury(everything=True)
        for _ in range(1000):  # let the drain messages go out before the endpoint closes
            if not self._drains:
                break
            self._worker.progress()
            self._drains = [d for d in self._drains if not d[0].completed]
        if self._self_ep is not None:
            try:
                self._self_ep.close_blocking()
            except Exception:
                pass
            self._self_ep = None
        with self._lock:
            for reply in self._replies.values():
                reply.state = "gone"
            self._replies.clear()
            self._incoming.clear()
        try:
            self._selector.close()
        except Exception:
            pass
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for fd in (self._doorbell_r, self._doorbell_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.nixl is not None:
            self.nixl.close()
        # endpoints went with their connections; the worker before its context
        self._worker = None
        self._context = None

    # ---------------------------------------------------------------- sockets

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("kvwire-ucx on port %d could not accept a connection: %s", self.port, exc)
                return
            if len(self._connections) >= self.settings.max_connections:
                log.warning("kvwire-ucx on port %d refuses %s: %d connections open", self.port, peer,
                            len(self._connections))
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(sock, outbound=False, label=f"{peer[0]}:{peer[1]}")
            self._connections.add(conn)
            self._count("connections_opened")
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _connect(self, address: PeerAddress) -> _Connection:
        key = (address.host, address.port, address.instance)
        conn = self._outbound.get(key)
        if conn is not None and not conn.closed:
            return conn
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(sock, outbound=True, label=str(address), address=address)
        self._outbound[key] = conn
        self._connections.add(conn)
        self._count("connections_opened")
        self._send(conn, wire.Hello(self.instance, bytes(self._worker.address)))
        code = sock.connect_ex((address.host, address.port))
        if code in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            self._selector.register(sock, selectors.EVENT_WRITE | selectors.EVENT_READ, conn)
            conn.want_write = True
        else:
            # registered so that _close can unregister it uniformly
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._timer(0.0, lambda: self._close(conn, f"could not connect to {address}: {os.strerror(code)}",
                                                 lost=True))
        return conn

    def _send(self, conn: _Connection, message: wire.Message) -> None:
        if conn.closed:
            return
        conn.out += wire.encode(message)
        if not conn.connecting:
            self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        while conn.out and not conn.closed:
            try:
                sent = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._close(conn, f"peer {conn.label} is gone: control connection {exc.strerror or exc}", lost=True)
                return
            del conn.out[:sent]
        want = bool(conn.out) or conn.connecting
        if want != conn.want_write and not conn.closed:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self._selector.modify(conn.sock, events, conn)
            conn.want_write = want

    def _on_writable(self, conn: _Connection) -> None:
        if conn.connecting:
            code = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                self._close(conn, f"could not connect to {conn.label}: {os.strerror(code)}", lost=True)
                return
            conn.connecting = False
        self._flush(conn)

    def _on_readable(self, conn: _Connection) -> bool:
        """Read from the socket (until a read comes back short) and handle the messages
        completed; whether it read any. An error or end of stream after some data is met on
        the next event, once that data was handled."""
        chunks: list[bytes] = []
        try:
            while len(chunks) < _READS_PER_EVENT:
                chunk = conn.sock.recv(_READ_BYTES)
                chunks.append(chunk)
                if len(chunk) < _READ_BYTES:
                    break
        except (BlockingIOError, InterruptedError):
            if not chunks:
                return False
        except OSError as exc:
            if not chunks:
                if conn.connecting:
                    self._close(conn, f"could not connect to {conn.label}: {exc.strerror or exc}", lost=True)
                else:
                    self._close(conn, f"peer {conn.label} is gone: control connection {exc.strerror or exc}",
                                lost=True)
                return False
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if not data:
            if conn.connecting:
                self._close(conn, f"could not connect to {conn.label}: connection closed", lost=True)
            else:
                self._close(conn, f"peer {conn.label} is gone: it closed the control connection", lost=True)
            return False
        try:
            messages = conn.reader.feed(data)
        except wire.WireError as exc:
            self._drop(conn, f"peer {conn.label} sent a malformed control message: {exc}")
            return False
        for message in messages:
            if conn.closed:
                return False
            self._dispatch(conn, message)
        return True

    def _drop(self, conn: _Connection, reason: str) -> None:
        """Close a connection whose peer sent garbage or broke the protocol, and count it."""
        log.warning("kvwire-ucx on port %d drops a connection: %s", self.port, reason)
        self._count("connections_dropped")
        self._close(conn, reason)

    def _close(self, conn: _Connection, reason: str, *, lost: bool = False) -> None:
        """End the connection and every transfer on it; cancels the UCX requests still posted
        on its endpoint, so they complete and their attempts quiesce."""
        if conn.closed:
            return
        conn.closed = True
        if lost:
            self._count("connections_lost")
        log.debug("kvwire-ucx on port %d closes connection to %s: %s", self.port, conn.label, reason)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        try:
            conn.sock.close()
        except OSError:
            pass
        self._connections.discard(conn)
        if conn.address is not None:
            key = (conn.address.host, conn.address.port, conn.address.instance)
            if self._outbound.get(key) is conn:
                del self._outbound[key]
        if conn.nixl_peer:
            self._forget_agents.add(conn.nixl_peer)  # once no read from it is in flight (_reap)
        for fetch in list(conn.fetches.values()):
            fetch.ended = True
            self._fail(fetch.attempt, reason)
        for reply in list(conn.replies.values()):
            reply.peer_done = True
            with self._lock:
                if reply.state == "waiting":
                    reply.state = "gone"
            if reply.attempt is not None:
                self._fail(reply.attempt, f"the requester went away: {reason}")
            else:
                self._forget_reply(reply)
        if conn.ep is not None:
            if lost:
                # Force-closing an endpoint whose peer just died can crash inside UCX
                # (ucp_ep_close_nbx racing its own failure handling). UCX fails such an endpoint
                # by itself and ucxx then closes it, cancelling its requests; a zero-byte probe
                # makes UCX find out at once even when the endpoint is idle.
                self._probe(conn)
                self._dying.append((conn, time.monotonic() + _DYING_WAIT_S))
            else:
                self._close_endpoint(conn)
        for fetch in list(conn.fetches.values()):
            self._drain(fetch)
            self._settle_fetch(fetch)
        for reply in list(conn.replies.values()):
            self._settle_reply(reply)

    def _probe(self, conn: _Connection) -> None:
        if conn.ep is None or not conn.ep.alive:
            return
        empty = Array(self._empty)
        try:
            self._drains.append((conn.ep.tag_send(empty, ucx_api.UCXXTag(_PROBE_TAG)), empty))
        except UCXError:
            pass  # the endpoint failed already

    def _close_endpoint(self, conn: _Connection) -> None:
        """Close the endpoint now, cancelling its requests (peer alive, or given up on)."""
        ep, conn.ep = conn.ep, None
        if ep is None or not ep.alive:
            return  # ucxx closed it after an error, cancelling its requests
        try:
            ep.close_blocking()
        except Exception as exc:
            log.debug("closing the UCX endpoint to %s: %s", conn.label, exc)

    def _bury(self, *, everything: bool = False) -> None:
        """Let go of endpoints of lost peers once ucxx closed them; close those that outlive
        their wait (or all, at teardown)."""
        now = time.monotonic()
        keep = []
        for conn, until in self._dying:
            if conn.ep is None or not conn.ep.alive:
                conn.ep = None
            elif everything or now >= until:
                self._close_endpoint(conn)
            else:
                keep.append((conn, until))
        self._dying = keep

    def _make_endpoint(self, conn: _Connection, worker_address: bytes) -> bool:
        try:
            address = ucx_api.UCXAddress.create_from_buffer(worker_address)
            conn.ep = ucx_api.UCXEndpoint.create_from_worker_address(self._worker, address, True)
        except Exception as exc:
            self._close(conn, f"peer {conn.label} is gone: its UCX worker is unreachable ({exc})", lost=True)
            return False
        failed = self._failed_eps

        def on_close(conn: _Connection = conn) -> None:  # runs inside progress(); no UCX calls here
            if not conn.closed:
                failed.append(conn)

        conn.ep.set_close_callback(on_close)
        return True

    # ---------------------------------------------------------------- messages

    def _dispatch(self, conn: _Connection, message: wire.Message) -> None:
        if isinstance(message, wire.Hello):
            if conn.hello:
                self._drop(conn, f"peer {conn.label} sent a second Hello")
                return
            if conn.outbound and conn.address is not None and message.instance != conn.address.instance:
                self._close(conn, f"another kvwire-ucx backend answers at {conn.label} (instance "
                                  f"{message.instance:#x}, the address names {conn.address.instance:#x}); "
                                  "the address is stale", lost=True)
                return
            # The requesting end receives on its worker; its endpoint to the serving end is what
            # a forced close cancels when that peer stops sending mid-row.
            if not self._make_endpoint(conn, message.worker_address):
                return
            conn.hello = True
            if not conn.outbound:
                self._send(conn, wire.Hello(self.instance, bytes(self._worker.address)))
            return
        if not conn.hello:
            self._drop(conn, f"peer {conn.label} sent {type(message).__name__} before Hello")
            return
        if conn.outbound:
            if isinstance(message, wire.Offer):
                self._on_offer(conn, message)
            elif isinstance(message, wire.ReadOffer):
                self._on_read_offer(conn, message)
            elif isinstance(message, wire.Decline):
                self._on_decline(conn, message)
            else:
                self._drop(conn, f"serving peer {conn.label} sent {type(message).__name__}, which only requesters send")
        else:
            if isinstance(message, wire.Pull):
                self._on_pull(conn, message)
            elif isinstance(message, wire.Go):
                self._on_go(conn, message)
            elif isinstance(message, wire.Cancel):
                self._on_cancel(conn, message)
            elif isinstance(message, wire.Ack):
                self._on_ack(conn, message)
            else:
                self._drop(conn, f"requesting peer {conn.label} sent {type(message).__name__}, which only servers send")

    # ---------------------------------------------------------------- requester side

    def start_fetch(self, fetch: _Fetch) -> None:
        """Engine side of ``fetch()``: connect (or reuse the connection), post receives for the
        first window of rows, and ask, giving that window as credit."""
        fetch.attempt._job = fetch
        if fetch.attempt._outcome is not None:  # cancelled before we got here
            fetch.ended = True
            self._quiesce(fetch.attempt)
            self._forget_fetch(fetch)
            return
        if self._stopping:
            fetch.ended = True
            self._conclude(fetch.attempt, Outcome.cancelled(fetch.attempt.view.row_masks(),
                                                            reason="the backend shut down"), quiesced=True)
            self._forget_fetch(fetch)
            return
        conn = self._connect(fetch.address)
        fetch.conn = conn
        conn.fetches[fetch.transfer] = fetch
        # One-sided: ask the peer where the rows lie and read them; nothing is posted on credit.
        # A peer in the other mode declines the pull.
        fetch.one_sided = self.nixl is not None
        try:
            if not fetch.one_sided:
                self._post_receives(fetch)
        except UCXError as exc:
            fetch.ended = True
            self._fail(fetch.attempt, f"posting receives failed: {exc}")
            self._drain(fetch)
            self._settle_fetch(fetch)
            return
        remaining_ms = int((fetch.deadline - time.monotonic()) * 1000)
        groups = tuple((g.group_id, g.slot_bytes) for g in fetch.groups)
        self._send(conn, wire.Pull(fetch.transfer, fetch.tag_base, max(1, min(remaining_ms, 2**32 - 1)),
                                   groups, fetch.width, fetch.names, fetch.credentials, fetch.next_seq,
                                   one_sided=fetch.one_sided))
        fetch.asked = True
        fetch.attempt._reached("asked")
        self._timer(fetch.deadline - time.monotonic(), lambda: self._fetch_deadline(fetch))

    def _on_offer(self, conn: _Connection, message: wire.Offer) -> None:
        fetch = conn.fetches.get(message.transfer)
        if fetch is None and message.transfer <= self._last_transfer:
            return  # a pull whose receives are all complete; it needs no answer any more
        if fetch is None or fetch.counts is not None or fetch.one_sided:
            self._drop(conn, f"peer {conn.label} offered rows for a pull it was not asked (transfer {message.transfer})")
            return
        if not self._take_counts(conn, fetch, message.counts):
            return
        self._reap_fetch(fetch)

    def _take_counts(self, conn: _Connection, fetch: _Fetch, counts: tuple[int, ...]) -> bool:
        """Take the answer's rows per group (an Offer's or a ReadOffer's); whether rows are to
        come. Drops a peer that offers what was not asked; ends the fetch when it was stopped
        while the answer travelled (telling the peer) or when nothing is served."""
        fetch.attempt._reached("answered")
        if len(counts) != len(fetch.groups) or any(c > fetch.rows for c in counts):
            self._drop(conn, f"peer {conn.label} offered {list(counts)} rows for a pull of {fetch.rows} "
                             f"blocks in {len(fetch.groups)} groups")
            return False
        fetch.counts = counts
        fetch.total = sum(counts)
        if not fetch.one_sided:
            width = len(fetch.groups)
            fetch.limit = max(((c - 1) * width + g + 1 for g, c in enumerate(counts) if c), default=0)
            # receives posted on credit for rows the peer does not hold will never be matched
            self._drain(fetch, lambda gi, ri: ri >= counts[gi])
        if fetch.ended or fetch.attempt._outcome is not None:
            # stopped (cancelled, deadline) while the answer travelled: the peer is told (Cancel,
            # now if not yet); rows already sent on credit still arrive, then it quiesces
            fetch.ended = True
            self._tell(fetch, wire.Cancel(fetch.transfer, "the requester stopped the pull"))
            self._settle_fetch(fetch)
            return False
        if fetch.total == 0:
            self._tell(fetch, wire.Ack(fetch.transfer, 0))
            fetch.ended = True
            self._conclude(fetch.attempt, Outcome.delivered(fetch.attempt._masks))
            self._settle_fetch(fetch)
            return False
        return True

    # ---------------------------------------------------------------- one-sided requester side

    def _on_read_offer(self, conn: _Connection, message: wire.ReadOffer) -> None:
        """The serving end said where the rows lie: read them (NIXL READ), block range by block
        range, marking each range once it arrived whole."""
        assert self.nixl is not None
        fetch = conn.fetches.get(message.transfer)
        known = fetch is not None or message.transfer <= self._last_transfer
        if fetch is not None and (fetch.counts is not None or not fetch.one_sided):
            known = False
        if not known:
            self._drop(conn, f"peer {conn.label} sent a ReadOffer for a pull it was not asked to answer so "
                             f"(transfer {message.transfer})")
            return
        # Metadata is sent once per generation, so it is loaded even for a pull given up on.
        problem = None
        try:
            if message.metadata:
                self.nixl.load_peer(message.agent, message.generation, message.metadata)
                conn.nixl_peer = message.agent
        except NixlError as exc:
            problem = f"peer {conn.label}'s NIXL agent is unusable: {exc}"
        if fetch is None:
            return  # given up on already; a ReadOffer needs no answer (the Cancel went out)
        if not self._take_counts(conn, fetch, message.counts):
            return
        if problem is None and not self.nixl.knows(message.agent, message.generation):
            self._drop(conn, f"peer {conn.label} offered reads from NIXL agent {message.agent!r} "
                             f"(generation {message.generation}) without sending its metadata")
            return
        if problem is not None:
            self._read_failed(fetch, problem)
            return
        fetch.peer_agent = message.agent
        fetch.remote = message.addresses
        per_block = sum(g.slot_bytes for g in fetch.groups)
        step = max(1, self.settings.window_bytes // max(1, per_block))
        longest = max(message.counts)
        # every range's descriptors now: built between two 64 MiB reads, the same few numpy
        # steps took ~0.15 ms each on a two-core host, against ~15 us up front
        for b in range(0, longest, step):
            end = min(b + step, longest)
            fetch.chunks.append((b, end, *self._read_descriptors(fetch, b, end)))
        self._reads.add(fetch)
        self._advance_read(fetch)

    def _advance_read(self, fetch: _Fetch) -> None:
        """Finish the read in flight and start the next ones while they complete at once; end
        the fetch when none is left, it stopped, or a read failed."""
        nixl = self.nixl
        assert nixl is not None
        while True:
            if fetch.xfer is not None:
                try:
                    finished = nixl.done(fetch.xfer)
                except NixlError as exc:
                    self._read_failed(fetch, f"reading rows from {fetch.address} failed: {exc}")
                    return
                if not finished:
                    return
                nixl.release(fetch.xfer)
                fetch.xfer = None
                self._mark_read(fetch)
            if fetch.ended or fetch.attempt._outcome is not None:
                fetch.ended = True
                self._reads.discard(fetch)
                self._settle_fetch(fetch)
                return
            if not fetch.chunks:
                fetch.ended = True
                self._reads.discard(fetch)
                if fetch.conn is not None:
                    self._tell(fetch, wire.Ack(fetch.transfer, fetch.received))
                self._conclude(fetch.attempt, Outcome.delivered(fetch.attempt._masks))
                self._settle_fetch(fetch)
                return
            start, end, local, remote = fetch.chunks.popleft()
            fetch.chunk = (start, end)
            try:
                fetch.xfer, _ = nixl.read(local, remote, fetch.peer_agent)
            except NixlError as exc:
                self._read_failed(fetch, f"reading rows from {fetch.address} failed: {exc}")
                return

    def _read_descriptors(self, fetch: _Fetch, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Local and remote descriptors of the offered rows of blocks ``[start, end)``, group by
        group, rows adjacent on both sides merged."""
        assert fetch.counts is not None
        local, remote, sizes = [], [], []
        for group, count, there in zip(fetch.groups, fetch.counts, fetch.remote, strict=True):
            hi = min(end, count)
            if hi <= start:
                continue
            assert group.span is not None
            base = group.span.__array_interface__["data"][0]
            local.append(group.offsets[start:hi] + np.uint64(base))
            remote.append(there[start:hi])
            sizes.append(np.full(hi - start, group.slot_bytes, dtype=np.uint64))
        return coalesce(np.concatenate(local), np.concatenate(remote), np.concatenate(sizes))

    def _mark_read(self, fetch: _Fetch) -> None:
        assert fetch.counts is not None
        start, end = fetch.chunk
        rows = 0
        for mask, count in zip(fetch.attempt._masks, fetch.counts, strict=True):
            hi = min(end, count)
            if hi > start:
                mask[start:hi] = True
                rows += hi - start
        fetch.received += rows
        self._count("rows_received", rows)
        self._count("rows_read", rows)

    def _read_failed(self, fetch: _Fetch, reason: str) -> None:
        """A read could not start or failed: the rows read so far stay marked, the attempt fails
        and the peer is told. Its handle (if any) is let go once NIXL says it stopped."""
        if fetch.xfer is not None and self.nixl is not None and self.nixl.release(fetch.xfer):
            fetch.xfer = None
        fetch.ended = True
        self._fail(fetch.attempt, reason)
        self._tell(fetch, wire.Cancel(fetch.transfer, wire.clip_reason(reason)))
        if fetch.xfer is None:
            self._reads.discard(fetch)
        self._settle_fetch(fetch)

    def _post_receives(self, fetch: _Fetch) -> int:
        """Post receives for the next rows (block-major numbers, skipping rows not offered) while
        the window allows; returns the first number this call covered."""
        start = seq = fetch.next_seq
        limit = fetch.limit
        if seq >= limit:
            return start
        window = self.settings.window_bytes
        counts = fetch.counts
        groups = fetch.groups
        width = len(groups)
        tag_high = fetch.tag_base << wire.TAG_ROW_BITS
        tag_recv, make_tag, append = self._worker.tag_recv, ucx_api.UCXXTag, fetch.posted.append
        inflight = fetch.inflight_bytes
        try:
            while seq < limit and (inflight < window or not fetch.posted):
                ri, gi = divmod(seq, width)
                seq += 1
                if counts is not None and ri >= counts[gi]:
                    continue
                group = groups[gi]
                assert group.span is not None
                size = group.slot_bytes
                offset = int(group.offsets[ri])
                buffer = Array(group.span[offset : offset + size])
                append((tag_recv(buffer, make_tag(tag_high | (seq - 1))), buffer, gi, ri, size))
                inflight += size
        finally:
            fetch.next_seq, fetch.inflight_bytes = seq, inflight
            if fetch.posted:
                self._busy.add(fetch)
        return start

    def _reap_fetch(self, fetch: _Fetch) -> None:
        posted = fetch.posted
        masks = fetch.attempt._masks
        counts = fetch.counts
        arrived = 0
        while posted and posted[0][0].completed:
            request, _buffer, gi, ri, size = posted.popleft()
            fetch.inflight_bytes -= size
            if fetch.drained or (counts is not None and ri >= counts[gi]):
                continue  # completed by this end, not by the peer's row
            try:
                request.check_error()
            except UCXError as exc:
                fetch.ended = True
                group = fetch.groups[gi]
                self._fail(fetch.attempt, f"row {ri} of group {group.group_id} did not arrive from "
                                          f"{fetch.address}: {type(exc).__name__}: {exc}")
                if fetch.conn is not None and not fetch.conn.closed:
                    self._tell(fetch, wire.Cancel(fetch.transfer, f"a row did not arrive: {exc}"))
            else:
                masks[gi][ri] = True
                fetch.received += 1
                arrived += 1
        if arrived:
            self._count("rows_received", arrived)
        if counts is not None and not fetch.ended:
            conn = fetch.conn
            if fetch.received == fetch.total:
                fetch.ended = True
                if conn is not None:
                    self._tell(fetch, wire.Ack(fetch.transfer, fetch.received))
                self._conclude(fetch.attempt, Outcome.delivered(masks))
            elif conn is not None and not conn.closed and (
                    fetch.inflight_bytes <= self.settings.window_bytes // 2 or not posted):
                # refill in batches: fewer Go messages, longer runs of sends
                try:
                    start = self._post_receives(fetch)
                except UCXError as exc:
                    self._close(conn, f"posting a receive for a pull from {conn.label} failed: {exc}")
                    return
                if fetch.next_seq > start:
                    self._send(conn, wire.Go(fetch.transfer, start, fetch.next_seq))
        self._settle_fetch(fetch)

    def _settle_fetch(self, fetch: _Fetch) -> None:
        """Quiesce and forget the fetch once nothing is posted and nothing more will be. A fetch
        forgotten before the serving end heard its last word says it now: the rows can arrive
        ahead of the offer (they travel over UCX, the offer over the control socket), so a cancel
        can find every receive complete before anything else would tell the serving end."""
        if fetch.posted or fetch.xfer is not None:
            return
        self._busy.discard(fetch)
        if fetch.ended or fetch.attempt._outcome is not None:
            fetch.ended = True
            self._quiesce(fetch.attempt)
            if fetch.attempt._outcome is not None:
                if fetch.asked:
                    self._tell(fetch, wire.Cancel(fetch.transfer, "the requester stopped the pull"))
                self._forget_fetch(fetch)

    def _drain(self, fetch: _Fetch, which: Callable[[int, int], bool] | None = None) -> None:
        """Complete the fetch's posted receives that no peer will match: those ``which(group
        index, row)`` selects (rows the peer did not offer), or all of them (the peer declined,
        or the connection closed).

        The Python API cannot cancel one request, and closing endpoints does not reliably cancel
        unmatched receives (nor is it safe when the peer just died). A zero-byte message with the
        same tag, sent to this worker itself, matches each such receive and completes it without
        writing the row. A receive the peer's data already matched is not affected (it finishes,
        or fails with the peer); the zero-byte message then stays unexpected, harmlessly, since
        its tag is never used again."""
        if which is None:
            fetch.drained = True
        if not fetch.posted:
            return
        if self._self_ep is None:
            try:
                own = ucx_api.UCXAddress.create_from_buffer(bytes(self._worker.address))
                self._self_ep = ucx_api.UCXEndpoint.create_from_worker_address(self._worker, own, True)
            except UCXError as exc:
                log.error("kvwire-ucx cannot reach its own worker to drain receives: %s", exc)
                return
        tag_high = fetch.tag_base << wire.TAG_ROW_BITS
        width = len(fetch.groups)
        for request, _buffer, gi, ri, _size in fetch.posted:
            if request.completed or (which is not None and not which(gi, ri)):
                continue
            empty = Array(self._empty)
            try:
                tag = ucx_api.UCXXTag(tag_high | (ri * width + gi))
                self._drains.append((self._self_ep.tag_send(empty, tag), empty))
            except UCXError as exc:
                log.error("kvwire-ucx could not complete a receive no peer will match: %s", exc)
                return

    def _tell(self, fetch: _Fetch, message: wire.Ack | wire.Cancel) -> None:
        """Send the serving end the fetch's last word (its Ack or a Cancel), once."""
        if fetch.told:
            return
        fetch.told = True
        if fetch.conn is not None and not fetch.conn.closed:
            self._send(fetch.conn, message)

    def _forget_fetch(self, fetch: _Fetch) -> None:
        if fetch.done:
            return
        fetch.done = True
        self._reads.discard(fetch)
        if fetch.conn is not None:
            fetch.conn.fetches.pop(fetch.transfer, None)

    def _on_decline(self, conn: _Connection, message: wire.Decline) -> None:
        fetch = conn.fetches.get(message.transfer)
        if fetch is None:
            return  # we gave up on it already
        fetch.attempt._reached("answered")
        fetch.ended = True
        if fetch.counts is None:
            # the answer: nothing will be sent, so every receive posted on credit is ours to end
            self._drain(fetch)
            fetch.told = True  # a declined pull is over at the serving end
            self._fail(fetch.attempt, f"peer {conn.label} declined the pull: {message.reason}")
        else:
            self._fail(fetch.attempt, f"peer {conn.label} stopped the pull: {message.reason}")
            self._tell(fetch, wire.Cancel(fetch.transfer, "acknowledging the stop"))
        self._settle_fetch(fetch)

    def _fetch_deadline(self, fetch: _Fetch) -> None:
        if fetch.done:
            return
        phase = "before the peer answered" if fetch.counts is None else (
            f"with {fetch.received} of {fetch.total} rows arrived")
        self._fail(fetch.attempt, f"the deadline of {fetch.timeout_s:g}s passed {phase} (peer {fetch.address})")
        self._stop_fetch(fetch, "the requester's deadline passed")

    def _after_local_cancel(self, attempt: UcxAttempt) -> None:
        job = attempt._job
        if isinstance(job, _Fetch):
            self._stop_fetch(job, "the requester cancelled the pull")
        elif isinstance(job, _Reply):
            self._stop_reply(job, "the serving end cancelled its reply")
        self._wakes[id(attempt)] = attempt._wake

    def _stop_fetch(self, fetch: _Fetch, reason: str) -> None:
        """Stop posting, tell the peer, and force the connection closed if the rows already
        named by Go do not finish within the grace."""
        if fetch.done:
            return
        fetch.ended = True
        conn = fetch.conn
        if fetch.asked and not fetch.told:
            # also when the offer arrived after the holder cancelled but before this ran: the
            # serving end waits for an Ack or a Cancel, and only this end can end that wait
            self._tell(fetch, wire.Cancel(fetch.transfer, reason))
        self._settle_fetch(fetch)
        if not fetch.done and conn is not None:
            self._timer(self.settings.grace_s, lambda: self._force_fetch(fetch))

    def _force_fetch(self, fetch: _Fetch) -> None:
        if fetch.xfer is not None and self.nixl is not None and self.nixl.release(fetch.xfer):
            fetch.xfer = None  # a read still running after the grace: NIXL cancelled it
            self._reads.discard(fetch)
            self._settle_fetch(fetch)
        if fetch.done or not fetch.posted or fetch.conn is None:
            return
        self._close(fetch.conn, f"rows of a stopped pull did not finish within the grace of "
                                f"{self.settings.grace_s:g}s; the peer {fetch.conn.label} stopped answering")

    # ---------------------------------------------------------------- serving side

    def _on_pull(self, conn: _Connection, message: wire.Pull) -> None:
        self._count("pulls_received")
        if message.transfer in conn.replies:
            self._drop(conn, f"peer {conn.label} reused transfer id {message.transfer}")
            return
        if self._stopping:
            self._decline_now(conn, message.transfer, "not serving: the serving end is shutting down")
            return
        with self._lock:
            serving = self._serve_wake is not None
            waiting = sum(1 for r in self._replies.values() if r.state == "waiting")
        if not serving:
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
            self._decline_now(conn, message.transfer,
                              f"busy: {waiting} pulls are already waiting for the serving holder")
            return
        pull_id = next(self._pull_ids)
        timeout_s = message.timeout_ms / 1000.0
        ticket = Hint.of("ticket", timeout_s=timeout_s, backend=self.instance, pull=pull_id)
        names = np.frombuffer(message.names, dtype=np.uint8).reshape(message.count, message.width)
        request = PullRequest(
            ticket=ticket,
            groups=tuple(g for g, _ in message.groups),
            slot_bytes=tuple(s for _, s in message.groups),
            names=names,
            peer=conn.label,
            credentials=message.credentials,
        )
        reply = _Reply(pull_id, conn, message, request, time.monotonic() + timeout_s)
        reply.one_sided = message.one_sided and self.nixl is not None
        conn.replies[message.transfer] = reply
        with self._lock:
            self._replies[pull_id] = reply
            self._incoming.append(reply)
            wake = self._serve_wake
        self._timer(timeout_s, lambda: self._expire_waiting(reply))
        if wake is not None:
            self._wakes[-1] = wake

    def _decline_now(self, conn: _Connection, transfer: int, reason: str) -> None:
        self._count("pulls_declined")
        self._send(conn, wire.Decline(transfer, wire.clip_reason(reason)))

    def _answer_once(self, reply: _Reply, message: wire.Offer | wire.ReadOffer | wire.Decline) -> None:
        """Send the pull's one answer (an Offer or ReadOffer, or a Decline) unless it went already."""
        if reply.answered or reply.conn.closed:
            return
        reply.answered = True
        if reply.attempt is not None:
            reply.attempt._reached("answered")
        if isinstance(message, wire.Decline):
            self._count("pulls_declined")
        self._send(reply.conn, message)

    def _expire_waiting(self, reply: _Reply) -> None:
        with self._lock:
            if reply.state != "waiting":
                return
            reply.state = "gone"
        self._answer_once(reply, wire.Decline(reply.transfer, "the serving holder did not answer within the "
                                                              "pull's deadline"))
        self._forget_reply(reply)

    def decline_reply(self, reply: _Reply, reason: str) -> None:
        """Engine side of ``decline()``."""
        self._answer_once(reply, wire.Decline(reply.transfer, reason))
        reply.peer_done = True
        self._forget_reply(reply)

    def answer(self, reply: _Reply, attempt: UcxAttempt, groups: tuple[GroupRows, ...],
               counts: tuple[int, ...], refusal: str | None, deadline: float) -> None:
        """Engine side of ``publish(view, ticket)``: offer the rows and send those within the
        credit, or refuse the pull."""
        reply.attempt = attempt
        attempt._job = reply
        masks = attempt.view.row_masks()
        if reply.conn.closed:
            self._conclude(attempt, Outcome.failed("the requester went away before the answer", masks), quiesced=True)
            self._forget_reply(reply)
            return
        if reply.peer_done:  # its Cancel arrived before this answer
            self._answer_once(reply, wire.Decline(reply.transfer, "the requester cancelled the pull"))
            self._conclude(attempt, Outcome.cancelled(masks, by_peer=True, reason="the requester cancelled the pull"),
                           quiesced=True)
            self._forget_reply(reply)
            return
        if reply.state == "gone":
            self._conclude(attempt, Outcome.failed("the pull's deadline passed before the answer", masks),
                           quiesced=True)
            self._forget_reply(reply)
            return
        if attempt._outcome is not None:  # the holder cancelled it before it went out
            self._answer_once(reply, wire.Decline(reply.transfer, "the serving end cancelled its answer"))
            reply.peer_done = True
            self._quiesce(attempt)
            self._forget_reply(reply)
            return
        if self._stopping:
            self._answer_once(reply, wire.Decline(reply.transfer, "not serving: the serving end is shutting down"))
            reply.peer_done = True
            self._conclude(attempt, Outcome.cancelled(masks, reason="the backend shut down"), quiesced=True)
            self._forget_reply(reply)
            return
        if refusal is not None:
            self._answer_once(reply, wire.Decline(reply.transfer, wire.clip_reason(refusal)))
            reply.peer_done = True
            self._conclude(attempt, Outcome.failed(refusal, masks), quiesced=True)
            self._forget_reply(reply)
            return
        if reply.one_sided:
            self._offer_reads(reply, attempt, groups, counts, deadline)
            return
        reply.groups = groups
        reply.counts = counts
        reply.total = sum(counts)
        width = len(counts)
        reply.limit = max(((c - 1) * width + g + 1 for g, c in enumerate(counts) if c), default=0)
        self._answer_once(reply, wire.Offer(reply.transfer, counts))
        if reply.total == 0:
            reply.peer_done = True  # nothing to send; the requester concludes on the offer alone
            self._conclude(attempt, Outcome.delivered(masks), quiesced=True)
            self._forget_reply(reply)
            return
        self._send_rows(reply, 0, reply.credit)
        self._timer(deadline - time.monotonic(), lambda: self._reply_deadline(reply))
        self._settle_reply(reply)

    def _offer_reads(self, reply: _Reply, attempt: UcxAttempt, groups: tuple[GroupRows, ...],
                     counts: tuple[int, ...], deadline: float) -> None:
        """Answer a one-sided pull: tell the requester where the rows lie (with this end's NIXL
        metadata when it changed) and wait for its Ack, Cancel, or the deadline."""
        assert self.nixl is not None
        generation, metadata = self.nixl.metadata()
        if reply.conn.nixl_sent == generation:
            metadata = b""
        agent = self.nixl.name.encode()
        counts = _fit_read_offer(counts, agent, metadata)
        addresses = []
        for group, count in zip(groups, counts, strict=True):
            if count == 0 or group.span is None:
                addresses.append(np.zeros(0, dtype=np.uint64))
                continue
            base = group.span.__array_interface__["data"][0]
            addresses.append(group.offsets[:count] + np.uint64(base))
        reply.groups = groups
        reply.counts = counts
        reply.total = sum(counts)
        self._answer_once(reply, wire.ReadOffer(reply.transfer, counts, agent, generation, metadata,
                                                tuple(addresses)))
        if metadata:
            self._wiring_until = time.monotonic() + _NIXL_WIREUP_S
        reply.conn.nixl_sent = generation
        masks = attempt.view.row_masks()
        if reply.total == 0:
            reply.peer_done = True
            self._conclude(attempt, Outcome.delivered(masks), quiesced=True)
            self._forget_reply(reply)
            return
        self._read_replies.add(reply)
        self._timer(deadline - time.monotonic(), lambda: self._reply_deadline(reply))
        self._settle_reply(reply)

    def _send_rows(self, reply: _Reply, start: int, end: int) -> None:
        """Send the offered rows among block-major numbers ``[start, end)``."""
        conn = reply.conn
        counts = reply.counts
        groups = reply.groups
        width = len(groups)
        tag_high = reply.tag_base << wire.TAG_ROW_BITS
        tag_send, make_tag, append = conn.ep.tag_send, ucx_api.UCXXTag, reply.posted.append
        try:
            for seq in range(start, min(end, reply.limit)):
                ri, gi = divmod(seq, width)
                if ri >= counts[gi]:
                    continue
                group = groups[gi]
                assert group.span is not None
                offset = int(group.offsets[ri])
                buffer = Array(group.span[offset : offset + group.slot_bytes])
                append((tag_send(buffer, make_tag(tag_high | seq)), buffer, gi, ri))
        except UCXError as exc:
            self._close(conn, f"sending to {conn.label} failed: {exc}", lost=True)
            return
        finally:
            if reply.posted:
                self._busy.add(reply)
        reply.go_end = end

    def _on_go(self, conn: _Connection, message: wire.Go) -> None:
        reply = conn.replies.get(message.transfer)
        if reply is None or reply.attempt is None or not reply.counts or reply.one_sided:
            self._drop(conn, f"peer {conn.label} named rows of transfer {message.transfer}, which was not offered")
            return
        if message.start != reply.go_end or message.end > reply.rows or reply.peer_done:
            self._drop(conn, f"peer {conn.label} named rows [{message.start}, {message.end}) of transfer "
                             f"{message.transfer}; expected rows from {reply.go_end} up to {reply.rows}")
            return
        self._send_rows(reply, message.start, message.end)

    def _reap_reply(self, reply: _Reply) -> None:
        posted = reply.posted
        sent = 0
        while posted and posted[0][0].completed:
            request, _buffer, gi, ri = posted.popleft()
            try:
                request.check_error()
            except UCXError as exc:
                if reply.attempt is not None:
                    self._fail(reply.attempt, f"row {ri} of group {reply.groups[gi].group_id} could not be sent to "
                                              f"{reply.conn.label}: {type(exc).__name__}: {exc}")
            else:
                sent += 1
        if sent:
            self._count("rows_sent", sent)
        self._settle_reply(reply)

    def _settle_reply(self, reply: _Reply) -> None:
        if reply.posted:
            return
        self._busy.discard(reply)
        attempt = reply.attempt
        if attempt is None:
            return
        if reply.peer_done or (not reply.one_sided and reply.go_end >= reply.limit) or reply.conn.closed:
            self._read_replies.discard(reply)
            self._quiesce(attempt)
        if attempt._quiesced and attempt._outcome is not None and (reply.peer_done or reply.conn.closed):
            self._forget_reply(reply)

    def _on_cancel(self, conn: _Connection, message: wire.Cancel) -> None:
        reply = conn.replies.get(message.transfer)
        if reply is None:
            return
        reply.peer_done = True
        with self._lock:
            if reply.state == "waiting":
                reply.state = "gone"
        if reply.attempt is not None:
            masks = reply.attempt.view.row_masks()
            self._conclude(reply.attempt, Outcome.cancelled(masks, by_peer=True, reason=message.reason or None))
            self._settle_reply(reply)
        elif reply.state == "gone":
            # never answered: say so, so the requester can end the receives it posted on credit
            self._answer_once(reply, wire.Decline(reply.transfer, "the requester cancelled the pull"))
            self._forget_reply(reply)
        # else the holder's answer is on its way to answer(), which sees peer_done

    def _on_ack(self, conn: _Connection, message: wire.Ack) -> None:
        reply = conn.replies.get(message.transfer)
        if reply is None or reply.attempt is None:
            return
        if message.rows != reply.total:
            self._drop(conn, f"peer {conn.label} acknowledged {message.rows} rows of a transfer of {reply.total}")
            return
        reply.peer_done = True
        masks = tuple(np.arange(g.rows) < c for g, c in zip(reply.attempt.view.groups, reply.counts, strict=True))
        self._conclude(reply.attempt, Outcome.delivered(masks))
        self._settle_reply(reply)

    def _reply_deadline(self, reply: _Reply) -> None:
        if reply.done or reply.attempt is None:
            return
        self._fail(reply.attempt, f"the deadline passed while serving {reply.conn.label} "
                                  f"before it confirmed the {reply.total} rows offered")
        self._stop_reply(reply, "the serving end's deadline passed")

    def _stop_reply(self, reply: _Reply, reason: str) -> None:
        """Tell the requester to stop; rows it already named are still sent, and the
        connection is forced closed if that does not finish within the grace."""
        if reply.done:
            return
        if not reply.peer_done and not reply.conn.closed:
            self._send(reply.conn, wire.Decline(reply.transfer, wire.clip_reason(reason)))
        self._settle_reply(reply)
        if not reply.done:
            self._timer(self.settings.grace_s, lambda: self._force_reply(reply))

    def _force_reply(self, reply: _Reply) -> None:
        if reply.done:
            return
        self._close(reply.conn, f"requester {reply.conn.label} did not finish a stopped transfer within the grace "
                                f"of {self.settings.grace_s:g}s")

    def _forget_reply(self, reply: _Reply) -> None:
        """Forget a reply's transfer. A request the holder holds but has not answered keeps its
        ticket valid a while, so that answering it says what happened instead of 'unknown'."""
        if reply.done:
            return
        reply.done = True
        self._read_replies.discard(reply)
        reply.conn.replies.pop(reply.transfer, None)
        with self._lock:
            if reply.state == "waiting":
                reply.state = "gone"
            keep = reply.surfaced and reply.attempt is None and reply.state == "gone"
            if not keep:
                self._replies.pop(reply.pull_id, None)
        if keep:
            self._timer(max(0.0, reply.expires_at - time.monotonic()) + _TICKET_LINGER_S,
                        lambda: self._drop_ticket(reply))

    def _drop_ticket(self, reply: _Reply) -> None:
        with self._lock:
            if self._replies.get(reply.pull_id) is reply and reply.attempt is None:
                del self._replies[reply.pull_id]

    # ---------------------------------------------------------------- shared

    def _fail(self, attempt: UcxAttempt, reason: str) -> bool:
        masks = tuple(m.copy() for m in attempt._masks) if attempt.kind == "fetch" else attempt.view.row_masks()
        return self._conclude(attempt, Outcome.failed(reason, masks))

    def _reap(self) -> None:
        if self._read_replies and self.nixl is not None:
            self.nixl.progress()
        if self._reads:
            for fetch in list(self._reads):
                self._advance_read(fetch)
        if self._forget_agents and self.nixl is not None:
            reading = {f.peer_agent for f in self._reads}
            for agent in self._forget_agents - reading:
                if not any(c.nixl_peer == agent and not c.closed for c in self._connections):
                    self.nixl.forget_peer(agent)
            self._forget_agents &= reading
        if self._dying:
            self._bury()
        if self._drains:
            self._drains = [d for d in self._drains if not d[0].completed]
        for transfer in list(self._busy):
            if isinstance(transfer, _Fetch):
                self._reap_fetch(transfer)
            else:
                self._reap_reply(transfer)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats[key] += n

    def _shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._stop_deadline = time.monotonic() + self.settings.grace_s
        if self._listener is not None:
            try:
                self._selector.unregister(self._listener)
            except (KeyError, ValueError):
                pass
            self._listener.close()
            self._listener = None
        for conn in list(self._connections):
            for fetch in list(conn.fetches.values()):
                masks = tuple(m.copy() for m in fetch.attempt._masks)
                self._conclude(fetch.attempt, Outcome.cancelled(masks, reason="the backend shut down"))
                self._stop_fetch(fetch, "the requester shut down")
            for reply in list(conn.replies.values()):
                if reply.attempt is None:
                    with self._lock:
                        claimed = reply.state == "answered"  # answer() is queued and will decline
                        if not claimed:
                            reply.state = "gone"
                    if not claimed:
                        self._answer_once(reply, wire.Decline(reply.transfer,
                                                              "not serving: the serving end is shutting down"))
                        self._forget_reply(reply)
                else:
                    self._conclude(reply.attempt, Outcome.cancelled(reply.attempt.view.row_masks(),
                                                                    reason="the backend shut down"))
                    self._stop_reply(reply, "the serving end shut down")
        self._timer(self.settings.grace_s, self._force_all)

    def _force_all(self) -> None:
        for conn in list(self._connections):
            if conn.fetches or conn.replies:
                self._close(conn, "the backend shut down and the peer did not finish within the grace")

    @classmethod
    def stop_all(cls, timeout: float = 2.0) -> None:
        """At interpreter exit: shut every engine down and wait briefly for its thread."""
        for engine in list(_engines):
            engine.begin_shutdown()
            engine.submit(engine._force_all)
        for engine in list(_engines):
            engine.join(timeout)


def _fit_read_offer(counts: tuple[int, ...], agent: bytes, metadata: bytes) -> tuple[int, ...]:
    """``counts`` cut to the longest common block prefix whose ReadOffer fits in one frame (a
    shorter prefix is still a valid answer)."""
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
