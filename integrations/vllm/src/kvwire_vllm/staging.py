"""Pinned host slots for a KV cache a backend cannot reach itself (CUDA memory, a host-only store),
a fixed pool recycled for every transfer. Imports no vLLM.

One slot holds one block across every layer and plane: a *row* of the cache
(:class:`~kvwire_vllm.kvcache.PagedCache`), and the pool is one HOST region of such slots, so a
staged block is one store object (group 0, the whole row). A save gathers vLLM's blocks into
slots and publishes the slots; a load fetches into slots and scatters the rows that arrived into
vLLM's blocks. Both copies are :mod:`kvwire.lender.blockcopy`'s, the one gather/scatter of every
device path, queued on the pool's own CUDA stream behind the work already queued on vLLM's
(the current) stream, so a gather reads a block only after the forward that computed it, and a
scatter writes a block only after every kernel that read its previous owner; each returns the
event its copy completes with, which the caller polls. Nothing here waits for the device.

The pool never grows: :meth:`take` hands out at most what is free, and the caller waits for slots
to come back (:mod:`kvwire_vllm.holder` says what waits how). Slots an attempt that never
quiesced may still touch are *kept*: out of use until :meth:`close`."""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvwire.contract import MemoryKind, SlotRegion
from kvwire.lender import blockcopy
from kvwire_vllm.kvcache import PagedCache

__all__ = ["StagingPool", "DEFAULT_STAGING_MIB"]

log = logging.getLogger(f"vllm.{__name__}")

#: Pinned host memory for staging slots when the connector's ``staging_mib`` is not given.
DEFAULT_STAGING_MIB = 1024


class StagingPool:
    """``slots`` rows of ``cache.row_bytes`` in (pinned, for a CUDA cache) host memory, one
    HOST :class:`SlotRegion` with id ``region_id``. Single-threaded: the worker's call sequence
    owns it."""

    def __init__(self, cache: PagedCache, slots: int, region_id: int = 0) -> None:
        if slots < 1:
            raise ValueError(f"a staging pool needs at least one slot, got {slots}")
        self.cache = cache
        self.planes = blockcopy.PlaneSet(cache.planes)
        self.slots = int(slots)
        self.rows: torch.Tensor | None = torch.zeros((self.slots, cache.row_bytes), dtype=torch.uint8,
                                                     pin_memory=cache.on_cuda)
        self.region = SlotRegion(region_id, self.rows.data_ptr(), cache.row_bytes, self.slots, MemoryKind.HOST)
        self._free = np.ones(self.slots, dtype=bool)
        self._kept = np.zeros(self.slots, dtype=bool)
        self.stream = torch.cuda.Stream(device=cache.device) if cache.on_cuda else None

    @classmethod
    def sized(cls, cache: PagedCache, mib: float) -> StagingPool:
        """A pool of ``mib`` MiB (at least one slot)."""
        return cls(cache, max(1, int(mib * (1 << 20)) // cache.row_bytes))

    @property
    def free(self) -> int:
        return int(np.count_nonzero(self._free))

    @property
    def kept(self) -> int:
        return int(np.count_nonzero(self._kept))

    @property
    def in_use(self) -> int:
        """Slots handed out and not given back (kept ones included)."""
        return self.slots - self.free

    def take(self, count: int) -> np.ndarray:
        """Up to ``count`` of the lowest free slots (so a transfer's slots are mostly one run),
        now the caller's; fewer, or none, when fewer are free."""
        if count <= 0:
            return np.zeros(0, dtype=np.int64)
        taken = np.flatnonzero(self._free)[:count].astype(np.int64)
        self._free[taken] = False
        return taken

    def give(self, slots: np.ndarray) -> None:
        """Slots back to the pool; giving one back twice is a bug and raises."""
        if slots.size and self._free[slots].any():
            raise RuntimeError(f"staging slots {slots[self._free[slots]][:8].tolist()} were given back twice")
        self._free[slots] = True

    def keep(self, slots: np.ndarray) -> None:
        """Slots an attempt that never quiesced may still touch: never handed out again."""
        self._kept[slots] = True

    def _ordered(self) -> None:
        """The pool's stream waits (on the device) for what vLLM's stream has queued so far."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.cache.device))

    def gather(self, block_ids: np.ndarray, slots: np.ndarray) -> torch.cuda.Event | None:
        """Slot ``slots[i]`` := vLLM's block ``block_ids[i]`` (every plane); the event its copy
        completes with (``None``: done, on the CPU). Raises before copying anything on bad input."""
        assert self.rows is not None, "the staging pool is closed"
        self._ordered()
        return blockcopy.gather(self.planes, block_ids, self.rows, slots, stream=self.stream)

    def scatter(self, slots: np.ndarray, block_ids: np.ndarray) -> torch.cuda.Event | None:
        """vLLM's block ``block_ids[i]`` := slot ``slots[i]``; the event its copy completes with."""
        assert self.rows is not None, "the staging pool is closed"
        self._ordered()
        return blockcopy.scatter(self.rows, slots, self.planes, block_ids, stream=self.stream)

    def close(self) -> None:
        """Let the pinned memory go: only once no attempt or copy can touch it. Idempotent."""
        if self.stream is not None:
            self.stream.synchronize()  # shutdown only: copies still queued read or write the rows
        self.rows = None
