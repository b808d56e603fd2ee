"""Helpers shared by the Mooncake backend's tests."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import numpy as np
import pytest

from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View

T = TypeVar("T")

#: How long a call against a killed master may take (the client's RPC connect timeout ~4.3 s).
DEAD_MASTER_BOUND_S = 6.5


def wait_for(condition: Callable[[], T], timeout_s: float, what: str) -> T:
    """Poll ``condition`` until it is truthy; fail the test saying ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.1)


_probes = iter(range(1 << 62))


def until_serving(client: Any, timeout_s: float = 30.0) -> None:
    """Wait until ``client``'s master answers and holds the client's segment again (after a
    restart the client reconnects and remounts by itself): a probe put succeeds."""
    def serving() -> bool:
        return bool(client.health_check() == 0 and client.put(f"kvwire-test-probe/{next(_probes)}", b"probe") == 0)

    wait_for(serving, timeout_s, "the Mooncake client to be served by its master again")


class Rows:
    """A HOST region over a numpy array: what a lender would lend, read directly by the tests."""

    _ids = iter(range(1000, 1 << 30))

    def __init__(self, slot_bytes: int, slot_count: int) -> None:
        self.array = np.zeros((slot_count, slot_bytes), dtype=np.uint8)
        self.region = SlotRegion(next(self._ids), int(self.array.ctypes.data), slot_bytes, slot_count,
                                 MemoryKind.HOST)

    def fill_random(self, seed: int) -> np.ndarray:
        self.array[:] = np.random.default_rng(seed).integers(0, 256, self.array.shape, dtype=np.uint8)
        return self.array.copy()

    def addresses(self, slots: np.ndarray | list[int] | None = None) -> np.ndarray:
        slots = np.arange(self.region.slot_count) if slots is None else np.asarray(slots)
        return self.region.addresses(slots)

    def sizes(self, n: int | None = None) -> np.ndarray:
        return np.full(self.region.slot_count if n is None else n, self.region.slot_bytes, dtype=np.uint64)




_name_counter = iter(range(1 << 62))


def names_for(n: int, width: int = 16) -> np.ndarray:
    """``n`` content names no other test uses, shape ``(n, width)`` uint8."""
    rng = np.random.default_rng([time.monotonic_ns(), next(_name_counter)])
    return rng.integers(0, 256, (n, width), dtype=np.uint8)


def view_of(rows: Rows, names: np.ndarray, slots: np.ndarray | None = None, group: int = 0) -> View:
    """One PAGED group: the rows of ``slots`` (default the first ``len(names)``) named ``names``."""
    slots = np.arange(len(names)) if slots is None else slots
    return View((LayerGroupRows(group, CacheKind.PAGED, rows.region, slots, TokenRange(0, 16 * len(slots)), names),))


def fetch_in_child(conn: Connection, master: str, hint: bytes, slot_bytes: int, names: bytes) -> None:
    """Run in a spawned process: build the plugin against ``master``, fetch the named rows, and
    answer on ``conn`` with JSON: status, mask, reason, and the SHA-256 of each delivered row."""
    from kvwire.registry import load

    table = np.frombuffer(names, dtype=np.uint8).reshape(-1, 16)
    backend = load("mooncake").build({"master": master, "segment_bytes": 0, "setup_retries": 1, "timeout_s": 20.0})
    try:
        rows = Rows(slot_bytes, len(table))
        with backend.register_regions([rows.region]):
            woken = threading.Event()
            attempt = backend.fetch(view_of(rows, table), Hint.from_bytes(hint), woken.set)
            deadline = time.monotonic() + 30
            while not (attempt.poll() is not None and attempt.quiesced()) and time.monotonic() < deadline:
                woken.wait(0.05)
                woken.clear()
            outcome = attempt.poll()
            if outcome is None or not attempt.quiesced():
                answer = {"status": "hung", "mask": [], "reason": "no outcome within 30 s", "sha256": []}
            else:
                mask = outcome.masks[0]
                answer = {
                    "status": outcome.status.value,
                    "mask": mask.tolist(),
                    "reason": outcome.reason,
                    "sha256": [hashlib.sha256(row.tobytes()).hexdigest() for row in rows.array[mask]],
                }
        conn.send_bytes(json.dumps(answer).encode())
    finally:
        backend.close()
