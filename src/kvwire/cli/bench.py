"""``kvwire bench``: pull throughput against row size and prompt length for each installed
backend, beside a plain memory copy of the same bytes (and the plugin's raw transport, when the
plugin offers one as ``Plugin.extra["raw_bench"]``) measured in the same run. Prints the ratios,
writes a JSON file and a PNG plot.

The caches are filled with random pages, not by the model, so only moving bytes is measured;
the time-to-first-token rows use the model on both sides."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvwire.contract import OtherEnd
from kvwire.registry import BackendConfig, load_config, survey

__all__ = ["Point", "BenchRun", "run_bench", "render", "write", "plot", "machine"]

B = 16


@dataclass(frozen=True, slots=True)
class Point:
    """One measured point: a backend's pulls of ``bytes`` bytes in rows of ``row_bytes``
    (``tokens`` tokens), beside a memory copy of the same bytes and the raw transport."""

    backend: str
    sweep: str            # "row" or "prompt" or "ttft"
    row_bytes: int
    tokens: int
    bytes: int
    seconds: float        # median kvwire pull (ttft: pull and decode)
    memcpy_seconds: float
    raw_seconds: float | None
    prefill_seconds: float | None = None
    #: the fastest and slowest of the repeats whose median ``seconds`` is
    seconds_min: float = 0.0
    seconds_max: float = 0.0
    repeat: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def vs_memcpy(self) -> float:
        return self.memcpy_seconds / self.seconds

    @property
    def vs_raw(self) -> float | None:
        return self.raw_seconds / self.seconds if self.raw_seconds else None


@dataclass(frozen=True, slots=True)
class BenchRun:
    """A whole ``kvwire bench`` run: where and when it ran, each backend's distribution and the
    options it ran with (a private files root, a private Mooncake master), and its points."""

    machine: str
    date: str
    repeat: int
    backends: dict[str, dict[str, Any]]
    points: list[Point]
    #: the machine's one-minute load average when the run started and when it ended: other work
    #: running beside the bench, which widens the spread and lowers the medians
    load: tuple[float, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "date": self.date, "repeat": self.repeat,
                "load": list(self.load) if self.load else None, "backends": self.backends,
                "points": [dict(asdict(p), gbps=p.gbps, vs_memcpy=p.vs_memcpy, vs_raw=p.vs_raw)
                           for p in self.points]}

    def where(self) -> str:
        """Machine, load and date in one line, for titles."""
        load = f" · load {self.load[0]:.1f} at the start, {self.load[1]:.1f} at the end" if self.load else ""
        return f"{self.machine}{load} · {self.date}"


def machine() -> str:
    """The machine in a few words: CPU model, cores, memory and GPUs."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = " ".join(line.split(":", 1)[1].split())
                break
    words = [f"{cpu}, {os.cpu_count()} cores"]
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        words.append(f"{kib / 2**20:.0f} GiB")
    if torch.cuda.is_available():
        words.append(", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
    return ", ".join(words)


def _model(row_bytes: int):
    from kvwire.runtime import ModelConfig

    # one slot = layers_per_group · 2 · B · heads · head_dim · 4 bytes (fp32), heads = 4
    head_dim = 16
    lpg = max(1, row_bytes // (2 * B * 4 * head_dim * 4))
    return ModelConfig(layers=2 * lpg, layers_per_group=lpg, heads=4, head_dim=head_dim, block_tokens=B,
                       max_tokens=1 << 20, seed=1)


def _fill(worker, prompts: Sequence[np.ndarray]) -> None:
    """Random pages under each prompt's names, committed, as if prefilled."""
    gen = torch.Generator().manual_seed(0)
    for p in prompts:
        req = worker.lender.open_request(p)
        table = torch.tensor(np.array(req.block_table, dtype=np.int64))
        for g in worker.lender.layout.groups:
            pool = worker.lender.pool(g.group_id)
            pool[table] = torch.randn((len(table), *pool.shape[1:]), generator=gen, dtype=pool.dtype)
        worker.lender.commit(req, len(p))
        worker.lender.close_request(req)


def _memcpy_seconds(nbytes: int, repeat: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _pull_seconds(config: BackendConfig, row_bytes: int, tokens: int, repeat: int) -> tuple[list[float], int]:
    """The seconds of ``repeat`` pulls of ``tokens`` tokens in rows of ``row_bytes`` (after one
    untimed pull that warms connections and pages up), and the bytes each moved."""
    from kvwire.runtime import Worker

    model = _model(row_bytes)
    rng = np.random.default_rng(tokens)
    prompts = [rng.integers(0, model.vocab, tokens + 1) for _ in range(repeat + 1)]
    blocks = (tokens // B + 1) * len(prompts) + 8
    with Worker(model, config=config, num_blocks=blocks, name="bench-A") as a, \
         Worker(model, config=config, num_blocks=blocks, name="bench-B") as b:
        _fill(a, prompts)
        state = a.transceiver_state()
        store = a.capabilities.other_end is OtherEnd.STORE
        times, moved = [], 0
        for i, p in enumerate(prompts):
            if store:
                a.publish(p)
            r = b.pull(p, source=state)
            if r.status != "delivered" or r.blocks_moved != tokens // B:
                raise RuntimeError(f"bench pull on {config.name} moved {r.blocks_moved} of {tokens // B} blocks: {r.reason}")
            if i:
                times.append(r.seconds)
            moved = r.bytes_moved
    return times, moved


def _ttft(config: BackendConfig, tokens: int, repeat: int = 3) -> tuple[list[float], float, int]:
    """Seconds to the first token on B (pull then decode) for each repeat, the median of a local
    prefill on A, and the bytes a pull moved; the first round (connections, first use) untimed."""
    from kvwire.runtime import ModelConfig, Worker

    model = ModelConfig(layers=8, layers_per_group=2, heads=4, head_dim=64, block_tokens=B,
                        max_tokens=tokens + 64, seed=3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, model.vocab, tokens) for _ in range(repeat + 1)]
    blocks = (tokens // B + 2) * len(prompts)
    remote, local, moved = [], [], 0
    with Worker(model, config=config, num_blocks=blocks, name="ttft-A") as a, \
         Worker(model, config=config, num_blocks=blocks, name="ttft-B") as b:
        state = a.transceiver_state()
        for p in prompts:
            t = time.perf_counter()
            a.generate(p, max_tokens=1)
            local.append(time.perf_counter() - t)
            if a.capabilities.other_end is OtherEnd.STORE:
                a.publish(p)
            t = time.perf_counter()
            r = b.pull(p, source=state)
            b.generate(p, max_tokens=1)
            remote.append(time.perf_counter() - t)
            moved = r.bytes_moved
    return remote[1:], statistics.median(local[1:]), moved


def _point(backend: str, sweep: str, row: int, tokens: int, moved: int, times: list[float], repeat: int,
           raw_s: float | None = None, prefill_s: float | None = None) -> Point:
    return Point(backend, sweep, row, tokens, moved, statistics.median(times), _memcpy_seconds(max(moved, 1), repeat),
                 raw_s, prefill_s, seconds_min=min(times), seconds_max=max(times), repeat=len(times))


def run_bench(
    names: Sequence[str],
    *,
    rows: Sequence[int] = (64 << 10, 256 << 10, 1 << 20, 4 << 20),
    prompts: Sequence[int] = (1024, 4096, 16384),
    ttft_prompts: Sequence[int] = (512, 2048),
    total_bytes: int = 64 << 20,
    repeat: int = 5,
    console: Console | None = None,
) -> BenchRun:
    """Measure ``names``, one after another, each inside its plugin's local services (a private
    master, a private files root: started here and removed afterwards)."""
    console = console or Console()
    points: list[Point] = []
    backends: dict[str, dict[str, Any]] = {}
    steps = len(names) * (len(rows) + len(prompts) + len(ttft_prompts))
    date = datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    started_load = os.getloadavg()[0]
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("bench", total=steps)
        for name in names:
            with load_config(backend=name, environ={}).services() as config:
                plugin = config.plugin()
                entry = next((row.entry for row in survey() if row.entry.name == name), None)
                backends[name] = {"distribution": entry.distribution if entry else "",
                                  "version": entry.version if entry else "", "options": dict(config.options)}
                raw: Callable[..., float] | None = plugin.extra.get("raw_bench")
                for row in rows:
                    progress.update(task, description=f"{name}: rows of {_size(row)}")
                    tokens = max(B, (total_bytes // (2 * row)) * B)  # two layer groups
                    times, moved = _pull_seconds(config, row, tokens, repeat)
                    raw_s = raw(plugin.resolve(config.options), row, moved // row, repeat) if raw else None
                    points.append(_point(name, "row", row, tokens, moved, times, repeat, raw_s))
                    progress.advance(task)
                for tokens in prompts:
                    progress.update(task, description=f"{name}: {tokens}-token prompts")
                    times, moved = _pull_seconds(config, 64 << 10, tokens, max(2, repeat // 2))
                    points.append(_point(name, "prompt", 64 << 10, tokens, moved, times, repeat))
                    progress.advance(task)
                for tokens in ttft_prompts:
                    progress.update(task, description=f"{name}: time to first token, {tokens} tokens")
                    times, local, moved = _ttft(config, tokens)
                    points.append(_point(name, "ttft", 0, tokens, moved, times, repeat, prefill_s=local))
                    progress.advance(task)
    return BenchRun(machine(), date, repeat, backends, points, load=(started_load, os.getloadavg()[0]))


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KiB"


def render(run: BenchRun, console: Console) -> None:
    """Three tables, one per sweep, each narrow enough for a terminal of 80 columns."""
    points = run.points
    console.print(f"kvwire bench · {run.where()}", highlight=False, markup=False)

    def caption(sweep: list[Point]) -> str:
        counts = " or ".join(dict.fromkeys(str(p.repeat) for p in sweep))
        return f"GB/s: the median of {counts} pulls; min–max: the slowest and the fastest"

    def spread(p: Point) -> str:
        return f"{p.bytes / p.seconds_max / 1e9:.2f}–{p.bytes / p.seconds_min / 1e9:.2f}" if p.seconds_min else ""

    rows = [p for p in points if p.sweep == "row"]
    if rows:
        table = Table(title="pull throughput by row size", box=box.SIMPLE_HEAD, caption=caption(rows))
        for col in ("backend", "row", "MiB", "GB/s", "min–max", "× memcpy", "× raw"):
            table.add_column(col, justify="left" if col == "backend" else "right", no_wrap=True)
        for p in rows:
            table.add_row(p.backend, _size(p.row_bytes), f"{p.bytes / 2**20:.0f}", f"{p.gbps:.2f}", spread(p),
                          f"{p.vs_memcpy:.2f}", f"{p.vs_raw:.2f}" if p.vs_raw else "-")
        console.print(table)
    prompts = [p for p in points if p.sweep == "prompt"]
    if prompts:
        table = Table(title="pull throughput by prompt length (rows of 64 KiB)", box=box.SIMPLE_HEAD,
                      caption=caption(prompts))
        for col in ("backend", "tokens", "MiB", "GB/s", "min–max", "k tokens/s", "× memcpy"):
            table.add_column(col, justify="left" if col == "backend" else "right", no_wrap=True)
        for p in prompts:
            table.add_row(p.backend, f"{p.tokens}", f"{p.bytes / 2**20:.0f}", f"{p.gbps:.2f}", spread(p),
                          f"{p.tokens / p.seconds / 1e3:.0f}", f"{p.vs_memcpy:.2f}")
        console.print(table)
    ttft = [p for p in points if p.sweep == "ttft" and p.prefill_seconds]
    if ttft:
        table = Table(title="time to first token on worker B (8-layer model)", box=box.SIMPLE_HEAD,
                      caption="pull and decode on B against a prefill on A; medians")
        for col in ("backend", "tokens", "pull+decode ms", "prefill ms", "faster by"):
            table.add_column(col, justify="left" if col == "backend" else "right", no_wrap=True)
        for p in ttft:
            assert p.prefill_seconds is not None
            table.add_row(p.backend, f"{p.tokens}", f"{p.seconds * 1e3:.0f}", f"{p.prefill_seconds * 1e3:.0f}",
                          f"{p.prefill_seconds / p.seconds:.1f}×")
        console.print(table)


def write(run: BenchRun, out: Path) -> tuple[Path, Path]:
    """``bench.json`` (the whole run) and ``bench.png`` (both sweeps, :func:`plot`) in ``out``."""
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    json_path.write_text(json.dumps(run.as_dict(), indent=2))
    fig = plot(run)
    png_path = out / "bench.png"
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path


def plot(run: BenchRun) -> Any:
    """The run's figure: throughput by row size (each backend beside its raw transport, in its
    colour, and a memory copy) and by prompt length, bars from the slowest to the fastest
    repeat, ticks at the measured values, the legend below both panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    points = run.points
    names = list(dict.fromkeys(p.backend for p in points if p.sweep in ("row", "prompt")))
    colours = {name: f"C{i % 10}" for i, name in enumerate(names)}  # matplotlib's default cycle
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.2))
    for i, name in enumerate(names):
        colour = colours[name]
        # Each backend a little to the side of the measured value (a log axis: a factor), so
        # bars of the same size or length do not hide one another.
        dodge = 1.05 ** (i - (len(names) - 1) / 2)
        rows = [p for p in points if p.backend == name and p.sweep == "row"]
        if rows:
            x = [p.row_bytes * dodge for p in rows]
            y = [p.gbps for p in rows]
            err = [[p.gbps - p.bytes / p.seconds_max / 1e9 for p in rows], [p.bytes / p.seconds_min / 1e9 - p.gbps for p in rows]]
            left.errorbar(x, y, yerr=err if rows[0].seconds_min else None, fmt="o-", color=colour, capsize=3,
                          label=f"kvwire · {name}")
            raws = [(p.row_bytes * dodge, p.bytes / seconds / 1e9) for p in rows if (seconds := p.raw_seconds)]
            if raws:
                left.plot([a for a, _ in raws], [b for _, b in raws], "x--", color=colour, label=f"raw transport · {name}")
        prompts = [p for p in points if p.backend == name and p.sweep == "prompt"]
        if prompts:
            k = [p.tokens / p.seconds / 1e3 for p in prompts]
            err = [[a - p.tokens / p.seconds_max / 1e3 for a, p in zip(k, prompts, strict=True)],
                   [p.tokens / p.seconds_min / 1e3 - a for a, p in zip(k, prompts, strict=True)]]
            right.errorbar([p.tokens * dodge for p in prompts], k, yerr=err if prompts[0].seconds_min else None, fmt="o-",
                           color=colour, capsize=3, label=f"kvwire · {name}")
    rows = [p for p in points if p.sweep == "row"]
    if rows:
        by_row = {p.row_bytes: p for p in rows}
        sizes = sorted(by_row)
        left.plot(sizes, [by_row[r].bytes / by_row[r].memcpy_seconds / 1e9 for r in sizes], "k:",
                  label="numpy memory copy of the same bytes")
    left.set(xscale="log", xlabel="row size (one block of one layer group)", ylabel="GB/s",
             title="pull throughput by row size")
    right.set(xscale="log", xlabel="prompt length (tokens), rows of 64 KiB", ylabel="thousand tokens/s",
              title="pull throughput by prompt length")
    # Ticks at the measured sizes and lengths, named as the tables name them (after the log
    # scale is set: setting the scale puts back its own locators).
    for ax, sweep, label in ((left, "row", _size), (right, "prompt", str)):
        measured = sorted({p.row_bytes if sweep == "row" else p.tokens for p in points if p.sweep == sweep})
        if measured:
            ax.xaxis.set_major_locator(FixedLocator(measured))
            ax.xaxis.set_major_formatter(FixedFormatter([label(m) for m in measured]))
            ax.set_xlim(measured[0] / 1.5, measured[-1] * 1.5)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    handles, labels = left.get_legend_handles_labels()
    # Each backend's kvwire curve beside its raw transport, in the order of the backends; the
    # memory copy, the reference, last.
    rank = {name: i for i, name in enumerate(names)}
    order = sorted(range(len(labels)), key=lambda i: (labels[i].startswith("numpy"),
                                                       rank.get(labels[i].split(" · ")[-1], 0),
                                                       labels[i].startswith("raw")))
    handles, labels = [handles[i] for i in order], [labels[i] for i in order]
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)) or 1, frameon=False)
    def repeats(sweep: str) -> str:
        return " or ".join(dict.fromkeys(str(p.repeat) for p in points if p.sweep == sweep)) or "-"

    fig.suptitle(f"kvwire bench · {run.where()}\neach point the median of {repeats('row')} pulls "
                 f"(left) and {repeats('prompt')} (right); bars from the slowest to the fastest", fontsize=11)
    rows_of_legend = -(-len(labels) // 4) if labels else 0
    fig.tight_layout(rect=(0, 0.05 * rows_of_legend + 0.02, 1, 1))
    return fig
