"""kvwire-ucx's opt-in one-sided mode: pulls answered with where the rows lie, and read by the
requester through NIXL (real agents, cma on loopback), in one process and across two; a pull
between the two modes is declined; and the trust model, as the README states it, holds.

Not collected by the main test run: ``test_ucx_one_sided.py`` runs this file in its own pytest
process, because a process that loaded NIXL must not run two-sided transfers afterwards (the
README says why), and the main run goes on with two-sided tests."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from kvwire.testing.require import backend_module

backend_module("ucxx._lib.libucxx", "ucx", "ucxx-cu12==0.52.0")  # skips, or fails when the run requires ucx
from kvwire_ucx.nixl import nixl_problem  # noqa: E402

if nixl_problem() is not None:
    pytest.skip(nixl_problem(), allow_module_level=True)

from test_ucx_processes import Child, answer_after_the_requester_died, children  # noqa: E402,F401
from ucx_holders import (  # noqa: E402
    Pool,
    Requester,
    ReuseTree,
    ServingHolder,
    block_names,
    check_timeline,
    fill,
    row_pattern,
    serve_filled,
)

from kvwire.contract import Cause, Hint, InvalidSubmission, MemoryKind, OutcomeStatus, SlotRegion  # noqa: E402

GROUPS = (0, 1)
SLOT = 16 << 10


def check_rows(pool: Pool, slots: list[int], names: list[bytes]) -> None:
    for g, gid in enumerate(pool.group_ids):
        for slot, name in zip(slots, names, strict=True):
            assert np.array_equal(pool.arrays[g][slot], row_pattern(name, gid, pool.slot_bytes)), (gid, slot)


def serving_end(make_backend, holders, mode: str, held: int = 6, **options):
    backend = make_backend(mode=mode, **options)
    pool, tree = Pool(GROUPS, 32, SLOT), ReuseTree()
    backend.register_regions(pool.regions)
    names = block_names(10)
    fill(pool, tree, names[:held], first_slot=3)
    holder = ServingHolder(backend, pool, tree)
    holders.append(holder)
    return backend, pool, tree, names, holder


def requesting_end(make_backend, mode: str, **options) -> tuple[Requester, Pool]:
    backend = make_backend(mode=mode, **options)
    pool = Pool(GROUPS, 32, SLOT, first_region_id=10)
    backend.register_regions(pool.regions)
    return Requester(backend, pool), pool


def test_a_one_sided_pull_reads_the_held_prefix_byte_for_byte(make_backend, holders) -> None:
    a, _, tree, names, holder = serving_end(make_backend, holders, "one-sided")
    req, pool = requesting_end(make_backend, "one-sided", window_bytes=3 * 2 * SLOT)  # 3 blocks per read
    for wanted, held in ((names[:6], 6), (names[:10], 6), (block_names(3, prompt="cold"), 0)):
        attempt, slots = req.fetch(a.address(), wanted)
        outcome = req.wait(attempt, slots, 10)
        assert outcome.is_delivered, outcome
        assert [m.tolist() for m in outcome.masks] == [[True] * held + [False] * (len(wanted) - held)] * 2
        check_rows(pool, slots[:held], wanted[:held])
    # the rows were read through NIXL, none sent as tag messages
    assert req.backend.stats().rows_read == 24 and a.stats().rows_sent == 0
    assert holder.wait_settled(3, 5) and all(x.outcome.is_delivered for x in holder.answers)
    assert tree.wait_unpinned(5)


#: (slots at the serving end, slots lent by the requester) of one pull of 8 blocks (issue 33).
LAYOUTS = (
    (list(range(0, 8)), list(range(8, 16))),                         # adjacent at both ends: one span
    (list(range(8, 16)), list(range(7, -1, -1))),                    # adjacent there, reversed here
    ([20, 19, 18, 17, 3, 4, 5, 30], list(range(0, 8))),              # reversed, then a run, there; adjacent here
    ([9, 10, 11, 25, 26, 12, 13, 2], [16, 17, 3, 4, 5, 20, 21, 22]),  # runs that differ at the two ends
)


def test_rows_in_any_layout_at_either_end_land_byte_for_byte(make_backend, holders) -> None:
    """The answer names runs of rows adjacent at the serving end, the requester reads spans
    adjacent at both ends (and ranges of 2 blocks all at once): every row lands where it was lent,
    whatever the two layouts."""
    backend = make_backend(mode="one-sided")
    there = Pool(GROUPS, 32, SLOT)
    tree = ReuseTree()
    backend.register_regions(there.regions)
    holder = ServingHolder(backend, there, tree)
    holders.append(holder)
    req, here = requesting_end(make_backend, "one-sided", window_bytes=2 * 2 * SLOT)
    for k, (served, lent) in enumerate(LAYOUTS):
        names = block_names(8, prompt=f"layout {k}")
        for name, slot in zip(names, served, strict=True):
            for g, gid in enumerate(there.group_ids):
                there.arrays[g][slot] = row_pattern(name, gid, SLOT)
            tree.insert(name, slot)
        attempt, slots = req.fetch(backend.address(), names, slots=lent)
        outcome = req.wait(attempt, slots, 20)
        assert outcome.is_delivered and all(m.all() for m in outcome.masks), (k, outcome)
        check_rows(here, slots, names)
    assert req.backend.stats().rows_read == 2 * 8 * len(LAYOUTS)
    assert tree.wait_unpinned(5)


def test_a_standing_offer_is_read_one_sided_without_the_holder(make_backend, holders) -> None:
    """O1 in the one-sided mode: the ReadOffer comes from the offer, the requester reads it
    through NIXL, and the holder never sees the pull; cancelling the offer quiesces it."""
    a, pa, tree, names, holder = serving_end(make_backend, holders, "one-sided")
    req, pool = requesting_end(make_backend, "one-sided")
    woken = threading.Event()
    offer = a.offer(pa.view(list(range(3, 9)), names[:6]), woken.set)
    attempt, slots = req.fetch(a.address(), names[:4])
    outcome = req.wait(attempt, slots, 10)
    assert outcome.is_delivered and [m.tolist() for m in outcome.masks] == [[True] * 4] * 2
    check_rows(pool, slots, names[:4])
    assert req.backend.stats().rows_read == 8 and a.stats().pulls_offered == 1 and holder.requests_seen == 0
    _cancel_and_quiesce(offer, woken)
    assert offer.poll().status is OutcomeStatus.CANCELLED


def _cancel_and_quiesce(offer, woken: threading.Event) -> None:
    offer.cancel()
    for _ in range(100):  # each wake may report a change (W1.8), or none
        if offer.quiesced() or not woken.wait(10):
            break
        woken.clear()
    assert offer.quiesced(), "the cancelled offer never quiesced"


def test_an_offer_in_any_layout_answers_prefixes_and_other_picks_byte_for_byte(make_backend, holders) -> None:
    """An answer from a standing offer names its rows' runs, taken for a prefix of the offered
    names from the runs the offer made once (cut at any row, inside a run or at its end), and
    made afresh for names in another order: every pull lands byte for byte in rows lent in
    another layout, none reaches the holder, and the cancelled offer quiesces."""
    backend = make_backend(mode="one-sided")
    there = Pool(GROUPS, 32, SLOT)
    tree = ReuseTree()
    backend.register_regions(there.regions)
    holders.append(ServingHolder(backend, there, tree))
    served = [9, 10, 11, 25, 26, 12, 13, 2, 3, 4]  # runs there: 3, 2, 2, 3 rows
    names = block_names(len(served), prompt="offered in runs")
    for name, slot in zip(names, served, strict=True):
        for g, gid in enumerate(there.group_ids):
            there.arrays[g][slot] = row_pattern(name, gid, SLOT)
    woken = threading.Event()
    offer = backend.offer(there.view(served, names), woken.set)
    req, here = requesting_end(make_backend, "one-sided", window_bytes=2 * 2 * SLOT)
    lent = [16, 17, 3, 4, 5, 20, 21, 22, 0, 1]  # runs here: 2, 3, 3, 2 rows
    pulls = (names, names[:1], names[:4], names[:5], names[:8], names[5:], [names[4], names[0], names[9], names[1]])
    for wanted in pulls:
        attempt, slots = req.fetch(backend.address(), wanted, slots=lent[:len(wanted)])
        outcome = req.wait(attempt, slots, 20)
        assert outcome.is_delivered and all(m.all() for m in outcome.masks), (len(wanted), outcome)
        check_rows(here, slots, wanted)
    # the first pull asks (the offer is pushed once the connection it opens is up); the rest are
    # answered from the pushed offer without a Pull
    assert backend.stats().pulls_offered == 1 and req.backend.stats().pulls_pushed == len(pulls) - 1
    assert holders[0].requests_seen == 0 and backend.stats().pulls_received == 1
    assert req.backend.stats().rows_read == 2 * sum(len(w) for w in pulls)
    _cancel_and_quiesce(offer, woken)


def test_a_pull_of_the_most_blocks_with_the_longest_names_is_read_from_an_offer(make_backend, holders) -> None:
    """The largest Pull the wire takes (MAX_BLOCKS names of MAX_NAME_BYTES: a 2 MiB frame, more
    than a socket takes at once) reaches the serving end whole, and its answer, one run per group,
    is read byte for byte."""
    from kvwire_ucx import wire

    blocks, slot = wire.MAX_BLOCKS, 64
    backend = make_backend(mode="one-sided")
    there = Pool(GROUPS, blocks, slot)
    backend.register_regions(there.regions)
    names = block_names(blocks, prompt="long", width=wire.MAX_NAME_BYTES)
    for g in range(len(GROUPS)):
        there.arrays[g][:] = np.random.default_rng(g).integers(0, 256, there.arrays[g].shape, dtype=np.uint8)
    woken = threading.Event()
    offer = backend.offer(there.view(range(blocks), names), woken.set)
    backend.serve(lambda: None)  # no holder: a pull the offer did not answer would time out
    here = Pool(GROUPS, blocks, slot, first_region_id=10)
    req = Requester(make_backend(mode="one-sided"), here)
    req.backend.register_regions(here.regions)
    attempt, slots = req.fetch(backend.address(), names, timeout_s=30, slots=list(range(blocks)))
    outcome = req.wait(attempt, slots, 40)
    assert outcome.is_delivered and all(m.all() for m in outcome.masks), outcome
    for g in range(len(GROUPS)):
        assert np.array_equal(here.arrays[g], there.arrays[g])
    assert backend.stats().pulls_offered == 1
    _cancel_and_quiesce(offer, woken)


def test_the_requester_is_woken_before_its_last_word_is_written(make_backend, holders) -> None:
    """The requester's Ack (its last word, after the reads) is written after the holder's wake:
    the holder learns the pull concluded without waiting for a socket write. The serving end
    still hears it: its answer concludes delivered."""
    a, pa, tree, names, holder = serving_end(make_backend, holders, "one-sided")
    backend = make_backend(mode="one-sided")
    pool = Pool(GROUPS, 32, SLOT, first_region_id=10)
    backend.register_regions(pool.regions)
    order: list[str] = []
    wires = backend._engine.wires
    send = wires.send

    def recorded_send(conn, message):  # type: ignore[no-untyped-def]
        order.append(type(message).__name__)
        return send(conn, message)

    wires.send = recorded_send
    woken = threading.Event()

    def wake() -> None:
        order.append("wake")
        woken.set()

    attempt = backend.fetch(pool.view([0, 1, 2], names[:3]), Hint.of("peer", address=a.address()), wake)
    deadline = time.monotonic() + 10
    while not (attempt.poll() is not None and attempt.quiesced()) and time.monotonic() < deadline:
        woken.wait(1)
        woken.clear()
    assert attempt.poll() is not None and attempt.poll().is_delivered, attempt.poll()
    assert holder.wait_settled(1, 5) and holder.answers[0].outcome.is_delivered  # the Ack arrived
    assert "Ack" in order and order.index("wake") < order.index("Ack"), order
    check_rows(pool, [0, 1, 2], names[:3])


def test_a_one_sided_pulls_timeline_separates_the_round_trip_from_the_read(make_backend, holders) -> None:
    a, _, tree, names, holder = serving_end(make_backend, holders, "one-sided")
    req, _ = requesting_end(make_backend, "one-sided")
    started = time.perf_counter()
    attempt, slots = req.fetch(a.address(), names[:6])
    assert req.wait(attempt, slots, 10).is_delivered
    assert holder.wait_settled(1, 5)
    wall = time.perf_counter() - started
    check_timeline(attempt.timeline(), wall, ("asked", "answered", "concluded", "quiesced"))
    check_timeline(holder.answers[0].attempt.timeline(), wall, ("answered", "concluded"), ("answered", "quiesced"))


@pytest.mark.parametrize(("server_mode", "requester_mode"), [("two-sided", "one-sided"), ("one-sided", "two-sided")])
def test_a_pull_between_the_modes_is_declined_saying_why(make_backend, holders, server_mode, requester_mode) -> None:
    a, _, tree, names, holder = serving_end(make_backend, holders, server_mode)
    req, _ = requesting_end(make_backend, requester_mode)
    attempt, slots = req.fetch(a.address(), names[:4])
    outcome = req.wait(attempt, slots, 10)
    assert outcome.is_failed and f"serves {server_mode} pulls only" in outcome.reason, outcome
    assert outcome.rows_delivered == 0 and holder.requests_seen == 0 and tree.pinned() == 0
    assert a.stats().rows_sent == 0 and req.backend.stats().rows_received == 0


def test_new_regions_reach_the_reader_with_fresh_metadata(make_backend, holders) -> None:
    """Metadata travels once per generation: a region registered after the first pull is
    readable by the next pull over the same connection."""
    a, _, _, names, holder = serving_end(make_backend, holders, "one-sided")
    req, pool = requesting_end(make_backend, "one-sided")
    attempt, slots = req.fetch(a.address(), names[:2])
    assert req.wait(attempt, slots, 10).is_delivered
    late = Pool(GROUPS, 8, SLOT, first_region_id=20)
    a.register_regions(late.regions)
    late_names = block_names(4, prompt="late")
    fill(late, holder.tree, late_names)
    holder.pool = late  # the serving holder now answers from the new regions
    attempt, slots = req.fetch(a.address(), late_names)
    outcome = req.wait(attempt, slots, 10)
    assert outcome.is_delivered and outcome.rows_delivered == 8, outcome
    check_rows(pool, slots, late_names)


def test_trust_model_a_reader_reaches_every_registered_region_and_nothing_else(make_backend, holders) -> None:
    """What the README says the one-sided mode exposes: once a peer has the serving end's
    metadata, it can read any row of any registered region (here a block the holder never
    offered), and nothing outside them. (In one process, NIXL needs the target agent progressed,
    as its backend's thread does anyway; across processes a cma read needs nothing of the
    target at all.)"""
    a, served, _, names, _ = serving_end(make_backend, holders, "one-sided", held=2)
    secret = Pool(GROUPS, 4, SLOT, first_region_id=30)
    secret.arrays[0][:] = 0x5A  # registered, never offered to anyone
    a.register_regions(secret.regions)
    unregistered = np.full(SLOT, 0xA5, dtype=np.uint8)
    req, pool = requesting_end(make_backend, "one-sided")
    attempt, slots = req.fetch(a.address(), names[:2])
    assert req.wait(attempt, slots, 10).is_delivered
    reader = req.backend.engine.nixl
    agent = a.engine.nixl.name.encode()
    landing = pool.arrays[0][20]
    local = np.array([[landing.ctypes.data, SLOT, 0]], dtype=np.uint64)

    def read(address: int) -> None:
        handle, done = reader.read(local, np.array([[address, SLOT, 0]], dtype=np.uint64), agent)
        deadline = time.monotonic() + 5
        while not done and time.monotonic() < deadline:
            a.engine.nixl.progress()
            done = reader.done(handle)
        reader.release(handle)
        assert done

    read(secret.arrays[0].ctypes.data)
    assert (landing == 0x5A).all(), "a registered region is readable by a peer holding the metadata"
    from kvwire_ucx.nixl import NixlError

    with pytest.raises(NixlError, match="could not set up a read"):
        read(unregistered.ctypes.data)
    del served


def test_registration_is_atomic_and_closes_once(make_backend) -> None:
    backend = make_backend(mode="one-sided")
    pool = Pool(GROUPS, 4, SLOT)
    registration = backend.register_regions(pool.regions)
    overlapping = SlotRegion(9, pool.regions[0].base + SLOT, SLOT, 2, MemoryKind.HOST)
    with pytest.raises(InvalidSubmission, match="overlaps"):
        backend.register_regions([overlapping])
    registration.close()
    registration.close()
    again = backend.register_regions([overlapping])  # the span is free again
    again.close()


def test_a_server_killed_as_it_answers_fails_the_read_and_the_rows_come_back(make_backend) -> None:
    slot = 1 << 20
    server = Child("kill-mid-pull", slot, 64, 64, mode="one-sided")
    try:
        address = bytes.fromhex(server.read()["address"])
        req, _ = requesting_end_big(make_backend, slot)
        attempt, slots = req.fetch(address, block_names(64), timeout_s=8)
        outcome = req.wait(attempt, slots, 15)
        assert server.wait_dead() == -signal.SIGKILL
    finally:
        server.stop()
    assert outcome.is_failed, outcome
    assert outcome.cause in (Cause.PEER_GONE, Cause.FAULT), outcome  # found out, not left to the deadline
    assert any(w in outcome.reason for w in ("gone", "failed", "unusable")), outcome.reason
    assert attempt.quiesced() and not req.lent


def requesting_end_big(make_backend, slot: int) -> tuple[Requester, Pool]:
    backend = make_backend(mode="one-sided", window_bytes=4 << 20)
    pool = Pool(GROUPS, 64, slot)
    backend.register_regions(pool.regions)
    return Requester(backend, pool), pool


def test_pull_from_another_process_one_sided(make_backend) -> None:
    slot = 256 << 10
    server = Child("serve", slot, 16, 12, mode="one-sided")
    try:
        address = bytes.fromhex(server.read()["address"])
        req, pool = requesting_end_big(make_backend, slot)
        names = block_names(16)
        attempt, slots = req.fetch(address, names)
        outcome = req.wait(attempt, slots, 10)
        assert outcome.is_delivered and [m.tolist() for m in outcome.masks] == [[True] * 12 + [False] * 4] * 2
        for g, gid in enumerate(GROUPS):
            for slot_index, name in zip(slots[:12], names[:12], strict=True):
                assert np.array_equal(pool.arrays[g][slot_index], row_pattern(name, gid, slot))
        assert req.backend.stats().rows_read == 24
        assert server.ask("pins") == {"pins": 0}
    finally:
        server.stop()


def test_a_requester_killed_after_the_offer_leaves_no_pin_on_the_server(make_backend, holders) -> None:
    slot = 1 << 20
    server = make_backend(mode="one-sided")
    holder, published = serve_filled(server, GROUPS, 64, slot)
    holders.append(holder)
    client = Child("request", slot, 64, server.address().hex(), mode="one-sided")
    try:
        assert client.read() == {"fetching": True}
        assert published.wait(10)
        client.proc.send_signal(signal.SIGKILL)
        assert client.wait_dead() == -signal.SIGKILL
        assert holder.wait_settled(1, 10)
    finally:
        client.stop()
    outcome = holder.answers[0].outcome
    # the requester may have finished reading (and acknowledged) before it died
    assert outcome.is_delivered or (outcome.is_failed and "gone" in outcome.reason), outcome
    assert holder.tree.wait_unpinned(5)


def test_an_answer_to_a_requester_that_died_before_it_fails_as_peer_gone_one_sided(make_backend, children) -> None:  # noqa: F811
    outcome, answer = answer_after_the_requester_died(make_backend(mode="one-sided"), children, mode="one-sided")
    assert outcome.is_failed, outcome  # a dead requester did not cancel anything (A10.4)
    assert outcome.cause is Cause.PEER_GONE and not outcome.by_peer, outcome
    assert outcome.rows_delivered == 0 and answer.attempt.quiesced()


def test_the_seed_flow_through_workers_in_the_one_sided_mode() -> None:
    """The runtime over the one-sided mode: B pulls A's prompt blocks with only A's state, and
    decodes exactly as a local prefill would."""
    import torch

    from kvwire.runtime import ModelConfig, Worker

    model = ModelConfig(layers=4, layers_per_group=2, heads=2, head_dim=16, block_tokens=16, max_tokens=1024, seed=3)
    a = Worker(model, backend="ucx", options={"mode": "one-sided"}, num_blocks=128, name="A", timeout_s=10)
    b = Worker(model, backend="ucx", options={"mode": "one-sided"}, num_blocks=128, name="B", timeout_s=10)
    try:
        prompt = np.random.default_rng(0).integers(0, model.vocab, 200)
        local = a.generate(prompt, max_tokens=3)
        pulled = b.pull(prompt, source=a.transceiver_state())
        assert pulled.status == "delivered" and pulled.blocks_moved == 12 and pulled.cached_tokens == 192
        remote = b.generate(prompt, max_tokens=3)
        assert remote.cached_tokens == 192 and remote.tokens == local.tokens
        assert torch.allclose(remote.logits, local.logits, rtol=1e-4, atol=1e-5)
        assert b.pull(prompt, source=a.transceiver_state()).blocks_moved == 0
        assert b.backend.stats().rows_read == 24  # 12 blocks x 2 layer groups, read one-sided
    finally:
        a.close()
        b.close()
    assert a.pins() == 0 and b.pins() == 0
