"""The raw ucxx transfer that ``kvwire bench`` prints beside kvwire-ucx moves the rows whole."""

from __future__ import annotations

import pytest

from kvwire.registry import load


def test_raw_bench_moves_the_rows_and_reports_a_time() -> None:
    plugin = load("ucx")
    if plugin.check and plugin.check():
        pytest.skip(f"ucx unavailable: {plugin.check()}")
    seconds = plugin.extra["raw_bench"](plugin.resolve({}), 64 << 10, 16, 2)   # raises if bytes differ
    assert 0 < seconds < 30
