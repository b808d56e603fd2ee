"""The regions a backend may touch (M3, M4) and the zero-copy numpy views over them."""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvwire.contract import InvalidSubmission, LayerGroupRows, MemoryKind, SlotRegion
from kvwire.contract.backend import Registration

__all__ = ["RegionTable", "RegionRegistration", "Span"]


@dataclass(frozen=True, slots=True, eq=False)
class Span:
    """One registered region and byte views over its memory: ``writable`` for receives,
    ``readable`` (read-only) for sends. The views borrow the memory; they never own it."""

    region: SlotRegion
    token: int
    writable: np.ndarray = field(repr=False)
    readable: np.ndarray = field(repr=False)


def _host_views(region: SlotRegion) -> tuple[np.ndarray, np.ndarray]:
    pointer = ctypes.cast(ctypes.c_void_p(region.base), ctypes.POINTER(ctypes.c_uint8))
    writable = np.ctypeslib.as_array(pointer, shape=(region.nbytes,))
    readable = writable.view()
    readable.flags.writeable = False
    return writable, readable


class RegionRegistration(Registration):
    """The regions one :meth:`RegionTable.register` call added; closing removes exactly them."""

    def __init__(self, table: RegionTable, token: int, regions: tuple[SlotRegion, ...]) -> None:
        self._table = table
        self._token = token
        self._regions = regions

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self._regions

    def close(self) -> None:
        self._table.unregister(self._token)


class RegionTable:
    """Registered spans, thread-safe. Overlap is refused, a batch is atomic, and unregistering
    removes only the spans of that one registration (so it never revokes a later one)."""

    def __init__(self, memory_kinds: frozenset[MemoryKind]) -> None:
        self._kinds = memory_kinds
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)

    def register(self, regions: Sequence[SlotRegion]) -> RegionRegistration:
        batch = tuple(regions)
        for region in batch:
            if not isinstance(region, SlotRegion):
                raise InvalidSubmission(f"register_regions takes SlotRegions, got {type(region).__name__}")
            if region.memory_kind not in self._kinds:
                kinds = ", ".join(sorted(k.value for k in self._kinds))
                raise InvalidSubmission(
                    f"region {region.region_id} is {region.memory_kind.value} memory; this backend reaches {kinds}"
                )
        for a, b in itertools.combinations(batch, 2):
            if a.overlaps(b):
                raise InvalidSubmission(f"regions {a.region_id} and {b.region_id} of one batch overlap")
        views = [_host_views(region) for region in batch]
        with self._lock:
            for region in batch:
                for span in self._spans:
                    if region.overlaps(span.region):
                        raise InvalidSubmission(
                            f"region {region.region_id} [{region.base:#x}, {region.end:#x}) overlaps registered "
                            f"region {span.region.region_id} [{span.region.base:#x}, {span.region.end:#x}); "
                            "close that registration first"
                        )
            token = next(self._tokens)
            self._spans.extend(Span(r, token, w, ro) for r, (w, ro) in zip(batch, views, strict=True))
        return RegionRegistration(self, token, batch)

    def unregister(self, token: int) -> None:
        with self._lock:
            self._spans = [s for s in self._spans if s.token != token]

    def locate(self, group: LayerGroupRows, index: int) -> tuple[Span | None, np.ndarray]:
        """The span holding every row of ``group`` and each row's byte offset in it (no span for
        a group without rows); raises ``InvalidSubmission`` naming the group if a row lies
        outside every registered span."""
        region = group.region
        if not group.rows:
            return None, np.zeros(0, dtype=np.int64)
        with self._lock:
            spans = list(self._spans)
        for span in spans:
            r = span.region
            if r.memory_kind is region.memory_kind and r.device == region.device:
                if r.base <= region.base and region.end <= r.end:
                    offsets = (region.base - r.base) + group.slots.astype(np.int64) * region.slot_bytes
                    return span, offsets
        addresses = group.addresses().astype(np.int64)
        for span in spans:
            r = span.region
            if r.memory_kind is not region.memory_kind or r.device != region.device:
                continue
            inside = (addresses >= r.base) & (addresses + region.slot_bytes <= r.end)
            if inside.all():
                return span, addresses - r.base
        raise InvalidSubmission(
            f"group {index} (id {group.group_id}) lends rows of region {region.region_id} "
            f"[{region.base:#x}, {region.end:#x}) that lie outside every registered region; "
            "register the region first (register_regions)"
        )
