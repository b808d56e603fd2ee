"""The one-sided mode's descriptor merging: rows adjacent on both sides become one span, and
the spans cover exactly the rows, in order (no NIXL needed)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from kvwire_ucx.nixl import coalesce


def test_rows_adjacent_on_both_sides_merge_and_others_do_not() -> None:
    local = np.array([0, 100, 200, 1000, 1100], dtype=np.uint64)
    remote = np.array([5000, 5100, 9000, 9100, 9200], dtype=np.uint64)
    here, there = coalesce(local, remote, np.full(5, 100, dtype=np.uint64))
    # rows 0-1 adjacent on both sides; row 2 adjacent here only; rows 3-4 adjacent on both
    assert here.tolist() == [[0, 200, 0], [200, 100, 0], [1000, 200, 0]]
    assert there.tolist() == [[5000, 200, 0], [9000, 100, 0], [9100, 200, 0]]


@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.integers(1, 64)), min_size=0, max_size=40))
def test_spans_cover_exactly_the_rows_in_order(rows: list[tuple[bool, bool, int]]) -> None:
    local, remote, sizes = [], [], []
    here = there = 0
    for near_here, near_there, size in rows:
        here += 0 if near_here else 7
        there += 0 if near_there else 11
        local.append(here)
        remote.append(there)
        sizes.append(size)
        here += size
        there += size
    a, b = coalesce(np.array(local, np.uint64), np.array(remote, np.uint64), np.array(sizes, np.uint64))
    assert a[:, 1].tolist() == b[:, 1].tolist()

    def expand(spans: np.ndarray) -> list[int]:
        return [int(base) + i for base, length, _ in spans for i in range(int(length))]

    assert expand(a) == [x + i for x, n in zip(local, sizes, strict=True) for i in range(n)]
    assert expand(b) == [x + i for x, n in zip(remote, sizes, strict=True) for i in range(n)]
    assert len(a) <= len(rows)
