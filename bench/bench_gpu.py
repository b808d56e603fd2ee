"""Block copies on a CUDA device, each against the ceiling measured in the same run, ratios side by
side. Run on a machine with a GPU: ``python bench/bench_gpu.py [--out FILE] [--sweep]``.

Sections (each figure a median; ratio = ceiling time / kvwire time, so 1.0 is the ceiling):

- ``kernel``: ``kvwire.lender.blockcopy`` gather and scatter by a random block table between
  planes and device rows, against a contiguous device copy of the same bytes; chunks (block bytes
  per plane) 4 KiB-512 KiB, 1k-16k blocks, as many planes as make about 512 MiB. Beside it the
  torch fallback (int64 views). Goal (issue 33): >= 0.85x. ``--sweep`` also times the kernel's
  bytes per program and warps, and uses the best for the rest of the run.
- ``host``: a real KV shape (32 layers of FlashAttention's K/V halves, 8 KV heads x 128, bf16,
  block 16; rows of 2 MiB) gathered into pinned host rows and scattered back, 1k-32k tokens,
  against a pinned copy of the same bytes (the DMA ceiling); through the device scratch, and
  (``host-direct``, run last) with the kernel on host memory.
- ``staged``: the same shape saved (gather into pinned rows, publish them, one object a block)
  and loaded (fetch into pinned rows, scatter) through the ``memory`` and ``files`` backends,
  driven through ``kvwire.holding``; against the pinned-copy ceiling (goal >= 0.8x), with
  the steps' medians beside it. ``--copy-threads 1,8`` builds each store once per value of its
  ``copy_threads`` option (threads that copy one batch of 16 MiB or more) and runs the values side
  by side, round by round (column ``thr``); the default is the option's default.
- ``core``: the same shape saved and loaded as vLLM's worker does it, through the connector's
  ``WorkerCore`` (``integrations/vllm``) driven step by step with ``tests/vllm_core/core_driver.py``:
  the CUDA planes registered with a HOST-only store, so staged through the core's pinned pool in
  chunks of at most ``CHUNK_BYTES`` (``--chunk-mib``; ``--staging-mib`` sizes the pool), one
  chunk's gather overlapping another's publish; against the pinned copy of the same bytes. Beside
  it what bounds an overlapped save (load): the DMA alone, the store's copy of pinned rows alone,
  and both at once on two buffers (``bound`` = the DMA alone / both at once: the best ratio a save
  that overlaps the two perfectly can reach). Last, the memory store's plugin
  ``memory-device``, which takes the CUDA planes directly (no staging: one copy kernel a batch
  between the planes and the store's pinned objects).
- ``lender``: the lender's staging rows (a read lease's copy, a write lease's marked rows) and a
  device-to-device copy of pool rows by block table, against torch's copies of the same bytes."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch
from _waiting import Direction, Mover  # noqa: E402  (bench/ is on sys.path when a bench runs)

from kvwire.contract import Backend, CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View
from kvwire.lender import CacheLayout, GroupSpec, Lender, Scope, blockcopy
from kvwire.lender.blockcopy import PlaneSet, gather, scatter
from kvwire.registry import load

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
B = 16
LINES: list[str] = []
OUT: str | None = None


def say(line: str = "") -> None:
    """Prints a line and appends it to the --out file at once (a crash keeps what came before)."""
    print(line, flush=True)
    LINES.append(line)
    if OUT:
        with open(OUT, "a") as fh:
            fh.write(line + "\n")


def device_ms(fn: Callable[[], object], repeat: int, calls: int = 1) -> float:
    """Median milliseconds per call between CUDA events around ``calls`` calls of ``fn`` (host
    enqueue time included where the device waits for it), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def wall_s(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def random_fill(t: torch.Tensor, seed: int) -> None:
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    gen = torch.Generator(device=t.device).manual_seed(seed)
    raw.view(torch.int32)[:] = torch.randint(-(1 << 31), (1 << 31) - 1, (raw.numel() // 4,), dtype=torch.int32,
                                             device=t.device, generator=gen)


class impl_as:
    """Copies inside the block use ``name`` ("torch" or "triton")."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.saved = blockcopy._choose()
        if self.name == "torch":
            blockcopy._choice = (blockcopy._Impl.TORCH, "torch (bench)")

    def __exit__(self, *exc: object) -> None:
        blockcopy._choice = self.saved


# -- kernel: gather/scatter by block table vs a contiguous copy --------------------------------


CONFIGS = [(cb, w) for cb in (4096, 8192, 16384, 32768) for w in (4, 8)]


def kernel_section(repeat: int, sweep: bool) -> None:
    say("## gather / scatter by block table, device rows, vs a contiguous device copy of the same bytes")
    say(f"   kernel: {blockcopy.implementation()}; goal >= 0.85x")
    triton = blockcopy._choose()[0] is blockcopy._Impl.TRITON
    configs = CONFIGS if (sweep and triton) else [(blockcopy._CHUNK_BYTES, blockcopy._NUM_WARPS)]
    results: dict[tuple[int, int], list[tuple[float, float]]] = {c: [] for c in configs}
    rows = []
    for chunk in (4 * KIB, 16 * KIB, 64 * KIB, 512 * KIB):
        for blocks in (1024, 4096, 16384):
            planes_n = max(1, min(64, (512 * MIB) // (chunk * blocks)))
            pool = 2 * blocks
            planes = [torch.empty((pool, chunk // 2), dtype=torch.bfloat16, device="cuda") for _ in range(planes_n)]
            for k, p in enumerate(planes):
                random_fill(p, k)
            ps = PlaneSet(planes)
            ids = np.random.default_rng(blocks + chunk).permutation(pool)[:blocks]
            out = torch.empty((blocks, ps.row_bytes), dtype=torch.uint8, device="cuda")
            src = torch.empty_like(out)
            random_fill(src, 99)
            total = blocks * ps.row_bytes
            copy1 = device_ms(lambda out=out, src=src: out.copy_(src), repeat)
            copy5 = device_ms(lambda out=out, src=src: out.copy_(src), repeat, calls=5)
            for cb, w in configs:
                blockcopy._CHUNK_BYTES, blockcopy._NUM_WARPS = cb, w
                g5 = device_ms(lambda ps=ps, ids=ids, out=out: gather(ps, ids, out), repeat, calls=5)
                s5 = device_ms(lambda ps=ps, ids=ids, out=out: scatter(out, None, ps, ids), repeat, calls=5)
                results[(cb, w)].append((copy5 / g5, copy5 / s5))
            g1 = device_ms(lambda ps=ps, ids=ids, out=out: gather(ps, ids, out), repeat)
            s1 = device_ms(lambda ps=ps, ids=ids, out=out: scatter(out, None, ps, ids), repeat)
            kern = (float("nan"), float("nan"))
            if triton:  # the kernel alone: the block table already on the device
                pairs = torch.from_numpy(blockcopy._pairs(ids, None)).cuda()
                kern = tuple(device_ms(lambda ps=ps, pairs=pairs, out=out, d=d, n=blocks: blockcopy._launch(
                    ps, pairs, n, out.data_ptr(), d), repeat, calls=5) for d in (True, False))
            with impl_as("torch"):
                tg = device_ms(lambda ps=ps, ids=ids, out=out: gather(ps, ids, out), max(3, repeat // 3))
                ts = device_ms(lambda ps=ps, ids=ids, out=out: scatter(out, None, ps, ids), max(3, repeat // 3))
            expected = torch.cat([p[torch.as_tensor(ids, device="cuda")].view(torch.uint8) for p in planes], dim=1)
            gather(ps, ids, out)
            assert torch.equal(out, expected), "the gather's rows differ from torch's"
            rows.append((chunk, blocks, planes_n, total, copy1, copy5, g1, s1, kern, tg, ts))
            del planes, ps, out, src, expected
            torch.cuda.empty_cache()
    best = max(configs, key=lambda c: min(min(r) for r in results[c]))
    if len(configs) > 1:
        say("   sweep (bytes per program, warps): min / median ratio over the 12 shapes, 5 calls back to back, "
            "gather | scatter")
        for c in configs:
            gs = [r[0] for r in results[c]]
            ss = [r[1] for r in results[c]]
            mark = "  <- best (used below)" if c == best else ""
            say(f"     {c[0] >> 10:>3} KiB x {c[1]} warps: {min(gs):.2f} / {statistics.median(gs):.2f} | "
                f"{min(ss):.2f} / {statistics.median(ss):.2f}{mark}")
    blockcopy._CHUNK_BYTES, blockcopy._NUM_WARPS = best
    say(f"   {'chunk':>6} {'blocks':>6} {'planes':>6} {'bytes':>6} {'copy GB/s':>9} | {'one call':>8} {'':>5} |"
        f" {'5 in a row':>10} {'':>5} | {'kernel':>6} {'':>5} | {'torch-int64':>11} {'':>5}")
    say(f"   {'':>6} {'':>6} {'':>6} {'':>6} {'':>9} | {'gather':>8} {'scat.':>5} | {'gather':>10} {'scat.':>5} |"
        f" {'gather':>6} {'scat.':>5} | {'gather':>11} {'scat.':>5}")
    for (chunk, blocks, planes_n, total, copy1, copy5, g1, s1, kern, tg, ts), res in zip(
            rows, results[best], strict=True):
        say(f"   {chunk >> 10:>4}Ki {blocks:>6} {planes_n:>6} {total >> 20:>4}Mi {2 * total / copy1 / 1e6:>9.0f} |"
            f" {copy1 / g1:>8.2f} {copy1 / s1:>5.2f} | {res[0]:>10.2f} {res[1]:>5.2f} |"
            f" {copy5 / kern[0]:>6.2f} {copy5 / kern[1]:>5.2f} | {copy1 / tg:>11.2f} {copy1 / ts:>5.2f}")
    small = PlaneSet([torch.zeros((32768, 256), dtype=torch.bfloat16, device="cuda") for _ in range(2)])
    out = torch.empty((16384, small.row_bytes), dtype=torch.uint8, device="cuda")
    spent = []
    for n in (16, 16384):
        ids = np.random.default_rng(n).permutation(32768)[:n]
        gather(small, ids, out)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            gather(small, ids, out)
        spent.append((time.perf_counter() - t) / 100 * 1e6)
        torch.cuda.synchronize()
    say(f"   host time to enqueue one gather: {spent[0]:.0f} us with 16 block ids, {spent[1]:.0f} us with 16384")
    say("   (ratios to the copy of the same bytes: one call each, events around it, its enqueue included;")
    say("    5 calls in a row against 5 copies; the kernel alone, its block table already on the device;")
    say("    copy GB/s counts bytes read and written)")
    say()


# -- host: the real KV shape to and from pinned rows -------------------------------------------

LAYERS, HEADS, DIM = 32, 8, 128
TOKENS = (1024, 4096, 16384, 32768)


class KV:
    """A FlashAttention-layout cache of the real shape on the device, its plane set, pinned rows
    for the largest request, and a contiguous device buffer of the same bytes for the ceiling."""

    def __init__(self) -> None:
        most = max(TOKENS) // B
        self.pool = 2 * most
        self.layers = [torch.empty((2, self.pool, B, HEADS, DIM), dtype=torch.bfloat16, device="cuda")
                       for _ in range(LAYERS)]
        for k, t in enumerate(self.layers):
            random_fill(t, k)
        self.planes = PlaneSet([half for t in self.layers for half in (t[0], t[1])])
        self.row = self.planes.row_bytes
        self.rows = torch.empty((most, self.row), dtype=torch.uint8, pin_memory=True)
        self.flat = torch.empty((most, self.row), dtype=torch.uint8, device="cuda")
        random_fill(self.flat, 7)
        self.rng = np.random.default_rng(1)

    def table(self, n: int) -> np.ndarray:
        return self.rng.permutation(self.pool)[:n]

    def tables(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Two block tables of ``n`` blocks each, apart from each other."""
        perm = self.rng.permutation(self.pool)
        return perm[:n], perm[n:2 * n]


def host_section(kv: KV, repeat: int, direct: bool) -> None:
    mode = "the kernel on host memory" if direct else "device scratch, then DMA"
    say(f"## {'host-direct' if direct else 'host'}: {LAYERS} layers x K/V, {HEADS} heads x {DIM}, bf16, block {B} "
        f"({kv.row >> 20} MiB a row), to and from pinned rows ({mode}), vs a pinned copy of the same bytes")
    blockcopy._HOST_DIRECT = direct
    say(f"   {'tokens':>7} {'bytes':>7} {'d2h GB/s':>9} {'gather':>7} {'h2d GB/s':>9} {'scatter':>8}")
    try:
        for tokens in TOKENS:
            n = tokens // B
            ids = kv.table(n)
            rows, flat = kv.rows[:n], kv.flat[:n]
            d2h = device_ms(lambda rows=rows, flat=flat: rows.copy_(flat, non_blocking=True), repeat)
            g = device_ms(lambda ids=ids, rows=rows: gather(kv.planes, ids, rows), repeat)
            h2d = device_ms(lambda rows=rows, flat=flat: flat.copy_(rows, non_blocking=True), repeat)
            s = device_ms(lambda ids=ids, rows=rows: scatter(rows, None, kv.planes, ids), repeat)
            total = n * kv.row
            say(f"   {tokens:>7} {total >> 20:>5}Mi {total / d2h / 1e6:>9.1f} {d2h / g:>7.2f} {total / h2d / 1e6:>9.1f}"
                f" {h2d / s:>8.2f}")
    finally:
        blockcopy._HOST_DIRECT = False
    say()


# -- staged save and load through a store ------------------------------------------------------


def view_of(region: SlotRegion, n: int, salt: int) -> View:
    names = np.zeros((n, 16), dtype=np.uint8)
    names[:, :8] = (np.arange(n, dtype=np.uint64) + np.uint64(salt << 32)).astype("<u8").view(np.uint8).reshape(n, 8)
    names[:, 8:12] = np.frombuffer(uuid.uuid4().bytes[:4], dtype=np.uint8)
    return View((LayerGroupRows(0, CacheKind.PAGED, region, np.arange(n, dtype=np.int64), TokenRange(0, B * n),
                                names),))


def shm_root() -> str | None:
    """Where the files stores of a section live: /dev/shm when it has room, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 10 * GIB else None


def default_copy_threads() -> list[int]:
    return [next(o.default for o in load("memory").options if o.name == "copy_threads")]


class HostStores:
    """The memory and files stores a section builds, one per ``copy_threads`` value, and their
    clean-up: memory stores forgotten, files roots removed (``with HostStores(...) as stores:``)."""

    def __init__(self, capacity: int, shm: str | None) -> None:
        self.capacity, self.shm = capacity, shm
        self.roots: list[str] = []
        self.stores: list[str] = []
        self.built: list[Backend] = []

    def build(self, name: str, threads: int) -> Backend:
        name, _, chunk_mib = name.partition("@")  # "memory-device@64": its chunks of 64 MiB
        if chunk_mib:
            import kvwire_memory
            kvwire_memory.DEVICE_CHUNK_BYTES = int(float(chunk_mib) * MIB)
        if name.startswith("memory"):  # "memory-device": its own plugin (a pinned store, no staging)
            self.stores.append(f"bench-gpu-{uuid.uuid4().hex[:8]}")
            where = {"store": self.stores[-1]}
        else:
            self.roots.append(tempfile.mkdtemp(prefix="kvwire-bench-gpu-", dir=self.shm))
            where = {"root": self.roots[-1]}
        backend = load(name).build({**where, "capacity_bytes": self.capacity, "eviction": True, "timeout_s": 120.0,
                                    "copy_threads": threads})
        self.built.append(backend)
        return backend

    def __enter__(self) -> HostStores:
        return self

    def __exit__(self, *exc: object) -> None:
        from kvwire_memory import forget_store

        for backend in self.built:
            backend.close()
        for store in self.stores:
            forget_store(store)
        for root in self.roots:
            shutil.rmtree(root, ignore_errors=True)


def staged_section(kv: KV, repeat: int, copy_threads: list[int] | None = None) -> None:
    if copy_threads is None:
        copy_threads = default_copy_threads()
    say(f"## staged save / load, {LAYERS} layers x K/V, {HEADS} heads x {DIM}, bf16, block {B}: one object a block "
        f"({kv.row >> 20} MiB), vs a pinned copy of the same bytes; goal >= 0.8x")
    shm = shm_root()
    region = SlotRegion(0, kv.rows.data_ptr(), kv.row, kv.rows.shape[0], MemoryKind.HOST)
    capacity = 2 * kv.rows.shape[0] * kv.row
    say(f"   files root: under {shm or tempfile.gettempdir()} ({shutil.disk_usage(shm or tempfile.gettempdir()).free >> 30}"
        f" GiB free), one per copy_threads value; memory: kvwire_memory's store, one per value; copy_threads (thr):"
        f" {', '.join(map(str, copy_threads))}, values run side by side, round by round; {os.cpu_count()} CPUs")
    mover = Mover(timeout_s=120.0)
    hint = Hint.of("store")
    say(f"   {'store':>6} {'thr':>3} {'tokens':>6} {'bytes':>6} | {'save':>5} {'gather':>7} {'publish':>8} {'ceil ms':>8} | "
        f"{'load':>5} {'fetch':>7} {'scatter':>8} {'ceil ms':>8}")
    for name in ("memory", "files"):
        with HostStores(capacity, shm) as made:
            backends = {threads: made.build(name, threads) for threads in copy_threads}
            for backend in backends.values():
                backend.register_regions([region])
            staged_rows(kv, name, backends, region, mover, hint, repeat)
    say("   (save/load: ratio to the pinned copy; the other columns are milliseconds: gather = blocks into pinned")
    say("    rows, event waited; publish/fetch = the backend's attempt from submission until quiesced)")
    say()


def staged_rows(kv: KV, name: str, backends: dict, region: SlotRegion, mover: Mover, hint: Hint, repeat: int) -> None:
    """The staged rows of one store: per token count, rounds of every copy_threads value in turn."""
    salt = 1
    for tokens in TOKENS:
        n = tokens // B
        ids, back = kv.tables(n)
        rows, flat = kv.rows[:n], kv.flat[:n]
        all_steps: dict[int, dict[str, list[float]]] = {
            t: {k: [] for k in ("gather", "publish", "fetch", "scatter", "d2h", "h2d")} for t in backends}
        for rep in range(repeat + 1):
            for threads, backend in backends.items():
                steps = all_steps[threads]
                salt += 1
                view = view_of(region, n, salt)
                t0 = time.perf_counter()
                gather(kv.planes, ids, rows).synchronize()
                t1 = time.perf_counter()
                mover.move(backend, Direction.PUBLISH, view, hint)
                t2 = time.perf_counter()
                rows.zero_()
                t3 = time.perf_counter()
                mover.move(backend, Direction.FETCH, view, hint)
                t4 = time.perf_counter()
                scatter(rows, None, kv.planes, back).synchronize()
                t5 = time.perf_counter()
                d2h = wall_s(lambda rows=rows, flat=flat: rows.copy_(flat, non_blocking=True))
                h2d = wall_s(lambda rows=rows, flat=flat: flat.copy_(rows, non_blocking=True))
                if rep == 0:  # the first round warms up, and checks the bytes came back whole
                    for t in kv.layers[:2]:
                        idx, bk = torch.as_tensor(ids, device="cuda"), torch.as_tensor(back, device="cuda")
                        assert torch.equal(t[:, bk].view(torch.int16), t[:, idx].view(torch.int16))
                    continue
                for k, v in zip(steps, (t1 - t0, t2 - t1, t4 - t3, t5 - t4, d2h, h2d), strict=True):
                    steps[k].append(v)
        for threads, steps in all_steps.items():
            m = {k: statistics.median(v) * 1e3 for k, v in steps.items()}
            save, load_ms = m["gather"] + m["publish"], m["fetch"] + m["scatter"]
            say(f"   {name:>6} {threads:>3} {tokens:>6} {n * kv.row >> 20:>4}Mi | {m['d2h'] / save:>5.2f}"
                f" {m['gather']:>7.1f} {m['publish']:>8.1f} {m['d2h']:>8.1f} | {m['h2d'] / load_ms:>5.2f}"
                f" {m['fetch']:>7.1f} {m['scatter']:>8.1f} {m['h2d']:>8.1f}")


# -- the connector's worker core: chunked staging ---------------------------------------------


def core_section(kv: KV, repeat: int, copy_threads: list[int] | None, staging_mib: float | None,
                 chunk_mib: float | None, stores: tuple[str, ...] = ("memory", "files", "memory-device")) -> None:
    import importlib.util

    from kvwire_vllm import holder
    from kvwire_vllm.core import WorkerCore

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "vllm_core", "core_driver.py")
    spec = importlib.util.spec_from_file_location("core_driver", path)
    assert spec is not None and spec.loader is not None
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    if chunk_mib is not None:
        holder.CHUNK_BYTES = int(chunk_mib * MIB)
    if copy_threads is None:
        copy_threads = default_copy_threads()
    options = {} if staging_mib is None else {"staging_mib": staging_mib}
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    say(f"## core: the connector's WorkerCore, staged save / load as vLLM's worker drives it, {LAYERS} layers x K/V, "
        f"{HEADS} heads x {DIM}, bf16, block {B} ({kv.row >> 20} MiB a block), vs a pinned copy of the same bytes")
    shm = shm_root()
    capacity = 2 * kv.rows.shape[0] * kv.row
    spare = torch.empty(kv.rows.shape, dtype=torch.uint8, pin_memory=True)  # the DMA beside the store's copy
    for name in stores:
        direct = name.partition("@")[0] == "memory-device"
        # a pinned store of one save's bytes: each save evicts the last and reuses its memory (a
        # fresh pinned slab costs seconds), as a full store does in service
        with HostStores(capacity // 2 if direct else capacity, shm) as made:
            cores = {t: WorkerCore(made.build(name, t), layers=layers, block_size=B, namespace="bench", timeout_s=120.0,
                                   backend_name=name, **options) for t in (copy_threads[-1:] if direct else copy_threads)}
            bounds = None if direct else made.build(name, copy_threads[-1])
            try:
                for core in cores.values():
                    core.register_kv_caches(dict(zip(layers, kv.layers, strict=True)), kv.pool)
                pool = next(iter(cores.values())).pool
                if direct:
                    assert pool is None, "the core staged the planes for a store that takes CUDA memory"
                    say(f"   {name}: the CUDA planes registered directly with the memory store's plugin memory-device, "
                        "one object a block in pinned memory; no staging")
                else:
                    assert pool is not None, "the core registered the CUDA planes directly: nothing staged to measure"
                    say(f"   {name}: staged through {pool.slots} pinned slots ({pool.slots * kv.row >> 20} MiB), chunks"
                        f" of at most {holder.CHUNK_BYTES >> 20} MiB; copy_threads (thr) {', '.join(map(str, copy_threads))}")
                core_rows(kv, name, cores, driver, repeat, capacity // 2 if direct else capacity)
                if bounds is not None:
                    core_bounds(kv, name, bounds, spare, repeat, capacity)
            finally:
                for core in cores.values():
                    assert core.shutdown(timeout_s=60), core.state()
    say("   (save/load: ratio to the pinned copy, d2h/h2d of the same bytes in the same round; the milliseconds are")
    say("    wall clock from the step that starts it until the core reports it done and nothing of it is in flight;")
    say("    bounds: GB/s of the DMA alone, the store's copy of pinned rows alone (publish/fetch through the holder")
    say("    loop), and both at once on two buffers of the same size; bound = the DMA alone / both at once)")
    say()


def core_rows(kv: KV, name: str, cores: dict, driver: ModuleType, repeat: int, capacity: int) -> None:
    """Save then load through each core in turn, round by round. Untimed rounds first, enough to
    fill the store to ``capacity`` once, so the timed ones meet a store in service (full, each save
    evicting and reusing memory) rather than first fills of fresh pages (pinned ones cost seconds
    a GiB); the first round checks the bytes came back whole."""
    say(f"   {'store':>6} {'thr':>3} {'tokens':>6} {'bytes':>6} | {'save':>5} {'ms':>7} {'ceil ms':>8} | "
        f"{'load':>5} {'ms':>7} {'ceil ms':>8}")
    seed = 0
    for tokens in TOKENS:
        n = tokens // B
        ids, back = kv.tables(n)
        steps: dict[int, dict[str, list[float]]] = {t: {k: [] for k in ("save", "load", "d2h", "h2d")} for t in cores}
        warm = 1 + -(-capacity // (n * kv.row))
        for rep in range(repeat + warm):
            for threads, core in cores.items():
                seed += 1
                times = core_round(kv, core, driver, ids, back, seed)
                if rep == 0:
                    for t in kv.layers[:2]:
                        idx, bk = torch.as_tensor(ids, device="cuda"), torch.as_tensor(back, device="cuda")
                        assert torch.equal(t[:, bk].view(torch.int16), t[:, idx].view(torch.int16))
                if rep < warm:
                    continue
                for k, v in zip(("save", "load", "d2h", "h2d"), times, strict=True):
                    steps[threads][k].append(v)
        for threads, st in steps.items():
            m = {k: statistics.median(v) * 1e3 for k, v in st.items()}
            say(f"   {name:>6} {threads:>3} {tokens:>6} {n * kv.row >> 20:>4}Mi | {m['d2h'] / m['save']:>5.2f}"
                f" {m['save']:>7.1f} {m['d2h']:>8.1f} | {m['h2d'] / m['load']:>5.2f} {m['load']:>7.1f} {m['h2d']:>8.1f}")


def core_round(kv: KV, core: object, driver: ModuleType, ids: np.ndarray, back: np.ndarray,
               seed: int) -> tuple[float, float, float, float]:
    """Seconds of one save of blocks ``ids`` under fresh names, one load of them into ``back``,
    and the pinned copies of the same bytes each way."""
    names = driver.names(ids.size, seed)
    save = wall_s(lambda: driver.save(core, f"s{seed}", ids.tolist(), names))
    errors: set[int] = set()
    load_s = wall_s(lambda: errors.update(driver.load(core, f"l{seed}", back.tolist(), names)))
    assert not errors, f"{len(errors)} blocks did not load"
    rows, flat = kv.rows[:ids.size], kv.flat[:ids.size]
    d2h = wall_s(lambda: rows.copy_(flat, non_blocking=True))
    h2d = wall_s(lambda: flat.copy_(rows, non_blocking=True))
    return save, load_s, d2h, h2d


def both_s(dma: Callable[[], object], copy: Callable[[], object]) -> tuple[float, float, float]:
    """Seconds of the DMA (events around it), of the store's copy (wall clock) and of both, the
    DMA queued first and the copy started at once beside it."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    dma()
    end.record()
    copy()
    t1 = time.perf_counter()
    end.synchronize()
    t2 = time.perf_counter()
    return start.elapsed_time(end) / 1e3, t1 - t0, t2 - t0


def core_bounds(kv: KV, name: str, backend: Backend, spare: torch.Tensor, repeat: int, capacity: int) -> None:
    """What bounds an overlapped save (load) of each size through this store: the DMA, the store's
    copy of pinned rows, each alone and both at once (the DMA on ``spare``, the copy on ``kv.rows``).
    The store (``capacity`` bytes, its own) is filled once first, untimed, as :func:`core_rows`
    does: a publish into pages never written runs at the speed the kernel faults them in (0.6 GB/s
    on the 2-core VM against 18 GB/s into a store's reused memory), which is a first fill's cost
    and not the store's copy."""
    region = SlotRegion(0, kv.rows.data_ptr(), kv.row, kv.rows.shape[0], MemoryKind.HOST)
    backend.register_regions([region, SlotRegion(1, spare.data_ptr(), kv.row, spare.shape[0], MemoryKind.HOST)])
    mover, rows = Mover(timeout_s=120.0), kv.rows.shape[0]
    for salt in range(-(-capacity // (rows * kv.row)) + 1):
        mover.move(backend, Direction.PUBLISH, view_of(region, rows, 100 + salt), Hint.of("store"))
    say(f"   bounds, {name} store, GB/s: {'tokens':>6} | {'d2h':>5} {'publish':>7} | both: {'d2h':>5} {'publish':>7}"
        f" {'bound':>5} | {'h2d':>5} {'fetch':>7} | both: {'h2d':>5} {'fetch':>7} {'bound':>5}")
    for tokens in TOKENS:
        m = bound_medians(backend, region, spare[:tokens // B], kv.flat[:tokens // B], repeat)
        gbs = {k: tokens // B * kv.row / v / 1e9 for k, v in m.items()}
        say(f"   {'':>29} {tokens:>6} | {gbs['d2h0']:>5.1f} {gbs['publish0']:>7.1f} | {'':>5} {gbs['save0']:>5.1f}"
            f" {gbs['save1']:>7.1f} {m['d2h0'] / m['save2']:>5.2f} | {gbs['h2d0']:>5.1f} {gbs['fetch0']:>7.1f} |"
            f" {'':>5} {gbs['load0']:>5.1f} {gbs['load1']:>7.1f} {m['h2d0'] / m['load2']:>5.2f}")


def bound_medians(backend: Backend, region: SlotRegion, other: torch.Tensor, flat: torch.Tensor,
                  repeat: int) -> dict[str, float]:
    """Median seconds, rounds after a warm-up: ``d2h0``/``h2d0`` the DMA between ``flat`` and
    ``other``, ``publish0``/``fetch0`` the store's copy of as many rows of ``region``, and
    ``save0..2``/``load0..2`` (DMA, copy, both) for the two at once."""
    n = other.shape[0]
    mover, hint = Mover(timeout_s=120.0), Hint.of("store")
    view = view_of(region, n, 3)  # what the fetches read

    def publish() -> None:  # fresh names each time (view_of draws some)
        mover.move(backend, Direction.PUBLISH, view_of(region, n, 2), hint)

    def fetch() -> None:
        mover.move(backend, Direction.FETCH, view, hint)

    def d2h() -> None:
        other.copy_(flat, non_blocking=True)

    def h2d() -> None:
        flat.copy_(other, non_blocking=True)

    saving: dict[str, Callable[[], tuple[float, ...]]] = {
        "d2h": lambda: (wall_s(d2h),), "publish": lambda: (wall_s(publish),), "save": lambda: both_s(d2h, publish)}
    loading: dict[str, Callable[[], tuple[float, ...]]] = {
        "h2d": lambda: (wall_s(h2d),), "fetch": lambda: (wall_s(fetch),), "load": lambda: both_s(h2d, fetch)}
    got: dict[str, list[float]] = {}
    for rep in range(repeat + 1):
        for timed in (saving, loading):
            mover.move(backend, Direction.PUBLISH, view, hint)  # again where the publishes evicted some of it
            for key, fn in timed.items():
                for i, v in enumerate(fn()):
                    if rep:
                        got.setdefault(f"{key}{i}", []).append(v)
    return {k: statistics.median(v) for k, v in got.items()}


# -- the lender's staging ------------------------------------------------------------------------


def lender_case(row_bytes: int, blocks: int, repeat: int) -> list[tuple[str, int, float, float]]:
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
    out.append(("device->host (read lease, staging)", total, wall_median(d2h, repeat),
                wall_median(lambda: pinned.copy_(dev, non_blocking=True), repeat)))

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
        h2d_s = wall_median(h2d, repeat)
    except Exception as exc:  # a lender that refuses re-filling valid rows: measure once
        print(f"  (host->device re-lend refused: {exc}; measured on fresh requests)", file=sys.stderr)
        h2d_s = float("nan")
    out.append(("host->device (write lease, marked rows)", total, h2d_s,
                wall_median(lambda: dst.copy_(pinned, non_blocking=True), repeat)))

    table_a = np.array(req_a.block_table[:blocks])
    table_b = np.array(req_b.block_table[:blocks])
    pool_a = PlaneSet([a.pool(0)])
    out.append(("device->device (pool rows by block table)", total,
                wall_median(lambda: gather(pool_a, table_a, b.pool(0), table_b), repeat),
                wall_median(lambda: dst.copy_(dev), repeat)))
    a.close_request(req_a)
    b.close_request(req_b)
    return out


def wall_median(fn: Callable[[], object], repeat: int) -> float:
    fn()
    return statistics.median(wall_s(fn) for _ in range(repeat))


def lender_section(repeat: int) -> None:
    say("## the lender's staging (kvwire.lender, one layer group), vs torch's copy of the same bytes")
    say(f"   {'path':44} {'row':>8} {'total':>9} {'kvwire GB/s':>12} {'ceiling GB/s':>13} {'ratio':>6}")
    for row in (256 * KIB, 1 * MIB, 4 * MIB):
        blocks = max(16, (512 * MIB) // row)
        for name, total, ours, ceiling in lender_case(row, blocks, repeat):
            g_ours, g_ceil = total / ours / 1e9, total / ceiling / 1e9
            say(f"   {name:44} {row >> 10:>6}Ki {total >> 20:>7}Mi {g_ours:>12.1f} {g_ceil:>13.1f} {g_ours / g_ceil:>6.2f}")
    say()


def main() -> int:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="also write the report to this file (appended as it runs)")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tuning and use the best")
    parser.add_argument("--sections", default="kernel,host,staged,core,lender,host-direct")
    parser.add_argument("--copy-threads", metavar="N,N",
                        help="staged: the stores' copy_threads values, run side by side (default: the option's default)")
    parser.add_argument("--tokens", metavar="N,N", help="host/staged/core: token counts (default 1024,4096,16384,32768)")
    parser.add_argument("--chunk-mib", type=float, help="core: the connector's staging chunk (holder.CHUNK_BYTES; "
                        "default 256)")
    parser.add_argument("--stores", default="memory,files,memory-device",
                        help="core: the stores, in order (memory-device: the memory store's plugin for CUDA rows; "
                        "memory-device@64: with chunks of 64 MiB)")
    parser.add_argument("--staging-mib", type=float, help="core: the core's pinned staging pool (default: the "
                        "connector's, 1024)")
    args = parser.parse_args()
    global TOKENS
    if args.tokens:
        TOKENS = tuple(int(x) for x in args.tokens.split(","))
    copy_threads = [int(x) for x in args.copy_threads.split(",")] if args.copy_threads else None
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    OUT = args.out
    if OUT:
        open(OUT, "w").close()
    sections = args.sections.split(",")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    free, total = torch.cuda.mem_get_info()
    say(f"kvwire GPU block-copy bench · {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    say(f"machine: {torch.cuda.get_device_name()} ({total >> 30} GiB) · {os.cpu_count()} CPUs · {platform.node()} · "
        f"Python {platform.python_version()} · torch {torch.__version__} · CUDA {torch.version.cuda} · "
        f"triton {triton_version}")
    say(f"block copies: {blockcopy.implementation()} · scratch {blockcopy.SCRATCH_BYTES >> 20} MiB · "
        f"median of {args.repeat} · command: bench/bench_gpu.py {' '.join(sys.argv[1:])}")
    say()
    failed = 0

    def run(name: str, fn: Callable[[], None]) -> None:
        nonlocal failed
        if name not in sections:
            return
        try:
            fn()
        except Exception:  # one section's failure is reported, and the others still run
            failed += 1
            say(f"!! section {name} failed:")
            for line in traceback.format_exc().splitlines():
                say(f"!!   {line}")
            say()

    run("kernel", lambda: kernel_section(args.repeat, args.sweep))
    kv = KV() if {"host", "staged", "core", "host-direct"} & set(sections) else None
    if kv is not None:
        run("host", lambda: host_section(kv, args.repeat, direct=False))
        run("staged", lambda: staged_section(kv, max(3, args.repeat // 2), copy_threads))
        run("core", lambda: core_section(kv, max(3, args.repeat // 2), copy_threads, args.staging_mib,
                                         args.chunk_mib, tuple(args.stores.split(","))))
    run("lender", lambda: lender_section(args.repeat))
    if kv is not None and blockcopy._choose()[0] is blockcopy._Impl.TRITON:
        run("host-direct", lambda: host_section(kv, args.repeat, direct=True))
    elif "host-direct" in sections:
        say("## host-direct: needs the Triton kernel; not run")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
