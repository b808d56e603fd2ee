"""The in-memory store driver: a :class:`~kvwire.blob.StoreDriver` over a :class:`MemoryStore`.

A put copies each row's bytes from host memory into the store as a new object; a get copies an
object's bytes into host memory. A block object (K1) is one slab holding a block's row of every
group, one after another: ``put_parts`` copies the parts straight into it and
``get_parts_into`` straight out of it, with no bounce buffer between. The driver checks that every address lies in a region
registered with it, so a wrong address is a ``ValueError`` rather than a write to memory nobody
lent.

A large batch (:data:`~kvwire_memory.store.PARALLEL_COPY_BYTES` or more) is copied by
``copy_threads`` threads at once: the driver's :class:`~kvwire_memory.store.CopyPool`, started
on the first such batch and joined by :meth:`MemoryDriver.close`.

With ``device`` (the ``memory-device`` plugin) the driver reaches CUDA device memory too, over
a store in pinned host memory: a batch's spans in registered DEVICE regions are copied by one
kernel launch between the device and the objects (:func:`kvwire.lender.blockcopy.copy_spans`,
the kernel reading or writing the pinned objects over the bus), on the driver's own stream of
that device, and the call returns once that copy has finished on the device (an event waited
for on the calling thread, never the whole device). This is how a vLLM worker whose KV cache is
on the GPU saves to and loads from the in-memory store with one pass over the bus and no
staging slots: the store's memory is the copy's destination. Spans in HOST regions of the same
batch are copied as without it."""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence
from operator import add

import numpy as np

from kvwire.blob import BatchResult, KeyStatus, StoreDriver
from kvwire.blob.parts import check_parts
from kvwire.contract import MemoryKind, SlotRegion
from kvwire_memory.store import DEFAULT_COPY_THREADS, CopyPool, MemoryStore
from kvwire_memory.store import _copy as store_copy

__all__ = ["MemoryDriver", "DeviceCopier"]

_DECLINED = int(KeyStatus.DECLINED)


class DeviceCopier:
    """The store's copier for a batch that has spans in device memory (duck-typed as a
    :class:`CopyPool` that takes every batch whole): each span whose device-side address lies in
    a registered DEVICE region goes to that device's copy kernel, every other span to the host
    pool. ``to_device``: the targets are the device side (a get), else the sources (a put)."""

    takes_all = True

    def __init__(self, driver: MemoryDriver, to_device: bool) -> None:
        self.driver, self.to_device = driver, to_device

    def takes(self, total: int) -> bool:
        return True

    def copy(self, targets: Sequence[int] | np.ndarray, sources: Sequence[int] | np.ndarray,
             sizes: Sequence[int] | np.ndarray) -> None:
        from kvwire.lender.blockcopy import copy_spans

        to = np.asarray(targets).astype(np.int64, copy=False)
        fro = np.asarray(sources).astype(np.int64, copy=False)
        lengths = np.asarray(sizes).astype(np.int64, copy=False)
        devices = self.driver.devices_of(to if self.to_device else fro)
        events = []
        for device in np.unique(devices[devices >= 0]).tolist():
            on = devices == device
            events.append(copy_spans(to[on], fro[on], lengths[on], device=device, to_device=self.to_device,
                                     stream=self.driver.stream(device)))
        host = devices < 0
        try:
            if host.any():
                pool = self.driver.pool
                total = int(lengths[host].sum())
                store_copy(to[host].tolist(), fro[host].tolist(), lengths[host].tolist(), total, pool)
        finally:
            for event in events:
                event.synchronize()  # this thread waits for its own copy, never for the device


class MemoryDriver(StoreDriver):
    """Reaches host memory, and CUDA memory too with ``device`` (over a pinned store). Calls may
    come from several threads at once."""

    memory_kinds = frozenset({MemoryKind.HOST})
    #: What a driver made with ``device`` reaches (the ``memory-device`` plugin's).
    device_memory_kinds = frozenset({MemoryKind.HOST, MemoryKind.DEVICE})
    #: A put or get is a memmove per row and never waits on anything else, so submissions of up
    #: to this many bytes move inside the holder's call (about 0.1 ms of copying at most).
    inline_bytes = 1 << 20

    def __init__(self, store: MemoryStore, *, copy_threads: int = DEFAULT_COPY_THREADS, device: bool = False) -> None:
        if device:
            if not store.pinned:
                raise ValueError(f"{store!r} keeps its objects in ordinary memory; a driver with device on needs "
                                 "a store made with pinned=True")
            # Instance attributes: the blob backend reads them per driver. A device batch waits
            # for the GPU, so no submission moves inside the holder's call.
            self.memory_kinds = self.device_memory_kinds
            self.inline_bytes = 0
        self.device = bool(device)
        self.store = store
        #: Copies large batches on ``copy_threads`` threads (the calling one among them).
        self.pool = CopyPool(copy_threads)
        self._lock = threading.Lock()
        self._spans: Counter[tuple[int, int]] = Counter()
        # Disjoint, sorted [start, end) spans, replaced whole on every change so calls read
        # them without the lock.
        self._starts = np.zeros(0, dtype=np.uint64)
        self._ends = np.zeros(0, dtype=np.uint64)
        self._bounds: tuple[list[int], list[int]] = ([], [])
        # The DEVICE spans alone, with their device index, replaced together as above.
        self._device_spans: tuple[np.ndarray, np.ndarray, np.ndarray] = (
            np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        self._device_regions: Counter[tuple[int, int, int]] = Counter()
        self._streams: dict[int, object] = {}
        self._closed = False

    # -- regions -------------------------------------------------------------------------------

    def register(self, regions: Sequence[SlotRegion]) -> None:
        for region in regions:
            if region.memory_kind not in self.memory_kinds:
                raise RuntimeError(
                    f"region {region.region_id} lies in {region.memory_kind.value} memory; this "
                    "in-memory store reaches host memory only (backend 'memory-device' takes CUDA memory)")
        with self._lock:
            self._spans.update((r.base, r.end) for r in regions)
            self._device_regions.update((r.base, r.end, r.device or 0) for r in regions
                                        if r.memory_kind is MemoryKind.DEVICE)
            self._rebuild()

    def unregister(self, regions: Sequence[SlotRegion]) -> None:
        with self._lock:
            for region in regions:
                for spans, span in ((self._spans, (region.base, region.end)),
                                    (self._device_regions, (region.base, region.end, region.device or 0))):
                    if spans[span] > 1:  # type: ignore[index]
                        spans[span] -= 1  # type: ignore[index]
                    else:
                        spans.pop(span, None)  # type: ignore[call-overload]
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
        self._starts = np.array(starts, dtype=np.uint64)
        self._ends = np.array(ends, dtype=np.uint64)
        self._bounds = (starts, ends)  # the same as lists, replaced together
        device = sorted(self._device_regions)
        self._device_spans = (np.array([d[0] for d in device], dtype=np.int64),
                              np.array([d[1] for d in device], dtype=np.int64),
                              np.array([d[2] for d in device], dtype=np.int64))

    def devices_of(self, addresses: np.ndarray) -> np.ndarray:
        """For each address, the index of the device whose registered DEVICE region it lies in,
        or -1 (host memory). Registered regions never overlap (the backend refuses that), and a
        process's device and host addresses are distinct (CUDA's unified addressing)."""
        starts, ends, devices = self._device_spans
        if not starts.size:
            return np.full(len(addresses), -1, dtype=np.int64)
        at = np.searchsorted(starts, addresses, side="right") - 1
        inside = (at >= 0) & (addresses < ends[np.maximum(at, 0)])
        return np.where(inside, devices[np.maximum(at, 0)], -1)

    def stream(self, device: int) -> object:
        """The driver's own CUDA stream on ``device``, made on first use: its copies queue
        behind nothing of the holder's (vLLM's compute)."""
        stream = self._streams.get(device)
        if stream is None:
            import torch

            with self._lock:
                stream = self._streams.get(device)
                if stream is None:
                    stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def _pool(self, addresses: np.ndarray | Sequence[int], to_device: bool) -> CopyPool | DeviceCopier:
        """The host pool, or a device copier for a batch with an address in device memory."""
        if not self.device or not self._device_regions:
            return self.pool
        if self.devices_of(np.asarray(addresses, dtype=np.int64).ravel()).max(initial=-1) < 0:
            return self.pool
        return DeviceCopier(self, to_device)

    @property
    def registered_bytes(self) -> int:
        """How many bytes of memory are registered now (0 once every registration is closed)."""
        return int((self._ends - self._starts).sum())

    def _check(self, op: str, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> tuple[list[int], list[int]]:
        addresses = np.asarray(addresses, dtype=np.uint64)
        sizes = np.asarray(sizes, dtype=np.uint64)
        if not (len(keys) == addresses.size == sizes.size) or addresses.ndim != 1 or sizes.ndim != 1:
            raise ValueError(
                f"{op}: {len(keys)} keys, {addresses.size} addresses and {sizes.size} sizes; give one of each per key")
        where, lengths = addresses.tolist(), sizes.tolist()
        if where:
            # The common case: every row lies within the hull of the rows, and the hull within
            # one registered span (spans are disjoint, so that suffices). The hull in C-level
            # list calls for a few rows, in numpy for more (exact: a row end past 2**64, which
            # uint64 would wrap, takes the path below).
            starts, ends = self._bounds
            if len(where) <= 32:
                low, high = min(where), max(map(add, where, lengths))
            else:
                row_ends = addresses + sizes
                low, high = int(addresses.min()), int(row_ends.max())
                if not bool((row_ends >= addresses).all()):
                    high = ends[-1] + 1 if ends else 1  # wrapped: never inside
            span = bisect_right(starts, low) - 1
            if span >= 0 and high <= ends[span]:
                return where, lengths
        span_starts, span_ends = self._starts, self._ends
        if span_starts.size:
            spans = np.searchsorted(span_starts, addresses, side="right").astype(np.int64) - 1
            row_ends = addresses + sizes
            inside = (spans >= 0) & (row_ends <= span_ends[np.maximum(spans, 0)]) & (row_ends >= addresses)
        else:
            inside = np.zeros(addresses.size, dtype=bool)
        if not inside.all():
            i = int(np.argmin(inside))
            raise ValueError(
                f"{op}: key {keys[i]!r} names {int(sizes[i])} bytes at {int(addresses[i]):#x}, which "
                "lie in no region registered with this driver; register the region first")
        return where, lengths

    # -- objects -------------------------------------------------------------------------------

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        where, lengths = self._check("put", keys, addresses, sizes)
        if self._closed:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "the in-memory driver is closed")
        pool = self._pool(where, False)
        try:
            status = self.store.write_batch(keys, where, lengths, pool=pool)
        except RuntimeError as exc:
            return self._copy_failed(pool, len(keys), exc)
        if status is None:
            return BatchResult.ok(len(keys))
        reasons: dict[int, str] = {}
        if (status == _DECLINED).any():
            reasons = {i: self._no_space(lengths[i]) for i in np.flatnonzero(status == _DECLINED).tolist()}
        return BatchResult(status, reasons)

    @staticmethod
    def _copy_failed(pool: CopyPool | DeviceCopier, count: int, exc: RuntimeError) -> BatchResult:
        """A device copy that raised (a CUDA error): every key of the call fails, naming it (the
        store kept none of the put's objects; a get's destinations may hold anything). A host
        copy raises no RuntimeError, so anything else is a bug and propagates."""
        if not isinstance(pool, DeviceCopier):
            raise exc
        return BatchResult.uniform(count, KeyStatus.FAILED, f"the copy between the GPU and the in-memory store "
                                                            f"failed: {type(exc).__name__}: {exc}")

    def _no_space(self, size: int) -> str:
        store = self.store
        if size > store.capacity_bytes:
            return f"an object of {size} bytes exceeds the in-memory store's capacity of {store.capacity_bytes} bytes"
        return (f"the in-memory store is full ({store.used_bytes} of {store.capacity_bytes} bytes used, "
                f"eviction off); {size} bytes do not fit")

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        where, lengths = self._check("get_into", keys, addresses, sizes)
        if self._closed:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "the in-memory driver is closed")
        pool = self._pool(where, True)
        try:
            status, reasons = self.store.read_batch(keys, where, lengths, pool=pool)
        except RuntimeError as exc:
            return self._copy_failed(pool, len(keys), exc)
        if status is None:
            return BatchResult.ok(len(keys))
        return BatchResult(status, reasons)

    def put_parts(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """Each block object copied from its parts into one allocation of the store."""
        at, lengths, total = self._check_parts("put_parts", keys, addresses, sizes)
        if self._closed:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "the in-memory driver is closed")
        pool = self._pool(at, False)
        try:
            status = self.store.write_parts(keys, at, lengths, pool=pool)
        except RuntimeError as exc:
            return self._copy_failed(pool, len(keys), exc)
        if status is None:
            return BatchResult.ok(len(keys))
        reasons: dict[int, str] = {}
        if (status == _DECLINED).any():
            reasons = {i: self._no_space(total) for i in np.flatnonzero(status == _DECLINED).tolist()}
        return BatchResult(status, reasons)

    def get_parts_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """Each block object copied from the store straight into its parts."""
        at, lengths, _ = self._check_parts("get_parts_into", keys, addresses, sizes)
        if self._closed:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "the in-memory driver is closed")
        pool = self._pool(at, True)
        try:
            status, reasons = self.store.read_parts(keys, at, lengths, pool=pool)
        except RuntimeError as exc:
            return self._copy_failed(pool, len(keys), exc)
        if status is None:
            return BatchResult.ok(len(keys))
        return BatchResult(status, reasons)

    def _check_parts(self, op: str, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, int]:
        """The arguments of a parts call, once every part lies in a registered region (else
        ``ValueError``, as :meth:`_check` says): each part's rows (one group's) are checked by
        their hull, and only a part whose hull is not inside one span goes row by row."""
        at, lengths, total = check_parts(op, keys, addresses, sizes)
        if at.size:
            starts, ends = self._bounds
            lows = at.min(axis=0).tolist()
            highs = (at.max(axis=0) + lengths.astype(np.uint64)).tolist()
            for p, (low, high) in enumerate(zip(lows, highs, strict=True)):
                span = bisect_right(starts, low) - 1
                if not (span >= 0 and high <= ends[span] and high > low):
                    column = at[:, p]
                    self._check(op, keys, column, np.full(column.size, lengths[p], dtype=np.uint64))
        return at, lengths, total

    def exists(self, keys: Sequence[str]) -> np.ndarray:
        store = self.store
        return np.fromiter((key in store for key in keys), dtype=bool, count=len(keys))

    def contains(self, keys: Sequence[str]) -> BatchResult:
        """``OK`` for each key the store holds now, ``MISSING`` for the others (lookup, L1);
        touches no object, and does not refresh its place in the eviction order."""
        if self._closed:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "the in-memory driver is closed")
        store = self.store
        held = np.fromiter((key in store for key in keys), dtype=bool, count=len(keys))
        if held.all():
            return BatchResult.ok(len(keys))
        return BatchResult(np.where(held, int(KeyStatus.OK), int(KeyStatus.MISSING)).astype(np.uint8))

    def remove(self, keys: Sequence[str]) -> BatchResult:
        if self._closed:
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "the in-memory driver is closed")
        discard = self.store.discard
        ok, missing = int(KeyStatus.OK), int(KeyStatus.MISSING)
        return BatchResult(np.array([ok if discard(key) else missing for key in keys], dtype=np.uint8))

    def close(self) -> None:
        """Stop answering (later calls fail) and join the copying threads (a call still copying
        finishes its copy on its own thread); the store and its objects stay for other drivers."""
        self._closed = True
        self.pool.close()

    def __repr__(self) -> str:
        return f"MemoryDriver({self.store!r})"
