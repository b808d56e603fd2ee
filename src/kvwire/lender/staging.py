"""Host staging slots, for backends that reach only host memory: one HOST region per layer
group, ``slots`` rows each (pinned memory when the pools are on a CUDA device). A lease takes row
indices first come, first served; the same index is one row of every group's staging region.

The copy methods never take the lender's lock: the rows they touch are pinned by the lease."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvwire.contract import MemoryKind, SlotRegion
from kvwire.lender.errors import StagingBusy
from kvwire.lender.layout import CacheLayout

__all__ = ["StagingArea"]


def _index(array: np.ndarray) -> torch.Tensor:
    """An int64 index tensor over ``array`` (torch refuses to share a read-only buffer)."""
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _runs(index: np.ndarray) -> list[tuple[int, int, int]]:
    """``(first staging row, start, stop)`` for each run of consecutive values in ``index``."""
    if index.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(index) != 1) + 1
    starts = np.concatenate([[0], cuts])
    stops = np.concatenate([cuts, [index.size]])
    return [(int(index[a]), int(a), int(b)) for a, b in zip(starts, stops, strict=True)]


class StagingArea:
    """Staging rows and their regions. ``take``/``give`` assume the caller holds the lender's
    lock; rows taken stay the taker's until given back."""

    def __init__(self, layout: CacheLayout, slots: int, device: torch.device, region_id_base: int) -> None:
        self.slots = slots
        self.on_cuda = device.type == "cuda"
        self.tensors: tuple[torch.Tensor, ...] = tuple(
            torch.zeros((slots, *g.slot_shape), dtype=g.dtype, pin_memory=self.on_cuda) for g in layout.groups
        )
        self.regions: tuple[SlotRegion, ...] = tuple(
            SlotRegion(region_id_base + i, t.data_ptr(), g.slot_bytes, slots, MemoryKind.HOST)
            for i, (g, t) in enumerate(zip(layout.groups, self.tensors, strict=True))
        )
        self.free = np.ones(slots, dtype=bool)
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if self.on_cuda else None

    def available(self) -> int:
        return int(np.count_nonzero(self.free))

    def take(self, count: int) -> np.ndarray:
        """The lowest ``count`` free rows, now the caller's; :class:`StagingBusy` (taking none)
        when fewer are free."""
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        free = np.flatnonzero(self.free)
        if free.size < count:
            raise StagingBusy(
                f"a staged lease needs {count} staging slot(s) but {free.size} of {self.slots} are free; "
                "release staged leases first or build the lender with more staging_slots"
            )
        taken = free[:count].astype(np.int64)
        self.free[taken] = False
        return taken

    def give(self, rows: np.ndarray) -> None:
        if rows.size and self.free[rows].any():
            raise RuntimeError(f"staging rows {rows[self.free[rows]][:8].tolist()} were given back twice")
        self.free[rows] = True

    # -- copies ------------------------------------------------------------------------------

    def copy_in(self, pools: Sequence[torch.Tensor], groups: Sequence[int], slots: Sequence[np.ndarray],
                rows: Sequence[np.ndarray]) -> torch.cuda.Event | None:
        """Pool -> staging: for each listed group, pool slots ``slots[k]`` into staging rows
        ``rows[k]``. On CUDA the copy runs on the staging stream after the current stream's work
        and the returned event completes with it; on the CPU it is done on return."""
        if not self.on_cuda:
            for g, s, r in zip(groups, slots, rows, strict=True):
                if s.size:
                    self.tensors[g].index_copy_(0, _index(r), pools[g].index_select(0, _index(s)))
            return None
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for g, s, r in zip(groups, slots, rows, strict=True):
                if not s.size:
                    continue
                gathered = pools[g].index_select(0, _index(s).to(self.device, non_blocking=True))
                # A device -> pinned-host copy is asynchronous only into a contiguous span, so the
                # copy is one per run of consecutive staging rows (the allocator hands out the
                # lowest free rows, so runs are few).
                for first, a, b in _runs(r):
                    self.tensors[g][first:first + b - a].copy_(gathered[a:b], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def copy_out(self, pools: Sequence[torch.Tensor], groups: Sequence[int], slots: Sequence[np.ndarray],
                 rows: Sequence[np.ndarray]) -> None:
        """Staging -> pool, only the listed rows; done (visible to the current stream's later
        work, and the staging rows free to reuse) on return."""
        if not self.on_cuda:
            for g, s, r in zip(groups, slots, rows, strict=True):
                if s.size:
                    pools[g].index_copy_(0, _index(s), self.tensors[g].index_select(0, _index(r)))
            return
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for g, s, r in zip(groups, slots, rows, strict=True):
                if not s.size:
                    continue
                # One DMA of the span of staging rows the lease holds (no host gather); the
                # unmarked rows in it reach only this scratch copy, never the pool (A7).
                low, high = int(r.min()), int(r.max()) + 1
                span = self.tensors[g][low:high].to(self.device, non_blocking=True)
                picked = span.index_select(0, _index(r - low).to(self.device, non_blocking=True))
                pools[g].index_copy_(0, _index(s).to(self.device, non_blocking=True), picked)
            event = torch.cuda.Event()
            event.record(self.stream)
        event.synchronize()
