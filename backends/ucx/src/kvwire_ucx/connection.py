"""One control connection per peer: its TCP socket and framing, and the UCX endpoint to the same
peer, with how each ends (:class:`Connection`, :class:`Connections`, :class:`Endpoints`).

Everything here runs on the progress thread. A connection knows nothing of pulls: which pulls
run on it is the engine's sides' to keep, and what a closed connection means for them the
engine's."""

from __future__ import annotations

import enum
import errno
import logging
import os
import selectors
import socket
import time
from typing import Any

import numpy as np

from kvwire_ucx import wire
from kvwire_ucx._ucx import Array, UCXError, ucx_api
from kvwire_ucx.address import PeerAddress
from kvwire_ucx.reactor import Reactor

__all__ = ["Connection", "ConnectionState", "Connections", "Endpoints", "PROBE_TAG"]

log = logging.getLogger(__name__)

#: Bytes read from a control socket per call, and how many calls one readable event may make
#: while each fills its buffer (a pull naming 8192 blocks is a 256 KiB frame).
_READ_BYTES = 1 << 16
_READS_PER_EVENT = 16
#: How long the endpoint of a lost peer is left to UCX's failure handling before it is closed.
DYING_WAIT_S = 2.0
#: The tag of the zero-byte probe sent to a peer presumed dead; no transfer ever uses it.
PROBE_TAG = (wire.MAX_TAG_BASE << wire.TAG_ROW_BITS) | ((1 << wire.TAG_ROW_BITS) - 1)


class ConnectionState(enum.Enum):
    CONNECTING = "connecting"  #: outbound, the TCP connect not yet complete
    GREETING = "greeting"      #: the socket is up; the peer's Hello has not come
    OPEN = "open"              #: Hellos exchanged, the UCX endpoint made
    CLOSED = "closed"


class Connection:
    """One control socket and the UCX endpoint to the same peer."""

    def __init__(self, sock: socket.socket, outbound: bool, label: str, address: PeerAddress | None = None) -> None:
        self.sock = sock
        self.outbound = outbound
        self.label = label
        self.address = address
        self.state = ConnectionState.CONNECTING if outbound else ConnectionState.GREETING
        self.reader = wire.FrameReader()
        self.out = bytearray()
        self.ep: Any = None
        self.want_write = False
        self.nixl_sent = -1   # generation of this end's NIXL metadata the peer was sent
        self.nixl_peer = b""  # the peer's NIXL agent, loaded from a ReadOffer on this connection

    @property
    def closed(self) -> bool:
        return self.state is ConnectionState.CLOSED

    @property
    def key(self) -> tuple[str, int, int] | None:
        a = self.address
        return None if a is None else (a.host, a.port, a.instance)


class Connections:
    """The listener and every control connection: accepting, connecting, framing, flushing."""

    def __init__(self, reactor: Reactor, host: str, port: int, max_connections: int) -> None:
        self._reactor = reactor
        self._max = max_connections
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise OSError(exc.errno, f"kvwire-ucx cannot listen on {host}:{port}: {exc.strerror}") from None
        self.listener: socket.socket | None = listener
        self.port: int = listener.getsockname()[1]
        self.all: set[Connection] = set()
        self._outbound: dict[tuple[str, int, int], Connection] = {}
        reactor.register(listener, selectors.EVENT_READ, self)

    def accept(self) -> list[Connection]:
        """Accept what is waiting (beyond ``max_connections``: refused); the new connections."""
        new: list[Connection] = []
        while self.listener is not None:
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.warning("kvwire-ucx on port %d could not accept a connection: %s", self.port, exc)
                break
            if len(self.all) >= self._max:
                log.warning("kvwire-ucx on port %d refuses %s: %d connections open", self.port, peer, len(self.all))
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock, outbound=False, label=f"{peer[0]}:{peer[1]}")
            self.all.add(conn)
            self._reactor.register(sock, selectors.EVENT_READ, conn)
            new.append(conn)
        return new

    def outbound(self, address: PeerAddress) -> Connection | None:
        conn = self._outbound.get((address.host, address.port, address.instance))
        return None if conn is None or conn.closed else conn

    def connect(self, address: PeerAddress, hello: wire.Hello) -> tuple[Connection, str | None]:
        """A new outbound connection with ``hello`` queued; and why it failed at once, if it did."""
        family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Connection(sock, outbound=True, label=str(address), address=address)
        self._outbound[(address.host, address.port, address.instance)] = conn
        self.all.add(conn)
        conn.out += wire.encode(hello)
        try:
            code = sock.connect_ex((address.host, address.port))
        except (OSError, ValueError, TypeError) as exc:
            # a host name that does not resolve (gaierror), a bad address, a host the socket
            # cannot encode: the pull fails with the reason, never a fault on the progress thread
            self._reactor.register(sock, selectors.EVENT_READ, conn)  # so that close unregisters it uniformly
            if not isinstance(exc, OSError):  # the address check let a host through that the socket refuses
                log.warning("kvwire-ucx: connecting to %s raised %s: %s", address, type(exc).__name__, exc)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            return conn, f"could not connect to {address}: {reason}"
        if code in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            self._reactor.register(sock, selectors.EVENT_WRITE | selectors.EVENT_READ, conn)
            conn.want_write = True
            return conn, None
        self._reactor.register(sock, selectors.EVENT_READ, conn)  # so that close unregisters it uniformly
        return conn, f"could not connect to {address}: {os.strerror(code)}"

    def send(self, conn: Connection, message: wire.Message) -> str | None:
        """Queue ``message`` and flush what the socket takes; why the connection failed, if it did."""
        if conn.closed:
            return None
        frame = wire.encode(message)
        if conn.out or conn.state is ConnectionState.CONNECTING:
            conn.out += frame
            return None if conn.state is ConnectionState.CONNECTING else self.flush(conn)
        # nothing queued: the frame goes to the socket as it is, and only what it does not take is
        # queued (a pull of 16384 blocks is a 256 KiB frame, copied into the queue for nothing)
        try:
            sent = conn.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            return f"peer {conn.label} is gone: control connection {exc.strerror or exc}"
        if sent < len(frame):
            conn.out += memoryview(frame)[sent:]
            return self.flush(conn)
        return None

    def flush(self, conn: Connection) -> str | None:
        while conn.out and not conn.closed:
            try:
                sent = conn.sock.send(conn.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                return f"peer {conn.label} is gone: control connection {exc.strerror or exc}"
            del conn.out[:sent]
        want = bool(conn.out) or conn.state is ConnectionState.CONNECTING
        if want != conn.want_write and not conn.closed:
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self._reactor.modify(conn.sock, events, conn)
            conn.want_write = want
        return None

    def writable(self, conn: Connection) -> str | None:
        """The socket became writable: finish connecting, flush; why it failed, if it did."""
        if conn.state is ConnectionState.CONNECTING:
            code = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code:
                return f"could not connect to {conn.label}: {os.strerror(code)}"
            conn.state = ConnectionState.GREETING
        return self.flush(conn)

    def read(self, conn: Connection) -> tuple[list[wire.Message] | None, str | None, bool]:
        """Read until a read comes back short: ``(messages, why it ended, malformed)``. No
        messages and no reason: nothing to read now. An error or end of stream after some data
        is met on the next event, once that data was handled."""
        chunks: list[bytes] = []
        try:
            while len(chunks) < _READS_PER_EVENT:
                chunk = conn.sock.recv(_READ_BYTES)
                chunks.append(chunk)
                if len(chunk) < _READ_BYTES:
                    break
        except (BlockingIOError, InterruptedError):
            if not chunks:
                return None, None, False
        except OSError as exc:
            if not chunks:
                return None, self._gone(conn, f"{exc.strerror or exc}"), False
        if not chunks[0]:
            if conn.state is ConnectionState.CONNECTING:
                return None, f"could not connect to {conn.label}: connection closed", False
            return None, f"peer {conn.label} is gone: it closed the control connection", False
        try:
            return conn.reader.feed(*chunks), None, False
        except wire.WireError as exc:
            return None, f"peer {conn.label} sent a malformed control message: {exc}", True

    def _gone(self, conn: Connection, what: str) -> str:
        if conn.state is ConnectionState.CONNECTING:
            return f"could not connect to {conn.label}: {what}"
        return f"peer {conn.label} is gone: control connection {what}"

    def close(self, conn: Connection) -> bool:
        """Close the socket and forget the connection; whether it was open."""
        if conn.closed:
            return False
        conn.state = ConnectionState.CLOSED
        self._reactor.unregister(conn.sock)
        try:
            conn.sock.close()
        except OSError:
            pass
        self.all.discard(conn)
        key = conn.key
        if key is not None and self._outbound.get(key) is conn:
            del self._outbound[key]
        return True

    def close_listener(self) -> None:
        if self.listener is not None:
            self._reactor.unregister(self.listener)
            self.listener.close()
            self.listener = None


class Endpoints:
    """The UCX endpoints of the connections, and how each ends.

    Endpoint error handling is always on. Force-closing an endpoint whose peer has just died can
    crash inside UCX (``ucp_ep_close_nbx`` racing its own failure handling), so such an endpoint
    (its connection was lost) is left to UCX, which fails it and then ucxx closes it, cancelling
    its requests; a zero-byte probe makes UCX find out at once even when it is idle. Only
    endpoints of peers known to be alive are closed forcibly."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self.failed: list[Connection] = []  # endpoints UCX reported failed (from inside progress)
        self._dying: list[tuple[Connection, float]] = []
        self.zero_byte: list[tuple[Any, Any]] = []  # probes and drains in flight, with their buffers
        self._empty = np.zeros(0, dtype=np.uint8)

    def make(self, conn: Connection, worker_address: bytes) -> str | None:
        """Make the endpoint to the peer's worker; why it failed, if it did."""
        try:
            address = ucx_api.UCXAddress.create_from_buffer(worker_address)
            conn.ep = ucx_api.UCXEndpoint.create_from_worker_address(self._worker, address, True)
        except Exception as exc:
            return f"peer {conn.label} is gone: its UCX worker is unreachable ({exc})"
        failed = self.failed

        def on_close(conn: Connection = conn) -> None:  # runs inside progress(); no UCX calls here
            if not conn.closed:
                failed.append(conn)

        conn.ep.set_close_callback(on_close)
        return None

    def take_failed(self) -> list[Connection]:
        """The connections whose endpoint UCX reported failed since the last call. (The list is
        emptied in place: each endpoint's callback holds on to it.)"""
        failed = list(self.failed)
        self.failed.clear()
        return failed

    def send_empty(self, ep: Any, tag: int) -> None:
        """A zero-byte message with ``tag`` on ``ep``, kept until it completed."""
        empty = Array(self._empty)
        self.zero_byte.append((ep.tag_send(empty, ucx_api.UCXXTag(tag)), empty))

    def lost(self, conn: Connection) -> None:
        """The peer is presumed gone: probe, and leave the endpoint to UCX for a while."""
        if conn.ep is None:
            return
        if conn.ep.alive:
            try:
                self.send_empty(conn.ep, PROBE_TAG)
            except UCXError:
                pass  # the endpoint failed already
        self._dying.append((conn, time.monotonic() + DYING_WAIT_S))

    def close(self, conn: Connection) -> None:
        """Close the endpoint now, cancelling its requests (peer alive, or given up on)."""
        ep, conn.ep = conn.ep, None
        if ep is None or not ep.alive:
            return  # ucxx closed it after an error, cancelling its requests
        try:
            ep.close_blocking()
        except Exception as exc:
            log.debug("closing the UCX endpoint to %s: %s", conn.label, exc)

    @property
    def dying(self) -> bool:
        return bool(self._dying)

    def bury(self, *, everything: bool = False) -> None:
        """Let go of endpoints of lost peers once ucxx closed them; close those that outlive
        their wait (or all, at teardown)."""
        now = time.monotonic()
        keep = []
        for conn, until in self._dying:
            if conn.ep is None or not conn.ep.alive:
                conn.ep = None
            elif everything or now >= until:
                self.close(conn)
            else:
                keep.append((conn, until))
        self._dying = keep

    def reap(self) -> None:
        if self.zero_byte:
            self.zero_byte = [z for z in self.zero_byte if not z[0].completed]

    def teardown(self, worker_fd: int) -> None:
        """Give endpoints of peers that died moments ago the rest of their wait (closing them
        earlier is what crashes), progressing the worker meanwhile; then let the zero-byte
        messages go out."""
        import select

        wait_until = max((until for _, until in self._dying), default=0.0)
        while self._dying and time.monotonic() < wait_until:
            self._worker.progress()
            self.bury()
            if self._dying and self._worker.arm():
                select.select([worker_fd], [], [], 0.01)
        self.bury(everything=True)
        for _ in range(1000):
            if not self.zero_byte:
                break
            self._worker.progress()
            self.reap()

    def release(self) -> None:
        """Let go of the worker once every endpoint is closed: a worker that lives on keeps its
        peers' endpoints to it alive, so they would not learn that this end went away."""
        self._worker = None
