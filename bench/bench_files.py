"""The files store at the row size of a small model's vLLM block (16 KiB: 32 tokens of one layer),
through the backend as kvwire-vllm drives it, in one run.

    .venv/bin/python bench/bench_files.py [--rows 511] [--runs 9]

Prints medians over runs of:

- per object, through the driver: put, get (one ``preadv`` into the row) and contains (lookup);
- a fetch of ``rows`` blocks of two layers (``2 * rows`` objects), as a kvwire-vllm load inside the
  step does it: one view of both layers; two views, one per layer, submitted together; and two
  views one after the other (what the connector does: one layer in flight per request).

The store lives under /dev/shm (shared memory), as the backend's default root does.

Large batches by copying threads: ``--copy-threads 1,8`` instead publishes and fetches 2 MiB rows
(``--large-rows``, 64 to 2048 a submission) through the plugin built with each ``copy_threads``
value (each its own root, at capacity for two submissions so publishes evict), alternating
between the values run by run, and prints each one's publish and fetch GB/s side by side
(medians, submission until quiesced):

    .venv/bin/python bench/bench_files.py --copy-threads 1,8 --large-rows 64,256,1024,2048"""

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
import kvwire_files.store
import numpy as np

from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View

SIZE = 16384


def settle(attempt, woken: threading.Event) -> None:
    while not (attempt.poll() is not None and attempt.quiesced()):
        woken.wait(5)
        woken.clear()


def view_of(region: SlotRegion, n: int, salt: int) -> View:
    names = np.zeros((n, 16), dtype=np.uint8)
    names[:, :8] = (np.arange(n, dtype=np.uint64) + np.uint64(salt << 32)).astype("<u8").view(np.uint8).reshape(n, 8)
    return View((LayerGroupRows(0, CacheKind.PAGED, region, np.arange(n, dtype=np.int64), TokenRange(0, 16 * n),
                                names),))


def by_copy_threads(threads: list[int], counts: list[int], runs: int) -> None:
    """Publish and fetch GB/s of ``count`` 2 MiB rows per ``copy_threads`` value, side by side."""
    row = 2 << 20
    hint = Hint.of("store", timeout_s=120.0)
    woken = threading.Event()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    print(f"bench_files --copy-threads: {row >> 20} MiB rows through the files plugin by copy_threads (threads that "
          f"write or read one batch of {kvwire_files.store.PARALLEL_IO_BYTES >> 20} MiB or more), median of {runs} "
          f"runs alternating between the values; GB/s, submission until quiesced; {platform.node()}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}")
    head = "".join(f" {'pub t=' + str(t):>10} {'fetch t=' + str(t):>10}" for t in threads)
    print(f"{'rows':>6} {'bytes':>7}{head}")
    for count in counts:
        src = np.random.default_rng(count).integers(0, 256, (count, row), dtype=np.uint8)
        dst = np.zeros_like(src)
        regions = [SlotRegion(0, src.ctypes.data, row, count, MemoryKind.HOST),
                   SlotRegion(1, dst.ctypes.data, row, count, MemoryKind.HOST)]
        roots, backends = [], {}
        for t in threads:
            root = tempfile.mkdtemp(prefix="bench-files-", dir=shm)
            roots.append(root)
            backends[t] = kvwire_files.plugin.build({"root": root, "capacity_bytes": 2 * count * row + (1 << 20),
                                                     "eviction": True, "timeout_s": 120.0, "copy_threads": t})
            backends[t].register_regions(regions)
        times: dict[int, dict[str, list[float]]] = {t: {"publish": [], "fetch": []} for t in threads}
        salt = 0
        try:
            for run in range(runs + 1):
                for t, backend in backends.items():
                    salt += 1
                    dst[:] = 0
                    began = time.perf_counter()
                    settle(backend.publish(view_of(regions[0], count, salt), hint, woken.set), woken)
                    middle = time.perf_counter()
                    settle(backend.fetch(view_of(regions[1], count, salt), hint, woken.set), woken)
                    ended = time.perf_counter()
                    if run == 0:
                        assert np.array_equal(dst, src)
                        continue
                    times[t]["publish"].append(middle - began)
                    times[t]["fetch"].append(ended - middle)
        finally:
            for backend in backends.values():
                backend.close()
            for root in roots:
                shutil.rmtree(root, ignore_errors=True)
        total = count * row
        cells = "".join(f" {total / statistics.median(times[t]['publish']) / 1e9:>10.1f}"
                        f" {total / statistics.median(times[t]['fetch']) / 1e9:>10.1f}" for t in threads)
        print(f"{count:>6} {total >> 20:>5}Mi{cells}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=511, help="blocks per fetch (511: a 16k-token prompt)")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--copy-threads", metavar="N,N", help="only the large-batch table: publish and fetch of 2 MiB rows "
                    "by each of these copy_threads values side by side (e.g. 1,8)")
    ap.add_argument("--large-rows", default="64,256,1024,2048",
                    help="with --copy-threads: 2 MiB rows per submission (default 64,256,1024,2048)")
    args = ap.parse_args()
    if args.copy_threads is not None:
        by_copy_threads([int(x) for x in args.copy_threads.split(",")], [int(x) for x in args.large_rows.split(",")],
                        args.runs)
        return 0
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
