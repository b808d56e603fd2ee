"""Host staging slots, for backends that reach only host memory: one HOST region per layer
group, ``slots`` rows each (pinned memory when the pools are on a CUDA device). A lease takes row
indices first come, first served; the same index is one row of every group's staging region.

The copy methods never take the lender's lock: the rows they touch are pinned by the lease. They
copy through :mod:`kvwire.lender.blockcopy`, each group's pool a one-plane set and its staging
tensor the row buffer, rows picked by index on both sides."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvwire.contract import MemoryKind, SlotRegion
from kvwire.lender.blockcopy import PlaneSet, gather, scatter
from kvwire.lender.errors import StagingBusy
from kvwire.lender.layout import CacheLayout

__all__ = ["StagingArea"]


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
        self._plane_sets: dict[int, PlaneSet] = {}

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

    def _planes(self, pools: Sequence[torch.Tensor], g: int) -> PlaneSet:
        """Group ``g``'s pool as a one-plane set, made once (a pool is its lender's for good)."""
        planes = self._plane_sets.get(g)
        if planes is None or planes.planes[0] is not pools[g]:
            planes = self._plane_sets[g] = PlaneSet([pools[g]])
        return planes

    def copy_in(self, pools: Sequence[torch.Tensor], groups: Sequence[int], slots: Sequence[np.ndarray],
                rows: Sequence[np.ndarray]) -> torch.cuda.Event | None:
        """Pool -> staging: for each listed group, pool slots ``slots[k]`` into staging rows
        ``rows[k]``. On CUDA the copy runs on the staging stream after the current stream's work
        and the returned event completes with it; on the CPU it is done on return."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        event = None
        for g, s, r in zip(groups, slots, rows, strict=True):
            if s.size:
                event = gather(self._planes(pools, g), s, self.tensors[g], r, stream=self.stream)
        if self.stream is not None and event is None:
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def copy_out(self, pools: Sequence[torch.Tensor], groups: Sequence[int], slots: Sequence[np.ndarray],
                 rows: Sequence[np.ndarray]) -> None:
        """Staging -> pool, only the listed rows; done (visible to the current stream's later
        work, and the staging rows free to reuse) on return."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        event = None
        for g, s, r in zip(groups, slots, rows, strict=True):
            if s.size:
                event = scatter(self.tensors[g], r, self._planes(pools, g), s, stream=self.stream)
        if event is not None:
            event.synchronize()
