"""The UCX-specific part of registered memory: zero-copy numpy views over each region the
contract's :class:`~kvwire.contract.RegionTable` holds (M3/M4 are read there, once), and the
rows of a submission as this backend moves them (:class:`GroupRows`)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvwire.contract import InvalidSubmission, MemoryKind, RegionTable, SlotRegion, View
from kvwire.contract.backend import Registration

__all__ = ["HostRegions", "GroupRows"]


@dataclass(frozen=True, slots=True, eq=False)
class GroupRows:
    """One group's rows as this backend moves them: a byte view of the registered region that
    holds them (writable for receives, read-only for sends; ``None`` without rows) and each
    row's byte offset in it (read-only uint64)."""

    group_id: int
    slot_bytes: int
    span: np.ndarray | None = field(repr=False)
    offsets: np.ndarray = field(repr=False)


def _host_views(region: SlotRegion) -> tuple[np.ndarray, np.ndarray]:
    """Byte views over a host region's memory: they borrow it, never own it."""
    pointer = ctypes.cast(ctypes.c_void_p(region.base), ctypes.POINTER(ctypes.c_uint8))
    writable = np.ctypeslib.as_array(pointer, shape=(region.nbytes,))
    readable = writable.view()
    readable.flags.writeable = False
    return writable, readable


class _Registration(Registration):
    """The table's registration; closing it (once) also lets go of the views."""

    def __init__(self, owner: HostRegions, inner: Registration, token: int) -> None:
        self._owner = owner
        self._inner = inner
        self._token = token

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self._inner.regions

    def close(self) -> None:
        self._inner.close()
        self._owner._forget(self._token)


class HostRegions:
    """The regions registered with one backend (a :class:`RegionTable`) and their views."""

    def __init__(self, memory_kinds: frozenset[MemoryKind]) -> None:
        self.table = RegionTable(memory_kinds)
        self._views: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def register(self, regions: Sequence[SlotRegion]) -> Registration:
        registration = self.table.register(regions)
        token = registration.token
        views = {(token, r.base): _host_views(r) for r in registration.regions}
        with self._lock:
            self._views.update(views)
        return _Registration(self, registration, token)

    def _forget(self, token: int) -> None:
        with self._lock:
            for key in [k for k in self._views if k[0] == token]:
                del self._views[key]

    def locate(self, view: View, *, writable: bool, kinds: frozenset[MemoryKind]) -> tuple[GroupRows, ...]:
        """Every group's rows, located (M4: the whole view is refused if one row is not)."""
        out = []
        for index, group in enumerate(view.groups):
            if group.region.memory_kind not in kinds:
                raise InvalidSubmission(
                    f"group {index} lends {group.region.memory_kind.value} memory; kvwire-ucx here reaches host memory")
            located = self.table.locate(group, index)
            span = None
            if located.region is not None:
                with self._lock:
                    views = self._views.get((located.token, located.region.base))
                if views is None:  # closed between the lookup and here
                    raise InvalidSubmission(f"group {index} (id {group.group_id}) lends rows of a registration that "
                                            "was closed; register the region first (register_regions)")
                span = views[0] if writable else views[1]
            offsets = located.offsets.view(np.uint64)  # offsets are >= 0; the table made them for this call
            offsets.flags.writeable = False
            out.append(GroupRows(group.group_id, group.region.slot_bytes, span, offsets))
        return tuple(out)
