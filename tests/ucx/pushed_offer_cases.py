"""Pushed offers (one-sided mode, wire version 4): a serving end pushes each standing offer's map
to the requesters that take pushes, and a fetch that a pushed offer covers whole reads at once,
with no ``Pull`` frame; anything else goes the old way. The offer's end withdraws it, and it
quiesces only once every connection it was pushed to answered or closed.

Not collected by the main test run: ``test_ucx_one_sided.py`` runs this file in its own pytest
process (a process that loaded NIXL must not run two-sided transfers afterwards; see the README).
Each test is written to fail when one clause of the push protocol is broken alone."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvwire.testing.require import backend_module

backend_module("ucxx._lib.libucxx", "ucx", "ucxx-cu12==0.52.0")  # skips, or fails when the run requires ucx
from kvwire_ucx.nixl import nixl_problem  # noqa: E402

if nixl_problem() is not None:
    pytest.skip(nixl_problem(), allow_module_level=True)

from kvwire_ucx import wire  # noqa: E402
from kvwire_ucx.faults import FrameFlow  # noqa: E402
from test_ucx_processes import Child  # noqa: E402
from ucx_holders import (  # noqa: E402
    Pool,
    Requester,
    ReuseTree,
    ServingHolder,
    block_names,
    check_timeline,
    fill,
    row_pattern,
)

from kvwire.contract import Cause, OutcomeStatus  # noqa: E402

GROUPS = (0, 1)
SLOT = 16 << 10


def check_rows(pool: Pool, slots: list[int], names: list[bytes]) -> None:
    for g, gid in enumerate(pool.group_ids):
        for slot, name in zip(slots, names, strict=True):
            assert np.array_equal(pool.arrays[g][slot], row_pattern(name, gid, pool.slot_bytes)), (gid, slot)


class Ends:
    """A one-sided serving end (its holder serves ``names[:held]`` from rows 3 on) and a
    one-sided requester whose outgoing frames are recorded."""

    def __init__(self, make_backend: Any, holders: list, held: int = 8, server: dict | None = None,
                 requester: dict | None = None) -> None:
        self.server = make_backend(mode="one-sided", **(server or {}))
        self.pool, self.tree = Pool(GROUPS, 32, SLOT), ReuseTree()
        self.server.register_regions(self.pool.regions)
        self.names = block_names(12)
        fill(self.pool, self.tree, self.names[:held], first_slot=3)
        self.holder = ServingHolder(self.server, self.pool, self.tree)
        holders.append(self.holder)
        backend = make_backend(mode="one-sided", **(requester or {}))
        self.here = Pool(GROUPS, 32, SLOT, first_region_id=10)
        backend.register_regions(self.here.regions)
        self.req = Requester(backend, self.here)
        self.sent: list[Any] = []
        wires = backend.engine.wires
        send = wires.send

        def recorded(conn: Any, message: Any) -> Any:
            self.sent.append(message)
            return send(conn, message)

        wires.send = recorded

    def offer(self, count: int = 8, groups: tuple[int, ...] = GROUPS, **options: Any) -> tuple[Any, threading.Event]:
        woken = threading.Event()
        view = self.pool.view(list(range(3, 3 + count)), self.names[:count], groups=list(groups))
        return self.server.offer(view, woken.set, **options), woken

    def pull(self, names: list[bytes], timeout: float = 10, **kw: Any) -> Any:
        attempt, slots = self.req.fetch(self.server.address(), names, **kw)
        outcome = self.req.wait(attempt, slots, timeout)
        if outcome.is_delivered:
            check_rows(self.here, slots, names)
        return outcome

    def pulls_sent(self) -> int:
        return sum(isinstance(m, wire.Pull) for m in self.sent)

    def pushed(self) -> int:
        return self.req.backend.stats().pulls_pushed

    def wait_pushed_here(self, count: int = 1, timeout: float = 5) -> None:
        """Wait until the requester keeps ``count`` pushed offers (the push arrived)."""
        requesting = self.req.backend.engine.requesting
        deadline = time.monotonic() + timeout
        while sum(len(v) for v in list(requesting._pushed.values())) < count:
            assert time.monotonic() < deadline, "the push never reached the requester"
            time.sleep(0.01)


def hold(backend: Any, direction: FrameFlow, kind: type) -> Any:
    """A hold of ``backend``'s frames of ``kind`` going ``direction``, taken up by its progress
    thread before this returns."""
    taken = backend.engine.faults.hold(direction, lambda m: isinstance(m, kind))
    synced = threading.Event()
    backend.engine.submit(synced.set)
    assert synced.wait(5)
    return taken


def wait_quiesced(offer: Any, woken: threading.Event, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not offer.quiesced() and time.monotonic() < deadline:
        woken.wait(0.05)
        woken.clear()
    return offer.quiesced()


def hold_reads(nixl: Any) -> threading.Event:
    """Make the reads of ``nixl`` stay in flight until the returned gate is set: each read
    starts (and NIXL may even finish it), but is reported running, and cannot be released."""
    gate = threading.Event()
    read, done, release = nixl.read, nixl.done, nixl.release

    def held_read(local, remote, peer, memories=(-1, -1)):  # type: ignore[no-untyped-def]
        handle, _ = read(local, remote, peer, memories)
        return handle, False

    def held_done(handle):  # type: ignore[no-untyped-def]
        return gate.is_set() and done(handle)

    def held_release(handle):  # type: ignore[no-untyped-def]
        return gate.is_set() and release(handle)

    nixl.read, nixl.done, nixl.release = held_read, held_done, held_release
    return gate


# ---------------------------------------------------------------- covered pulls read at once

def test_a_pull_a_pushed_offer_covers_is_read_without_a_pull_frame(make_backend, holders) -> None:
    """An offer made once the requester is connected is pushed to it; a pull it covers reads at
    once (no Pull frame, no Ack), byte for byte, and the serving end never hears of it."""
    ends = Ends(make_backend, holders)
    assert ends.pull(ends.names[:1]).is_delivered  # connects (answered by the holder)
    assert ends.holder.wait_settled(1, 5)
    offer, woken = ends.offer()
    ends.wait_pushed_here()
    before = ends.pulls_sent()
    started = time.perf_counter()
    attempt, slots = ends.req.fetch(ends.server.address(), ends.names[:6])
    outcome = ends.req.wait(attempt, slots, 10)
    wall = time.perf_counter() - started
    assert outcome.is_delivered and all(m.all() for m in outcome.masks), outcome
    check_rows(ends.here, slots, ends.names[:6])
    assert ends.pulls_sent() == before and ends.pushed() == 1
    transfer = attempt.job.transfer
    assert not any(isinstance(m, (wire.Ack, wire.Cancel)) and m.transfer == transfer for m in ends.sent), ends.sent
    stats = ends.server.stats()
    assert stats.pulls_received == 1 and stats.pulls_offered == 0 and stats.offers_pushed == 1
    assert ends.holder.requests_seen == 1 and ends.req.backend.stats().rows_read == 2 + 12
    check_timeline(attempt.timeline(), wall, ("pushed", "answered", "concluded", "quiesced"))
    offer.cancel()
    assert wait_quiesced(offer, woken)
    assert ends.tree.wait_unpinned(5)


def test_an_offer_made_before_the_requester_connected_is_pushed_after_hello(make_backend, holders) -> None:
    """The offers standing when a requester connects are pushed after the Hello: its first
    pull asks (the connection is not up yet), every later covered pull reads at once."""
    ends = Ends(make_backend, holders)
    offer, woken = ends.offer()
    for k, wanted in enumerate((ends.names[:2], ends.names[:8], ends.names[2:5], [ends.names[7], ends.names[0]])):
        assert ends.pull(wanted).is_delivered, k
    assert ends.pulls_sent() == 1 and ends.pushed() == 3
    assert ends.server.stats().pulls_offered == 1 and ends.holder.requests_seen == 0
    offer.cancel()
    assert wait_quiesced(offer, woken)


def test_an_offer_made_before_serve_is_pushed_only_once_the_end_serves(make_backend) -> None:
    """O1.4: an offer answers only while its backend serves; a push is an answer in advance, so
    it goes out only after serve()."""
    server = make_backend(mode="one-sided")
    pool = Pool(GROUPS, 16, SLOT)
    server.register_regions(pool.regions)
    names = block_names(4)
    fill(pool, ReuseTree(), names)
    woken = threading.Event()
    offer = server.offer(pool.view([0, 1, 2, 3], names), woken.set)
    here = Pool(GROUPS, 16, SLOT, first_region_id=10)
    backend = make_backend(mode="one-sided")
    backend.register_regions(here.regions)
    req = Requester(backend, here)
    attempt, slots = req.fetch(server.address(), names[:2], timeout_s=2)
    outcome = req.wait(attempt, slots, 10)
    assert outcome.is_failed and "not serving" in outcome.reason, outcome
    assert server.stats().offers_pushed == 0
    server.serve(lambda: None)
    # The push reached the requester (not only left the serving end): until the requester's
    # progress thread has taken it up, a fetch goes the old way (under load that took long
    # enough for the fetch below to go out first).
    deadline = time.monotonic() + 5
    while backend.stats().pushes_received == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats().offers_pushed == 1
    attempt, slots = req.fetch(server.address(), names[:4])
    assert req.wait(attempt, slots, 10).is_delivered
    assert backend.stats().pulls_pushed == 1
    offer.cancel()
    assert wait_quiesced(offer, woken)


@pytest.mark.parametrize("how", ["a name missing", "another group", "another slot size"])
def test_a_pull_no_pushed_offer_covers_goes_the_old_way_to_the_holder(make_backend, holders, how) -> None:
    """O1.5: a pull the pushed offer does not cover whole (a name it lacks, a group it lacks, a
    slot size it does not have) sends a Pull, and reaches the holder."""
    ends = Ends(make_backend, holders, held=10)
    offer, woken = ends.offer(count=6, groups=(0,) if how == "another group" else GROUPS)
    assert ends.pull(ends.names[:1]).is_delivered  # connects; the push follows the Hello
    ends.wait_pushed_here()
    pushed, asked, seen = ends.pushed(), ends.pulls_sent(), ends.holder.requests_seen
    if how == "another slot size":
        pool = Pool(GROUPS, 8, 2 * SLOT, first_region_id=40)
        ends.req.backend.register_regions(pool.regions)
        other = Requester(ends.req.backend, pool)
        attempt, slots = other.fetch(ends.server.address(), ends.names[:2])
        outcome = other.wait(attempt, slots, 10)
        assert not outcome.is_delivered or outcome.rows_delivered == 0, outcome  # the holder's rows do not fit
    else:
        wanted = ends.names[:7] if how == "a name missing" else ends.names[:3]
        outcome = ends.pull(wanted)
        assert outcome.is_delivered and all(m.all() for m in outcome.masks), outcome
    assert ends.pushed() == pushed and ends.pulls_sent() == asked + 1
    assert ends.holder.wait_requests(seen + 1, 5), "the pull not covered never reached the holder"
    offer.cancel()
    assert wait_quiesced(offer, woken)


# ---------------------------------------------------------------- withdrawal

def test_a_cancel_while_a_pushed_read_is_in_flight_fails_it_and_quiesces_after_the_answer(make_backend,
                                                                                          holders) -> None:
    """O1.8: the holder cancels the offer while a read from its push is in flight: the fetch
    does not deliver (the cause a ReadOffer's reader gets when its offer ends), no Withdrawn goes
    out while the read is in flight, and the offer quiesces only once it did."""
    ends = Ends(make_backend, holders)
    offer, woken = ends.offer()
    assert ends.pull(ends.names[:1]).is_delivered
    ends.wait_pushed_here()
    gate = hold_reads(ends.req.backend.engine.nixl)
    attempt, slots = ends.req.fetch(ends.server.address(), ends.names[:6])
    time.sleep(0.1)
    assert attempt.poll() is None and ends.pushed() == 1  # reading
    offer.cancel()
    outcome = ends.req.wait_concluded(attempt, 5)
    assert outcome.is_failed and outcome.cause is Cause.DECLINED and "withdrew" in outcome.reason, outcome
    assert not attempt.quiesced()  # its read still runs
    time.sleep(0.3)
    assert offer.poll().status is OutcomeStatus.CANCELLED and not offer.quiesced(), (
        "the offer quiesced while a read from its push was still in flight")
    assert not any(isinstance(m, wire.Withdrawn) for m in ends.sent)
    gate.set()
    assert wait_quiesced(offer, woken)
    assert ends.req.wait(attempt, slots, 5) is not None and attempt.quiesced()
    assert any(isinstance(m, wire.Withdrawn) for m in ends.sent)


def test_the_offer_quiesces_only_once_the_withdrawal_is_answered(make_backend, holders) -> None:
    """With no read in flight the requester answers at once; held back, the offer waits for it
    (and the requester never reads the withdrawn offer meanwhile: a next pull asks)."""
    ends = Ends(make_backend, holders)
    offer, woken = ends.offer()
    assert ends.pull(ends.names[:1]).is_delivered
    ends.wait_pushed_here()
    withdrawn = hold(ends.req.backend, FrameFlow.OUTGOING, wire.Withdrawn)
    offer.cancel()
    time.sleep(0.2)
    assert len(withdrawn.held) == 1 and not offer.quiesced()
    asked = ends.pulls_sent()
    assert ends.pull(ends.names[:4]).is_delivered  # answered by the holder now
    assert ends.pulls_sent() == asked + 1 and ends.pushed() == 0
    withdrawn.release()
    assert wait_quiesced(offer, woken)


def test_a_requester_that_never_answers_the_withdrawal_is_cut_off_after_the_grace(make_backend, holders) -> None:
    ends = Ends(make_backend, holders)
    offer, woken = ends.offer()
    assert ends.pull(ends.names[:1]).is_delivered
    ends.wait_pushed_here()
    hold(ends.req.backend, FrameFlow.OUTGOING, wire.Withdrawn)
    offer.cancel()
    started = time.monotonic()
    assert wait_quiesced(offer, woken, 5)
    assert time.monotonic() - started >= 0.4  # the grace (0.5 s): the serving end closed the connection
    deadline = time.monotonic() + 5
    while ends.req.backend.stats().connections_lost == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ends.req.backend.stats().connections_lost == 1


def test_a_requester_whose_connection_closes_counts_as_answered(make_backend, holders) -> None:
    ends = Ends(make_backend, holders, server={"grace_s": 30.0})
    offer, woken = ends.offer()
    assert ends.pull(ends.names[:1]).is_delivered
    ends.wait_pushed_here()
    hold(ends.req.backend, FrameFlow.OUTGOING, wire.Withdrawn)
    offer.cancel()
    time.sleep(0.2)
    assert not offer.quiesced()
    ends.req.backend.shutdown()
    ends.req.backend.close()  # its connections close
    assert wait_quiesced(offer, woken, 5)


def test_a_requester_killed_after_the_push_leaves_the_offer_free_to_quiesce(make_backend, holders) -> None:
    slot = 64 << 10
    server = make_backend(mode="one-sided", grace_s=30.0)  # only the connection's end can answer for it
    pool, tree = Pool(GROUPS, 8, slot), ReuseTree()
    server.register_regions(pool.regions)
    names = block_names(8)
    fill(pool, tree, names)
    holders.append(ServingHolder(server, pool, tree))
    woken = threading.Event()
    offer = server.offer(pool.view(list(range(8)), names), woken.set)
    client = Child("request", slot, 8, server.address().hex(), mode="one-sided")
    try:
        assert client.read() == {"fetching": True}
        deadline = time.monotonic() + 10
        while server.stats().offers_pushed < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.stats().offers_pushed == 1
        client.proc.send_signal(signal.SIGKILL)
        assert client.wait_dead() == -signal.SIGKILL
        offer.cancel()
        assert wait_quiesced(offer, woken, 10)
    finally:
        client.stop()


def test_a_shutdown_of_the_serving_end_withdraws_its_pushed_offers(make_backend, holders) -> None:
    ends = Ends(make_backend, holders)
    offer, woken = ends.offer()
    assert ends.pull(ends.names[:1]).is_delivered
    ends.wait_pushed_here()
    ends.holder.stop()
    ends.server.shutdown()
    assert wait_quiesced(offer, woken, 5) and offer.poll().cause is Cause.SHUTDOWN
    assert any(isinstance(m, wire.Withdrawn) for m in ends.sent)
    assert not any(ends.req.backend.engine.requesting._pushed.values())  # forgotten once answered


# ---------------------------------------------------------------- the requester's own end

def test_a_requesters_cancel_ends_its_fetch_and_the_offer_answers_the_next(make_backend, holders) -> None:
    """O1.9: a requester that cancels a fetch its pushed offer answers ends that fetch only."""
    ends = Ends(make_backend, holders)
    offer, woken = ends.offer()
    assert ends.pull(ends.names[:1]).is_delivered
    ends.wait_pushed_here()
    from kvwire_ucx.requesting import PushedAnswer

    answers = hold(ends.req.backend, FrameFlow.INCOMING, PushedAnswer)
    attempt, slots = ends.req.fetch(ends.server.address(), ends.names[:4])
    time.sleep(0.1)
    assert len(answers.held) == 1
    attempt.cancel()
    outcome = ends.req.wait(attempt, slots, 5)
    assert outcome.is_cancelled and outcome.cause is Cause.HOLDER_CANCELLED, outcome
    answers.release()
    assert offer.poll() is None
    assert ends.pull(ends.names[2:8]).is_delivered and ends.pushed() == 2
    assert offer.poll() is None and ends.holder.requests_seen == 0
    offer.cancel()
    assert wait_quiesced(offer, woken)


def test_a_read_from_a_pushed_offer_that_fails_ends_only_that_fetch(make_backend, holders) -> None:
    ends = Ends(make_backend, holders)
    offer, woken = ends.offer()
    assert ends.pull(ends.names[:1]).is_delivered
    ends.wait_pushed_here()
    nixl = ends.req.backend.engine.nixl
    read = nixl.read
    from kvwire_ucx.nixl import NixlError

    def failing(*args, **kw):  # type: ignore[no-untyped-def]
        raise NixlError("injected: the read failed")

    nixl.read = failing
    outcome = ends.pull(ends.names[:3])
    assert outcome.is_failed and "injected" in outcome.reason, outcome
    nixl.read = read
    assert ends.pull(ends.names[:3]).is_delivered and ends.pushed() == 2 and offer.poll() is None
    offer.cancel()
    assert wait_quiesced(offer, woken)


# ---------------------------------------------------------------- a NIXL path that stalls

def stall_path(nixl: Any) -> list[bytes]:
    """Make ``nixl``'s path to every peer agent loaded now stall for good, as after a fault:
    each read from such an agent is reported running until released (release works), until
    this end forgets that agent; one loaded again afterwards reads as before. Returns the agents
    forgotten, in order."""
    stale = set(nixl._peers)
    assert stale, "no peer agent is loaded yet"
    stalled: list[Any] = []
    forgotten: list[bytes] = []
    read, done, forget = nixl.read, nixl.done, nixl.forget_peer

    def stalling_read(local, remote, peer, memories=(-1, -1)):  # type: ignore[no-untyped-def]
        handle, finished = read(local, remote, peer, memories)
        if peer not in stale:
            return handle, finished
        stalled.append(handle)
        return handle, False

    def stalling_done(handle):  # type: ignore[no-untyped-def]
        return not any(handle is h for h in stalled) and done(handle)

    def forgetting(peer):  # type: ignore[no-untyped-def]
        stale.discard(peer)
        forgotten.append(peer)
        forget(peer)

    nixl.read, nixl.done, nixl.forget_peer = stalling_read, stalling_done, forgetting
    return forgotten


@pytest.mark.parametrize("answered", ["asked", "pushed"])
def test_a_read_stalled_past_the_grace_drops_the_nixl_path_and_the_next_pull_connects_anew(make_backend, holders,
                                                                                           answered) -> None:
    """A fetch whose reads did not finish within its deadline and the grace (a path that
    stalls after a fault) closes its connection, and with it the offers pushed on it and the
    peer's agent: the next pull connects anew, gets the agent's metadata again and reads. Kept,
    the stalled path failed the next pull at its deadline ("the deadline of 5s passed with 0 of
    6 rows arrived"), as tests/reliability's link pulled mid-pull did once in CI."""
    ends = Ends(make_backend, holders)
    offer = None
    if answered == "pushed":
        offer, woken = ends.offer()
    assert ends.pull(ends.names[:1]).is_delivered  # connects, loads the serving end's agent
    if offer is not None:
        ends.wait_pushed_here()
    requester = ends.req.backend
    forgotten = stall_path(requester.engine.nixl)
    opened = requester.stats().connections_opened
    pushed = ends.pushed()
    pushed_on = set(requester.engine.requesting._pushed)  # the connection the offer was pushed on
    outcome = ends.pull(ends.names[:3], timeout_s=1.0)
    # the deadline ends it: the requester's own, or (on a loaded machine, asked) the serving end's,
    # whose word can arrive first
    by_server = outcome.cause is Cause.DECLINED and "serving end's deadline passed" in (outcome.reason or "")
    assert outcome.is_failed and (outcome.cause is Cause.DEADLINE or by_server), outcome
    assert ends.pushed() == pushed + (answered == "pushed")  # the stalled read was the pushed offer's
    again = ends.pull(ends.names[:3], timeout_s=5.0)
    assert again.is_delivered, again
    assert forgotten == [ends.server.engine.nixl.name.encode()]
    assert requester.stats().connections_opened == opened + 1
    assert not pushed_on & set(requester.engine.requesting._pushed)  # the closed connection's offers are gone
    if offer is not None:
        assert offer.poll() is None  # the offer stands: the closed connection counted as answered
        offer.cancel()
        assert wait_quiesced(offer, woken)
    assert ends.tree.wait_unpinned(5)


# ---------------------------------------------------------------- deadlines

def test_no_read_starts_from_a_pushed_offer_about_to_run_out_or_past_its_deadline(make_backend, holders) -> None:
    """A pull reads from a pushed offer only while it stands for the grace more (O1.12); after
    that, and after its deadline even with the withdrawal not yet arrived, pulls ask."""
    ends = Ends(make_backend, holders, requester={"grace_s": 0.5})
    assert ends.pull(ends.names[:1]).is_delivered
    offer, woken = ends.offer(timeout_s=1.5)
    ends.wait_pushed_here()
    made = time.monotonic()
    assert ends.pull(ends.names[:2]).is_delivered and ends.pushed() == 1
    time.sleep(max(0.0, made + 1.1 - time.monotonic()))  # 0.4 s left: less than the grace
    asked = ends.pulls_sent()
    assert ends.pull(ends.names[:2]).is_delivered
    assert ends.pushed() == 1 and ends.pulls_sent() == asked + 1
    withdraw = hold(ends.req.backend, FrameFlow.INCOMING, wire.Withdraw)
    time.sleep(max(0.0, made + 1.7 - time.monotonic()))  # past its deadline; the withdrawal held
    assert offer.poll() is not None and offer.poll().is_delivered
    assert ends.pull(ends.names[:2]).is_delivered and ends.pushed() == 1 and ends.pulls_sent() == asked + 2
    withdraw.release()
    assert wait_quiesced(offer, woken)


# ---------------------------------------------------------------- protocol mistakes

@pytest.mark.parametrize("mistake", ["withdraw of an offer never pushed", "the same offer pushed twice",
                                     "a push naming a block twice", "a push without metadata from an unknown agent"])
def test_a_serving_end_that_breaks_the_push_protocol_is_dropped(make_backend, holders, mistake) -> None:
    ends = Ends(make_backend, holders)
    offer, woken = ends.offer()
    assert ends.pull(ends.names[:1]).is_delivered
    ends.wait_pushed_here()
    engine = ends.req.backend.engine
    (conn,) = [c for c in engine.wires.all if c.outbound and not c.closed]
    runs = np.array([[ends.pool.arrays[0][3].ctypes.data, 2]], dtype=np.uint64)
    names = ends.names[0] + (ends.names[0] if mistake == "a push naming a block twice" else ends.names[1])
    group = wire.PushedGroup(0, SLOT, -1, 32, names, runs)
    agent = b"another-agent" if "unknown agent" in mistake else ends.server.engine.nixl.name.encode()
    message: Any
    if mistake == "withdraw of an offer never pushed":
        message = wire.Withdraw(999)
    else:
        offer_id = offer.job.offer_id if mistake == "the same offer pushed twice" else 77
        message = wire.PushOffer(offer_id, 10_000, agent, 1, b"", (group,))
    engine.faults.inject(FrameFlow.INCOMING, conn, message)
    deadline = time.monotonic() + 5
    while ends.req.backend.stats().connections_dropped == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ends.req.backend.stats().connections_dropped == 1
    assert wait_quiesced(offer, woken, 1) is False  # still standing: a dropped connection ends no offer
    offer.cancel()
    assert wait_quiesced(offer, woken)
