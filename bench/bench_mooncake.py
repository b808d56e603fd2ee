"""Mooncake plugin against the raw Mooncake zero-copy calls, on the same rows, in the same run.

    .venv/bin/python bench/bench_mooncake.py [--quick] [--total-mib N] [--runs N] [--check-existing]
    .venv/bin/python bench/bench_mooncake.py --prompts [--shape tiny|32L-8x128|24L-2x64] [--per-layer]
                                             [--lengths 1024,...] [--runs N] [--variant NAME=JSON]
                                             [--engines [--schedulers N [--scheduler-options JSON]]]

``--prompts``: the store calls alone at the sizes a 1k..16k-token prompt of the tiny vLLM test
model moves (31..511 whole blocks, 2 layers x 16 KiB per block), kvwire (a publish and a fetch of
one view, a group per layer, through the plugin's backend: the calls kvwire-vllm makes) against
the raw store API called the way vLLM's ``MooncakeStoreConnector`` calls it (one key per block,
a buffer per layer: ``batch_is_exist`` then ``batch_put_from_multi_buffers``; one
``batch_get_into_multi_buffers``), side by side in one run, medians. The writer is this
process, the reader a spawned one; the segment is a third process's (``mooncake_client``), so
every byte of both paths crosses the transfer engine, or with ``--engines`` the writer's and the
reader's own (as two engines' workers hold them: part of each fetch is then a local copy).

Starts its own ``mooncake_master`` on free loopback ports (and stops it). A writer publishes
~64 MiB of rows (64 KiB ... 16 MiB each) and a reader fetches them into other memory:

- kvwire: ``publish`` on a backend built by ``kvwire.registry.load("mooncake")``, then ``fetch``
  on another, each timed from submission until the attempt has concluded and quiesced;
- raw: ``batch_put_from`` on the writer's client, then ``batch_get_into`` on the reader's, one
  call each, with keys and pointer lists built before the clock starts. The keys have kvwire's
  layout (``kvw1/<namespace>/g<group>/<name hex>``, each run its own names): Mooncake's cost per
  key grows with the key's length, and short made-up keys would flatter raw.

The writer's client contributes the store's only segment; the reader contributes none, so every
fetch crosses the transfer engine (loopback TCP), as a fetch by another worker does. "one
process": both clients in this process. "two processes": the reader in a spawned process (a
Mooncake client must not be forked). Each run uses fresh keys; the store is emptied between runs,
outside the clock. kvwire and raw alternate (which goes first alternates too), after one warm-up
run each. Rates are payload / median seconds; a ratio is the median over runs of raw seconds /
kvwire seconds, the two measured back to back. Bytes are checked after every run. Goal: kvwire
>= 0.9x raw.

Same calls on both sides: the plugin is built with ``check_existing=false`` unless
``--check-existing`` is given. With the plugin's default (true) its driver asks
``batch_is_exist`` before each ``batch_put_from``, one more master round trip per store call
(~0.1 ms for 16 keys, ~0.5 ms for 1024 here), to report keys already stored ``ALREADY_THERE``
and not put them again. Raw has no such step to match: Mooncake 0.3.13's ``batch_put_from``
answers ``0`` for a key that exists (it keeps the first object and moves no bytes), exactly as
for a new key, and a publish's outcome is the same either way (the row is held). So the default
comparison times the same Mooncake calls on both sides; ``--check-existing`` times the plugin's
default configuration against the same raw calls (kvwire then does one call more than raw).

Why one file of this size: both modes share the reader process and its pipe protocol, the byte
checks off the timed threads, the key layout and the master; split, each would import the
other's internals."""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import hashlib
import json
import multiprocessing
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

import numpy as np  # noqa: E402
from _waiting import Direction, Mover  # noqa: E402  (bench/ is on sys.path when a bench runs)
from kvwire_mooncake.master import MasterProcess, find_master_binary, free_port  # noqa: E402

from kvwire.blob import BlobBackend, store_keys  # noqa: E402
from kvwire.contract import (  # noqa: E402
    CacheKind,
    Hint,
    LayerGroupRows,
    MemoryKind,
    SlotRegion,
    TokenRange,
    View,
)
from kvwire.contract.blocks import block_layout  # noqa: E402
from kvwire.registry import load  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
HINT = Hint.of("store", namespace="bench")
WRITER_SEGMENT = 1 << 30


def region_of(array: np.ndarray, region_id: int) -> SlotRegion:
    return SlotRegion(region_id, array.ctypes.data, array.shape[1], array.shape[0], MemoryKind.HOST)


def names_of(rows: int, salt: int) -> np.ndarray:
    """16-byte content names of run ``salt``'s rows."""
    ids = np.arange(rows, dtype=np.uint64) + np.uint64(salt) * np.uint64(1 << 32)
    names = np.zeros((rows, 16), dtype=np.uint8)
    names[:, :8] = ids.astype("<u8").view(np.uint8).reshape(rows, 8)
    return names


def view_of(region: SlotRegion, rows: int, salt: int) -> View:
    return View((LayerGroupRows(0, CacheKind.PAGED, region, np.arange(rows), TokenRange(0, 16 * rows),
                                names_of(rows, salt)),))


def raw_keys(rows: int, salt: int) -> list[str]:
    """The keys kvwire stores run ``salt``'s rows under: Mooncake's cost per key grows with the
    key's length (1024 puts of 64 KiB: ~1.2 ms more with these 46-character keys than with
    'raw/<run>/<row>'), so raw gets keys as long as kvwire's."""
    return store_keys(HINT.get("namespace"), 0, names_of(rows, salt))


CHECK_EXISTING = False  # --check-existing: the plugin's default, one batch_is_exist more than raw per put


def build(master: str, segment_bytes: int) -> BlobBackend:
    backend = load("mooncake").build({"master": master, "segment_bytes": segment_bytes, "setup_retries": 1,
                                      "timeout_s": 60.0, "check_existing": CHECK_EXISTING})
    assert isinstance(backend, BlobBackend)
    return backend


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(array.data).hexdigest()


#: Zeroing the destination before a fetch and hashing it after run here, on neither side's
#: calling thread. On this 2-core machine a Mooncake call made right after its thread hashed
#: 64 MiB (~0.1 s of CPU) ran ~20-30% faster than the same call made from a thread that had been
#: waiting (measured: median 29 ms vs 36-42 ms for 64 MiB). Raw calls from the main thread and
#: kvwire from its worker thread, so checking bytes on the main thread favoured raw.
HOUSEKEEPER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-housekeeping")


def off_thread(work: Callable[[], Any]) -> Any:
    """Run ``work`` on the housekeeping thread and wait for it."""
    return HOUSEKEEPER.submit(work).result()


@dataclass
class Figures:
    """Seconds per run, by ``(path, op)``: path ``kvwire`` or ``raw``, op ``publish``/``fetch``."""

    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, path: str, publish_s: float, fetch_s: float) -> None:
        self.seconds.setdefault((path, "publish"), []).append(publish_s)
        self.seconds.setdefault((path, "fetch"), []).append(fetch_s)
        self.seconds.setdefault((path, "round trip"), []).append(publish_s + fetch_s)

    def median(self, path: str, op: str) -> float:
        return statistics.median(self.seconds[(path, op)])

    def paired_ratio(self, op: str) -> float:
        """Median over runs of raw seconds / kvwire seconds, the two measured back to back in
        each run: steadier than a ratio of medians when the machine's load drifts."""
        pairs = zip(self.seconds[("raw", op)], self.seconds[("kvwire", op)], strict=True)
        return statistics.median(raw / kv for raw, kv in pairs)


class Reader(Protocol):
    """Where fetches run: in this process, or in a spawned one driven over a pipe (JSON)."""

    def prepare(self, rows: int, row_bytes: int) -> None: ...
    def fetch(self, path: str, salt: int, expect: str) -> float: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


class LocalReader:
    def __init__(self, master: str) -> None:
        self.backend = build(master, 0)
        self.client = self.backend.driver.client  # type: ignore[attr-defined]
        self.mover = Mover()

    def prepare(self, rows: int, row_bytes: int) -> None:
        self.rows = rows
        self.dst = np.zeros((rows, row_bytes), dtype=np.uint8)
        self.region = region_of(self.dst, 2)
        self.registration = self.backend.register_regions([self.region])
        self.pointers = self.region.addresses(np.arange(rows)).tolist()
        self.sizes = [row_bytes] * rows

    def fetch(self, path: str, salt: int, expect: str) -> float:
        return fetch_once(self, path, salt, expect)

    def finish(self) -> None:
        self.registration.close()

    def close(self) -> None:
        self.backend.close()


def fetch_once(reader: Any, path: str, salt: int, expect: str) -> float:
    """Fetch run ``salt`` by ``path`` into ``reader.dst``; seconds, after checking the bytes."""
    off_thread(lambda: reader.dst.fill(0))
    if path == "kvwire":
        view = view_of(reader.region, reader.rows, salt)
        started = time.perf_counter()
        reader.mover.move(reader.backend, Direction.FETCH, view, HINT)
        took = time.perf_counter() - started
    else:
        keys = raw_keys(reader.rows, salt)
        started = time.perf_counter()
        got = reader.client.batch_get_into(keys, reader.pointers, reader.sizes)
        took = time.perf_counter() - started
        assert got == reader.sizes, f"raw batch_get_into answered {sorted(set(got))}"
    if off_thread(lambda: digest(reader.dst)) != expect:
        raise AssertionError(f"{path} fetch of run {salt}: the bytes differ from what was published")
    return took


def reader_process(conn: Connection, master: str) -> None:
    """The spawned reader: answers JSON commands on ``conn`` until told to exit."""
    reader = LocalReader(master)
    try:
        while True:
            command = json.loads(conn.recv_bytes())
            op = command["op"]
            if op == "prepare":
                reader.prepare(command["rows"], command["row_bytes"])
                answer: dict[str, Any] = {"ok": True}
            elif op == "fetch":
                try:
                    answer = {"ok": True, "seconds": reader.fetch(command["path"], command["salt"], command["expect"])}
                except AssertionError as exc:
                    answer = {"ok": False, "error": str(exc)}
            elif op == "finish":
                reader.finish()
                answer = {"ok": True}
            else:
                break
            conn.send_bytes(json.dumps(answer).encode())
    finally:
        reader.close()


class RemoteReader:
    def __init__(self, master: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.process = context.Process(target=reader_process, args=(child_end, master), daemon=True)
        self.process.start()

    def _ask(self, **command: Any) -> dict[str, Any]:
        self.conn.send_bytes(json.dumps(command).encode())
        if not self.conn.poll(120):
            raise TimeoutError(f"the reader process did not answer {command['op']!r} within 120 s")
        answer: dict[str, Any] = json.loads(self.conn.recv_bytes())
        if not answer["ok"]:
            raise AssertionError(answer.get("error"))
        return answer

    def prepare(self, rows: int, row_bytes: int) -> None:
        self._ask(op="prepare", rows=rows, row_bytes=row_bytes)

    def fetch(self, path: str, salt: int, expect: str) -> float:
        return float(self._ask(op="fetch", path=path, salt=salt, expect=expect)["seconds"])

    def finish(self) -> None:
        self._ask(op="finish")

    def close(self) -> None:
        try:
            self.conn.send_bytes(json.dumps({"op": "exit"}).encode())
        finally:
            self.process.join(30)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()


def measure(writer: BlobBackend, reader: Reader, row_bytes: int, total: int, runs: int,
            salts: Callable[[], int]) -> Figures:
    rows = max(2, total // row_bytes)
    src = np.random.default_rng(row_bytes).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    expect = digest(src)
    region = region_of(src, 1)
    registration = writer.register_regions([region])
    client = writer.driver.client  # type: ignore[attr-defined]
    pointers, sizes = region.addresses(np.arange(rows)).tolist(), [row_bytes] * rows
    mover = Mover()
    reader.prepare(rows, row_bytes)
    figures = Figures()

    def kvwire() -> tuple[float, float]:
        salt = salts()
        view = view_of(region, rows, salt)
        started = time.perf_counter()
        mover.move(writer, Direction.PUBLISH, view, HINT)
        publish_s = time.perf_counter() - started
        return publish_s, reader.fetch("kvwire", salt, expect)

    def raw() -> tuple[float, float]:
        salt = salts()
        keys = raw_keys(rows, salt)
        started = time.perf_counter()
        codes = client.batch_put_from(keys, pointers, sizes)
        publish_s = time.perf_counter() - started
        assert not any(codes), f"raw batch_put_from answered {sorted(set(codes))}"
        return publish_s, reader.fetch("raw", salt, expect)

    try:
        for run in range(runs + 1):
            order = (("kvwire", kvwire), ("raw", raw)) if run % 2 == 0 else (("raw", raw), ("kvwire", kvwire))
            for path, go in order:
                publish_s, fetch_s = go()
                client.remove_all(True)  # outside the clock: the next run stores into free space
                if run:  # run 0 of each warms up (page faults of the segment, connections)
                    figures.add(path, publish_s, fetch_s)
    finally:
        reader.finish()
        registration.close()
    return figures


# -- prompt sizes: kvwire against vLLM's MooncakeStoreConnector's way of calling the store ---------

BLOCK_TOKENS, LAYERS, LAYER_BLOCK_BYTES = 32, 2, 16 * KIB  # the tiny Llama of tests/vllm and bench_vllm
#: ``--shape``: the KV geometry of a block (layers, bytes of one layer's block at 32 tokens, bf16
#: for the real ones): the tiny test model's, an 8B-class model's, a 0.5B-class one's.
SHAPES = {"tiny": (2, 16 * KIB), "32L-8x128": (32, 128 * KIB), "24L-2x64": (24, 16 * KIB)}
#: kvwire stores a block's layers as one object (contract K1) where the store names block-objects;
#: ``--per-layer`` measures the object per block and layer instead.
BLOCK_OBJECTS = True


def set_shape(name: str, block_objects: bool) -> None:
    global LAYERS, LAYER_BLOCK_BYTES, BLOCK_OBJECTS
    LAYERS, LAYER_BLOCK_BYTES = SHAPES[name]
    BLOCK_OBJECTS = block_objects


def hint_for(view: View) -> Hint:
    return Hint.of("store", namespace="bench", blocks=block_layout(view)) if BLOCK_OBJECTS else HINT
PROMPTS = (1024, 2048, 4096, 8192, 16384)
HOLDER_SEGMENT = 1 << 30


def vllm_keys(blocks: int, salt: int) -> list[str]:
    """Keys as long as vLLM's ``PoolKey`` strings (model, namespace and ranks, then the block
    hash): one key per block, all layers in one object."""
    return [f"tiny-llama@tp_rank:0@pcp0@dcp0@pp_rank:0@{salt:032x}{b:032x}" for b in range(blocks)]


#: A --variant key that is no plugin option: the calls of one submission at once, overriding the
#: driver's ``chunks_at_once`` (null: as many as the backend's workers, as before issue 34's change).
AT_ONCE = "chunks_at_once"


class PromptSide:
    """One engine worker's side: a KV tensor per layer (``[num_blocks, 16 KiB]``, as vLLM's CPU
    cache lays out one layer), registered with a kvwire backend built by the plugin, whose
    Mooncake client also serves the raw calls (registered once, used by both)."""

    def __init__(self, master: str, num_blocks: int, options: dict[str, Any]) -> None:
        options = dict(options)
        at_once = options.pop(AT_ONCE, False)  # not a plugin option: the driver declares it
        self.backend = load("mooncake").build({"master": master, "segment_bytes": 0, "setup_retries": 1,
                                               "timeout_s": 60.0, **options})
        assert isinstance(self.backend, BlobBackend)
        if at_once is not False:  # the backend read it from its driver when built; this bench overrides it
            self.backend._chunks_at_once = at_once
        self.client = self.backend.driver.client  # type: ignore[attr-defined]
        self.caches = [np.zeros((num_blocks, LAYER_BLOCK_BYTES), dtype=np.uint8) for _ in range(LAYERS)]
        self.regions = [region_of(c, 10 + i) for i, c in enumerate(self.caches)]
        self.registration = self.backend.register_regions(self.regions)
        self.mover = Mover()

    def block_ids(self, blocks: int) -> np.ndarray:
        return np.arange(1, blocks + 1)  # block 0 is vLLM's null block

    def view(self, blocks: int, salt: int) -> View:
        ids = self.block_ids(blocks)
        names = names_of(blocks, salt)
        return View(tuple(LayerGroupRows(g, CacheKind.PAGED, self.regions[g], ids,
                                         TokenRange(0, BLOCK_TOKENS * blocks), names) for g in range(LAYERS)))

    def vllm_args(self, blocks: int, salt: int) -> tuple[list[str], list[list[int]], list[list[int]]]:
        """What vLLM's connector passes: per block one key, one pointer and size per layer."""
        addresses = np.stack([r.addresses(self.block_ids(blocks)) for r in self.regions], axis=1)
        return vllm_keys(blocks, salt), addresses.tolist(), [[LAYER_BLOCK_BYTES] * LAYERS] * blocks

    def driver_args(self, blocks: int, salt: int) -> tuple[list[str], np.ndarray, np.ndarray]:
        """What the blob backend hands its driver for the view: every group's keys, block by block
        (with block objects: a key per block, the addresses ``(blocks, layers)``, a size per layer)."""
        ids, names = self.block_ids(blocks), names_of(blocks, salt)
        if BLOCK_OBJECTS:
            keys = [f"kvw1/bench/blk/{n.tobytes().hex()}" for n in names]
            addresses = np.stack([r.addresses(ids) for r in self.regions], axis=1).astype(np.uint64)
            return keys, addresses, np.full(LAYERS, LAYER_BLOCK_BYTES, dtype=np.int64)
        keys = [k for pair in zip(*(store_keys(HINT.get("namespace"), g, names) for g in range(LAYERS)), strict=True)
                for k in pair]
        addresses = np.stack([r.addresses(ids) for r in self.regions], axis=1).reshape(-1).astype(np.uint64)
        return keys, addresses, np.full(blocks * LAYERS, LAYER_BLOCK_BYTES, dtype=np.uint64)

    def fill(self, blocks: int, salt: int) -> str:
        """New random bytes in the rows of ``blocks``; their digest."""
        rng = np.random.default_rng(salt)
        for cache in self.caches:
            cache[self.block_ids(blocks)] = rng.integers(0, 256, (blocks, LAYER_BLOCK_BYTES), dtype=np.uint8)
        return self.digest(blocks)

    def digest(self, blocks: int) -> str:
        ids = self.block_ids(blocks)
        return hashlib.sha256(b"".join(c[ids].tobytes() for c in self.caches)).hexdigest()

    def publish(self, path: str, blocks: int, salt: int) -> float:
        started = time.perf_counter()
        if path == "vllm":  # KVCacheStoreSendingThread: batch_is_exist, then put the missing ones
            keys, addresses, sizes = self.vllm_args(blocks, salt)
            started = time.perf_counter()
            exist = self.client.batch_is_exist(keys)
            todo = [i for i, e in enumerate(exist) if e != 1]
            codes = self.client.batch_put_from_multi_buffers(
                [keys[i] for i in todo], [addresses[i] for i in todo], [sizes[i] for i in todo])
            took = time.perf_counter() - started
            assert not any(codes), f"vllm-way put answered {sorted(set(codes))}"
            return took
        if path == "driver":  # kvwire's driver called directly, without the blob backend
            names, at, lengths = self.driver_args(blocks, salt)
            put = self.backend.driver.put_parts if BLOCK_OBJECTS else self.backend.driver.put
            started = time.perf_counter()
            result = put(names, at, lengths)
            took = time.perf_counter() - started
            assert not result.status.any(), result.first_reason()
            return took
        view = self.view(blocks, salt)
        self.mover.move(self.backend, Direction.PUBLISH, view, hint_for(view))
        return time.perf_counter() - started

    def fetch(self, path: str, blocks: int, salt: int, expect: str) -> float:
        off_thread(lambda: [c.__setitem__(slice(None), 0) for c in self.caches])
        if path == "vllm":  # KVCacheStoreRecvingThread: one batch_get_into_multi_buffers
            keys, addresses, sizes = self.vllm_args(blocks, salt)
            started = time.perf_counter()
            got = self.client.batch_get_into_multi_buffers(keys, addresses, sizes)
            took = time.perf_counter() - started
            assert got == [LAYER_BLOCK_BYTES * LAYERS] * blocks, f"vllm-way get answered {sorted(set(got))}"
        elif path == "driver":
            names, at, lengths = self.driver_args(blocks, salt)
            get = self.backend.driver.get_parts_into if BLOCK_OBJECTS else self.backend.driver.get_into
            started = time.perf_counter()
            result = get(names, at, lengths)
            took = time.perf_counter() - started
            assert not result.status.any(), result.first_reason()
        else:
            view = self.view(blocks, salt)
            hint = hint_for(view)
            started = time.perf_counter()
            self.mover.move(self.backend, Direction.FETCH, view, hint)
            took = time.perf_counter() - started
        if off_thread(lambda: self.digest(blocks)) != expect:
            raise AssertionError(f"{path} fetch of {blocks} blocks: the bytes differ from what was published")
        return took

    def close(self) -> None:
        self.registration.close()
        self.backend.close()


def prompt_reader_process(conn: Connection, master: str, num_blocks: int, variants: dict[str, Any],
                          shape: tuple[str, bool] = ("tiny", True)) -> None:
    """The spawned reader (engine B's worker): one side per variant, driven by JSON commands."""
    set_shape(*shape)  # a spawned process starts from the module's defaults
    sides = {name: PromptSide(master, num_blocks, options) for name, options in variants.items()}
    try:
        conn.send_bytes(b"{}")
        while True:
            command = json.loads(conn.recv_bytes())
            if command["op"] != "fetch":
                break
            try:
                side = sides[command["side"]]
                seconds = side.fetch(command["path"], command["blocks"], command["salt"], command["expect"])
                answer: dict[str, Any] = {"ok": True, "seconds": seconds}
            except AssertionError as exc:
                answer = {"ok": False, "error": str(exc)}
            conn.send_bytes(json.dumps(answer).encode())
    finally:
        for side in sides.values():
            side.close()


def start_holder(master: str) -> subprocess.Popen[bytes]:
    """A standalone ``mooncake_client`` contributing the store's only segment: every put and every
    get of both paths crosses the transfer engine (loopback TCP), as between engines whose
    objects live in a third process's memory."""
    binary = find_master_binary().with_name("mooncake_client")
    return subprocess.Popen([str(binary), "-host=127.0.0.1", "-metadata_server=P2PHANDSHAKE",
                             f"-master_server_address={master}", f"-global_segment_size={HOLDER_SEGMENT}",
                             f"-port={free_port()}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def prompts_main(runs: int, variants: dict[str, dict[str, Any]], lengths: tuple[int, ...], engines: bool = False,
                 schedulers: int = 0, scheduler_options: dict[str, Any] | None = None) -> None:
    """kvwire (each variant of plugin options) against vLLM's way, at each prompt length.
    ``engines``: no holder; the writer's and the reader's clients contribute the segments (256 MiB
    each), as two engines' workers do, so part of each fetch is local; plus ``schedulers``
    lookup-only kvwire backends (kvwire-vllm's scheduler sides) built with ``scheduler_options``,
    which register nothing."""
    if engines:
        if len(variants) != 1:
            raise SystemExit("--engines compares one kvwire column with vLLM's way (no --variant)")
        variants = {name: {"segment_bytes": 256 * MIB, **options} for name, options in variants.items()}
    blocks_of = {length: (length - 1) // BLOCK_TOKENS for length in lengths}  # B loads all but the last block
    num_blocks = max(blocks_of.values()) + 1
    paths = ["vllm", "driver", *variants]
    where = ("the segments in the writer's and the reader's clients (256 MiB each)"
             + (f", {schedulers} lookup-only backend(s) with options {scheduler_options or '(defaults)'}"
                if schedulers else "") if engines else "the segment in a third (a mooncake_client holder)")
    print(f"kvwire over Mooncake vs vLLM MooncakeStoreConnector's store calls, at the blocks a prompt moves "
          f"({LAYERS} layers x {LAYER_BLOCK_BYTES // KIB} KiB per block; kvwire "
          f"{'one object per block (K1)' if BLOCK_OBJECTS else 'one object per block and layer'}); "
          "writer and reader in two processes, "
          f"{where}; median ms of {runs} runs (after 1 warm-up); paths rotate order each run")
    for name, options in variants.items():
        print(f"  {name}: plugin options {options or '(defaults)'}")
    print("  driver: the first column's driver called directly with the keys and addresses its backend "
          "would pass (no blob backend, no worker thread)")
    print("  vllm: batch_is_exist + batch_put_from_multi_buffers (1 key per block, 1 buffer per layer); "
          "batch_get_into_multi_buffers")
    header = (f"{'prompt':>7} {'blocks':>6} {'op':<8} " + " ".join(f"{p:>14}" for p in paths)
              + "  vllm/each: " + " ".join(paths[1:]))
    print(header)
    counter = iter(range(1, 1 << 30))
    with MasterProcess(lease_ttl_ms=10_000) as master:
        holder = None if engines else start_holder(master.address)
        lookups = [load("mooncake").build({"master": master.address, "setup_retries": 1, **(scheduler_options or {})})
                   for _ in range(schedulers)]
        writers: dict[str, PromptSide] = {}
        context = multiprocessing.get_context("spawn")
        conn, child_end = context.Pipe()
        shape = next(name for name, geometry in SHAPES.items() if geometry == (LAYERS, LAYER_BLOCK_BYTES))
        reader = context.Process(target=prompt_reader_process,
                                 args=(child_end, master.address, num_blocks, variants, (shape, BLOCK_OBJECTS)),
                                 daemon=True)
        try:
            time.sleep(0.5)  # the holder mounts its segment
            writers = {name: PromptSide(master.address, num_blocks, options) for name, options in variants.items()}
            client = next(iter(writers.values())).client
            reader.start()
            if not conn.poll(120):
                raise TimeoutError("the reader process did not start within 120 s")
            conn.recv_bytes()
            for length in lengths:
                blocks = blocks_of[length]
                seconds: dict[tuple[str, str], list[float]] = {}
                for run in range(runs + 1):
                    shift = run % len(paths)
                    for path in paths[shift:] + paths[:shift]:
                        salt = next(counter)
                        side = writers[path] if path in variants else next(iter(writers.values()))
                        # off the timed thread, as the readers' checks (see HOUSEKEEPER): raw calls run here,
                        # kvwire's on a backend worker, and a thread that just hashed runs its next call faster
                        expect = off_thread(functools.partial(side.fill, blocks, salt))
                        publish_s = side.publish(path, blocks, salt)
                        conn.send_bytes(json.dumps({"op": "fetch", "side": path if path in variants
                                                    else next(iter(variants)), "path": path, "blocks": blocks, "salt": salt,
                                                    "expect": expect}).encode())
                        answer = json.loads(conn.recv_bytes())
                        if not answer["ok"]:
                            raise AssertionError(answer["error"])
                        client.remove_all(True)
                        if run:
                            seconds.setdefault((path, "publish"), []).append(publish_s)
                            seconds.setdefault((path, "fetch"), []).append(answer["seconds"])
                for op in ("publish", "fetch"):
                    medians = {p: statistics.median(seconds[(p, op)]) for p in paths}
                    ratio = " ".join(f"{medians['vllm'] / medians[p]:.2f}x" for p in paths[1:])
                    print(f"{length:>7} {blocks:>6} {op:<8} " + " ".join(f"{medians[p] * 1e3:>14.2f}" for p in paths)
                          + f"  {ratio}", flush=True)
        finally:
            if reader.is_alive():
                conn.send_bytes(json.dumps({"op": "exit"}).encode())
                reader.join(60)
            for side in writers.values():
                side.close()
            for backend in lookups:
                backend.close()
            if holder is not None:
                holder.terminate()
                holder.wait(10)
    print("vllm/each: vLLM's median seconds / that column's (above 1: faster than vLLM's way)")


def label(row_bytes: int) -> str:
    return f"{row_bytes // KIB} KiB" if row_bytes < MIB else f"{row_bytes // MIB} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs and row sizes")
    parser.add_argument("--total-mib", type=int, default=64, help="MiB per submission (default 64)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per figure (default 11, quick 3)")
    parser.add_argument("--check-existing", action="store_true",
                        help="build the plugin with check_existing=true, its default (a batch_is_exist before "
                             "each put, which raw does not do); without it both sides make the same calls")
    parser.add_argument("--prompts", action="store_true",
                        help="instead: kvwire against vLLM's MooncakeStoreConnector's store calls at the blocks a "
                             "1k..16k-token prompt moves (tiny Llama: 2 layers x 16 KiB per block)")
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny",
                        help="with --prompts: the block's KV geometry (default tiny: 2 layers x 16 KiB)")
    parser.add_argument("--per-layer", action="store_true",
                        help="with --prompts: kvwire stores an object per block and layer, not per block (K1)")
    parser.add_argument("--engines", action="store_true",
                        help="with --prompts: the segments in the writer's and reader's clients, as in two engines")
    parser.add_argument("--schedulers", type=int, default=0,
                        help="with --engines: this many lookup-only kvwire backends besides (scheduler sides)")
    parser.add_argument("--scheduler-options", default="{}", metavar="JSON",
                        help="with --schedulers: their plugin options, e.g. '{\"segment_when\": \"setup\"}'")
    parser.add_argument("--lengths", default=",".join(map(str, PROMPTS)), help="with --prompts: prompt lengths")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="with --prompts: another kvwire column, the plugin built with these options "
                             "(e.g. 'chunk4m={\"chunk_bytes\": 4194304}'); the column 'kvwire' has the defaults; "
                             "the key chunks_at_once (no plugin option) overrides the driver's, e.g. "
                             "'parallel={\"chunks_at_once\": null}'")
    args = parser.parse_args()
    if args.prompts:
        set_shape(args.shape, not args.per_layer)
        variants: dict[str, dict[str, Any]] = {"kvwire": {}}
        for text in args.variant:
            name, _, options = text.partition("=")
            variants[name] = json.loads(options)
        prompts_main(args.runs or 7, variants, tuple(int(x) for x in args.lengths.split(",")), args.engines,
                     args.schedulers, json.loads(args.scheduler_options))
        return
    global CHECK_EXISTING
    CHECK_EXISTING = args.check_existing
    runs = args.runs or (3 if args.quick else 11)
    total = args.total_mib * MIB
    row_sizes = (256 * KIB, 4 * MIB) if args.quick else (64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB)
    counter = iter(range(1, 1 << 30))

    print(f"kvwire over Mooncake vs raw batch_put_from / batch_get_into, ~{total // MIB} MiB per submission, "
          f"median of {runs} runs; GB/s of payload (1 GB = 1e9 bytes); check_existing={CHECK_EXISTING}")
    print(f"{'setting':<14} {'row':>7} {'rows':>5}  {'op':<10} {'raw':>7} {'kvwire':>7} {'ratio':>7}")
    ratios: list[float] = []
    by_op: dict[tuple[str, str], list[float]] = {}  # (setting, op) -> ratio per row size
    # Reads lease an object; a lease shorter than a transfer fails it (-707 LEASE_EXPIRED).
    with MasterProcess(lease_ttl_ms=10_000) as master:
        writer = build(master.address, WRITER_SEGMENT)
        try:
            readers: tuple[tuple[str, Callable[[str], Reader]], ...] = (
                ("one process", LocalReader), ("two processes", RemoteReader))
            for setting, make in readers:
                name = setting
                reader = make(master.address)
                try:
                    for row_bytes in row_sizes:
                        figures = measure(writer, reader, row_bytes, total, runs, lambda: next(counter))
                        rows = max(2, total // row_bytes)
                        payload = rows * row_bytes / 1e9
                        for op in ("publish", "fetch", "round trip"):
                            raw_rate = payload / figures.median("raw", op)
                            kv_rate = payload / figures.median("kvwire", op)
                            ratio = figures.paired_ratio(op)
                            by_op.setdefault((name, op), []).append(ratio)
                            if op == "round trip":
                                ratios.append(ratio)
                            first = op == "publish"
                            print(f"{setting if first else '':<14} {label(row_bytes) if first else '':>7} "
                                  f"{rows if first else '':>5}  {op:<10} {raw_rate:>7.2f} {kv_rate:>7.2f} "
                                  f"{ratio:>6.2f}x", flush=True)
                        setting = ""
                finally:
                    reader.close()
        finally:
            writer.close()
    print("\nkvwire / raw over the row sizes, median (worst):")
    for name, _ in readers:
        print(f"  {name:<14} " + ", ".join(
            f"{op} {statistics.median(by_op[(name, op)]):.2f}x ({min(by_op[(name, op)]):.2f}x)"
            for op in ("publish", "fetch", "round trip")))
    worst = min(ratios)
    print(f"round trip, kvwire / raw: median {statistics.median(ratios):.2f}x, worst {worst:.2f}x "
          f"(goal >= 0.90x): {'met' if worst >= 0.9 else 'NOT met'}")


if __name__ == "__main__":
    main()
