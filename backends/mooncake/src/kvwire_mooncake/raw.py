"""The raw Mooncake transfer that a kvwire fetch stands on, for ``kvwire bench``
(``Plugin.extra["raw_bench"]``): the same rows moved by ``batch_get_into`` alone."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from kvwire.contract import MemoryKind, SlotRegion
from kvwire_mooncake.driver import MooncakeDriver
from kvwire_mooncake.master import MasterProcess
from kvwire_mooncake.options import ClientSettings

__all__ = ["raw_fetch_seconds"]


@contextlib.contextmanager
def _clients(settings: ClientSettings) -> Iterator[tuple[MooncakeDriver, MooncakeDriver]]:
    """A writer and a reader client, as two workers hold, against the configured master (or a
    private one); closed together afterwards (each close takes 1-2 s)."""
    with contextlib.ExitStack() as stack:
        if not settings.master:
            master = stack.enter_context(MasterProcess(lease_ttl_ms=10_000))
            settings = ClientSettings(**{**_fields(settings), "master": master.address})
        drivers: list[MooncakeDriver] = []
        try:
            drivers.append(MooncakeDriver.connect(settings))
            drivers.append(MooncakeDriver.connect(settings))
            yield drivers[0], drivers[1]
        finally:
            closers = [threading.Thread(target=d.close) for d in drivers]
            for closer in closers:
                closer.start()
            for closer in closers:
                closer.join()


def _fields(settings: ClientSettings) -> dict[str, Any]:
    return {name: getattr(settings, name) for name in settings.__slots__}  # type: ignore[attr-defined]


def raw_fetch_seconds(options: Mapping[str, Any], row_bytes: int, rows: int, repeat: int) -> float:
    """Median seconds of one ``batch_get_into`` of ``rows`` rows of ``row_bytes`` by one client,
    of objects another client stored (with ``batch_put_from``, untimed), after one warm-up."""
    settings = ClientSettings.from_options(options)
    rows = max(1, int(rows))
    src = np.random.default_rng(row_bytes).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    src_region = SlotRegion(1, src.ctypes.data, row_bytes, rows, MemoryKind.HOST)
    dst_region = SlotRegion(2, dst.ctypes.data, row_bytes, rows, MemoryKind.HOST)
    sizes = [row_bytes] * rows
    prefix = f"kvwire-raw-bench/{uuid.uuid4().hex}"
    times: list[float] = []
    with _clients(settings) as (writer, reader):
        writer.register([src_region])
        reader.register([dst_region])
        src_ptrs = src_region.addresses(np.arange(rows)).tolist()
        dst_ptrs = dst_region.addresses(np.arange(rows)).tolist()
        for run in range(max(1, repeat) + 1):
            keys = [f"{prefix}/{run}/{i}" for i in range(rows)]
            stored = writer.client.batch_put_from(keys, src_ptrs, sizes)
            if any(stored):
                raise RuntimeError(f"raw bench: batch_put_from answered {sorted(set(stored))}")
            started = time.perf_counter()
            got = reader.client.batch_get_into(keys, dst_ptrs, sizes)
            took = time.perf_counter() - started
            if got != sizes:
                raise RuntimeError(f"raw bench: batch_get_into answered {sorted(set(got))}")
            if run:
                times.append(took)
            writer.client.remove_by_regex(f"^{prefix}/{run}/", True)
        if not np.array_equal(src, dst):
            raise RuntimeError("raw bench: the fetched bytes differ from the stored ones")
    return statistics.median(times)
