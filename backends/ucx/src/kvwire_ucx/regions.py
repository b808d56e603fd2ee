"""The UCX-specific part of registered memory: zero-copy views over each region the contract's
:class:`~kvwire.contract.RegionTable` holds (M3/M4 are read there, once), and the rows of a
submission as this backend moves them (:class:`GroupRows`). A host region's view is a numpy byte
array; a device region's is a :class:`DeviceBytes`, which UCX reads through the CUDA array
interface (ucxx hands its pointer to UCX, whose CUDA transports move it)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwire.contract import InvalidSubmission, MemoryKind, RegionTable, SlotRegion, View
from kvwire.contract.backend import Registration

__all__ = ["RegisteredRegions", "GroupRows", "DeviceBytes", "HOST", "RowRuns"]

#: ``GroupRows.memory`` of host memory (else the CUDA device index).
HOST = -1


class DeviceBytes:
    """Bytes of GPU memory at ``address`` (never owned): sliced like a byte array, and read by
    ucxx's ``Array`` through ``__cuda_array_interface__``."""

    __slots__ = ("address", "nbytes", "readonly")

    def __init__(self, address: int, nbytes: int, readonly: bool) -> None:
        self.address = address
        self.nbytes = nbytes
        self.readonly = readonly

    def __getitem__(self, part: slice) -> DeviceBytes:
        start, stop, step = part.indices(self.nbytes)
        if step != 1 or stop < start:
            raise ValueError("device bytes are sliced into contiguous spans only")
        return DeviceBytes(self.address + start, stop - start, self.readonly)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, self.readonly),
                "strides": None, "version": 3}


@dataclass(frozen=True, slots=True, eq=False)
class GroupRows:
    """One group's rows as this backend moves them: a byte view of the registered region that
    holds them (writable for receives, read-only for sends; ``None`` without rows), each row's
    byte offset in it (read-only uint64), the region's address (``base``, 0 without rows),
    where it lies (``memory``: :data:`HOST`, else the CUDA device index) and whether the rows lie
    one after another in row order (``adjacent``; ``False`` when not known)."""

    group_id: int
    slot_bytes: int
    span: np.ndarray | DeviceBytes | None = field(repr=False)
    offsets: np.ndarray = field(repr=False)
    base: int = 0
    memory: int = HOST
    adjacent: bool = False


class RowRuns:
    """Where a group's rows lie, as runs of rows adjacent in memory: ``runs`` an ``(n, 2)``
    uint64 array of (address of the run's first row, rows in it), in row order, and ``ends`` the
    rows up to each run's end. Made once (one pass over the rows), it gives the runs of any
    leading part of the rows in a few steps over the runs alone (:meth:`prefix`), as a
    one-sided answer names them. Read-only: :meth:`prefix` of every row gives ``runs`` itself."""

    __slots__ = ("runs", "ends", "_rows")

    def __init__(self, addresses: np.ndarray, slot_bytes: int) -> None:
        addresses = np.asarray(addresses, dtype=np.uint64)
        if not len(addresses):
            self.runs = np.zeros((0, 2), dtype=np.uint64)
        else:
            starts = np.flatnonzero(addresses[1:] != addresses[:-1] + np.uint64(slot_bytes)) + 1
            self.runs = np.empty((len(starts) + 1, 2), dtype=np.uint64)
            self.runs[0, 0] = addresses[0]
            self.runs[1:, 0] = addresses[starts]
            self.runs[:-1, 1] = starts
            self.runs[-1, 1] = len(addresses)
            self.runs[1:, 1] -= self.runs[:-1, 1].copy()
        self.runs.flags.writeable = False
        self.ends = np.cumsum(self.runs[:, 1])
        self._rows = len(addresses)

    @classmethod
    def of(cls, group: GroupRows, count: int) -> RowRuns:
        """The runs of ``group``'s first ``count`` rows."""
        if count == 0 or group.span is None:
            return cls(np.zeros(0, dtype=np.uint64), group.slot_bytes)
        return cls(group.offsets[:count] + np.uint64(group.base), group.slot_bytes)

    @property
    def rows(self) -> int:
        return self._rows

    def count(self, rows: int) -> int:
        """How many runs the first ``rows`` rows make."""
        return 0 if rows <= 0 else int(np.searchsorted(self.ends, rows)) + 1

    def prefix(self, rows: int) -> np.ndarray:
        """The runs of the first ``rows`` rows: a new array, or :attr:`runs` itself (read-only)
        when that is every row."""
        if rows >= self._rows:  # every row (the usual answer): no step at all
            return self.runs
        k = self.count(rows)
        out = self.runs[:k].copy()
        if k:
            out[-1, 1] -= self.ends[k - 1] - np.uint64(rows)
        return out


def _views(region: SlotRegion) -> tuple[np.ndarray | DeviceBytes, np.ndarray | DeviceBytes]:
    """Byte views (writable, read-only) over a region's memory: they borrow it, never own it."""
    if region.memory_kind is MemoryKind.DEVICE:
        return DeviceBytes(region.base, region.nbytes, False), DeviceBytes(region.base, region.nbytes, True)
    pointer = ctypes.cast(ctypes.c_void_p(region.base), ctypes.POINTER(ctypes.c_uint8))
    writable = np.ctypeslib.as_array(pointer, shape=(region.nbytes,))
    readable = writable.view()
    readable.flags.writeable = False
    return writable, readable


class _Registration(Registration):
    """The table's registration; closing it (once) also lets go of the views."""

    def __init__(self, owner: RegisteredRegions, inner: Registration, token: int) -> None:
        self._owner = owner
        self._inner = inner
        self._token = token

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self._inner.regions

    def close(self) -> None:
        self._inner.close()
        self._owner._forget(self._token)


class RegisteredRegions:
    """The regions registered with one backend (a :class:`RegionTable`) and their views."""

    def __init__(self, memory_kinds: frozenset[MemoryKind]) -> None:
        self.table = RegionTable(memory_kinds)
        self.memory_kinds = memory_kinds
        self._views: dict[tuple[int, int], tuple[np.ndarray | DeviceBytes, np.ndarray | DeviceBytes]] = {}
        self._lock = threading.Lock()
        self._device: int | None = None  # the one CUDA device this backend's regions lie on

    def register(self, regions: Sequence[SlotRegion]) -> Registration:
        devices = {r.device for r in regions if r.memory_kind is MemoryKind.DEVICE and r.device is not None}
        with self._lock:
            known = {self._device} if self._device is not None else set()
            if len(devices | known) > 1:
                raise InvalidSubmission(
                    f"kvwire-ucx moves the memory of one CUDA device per backend, and these regions would make "
                    f"it devices {sorted(devices | known)}; make one backend per device")
        registration = self.table.register(regions)
        token = registration.token
        if devices:
            with self._lock:
                self._device = devices.pop()
        views = {(token, r.base): _views(r) for r in registration.regions}
        with self._lock:
            self._views.update(views)
        return _Registration(self, registration, token)

    def _forget(self, token: int) -> None:
        with self._lock:
            for key in [k for k in self._views if k[0] == token]:
                del self._views[key]

    @property
    def device(self) -> int | None:
        """The CUDA device of the device regions registered so far, or ``None``."""
        return self._device

    def locate(self, view: View, *, writable: bool) -> tuple[GroupRows, ...]:
        """Every group's rows, located (M4: the whole view is refused if one row is not)."""
        out = []
        for index, group in enumerate(view.groups):
            if group.region.memory_kind not in self.memory_kinds:
                raise InvalidSubmission(
                    f"group {index} lends {group.region.memory_kind.value} memory; kvwire-ucx here reaches host "
                    "memory only (device memory needs a UCX with its CUDA transports, on a host with a GPU)")
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
            # offsets count from the registered region that holds the rows (the view's may be a part of it)
            base = located.region.base if located.region is not None else 0
            memory = HOST if group.region.device is None else group.region.device
            out.append(GroupRows(group.group_id, group.region.slot_bytes, span, offsets, base, memory,
                                 located.adjacent))

        return tuple(out)
