"""Lender micro-benchmarks: prompt hashing, reuse lookup of a long prefix, and the lease cycle.

Run: ``.venv/bin/python bench/bench_lender.py`` (add ``--device cuda`` on a GPU machine).
Prints one table of medians; goals: a 128k-token prefix looked up in <= 5 ms (``probe(tokens)``,
hashing included: names are one SHA-256 call per block, ``kvwire.lender.names``), a lease cycle
<= 50 us per lease and <= 1 us per row."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvwire.contract import CacheKind
from kvwire.lender import CacheLayout, GroupSpec, Lender, Scope

PREFIX_TOKENS = 128 * 1024


def median_seconds(fn: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_lender(block_tokens: int, device: str, staging_slots: int = 0) -> Lender:
    blocks = PREFIX_TOKENS // block_tokens
    layout = CacheLayout(
        block_tokens=block_tokens,
        num_blocks=2 * blocks + 8,
        num_state_slots=0,
        groups=(
            GroupSpec(0, CacheKind.PAGED, (2, block_tokens, 1, 8), torch.float16),
            GroupSpec(1, CacheKind.PAGED, (2, block_tokens, 1, 8), torch.float16),
        ),
    )
    return Lender(layout, Scope("bench-model", b"tenant"), device=device, staging_slots=staging_slots)


def committed(lender: Lender, tokens: np.ndarray):
    request = lender.open_request(tokens)
    lender.commit(request, tokens.size)
    return request


def fmt(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:8.3f} ms"
    return f"{seconds * 1e6:8.2f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args()
    rows: list[tuple[str, str, str]] = []
    tokens = np.arange(PREFIX_TOKENS, dtype=np.int64) * 7 + 3

    for bt in (16, 32, 64):
        lender = make_lender(bt, args.device)
        t = median_seconds(lambda lender=lender: lender.names(tokens), args.repeat)
        rows.append((f"hash 128k-token prompt (block {bt})", fmt(t), f"{PREFIX_TOKENS / t / 1e6:6.1f} M tokens/s"))

    for bt in (16, 32):
        lender = make_lender(bt, args.device)
        request = committed(lender, tokens)
        lender.close_request(request)
        names = lender.names(tokens)
        blocks = names.shape[0]
        assert lender.probe(tokens) == blocks

        t = median_seconds(lambda lender=lender: lender.probe(tokens), args.repeat)
        rows.append((f"probe(tokens) 128k prefix (block {bt})", fmt(t), f"{blocks} blocks, hashing included"))
        t = median_seconds(lambda lender=lender, names=names: lender.probe_names(names), args.repeat)
        rows.append((f"probe_names 128k prefix (block {bt})", fmt(t), f"{t / blocks * 1e9:6.0f} ns/block"))

        def lend_names(lender=lender, names=names, blocks=blocks) -> None:
            lease = lender.lend_names(names)
            assert lease.found == blocks
            lease.release()

        t = median_seconds(lend_names, args.repeat)
        rows.append((f"lend_names+release 128k prefix (block {bt})", fmt(t), f"{t / blocks * 1e9:6.0f} ns/block"))

        def reopen(lender=lender) -> None:
            lender.close_request(lender.open_request(tokens))

        t = median_seconds(reopen, args.repeat)
        rows.append((f"open+close on a held 128k prefix (block {bt})", fmt(t), "hashing included"))
        assert lender.pins() == 0

    # lease cycle: lend -> view -> mark -> release, over n rows of each of 2 PAGED groups
    bt = 16
    sizes = (1, 64, 1024, 8192)
    for kind in ("read", "write", "names", "read staged"):
        lender = make_lender(bt, args.device, staging_slots=8192 if kind == "read staged" else 0)
        cycle: dict[int, float] = {}
        for n in sizes:
            prompt = tokens[: n * bt + 1]  # n whole blocks and one more token
            if kind == "write":
                request = lender.open_request(prompt)
            else:
                request = committed(lender, prompt)
            names = request.names[:n].copy()

            def one(lender=lender, request=request, names=names, n=n, kind=kind) -> None:
                if kind == "names":
                    lease = lender.lend_names(names)
                elif kind == "write":
                    lease = lender.lend_write(request, first_block=0)
                else:
                    lease = lender.lend_read(request, staging=kind == "read staged")
                lease.wait_ready(10.0)
                view = lease.view
                masks = view.row_masks()
                for m in masks:
                    m[:] = True
                lease.mark_arrived(masks)
                lease.release()
                assert view.groups[0].rows == n

            cycle[n] = median_seconds(one, args.repeat * (5 if n <= 64 else 1))
            lender.close_request(request)
        per_row = (cycle[sizes[-1]] - cycle[sizes[0]]) / (2 * (sizes[-1] - sizes[0]))
        detail = ", ".join(f"{n}: {fmt(cycle[n]).strip()}" for n in sizes)
        rows.append((f"lease cycle, {kind} (blocks x 2 groups)", fmt(cycle[1]),
                     f"{per_row * 1e9:6.0f} ns/row; {detail}"))
        assert lender.pins() == 0

    width = max(len(r[0]) for r in rows)
    print(f"kvwire lender bench on {args.device}, torch {torch.__version__}, medians of {args.repeat}+ runs; "
          f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'what':<{width}}  {'median':>11}  notes")
    print("-" * (width + 60))
    for what, value, notes in rows:
        print(f"{what:<{width}}  {value:>11}  {notes}")


if __name__ == "__main__":
    main()
