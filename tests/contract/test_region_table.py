"""The one reading of M3 and M4 (``kvwire.contract.RegionTable``), checked against a plain
model: a row is recognized exactly when its bytes lie inside one registered region of its
memory kind and device."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.contract import (
    CacheKind,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    RegionTable,
    SlotRegion,
    SubmissionRejected,
    TokenRange,
    View,
)

HOST = frozenset({MemoryKind.HOST})


def rows(region: SlotRegion, slots: list[int], gid: int = 0) -> LayerGroupRows:
    return LayerGroupRows(gid, CacheKind.PAGED, region, np.asarray(slots, dtype=np.int64), TokenRange(0, 16))


def test_M3_a_batch_registers_whole_or_not_at_all() -> None:
    table = RegionTable(HOST)
    a = SlotRegion(1, 0x1000, 64, 4, MemoryKind.HOST)
    b = SlotRegion(2, 0x2000, 64, 4, MemoryKind.HOST)
    reg = table.register([a])
    with pytest.raises(InvalidSubmission, match="overlaps registered region 1"):
        table.register([b, SlotRegion(3, 0x1040, 64, 1, MemoryKind.HOST)])
    assert table.regions == (a,)  # b was not registered either
    with pytest.raises(InvalidSubmission, match="of one batch overlap"):
        table.register([b, SlotRegion(4, 0x2010, 16, 1, MemoryKind.HOST)])
    with pytest.raises(InvalidSubmission, match="device memory"):
        table.register([SlotRegion(5, 0x9000, 64, 1, MemoryKind.DEVICE, device=0)])
    empty = table.register([])  # an empty batch registers nothing, and closes like any other
    assert empty.regions == () and table.regions == (a,)
    empty.close()
    reg.close()
    assert reg.closed and table.regions == ()


def test_M3_closing_twice_never_revokes_a_later_registration_of_the_same_span() -> None:
    table = RegionTable(HOST)
    a = SlotRegion(1, 0x1000, 64, 4, MemoryKind.HOST)
    first = table.register([a])
    first.close()
    second = table.register([a])
    first.close()
    assert not second.closed
    assert table.locate(rows(a, [3])).region == a


def test_M3_registration_after_close_of_the_table_is_rejected() -> None:
    table = RegionTable(HOST)
    table.close()
    with pytest.raises(SubmissionRejected, match="shut down"):
        table.register([SlotRegion(1, 0x1000, 64, 4, MemoryKind.HOST)])


@pytest.mark.parametrize(("slots", "adjacent"), [
    ([3, 4, 5, 6], True), ([7], True), ([0, 1], True),
    ([3, 5, 6], False), ([6, 5, 4, 3], False), ([4, 3, 5, 6], False), ([2, 2, 3], False),
])
def test_M4_located_rows_say_whether_they_are_consecutive_slots_in_order(slots: list[int], adjacent: bool) -> None:
    table = RegionTable(HOST)
    table.register([SlotRegion(1, 0x10000, 8, 16, MemoryKind.HOST)])
    view_region = SlotRegion(2, 0x10000 + 8, 8, 15, MemoryKind.HOST)  # a sub-span: offsets shift by one slot
    located = table.locate(rows(view_region, slots))
    assert located.adjacent is adjacent
    assert located.offsets.tolist() == [8 + s * 8 for s in slots]


def test_M4_a_device_region_at_a_host_address_is_not_recognized() -> None:
    table = RegionTable(frozenset(MemoryKind))
    table.register([SlotRegion(1, 0x1000, 64, 4, MemoryKind.HOST)])
    with pytest.raises(InvalidSubmission, match="outside every registered region"):
        table.locate(rows(SlotRegion(2, 0x1000, 64, 4, MemoryKind.DEVICE, device=0), [0]))


@settings(max_examples=200, deadline=None)
@given(
    registered=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=4),
    view_base=st.integers(0, 60), slot_bytes=st.sampled_from([1, 3, 8]), slots=st.lists(st.integers(0, 7), max_size=6),
)
def test_M4_a_row_is_recognized_exactly_when_it_lies_in_one_registered_region(
        registered: list[tuple[int, int]], view_base: int, slot_bytes: int, slots: list[int]) -> None:
    table = RegionTable(HOST)
    spans: list[tuple[int, int]] = []
    for i, (start, length) in enumerate(registered):
        base, end = 0x10000 + start * 8, 0x10000 + (start + length) * 8
        if any(base < e and s < end for s, e in spans):
            continue
        table.register([SlotRegion(i, base, 8, length, MemoryKind.HOST)])
        spans.append((base, end))
    view_region = SlotRegion(99, 0x10000 + view_base * 8, slot_bytes, 8, MemoryKind.HOST)
    group = rows(view_region, slots)
    starts = [view_region.base + s * slot_bytes for s in slots]
    # The model: one registered span holds every row of the group.
    expect = not slots or any(all(b <= a and a + slot_bytes <= e for a in starts) for b, e in spans)
    if expect:
        located = table.locate(group)
        if slots:
            assert located.region is not None
            assert np.array_equal(located.offsets + located.region.base, np.asarray(starts))
    else:
        with pytest.raises(InvalidSubmission, match="group 0"):
            table.locate_view(View((group,)))
