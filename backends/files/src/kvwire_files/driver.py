"""The file store driver: a :class:`~kvwire.blob.StoreDriver` over a :class:`FileStore`.

A put writes each row's bytes from host memory into an object file; a get reads an object file
straight into the row (``preadv`` on a view of the row's memory; no Python bytes on the way).
A block object (K1) is one entry of a pack holding a block's row of every group, one after
another: ``put_parts`` writes it with one ``writev`` iovec per part, ``get_parts_into`` reads it
with one ``preadv`` iovec per part. The driver checks that every address lies in a region
registered with it, so a wrong address is a ``ValueError`` rather than a read or write of memory
nobody lent."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

import numpy as np

from kvwire.blob import BatchResult, KeyStatus, StoreDriver, call_deadline
from kvwire.blob.parts import check_parts
from kvwire.contract import MemoryKind, SlotRegion
from kvwire_files import fs
from kvwire_files.store import FileStore, Memory

__all__ = ["FilesDriver"]

#: A wait for the store's lock ends this long after the attempt's deadline: the backend's
#: deadline thread concludes the attempt first (cause DEADLINE, not the lock's holder named as
#: a fault), and the call still returns well within the grace (2 s, the harness's).
PAST_DEADLINE_S = 0.2


def _lock_deadline() -> float | None:
    deadline = call_deadline()
    return None if deadline is None else deadline + PAST_DEADLINE_S


class FilesDriver(StoreDriver):
    """Reaches host memory only. Calls may come from several threads (and processes) at once."""

    memory_kinds = frozenset({MemoryKind.HOST})

    def __init__(self, store: FileStore, *, owns_store: bool = False) -> None:
        self.store = store
        self._owns_store = owns_store
        # A get takes no lock another process holds (kvwire_files.store). Asked with ``now`` it
        # waits for nothing but memory (on tmpfs every read is; on a disk, reads that would wait
        # for it give up at once), so a small one is tried inside the holder's call (A8.5 holds:
        # nothing it waits for can stall) and goes to a worker when it gives up. A put waits for
        # the store's lock: never inline. 256 KiB, not the memory store's 1 MiB: a read inside the
        # call cannot overlap the caller's own work. In vLLM at 2k tokens (1 MiB per layer) the
        # connector's time in its hooks was 0.6 ms more per request with 1 MiB than with reads
        # handed to the workers, which run beside the step's compute.
        self.inline_get_bytes = (256 << 10) if store.reads_without_waiting else 0
        self.inline_contains = store.reads_without_waiting
        self._lock = threading.Lock()
        self._spans: Counter[tuple[int, int]] = Counter()
        # Disjoint, sorted [start, end) spans and a byte view of each, replaced whole on every
        # change so calls read them without the lock.
        self._known: tuple[np.ndarray, np.ndarray, list[memoryview]] = (
            np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64), [])
        self._closed = False

    # -- regions -------------------------------------------------------------------------------

    def register(self, regions: Sequence[SlotRegion]) -> None:
        for region in regions:
            if region.memory_kind is not MemoryKind.HOST:
                raise RuntimeError(f"region {region.region_id} lies in {region.memory_kind.value} memory; the "
                                   "file store reaches host memory only")
        with self._lock:
            self._spans.update((r.base, r.end) for r in regions)
            self._rebuild()

    def unregister(self, regions: Sequence[SlotRegion]) -> None:
        with self._lock:
            for region in regions:
                span = (region.base, region.end)
                if self._spans[span] > 1:
                    self._spans[span] -= 1
                else:
                    self._spans.pop(span, None)
            self._rebuild()

    def _rebuild(self) -> None:
        starts: list[int] = []
        ends: list[int] = []
        for start, end in sorted(self._spans):
            if ends and start <= ends[-1]:
                ends[-1] = max(ends[-1], end)
            else:
                starts.append(start)
                ends.append(end)
        self._known = (np.array(starts, dtype=np.uint64), np.array(ends, dtype=np.uint64),
                       [fs.view(start, end - start) for start, end in zip(starts, ends, strict=True)])

    def _check(self, op: str, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> list[memoryview]:
        """A byte view of each key's memory (a slice of its region's view: no copy); a
        ``ValueError`` naming the key when its bytes lie in no registered region."""
        addresses = np.asarray(addresses, dtype=np.uint64)
        sizes = np.asarray(sizes, dtype=np.uint64)
        if not (len(keys) == addresses.size == sizes.size) or addresses.ndim != 1 or sizes.ndim != 1:
            raise ValueError(f"{op}: {len(keys)} keys, {addresses.size} addresses and {sizes.size} sizes; "
                             "give one of each per key")
        starts, ends, views = self._known
        if starts.size:
            span = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
            inside = (span >= 0) & (addresses + sizes <= ends[np.maximum(span, 0)])
        else:
            inside = np.zeros(addresses.size, dtype=bool)
        if not inside.all():
            i = int(np.argmin(inside))
            raise ValueError(f"{op}: key {keys[i]!r} names {int(sizes[i])} bytes at {int(addresses[i]):#x}, which "
                             "lie in no region registered with this driver; register the region first")
        if not addresses.size:
            return []
        span_of = span.tolist()
        lo = (addresses - starts[span]).tolist()
        return [views[s][a:a + z] for s, a, z in zip(span_of, lo, sizes.tolist(), strict=True)]

    # -- objects -------------------------------------------------------------------------------

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return self._put(keys, self._check("put", keys, addresses, sizes))

    def put_parts(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """Each block object written from its parts as one entry of the batch's pack."""
        return self._put(keys, self._check_parts("put_parts", keys, addresses, sizes))

    def _put(self, keys: Sequence[str], buffers: Sequence[Memory]) -> BatchResult:
        if self._closed:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "the file store driver is closed")
        try:
            status, reasons = self.store.write_from(list(keys), buffers, deadline=_lock_deadline())
        except OSError as exc:  # the index or the ledger cannot be read: nothing was stored
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, f"the file store at {self.store.root}: {exc}")
        if not reasons and all(s is KeyStatus.OK for s in status):
            return BatchResult.ok(len(keys))
        return BatchResult(np.array(status, dtype=np.uint8), reasons)

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        result = self._get(keys, addresses, sizes, now=False)
        assert result is not None
        return result

    def get_into_now(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult | None:
        """:meth:`get_into` from what is in memory, or ``None`` where it would wait (see
        :meth:`FileStore.read_batch`)."""
        return self._get(keys, addresses, sizes, now=self.store.reads_without_waiting)

    def get_parts_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """Each block object read straight into its parts, one ``preadv`` iovec per part."""
        result = self._read(keys, self._check_parts("get_parts_into", keys, addresses, sizes), now=False)
        assert result is not None
        return result

    def get_parts_into_now(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray
                           ) -> BatchResult | None:
        """:meth:`get_parts_into` from what is in memory, or ``None`` where it would wait."""
        buffers = self._check_parts("get_parts_into", keys, addresses, sizes)
        return self._read(keys, buffers, now=self.store.reads_without_waiting)

    def _check_parts(self, op: str, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray
                     ) -> list[Memory]:
        """The parts of each key as a tuple of byte views (each checked as :meth:`_check` does)."""
        at, lengths, _ = check_parts(op, keys, addresses, sizes)
        columns = [self._check(op, keys, at[:, p], np.full(len(keys), size, dtype=np.uint64))
                   for p, size in enumerate(lengths.tolist())]
        return list(zip(*columns, strict=True)) if len(keys) else []

    def _get(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray, now: bool) -> BatchResult | None:
        return self._read(keys, self._check("get_into", keys, addresses, sizes), now)

    def _read(self, keys: Sequence[str], buffers: Sequence[Memory], now: bool) -> BatchResult | None:
        if self._closed:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "the file store driver is closed")
        try:
            answers = self.store.read_batch(list(keys), buffers, now=now, deadline=_lock_deadline())
        except OSError as exc:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, f"the file store at {self.store.root}: {exc}")
        if answers is None:
            return None
        reasons = {i: why for i, (_, why) in enumerate(answers) if why is not None}
        if not reasons and all(code is KeyStatus.OK for code, _ in answers):
            return BatchResult.ok(len(keys))
        return BatchResult(np.array([code for code, _ in answers], dtype=np.uint8), reasons)

    def exists(self, keys: Sequence[str]) -> np.ndarray:
        try:
            return self._holds(keys)
        except OSError:  # exists() has no fault to report: a key it cannot check is not stored
            return np.zeros(len(keys), dtype=bool)

    def _holds(self, keys: Sequence[str]) -> np.ndarray:
        return np.array(self.store.holds_batch(keys), dtype=bool).reshape(len(keys))

    def contains(self, keys: Sequence[str]) -> BatchResult:
        """``OK`` for each key the directory holds an object of now, ``MISSING`` for the others
        (lookup, L1); reads no object and changes nothing."""
        result = self._contains(keys, now=False)
        assert result is not None
        return result

    def contains_now(self, keys: Sequence[str]) -> BatchResult | None:
        """:meth:`contains` from what is in memory, or ``None`` where it would wait."""
        return self._contains(keys, now=self.store.reads_without_waiting)

    def _contains(self, keys: Sequence[str], now: bool) -> BatchResult | None:
        if self._closed:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "the file store driver is closed")
        try:
            answer = self.store.holds_batch(keys, now=now)
        except OSError as exc:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, f"the file store at {self.store.root}: {exc}")
        if answer is None:
            return None
        held = np.array(answer, dtype=bool).reshape(len(keys))
        if held.all():
            return BatchResult.ok(len(keys))
        return BatchResult(np.where(held, int(KeyStatus.OK), int(KeyStatus.MISSING)).astype(np.uint8))

    def remove(self, keys: Sequence[str]) -> BatchResult:
        if self._closed:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "the file store driver is closed")
        try:
            done = np.array(self.store.discard_batch(keys), dtype=bool).reshape(len(keys))
        except OSError as exc:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, f"the file store at {self.store.root}: {exc}")
        return BatchResult(np.where(done, int(KeyStatus.OK), int(KeyStatus.MISSING)).astype(np.uint8))

    def close(self) -> None:
        """Stop answering (later calls fail); the objects stay for other processes. Idempotent."""
        self._closed = True
        if self._owns_store:
            self.store.close()

    def __repr__(self) -> str:
        return f"FilesDriver({self.store!r})"
