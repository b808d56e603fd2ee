"""Clause by clause, over the input space real engines use: rows from one byte to 4 MiB, views of
thousands of rows and many groups, names that differ in one byte or hold zero bytes, and what a
publish's mask says. Each test names the clause it checks (``docs/contract.md``) in its
docstring's first line; every check runs for stores and for serving peers unless the clause is a
store's."""


from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvwire.contract import CacheKind, LayerGroupRows, View
from kvwire.testing import needs, profiles
from kvwire.testing.harness import FaultPlan, Harness
from kvwire.testing.holder import refused
from kvwire.testing.layout import Bench, GroupPlan, ViewPlan
from kvwire.testing.plans import (
    check_bits,
    needs_misses,
    offer_for,
    paged_exchange,
    pages,
    store_only,
    transfer_checked,
)

SENTINEL = 0xA5
MiB = 1 << 20


# -- sizes and shapes ---------------------------------------------------------------------------

def test_A7_rows_from_one_byte_to_four_mebibytes(kvwire_harness: Harness) -> None:
    """A7.1 / M2: rows of any size, drawn on a log scale from 1 B to 4 MiB, arrive byte for byte."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)

    @profiles.examples(max_examples=max(3, profiles.active().examples // 2))
    @example(exponents=[0, 22], jitter=0, rows=2)
    @example(exponents=[13, 16, 18], jitter=0, rows=3)
    @given(exponents=st.lists(st.integers(0, 22), min_size=1, max_size=3),
           jitter=st.integers(-3, 3), rows=st.integers(1, 4))
    def run(exponents: list[int], jitter: int, rows: int) -> None:
        sizes = [min(4 * MiB, max(1, 2**e + (jitter if e > 2 else 0))) for e in exponents]
        specs = [(s, rows if s <= MiB else min(rows, 2)) for s in sizes]
        plan = pages(specs, seed=sum(sizes) + rows, shared=shared)
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                              plan, kind) as bench:
            result = ex.transfer(bench)
            assert result.fetched.is_delivered and all(m.all() for m in result.fetched.masks), (
                f"A5/A7: rows of {sizes} bytes did not all arrive: {result.fetched!r}")

    run()


def test_A9_views_of_thousands_of_rows_and_many_groups(kvwire_harness: Harness) -> None:
    """A9.6: a view's size does not change what moves: 3 groups of 1500 rows, and 16 groups,
    each with held and missing rows in place."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)
    for specs, seed in (([(8, 1500), (24, 1500), (1, 1500)], 211), ([(16 + g, 24) for g in range(16)], 223)):
        plan = pages(specs, seed, shared)
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                              plan, kind) as bench:
            if ex.store or ex.serves_pulls:
                offer = offer_for(ex, plan, lambda gi, n: [r for r in range(n) if (r + gi) % 3 != 1]
                                   if ex.store else range(n * 3 // 4))
            else:
                offer = None
            transfer_checked(ex, bench, offer, None, "A9.6")


def test_A9_misses_keep_their_place_whatever_the_order(kvwire_harness: Harness) -> None:
    """A9.2 / A9.3: the rows of a fetch in any order, whole or split over views: every bit stays with its
    row, held rows true and missing rows false."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)
    p = profiles.active()

    @profiles.examples()
    @given(groups=st.integers(1, p.max_groups), rows=st.integers(2, max(p.max_rows, 12)), data=st.data())
    def run(groups: int, rows: int, data: st.DataObject) -> None:
        plan = pages([(data.draw(st.sampled_from([3, 64, 200])), rows) for _ in range(groups)],
                     data.draw(st.integers(0, 2**31)), shared)
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                              plan, kind) as bench:
            needs_misses(ex)
            offer = offer_for(ex, plan, lambda gi, n: data.draw(
                st.lists(st.integers(0, n - 1), unique=True, min_size=1, max_size=n - 1), label=f"held {gi}"))
            if ex.serves_pulls:
                # One pull, its blocks in a drawn order: the served prefix is the held names'
                # run from the start of that order.
                order = data.draw(st.permutations(range(rows)), label="order")
                take = {gi: list(order) for gi in range(groups)}
                transfer_checked(ex, bench, offer, take, "A9.2")
                return
            ex.offer(bench, offer)
            parts = data.draw(st.integers(1, 3), label="parts")
            for part in range(parts):
                take = {gi: data.draw(st.permutations([r for r in range(g.rows) if r % parts == part]),
                                      label=f"part {part} of {gi}") for gi, g in enumerate(plan.groups)}
                fetched = ex.settle(ex.fetch(bench.sink_view(take)))
                bench.apply_fetch(fetched, take)
                check_bits(ex, bench, offer, take, fetched, "A9.2")

    run()


# -- names ----------------------------------------------------------------------------------------

def _crafted_names(rows: int, width: int) -> np.ndarray:
    """Distinct names that a backend treating names as text, trimming zero bytes, or reading
    only part of them would confuse: all zeros, one byte apart at either end, trailing zeros,
    two names apart only in a byte that is not UTF-8 (0xFF and 0xFE)."""
    names = np.zeros((rows, width), dtype=np.uint8)
    for i in range(1, rows):
        if i % 4 == 1:
            names[i, -1] = i  # differs from all-zeros in the last byte
        elif i % 4 == 2:
            names[i, 0] = i  # ... in the first byte, then zeros
        elif i % 4 == 3:
            names[i, width // 2] = i
        elif i % 8 == 4:
            names[i, :] = names[i - 1]
            names[i, 1] = 0xFF
        else:  # ... only in a byte that is no UTF-8 text: 0xFE where row i - 4 has 0xFF
            names[i, :] = names[i - 4]
            names[i, 1] = 0xFE
    assert len(np.unique(names, axis=0)) == rows
    return names


def test_N1_names_are_opaque_bytes_every_byte_counts(kvwire_harness: Harness) -> None:
    """N1.3 / N1.4: names are opaque fixed-width bytes: zero bytes count, and names one byte apart name
    different blocks, also when neither byte is text (names never decoded as text)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(32, 12), (48, 12)], 227, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        needs_misses(ex)
        crafted = _crafted_names(12, 16)
        for gi in range(len(plan.groups)):
            bench.names[gi] = crafted
        offer = offer_for(ex, plan, lambda gi, n: [0, 2, 3, 5, 8, 11] if ex.store else range(7))
        transfer_checked(ex, bench, offer, None, "N1.4")


def test_N1_a_store_keys_rows_by_group_and_name(kvwire_harness: Harness) -> None:
    """N1.2: the same name in two groups stands for two rows with different bytes; each group's
    row is found only in that group."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.names(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 6), (64, 6), (32, 6)], 229, shared=True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "keying stored rows")
        offer = {0: [0, 1, 2], 1: [3, 4, 5], 2: [1, 4]}
        transfer_checked(ex, bench, offer, None, "N1.2")


def test_N1_a_content_addressed_backend_refuses_views_without_names(kvwire_harness: Harness) -> None:
    """N1.5 / S3.2: a backend that declares content addressing refuses a publish and a fetch whose
    groups carry no names with ``InvalidSubmission`` (never as rows nobody holds), touching no
    memory and storing nothing: a named fetch afterwards finds none of those rows."""
    specs = [(32, 3), (48, 3)]
    with paged_exchange(kvwire_harness, specs, 233, needs.transfer, needs.names) as (caps, ex, bench):
        if caps.publish:
            refused(lambda: ex.publish(bench.source_view(names=False)),
                    "N1.5: a publish whose groups carry no names, on a content-addressed backend,")
        if caps.fetch:
            refused(lambda: ex.fetch(bench.sink_view(names=False)),
                    "N1.5: a fetch whose groups carry no names, on a content-addressed backend,")
        bench.verify("N1.5: after submissions refused for carrying no names")
        if ex.store:
            transfer_checked(ex, bench, {}, None, "N1.5")


@pytest.mark.parametrize("width", [1, 64])
def test_N1_names_of_one_byte_and_of_64_bytes_name_their_blocks(kvwire_harness: Harness, width: int) -> None:
    """N1.3: names are 1 to 64 bytes wide, and a name of either extreme names its block: rows named
    by one byte, or by 64 bytes that differ only in the last, move and are found like any others
    (from a store, the rows offered; from a serving peer, the held prefix)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    rows = 6
    plan = ViewPlan(tuple(GroupPlan(gi, CacheKind.PAGED, size, rows, tuple(range(1, 1 + rows)),
                                    tuple(reversed(range(1, 1 + rows))), rows + 2, width)
                          for gi, size in enumerate((32, 48))), 251, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        needs_misses(ex)
        names = np.full((rows, width), 0x5A, dtype=np.uint8)
        names[:, -1] = np.arange(rows) * 37  # distinct only in the last byte (the only byte, at width 1)
        for gi in range(len(plan.groups)):
            bench.names[gi] = names
        offer = offer_for(ex, plan, lambda gi, n: [0, 1, 2, 4] if ex.store else range(4))
        transfer_checked(ex, bench, offer, None, f"N1.3 (names of {width} bytes)")


def test_N1_a_name_with_a_trailing_zero_or_a_byte_less_is_another_name(kvwire_harness: Harness) -> None:
    """N1.4 / S1.4: a name and the same name with one more trailing zero byte, or with its last
    byte dropped, are different names: after a publish of names of width w (1, 16 and 64, some
    ending in a zero byte), a fetch of the same group and rows under those names of width w + 1
    or w - 1 finds nothing."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    widths = (1, 16, 64)
    rows = 4
    plan = ViewPlan(tuple(GroupPlan(gi, CacheKind.PAGED, 32, rows, tuple(range(1, 1 + rows)),
                                    tuple(reversed(range(1, 1 + rows))), rows + 2, w)
                          for gi, w in enumerate(widths)), 241)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "which names a stored row is found under")
        needs.names(caps)
        for names in bench.names:
            names[:, 0] = np.arange(rows) + 1  # distinct, also once the last byte is dropped
            if names.shape[1] > 1:
                names[::2, -1] = 0  # a trailing zero: dropping it leaves the same bytes, zero-padded
        published = ex.offer(bench)
        assert published is not None
        if not any(m.any() for m in published.masks):
            pytest.skip("the store took none of the published rows")
        for what, delta in (("one trailing zero byte added", +1), ("the last byte dropped", -1)):
            select = {gi: list(range(rows)) for gi, w in enumerate(widths) if 1 <= w + delta <= 64}
            view = bench.sink_view(select)
            groups = []
            for gi, g in zip(bench.groups_in(select), view.groups, strict=True):
                w = widths[gi]
                names = np.zeros((rows, w + delta), dtype=np.uint8)
                names[:, : min(w, w + delta)] = bench.names[gi][:, : min(w, w + delta)]
                groups.append(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens, names))
            fetched = ex.settle(ex.fetch(View(tuple(groups))))
            bench.apply_fetch(fetched, select)
            for gi, mask in zip(bench.groups_in(select), fetched.masks, strict=True):
                assert not mask.any(), (
                    f"N1.4/S1.4: group {gi}: rows {np.flatnonzero(mask).tolist()} were published under names of "
                    f"{widths[gi]} bytes, and found under the same names with {what} ({widths[gi] + delta} bytes); "
                    "those are different names, which no one published")


# -- publish masks ---------------------------------------------------------------------------------

def test_A5_a_publish_counts_rows_the_store_already_holds(kvwire_harness: Harness) -> None:
    """A5.6 / A5.11: a publish's mask marks the rows the other end holds once it concluded, those it held
    before included."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 5), (128, 5)], 233, shared=False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "a publish's mask of held rows")
        first = ex.settle(ex.publish(bench.source_view({0: [0, 1], 1: [4]})))
        assert first.is_delivered and all(m.all() for m in first.masks), f"S1: {first!r}"
        again = ex.settle(ex.publish(bench.source_view()))
        assert again.is_delivered, f"A5.4: publishing rows the store holds and rows it lacks failed: {again!r}"
        for g, mask in zip(plan.groups, again.masks, strict=True):
            assert mask.all(), (
                f"A5.4: group {g.group_id}: the store holds every row after the second publish, but its mask marks "
                f"only {np.flatnonzero(mask).tolist()}; rows held before count as held")
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(fetched)
        assert all(m.all() for m in fetched.masks), f"S1: {fetched!r}"


def test_A5_publish_masks_say_exactly_what_the_store_holds(kvwire_harness: Harness) -> None:
    """A5.6 / A5.9 / S1.3: with faults on some names, a row the publish marks true is found by a fetch,
    and a row that faulted is marked false and not found."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 6), (40, 6)], 239, shared=False)
    probe = Bench(kvwire_harness, None, None, plan, kind)
    faulty = {probe.names[0][3].tobytes(), probe.names[1][1].tobytes()}
    try:
        with needs.open_exchange(kvwire_harness, faults=FaultPlan(publish=frozenset(faulty))) as ex, Bench(
                kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            store_only(ex, "a publish's mask of held rows")
            published = ex.settle(ex.publish(bench.source_view()))
            assert published.is_failed, f"A5.3: a publish that met faults at the store must fail: {published!r}"
            fetched = ex.settle(ex.fetch(bench.sink_view()))
            bench.apply_fetch(fetched)
            for gi, (put, got) in enumerate(zip(published.masks, fetched.masks, strict=True)):
                lost = np.flatnonzero(put & ~got)
                assert lost.size == 0, (
                    f"A5.4: group {gi}: row(s) {lost.tolist()} marked held by the publish were not found by a fetch")
                for row in range(plan.groups[gi].rows):
                    if bench.names[gi][row].tobytes() in faulty:
                        assert not put[row] and not got[row], (
                            f"A5.4: group {gi} row {row} faulted at the store, yet is marked held or was found")
    finally:
        probe.close()
