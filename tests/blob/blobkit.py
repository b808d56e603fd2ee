"""Test helpers for the blob backend: host memory slabs, views over them, and a wake that tests
can wait on (no sleeps: W1 promises a wake after every change)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvwire.contract import CacheKind, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View

_region_ids = iter(range(1, 1 << 30))


@dataclass
class Slab:
    """``rows`` slots of ``slot_bytes`` in a numpy array, and the region that names them."""

    array: np.ndarray
    region: SlotRegion

    @classmethod
    def make(cls, rows: int, slot_bytes: int, *, seed: int | None = None) -> Slab:
        if seed is None:
            array = np.zeros((rows, slot_bytes), dtype=np.uint8)
        else:
            array = np.random.default_rng(seed).integers(0, 256, (rows, slot_bytes), dtype=np.uint8)
        region = SlotRegion(next(_region_ids), array.ctypes.data, slot_bytes, rows, MemoryKind.HOST)
        return cls(array, region)


def names(ids: Sequence[int] | np.ndarray, width: int = 16, salt: int = 0) -> np.ndarray:
    """Distinct fixed-width content names for integer ids."""
    ids = np.asarray(ids, dtype=np.uint64) + np.uint64(salt) * np.uint64(1 << 32)
    out = np.zeros((ids.size, width), dtype=np.uint8)
    raw = ids.astype("<u8").view(np.uint8).reshape(-1, 8)
    out[:, : min(8, width)] = raw[:, : min(8, width)]
    out[:, -1] ^= 0xA5
    return out


def group(slab: Slab, slots: Sequence[int] | np.ndarray, ids: Sequence[int] | np.ndarray | None,
          gid: int = 0, width: int = 16) -> LayerGroupRows:
    slots = np.asarray(slots, dtype=np.int64)
    nm = None if ids is None else names(ids, width)
    return LayerGroupRows(gid, CacheKind.PAGED, slab.region, slots, TokenRange(0, 16 * max(1, slots.size)), nm)


def view(*groups: LayerGroupRows) -> View:
    return View(tuple(groups))


class Waker:
    """A wake function that counts calls and lets a test wait for a condition it changes."""

    def __init__(self, probe: Callable[[], object] | None = None) -> None:
        self.cond = threading.Condition()
        self.calls = 0
        self.probe = probe
        self.seen: list[object] = []

    def __call__(self) -> None:
        seen = self.probe() if self.probe is not None else None
        with self.cond:
            self.calls += 1
            self.seen.append(seen)
            self.cond.notify_all()

    def until(self, condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
        with self.cond:
            assert self.cond.wait_for(condition, timeout=timeout_s), "condition not reached in time"


def settle(attempt, waker: Waker, timeout_s: float = 5.0):  # type: ignore[no-untyped-def]
    """Wait until the attempt concluded and quiesced; its outcome."""
    waker.until(lambda: attempt.poll() is not None and attempt.quiesced(), timeout_s)
    return attempt.poll()
