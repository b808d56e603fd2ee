"""The fault proxy the multi-host tests put in front of TCP paths (``faultproxy.py``), on loopback:
whatever faults it adds, a stream arrives whole and in order; a stall holds every byte until it is
healed; a reset ends the open connections with RST while new ones still pass; bad settings are
refused by name."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from hosts import ProxyProcess


@pytest.fixture
def echo() -> Iterator[int]:
    """An echo server on loopback; its port."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    server.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(1 << 16):
                conn.sendall(data)
        except OSError:
            pass


@pytest.fixture
def proxy(echo: int) -> Iterator[ProxyProcess]:
    made = ProxyProcess(None, "127.0.0.1:0", f"127.0.0.1:{echo}")
    yield made
    made.stop()


def _round_trip(port: int, payload: bytes, timeout_s: float = 20.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        got = bytearray()
        while len(got) < len(payload):
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            got += chunk
        sender.join()
    return bytes(got)


def test_a_stream_arrives_whole_and_in_order_through_delay_rate_and_loss(proxy):
    payload = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    for faults in ({}, {"delay_s": 0.01}, {"rate_bps": 20 << 20}, {"loss": 0.5, "rto_s": 0.01, "seed": 2}):
        proxy.heal()
        proxy.set(**faults)
        assert _round_trip(proxy.port, payload) == payload, faults
    assert proxy.set()["bytes"] >= 4 * 2 * len(payload)


def test_a_stall_holds_every_byte_until_healed_and_a_reset_sends_rst(proxy):
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as conn:
        conn.sendall(b"before")
        assert conn.recv(100) == b"before"
        proxy.set(stall=True)
        conn.sendall(b"held")
        conn.settimeout(0.3)
        with pytest.raises(TimeoutError):
            conn.recv(100)
        proxy.set(stall=False)
        conn.settimeout(5)
        assert conn.recv(100) == b"held"
        proxy.set(reset=True)
        with pytest.raises(ConnectionResetError):
            conn.recv(100)
    assert _round_trip(proxy.port, b"after") == b"after"


def test_bad_settings_are_refused_by_name(proxy):
    with pytest.raises(ValueError, match="loss is a probability"):
        proxy.set(loss=2)
    with pytest.raises(ValueError, match="delay_s must be >= 0"):
        proxy.set(delay_s=-1)
    assert proxy.set()["loss"] == 0  # a refused setting changed nothing
