"""Helpers shared by the Mooncake backend's tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest

from kvwire.contract import MemoryKind, SlotRegion

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


