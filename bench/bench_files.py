"""The files store at the row size of a small model's vLLM block (16 KiB: 32 tokens of one layer),
through the backend as kvwire-vllm drives it, in one run.

    .venv/bin/python bench/bench_files.py [--rows 511] [--runs 9]

Prints medians over runs of:

- per object, through the driver: put, get (one ``preadv`` into the row) and contains (lookup);
- a fetch of ``rows`` blocks of two layers (``2 * rows`` objects), as a kvwire-vllm load inside the
  step does it: one view of both layers; two views, one per layer, submitted together; and two
  views one after the other (what the connector does: one layer in flight per request).

The store lives under /dev/shm (shared memory), as the backend's default root does."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time

import kvwire_files
import numpy as np

from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View

SIZE = 16384


def settle(attempt, woken: threading.Event) -> None:
    while not (attempt.poll() is not None and attempt.quiesced()):
        woken.wait(5)
        woken.clear()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=511, help="blocks per fetch (511: a 16k-token prompt)")
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    n = args.rows
    root = tempfile.mkdtemp(prefix="bench-files-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    backend = kvwire_files.create({"root": root, "capacity_bytes": 1 << 32, "eviction": True, "fsync": False,
                                   "timeout_s": 30.0, "max_in_flight": 64, "namespace": "bench"})
    memory = [np.zeros((3 * n, SIZE), dtype=np.uint8) for _ in range(2)]
    regions = [SlotRegion(i, m.ctypes.data, SIZE, m.shape[0], MemoryKind.HOST) for i, m in enumerate(memory)]
    registration = backend.register_regions(regions)
    rng = np.random.default_rng(0)
    names = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    rows = np.arange(n, dtype=np.int64) * 3
    hint = Hint.of("store", namespace="bench", timeout_s=30.0)
    woken = threading.Event()

    def view(groups) -> View:
        return View(tuple(LayerGroupRows(r.region_id, CacheKind.PAGED, r, rows, TokenRange(0, n * 32), names)
                          for r in groups))

    try:
        for m in memory:
            m[rows] = rng.integers(0, 256, (n, SIZE), dtype=np.uint8)
        began = time.perf_counter()
        settle(backend.publish(view(regions), hint, woken.set), woken)
        put = (time.perf_counter() - began) / (2 * n)
        driver = backend.driver
        keys = [f"kvw1/bench/g{g}/{name.tobytes().hex()}" for g in range(2) for name in names]
        sink = np.zeros((2 * n, SIZE), dtype=np.uint8)
        driver.register([SlotRegion(9, sink.ctypes.data, SIZE, 2 * n, MemoryKind.HOST)])
        addresses = sink.ctypes.data + np.arange(2 * n, dtype=np.uint64) * SIZE
        sizes = np.full(2 * n, SIZE, dtype=np.uint64)
        gets, looks = [], []
        for _ in range(args.runs):
            t = time.perf_counter()
            result = driver.get_into(keys, addresses, sizes)
            gets.append(time.perf_counter() - t)
            assert not result.reasons and (result.status == 0).all(), result.reasons
            t = time.perf_counter()
            driver.contains(keys)
            looks.append(time.perf_counter() - t)
        assert np.array_equal(sink[:n], memory[0][rows]) and np.array_equal(sink[n:], memory[1][rows])
        shapes = {
            "one view of both layers": lambda: [backend.fetch(view(regions), hint, woken.set)],
            "two views (one per layer) at once": lambda: [backend.fetch(view((r,)), hint, woken.set) for r in regions],
        }
        timings: dict[str, list[float]] = {label: [] for label in [*shapes, "two views, one after the other"]}
        for _ in range(args.runs):
            for label, submit in shapes.items():
                t = time.perf_counter()
                for attempt in submit():
                    settle(attempt, woken)
                timings[label].append(time.perf_counter() - t)
            t = time.perf_counter()
            for region in regions:
                settle(backend.fetch(view((region,)), hint, woken.set), woken)
            timings["two views, one after the other"].append(time.perf_counter() - t)
    finally:
        registration.close()
        backend.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"bench_files: {2 * n} objects of {SIZE // 1024} KiB ({n} blocks x 2 layers), median of {args.runs} runs; "
          f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    print(f"  per object: put {put * 1e6:.1f} us (one run), get {statistics.median(gets) / (2 * n) * 1e6:.1f} us, "
          f"contains {statistics.median(looks) / (2 * n) * 1e6:.1f} us")
    for label, xs in timings.items():
        print(f"  fetch, {label:36s} {statistics.median(xs) * 1e3:6.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
