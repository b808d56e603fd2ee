"""Mooncake plugin against the raw Mooncake zero-copy calls, on the same rows, in the same run.

    .venv/bin/python bench/bench_mooncake.py [--quick] [--total-mib N] [--runs N] [--check-existing]

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
default configuration against the same raw calls (kvwire then does one call more than raw)."""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

import numpy as np  # noqa: E402
from _waiting import Direction, Mover  # noqa: E402  (bench/ is on sys.path when a bench runs)
from kvwire_mooncake.master import MasterProcess  # noqa: E402

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
    args = parser.parse_args()
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
