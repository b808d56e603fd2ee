"""The one-sided row mover: one fetch's NIXL ``READ`` s of the served rows straight into the
rows it lent, block range by block range, rows adjacent on both sides merged into one span."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvwire.contract import Cause
from kvwire_ucx.nixl import NixlAgent, NixlError, coalesce
from kvwire_ucx.protocol.events import ReadCompleted, ReadFailed, ReadStopped
from kvwire_ucx.regions import GroupRows

__all__ = ["RangeReads"]


def _cause(error: NixlError) -> Cause:
    return Cause.PEER_GONE if "Disconnect" in str(error) else Cause.FAULT


class RangeReads:
    """The planned ranges of one fetch and the read in flight."""

    def __init__(self, nixl: NixlAgent, groups: tuple[GroupRows, ...], peer: str) -> None:
        self._nixl = nixl
        self._groups = groups
        self._peer = peer
        self.peer_agent = b""
        self.remote: tuple[np.ndarray, ...] = ()  # the offered rows' addresses at the peer
        self._plan: list[tuple[np.ndarray, np.ndarray]] = []
        self.handle: Any = None
        self._failed: ReadFailed | None = None  # failed, but NIXL has not let go of it yet

    def plan(self, counts: tuple[int, ...], ranges: tuple[tuple[int, int], ...]) -> None:
        """Every range's descriptors now: built between two 64 MiB reads, the same few numpy
        steps took ~0.15 ms each on a two-core host, against ~15 us up front."""
        self._plan = [self._descriptors(counts, start, end) for start, end in ranges]

    def _descriptors(self, counts: tuple[int, ...], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        local, remote, sizes = [], [], []
        for group, count, there in zip(self._groups, counts, self.remote, strict=True):
            hi = min(end, count)
            if hi <= start:
                continue
            assert group.span is not None
            base = group.span.__array_interface__["data"][0]
            local.append(group.offsets[start:hi] + np.uint64(base))
            remote.append(there[start:hi])
            sizes.append(np.full(hi - start, group.slot_bytes, dtype=np.uint64))
        if len(local) == 1:  # one group in the range (the usual pull of one layer group): nothing to join
            return coalesce(local[0], remote[0], sizes[0])
        return coalesce(np.concatenate(local), np.concatenate(remote), np.concatenate(sizes))

    @property
    def running(self) -> bool:
        return self.handle is not None

    def start(self, index: int) -> ReadCompleted | ReadFailed | None:
        """Start reading range ``index``: what happened already, or ``None`` while it runs."""
        local, remote = self._plan[index]
        try:
            self.handle, done = self._nixl.read(local, remote, self.peer_agent)
        except NixlError as exc:
            return ReadFailed(f"reading rows from {self._peer} failed: {exc}", _cause(exc), stopped=True)
        return self._finish() if done else None

    def _finish(self) -> ReadCompleted:
        self._nixl.release(self.handle)
        self.handle = None
        return ReadCompleted()

    def poll(self) -> ReadCompleted | ReadFailed | ReadStopped | None:
        """What the read in flight did since the last call, or ``None`` while it runs."""
        if self.handle is None:
            return None
        if self._failed is not None:
            return ReadStopped() if self.release() else None
        try:
            finished = self._nixl.done(self.handle)
        except NixlError as exc:
            stopped = self.release()
            failed = ReadFailed(f"reading rows from {self._peer} failed: {exc}", _cause(exc), stopped=stopped)
            if not stopped:
                self._failed = failed
            return failed
        return self._finish() if finished else None

    def release(self) -> bool:
        """Let go of the read in flight (NIXL cancels it); whether NIXL did."""
        if self.handle is not None and self._nixl.release(self.handle):
            self.handle = None
        return self.handle is None
