"""Where a region's memory lies (M1) and what a region is (M2)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

__all__ = ["MemoryKind", "SlotRegion"]


class MemoryKind(enum.Enum):
    """``HOST`` is CPU-addressable memory; ``DEVICE`` is the GPU that holds the cache."""

    HOST = "host"
    DEVICE = "device"


@dataclass(frozen=True, slots=True)
class SlotRegion:
    """One contiguous span of ``slot_count`` equal slots of ``slot_bytes`` each, starting at the
    address ``base``. A row is one slot of one region. A ``DEVICE`` region names its device."""

    region_id: int
    base: int
    slot_bytes: int
    slot_count: int
    memory_kind: MemoryKind
    device: int | None = None

    def __post_init__(self) -> None:
        for field in ("region_id", "base", "slot_bytes", "slot_count"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"SlotRegion.{field} must be an int, got {type(value).__name__}")
            object.__setattr__(self, field, int(value))
        if self.region_id < 0:
            raise ValueError(f"SlotRegion.region_id must be >= 0, got {self.region_id}")
        if self.base <= 0:
            raise ValueError(f"SlotRegion.base must be a positive address, got {self.base}")
        if self.slot_bytes <= 0:
            raise ValueError(f"SlotRegion.slot_bytes must be > 0, got {self.slot_bytes}")
        if self.slot_count <= 0:
            raise ValueError(f"SlotRegion.slot_count must be > 0, got {self.slot_count}")
        if not isinstance(self.memory_kind, MemoryKind):
            raise TypeError(
                f"SlotRegion.memory_kind must be a MemoryKind, got {self.memory_kind!r}"
            )
        if self.memory_kind is MemoryKind.DEVICE:
            if self.device is None or int(self.device) < 0:
                raise ValueError("a DEVICE SlotRegion must name its device index (device >= 0)")
            object.__setattr__(self, "device", int(self.device))
        elif self.device is not None:
            raise ValueError("a HOST SlotRegion names no device; pass device=None")

    @property
    def nbytes(self) -> int:
        """The span's length in bytes."""
        return self.slot_bytes * self.slot_count

    @property
    def end(self) -> int:
        """One past the span's last byte."""
        return self.base + self.nbytes

    def overlaps(self, other: SlotRegion) -> bool:
        """Whether the two spans share a byte of the same memory (same kind and device)."""
        if self.memory_kind is not other.memory_kind or self.device != other.device:
            return False
        return self.base < other.end and other.base < self.end

    def addresses(self, slots: np.ndarray) -> np.ndarray:
        """The start address of each slot index in ``slots`` (uint64)."""
        return np.uint64(self.base) + np.asarray(slots, dtype=np.uint64) * np.uint64(self.slot_bytes)
