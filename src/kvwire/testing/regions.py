"""Memory behind a :class:`SlotRegion` that the suite reads and writes itself, never through the
backend under test: the independent path every byte check goes through.

Each region is surrounded by guard bytes; a backend that writes outside the rows it was given
changes them, and :meth:`RegionMemory.guards_intact` says so."""

from __future__ import annotations

import abc
import itertools
from typing import Any

import numpy as np

from kvwire.contract import MemoryKind, SlotRegion

__all__ = ["RegionMemory", "HostMemory", "DeviceMemory", "fake_region", "next_region_id", "cuda_devices"]

#: Bytes of guard before and after each region, filled with :data:`GUARD_BYTE`.
GUARD = 64
GUARD_BYTE = 0xA5

_region_ids = itertools.count(1)


def next_region_id() -> int:
    """A region id no other region of this process uses."""
    return next(_region_ids)


def cuda_devices() -> tuple[int, ...]:
    """The CUDA device indices present, or none. Imports torch only when asked."""
    try:
        import torch
    except ImportError:
        return ()
    if not torch.cuda.is_available():
        return ()
    return tuple(range(torch.cuda.device_count()))


class RegionMemory(abc.ABC):
    """A region and the memory behind it, with guard bytes on both sides. The suite owns it: it
    stays allocated until the object is dropped, which the suite does only once no backend may
    touch it (S2)."""

    region: SlotRegion

    @abc.abstractmethod
    def read(self, slots: Any) -> np.ndarray:
        """A private copy of the given slots' bytes, shape ``(len(slots), slot_bytes)`` uint8."""

    @abc.abstractmethod
    def write(self, slots: Any, data: np.ndarray) -> None:
        """Write ``data`` (shape ``(len(slots), slot_bytes)`` uint8) into the given slots."""

    @abc.abstractmethod
    def guards_intact(self) -> bool:
        """Whether the bytes just before and just after the region are as allocated."""

    def read_all(self) -> np.ndarray:
        return self.read(np.arange(self.region.slot_count))

    def fill(self, slots: Any, value: int) -> None:
        """Write ``value`` into every byte of the given slots."""
        slots = np.asarray(slots, dtype=np.int64)
        self.write(slots, np.full((slots.size, self.region.slot_bytes), value, dtype=np.uint8))


class HostMemory(RegionMemory):
    """A HOST region over a numpy array; the suite reads it through that array."""

    def __init__(self, slot_bytes: int, slot_count: int, region_id: int | None = None) -> None:
        nbytes = slot_bytes * slot_count
        self._buffer = np.full(GUARD + nbytes + GUARD, GUARD_BYTE, dtype=np.uint8)
        self._rows = self._buffer[GUARD : GUARD + nbytes].reshape(slot_count, slot_bytes)
        self._rows[:] = 0
        base = int(self._buffer.ctypes.data) + GUARD
        rid = next_region_id() if region_id is None else region_id
        self.region = SlotRegion(rid, base, slot_bytes, slot_count, MemoryKind.HOST)

    def read(self, slots: Any) -> np.ndarray:
        return self._rows[np.asarray(slots, dtype=np.int64)].copy()

    def write(self, slots: Any, data: np.ndarray) -> None:
        self._rows[np.asarray(slots, dtype=np.int64)] = np.asarray(data, dtype=np.uint8)

    def guards_intact(self) -> bool:
        return bool((self._buffer[:GUARD] == GUARD_BYTE).all() and (self._buffer[-GUARD:] == GUARD_BYTE).all())


class DeviceMemory(RegionMemory):
    """A DEVICE region over a torch CUDA tensor; the suite reads it by copying to the host."""

    def __init__(self, slot_bytes: int, slot_count: int, device: int = 0, region_id: int | None = None) -> None:
        import torch

        nbytes = slot_bytes * slot_count
        self._torch = torch
        self._buffer = torch.full((GUARD + nbytes + GUARD,), GUARD_BYTE, dtype=torch.uint8, device=f"cuda:{device}")
        self._rows = self._buffer[GUARD : GUARD + nbytes].view(slot_count, slot_bytes)
        self._rows.zero_()
        torch.cuda.synchronize(device)
        base = int(self._buffer.data_ptr()) + GUARD
        rid = next_region_id() if region_id is None else region_id
        self.region = SlotRegion(rid, base, slot_bytes, slot_count, MemoryKind.DEVICE, device)

    def read(self, slots: Any) -> np.ndarray:
        index = self._torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self._rows.device)
        out: np.ndarray = self._rows.index_select(0, index).cpu().numpy().copy()
        return out

    def write(self, slots: Any, data: np.ndarray) -> None:
        index = self._torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self._rows.device)
        values = self._torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)).to(self._rows.device)
        self._rows.index_copy_(0, index, values)
        self._torch.cuda.synchronize(self._rows.device)

    def guards_intact(self) -> bool:
        head = self._buffer[:GUARD].cpu().numpy()
        tail = self._buffer[-GUARD:].cpu().numpy()
        return bool((head == GUARD_BYTE).all() and (tail == GUARD_BYTE).all())


def fake_region(kind: MemoryKind, slot_bytes: int = 64, slot_count: int = 4) -> SlotRegion:
    """A region at an address no one allocated, for submissions that must be refused before any
    byte is touched (an undeclared memory kind, an unregistered span)."""
    base = 0x7E00_0000_0000 + next_region_id() * 0x1_0000_0000
    device = 0 if kind is MemoryKind.DEVICE else None
    return SlotRegion(next_region_id(), base, slot_bytes, slot_count, kind, device)
