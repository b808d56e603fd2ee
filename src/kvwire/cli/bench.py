"""``kvwire bench``: pull throughput against row size and prompt length for each installed
backend, beside a plain memory copy of the same bytes (and the plugin's raw transport, when the
plugin offers one as ``Plugin.extra["raw_bench"]``) measured in the same run. Prints the ratios,
writes a JSON file and a PNG plot.

The caches are filled with random pages, not by the model, so only moving bytes is measured;
the time-to-first-token rows use the model on both sides."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvwire.contract import OtherEnd
from kvwire.registry import BackendConfig, load_config, survey

__all__ = ["Point", "run_bench"]

B = 16


@dataclass(frozen=True, slots=True)
class Point:
    backend: str
    sweep: str            # "row" or "prompt" or "ttft"
    row_bytes: int
    tokens: int
    bytes: int
    seconds: float        # median kvwire pull
    memcpy_seconds: float
    raw_seconds: float | None
    prefill_seconds: float | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9

    @property
    def vs_memcpy(self) -> float:
        return self.memcpy_seconds / self.seconds

    @property
    def vs_raw(self) -> float | None:
        return self.raw_seconds / self.seconds if self.raw_seconds else None


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


def _pull_seconds(config: BackendConfig, row_bytes: int, tokens: int, repeat: int) -> tuple[float, int]:
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
            if i:  # the first pull warms connections and pages up
                times.append(r.seconds)
            moved = r.bytes_moved
    return statistics.median(times), moved


def _ttft(config: BackendConfig, tokens: int, repeat: int = 3) -> tuple[float, float, int]:
    """Median seconds to the first token: pull then decode on B, against a local prefill on A."""
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
        for p in prompts:   # the first round pays connection and first-use costs
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
    return statistics.median(remote[1:]), statistics.median(local[1:]), moved


def _backends(names: Sequence[str]) -> list[str]:
    if names:
        return list(names)
    return [row.entry.name for row in survey() if row.plugin is not None and not row.problem]


def run_bench(
    names: Sequence[str] = (),
    *,
    rows: Sequence[int] = (64 << 10, 256 << 10, 1 << 20, 4 << 20),
    prompts: Sequence[int] = (1024, 4096, 16384),
    ttft_prompts: Sequence[int] = (512, 2048),
    total_bytes: int = 64 << 20,
    repeat: int = 5,
    console: Console | None = None,
) -> list[Point]:
    console = console or Console()
    points: list[Point] = []
    chosen = _backends(names)
    steps = len(chosen) * (len(rows) + len(prompts) + len(ttft_prompts))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("bench", total=steps)
        for name in chosen:
            with load_config(backend=name, environ={}).services() as config:
                plugin = config.plugin()
                raw: Callable[..., float] | None = plugin.extra.get("raw_bench")
                for row in rows:
                    progress.update(task, description=f"{name}: rows of {row >> 10} KiB")
                    tokens = max(B, (total_bytes // (2 * row)) * B)  # two layer groups
                    secs, moved = _pull_seconds(config, row, tokens, repeat)
                    raw_s = raw(plugin.resolve(config.options), row, moved // row, repeat) if raw else None
                    points.append(Point(name, "row", row, tokens, moved, secs, _memcpy_seconds(moved, repeat), raw_s))
                    progress.advance(task)
                for tokens in prompts:
                    progress.update(task, description=f"{name}: {tokens}-token prompts")
                    row = 64 << 10
                    secs, moved = _pull_seconds(config, row, tokens, max(2, repeat // 2))
                    points.append(Point(name, "prompt", row, tokens, moved, secs, _memcpy_seconds(moved, repeat), None))
                    progress.advance(task)
                for tokens in ttft_prompts:
                    progress.update(task, description=f"{name}: time to first token, {tokens} tokens")
                    remote, local, moved = _ttft(config, tokens)
                    points.append(Point(name, "ttft", 0, tokens, moved, remote, _memcpy_seconds(max(moved, 1), repeat),
                                        None, prefill_seconds=local))
                    progress.advance(task)
    return points


def render(points: Sequence[Point], console: Console) -> None:
    table = Table(title="kvwire bench · pull throughput (medians)")
    for col in ("backend", "sweep", "row", "tokens", "MiB", "GB/s", "× memcpy", "× raw", "TTFT pull+decode / prefill"):
        table.add_column(col, justify="right" if col not in ("backend", "sweep") else "left")
    for p in points:
        ttft = f"{p.seconds * 1e3:.0f} / {p.prefill_seconds * 1e3:.0f} ms" if p.prefill_seconds is not None else ""
        table.add_row(p.backend, p.sweep, f"{p.row_bytes >> 10} KiB" if p.row_bytes else "", f"{p.tokens}",
                      f"{p.bytes / 2**20:.1f}", f"{p.gbps:.2f}", f"{p.vs_memcpy:.2f}",
                      f"{p.vs_raw:.2f}" if p.vs_raw else "", ttft)
    console.print(table)


def write(points: Sequence[Point], out: Path) -> tuple[Path, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    data = [dict(asdict(p), gbps=p.gbps, vs_memcpy=p.vs_memcpy, vs_raw=p.vs_raw) for p in points]
    json_path = out / "bench.json"
    json_path.write_text(json.dumps(data, indent=2))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in sorted({p.backend for p in points}):
        rows = [p for p in points if p.backend == name and p.sweep == "row"]
        if rows:
            left.plot([p.row_bytes >> 10 for p in rows], [p.gbps for p in rows], "o-", label=f"kvwire {name}")
            raws = [(p.row_bytes >> 10, p.bytes / seconds / 1e9) for p in rows if (seconds := p.raw_seconds)]
            if raws:
                left.plot([x for x, _ in raws], [y for _, y in raws], "x--", label=f"raw {name}")
        prompts = [p for p in points if p.backend == name and p.sweep == "prompt"]
        if prompts:
            right.plot([p.tokens for p in prompts], [p.tokens / p.seconds / 1e3 for p in prompts], "o-", label=name)
    rows = [p for p in points if p.sweep == "row"]
    if rows:
        by_row = {p.row_bytes: p for p in rows}
        left.plot([r >> 10 for r in sorted(by_row)], [by_row[r].bytes / by_row[r].memcpy_seconds / 1e9 for r in sorted(by_row)],
                  "k:", label="numpy memcpy")
    left.set(xscale="log", xlabel="row size (KiB)", ylabel="GB/s", title="pull throughput by row size")
    right.set(xscale="log", xlabel="prompt tokens", ylabel="thousand tokens/s", title="pull throughput by prompt length")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png_path = out / "bench.png"
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path


def as_dicts(points: Sequence[Point]) -> list[dict[str, Any]]:
    return [asdict(p) for p in points]
