"""kvwire-ucx between two processes on loopback: the pull itself, and what a dead peer or a
closed port does to it."""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvwire.testing.require import backend_module

backend_module("ucxx._lib.libucxx", "ucx", "ucxx-cu12==0.52.0")  # skips, or fails when the run requires ucx

from ucx_holders import (  # noqa: E402
    Pool,
    Requester,
    ReuseTree,
    ServingHolder,
    block_names,
    fill,
    row_pattern,
    serve_filled,
)

from kvwire.contract import Cause  # noqa: E402
from kvwire.testing.holder import wait_for  # noqa: E402

CHILD = Path(__file__).with_name("ucx_peer_process.py")
GROUPS = (0, 1)


class Child:
    """A kvwire-ucx end in a subprocess; always killed and reaped by :meth:`stop`."""

    def __init__(self, *args: object, mode: str = "two-sided") -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHILD.parent), os.environ.get("PYTHONPATH", "")]),
                   KVWIRE_UCX_TEST_MODE=mode)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(CHILD), *map(str, args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)

    def read(self, timeout: float = 20) -> dict:
        """The next JSON line the child prints, waiting at most ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(left):
                raise TimeoutError(f"the child said nothing within {timeout}s (exit code {self.proc.poll()})")
            line = self.proc.stdout.readline()
            if not line:
                raise EOFError(f"the child exited with {self.proc.wait(5)}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def wait_dead(self, timeout: float = 10) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit")
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)
        self._selector.close()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


@pytest.fixture
def children():
    started: list[Child] = []

    def start(*args: object, mode: str = "two-sided") -> Child:
        child = Child(*args, mode=mode)
        started.append(child)
        return child

    yield start
    for child in started:
        child.stop()


@pytest.fixture
def requester(make_backend):
    def build(slot: int, blocks: int, **options) -> tuple[Requester, Pool]:
        backend = make_backend(**options)
        pool = Pool(GROUPS, blocks, slot)
        backend.register_regions(pool.regions)
        return Requester(backend, pool), pool

    return build


def test_pull_from_another_process(children, requester) -> None:
    slot = 64 << 10
    server = children("serve", slot, 12, 8)
    address = bytes.fromhex(server.read()["address"])
    req, pool = requester(slot, 24)
    names = block_names(12)
    for wanted, held in ((names[:8], 8), (names, 8), (block_names(3, prompt="cold"), 0)):
        attempt, slots = req.fetch(address, wanted)
        outcome = req.wait(attempt, slots, 10)
        assert outcome.is_delivered
        assert [m.tolist() for m in outcome.masks] == [[True] * held + [False] * (len(wanted) - held)] * 2
        for g, gid in enumerate(GROUPS):
            for slot_index, name in zip(slots[:held], wanted[:held], strict=True):
                assert np.array_equal(pool.arrays[g][slot_index], row_pattern(name, gid, slot))
    assert server.ask("pins") == {"pins": 0}


def test_a_server_killed_mid_pull_fails_the_fetch_and_the_rows_come_back(children, requester) -> None:
    slot = 1 << 20
    server = children("kill-mid-pull", slot, 64, 64)
    address = bytes.fromhex(server.read()["address"])
    req, _ = requester(slot, 64, window_bytes=4 << 20)
    # rows lent in reverse: one receive per row, so a window of 4 MiB is 4 rows (slow enough to kill)
    attempt, slots = req.fetch(address, block_names(64), timeout_s=8, slots=list(range(63, -1, -1)))
    outcome = req.wait(attempt, slots, 15)
    assert server.wait_dead() == -signal.SIGKILL
    assert outcome.is_failed, outcome
    assert outcome.cause is Cause.PEER_GONE, outcome  # found gone, not left to the deadline
    assert "is gone" in outcome.reason or "did not arrive" in outcome.reason
    assert outcome.rows_delivered < 128
    assert attempt.quiesced() and not req.lent


def test_a_server_killed_before_answering_fails_the_fetch_before_its_deadline(children, requester) -> None:
    server = children("kill-on-request", 4096, 4, 4)
    address = bytes.fromhex(server.read()["address"])
    req, _ = requester(4096, 4)
    attempt, slots = req.fetch(address, block_names(4), timeout_s=8)
    outcome = req.wait(attempt, slots, 15)
    assert server.wait_dead() == -signal.SIGKILL
    assert outcome.is_failed and outcome.cause is Cause.PEER_GONE and "is gone" in outcome.reason
    assert attempt.quiesced() and not req.lent


def test_a_server_frozen_mid_pull_fails_at_the_deadline_and_quiesces_within_the_grace(children, requester) -> None:
    slot = 1 << 20
    server = children("serve", slot, 64, 64)
    address = bytes.fromhex(server.read()["address"])
    req, _ = requester(slot, 64, window_bytes=8 << 20, grace_s=0.5)
    # rows lent in reverse: one receive per row, so a window of 8 MiB is 8 rows (slow enough to freeze)
    attempt, slots = req.fetch(address, block_names(64), timeout_s=1.0, slots=list(range(63, -1, -1)))
    deadline = time.monotonic() + 10
    while req.backend.stats().rows_received < 2 and time.monotonic() < deadline:
        time.sleep(0.0005)
    server.proc.send_signal(signal.SIGSTOP)  # alive, holding its connections, sending nothing
    try:
        outcome = req.wait(attempt, slots, 10)
    finally:
        server.proc.send_signal(signal.SIGKILL)
    assert outcome.is_failed and outcome.cause is Cause.DEADLINE and "deadline" in outcome.reason
    assert 0 < outcome.rows_delivered < 128
    # it quiesced because the grace ran out and forced the connection closed, not by itself
    events = attempt.job.machine.events()
    stop = events.index("DeadlinePassed")
    assert "GraceExpired" in events[stop:] and "ConnectionLost" in events[stop:], events
    assert attempt.quiesced() and not req.lent


def test_a_requester_killed_mid_pull_leaves_no_pin_on_the_server(children, make_backend, holders) -> None:
    slot = 1 << 20
    server = make_backend(window_bytes=4 << 20)
    holder, published = serve_filled(server, GROUPS, 64, slot)
    holders.append(holder)
    client = children("request", slot, 64, server.address().hex())
    assert client.read() == {"fetching": True}
    assert published.wait(10)
    deadline = time.monotonic() + 10
    while server.stats().rows_sent < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    client.proc.send_signal(signal.SIGKILL)
    assert client.wait_dead() == -signal.SIGKILL
    assert holder.wait_settled(1, 10)
    outcome = holder.answers[0].outcome
    assert outcome.is_failed and "gone" in outcome.reason, outcome
    assert holder.tree.wait_unpinned(5)


def answer_after_the_requester_died(server, children, mode: str = "two-sided"):
    """A10.11 with A10.4: the requester (another process) asks, its serving holder has taken the
    request but not answered, the requester is SIGKILLed and the serving end sees its connection
    go; then the holder answers. The answer's outcome, and the holder that made it."""
    slot = 64 << 10
    gate = threading.Event()
    pool, tree = Pool(GROUPS, 8, slot), ReuseTree()
    server.register_regions(pool.regions)
    fill(pool, tree, block_names(8))
    holder = ServingHolder(server, pool, tree, gate=gate)
    try:
        client = children("request", slot, 8, server.address().hex(), mode=mode)
        assert client.read() == {"fetching": True}
        assert holder.wait_requests(1, 10)
        lost = server.stats().connections_lost
        client.proc.send_signal(signal.SIGKILL)
        assert client.wait_dead() == -signal.SIGKILL
        wait_for(lambda: server.stats().connections_lost > lost, 10, "the serving end seeing the requester's "
                 "connection go")
        assert not holder.answers, "the holder answered before the requester's death was seen"
        gate.set()
        assert holder.wait_settled(1, 10)
        assert tree.wait_unpinned(5), "the answer's pins were not given back"
    finally:
        gate.set()
        holder.stop()
    answer = holder.answers[0]
    return answer.outcome, answer


def test_an_answer_to_a_requester_that_died_before_it_fails_as_peer_gone(children, make_backend) -> None:
    outcome, answer = answer_after_the_requester_died(make_backend(), children)
    assert outcome.is_failed, outcome  # a dead requester did not cancel anything (A10.4)
    assert outcome.cause is Cause.PEER_GONE and not outcome.by_peer, outcome
    assert outcome.rows_delivered == 0 and answer.attempt.quiesced()


def test_a_closed_port_fails_fast_with_a_clear_reason(requester) -> None:
    from kvwire_ucx.address import PeerAddress

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    req, _ = requester(4096, 2)
    attempt, slots = req.fetch(PeerAddress("127.0.0.1", port, 1).to_bytes(), block_names(2), timeout_s=8)
    outcome = req.wait(attempt, slots, 15)
    assert outcome.is_failed and outcome.cause is Cause.PEER_GONE  # refused at once, not at the deadline
    assert "could not connect" in outcome.reason and "refused" in outcome.reason.lower()
    assert attempt.job.machine.events()[:2] == ["Start", "ConnectionLost"]  # then the drained receives complete


def test_an_address_that_fails_at_once_fails_the_pull_with_the_reason(requester, caplog) -> None:
    """A connect the kernel refuses inside the call (TCP to a multicast address: "network is
    unreachable", no packet sent, no DNS asked) ends the pull with that reason, and the engine
    logs no error of its own (it once called a method renamed away, and the reason was lost)."""
    from kvwire_ucx.address import PeerAddress

    req, _ = requester(4096, 2)
    with caplog.at_level(logging.WARNING, logger="kvwire_ucx"):
        attempt, slots = req.fetch(PeerAddress("224.0.0.1", 5, 1).to_bytes(), block_names(2), timeout_s=8)
        outcome = req.wait(attempt, slots, 15)
    assert outcome.is_failed and outcome.cause is Cause.PEER_GONE, outcome
    assert "could not connect to 224.0.0.1" in outcome.reason and "unreachable" in outcome.reason.lower(), outcome
    engine_errors = [r for r in caplog.records if r.name.startswith("kvwire_ucx") and r.levelno >= logging.ERROR]
    assert not engine_errors, [r.getMessage() for r in engine_errors]


def test_an_address_whose_host_no_socket_takes_is_refused_when_submitted(requester) -> None:
    """H1.11 / S3.2: an address whose host a socket could never be asked to reach (a NUL byte,
    spaces, text that is no ASCII host name) raises ``InvalidSubmission`` from ``fetch()``; such
    a host once passed the decoder and failed inside the connect on the progress thread, where
    the pull never started and never concluded."""
    import struct

    from kvwire.contract import InvalidSubmission

    req, _ = requester(4096, 2)
    for host in ("a\x00b", "two words", "é" * 3):
        raw = host.encode()
        address = struct.pack(">4sBQHB", b"KVUA", 1, 1, 5, len(raw)) + raw  # the address layout, by hand
        with pytest.raises(InvalidSubmission, match="host"):
            req.fetch(address, block_names(2), timeout_s=8)


def test_a_host_the_socket_refuses_inside_the_connect_fails_the_pull_with_the_reason(requester, caplog,
                                                                                    monkeypatch) -> None:
    """Should a host still reach the connect and make the socket raise something other than
    ``OSError`` there (a ``TypeError`` or ``UnicodeError`` for text it cannot encode), the pull
    fails with the reason at once, and the engine logs no error of its own."""
    from kvwire_ucx.address import PeerAddress

    req, _ = requester(4096, 2)
    address = PeerAddress("127.0.0.1", 5, 1)
    raw = address.to_bytes()
    object.__setattr__(address, "host", "a\x00b")  # past the address's own check: the connect's guard alone
    monkeypatch.setattr(PeerAddress, "from_bytes", classmethod(lambda cls, data: address))
    with caplog.at_level(logging.WARNING, logger="kvwire_ucx"):
        attempt, slots = req.fetch(raw, block_names(2), timeout_s=8)
        outcome = req.wait(attempt, slots, 15)
    assert outcome.is_failed and outcome.cause is Cause.PEER_GONE, outcome
    assert "could not connect" in outcome.reason and "null" in outcome.reason.lower(), outcome
    engine_errors = [r for r in caplog.records if r.name.startswith("kvwire_ucx") and r.levelno >= logging.ERROR]
    assert not engine_errors, [r.getMessage() for r in engine_errors]
