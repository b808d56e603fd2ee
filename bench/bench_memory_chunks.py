"""The memory store's large copies against the host's own memmove (issue 33 row 2): where a staged
save through the ``memory`` backend loses time to the host.

    python bench/bench_memory_chunks.py [--rows 2048] [--threads 8] [--rounds 6]

Three lines and a table, medians:

- memmove of the rows' bytes (touched first) cut in equal pieces on 1, 2, 4, ... threads: what the
  host's memory gives a copy of pinned rows at all (glibc's memmove, calls of 1/threads each).
- memmove on ``--threads`` threads in calls of 2 ... 512 MiB, with the C library's copy
  thresholds: below its non-temporal threshold glibc's memmove writes through the cache.
- publish and fetch of ``--rows`` rows of 2 MiB (one object a row, as a staged save of a real KV
  shape stores a block) through a ``BlobBackend`` over ``MemoryDriver(copy_threads=--threads)``,
  by the backend's ``chunk_bytes`` x ``workers`` (64 MiB x 2 is the default the plugin builds),
  beside the store's copy pool copying the same bytes as one batch in the same round (``pool``:
  kvwire.copying.stream_copy, or memmove where kvwire's helper was not built). The store holds
  two rounds' bytes, so from the third round on each publish evicts and reuses memory (the
  steady state of a full store); the first two rounds, which fill fresh pages, are not counted
  but printed (``fresh``), since a first fill pays the kernel's zeroing of every new page.

On the H100 host (bench/results/gpu-2026-12-06-night.txt) the store's 64 MiB chunks, cut in 8 MiB
pieces, copied at 36-39 GB/s with glibc's memmove, below its non-temporal threshold of 53.5 MiB,
against 57-62 with stores that bypass the cache: since then the pool copies with
kvwire.copying.stream_copy."""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
from _waiting import Direction, Mover  # noqa: E402  (bench/ is on sys.path when a bench runs)
from kvwire_memory.driver import MemoryDriver
from kvwire_memory.store import CopyPool, MemoryStore

from kvwire.blob import BlobBackend
from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View
from kvwire.copying import COPY_NAME

ROW = 2 << 20
VARIANTS = ((64, 2), (256, 2), (1024, 1), (1 << 20, 1))  # chunk MiB x workers (the last: one call a submission)


def view(region: SlotRegion, names: np.ndarray) -> View:
    n = len(names)
    return View((LayerGroupRows(0, CacheKind.PAGED, region, np.arange(n, dtype=np.int64), TokenRange(0, 16 * n),
                                names),))


def names_of(n: int, salt: int) -> np.ndarray:
    names = np.zeros((n, 16), np.uint8)
    names[:, :8] = (np.arange(n, dtype=np.uint64) + np.uint64(salt << 32)).astype("<u8").view(np.uint8).reshape(n, 8)
    return names


def memmove_s(dst: np.ndarray, src: np.ndarray, threads: int, piece: int | None = None) -> float:
    """Seconds to memmove ``src`` into ``dst`` cut in equal shares on ``threads`` threads, each
    thread copying its share in calls of at most ``piece`` bytes (as the store's copy pool does
    for a batch cut in pieces; ``None``: its whole share in one call)."""
    step = len(src) // threads

    def part(i: int) -> None:
        lo, hi = i * step, (len(src) if i == threads - 1 else (i + 1) * step)
        for at in range(lo, hi, piece or hi - lo):
            ctypes.memmove(dst.ctypes.data + at, src.ctypes.data + at, min(piece or hi - lo, hi - at))

    workers = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
    began = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - began


def glibc_tunables() -> str:
    """The C library's copy thresholds as its loader lists them (memmove switches to stores that
    bypass the cache above the non-temporal one); empty where it lists none."""
    for loader in ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1"):
        try:
            out = subprocess.run([loader, "--list-tunables"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        return ", ".join(line.split(" (")[0].replace("glibc.cpu.x86_", "") for line in out.splitlines()
                         if "non_temporal_threshold" in line or "rep_movsb_threshold" in line)
    return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2048, help="rows of 2 MiB a submission (default 2048: 4 GiB)")
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1), help="the store's copy_threads")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    total = ROW * args.rows
    gb = total / 1e9
    src, dst = np.ones(total, np.uint8), np.ones(total, np.uint8)
    print(f"bench_memory_chunks: {args.rows} rows of 2 MiB ({total >> 20} MiB); {platform.node()}, "
          f"{os.cpu_count()} CPUs; medians of {args.rounds} (memmove) / {max(1, args.rounds - 2)} (store) rounds")
    print("memmove by threads (GB/s): " + ", ".join(
        f"{t}: {gb / statistics.median(memmove_s(dst, src, t) for _ in range(args.rounds)):.1f}"
        for t in sorted({1, 2, 4, 8, 16, args.threads}) if t <= 4 * (os.cpu_count() or 1)), flush=True)
    tunables = os.environ.get("GLIBC_TUNABLES")
    by_piece = []
    for mib in (2, 8, 32, 128, 512):
        if mib << 20 <= total // args.threads:
            took = statistics.median(memmove_s(dst, src, args.threads, mib << 20) for _ in range(args.rounds))
            by_piece.append(f"{mib} MiB: {gb / took:.1f}")
    print(f"memmove on {args.threads} threads by the size of one memmove (GB/s; the C library's "
          f"{glibc_tunables() or '?'}{', GLIBC_TUNABLES=' + tunables if tunables else ''}): "
          + ", ".join(by_piece), flush=True)
    region = SlotRegion(0, src.ctypes.data, ROW, args.rows, MemoryKind.HOST)
    back = SlotRegion(1, dst.ctypes.data, ROW, args.rows, MemoryKind.HOST)
    pool = CopyPool(args.threads)
    mover, hint = Mover(timeout_s=120.0), Hint.of("store")
    print(f"the store's copy pool copies with {COPY_NAME}")
    print(f"{'chunk MiB':>10} {'workers':>7} | {'publish':>7} {'fetch':>7} {'pool':>7} GB/s "
          f"| {'fresh publish':>13} (copy_threads {args.threads})")
    try:
        for chunk_mib, workers in VARIANTS:
            backend = BlobBackend(MemoryDriver(MemoryStore(2 * total), copy_threads=args.threads),
                                  chunk_bytes=chunk_mib << 20, workers=workers, owns_driver=True)
            backend.register_regions([region, back])
            pubs, fets, raws, fresh = [], [], [], []
            try:
                for r in range(args.rounds):
                    names = names_of(args.rows, r)
                    began = time.perf_counter()
                    mover.move(backend, Direction.PUBLISH, view(region, names), hint)
                    publish = time.perf_counter() - began
                    began = time.perf_counter()
                    mover.move(backend, Direction.FETCH, view(back, names), hint)
                    fetch = time.perf_counter() - began
                    began = time.perf_counter()
                    pool.copy([dst.ctypes.data], [src.ctypes.data], [total])
                    raws.append(time.perf_counter() - began)
                    (fresh if r < 2 else pubs).append(publish)
                    if r >= 2:
                        fets.append(fetch)
            finally:
                backend.shutdown()
            label = "one call" if chunk_mib >= 1 << 20 else str(chunk_mib)
            print(f"{label:>10} {workers:>7} | {gb / statistics.median(pubs or fresh):7.1f} "
                  f"{gb / statistics.median(fets or [float('inf')]):7.1f} {gb / statistics.median(raws):7.1f}      "
                  f"| {', '.join(f'{gb / f:.1f}' for f in fresh):>13}", flush=True)
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
