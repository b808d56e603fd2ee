"""M1-M4: memory kinds, regions, registration, and rows a backend does not recognize."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import (
    CacheKind,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    SlotRegion,
    TokenRange,
    View,
)
from kvwire.contract.backend import Backend, Registration
from kvwire.testing import needs, profiles
from kvwire.testing.harness import Harness
from kvwire.testing.holder import refused
from kvwire.testing.layout import Bench, simple_plan
from kvwire.testing.regions import RegionMemory, fake_region, next_region_id
from kvwire.testing.strategies import view_plans


def _sub_region(region: SlotRegion, offset_slots: int, count: int) -> SlotRegion:
    """Another region over part of the same memory (an overlap)."""
    from kvwire.testing.regions import next_region_id

    return SlotRegion(next_region_id(), region.base + offset_slots * region.slot_bytes, region.slot_bytes, count,
                      region.memory_kind, region.device)


# -- M1 ----------------------------------------------------------------------------------------

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
        first.close()
        second = ex.ends.sink.register_regions(regions)
        first.close()  # must not revoke the later registration of the same spans
        bench.registrations.append(second)
        result = ex.transfer(bench)
        assert all(m.all() for m in result.fetched.masks), (
            f"M3: after an old registration's close(), the later one must still cover its rows: {result.fetched!r}")
        second.close()
        second.close()
        refused(lambda: ex.fetch(bench.sink_view()), "M4: a fetch into rows whose registration was closed")
        bench.close()


# -- M4 ----------------------------------------------------------------------------------------

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
                             f"M4: a publish with rows in unregistered region of group {plan.groups[unknown].group_id}")
                if caps.fetch:
                    refused(lambda: ex.fetch(bench.sink_view()),
                             f"M4: a fetch with rows in unregistered region of group {plan.groups[unknown].group_id}")
                bench.verify("after refused submissions")
                if known and caps.fetch and caps.publish and ex.store:
                    # Nothing escaped: the store was told nothing of the refused publish.
                    only_known = {i: range(plan.groups[i].rows) for i in known}
                    fetched = ex.settle(ex.fetch(bench.sink_view(only_known)))
                    bench.apply_fetch(fetched, only_known)
                    assert fetched.rows_delivered == 0, (
                        f"S3/M4: a refused publish reached the store: {fetched.rows_delivered} of its rows were fetched")

    run()


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


def test_M4_a_group_over_two_registered_regions_is_refused(kvwire_harness: Harness) -> None:
    """M4.3: all rows of one group lie in one registered region. Two regions that touch (the two
    halves of one allocation) are registered; a group whose region covers both and whose rows lie
    one in each half is refused in either direction, and touches nothing."""
    slot = 64
    _refused_both_ways(kvwire_harness, slot, 8, [(0, 4), (4, 4)], [
        ("whose rows 3 and 4 lie in two touching registered regions", 0, 8, [3, 4]),
        ("whose first and last rows lie in two touching registered regions", 0, 8, [0, 2, 7]),
    ], "M4.3")


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
