"""The one-sided row mover: one fetch's NIXL ``READ`` s of the served rows straight into the
rows it lent, a batch of block ranges at once (every range of a pull up to
:data:`~kvwire_ucx.protocol.requester.READ_RANGES_AT_ONCE`), rows adjacent on both sides merged
into one span.

The serving end names its rows as runs (rows adjacent there); this end cuts them again where its
own rows stop being adjacent. Both are found once per pull, in one pass over this end's rows
(:meth:`RangeReads.plan`); a batch's spans are then taken from them in steps over the spans
alone, never a step per row (a pull of 16384 rows planned row by row, range by range, cost
~0.3 ms on a two-core host).

NIXL reads one kind of memory into one kind per transfer, so a range whose groups lie in
different memories (host here and a GPU there, say) is read as one transfer per pair of
memories; the range is done when every one of them is, and failed when one fails."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvwire.contract import Cause
from kvwire_ucx.nixl import NixlAgent, NixlError, coalesce
from kvwire_ucx.protocol.events import ReadCompleted, ReadFailed, ReadStopped
from kvwire_ucx.regions import HOST, GroupRows

__all__ = ["RangeReads", "Spans"]

#: A batch's part: the memories (here, there) and the descriptor arrays of each side.
_Part = tuple[tuple[int, int], np.ndarray, np.ndarray]


def _cause(error: NixlError) -> Cause:
    return Cause.PEER_GONE if "Disconnect" in str(error) else Cause.FAULT


_NO_BREAKS = np.zeros(0, dtype=np.intp)


class Spans:
    """One group's first ``count`` rows, read from ``runs`` there (``(n, 2)`` uint64: address,
    rows), as spans of rows adjacent at both ends: each span's first row (``first``, ascending
    from 0), its address here (``here``) and there (``there``)."""

    __slots__ = ("first", "here", "there", "count", "slot")

    def __init__(self, group: GroupRows, count: int, runs: np.ndarray) -> None:
        slot = np.uint64(group.slot_bytes)
        self.count = count
        self.slot = slot
        if count == 0:
            self.first = np.zeros(0, dtype=np.int64)
            self.here = self.there = np.zeros(0, dtype=np.uint64)
            return
        offsets = group.offsets[:count]
        # (a row before its predecessor wraps around in the difference, and is a break as well;
        # rows known to lie one after another have none, and need no pass to say so)
        breaks_here = _NO_BREAKS if group.adjacent else np.flatnonzero(np.diff(offsets) != slot) + 1
        if len(runs) == 1 and not len(breaks_here):  # adjacent at both ends: one span
            self.first = np.zeros(1, dtype=np.int64)
            self.here = offsets[:1] + np.uint64(group.base)
            self.there = runs[:1, 0].copy()
            return
        lengths = runs[:, 1].astype(np.int64)
        run_first = np.cumsum(lengths) - lengths  # each run's first row (0 first)
        first = np.union1d(breaks_here, run_first) if len(breaks_here) else run_first
        run = np.searchsorted(run_first, first, side="right") - 1
        self.first = first
        self.here = offsets[first] + np.uint64(group.base)
        self.there = runs[run, 0] + (first - run_first[run]).astype(np.uint64) * slot

    def between(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The spans of rows ``[start, min(end, count))``: addresses here, there, and lengths in
        bytes (uint64); the first and last cut to the rows asked."""
        hi = min(end, self.count)
        if hi <= start:
            empty = np.zeros(0, dtype=np.uint64)
            return empty, empty, empty
        if len(self.first) == 1:
            skip = np.uint64(start) * self.slot
            return self.here + skip, self.there + skip, np.full(1, hi - start, dtype=np.uint64) * self.slot
        i0 = int(np.searchsorted(self.first, start, side="right")) - 1
        i1 = int(np.searchsorted(self.first, hi, side="left"))
        first = self.first[i0:i1].copy()
        skip = np.uint64(start - int(first[0])) * self.slot  # rows of the first span before start
        first[0] = start
        here, there = self.here[i0:i1].copy(), self.there[i0:i1].copy()
        here[0] += skip
        there[0] += skip
        ends = np.empty(len(first), dtype=np.int64)
        ends[:-1] = first[1:]
        ends[-1] = hi
        return here, there, (ends - first).astype(np.uint64) * self.slot


class RangeReads:
    """The planned ranges of one fetch and the reads in flight."""

    def __init__(self, nixl: NixlAgent, groups: tuple[GroupRows, ...], peer: str) -> None:
        self._nixl = nixl
        self._groups = groups
        self._peer = peer
        self.peer_agent = b""
        #: the offered rows at the peer, per group: runs (address of a run's first row, rows)
        self.remote: tuple[np.ndarray, ...] = ()
        self.remote_memories: tuple[int, ...] = ()  # where each group's rows lie there (empty: host)
        self._ranges: tuple[tuple[int, int], ...] = ()
        self._spans: list[Spans] = []
        self.handles: list[Any] = []
        self._failed: ReadFailed | None = None  # failed, but NIXL has not let go of every read yet

    def plan(self, counts: tuple[int, ...], ranges: tuple[tuple[int, int], ...]) -> None:
        """Every group's spans now (one pass over this end's rows); each batch of ranges takes
        its part of them when it starts."""
        self._ranges = ranges
        self._spans = [Spans(group, count, runs) for group, count, runs in zip(self._groups, counts, self.remote,
                                                                                strict=True)]

    def _descriptors(self, start: int, end: int) -> list[_Part]:
        """The reads of blocks ``[start, end)``: one per pair of memories, spans that continue
        from one group's rows to the next's (adjacent at both ends) joined."""
        there_memories = self.remote_memories or (HOST,) * len(self._groups)
        by_pair: dict[tuple[int, int], tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]] = {}
        for group, spans, memory in zip(self._groups, self._spans, there_memories, strict=True):
            here, there, lengths = spans.between(start, end)
            if not len(here):
                continue
            ours, theirs, sizes = by_pair.setdefault((group.memory, memory), ([], [], []))
            ours.append(here)
            theirs.append(there)
            sizes.append(lengths)
        parts = []
        for (here_memory, there_memory), (ours, theirs, sizes) in by_pair.items():
            if len(ours) == 1:  # one group's spans: adjacent at both ends already joined
                local, remote = np.empty((len(ours[0]), 3), np.uint64), np.empty((len(ours[0]), 3), np.uint64)
                local[:, 0], remote[:, 0] = ours[0], theirs[0]
                local[:, 1] = remote[:, 1] = sizes[0]
            else:
                local, remote = coalesce(np.concatenate(ours), np.concatenate(theirs), np.concatenate(sizes))
            local[:, 2] = max(here_memory, 0)  # NIXL's descriptor names the device (0 for host memory)
            remote[:, 2] = max(there_memory, 0)
            parts.append(((here_memory, there_memory), local, remote))
        return parts

    @property
    def running(self) -> bool:
        return bool(self.handles)

    def start(self, first: int, last: int) -> ReadCompleted | ReadFailed | None:
        """Start reading ranges ``[first, last)``, all at once: what happened already, or
        ``None`` while they run. One that cannot start lets go of those started."""
        pending: list[Any] = []
        for memories, local, remote in self._descriptors(self._ranges[first][0], self._ranges[last - 1][1]):
            try:
                handle, done = self._nixl.read(local, remote, self.peer_agent, memories)
            except NixlError as exc:
                self.handles = pending
                failed = ReadFailed(f"reading rows from {self._peer} failed: {exc}", _cause(exc), stopped=True)
                if pending and not self.release():
                    self._failed = failed
                    return ReadFailed(failed.reason, failed.cause, stopped=False)
                return failed
            if done:
                self._nixl.release(handle)
            else:
                pending.append(handle)
        self.handles = pending
        return None if pending else ReadCompleted()

    def poll(self) -> ReadCompleted | ReadFailed | ReadStopped | None:
        """What the reads in flight did since the last call, or ``None`` while they run."""
        if not self.handles:
            return None
        if self._failed is not None:
            return ReadStopped() if self.release() else None
        still: list[Any] = []
        for index, handle in enumerate(self.handles):
            try:
                finished = self._nixl.done(handle)
            except NixlError as exc:
                self.handles = still + self.handles[index:]
                stopped = self.release()
                failed = ReadFailed(f"reading rows from {self._peer} failed: {exc}", _cause(exc), stopped=stopped)
                if not stopped:
                    self._failed = failed
                return failed
            if finished:
                self._nixl.release(handle)
            else:
                still.append(handle)
        self.handles = still
        return None if still else ReadCompleted()

    def release(self) -> bool:
        """Let go of the reads in flight (NIXL cancels them); whether NIXL let go of all."""
        self.handles = [h for h in self.handles if not self._nixl.release(h)]
        return not self.handles
