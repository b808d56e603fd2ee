"""The control connection's framing over a real socket: a frame goes to the socket as it is when
nothing is queued, and what the socket does not take is queued and flushed in order, behind it
every later frame; the reading end's chunks are cut into the same messages."""

from __future__ import annotations

import selectors
import socket
import time

from kvwire.testing.require import backend_module

backend_module("ucxx._lib.libucxx", "ucx", "ucxx-cu12==0.52.0")  # skips, or fails when the run requires ucx
from kvwire_ucx import wire  # noqa: E402
from kvwire_ucx.connection import Connection, Connections  # noqa: E402
from kvwire_ucx.reactor import Reactor  # noqa: E402


def _pull(transfer: int, seed: int) -> wire.Pull:
    names = bytes((seed + i * 7) % 256 for i in range(wire.MAX_BLOCKS * 16))
    return wire.Pull(transfer, 1, 1000, ((0, 64), (1, 64)), 16, names, one_sided=True)


def test_frames_the_socket_takes_in_part_go_out_whole_and_in_order() -> None:
    reactor = Reactor()
    wires = Connections(reactor, "127.0.0.1", 0, 4)
    here, there = socket.socketpair()
    try:
        for sock in (here, there):
            sock.setblocking(False)
        here.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        there.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        conn = Connection(here, outbound=False, label="test peer")
        reactor.register(here, selectors.EVENT_READ, conn)
        sent = [wire.Ack(1, 5), _pull(2, 3), wire.Cancel(3, "why"), _pull(4, 9), wire.Ack(5, 0)]
        for message in sent:
            assert wires.send(conn, message) is None
        assert conn.out and conn.want_write  # the socket took a part; the rest waits for it
        reader, got = wire.FrameReader(), []
        deadline = time.monotonic() + 10
        while len(got) < len(sent) and time.monotonic() < deadline:
            chunks = []
            while True:
                try:
                    chunk = there.recv(1 << 16)
                except BlockingIOError:
                    break
                chunks.append(chunk)
            got += reader.feed(*chunks)
            assert wires.flush(conn) is None  # as the progress thread does once the socket is writable
        assert got == sent and reader.buffered == 0
        assert not conn.out and not conn.want_write
        # with nothing queued, a frame goes straight to the socket
        assert wires.send(conn, wire.Ack(6, 1)) is None and not conn.out
        assert reader.feed(there.recv(1 << 16)) == [wire.Ack(6, 1)]
        wires.close(conn)
    finally:
        here.close()
        there.close()
        wires.close_listener()
        reactor.close()
