"""K1.2: a view's block layout, and reading one back."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import CacheKind, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View, block_layout
from kvwire.contract.blocks import parse_block_layout


def group(gid: int, slot_bytes: int) -> LayerGroupRows:
    region = SlotRegion(gid, 4096 * (gid + 1) * 1024, slot_bytes, 8, MemoryKind.HOST)
    return LayerGroupRows(gid, CacheKind.PAGED, region, np.arange(2), TokenRange(0, 32))


def test_a_views_layout_lists_its_groups_in_ascending_id_with_their_row_sizes() -> None:
    view = View((group(3, 100), group(0, 4096), group(17, 1)))
    assert block_layout(view) == "0:4096,3:100,17:1"
    assert block_layout([(17, 1), (0, 4096), (3, 100)]) == "0:4096,3:100,17:1"
    assert block_layout(View(())) == ""


@given(st.dictionaries(st.integers(0, 2**40), st.integers(1, 2**40), max_size=80))
def test_a_layout_reads_back_as_its_pairs(pairs: dict[int, int]) -> None:
    text = block_layout(pairs.items())
    assert parse_block_layout(text) == tuple(sorted(pairs.items()))


@pytest.mark.parametrize("text", [
    "0:0", "-1:4", "0:4,0:4", "1:4,0:4", "0:4,", ",0:4", "0:4;1:4", "00:4", "0:04", "0: 4", " 0:4", "0:4.0",
    "a:4", "0x1:4", "0:4,1", "1:+4",
])
def test_a_malformed_layout_is_refused_naming_it(text: str) -> None:
    with pytest.raises(ValueError, match="block layout"):
        parse_block_layout(text)


def test_a_layout_that_is_no_str_is_refused() -> None:
    for value in (b"0:4", 4, None, True):
        with pytest.raises(ValueError, match="str"):
            parse_block_layout(value)


def test_pairs_that_make_no_layout_are_refused() -> None:
    with pytest.raises(ValueError, match="once"):
        block_layout([(1, 4), (1, 8)])
    with pytest.raises(ValueError, match=">= 1 byte"):
        block_layout([(1, 0)])
    with pytest.raises(ValueError, match="ids >= 0"):
        block_layout([(-1, 4)])
