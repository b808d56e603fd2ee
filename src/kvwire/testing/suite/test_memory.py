"""M1-M4: memory kinds, regions, registration, and rows a backend does not recognize."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import (
    CacheKind,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    SlotRegion,
    SubmissionRejected,
    TokenRange,
    View,
)
from kvwire.contract.backend import Backend, Registration
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Harness, shut_down
from kvwire.testing.holder import (
    refused,
)
from kvwire.testing.layout import BLOCK_TOKENS, Bench, simple_plan
from kvwire.testing.marks import checks
from kvwire.testing.plans import (
    paged_exchange,
    pages,
)
from kvwire.testing.regions import RegionMemory, fake_region, next_region_id
from kvwire.testing.strategies import view_plans

SENTINEL_5A = 0x5A


# -- registration and recognition ------------------------------------------------------------------

@checks("M3.10", "M3.11")
def test_M3_registration_after_shutdown_is_rejected_and_closing_still_works(kvwire_harness: Harness) -> None:
    """M3.10 / M3.11: after ``shutdown()`` a registration raises ``SubmissionRejected`` and
    registers nothing; closing an earlier registration is still allowed, twice."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 313, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        late = Bench(kvwire_harness, None, None, plan, kind)
        try:
            for backend in ex.ends.backends:
                shut_down(backend, timeout_s=max(10.0, kvwire_harness.quiesce_grace_s))
                refused(lambda: backend.register_regions([m.region for m in late.source.memories]),  # noqa: B023
                        "M3.10: a registration after shutdown()", SubmissionRejected)
            for registration in bench.registrations:
                call_briefly_close(registration)
                call_briefly_close(registration)
            bench.registrations.clear()
        finally:
            late.close()


def call_briefly_close(registration) -> None:  # type: ignore[no-untyped-def]
    from kvwire.testing.holder import call_briefly

    try:
        call_briefly(registration.close, "M3.11: closing a registration after shutdown()")
    except Exception as exc:
        raise AssertionError(f"M3.11: closing a registration after shutdown() raised {type(exc).__name__}: {exc}; a "
                             "registration may be closed before and after shutdown()") from exc


def _close_again(registration: Registration, what: str) -> None:
    """M3.8: ``close()`` of a registration already closed does nothing and raises nothing."""
    try:
        registration.close()
    except Exception as exc:
        raise AssertionError(f"M3.8: {what} raised {type(exc).__name__}: {exc}; close() is idempotent") from exc


def _sub_span_view(view: View, offset_slots: int) -> View:
    """The same rows, each group described by another region inside the registered one: starting
    ``offset_slots`` slots later, with its slot indices shifted to match (M4.2)."""
    groups = []
    for g in view.groups:
        r = g.region
        lo = min(offset_slots, int(g.slots.min()) if g.rows else 0)
        inner = SlotRegion(r.region_id + 30_000, r.base + lo * r.slot_bytes, r.slot_bytes, r.slot_count - lo,
                           r.memory_kind, r.device)
        groups.append(LayerGroupRows(g.group_id, g.kind, inner, g.slots - lo, g.tokens, g.names))
    return View(tuple(groups))


@checks("M4.1", "M4.2")
def test_M4_a_view_over_part_of_a_registered_region_moves_its_rows(kvwire_harness: Harness) -> None:
    """M4.1 / M4.2: a row is recognized by where its bytes lie: a view whose regions are other
    descriptions of registered memory (a sub-span under another id) moves its rows like any other."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4), (16, 4)], 317, needs.shares_names(caps), spare=2)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        try:
            if ex.store:
                out = ex.settle(ex.publish(_sub_span_view(bench.source_view(), 2)))
                assert out.is_delivered and all(m.all() for m in out.masks), f"M4.2: {out!r}"
            elif ex.serves_pulls:
                ex.offer(bench)
            sub = ex.fetch(_sub_span_view(bench.sink_view(), 1))
        except InvalidSubmission as exc:
            raise AssertionError(f"M4.2: rows inside a registered region were refused because the view describes "
                                 f"them with another SlotRegion: {exc}") from exc
        ex.serve_one()
        fetched = ex.settle(sub)
        bench.apply_fetch(fetched)
        assert fetched.is_delivered and all(m.all() for m in fetched.masks), f"M4.2: {fetched!r}"


def _halved_view(view: View) -> View:
    """``view`` with every region described in slots of half its slot size: each row becomes two
    rows, its first and its second half, named as the row with one byte more (0 or 1) (M4.2)."""
    groups = []
    for g in view.groups:
        r = g.region
        half = SlotRegion(r.region_id + 40_000, r.base, r.slot_bytes // 2, r.slot_count * 2, r.memory_kind, r.device)
        slots = (np.repeat(g.slots * 2, 2) + np.tile([0, 1], g.rows)).astype(np.int64)
        names = None
        if g.names is not None:
            names = np.zeros((2 * g.rows, g.names.shape[1] + 1), dtype=np.uint8)
            names[:, :-1] = np.repeat(g.names, 2, axis=0)
            names[:, -1] = np.tile([0, 1], g.rows)
        groups.append(LayerGroupRows(g.group_id, g.kind, half, slots, TokenRange(0, BLOCK_TOKENS * 2 * g.rows),
                                     names))
    return View(tuple(groups))


def _moved_as_described(ex: Exchange, source: View, sink: View, how: str) -> Outcome:
    """Offer ``source`` (publish to a store, into the serving holder's tree, or publish to a peer)
    and fetch ``sink``, both describing registered memory ``how``; the fetch's outcome, which
    must have delivered every row (M4.2: rows inside registered regions are recognized however
    a view describes them)."""
    pub = None
    try:
        if ex.store:
            published = ex.settle(ex.publish(source))
            assert published.is_delivered and all(m.all() for m in published.masks), f"M4.2: {published!r}"
        elif ex.serves_pulls:
            ex.holder().tree.add_view(source)
        else:
            pub = ex.publish(source)
        sub = ex.fetch(sink)
    except InvalidSubmission as exc:
        raise AssertionError(f"M4.2: rows inside registered regions were refused because the view describes them "
                             f"{how}: {exc}") from exc
    ex.serve_one()
    fetched = ex.settle(sub)
    if pub is not None:
        ex.settle(pub)
    assert fetched.is_delivered and all(m.all() for m in fetched.masks), (
        f"M4.2: a fetch of rows described {how} must deliver them all: {fetched!r}")
    return fetched


@checks("M4.2", "M4.1")
def test_M4_rows_described_with_another_slot_size_move(kvwire_harness: Harness) -> None:
    """M4.2 / M4.1: recognition reads where a row's bytes lie, not the registered slot size: a view
    that describes registered memory in slots of half the registered size (every registered row
    as two rows) is taken, and both halves of every row arrive, byte for byte."""
    with paged_exchange(kvwire_harness, [(64, 3), (32, 3)], 347, needs.transfer) as (_, ex, bench):
        source, sink = _halved_view(bench.source_view()), _halved_view(bench.sink_view())
        fetched = _moved_as_described(ex, source, sink, "in slots of half the registered size")
        bench.apply_fetch(Outcome.delivered([m[0::2] & m[1::2] for m in fetched.masks]))


#: Other descriptions of registered memory whose rows each span two registered slots (M4.2): per
#: case, the region over a registered one of ``n`` slots of ``size`` bytes, and the slots of its
#: rows, over the registered slots 2..5 (the bench's rows, with two spare slots either side; "half a
#: slot further on" covers 2.5..5.5).
ACROSS_SLOTS: dict[str, Callable[[SlotRegion], tuple[SlotRegion, list[int]]]] = {
    "twice the slot size": lambda r: (SlotRegion(r.region_id + 50_000, r.base, 2 * r.slot_bytes, r.slot_count // 2,
                                                 r.memory_kind, r.device), [1, 2]),
    "half a slot further on": lambda r: (SlotRegion(r.region_id + 60_000, r.base + r.slot_bytes // 2, r.slot_bytes,
                                                    r.slot_count - 1, r.memory_kind, r.device), [2, 3, 4]),
}


def _across_view(view: View, case: str, names: np.ndarray) -> View:
    """``view`` with every group's region described as ``ACROSS_SLOTS[case]`` says, its rows named
    ``names`` (alike in every group)."""
    groups = []
    for g in view.groups:
        region, slots = ACROSS_SLOTS[case](g.region)
        groups.append(LayerGroupRows(g.group_id, g.kind, region, np.asarray(slots, dtype=np.int64),
                                     TokenRange(0, BLOCK_TOKENS * len(slots)), names[: len(slots)]))
    return View(tuple(groups))


@checks("M4.2", "M4.1", "M2.4")
@pytest.mark.parametrize("case", list(ACROSS_SLOTS))
def test_M4_rows_that_span_registered_slots_move(kvwire_harness: Harness, case: str) -> None:
    """M4.2 / M4.1 / M2.4: recognition reads where a row's bytes lie, not the registered slots: a
    view describing registered memory in slots twice the registered size, or starting half a slot
    further on (every row across two registered slots), is taken, and exactly its rows' bytes
    arrive."""
    with paged_exchange(kvwire_harness, [(64, 4), (32, 4)], 661, needs.transfer, spare=2) as (_, ex, bench):
        assert all(g.region_slots == 8 and set(g.source_slots) == {2, 3, 4, 5} for g in bench.plan.groups)
        names = np.random.default_rng(661).integers(0, 256, size=(4, 16), dtype=np.uint8)
        names[:, 0] = np.arange(4)  # distinct
        source, sink = _across_view(bench.source_view(), case, names), _across_view(bench.sink_view(), case, names)
        _moved_as_described(ex, source, sink, f"with {case} (each row across two registered slots)")
        for gi, g in enumerate(sink.groups):
            start = int(g.addresses()[0]) - bench.sink.memories[gi].region.base
            end = int(g.addresses()[-1]) + g.region.slot_bytes - bench.sink.memories[gi].region.base
            want = bench.sink.model[gi].reshape(-1).copy()
            want[start:end] = bench.source.model[gi].reshape(-1)[start:end]
            got = bench.sink.memories[gi].read_all().reshape(-1)
            wrong = np.flatnonzero(got != want)
            assert wrong.size == 0, (
                f"M4.2/M2.3: group {g.group_id}: byte(s) {wrong[:8].tolist()} of the sink region differ from the source's "
                f"rows (bytes {start}..{end}) or from what was there before; a row moves exactly its bytes")
            bench.sink.model[gi] = want.reshape(bench.sink.model[gi].shape)
        bench.verify("M4.2: after rows spanning registered slots moved")


@checks("M4.6", "B1.2")
def test_M4_rows_registered_only_with_another_instance_are_refused(kvwire_harness: Harness) -> None:
    """M4.6 / B1.2: memory registered with one instance is not registered with another."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3)], 331, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as first, needs.open_exchange(kvwire_harness) as second, Bench(
            kvwire_harness, first.ends.source, first.ends.sink, plan, kind) as bench:
        if caps.publish:
            refused(lambda: second.publish(bench.source_view()),
                    "M4.6: a publish on an instance of rows registered only with another")
        if caps.fetch:
            refused(lambda: second.fetch(bench.sink_view()),
                    "M4.6: a fetch on an instance of rows registered only with another")
        bench.verify("M4.6: after refused submissions")


# -- M3.4 / M3.5: regions of other slot sizes over the same bytes -------------------------------------------

def _span(memory_region: SlotRegion, offset: int, slot_bytes: int, count: int) -> SlotRegion:
    r = memory_region
    return SlotRegion(next_region_id(), r.base + offset, slot_bytes, count, r.memory_kind, r.device)


@checks("M3.5", "M3.4", "M3.2")
def test_M3_regions_of_other_slot_sizes_overlap_by_their_bytes(kvwire_harness: Harness) -> None:
    """M3.5 / M3.4 / M3.2: overlap is judged by the bytes regions span, whatever their slot
    sizes: a region of 16-byte slots inside a registered region of 64-byte slots, or sharing its
    last 16 bytes, is refused, and so is a batch of two such regions; regions of other slot sizes
    that only touch are taken, in one batch and in two."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    memory = kvwire_harness.allocate(kind, 64, 16)  # 1024 bytes
    whole = memory.region
    with needs.open_exchange(kvwire_harness) as ex:
        backend = ex.ends.sink
        first = _span(whole, 0, 64, 8)  # bytes [0, 512)
        with backend.register_regions([first]):
            for what, region in (("inside it", _span(whole, 200, 16, 4)),
                                 ("sharing its last 16 bytes", _span(whole, 496, 16, 4)),
                                 ("covering it whole", _span(whole, 0, 512, 2))):
                refused(functools.partial(backend.register_regions, [region]),
                        f"M3.5: registering a region of {region.slot_bytes}-byte slots {what} (a registered region of "
                        "64-byte slots)")
            touching = _span(whole, 512, 16, 32)  # bytes [512, 1024)
            try:
                backend.register_regions([touching]).close()
            except InvalidSubmission as exc:
                raise AssertionError(f"M3.5: a region of 16-byte slots that only touches a registered region of 64-byte "
                                     f"slots was refused: {exc}") from None
        refused(functools.partial(backend.register_regions, [_span(whole, 0, 64, 8), _span(whole, 480, 32, 4)]),
                "M3.4: registering a batch of a 64-byte-slot region and a 32-byte-slot one sharing its last 32 bytes")
        try:
            backend.register_regions([_span(whole, 0, 64, 8), _span(whole, 512, 32, 16)]).close()
        except InvalidSubmission as exc:
            raise AssertionError(f"M3.4: a batch of two regions of other slot sizes that only touch was refused: "
                                 f"{exc}") from None


# -- found by mutation testing of the shipped backends (issue 39) ---------------------------------------------

@checks("M4.1", "M4.4", "M4.2", also=("S3.5",))
def test_M4_a_region_reaching_past_its_registration_is_checked_row_by_row(kvwire_harness: Harness) -> None:
    """M4.1 / M4.4 / M4.2: a view's region may describe more memory than is registered, as long as
    its rows lie inside a registration: a fetch of rows inside is taken; the same region object
    then naming a row outside the registration is refused with ``InvalidSubmission`` and that row
    is not touched (a backend that remembers the region as recognized after the first view lets
    the second read or write memory nobody registered)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 3921, needs.shares_names(caps), spare=0)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, None, plan, kind) as bench:
        memory = kvwire_harness.allocate(kind, 64, 8)
        whole = memory.region
        registered = SlotRegion(next_region_id(), whole.base, 64, 4, whole.memory_kind, whole.device)
        wide = SlotRegion(next_region_id(), whole.base, 64, 8, whole.memory_kind, whole.device)  # reaches past it
        names = bench.names[0]
        with ex.ends.sink.register_regions([registered]):
            ex.offer(bench)
            inside = View((LayerGroupRows(0, CacheKind.PAGED, wide, np.array([0, 1]), TokenRange(0, 32), names),))
            out = ex.fetch_settled(inside)
            assert out.is_delivered, f"M4.2: rows inside a registration, described by a wider region: {out!r}"
            memory.fill([5, 6], SENTINEL_5A)
            outside = View((LayerGroupRows(0, CacheKind.PAGED, wide, np.array([5, 6]), TokenRange(0, 32), names),))
            refused(lambda: ex.fetch(outside), "M4.4: a fetch whose rows lie past the registration of their region's "
                    "memory (the same region object that earlier named rows inside it)")
            got = memory.read([5, 6])
            assert (got == SENTINEL_5A).all(), "S3.5/M4.4: a refused fetch of rows outside any registration wrote them"


def _sub_region(region: SlotRegion, offset_slots: int, count: int) -> SlotRegion:
    """Another region over part of the same memory (an overlap)."""
    from kvwire.testing.regions import next_region_id

    return SlotRegion(next_region_id(), region.base + offset_slots * region.slot_bytes, region.slot_bytes, count,
                      region.memory_kind, region.device)


# -- M1 ----------------------------------------------------------------------------------------

@checks("M1.3")
def test_M1_declared_memory_kinds_move_bytes(kvwire_harness: Harness) -> None:
    """Every declared memory kind this machine has can be registered, and rows in it move."""
    caps = kvwire_harness.capabilities()
    kinds = needs.usable_kinds(kvwire_harness, caps)
    if not kinds:
        pytest.skip("backend declares only DEVICE memory and no CUDA device is present")
    for kind in kinds:
        with needs.open_exchange(kvwire_harness) as ex:
            plan = simple_plan(groups=2, rows=3, slot_bytes=96, seed=11, shared_names=needs.shares_names(caps))
            with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
                for region in (*[m.region for m in bench.source.memories], *[m.region for m in bench.sink.memories]):
                    assert region.memory_kind is kind
                if caps.fetch and caps.publish:
                    result = ex.transfer(bench)
                    assert all(m.all() for m in result.fetched.masks), (
                        f"M1: rows in {kind.value} memory were offered and held, yet not all arrived: {result.fetched!r}")


@checks("M1.4")
def test_M1_undeclared_memory_kind_refused(kvwire_harness: Harness) -> None:
    caps = kvwire_harness.capabilities()
    missing = [k for k in MemoryKind if k not in caps.memory_kinds]
    if not missing:
        pytest.skip("backend declares every memory kind")
    with needs.open_exchange(kvwire_harness) as ex:
        for kind in missing:
            for backend in ex.ends.backends:
                refused(functools.partial(backend.register_regions, [fake_region(kind)]),
                         f"M1/M3: registering a {kind.value} region with a backend that declares "
                         f"{sorted(x.value for x in caps.memory_kinds)}")


# -- M2 ----------------------------------------------------------------------------------------

@checks("M2.3", "M2.4")
def test_M2_a_row_is_exactly_one_slot(kvwire_harness: Harness) -> None:
    """Odd slot sizes, scattered slots: each row moves exactly its slot's bytes; the slots and
    bytes around it stay as they were."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    p = profiles.active()

    @profiles.examples()
    @given(plan=view_plans(max_groups=p.max_groups, max_rows=p.max_rows, min_rows=1,
                           shared_names=needs.shares_names(caps)))
    def run(plan) -> None:  # type: ignore[no-untyped-def]
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                              kind) as bench:
            ex.transfer(bench)
            bench.verify("after the transfer")

    run()


# -- M3 ----------------------------------------------------------------------------------------

@checks("M3.1")
def test_M3_registration_covers_its_batch(kvwire_harness: Harness) -> None:
    """M3.1: ``register_regions`` registers one batch and returns one ``Registration`` whose
    regions are that batch."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    memories = [kvwire_harness.allocate(kind, 64, 4) for _ in range(3)]
    with needs.open_exchange(kvwire_harness) as ex:
        registration = ex.ends.sink.register_regions([m.region for m in memories])
        assert isinstance(registration, Registration), (
            f"M3.1: register_regions() must return a Registration, got {type(registration).__name__}")
        assert tuple(registration.regions) == tuple(m.region for m in memories), (
            "M3.1: the registration must cover exactly the batch's regions")
        registration.close()


@checks("M3.5", "M3.4")
def test_M3_overlapping_region_refused(kvwire_harness: Harness) -> None:
    """M3.5 / M3.4: a region overlapping one already registered (inside it, sharing a slot, or
    the very same span again, as the same object or under another id), or another of its own
    batch, refuses the batch with ``InvalidSubmission``."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    memory = kvwire_harness.allocate(kind, 64, 8)
    other = kvwire_harness.allocate(kind, 64, 8)
    with needs.open_exchange(kvwire_harness) as ex:
        backend = ex.ends.sink
        with backend.register_regions([memory.region]):
            refused(lambda: backend.register_regions([_sub_region(memory.region, 2, 3)]),
                     "M3.5: registering a region inside a registered one")
            refused(lambda: backend.register_regions([_sub_region(memory.region, 7, 1)]),
                     "M3.5: registering a region sharing the last slot of a registered one")
            refused(lambda: backend.register_regions([memory.region]),
                     "M3.5: registering a region that is registered and open (the same span again)")
            refused(lambda: backend.register_regions([_sub_region(memory.region, 0, memory.region.slot_count)]),
                     "M3.5: registering the span of a registered region under another id")
        refused(lambda: backend.register_regions([other.region, _sub_region(other.region, 1, 2)]),
                 "M3.4: registering a batch whose two regions overlap")


@checks("M3.3", also=("M3.6",))
def test_M3_a_region_of_an_undeclared_memory_kind_refuses_its_whole_batch(kvwire_harness: Harness) -> None:
    """M3.3: a batch that holds a region of a memory kind the backend does not declare, beside
    regions of a declared kind (after them or before them), is refused whole with
    ``InvalidSubmission``: the declared regions' rows are not recognized afterwards (M3.6), and
    registered alone they are taken and their rows move."""
    caps = kvwire_harness.capabilities()
    missing = [k for k in MemoryKind if k not in caps.memory_kinds]
    if not missing:
        pytest.skip("backend declares every memory kind")
    needs.fetch(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    declared = sorted(k.value for k in caps.memory_kinds)
    plan = simple_plan(groups=2, rows=3, seed=2231, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(
            kvwire_harness, ex.ends.source if caps.publish else None, None, plan, kind) as bench:
        sink = ex.ends.sink
        good = [m.region for m in bench.sink.memories]
        for undeclared in missing:
            for batch in ([*good, fake_region(undeclared)], [fake_region(undeclared), *good]):
                refused(functools.partial(sink.register_regions, batch),
                        f"M3.3: registering a batch with a {undeclared.value} region beside {kind.value} ones (the "
                        f"backend declares {declared})")
                refused(lambda: ex.fetch(bench.sink_view()),
                        f"M3.3/M3.6: a fetch into the {kind.value} regions of a batch refused for its "
                        f"{undeclared.value} region")
                bench.verify("M3.3: after a refused batch and a refused fetch")
        registration = sink.register_regions(good)
        try:
            if caps.publish:
                result = ex.transfer(bench)
                assert result.fetched.is_delivered and all(m.all() for m in result.fetched.masks), (
                    f"M3.2: the {kind.value} regions registered alone must be recognized and their rows move: "
                    f"{result.fetched!r}")
        finally:
            registration.close()


@checks("M3.6")
def test_M3_refused_batch_leaves_nothing_registered(kvwire_harness: Harness) -> None:
    """M3.6: a refused batch leaves nothing registered: none of its regions is recognized
    afterwards, and an earlier registration it overlapped is unchanged (its rows still move)."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    needs.fetch(caps)
    plan = simple_plan(groups=1, rows=3, seed=5)
    with needs.open_exchange(kvwire_harness) as ex:
        sink = ex.ends.sink
        bench = Bench(kvwire_harness, None, None, plan, kind)
        fresh = [m.region for m in bench.sink.memories]
        # The earlier registration: a bench registered with both ends, whose sink region the first
        # bad batch overlaps.
        kept = Bench(kvwire_harness, ex.ends.source if caps.publish else None, sink,
                     simple_plan(groups=1, rows=3, seed=6, shared_names=needs.shares_names(caps)), kind)
        taken = kept.sink.memories[0].region
        moves = caps.publish  # then a transfer through the earlier registration shows it still in force
        with kept:
            bad_batches = [[*fresh, _sub_region(taken, 1, 2)], [*fresh, *fresh]]
            bad_batches += [[*fresh, fake_region(k)] for k in MemoryKind if k not in caps.memory_kinds]
            for batch in bad_batches:
                refused(functools.partial(sink.register_regions, batch), "M3.3-M3.5: a batch with a bad region")
                refused(lambda: ex.fetch(bench.sink_view()),
                         "M3.6/M4: a fetch into a region whose batch was refused (nothing may stay registered)")
                bench.verify("after a refused batch and a refused fetch")
                if moves:
                    try:
                        result = ex.transfer(kept)
                    except InvalidSubmission as exc:
                        raise AssertionError(f"M3.6: a refused batch revoked an earlier registration: a fetch into its "
                                             f"rows was refused: {exc}") from exc
                    assert result.fetched.is_delivered and all(m.all() for m in result.fetched.masks), (
                        f"M3.6: after a refused batch, rows of an earlier registration no longer move: "
                        f"{result.fetched!r}")
            registration = sink.register_regions(fresh)
            registration.close()


@checks("M3.4", "M3.5", "M3.2")
def test_M3_regions_that_only_touch_do_not_overlap(kvwire_harness: Harness) -> None:
    """M3.4 / M3.5 / M3.2: two regions that only touch (one ends on the byte where the next
    begins: two halves of one allocation) do not overlap; registered in one batch or in two, both
    are taken, and rows of each move."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=4, seed=13, spare=2, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(
            kvwire_harness, ex.ends.source if caps.publish else None, None, plan, kind) as bench:
        whole = bench.sink.memories[0].region
        half = whole.slot_count // 2
        lo = _sub_region(whole, 0, half)
        hi = _sub_region(whole, half, whole.slot_count - half)
        assert hi.base == lo.base + lo.slot_count * lo.slot_bytes
        sink_slots = np.asarray(plan.groups[0].sink_slots)
        parts = [(lo, 0, {0: np.flatnonzero(sink_slots < half).tolist()}),
                 (hi, half, {0: np.flatnonzero(sink_slots >= half).tolist()})]
        assert all(rows[0] for _, _, rows in parts), "the plan puts rows in both halves"
        moves = caps.fetch and caps.publish and (ex.store or ex.serves_pulls)
        if moves:
            ex.offer(bench)
        for how, batches in (("in one batch", [[lo, hi]]), ("in two batches", [[lo], [hi]])):
            registrations = []
            try:
                for batch in batches:
                    try:
                        registrations.append(ex.ends.sink.register_regions(batch))
                    except InvalidSubmission as exc:
                        clause = "M3.4" if len(batch) == 2 else "M3.5"
                        raise AssertionError(
                            f"{clause}: two regions that only touch ([{lo.base:#x}, {hi.base:#x}) and "
                            f"[{hi.base:#x}, ...)) registered {how} were refused as overlapping: {exc}") from exc
                if not moves:
                    continue
                for region, first, rows in parts:
                    view = bench.sink_view(rows)
                    view = View(tuple(LayerGroupRows(g.group_id, g.kind, region, g.slots - first, g.tokens, g.names)
                                      for g in view.groups))
                    try:
                        out = ex.fetch_settled(view)
                    except InvalidSubmission as exc:
                        raise AssertionError(f"M3.2: rows of a region registered {how} beside one it touches were "
                                             f"refused: {exc}") from exc
                    bench.apply_fetch(out, rows)
                    assert out.is_delivered and all(m.all() for m in out.masks), (
                        f"M3.2: rows of a region registered {how} beside one it touches did not move: {out!r}")
            finally:
                for registration in registrations:
                    registration.close()
            bench.forget_sink()


@checks("M3.8", "M3.9")
def test_M3_close_is_idempotent_and_spares_a_later_registration(kvwire_harness: Harness) -> None:
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    needs.transfer(caps)
    plan = simple_plan(groups=1, rows=4, seed=9)
    with needs.open_exchange(kvwire_harness) as ex:
        bench = Bench(kvwire_harness, ex.ends.source, None, plan, kind)
        regions = [m.region for m in bench.sink.memories]
        first = ex.ends.sink.register_regions(regions)
        first.close()
        _close_again(first, "a second close() of a registration")
        second = ex.ends.sink.register_regions(regions)
        _close_again(first, "a third close() of a registration, after the same spans were registered again")
        # ... and it must not revoke the later registration of the same spans (M3.9)
        bench.registrations.append(second)
        result = ex.transfer(bench)
        assert all(m.all() for m in result.fetched.masks), (
            f"M3: after an old registration's close(), the later one must still cover its rows: {result.fetched!r}")
        second.close()
        _close_again(second, "a second close() of a registration")
        refused(lambda: ex.fetch(bench.sink_view()), "M4: a fetch into rows whose registration was closed")
        bench.close()


# -- M4 ----------------------------------------------------------------------------------------

@checks("M4.4", "M4.7")
def test_M4_unrecognized_rows_refuse_the_whole_submission(kvwire_harness: Harness) -> None:
    """A view with rows in a region the backend never registered is refused whole, in either
    direction, and nothing escaped: no byte written, nothing stored, never a skipped row."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    p = profiles.active()

    @profiles.examples()
    @given(plan=view_plans(max_groups=p.max_groups, max_rows=p.max_rows, min_rows=1,
                           shared_names=needs.shares_names(caps)), data=st.data())
    def run(plan, data) -> None:  # type: ignore[no-untyped-def]
        unknown = data.draw(st.integers(0, len(plan.groups) - 1), label="unregistered group")
        with needs.open_exchange(kvwire_harness) as ex:
            bench = Bench(kvwire_harness, None, None, plan, kind)
            known = [i for i in range(len(plan.groups)) if i != unknown]
            if known:
                bench.registrations.append(ex.ends.source.register_regions(
                    [bench.source.memories[i].region for i in known]))
                bench.registrations.append(ex.ends.sink.register_regions(
                    [bench.sink.memories[i].region for i in known]))
            with bench:
                if caps.publish:
                    refused(lambda: ex.publish(bench.source_view()),
                             f"M4.4/M4.7: a publish with rows in unregistered region of group {plan.groups[unknown].group_id} "
                             "(refused whole, never moved without those rows)")
                if caps.fetch:
                    refused(lambda: ex.fetch(bench.sink_view()),
                             f"M4.4/M4.7: a fetch with rows in unregistered region of group {plan.groups[unknown].group_id} "
                             "(refused whole, never moved without those rows)")
                bench.verify("after refused submissions")
                if known and caps.fetch and caps.publish and ex.store:
                    # Nothing escaped: the store was told nothing of the refused publish.
                    only_known = {i: range(plan.groups[i].rows) for i in known}
                    fetched = ex.settle(ex.fetch(bench.sink_view(only_known)))
                    bench.apply_fetch(fetched, only_known)
                    assert fetched.rows_delivered == 0, (
                        f"S3/M4: a refused publish reached the store: {fetched.rows_delivered} of its rows were fetched")

    run()


@checks("M4.5", "M3.7")
def test_M4_rows_of_a_closed_registration_refused(kvwire_harness: Harness) -> None:
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=2, seed=3)
    with needs.open_exchange(kvwire_harness) as ex:
        bench = Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind)
        bench.close()
        if caps.publish:
            refused(lambda: ex.publish(bench.source_view()), "M4: a publish from rows whose registration was closed")
        if caps.fetch:
            refused(lambda: ex.fetch(bench.sink_view()), "M4: a fetch into rows whose registration was closed")
        # M3.7: close() unregisters the whole batch: the rows of each of its regions alone are refused too.
        for gi, group in enumerate(plan.groups):
            rows = {gi: list(range(group.rows))}
            if caps.publish:
                refused(lambda: ex.publish(bench.source_view(rows)),  # noqa: B023
                        f"M3.7: a publish from rows of group {group.group_id} alone, region {gi + 1} of a batch whose "
                        "registration was closed")
            if caps.fetch:
                refused(lambda: ex.fetch(bench.sink_view(rows)),  # noqa: B023
                        f"M3.7: a fetch into rows of group {group.group_id} alone, region {gi + 1} of a batch whose "
                        "registration was closed")
        bench.verify("after refused submissions")


def _registered_part(harness: Harness, backend: Backend, kind: MemoryKind, slot_bytes: int, slot_count: int,
                     parts: list[tuple[int, int]], seed: int) -> tuple[RegionMemory, np.ndarray, Registration]:
    """One allocation of ``slot_count`` slots filled with random bytes, of which only the parts
    ``(first slot, slots)`` are registered with ``backend``, each as its own region of one batch:
    the memory around them is real (a row that strays there can be seen), but not registered."""
    memory = harness.allocate(kind, slot_bytes, slot_count)
    memory.write(np.arange(slot_count),
                 np.random.default_rng(seed).integers(0, 256, size=(slot_count, slot_bytes), dtype=np.uint8))
    registration = backend.register_regions([_sub_region(memory.region, first, n) for first, n in parts])
    return memory, memory.read_all(), registration


def _untouched(memory: RegionMemory, before: np.ndarray, clause: str, why: str) -> None:
    assert memory.guards_intact() and np.array_equal(memory.read_all(), before), (
        f"{clause}/S2: memory changed {why}; a refused submission touches nothing")


def _refused_both_ways(harness: Harness, slot_bytes: int, slot_count: int, parts: list[tuple[int, int]],
                       cases: list[tuple[str, int, int, list[int]]], clause: str) -> None:
    """For each case ``(what, offset in bytes from the allocation's base, slot count, slots)``,
    a group whose region is a fresh ``SlotRegion`` at that offset in memory of which only
    ``parts`` are registered: a publish and a fetch of it (as declared) are refused, and no byte
    of the memory changed."""
    caps = harness.capabilities()
    kind = needs.usable_kind(harness, caps)
    if not (caps.fetch or caps.publish):
        pytest.skip("backend declares neither fetch nor publish")

    with needs.open_exchange(harness) as ex:
        ends = [(op, backend) for op, backend, declared in
                (("publish", ex.ends.source, caps.publish), ("fetch", ex.ends.sink, caps.fetch)) if declared]
        for op, backend in ends:
            memory, before, registration = _registered_part(harness, backend, kind, slot_bytes, slot_count, parts,
                                                            seed=slot_bytes + len(op))
            with registration:
                for what, offset, count, slots in cases:
                    region = SlotRegion(next_region_id(), memory.region.base + offset, slot_bytes, count,
                                        memory.region.memory_kind, memory.region.device)
                    rows = np.asarray(slots, dtype=np.int64)
                    names = np.random.default_rng(offset + 1).integers(0, 256, size=(rows.size, 16), dtype=np.uint8)
                    names[:, 0] = np.arange(rows.size)
                    view = View((LayerGroupRows(0, CacheKind.PAGED, region, rows, TokenRange(0, 16 * rows.size),
                                                names),))
                    submit = ex.publish if op == "publish" else ex.fetch
                    refused(functools.partial(submit, view), f"{clause}: a {op} of a group {what}")
                    _untouched(memory, before, clause, f"by a refused {op} of a group {what}")


@checks("M4.3")
def test_M4_a_group_over_two_registered_regions_is_refused(kvwire_harness: Harness) -> None:
    """M4.3: all rows of one group lie in one registered region. Two regions that touch (the two
    halves of one allocation) are registered; a group whose region covers both and whose rows lie
    one in each half is refused in either direction, and touches nothing."""
    slot = 64
    _refused_both_ways(kvwire_harness, slot, 8, [(0, 4), (4, 4)], [
        ("whose rows 3 and 4 lie in two touching registered regions", 0, 8, [3, 4]),
        ("whose first and last rows lie in two touching registered regions", 0, 8, [0, 2, 7]),
    ], "M4.3")


@checks("M4.1", "M4.4")
def test_M4_a_row_partly_outside_its_registered_region_is_refused(kvwire_harness: Harness) -> None:
    """M4.1 / M4.4: a row is recognized only when all of its bytes lie in one registered region. A
    row that runs half a slot past the registered region's end, or starts half a slot before its
    base (over real, unregistered memory of the same allocation), is not: the submission is
    refused in either direction, and no byte, inside the region or around it, changes."""
    slot = 64
    # Slots 2..5 of an allocation of 8 are registered; slots 0, 1, 6 and 7 are real but not.
    base, end = 2 * slot, 6 * slot
    _refused_both_ways(kvwire_harness, slot, 8, [(2, 4)], [
        ("with a row running half a slot past the registered region's end", base + slot // 2, 4, [1, 3]),
        ("with a row starting half a slot before the registered region's base", base - slot // 2, 4, [0, 2]),
        ("with one row entirely inside and one running one byte past the end", end - 2 * slot + 1, 2, [0, 1]),
    ], "M4.1/M4.4")


# -- M1.4 / M4.1: a view that names another memory kind over registered memory ----------------------


def _relabelled(view: View, kind: MemoryKind, device: int | None) -> View:
    """``view`` with every group's region described as memory of ``kind`` (on ``device``), at the
    same addresses."""
    groups = []
    for g in view.groups:
        r = g.region
        region = SlotRegion(r.region_id + 40_000, r.base, r.slot_bytes, r.slot_count, kind, device)
        groups.append(LayerGroupRows(g.group_id, g.kind, region, g.slots, g.tokens, g.names))
    return View(tuple(groups))


def _other_labels(kind: MemoryKind, device: int | None) -> list[tuple[str, MemoryKind, int | None]]:
    """Descriptions of memory of ``kind`` (on ``device``) as other memory (M1.2): the other kind,
    and for DEVICE memory another device."""
    labels: list[tuple[str, MemoryKind, int | None]] = []
    if kind is MemoryKind.HOST:
        labels.append(("DEVICE memory of device 0", MemoryKind.DEVICE, 0))
    else:
        labels.append(("HOST memory", MemoryKind.HOST, None))
        labels.append((f"DEVICE memory of device {(device or 0) + 1}", MemoryKind.DEVICE, (device or 0) + 1))
    return labels


@checks("M1.4", "M4.1", "M1.2", also=("M1.3",))
def test_M1_a_view_naming_another_memory_kind_over_registered_memory_is_refused(kvwire_harness: Harness) -> None:
    """M1.4 / M4.1 / M1.2: a row is recognized only inside a registered region of the same memory
    kind and device: a publish or fetch whose regions name another kind (DEVICE over registered
    HOST memory, or the reverse, or another device) at registered addresses raises
    ``InvalidSubmission``; memory is untouched, nothing reaches the other end, and the same rows
    described as what they are move afterwards."""
    with paged_exchange(kvwire_harness, [(64, 3), (32, 3)], 701, needs.transfer) as (caps, ex, bench):
        region = bench.sink.memories[0].region
        if ex.serves_pulls:
            ex.offer(bench)
        for what, kind, device in _other_labels(region.memory_kind, region.device):
            declared = "declared" if kind in caps.memory_kinds else "not declared"
            # A declared kind is refused because recognition is judged within one kind and device (M1.2).
            clause = "M1.2/M4.1" if kind in caps.memory_kinds else "M1.4/M4.1"
            if ex.store:
                refused(functools.partial(ex.publish, _relabelled(bench.source_view(), kind, device)),
                        f"{clause}: a publish whose view names {what} ({declared}) over registered "
                        f"{region.memory_kind.value} memory")
            refused(functools.partial(ex.fetch, _relabelled(bench.sink_view(), kind, device)),
                    f"{clause}: a fetch whose view names {what} ({declared}) over registered "
                    f"{region.memory_kind.value} memory")
        bench.verify("S3.5: after submissions refused for the memory kind their view names")
        if ex.serves_pulls:
            assert not ex.holder().serving.incoming(), (
                "S3.4: a pull refused for the memory kind its view names reached the serving end")
        if ex.store:
            empty = ex.settle(ex.fetch(bench.sink_view()))
            bench.apply_fetch(empty)
            assert empty.is_delivered and not any(m.any() for m in empty.masks), (
                f"S3.4/M1.4: only refused publishes were made, yet a fetch of their rows found some: {empty!r}")
        result = ex.transfer(bench)
        assert result.fetched.is_delivered and all(m.all() for m in result.fetched.masks), (
            f"M1.3: the same rows described as the memory they are must move afterwards: {result.fetched!r}")


# -- M4.5: rows seen through a sub-span, once their registration closed --------------------------------


@checks("M4.5", "M3.7", also=("M4.2",))
def test_M4_rows_seen_through_a_sub_span_are_refused_once_their_registration_closed(kvwire_harness: Harness) -> None:
    """M4.5 / M3.7: rows moved through a view of another ``SlotRegion`` inside a registered region
    (a sub-span, M4.2) are no longer recognized once that registration closed: a later publish or
    fetch of them, through the sub-span or the registered region, raises ``InvalidSubmission``
    and touches nothing."""
    with paged_exchange(kvwire_harness, [(64, 3), (32, 3)], 709, needs.transfer, spare=2) as (caps, ex, bench):
        source, sink = _sub_span_view(bench.source_view(), 2), _sub_span_view(bench.sink_view(), 1)
        if ex.store:
            published = ex.settle(ex.publish(source))
            assert published.is_delivered, f"M4.2: a publish through a sub-span: {published!r}"
            fetched = ex.settle(ex.fetch(sink))
        elif ex.serves_pulls:
            ex.offer(bench)
            fetched = ex.fetch_settled(sink)
        else:
            pub, sub = ex.publish(source), ex.fetch(sink)
            ex.settle(pub)
            fetched = ex.settle(sub)
        bench.apply_fetch(fetched)
        assert fetched.is_delivered and all(m.all() for m in fetched.masks), (
            f"M4.2: a fetch through a sub-span of registered memory: {fetched!r}")
        bench.close()
        for what, view in (("the sub-span", sink), ("the registered region", bench.sink_view())):
            refused(functools.partial(ex.fetch, view),
                    f"M4.5: a fetch through {what} after the registration it was moved through closed")
        if not ex.serves_pulls:
            for what, view in (("the sub-span", source), ("the registered region", bench.source_view())):
                refused(functools.partial(ex.publish, view),
                        f"M4.5: a publish through {what} after the registration it was moved through closed")
        else:
            assert not ex.holder().serving.incoming(), (
                "S3.4: a pull refused for rows of a closed registration reached the serving end")
        bench.verify("S3.5: after submissions refused for rows of closed registrations")
