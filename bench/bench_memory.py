"""In-memory blob backend: round-trip throughput and per-submission overhead.

    .venv/bin/python bench/bench_memory.py [--quick]

Throughput: one worker publishes ~64 MiB of rows (row size 64 KiB ... 16 MiB) through the
``memory`` plugin, another fetches them into other memory; time = publish + fetch, each from
submission until quiesced. The store is at capacity, so each publish evicts the previous run's
objects and reuses their memory (the steady state of a full store). The baseline moves the same
bytes with plain numpy in the same run: one np.copyto into a staging slab (what a publish does)
and one back (what a fetch does). Runs alternate between the two; each figure is the median.
Goals (issue 19): >= 0.8x of the baseline at 64 KiB rows, >= 0.9x at 256 KiB. Beside each ratio,
the per-step trace: the median time inside the store driver's calls (the copies) and the rest of
the round trip (submission, the hand-off to a worker thread and the wake back).

Overhead: one-row submissions of 4 KiB, sequentially (submit, wait for the wake, next) and
pipelined (a window of submissions in flight), against the bare driver call; goals <= 50 us and
<= 20 us. Per-row cost: the slope of a submission's time between 16 and 256 rows of 4 KiB
(publish, then fetch); goal <= 1 us per row. Beside the wall times, the process's CPU time for
the same work (all threads): on a machine shared with other jobs, wall time also counts the
time slices they take.

Large batches by copying threads: ``--copy-threads 1,8`` publishes and fetches 2 MiB rows (64 to
2048 of them a submission, ``--rows``) through the plugin built with each ``copy_threads`` value,
alternating between the values run by run, and prints each one's publish and fetch GB/s side by
side (medians), beside one numpy copy of the same bytes (one thread) for scale; only that table:

    .venv/bin/python bench/bench_memory.py --copy-threads 1,8 --rows 64,256,1024,2048

Before and after in one run: ``--against TREE`` alternates this bench (fresh processes, the same
bench code) between the kvwire tree at TREE, e.g. a ``git worktree`` of an earlier commit, and
the installed one, and prints the medians side by side:

    git worktree add --detach /tmp/kvw-before <commit>
    .venv/bin/python bench/bench_memory.py --against /tmp/kvw-before --rounds 3"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import kvwire_memory.store as store_module
import numpy as np
from _waiting import Direction, Mover  # noqa: E402  (bench/ is on sys.path when a bench runs)
from kvwire_memory import MemoryDriver, MemoryStore, forget_store, named_store

from kvwire.blob import BatchResult, BlobBackend
from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View
from kvwire.holding import AtDeadline, Submission, WaitStatus, Wakes, submit, wait, wait_all, wait_any
from kvwire.registry import load

KIB, MIB = 1 << 10, 1 << 20
HINT = Hint.of("store")


def region_of(array: np.ndarray, region_id: int) -> SlotRegion:
    return SlotRegion(region_id, array.ctypes.data, array.shape[1], array.shape[0], MemoryKind.HOST)


def view_of(region: SlotRegion, rows: int, salt: int) -> View:
    ids = np.arange(rows, dtype=np.uint64) + np.uint64(salt) * np.uint64(1 << 32)
    names = np.zeros((rows, 16), dtype=np.uint8)
    names[:, :8] = ids.astype("<u8").view(np.uint8).reshape(rows, 8)
    group = LayerGroupRows(0, CacheKind.PAGED, region, np.arange(rows), TokenRange(0, 16 * rows), names)
    return View((group,))


def throughput(row_bytes: int, total_bytes: int, runs: int) -> tuple[float, float, float]:
    """GiB/s of payload through the backend's round trip and through the numpy baseline, and
    the publish share of the backend's time. Runs alternate between the two, after one warm-up
    each, so a busy machine slows both alike."""
    rows = max(2, total_bytes // row_bytes)
    src = np.random.default_rng(row_bytes).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    staging = np.empty_like(src)
    store_name = f"bench-{uuid.uuid4().hex[:8]}"
    capacity = rows * row_bytes
    options = {"store": store_name, "capacity_bytes": capacity, "eviction": True}
    plugin = load("memory")
    writer, reader = plugin.build(options), plugin.build(options)
    assert isinstance(writer, BlobBackend) and isinstance(reader, BlobBackend)
    src_region, dst_region = region_of(src, 0), region_of(dst, 1)
    writer.register_regions([src_region])
    reader.register_regions([dst_region])
    store = named_store(store_name, capacity_bytes=capacity, eviction=True)
    in_driver = trace_driver(writer, reader)
    mover = Mover()
    salt = iter(range(1, 1 << 30))

    def backend() -> float:
        s = next(salt)  # fresh names: every publish really stores (the store evicts the last run's)
        started = time.perf_counter()
        mover.move(writer, Direction.PUBLISH, view_of(src_region, rows, s), HINT)
        middle = time.perf_counter()
        mover.move(reader, Direction.FETCH, view_of(dst_region, rows, s), HINT)
        return middle - started

    def baseline() -> None:
        np.copyto(staging, src)  # what a publish moves
        np.copyto(dst, staging)  # what a fetch moves

    backend_times, baseline_times, shares, driver_times = [], [], [], []
    for run in range(runs + 1):
        dst[:] = 0
        in_driver.clear()
        started = time.perf_counter()
        publish_s = backend()
        elapsed = time.perf_counter() - started
        driver_s = sum(in_driver)
        assert np.array_equal(dst, src)
        dst[:] = 0
        started = time.perf_counter()
        baseline()
        baseline_s = time.perf_counter() - started
        if run:  # the first run of each warms up
            backend_times.append(elapsed)
            baseline_times.append(baseline_s)
            shares.append(publish_s / elapsed)
            driver_times.append(driver_s)
    writer.close()
    reader.close()
    store.clear()
    forget_store(store_name)
    gib = rows * row_bytes / (1 << 30)
    return (gib / statistics.median(backend_times), gib / statistics.median(baseline_times),
            statistics.median(shares), statistics.median(driver_times),
            statistics.median(t - d for t, d in zip(backend_times, driver_times, strict=True)))


def by_copy_threads(threads: Sequence[int], counts: Sequence[int], row_bytes: int, runs: int) -> list[dict]:
    """For each count of rows: seconds of a publish and of a fetch (submission until quiesced)
    through the plugin built with each ``copy_threads`` value, runs alternating between the
    values after one warm-up each; medians, and a one-thread numpy copy of the same bytes. Each
    value has its own store at capacity, so a publish evicts the last one's objects and reuses
    their memory, as a full store does."""
    out = []
    mover = Mover(timeout_s=120.0)
    for count in counts:
        src = np.random.default_rng(count).integers(0, 256, (count, row_bytes), dtype=np.uint8)
        dst = np.zeros_like(src)
        src_region, dst_region = region_of(src, 0), region_of(dst, 1)
        capacity = count * row_bytes
        sides = {}
        for n in threads:
            options = {"store": f"bench-{uuid.uuid4().hex[:8]}", "capacity_bytes": capacity, "eviction": True,
                       "copy_threads": n, "timeout_s": 120.0}
            backend = load("memory").build(options)
            assert isinstance(backend, BlobBackend)
            backend.register_regions([src_region, dst_region])
            sides[n] = (backend, options["store"])
        times: dict[int, dict[str, list[float]]] = {n: {"publish": [], "fetch": []} for n in threads}
        numpy_s = []
        salt = iter(range(1, 1 << 30))
        for run in range(runs + 1):
            for n, (backend, _) in sides.items():
                s = next(salt)
                dst[:] = 0
                started = time.perf_counter()
                mover.move(backend, Direction.PUBLISH, view_of(src_region, count, s), HINT)
                middle = time.perf_counter()
                mover.move(backend, Direction.FETCH, view_of(dst_region, count, s), HINT)
                ended = time.perf_counter()
                if run == 0:
                    assert np.array_equal(dst, src)
                    continue
                times[n]["publish"].append(middle - started)
                times[n]["fetch"].append(ended - middle)
            started = time.perf_counter()
            np.copyto(dst, src)
            if run:
                numpy_s.append(time.perf_counter() - started)
        for backend, name in sides.values():
            backend.close()
            forget_store(name)
        total = count * row_bytes
        out.append({"rows": count, "bytes": total, "numpy_gbs": total / statistics.median(numpy_s) / 1e9,
                    "by_threads": {n: {k: total / statistics.median(v) / 1e9 for k, v in t.items()}
                                   for n, t in times.items()}})
        del src, dst
    return out


def report_by_copy_threads(threads: Sequence[int], rows: list[dict], row_bytes: int, runs: int) -> None:
    print(f"machine: {machine()}")
    print(f"publish and fetch of {row_bytes // MIB} MiB rows through the memory plugin by copy_threads "
          f"(threads that copy one batch of {store_module.PARALLEL_COPY_BYTES // MIB} MiB or more), median of "
          f"{runs} runs alternating between the values; GB/s of payload, submission until quiesced")
    head = "".join(f" {'pub t=' + str(n):>10} {'fetch t=' + str(n):>10}" for n in threads)
    print(f"{'rows':>6} {'bytes':>7}{head} {'numpy 1t':>9}")
    for r in rows:
        cells = "".join(f" {r['by_threads'][n]['publish']:>10.1f} {r['by_threads'][n]['fetch']:>10.1f}"
                        for n in threads)
        print(f"{r['rows']:>6} {r['bytes'] // MIB:>5}Mi{cells} {r['numpy_gbs']:>9.1f}")


def trace_driver(*backends: BlobBackend) -> list[float]:
    """Seconds spent inside the store driver's put/get_into calls of these backends, appended
    per call (the bench's per-step trace: the copies, against everything around them)."""
    spent: list[float] = []
    for b in backends:
        driver = b.driver
        for name in ("put", "get_into"):
            call = getattr(driver, name)

            def timed(*args, _call=call):  # type: ignore[no-untyped-def]
                started = time.perf_counter()
                try:
                    return _call(*args)
                finally:
                    spent.append(time.perf_counter() - started)

            setattr(driver, name, timed)
    return spent


class CopyOnlyDriver(MemoryDriver):
    """The floor of a store driver, for scale: the memory driver's address checks and the memory
    store's copy routine, into and out of the rows of one pool as large as the bench's store,
    taken in order, so that each submission's rows are one run (the cheapest place a store could
    give them), with no table at all. The bytes a fetch gets are not the ones published; only
    the time counts."""

    def __init__(self, rows: int, row_bytes: int) -> None:
        super().__init__(MemoryStore(1))
        self._pool = np.zeros((rows, row_bytes), dtype=np.uint8)
        base = self._pool.ctypes.data
        self._places: list[int] = list(range(base, base + rows * row_bytes, row_bytes))
        self._next = 0

    def _take(self, n: int) -> list[int]:
        at = self._next if self._next + n <= len(self._places) else 0
        self._next = at + n
        return self._places[at:at + n]

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        where, lengths = self._check("put", keys, addresses, sizes)
        store_module._copy(self._take(len(keys)), where, lengths, sum(lengths))
        return BatchResult.ok(len(keys))

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        where, lengths = self._check("get_into", keys, addresses, sizes)
        store_module._copy(where, self._take(len(keys)), lengths, sum(lengths))
        return BatchResult.ok(len(keys))


class DictFloorDriver(CopyOnlyDriver):
    """The floor of a store keyed by the driver's text keys: :class:`CopyOnlyDriver` plus the
    fewest dict operations such a table needs per row, with nothing else around them. A put
    checks that its keys are distinct (a set) and not stored (a presence check), drops the
    oldest batches' keys until its own fit (a deletion per evicted row) and enters its own (an
    insertion): four per row. A get looks each key up: one per row. No eviction order, memory
    bookkeeping or statuses; a store that has them costs more."""

    def __init__(self, rows: int, row_bytes: int) -> None:
        super().__init__(rows, row_bytes)
        self._table: dict[str, int] = {}
        self._batches: collections.deque[list[str]] = collections.deque()
        self._rows = rows

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        keys, table = list(keys), self._table
        if len(set(keys)) != len(keys) or not table.keys().isdisjoint(keys):
            raise AssertionError("the bench publishes fresh, distinct names")
        while self._batches and len(table) + len(keys) > self._rows:
            collections.deque(map(table.__delitem__, self._batches.popleft()), maxlen=0)
        result = super().put(keys, addresses, sizes)
        table.update(zip(keys, range(len(keys)), strict=True))
        self._batches.append(keys)
        return result

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        if None in map(self._table.get, keys):
            raise AssertionError("the bench fetches what it published")
        return super().get_into(keys, addresses, sizes)


def per_row(runs: int) -> dict[str, float]:
    """Microseconds each extra 4 KiB row adds to a publish and to a fetch: the slope between
    submissions of 16 and 256 rows, medians over ``runs`` runs of 50 submissions each. The store
    holds one run's objects, so each run evicts the last one's and reuses its memory (a full
    store's steady state, as in :func:`throughput`; a growing store adds the first touch of
    fresh pages, a cost of the system, not of the backend). Beside each, the per-step trace of
    the same slope: the time inside the store driver's call, and of it inside the store's copies
    (the rest of the driver's share is the store's table: look-up, eviction, insertion)."""
    row, sizes, count = 4 * KIB, (16, 256), 50
    src = np.random.default_rng(1).integers(0, 256, (sizes[-1], row), dtype=np.uint8)
    dst = np.zeros_like(src)
    store = MemoryStore(count * sum(sizes) * row)
    backend = BlobBackend(MemoryDriver(store))
    src_region, dst_region = region_of(src, 0), region_of(dst, 1)
    backend.register_regions([src_region, dst_region])
    floor = BlobBackend(CopyOnlyDriver(count * sum(sizes), row))
    floor.register_regions([src_region, dst_region])
    dict_floor = BlobBackend(DictFloorDriver(count * sum(sizes), row))
    dict_floor.register_regions([src_region, dst_region])
    in_driver = trace_driver(backend)
    mover = Mover()
    times: dict[tuple[Direction | None, int], list[float]] = {}
    cpu_times: dict[tuple[Direction, int], list[float]] = {}
    steps: dict[tuple[str, Direction, int], list[float]] = {}
    staging: dict[int, list[np.ndarray]] = {}
    salt = iter(range(1, 1 << 30))
    with tracing_copies() as in_copies:
        for run in range(runs + 1):  # the first run warms up
            for n in sizes:
                salts = [next(salt) for _ in range(count)]
                for op, region in ((Direction.PUBLISH, src_region), (Direction.FETCH, dst_region)):
                    views = [view_of(region, n, s) for s in salts]
                    in_driver.clear()
                    in_copies.clear()
                    started, cpu = time.perf_counter(), time.process_time()
                    for v in views:
                        mover.move(backend, op, v, HINT)
                    if run:
                        times.setdefault((op, n), []).append((time.perf_counter() - started) / count)
                        cpu_times.setdefault((op, n), []).append((time.process_time() - cpu) / count)
                        steps.setdefault(("driver", op, n), []).append(sum(in_driver) / count)
                        steps.setdefault(("copies", op, n), []).append(sum(in_copies) / count)
                    started = time.perf_counter()
                    for v in views:
                        mover.move(floor, op, v, HINT)
                    if run:
                        steps.setdefault(("floor", op, n), []).append((time.perf_counter() - started) / count)
                    started = time.perf_counter()
                    for v in views:
                        mover.move(dict_floor, op, v, HINT)
                    if run:
                        steps.setdefault(("dict floor", op, n), []).append((time.perf_counter() - started) / count)
                # the same bytes copied by numpy into slabs of the store's size, reused (no fresh pages)
                slabs = staging.setdefault(n, [np.zeros((n, row), dtype=np.uint8) for _ in range(count)])
                started = time.perf_counter()
                for slab in slabs:
                    np.copyto(slab, src[:n])
                if run:
                    times.setdefault((None, n), []).append((time.perf_counter() - started) / count)
    backend.close()
    floor.close()
    dict_floor.close()

    def slope(of: dict, *key: object) -> float:
        return ((statistics.median(of[(*key, sizes[1])]) - statistics.median(of[(*key, sizes[0])]))
                / (sizes[1] - sizes[0]) * 1e6)

    out: dict[str, float] = {}
    for op, name in ((Direction.PUBLISH, "publish"), (Direction.FETCH, "fetch")):
        whole, driver, copies = slope(times, op), slope(steps, "driver", op), slope(steps, "copies", op)
        out[name] = whole
        out[f"  trace: {name}, backend and holder"] = whole - driver
        out[f"  trace: {name}, the store's table"] = driver - copies
        out[f"  trace: {name}, the store's copies"] = copies
        out[f"  floor: {name} through a driver that only copies"] = slope(steps, "floor", op)
        out[f"  floor: {name} through one that copies and keeps a bare dict"] = slope(steps, "dict floor", op)
    out["publish, CPU"] = slope(cpu_times, Direction.PUBLISH)
    out["fetch, CPU"] = slope(cpu_times, Direction.FETCH)
    out["numpy copy of the same row"] = slope(times, None)
    return out


@contextlib.contextmanager
def tracing_copies() -> Iterator[list[float]]:
    """Seconds spent inside the memory store's copies (``kvwire_memory.store._copy``), appended
    per call while the block runs; the store's own function is back afterwards."""
    original, spent = store_module._copy, []

    def timed(*args):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        try:
            return original(*args)
        finally:
            spent.append(time.perf_counter() - started)

    store_module._copy = timed
    try:
        yield spent
    finally:
        store_module._copy = original


def machine() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.node()}: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
            f"Python {platform.python_version()}, numpy {np.__version__}, load average {load}")


def overhead(submissions: int, runs: int) -> dict[str, float]:
    """Microseconds per one-row 4 KiB submission."""
    row = 4 * KIB
    src = np.random.default_rng(0).integers(0, 256, (1, row), dtype=np.uint8)
    dst = np.zeros_like(src)
    store = MemoryStore(1 << 30)
    backend = BlobBackend(MemoryDriver(store))
    backend.register_regions([region_of(src, 0), region_of(dst, 1)])
    in_driver = trace_driver(backend)
    src_region, dst_region = region_of(src, 0), region_of(dst, 1)
    mover = Mover()
    views = [view_of(src_region, 1, s) for s in range(submissions)]
    fetch_views = [view_of(dst_region, 1, s) for s in range(submissions)]
    results: dict[str, list[float]] = {}

    def record(label: str, seconds: float) -> None:
        results.setdefault(label, []).append(seconds / submissions * 1e6)

    def timed(label: str, work: Callable[[], None]) -> None:
        """Wall time, and the CPU time of the whole process (every thread) for the same work:
        on a machine shared with other jobs the first counts their time slices too."""
        started, cpu = time.perf_counter(), time.process_time()
        work()
        record(label, time.perf_counter() - started)
        record(f"{label}, CPU", time.process_time() - cpu)

    def sequential(op: Direction, batch: list[View]) -> Callable[[], None]:
        def work() -> None:
            for v in batch:
                mover.move(backend, op, v, HINT)
        return work

    for _ in range(runs):
        store.clear()
        timed("publish, sequential", sequential(Direction.PUBLISH, views))
        timed("fetch, sequential", sequential(Direction.FETCH, fetch_views))
        store.clear()
        timed("publish, pipelined (window 32)", lambda: pipelined(backend, views, Direction.PUBLISH))
        timed("fetch, pipelined (window 32)", lambda: pipelined(backend, fetch_views, Direction.FETCH))
        # Per-step trace of the sequential publish: the submission call (which moves a row this
        # small itself), the driver call inside it, and the holder loop's wait after it.
        store.clear()
        wakes = Wakes()
        in_driver.clear()
        call_s = wait_s = 0.0
        for v in views:
            started = time.perf_counter()
            sub = submit(backend, Direction.PUBLISH, v, HINT, wakes=wakes)
            middle = time.perf_counter()
            wait(sub, 30.0, at_deadline=AtDeadline.RETURN).result()
            call_s += middle - started
            wait_s += time.perf_counter() - middle
        record("  trace: the publish() call", call_s)
        record("  trace:   of it inside the driver", sum(in_driver))
        record("  trace: the holder's wait after it", wait_s)
        # The bare driver, for scale: what any backend must spend per row.
        store.clear()
        driver = backend.driver
        keys = [f"bench/{s}" for s in range(submissions)]
        address, size = src_region.addresses(np.zeros(1)), np.full(1, row, dtype=np.uint64)
        started = time.perf_counter()
        for key in keys:
            type(driver).put(driver, [key], address, size)  # the class's put: not the traced one
        record("bare driver put (no backend)", time.perf_counter() - started)
    backend.close()
    order = sorted(results, key=lambda label: label.endswith(", CPU"))  # wall times first, then CPU times
    return {label: statistics.median(results[label]) for label in order}


def pipelined(backend: BlobBackend, views: list[View], op: Direction, window: int = 32) -> None:
    """Keeps up to ``window`` attempts in flight, one condition for all (the holder loop's
    ``wait_any``); an attempt leaves the window once concluded and quiesced."""
    wakes = Wakes()
    in_flight: list[Submission] = []
    for v in views:
        if len(in_flight) >= window:
            finished = {id(w.submission) for w in wait_any(in_flight, 30.0) if w.status is not WaitStatus.EXPIRED}
            assert finished, "no attempt of the window concluded and quiesced within 30 s"
            in_flight[:] = [s for s in in_flight if id(s) not in finished]
        in_flight.append(submit(backend, op, v, HINT, wakes=wakes))
    assert all(w.status is not WaitStatus.EXPIRED for w in wait_all(in_flight, 30.0, at_deadline=AtDeadline.RETURN))


def measure(quick: bool) -> dict:
    """Every figure of the bench, as printed by :func:`report`."""
    runs = 3 if quick else 7
    total = (16 if quick else 64) * MIB
    submissions = 500 if quick else 2000
    result: dict = {"machine": machine(), "runs": runs, "total": total, "submissions": submissions, "rows": []}
    for row_bytes in (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB):
        backend, numpy_rate, share, driver_s, rest_s = throughput(row_bytes, total, runs)
        label = f"{row_bytes // KIB} KiB" if row_bytes < MIB else f"{row_bytes // MIB} MiB"
        result["rows"].append({"row": label, "count": max(2, total // row_bytes), "backend": backend,
                               "numpy": numpy_rate, "ratio": backend / numpy_rate, "share": share,
                               "driver_ms": driver_s * 1e3, "rest_ms": rest_s * 1e3})
    result["overhead"] = overhead(submissions, runs)
    result["per_row"] = per_row(runs)
    return result


def report(result: dict) -> None:
    runs = result["runs"]
    print(f"machine: {result['machine']}")
    print(f"round trip (publish + fetch) through the memory plugin, ~{result['total'] // MIB} MiB per submission, "
          f"median of {runs} runs; GiB/s of payload")
    print("baseline: plain numpy, np.copyto of the same bytes into a staging slab and back, same run")
    print("trace: ms inside the store driver's calls (the copies) and ms of the rest of the round trip")
    print(f"{'row':>8} {'rows':>5} {'backend':>9} {'numpy':>8} {'ratio':>7} {'publish share':>14} "
          f"{'in driver':>10} {'rest':>8}")
    for r in result["rows"]:
        print(f"{r['row']:>8} {r['count']:>5} {r['backend']:>9.2f} {r['numpy']:>8.2f} "
              f"{r['ratio']:>6.2f}x {r['share']:>13.0%} {r['driver_ms']:>10.2f} {r['rest_ms']:>8.2f}")
    print(f"\nper-submission overhead, one 4 KiB row, {result['submissions']} submissions, median of {runs} runs"
          " (CPU: the process's CPU time, all threads, for the same work)")
    for label, micros in result["overhead"].items():
        print(f"  {label:<40} {micros:8.1f} µs")
    print(f"\nper-row cost inside a submission (4 KiB rows, slope from 16 to 256 rows), median of {runs} runs")
    for label, micros in result["per_row"].items():
        note = " (the floor: the 4 KiB copy itself)" if label.startswith("numpy") else ""
        print(f"  {label:<40} {micros:8.2f} µs/row{note}")


def _tree_env(tree: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "src"), str(tree / "backends" / "memory" / "src")]))


def against(before: Path, rounds: int, quick: bool, after: Path | None = None) -> None:
    """Before and after side by side: this bench, run ``rounds`` times alternately on the tree at
    ``before`` (its ``src`` and ``backends/memory/src`` first on the path) and on the installed
    one (or the tree at ``after``), each in a fresh process; every figure is the median over the
    rounds of each side's medians. The same bench code measures both."""
    before = before.resolve()
    env_before = _tree_env(before)
    env_after = (_tree_env(after.resolve()) if after is not None
                 else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    sides: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(rounds):
        for side, env in (("before", env_before), ("after", env_after)):
            argv = [sys.executable, __file__, "--json", "-"] + (["--quick"] if quick else [])
            out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
            sides[side].append(json.loads(out))
    med = statistics.median
    first = sides["after"][0]
    print(f"machine: {first['machine']}")
    after_tree = after.resolve() if after is not None else Path(__file__).resolve().parent.parent
    print(f"before: {before} ({_commit(before)}); after: {after_tree} ({_commit(after_tree)})")
    print(f"{rounds} rounds, alternating before/after, each a fresh process running this bench"
          f"{' --quick' if quick else ''}; medians over the rounds\n")
    print(f"{'what':<48} {'before':>9} {'after':>9} {'after/before':>13}")
    for i, r in enumerate(first["rows"]):
        b, a = (med(x["rows"][i]["ratio"] for x in sides[s]) for s in ("before", "after"))
        print(f"{'round trip vs numpy, ' + r['row'] + ' rows':<48} {b:>8.2f}x {a:>8.2f}x {a / b:>12.2f}")
    for section, unit in (("overhead", "µs"), ("per_row", "µs/row")):
        for label in first[section]:
            b, a = (med(x[section][label] for x in sides[s]) for s in ("before", "after"))
            print(f"{(label + ' (' + unit + ')'):<48} {b:>9.2f} {a:>9.2f} {a / b:>12.2f}")


def _commit(tree: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h"], check=True,
                              capture_output=True, text=True).stdout.strip() + (
            " + uncommitted changes" if subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--",
                                                        "src", "backends/memory", "bench"],
                                                       capture_output=True, text=True).stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "not a git tree"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs and smaller submissions")
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON to FILE ('-': stdout) instead")
    parser.add_argument("--against", metavar="TREE", type=Path,
                        help="before/after: alternate this bench between the kvwire tree at TREE and this one")
    parser.add_argument("--after", metavar="TREE", type=Path,
                        help="with --against: the after side is the kvwire tree at TREE (default: the installed one)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --against (default 3)")
    parser.add_argument("--copy-threads", metavar="N,N", help="only the large-batch table: publish and fetch by "
                        "each of these copy_threads values side by side (e.g. 1,8)")
    parser.add_argument("--rows", default="64,256,1024,2048",
                        help="with --copy-threads: rows of 2 MiB per submission (default 64,256,1024,2048)")
    parser.add_argument("--runs", type=int, default=7, help="with --copy-threads: timed runs per value (default 7)")
    args = parser.parse_args()
    if args.copy_threads is not None:
        threads = [int(x) for x in args.copy_threads.split(",")]
        rows = by_copy_threads(threads, [int(x) for x in args.rows.split(",")], 2 * MIB, args.runs)
        report_by_copy_threads(threads, rows, 2 * MIB, args.runs)
        return
    if args.against is not None:
        against(args.against, args.rounds, args.quick, args.after)
        return
    result = measure(args.quick)
    if args.json is None:
        report(result)
    elif args.json == "-":
        json.dump(result, sys.stdout)
    else:
        Path(args.json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
