"""``kvwire bench`` as a user reads it: tables whole at 80 columns, a JSON of the whole run, and
a plot whose axes, colours, spread, title and legend say what was measured (issue 40)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvwire.cli.bench import BenchRun, Point, plot
from kvwire.cli.checks import bench_backends


def kvwire(*args: str, columns: int = 80, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvwire.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, COLUMNS=str(columns)))


def test_bench_at_80_columns_prints_whole_tables_and_writes_the_run(tmp_path):
    r = kvwire("bench", "--backend", "memory", "--quick", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("kvwire bench · ")       # no progress line before it off a terminal
    assert "…" not in r.stdout and all(len(line) <= 80 for line in lines), r.stdout
    assert sum(line.split()[:1] == ["memory"] for line in lines) == 5   # 2 row sizes, 2 prompts, 1 TTFT
    run = json.loads((tmp_path / "bench.json").read_text())
    assert run["repeat"] == 3 and run["machine"] and run["date"] and len(run["load"]) == 2
    assert run["backends"]["memory"]["distribution"] == "kvwire-memory"
    assert {p["sweep"] for p in run["points"]} == {"row", "prompt", "ttft"}
    assert [p["row_bytes"] for p in run["points"] if p["sweep"] == "row"] == [64 << 10, 1 << 20]
    for p in run["points"]:
        assert p["backend"] == "memory" and p["bytes"] > 0 and p["memcpy_seconds"] > 0
        assert 0 < p["seconds_min"] <= p["seconds"] <= p["seconds_max"]
        assert p["repeat"] == (3 if p["sweep"] != "prompt" else 2)
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bench_leaves_out_a_plugin_that_declares_itself_no_backend_to_compare():
    names = bench_backends(())
    assert "memory" in names
    from kvwire.registry import survey

    for row in survey():
        if row.plugin is not None and row.plugin.extra.get("bench") is False:
            assert row.entry.name not in names
    if any(row.entry.name == "example" for row in survey()):
        assert "example" not in names                    # the template's toy store
        assert bench_backends(["example"]) == ["example"]  # unless asked for by name


def point(backend: str, sweep: str, size: int, gbps: float, raw: float | None = None) -> Point:
    nbytes = 64 << 20
    seconds = nbytes / gbps / 1e9
    return Point(backend, sweep, size if sweep == "row" else 64 << 10, size if sweep == "prompt" else 1024, nbytes,
                 seconds, seconds / 2, nbytes / raw / 1e9 if raw else None, seconds_min=seconds * 0.8,
                 seconds_max=seconds * 1.25, repeat=5)


@pytest.fixture
def figure():
    run = BenchRun("Test CPU, 2 cores, 24 GiB", "2026-12-04 10:00 UTC", 5,
                   {"alpha": {}, "beta": {}},
                   [point("alpha", "row", 64 << 10, 3.0), point("alpha", "row", 1 << 20, 4.0),
                    point("beta", "row", 64 << 10, 1.0, raw=2.0), point("beta", "row", 1 << 20, 2.0, raw=3.0),
                    point("alpha", "prompt", 1024, 3.0), point("alpha", "prompt", 16384, 4.0),
                    point("beta", "prompt", 1024, 1.0), point("beta", "prompt", 16384, 2.0)], load=(0.5, 1.5))
    import matplotlib.pyplot as plt

    fig = plot(run)
    yield fig
    plt.close(fig)


def test_the_plot_ticks_are_the_measured_sizes_and_lengths(figure):
    left, right = figure.axes
    figure.canvas.draw()
    assert [t.get_text() for t in left.get_xticklabels()] == ["64 KiB", "1 MiB"]
    assert [t.get_text() for t in right.get_xticklabels()] == ["1024", "16384"]


def test_a_raw_transport_is_drawn_in_its_backends_colour(figure):
    left = figure.axes[0]
    lines = {line.get_label(): line for line in left.get_lines()}
    raw = lines["raw transport · beta"]
    kvwire_beta = next(c for c in left.containers if c.get_label() == "kvwire · beta")
    kvwire_alpha = next(c for c in left.containers if c.get_label() == "kvwire · alpha")
    assert raw.get_color() == kvwire_beta.lines[0].get_color() != kvwire_alpha.lines[0].get_color()
    assert raw.get_linestyle() == "--"


def test_the_plot_shows_the_spread_of_the_repeats(figure):
    left = figure.axes[0]
    beta = next(c for c in left.containers if c.get_label() == "kvwire · beta")
    (bars,) = beta.lines[2]                                  # the vertical bars, one per point
    spans = sorted((seg[0][1], seg[1][1]) for seg in bars.get_segments())
    # 1 GB/s median over repeats of 0.8x and 1.25x its time: bars from 0.8 to 1.25 GB/s
    assert spans[0] == pytest.approx((1 / 1.25, 1 / 0.8))


def test_the_legend_lies_outside_both_panels_and_the_title_says_where_when_and_how_often(figure):
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    (legend,) = figure.legends
    box = legend.get_window_extent(renderer)
    for ax in figure.axes:
        assert not box.overlaps(ax.get_window_extent(renderer))
    title = figure._suptitle.get_text()
    assert "Test CPU, 2 cores" in title and "2026-12-04" in title and "median of 5 pulls" in title
    assert "load 0.5 at the start, 1.5 at the end" in title
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["kvwire · alpha", "kvwire · beta", "raw transport · beta",
                      "numpy memory copy of the same bytes"]    # each raw beside its backend
