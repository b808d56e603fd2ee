"""Block objects (K1) against one object per group and block, at a real model's KV geometry.

    .venv/bin/python bench/bench_blocks.py [--backends memory,mooncake,files] [--tokens 1024,4096,16384]
        [--layers 32] [--row-kib 16] [--repeats 5]

A prompt of ``tokens`` tokens is ``tokens / 16`` blocks; each block has one row of ``row-kib`` KiB
in each of ``layers`` groups (32 x 16 KiB: an 8B-class model's K and V of one layer for 16 tokens,
8 KV heads x 128 x 2 bytes x 2 x 16 / 2, per group). One backend publishes the prompt's rows from
one array per layer, another fetches them into other arrays, through the runtime's holder loop
(``bench/_waiting.py``): per group (``Hint.of("store")``, ``layers`` objects a block) and per
block (``blocks=block_layout(view)``, one object a block), alternating within each repeat, fresh
names every run. Each time runs from the submission until the attempt concluded and quiesced;
the figures are medians, with the per-block / per-group ratio of the times beside them (below 1:
block objects are faster) and a plain ``np.copyto`` of the same bytes for scale. Stores: the
in-process ``memory`` store; ``mooncake`` with a private master, both clients in this process
(the writer's segment holds the objects, so the reader's bytes cross loopback TCP); ``files`` in
a private root in /dev/shm."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from _waiting import Direction  # noqa: E402  (bench/ is on sys.path when a bench runs)

from kvwire.blob import BlobBackend
from kvwire.contract import (
    CacheKind,
    Hint,
    LayerGroupRows,
    MemoryKind,
    SlotRegion,
    TokenRange,
    View,
    block_layout,
)
from kvwire.holding import AtDeadline, Wakes, submit, wait
from kvwire.registry import load

BLOCK_TOKENS = 16
NAMESPACE = "bench-blocks"


class Prompt:
    """One array per layer of ``blocks`` rows, registered with a backend."""

    def __init__(self, backend: BlobBackend, layers: int, blocks: int, row: int, seed: int | None) -> None:
        rng = np.random.default_rng(seed)
        self.arrays = [rng.integers(0, 256, (blocks, row), dtype=np.uint8) if seed is not None
                       else np.zeros((blocks, row), dtype=np.uint8) for _ in range(layers)]
        self.regions = [SlotRegion(i, a.ctypes.data, row, blocks, MemoryKind.HOST) for i, a in enumerate(self.arrays)]
        self.registration = backend.register_regions(self.regions)

    def view(self, salt: int) -> View:
        blocks = self.regions[0].slot_count
        names = np.zeros((blocks, 16), dtype=np.uint8)
        names[:, :8] = (np.arange(blocks, dtype=np.uint64) + np.uint64(salt << 32)).astype("<u8").view(np.uint8).reshape(-1, 8)
        slots = np.arange(blocks)
        return View(tuple(LayerGroupRows(g, CacheKind.PAGED, r, slots, TokenRange(0, BLOCK_TOKENS * blocks), names)
                          for g, r in enumerate(self.regions)))


@contextlib.contextmanager
def backends(kind: str, data_bytes: int) -> Iterator[tuple[BlobBackend, BlobBackend, Callable[[], None]]]:
    """A writer and a reader on one store of ``kind`` with room for a run, and what empties it."""
    plugin = load(kind)
    options: dict[str, Any] = {"namespace": NAMESPACE, "timeout_s": 120.0}
    if kind == "memory":
        store = f"bench-{uuid.uuid4().hex[:8]}"
        options.update(store=store, capacity_bytes=2 * data_bytes + (64 << 20))
        writer, reader = plugin.build(options), plugin.build(options)
        from kvwire_memory import forget_store, named_store

        try:
            yield writer, reader, named_store(store, capacity_bytes=options["capacity_bytes"], eviction=True).clear
        finally:
            writer.close()
            reader.close()
            forget_store(store)
        return
    if kind == "mooncake":
        from kvwire_mooncake.master import MasterProcess

        with MasterProcess(lease_ttl_ms=5_000) as master:
            segment = max(64 << 20, 2 * data_bytes + (64 << 20))
            writer = plugin.build({**options, "master": master.address, "segment_bytes": segment})
            reader = plugin.build({**options, "master": master.address, "segment_bytes": 0})
            client = writer.driver.client  # type: ignore[attr-defined]
            try:
                yield writer, reader, lambda: client.remove_by_regex(f"^kvw1/{NAMESPACE}/", True)
            finally:
                writer.close()
                reader.close()
        return
    assert plugin.local_services is not None
    with plugin.local_services(plugin.resolve({})) as private:
        options.update(root=private["root"], capacity_bytes=2 * data_bytes + (64 << 20))
        writer, reader = plugin.build(options), plugin.build(options)
        try:
            yield writer, reader, lambda: None  # eviction makes room; the root goes afterwards
        finally:
            writer.close()
            reader.close()


def moved(backend: BlobBackend, op: Direction, view: View, hint: Hint, wakes: Wakes) -> str | None:
    """Move ``view`` through the runtime's holder loop; ``None`` when every row moved, else what
    went wrong (the bench goes on: a repeat that did not move everything is counted, not timed)."""
    outcome = wait(submit(backend, op, view, hint, wakes=wakes), 120.0, at_deadline=AtDeadline.RETURN).result()
    if outcome.is_delivered and all(m.all() for m in outcome.masks):
        return None
    return f"{op.value}: {outcome!r}"


def measure(kind: str, layers: int, blocks: int, row: int, repeats: int) -> dict[str, float]:
    """Median seconds of each publish and fetch, per group and per block, and of np.copyto; and
    how many repeats of each mode did not move every row."""
    data = layers * blocks * row
    times: dict[str, list[float]] = {k: [] for k in ("put_group", "get_group", "put_block", "get_block", "copy")}
    failed = {"group": 0, "block": 0}
    with backends(kind, data) as (writer, reader, empty):
        src = Prompt(writer, layers, blocks, row, seed=blocks)
        dst = Prompt(reader, layers, blocks, row, seed=None)
        wakes = Wakes()
        salt = iter(range(1, 1 << 30))
        whole = np.empty((layers, blocks, row), dtype=np.uint8)
        for repeat in range(repeats + 1):  # the first warms up
            for mode in ("group", "block"):
                s = next(salt)
                put_view, get_view = src.view(s), dst.view(s)
                hint = Hint.of("store", namespace=NAMESPACE)
                if mode == "block":
                    hint = Hint.of("store", namespace=NAMESPACE, blocks=block_layout(put_view))
                for array in dst.arrays:
                    array[:] = 0
                began = time.perf_counter()
                wrong = moved(writer, Direction.PUBLISH, put_view, hint, wakes)
                middle = time.perf_counter()
                wrong = wrong or moved(reader, Direction.FETCH, get_view, hint, wakes)
                ended = time.perf_counter()
                empty()
                if wrong:
                    failed[mode] += 1
                    print(f"# {kind} {blocks * BLOCK_TOKENS} tokens, per {mode}: {wrong[:300]}", file=sys.stderr)
                    continue
                assert all(np.array_equal(a, b) for a, b in zip(src.arrays, dst.arrays, strict=True))
                if repeat:
                    times[f"put_{mode}"].append(middle - began)
                    times[f"get_{mode}"].append(ended - middle)
            began = time.perf_counter()
            for layer, array in enumerate(src.arrays):
                np.copyto(whole[layer], array)
            if repeat:
                times["copy"].append(time.perf_counter() - began)
    medians = {k: statistics.median(v) if v else float("nan") for k, v in times.items()}
    return {**medians, "failed_group": failed["group"], "failed_block": failed["block"]}


def machine() -> str:
    load_avg = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.node()}: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
            f"Python {platform.python_version()}, numpy {np.__version__}, load average {load_avg}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="memory,mooncake,files")
    parser.add_argument("--tokens", default="1024,2048,4096,8192,16384")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--row-kib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    row = args.row_kib << 10
    print(f"# bench_blocks: {args.layers} layers x {args.row_kib} KiB rows, {BLOCK_TOKENS} tokens a block, "
          f"median of {args.repeats} (after one warm-up)")
    print(f"# {machine()}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print("# times in ms from submission to concluded and quiesced; ratio = per block / per group "
          "(below 1: block objects faster)")
    print(f"{'store':9} {'tokens':>6} {'MiB':>5} {'objects':>15} | {'publish':>8} {'publish':>8} {'ratio':>5} | "
          f"{'fetch':>8} {'fetch':>8} {'ratio':>5} | {'fetch':>6} {'copy':>6} | {'failed':>6}")
    print(f"{'':9} {'':>6} {'':>5} {'group / block':>15} | {'group':>8} {'block':>8} {'':>5} | "
          f"{'group':>8} {'block':>8} {'':>5} | {'GB/s':>6} {'GB/s':>6} | {'g / b':>6}")
    for kind in args.backends.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            blocks = tokens // BLOCK_TOKENS
            m = measure(kind, args.layers, blocks, row, args.repeats)
            data = args.layers * blocks * row
            failures = f"{m['failed_group']:.0f} / {m['failed_block']:.0f}"
            print(f"{kind:9} {tokens:>6} {data >> 20:>5} {f'{args.layers * blocks} / {blocks}':>15} | "
                  f"{m['put_group'] * 1e3:8.1f} {m['put_block'] * 1e3:8.1f} {m['put_block'] / m['put_group']:5.2f} | "
                  f"{m['get_group'] * 1e3:8.1f} {m['get_block'] * 1e3:8.1f} {m['get_block'] / m['get_group']:5.2f} | "
                  f"{data / m['get_block'] / 1e9:6.2f} {data / m['copy'] / 1e9:6.2f} | {failures:>6}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
