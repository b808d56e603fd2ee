"""Staging copy throughput on a CUDA device, against the torch copy ceiling measured in the same
run: device -> host (a read lease's staging copy), host -> device (a write lease's marked rows),
and device -> device. Run: ``python bench/bench_gpu.py [--out FILE]`` on a machine with a GPU.

Each figure is the median of several runs; the ratio column is kvwire / ceiling."""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import numpy as np
import torch

from kvwire.contract import CacheKind
from kvwire.lender import CacheLayout, GroupSpec, Lender, Scope

B = 16


def median_seconds(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def case(row_bytes: int, blocks: int, repeat: int) -> list[tuple[str, int, float, float]]:
    width = row_bytes // (2 * B * 2)  # float16 elements: (2, B, width)
    layout = CacheLayout(B, blocks + 1, 0, (GroupSpec(0, CacheKind.PAGED, (2, B, width), torch.float16),))
    prompt = np.arange(blocks * B + 1)
    a = Lender(layout, Scope("bench"), device="cuda", staging_slots=blocks)
    b = Lender(layout, Scope("bench"), device="cuda", staging_slots=blocks)
    req_a = a.open_request(prompt)
    a.pool(0).normal_()
    a.commit(req_a, len(prompt))
    total = blocks * layout.groups[0].slot_bytes
    out = []

    def d2h() -> None:
        lease = a.lend_read(req_a, staging=True)
        assert lease.wait_ready(30)
        lease.release()

    dev = a.pool(0)[:blocks]
    pinned = torch.empty_like(dev, device="cpu").pin_memory()
    out.append(("device->host (read lease, staging)", total, median_seconds(d2h, repeat),
                median_seconds(lambda: pinned.copy_(dev, non_blocking=True), repeat)))

    req_b = b.open_request(prompt)
    masks = None

    def h2d() -> None:
        nonlocal masks
        lease = b.lend_write(req_b, first_block=0, staging=True)
        masks = masks or tuple(np.ones(g.rows, dtype=bool) for g in lease.view.groups)
        lease.mark_arrived(masks)
        lease.release()

    dst = b.pool(0)[:blocks]
    try:
        h2d_s = median_seconds(h2d, repeat)
    except Exception as exc:  # a lender that refuses re-filling valid rows: measure once
        print(f"  (host->device re-lend refused: {exc}; measured on fresh requests)", file=sys.stderr)
        h2d_s = float("nan")
    out.append(("host->device (write lease, marked rows)", total, h2d_s,
                median_seconds(lambda: dst.copy_(pinned, non_blocking=True), repeat)))

    table_a = torch.tensor(np.array(req_a.block_table[:blocks]), device="cuda")
    table_b = torch.tensor(np.array(req_b.block_table[:blocks]), device="cuda")
    out.append(("device->device (pool rows by block table)", total,
                median_seconds(lambda: b.pool(0).index_copy_(0, table_b, a.pool(0).index_select(0, table_a)), repeat),
                median_seconds(lambda: dst.copy_(dev), repeat)))
    a.close_request(req_a)
    b.close_request(req_b)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    lines = [
        f"kvwire GPU staging bench · {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"machine: {torch.cuda.get_device_name()} · torch {torch.__version__} · CUDA {torch.version.cuda} · {platform.node()}",
        "",
        f"{'path':44} {'row':>8} {'total':>9} {'kvwire GB/s':>12} {'ceiling GB/s':>13} {'ratio':>6}",
    ]
    for row in (256 << 10, 1 << 20, 4 << 20):
        blocks = max(16, (512 << 20) // row)
        for name, total, ours, ceiling in case(row, blocks, args.repeat):
            g_ours, g_ceil = total / ours / 1e9, total / ceiling / 1e9
            lines.append(f"{name:44} {row >> 10:>6}Ki {total >> 20:>7}Mi {g_ours:>12.1f} {g_ceil:>13.1f} {g_ours / g_ceil:>6.2f}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
