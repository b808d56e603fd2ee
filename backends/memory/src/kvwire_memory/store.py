"""An in-memory store of named, immutable byte objects, shared by name within one process.

An object enters the table only once its bytes are whole, and its bytes are never written while
it is there, so no reader sees a half-written object and a put under an existing name changes
nothing. The store bounds the bytes it holds; when full it evicts least-recently-used objects,
or, with eviction off, declines the new object.

Batches are the unit of work: :meth:`MemoryStore.write_batch` and :meth:`MemoryStore.read_batch`
take the lock once per batch, look keys up, touch the eviction order and evict with C-level
iteration (``map``, ``compress``, ``islice``), and copy outside the lock: rows that continue
each other with one ``memmove`` (without the GIL), many small rows apart with one numpy
assignment. A batch of :data:`PARALLEL_COPY_BYTES` or more copied by memmoves, given a
:class:`CopyPool`, is cut into pieces of about equal bytes copied on several threads at once.
No Python statement runs per row on that path; a batch that needs
per-row decisions (a name twice in one put, a put that only partly fits) takes a slower path
with the same answers.

Memory: the objects a put stores anew share one slab (one allocation per batch and object
size), so a batch of small rows is one allocation, not one per row. Memory of removed objects
is kept and reused for new objects of the same size once no read is copying, up to the
capacity counted by object; a slab goes back to the system once none of its objects is stored
or kept, so a slab of which only some objects survive can keep the rest of its bytes until
then (a store at capacity stops asking the system for fresh pages, whose first touch costs
more than the copy itself).

Why one file of this size: the table, the eviction order and the kept memory change together under
one lock, and each path (batch, one key, row by row) must give the same answers."""

from __future__ import annotations

import ctypes
import os
import threading
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from itertools import accumulate, compress, islice, repeat
from operator import is_not, itemgetter, ne, not_
from typing import Final, cast

import numpy as np

from kvwire.blob import KeyStatus
from kvwire.copying import stream_copy as _stream_copy

__all__ = ["MemoryStore", "named_store", "forget_store"]

#: One stored object, or memory kept for one: (the array that owns the bytes, their address,
#: their size). The owner is a slab several objects share; holding it keeps the bytes alive.
_Entry = tuple[np.ndarray | None, int, int]

_ADDRESS: Final = 1  # places in an _Entry (Final, so a type checker reads entry[_SIZE] as an int)
_SIZE: Final = 2
_address_of, _size_of = itemgetter(_ADDRESS), itemgetter(_SIZE)
_OK, _MISSING, _FAILED = int(KeyStatus.OK), int(KeyStatus.MISSING), int(KeyStatus.FAILED)
_memmove = ctypes.memmove  # releases the GIL for the copy


def _address(array: np.ndarray) -> int:
    """The address of a writable, contiguous array's first byte: through the buffer protocol,
    0.25 us where ``array.ctypes.data`` builds a helper object for 2 us (measured here; a
    one-row put into a store with no kept memory allocates one such slab)."""
    # ndarray declares __buffer__ in numpy's stubs only for Python >= 3.12; it has the buffer
    # protocol on every version.
    return ctypes.addressof(ctypes.c_char.from_buffer(array))  # type: ignore[arg-type]


_memmove_address = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
assert _memmove_address is not None  # a C function's address: never NULL
#: The same memmove called without releasing the GIL: for a batch this small, handing the GIL
#: to another thread and waiting to get it back costs more than the copy (tens of microseconds
#: on a busy machine, against well under one for 4 KiB).
_memmove_holding_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    _memmove_address)
#: Batches of at most this many bytes copy holding the GIL.
SMALL_COPY_BYTES = 256 << 10
#: Batches of at least this many rows of one size of at most this many bytes, not in a row at
#: both ends, copy in numpy (:func:`_copy_rows`): a few rows copy faster by memmove than numpy
#: builds its arrays (~5 us), and for large rows a memmove's call costs little beside its copy.
NUMPY_MIN_ROWS = 8
NUMPY_ROW_BYTES = 64 << 10


#: Batches of at least this many bytes copy on several threads when the store is given a
#: :class:`CopyPool` (the ``copy_threads`` option): handing parts to the pool's threads and
#: waiting for them costs ~50 us (measured on a busy 2-core machine: a 1 MiB memmove took 55 us
#: alone, 107 us split over two threads), 4 % of a 16 MiB copy at 13 GB/s; smaller batches keep
#: the paths below unchanged.
PARALLEL_COPY_BYTES = 16 << 20
#: Parts of a split copy start at multiples of this many bytes (page-aligned where their run is).
_SPLIT_ALIGN = 4096
#: The option's default: one copying thread per core, at most 8.
DEFAULT_COPY_THREADS = max(1, min(8, os.cpu_count() or 1))


def _run(iterator: Iterator[object]) -> None:
    """Exhaust ``iterator`` in C (a ``map`` whose calls do the work)."""
    deque(iterator, maxlen=0)


def _in_a_row(addresses: Sequence[int], size: int) -> bool:
    """Whether ``addresses`` are ``size`` bytes apart, in order (``addresses[i] == addresses[0] +
    i * size``): two list comparisons in C, the first of which rejects most batches that are not."""
    first, n = addresses[0], len(addresses)
    if addresses[-1] != first + (n - 1) * size:
        return False
    if type(addresses) is not list:
        addresses = list(addresses)
    return addresses == list(range(first, first + n * size, size))


class _Rows:
    """Rows of ``size`` bytes in raw memory, for numpy: ``count`` rows from address ``low``,
    ``stride`` bytes apart (1: a row at every byte, so row ``a - low`` is the one at ``a``).
    numpy touches only the rows an operation indexes; the addresses are the driver's to check,
    as they are for memmove."""

    __slots__ = ("__array_interface__",)

    def __init__(self, low: int, count: int, size: int, stride: int) -> None:
        self.__array_interface__ = {"version": 3, "shape": (count,), "typestr": f"|V{size}",
                                    "data": (low, False), "strides": (stride,)}


def _rows(addresses: Sequence[int], size: int, in_a_row: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows at ``addresses`` as an array of ``size``-byte elements and the index of each
    row in it: a view of the rows themselves when they are in a row (index ``None``), else a
    view of every byte address from the lowest to the highest."""
    if in_a_row:
        return np.asarray(_Rows(addresses[0], len(addresses), size, size)), None
    at = np.array(addresses, dtype=np.int64)
    low = int(at.min())
    return np.asarray(_Rows(low, int(at.max()) - low + 1, size, 1)), at - low


def _copy_rows(targets: Sequence[int], sources: Sequence[int], size: int, targets_in_a_row: bool,
               sources_in_a_row: bool) -> None:
    """Copy rows of ``size`` bytes in numpy's C loops, one indexed assignment for the batch: a
    ctypes memmove per row costs 0.5-1 us in the call alone, more than copying 4 KiB (measured
    here: 256 rows of 4 KiB into rows of 16 slabs, 0.2-0.5 us a row against 1.2-1.9 us). A
    gather (``sources`` apart) goes through one temporary of the batch's bytes; numpy's
    ``take(out=)`` is not used, since it copies its whole input when it may overlap ``out``,
    and the input here spans every address between the rows."""
    src, at = _rows(sources, size, sources_in_a_row)
    if at is not None:
        src = src[at]
    dst, to = _rows(targets, size, targets_in_a_row)
    if to is None:
        np.copyto(dst, src)
    else:
        dst[to] = src


def split_runs(targets: Sequence[int], sources: Sequence[int], sizes: Sequence[int], parts: int
               ) -> list[tuple[list[int], list[int], list[int]]]:
    """The copies of ``sizes[i]`` bytes from ``sources[i]`` to ``targets[i]`` cut into at most
    ``parts`` pieces of about equal bytes (the cuts at multiples of ``_SPLIT_ALIGN`` bytes of
    the whole, so a run may be cut in two or more): for each piece its targets, sources and
    sizes, every byte in exactly one piece, in order. Empty runs are left out."""
    z = np.asarray(sizes, dtype=np.uint64)
    keep = z > 0
    t = np.asarray(targets, dtype=np.uint64)[keep]
    f = np.asarray(sources, dtype=np.uint64)[keep]
    z = z[keep]
    ends = np.cumsum(z, dtype=np.uint64)
    total = int(ends[-1]) if ends.size else 0
    if not total:
        return []
    starts = ends - z
    step = max(_SPLIT_ALIGN, -(-total // parts // _SPLIT_ALIGN) * _SPLIT_ALIGN)
    pieces = []
    for lo in range(0, total, step):
        hi = min(total, lo + step)
        first = int(np.searchsorted(ends, lo, side="right"))  # the run holding byte lo
        last = int(np.searchsorted(starts, hi, side="left"))  # past the last run starting below hi
        run_lo, run_hi = starts[first:last], ends[first:last]
        skip = np.maximum(run_lo, np.uint64(lo)) - run_lo
        size = np.minimum(run_hi, np.uint64(hi)) - run_lo - skip
        pieces.append(((t[first:last] + skip).tolist(), (f[first:last] + skip).tolist(), size.tolist()))
    return pieces


def _copy_piece(targets: list[int], sources: list[int], sizes: list[int]) -> None:
    """One piece of a split copy, on a thread of the pool or the caller's: a copy per run, each
    without the GIL, with stores that bypass the cache (:func:`kvwire.copying.stream_copy`;
    memmove where kvwire's helper was not built). A piece is 1/threads of a batch of 16 MiB or
    more, below the size from which glibc's memmove streams by itself (53.5 MiB on an H100
    host), and neither a stored object nor a fetched row is read again by the CPU soon."""
    _run(map(_stream_copy, targets, sources, sizes))


class CopyPool:
    """Up to ``threads`` threads copying one large batch at once (the caller's own thread is
    one of them): a batch of at least ``min_bytes`` (:data:`PARALLEL_COPY_BYTES`) is cut into
    ``threads`` pieces of about equal bytes (:func:`split_runs`), the caller copies the first
    and the pool's threads the others. The threads start on the first such batch, are shared by
    every copy through this pool (copies of other calls queue behind each other's pieces), and
    are joined by :meth:`close`; a copy that finds the pool closed copies on its caller's thread
    alone. A copy returns only once every piece of it has ended, also when one raised (then it
    raises that piece's exception): no thread writes into the batch's memory after it returns.
    With ``threads == 1`` the pool never starts a thread."""

    def __init__(self, threads: int = DEFAULT_COPY_THREADS, *, min_bytes: int = PARALLEL_COPY_BYTES) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ValueError(f"copy_threads must be an int from 1 to 64, got {threads!r}")
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 1:
            raise ValueError(f"min_bytes must be an int >= 1, got {min_bytes!r}")
        self.threads = threads
        self.min_bytes = min_bytes
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    #: Whether :meth:`copy` takes every batch whole, whatever its size and shape (a copier of
    #: device memory: the store's host paths must never touch such addresses). Never for a pool.
    takes_all = False

    def takes(self, total: int) -> bool:
        """Whether a batch of ``total`` bytes is copied on several threads."""
        return total >= self.min_bytes and self.threads > 1

    def copy(self, targets: Sequence[int], sources: Sequence[int], sizes: Sequence[int]) -> None:
        """Copy ``sizes[i]`` bytes from ``sources[i]`` to ``targets[i]`` for every run, the runs
        cut into pieces across the pool's threads."""
        pieces = split_runs(targets, sources, sizes, self.threads)
        if len(pieces) < 2:
            for piece in pieces:
                _copy_piece(*piece)
            return
        futures: list[Future[None]] = []
        inline = [pieces[0]]
        executor = self._start()
        for piece in pieces[1:]:
            if executor is None:
                inline.append(piece)
                continue
            try:
                futures.append(executor.submit(_copy_piece, *piece))
            except RuntimeError:  # closed meanwhile: the caller copies what is left
                executor = None
                inline.append(piece)
        error: BaseException | None = None
        try:
            for piece in inline:
                _copy_piece(*piece)
        except BaseException as exc:
            error = exc
        finally:
            wait_futures(futures)  # every piece has ended before the copy returns or raises
        if error is not None:
            raise error
        for future in futures:
            future.result()  # the first piece that raised raises here

    def _start(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._executor is None and not self._closed:
                self._executor = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvwire-memory-copy")
            return self._executor

    def close(self) -> None:
        """Join the pool's threads (after the pieces queued now); later copies run on their
        callers' threads. Idempotent."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"CopyPool({self.threads} threads from {self.min_bytes} bytes{', closed' if self._closed else ''})"


def _copy(targets: Sequence[int], sources: Sequence[int], sizes: Sequence[int], total: int,
          pool: CopyPool | None = None) -> None:
    """Copy ``sizes[i]`` bytes from ``sources[i]`` to ``targets[i]`` for every row. Rows of one
    size that continue each other at both ends (the usual batch: consecutive slots into one
    slab) are one memmove; other batches of many rows of one small size are one numpy
    assignment (:func:`_copy_rows`). Otherwise a small batch copies row by row holding the GIL,
    and a large one merges the rows that continue each other into one memmove per run (found
    with numpy), since one long copy runs faster than many short ones (the C library streams a
    long copy past the caches). With ``pool``, a batch of at least its ``min_bytes`` that one
    or more memmoves copy (not the numpy assignment of small rows) is cut across its threads."""
    if pool is not None and pool.takes_all:  # a device copier: every span its way
        pool.copy(targets, sources, sizes)
        return
    n = len(sizes)
    split = pool if pool is not None and pool.takes(total) else None
    if n > 1:
        size = sizes[0]
        if size and sizes.count(size) == n:
            to_row, from_row = _in_a_row(targets, size), _in_a_row(sources, size)
            if to_row and from_row:
                if split is not None:
                    split.copy([targets[0]], [sources[0]], [total])
                    return
                (_memmove_holding_gil if total <= SMALL_COPY_BYTES else _memmove)(targets[0], sources[0], total)
                return
            if n >= NUMPY_MIN_ROWS and size <= NUMPY_ROW_BYTES:
                _copy_rows(targets, sources, size, to_row, from_row)
                return
    if total <= SMALL_COPY_BYTES:
        _run(map(_memmove_holding_gil, targets, sources, sizes))
        return
    if len(sizes) > 1:
        to = np.array(targets, dtype=np.uint64)
        fro = np.array(sources, dtype=np.uint64)
        row_sizes = np.array(sizes, dtype=np.uint64)
        cuts = np.flatnonzero((to[1:] != to[:-1] + row_sizes[:-1]) | (fro[1:] != fro[:-1] + row_sizes[:-1])) + 1
        if cuts.size < row_sizes.size - 1:
            first = np.concatenate(([0], cuts))
            runs = to[first].tolist(), fro[first].tolist(), np.add.reduceat(row_sizes, first).tolist()
            if split is not None:
                split.copy(*runs)
                return
            _run(map(_memmove, *runs))
            return
    if split is not None:
        split.copy(targets, sources, sizes)
        return
    _run(map(_memmove, targets, sources, sizes))


class _Parts:
    """Objects made of several spans (block objects, K1): object ``i``'s part ``p`` is the
    ``sizes[p]`` bytes at ``addresses[i, p]`` in memory, and lies at ``offsets[p]`` in the
    object. The store's batch paths then carry row indices where they carry addresses, and
    :meth:`spans` turns them into the spans to copy."""

    __slots__ = ("addresses", "sizes", "offsets", "total")

    def __init__(self, addresses: np.ndarray, sizes: np.ndarray) -> None:
        self.addresses = np.asarray(addresses, dtype=np.uint64)
        self.sizes = np.asarray(sizes, dtype=np.uint64)
        self.offsets = (np.cumsum(self.sizes) - self.sizes).astype(np.uint64)
        self.total = int(self.sizes.sum())

    def spans(self, objects: Sequence[int], rows: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """For objects stored at ``objects`` whose parts are those of ``rows``: each part's
        address in the object, its address in memory, and its size, part after part."""
        inside, outside, sizes = self.span_arrays(objects, rows)
        return inside.tolist(), outside.tolist(), sizes.tolist()

    def span_arrays(self, objects: Sequence[int], rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`spans` as three uint64 arrays, for a copier that takes arrays (a device copier:
        a block object of many layers is thousands of spans a batch)."""
        inside = (np.array(objects, dtype=np.uint64)[:, None] + self.offsets[None, :]).ravel()
        outside = self.addresses[np.array(rows, dtype=np.int64)].ravel()
        return inside, outside, np.tile(self.sizes, len(rows))


def _copy_in(targets: Sequence[int], sources: Sequence[int], sizes: Sequence[int], total: int,
             parts: _Parts | None, pool: CopyPool | None = None) -> None:
    """Copy rows into new objects at ``targets``: from the addresses ``sources``, or with
    ``parts`` from the parts of the rows ``sources``."""
    if parts is None:
        _copy(targets, sources, sizes, total, pool)
    elif pool is not None and pool.takes_all:
        pool.copy(*parts.span_arrays(targets, sources))
    else:
        inside, outside, lengths = parts.spans(targets, sources)
        _copy(inside, outside, lengths, total, pool)


def _copy_out(targets: Sequence[int], sources: Sequence[int], sizes: Sequence[int], total: int,
              parts: _Parts | None, pool: CopyPool | None = None) -> None:
    """Copy objects at ``sources`` out: to the addresses ``targets``, or with ``parts`` to the
    parts of the rows ``targets``."""
    if parts is None:
        _copy(targets, sources, sizes, total, pool)
    elif pool is not None and pool.takes_all:
        inside, outside, lengths = parts.span_arrays(sources, targets)
        pool.copy(outside, inside, lengths)
    else:
        inside, outside, lengths = parts.spans(sources, targets)
        _copy(outside, inside, lengths, total, pool)


class MemoryStore:
    """At most ``capacity_bytes`` of object bytes (keys are not counted); with the memory kept
    for reuse, never more than that counted by object. Safe to use from many threads at once;
    the copies themselves run outside the lock, without the GIL.

    With ``pinned``, every slab is pinned (page-locked) host memory from torch's pinned
    allocator, which a CUDA device reaches over the bus: a driver can then copy between the
    device and the objects directly (``kvwire-memory`` with ``device`` on). torch's allocator
    rounds each slab up to a power of two and keeps freed slabs for reuse, so a pinned store
    can hold up to twice its capacity in pinned memory."""

    def __init__(self, capacity_bytes: int, *, eviction: bool = True, pinned: bool = False) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.eviction = bool(eviction)
        self.pinned = bool(pinned)
        self._slab = _pinned_slab if self.pinned else _slab
        self._objects: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._used = 0       # bytes of stored objects, plus bytes reserved by puts copying now
        self._evicted = 0
        #: How many stored objects have each size: when all have one (the usual store of one
        #: model's rows), eviction knows how many of the oldest free enough without reading
        #: their sizes.
        self._count_by_size: dict[int, int] = {}
        self._spare: dict[int, list[_Entry]] = {}  # size -> memory free for reuse
        self._spare_bytes = 0
        self._reading = 0    # reads copying now: memory removed meanwhile waits in _held_back
        self._held_back: list[_Entry] = []
        #: Counts insertions into ``_objects``: a put that finds it unchanged after its copy
        #: knows no other writer stored one of its names meanwhile, without asking per key.
        self._inserted = 0
        self._lock = threading.Lock()

    # -- by address: what the driver uses --------------------------------------------------------

    def write_batch(self, keys: Sequence[str], addresses: Sequence[int],
                    sizes: Sequence[int], *, pool: CopyPool | None = None) -> np.ndarray | None:
        """Store ``sizes[i]`` bytes read at ``addresses[i]`` as ``keys[i]``. Answers ``None``
        when every key is ``OK`` (stored anew), else one uint8 :class:`KeyStatus` per key:
        ``OK``, ``ALREADY_THERE`` (the first bytes stay) or ``DECLINED`` (no space). With
        ``pool``, a large batch copies on its threads (:class:`CopyPool`). A copy that raises
        stores none of its new objects and gives their memory back, then raises."""
        return self._write(keys, addresses, sizes, None, pool)

    def write_parts(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray, *,
                    pool: CopyPool | None = None) -> np.ndarray | None:
        """Store objects made of parts (block objects): ``keys[i]`` is the ``sizes[p]`` bytes at
        ``addresses[i, p]`` for each part ``p``, one after another, copied into one allocation
        per object. Answers as :meth:`write_batch`."""
        parts = _Parts(addresses, sizes)
        return self._write(keys, range(len(keys)), [parts.total] * len(keys), parts, pool)

    def _write(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int],
               parts: _Parts | None, pool: CopyPool | None = None) -> np.ndarray | None:
        """:meth:`write_batch`; with ``parts``, ``addresses`` are row indices into them."""
        n = len(keys)
        if n == 1:  # one row (a one-block submission): no lists to build
            status = self._write_row(keys[0], addresses[0], sizes[0], parts, pool)
            return None if status is KeyStatus.OK else np.array([status], dtype=np.uint8)
        with self._lock:
            if len(set(keys)) != n:
                fresh = None
            else:
                fresh = self._reserve(keys, addresses, sizes)
                inserted = self._inserted
        if fresh is None:  # a name twice in the batch, or only part of it fits: row by row
            return np.array([self._write_row(k, a, s, parts, pool) for k, a, s in zip(keys, addresses, sizes, strict=True)],
                            dtype=np.uint8)
        there, new_keys, sources, targets, new_sizes, need = fresh
        try:
            _copy_in(list(map(_address_of, targets)), sources, new_sizes, need, parts, pool)
        except BaseException:
            self._unreserve(targets, need)
            raise
        with self._lock:
            objects = self._objects
            if self._inserted != inserted and not objects.keys().isdisjoint(new_keys):
                # another writer of a name came first
                raced = list(map(objects.__contains__, new_keys))
                if there is None:
                    there = [False] * n
                for key, target, was in zip(new_keys, targets, raced, strict=True):
                    if was:
                        self._used -= target[_SIZE]
                        self._give(target)
                    else:
                        objects[key] = target
                        self._counted(target[_SIZE], 1)
                marks = iter(raced)  # one per row not there before: those that raced are there now
                there = [t or next(marks) for t in there]
            else:
                objects.update(zip(new_keys, targets, strict=True))
                first = new_sizes[0] if new_sizes else 0
                if new_sizes.count(first) == len(new_sizes):
                    if new_sizes:
                        self._counted(first, len(new_sizes))
                else:
                    _run(map(self._counted, new_sizes, repeat(1)))
            self._inserted += 1
            self._trim_spare()
        if there is None or not any(there):
            return None
        return np.array(there, dtype=np.uint8)  # ALREADY_THERE is 1, OK is 0

    def read_batch(self, keys: Sequence[str], addresses: Sequence[int],
                   sizes: Sequence[int], *, pool: CopyPool | None = None) -> tuple[np.ndarray | None, dict[int, str]]:
        """Copy object ``keys[i]`` to ``sizes[i]`` bytes at ``addresses[i]``. Answers ``None``
        when every key is ``OK``, else one uint8 status per key: ``OK``, ``MISSING``, or
        ``FAILED`` when the object has another size (nothing is written there), with a reason
        for each ``FAILED`` key. With ``pool``, a large batch copies on its threads."""
        return self._read(keys, addresses, sizes, None, pool)

    def read_parts(self, keys: Sequence[str], addresses: np.ndarray,
                   sizes: np.ndarray, *, pool: CopyPool | None = None) -> tuple[np.ndarray | None, dict[int, str]]:
        """Copy objects into their parts (block objects): the first ``sizes[0]`` bytes of
        ``keys[i]`` to ``addresses[i, 0]``, the next ``sizes[1]`` to ``addresses[i, 1]``, and so
        on. Answers as :meth:`read_batch` for objects of ``sizes.sum()`` bytes."""
        parts = _Parts(addresses, sizes)
        return self._read(keys, range(len(keys)), [parts.total] * len(keys), parts, pool)

    def _read(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int],
              parts: _Parts | None, pool: CopyPool | None = None) -> tuple[np.ndarray | None, dict[int, str]]:
        """:meth:`read_batch`; with ``parts``, ``addresses`` are row indices into them."""
        if len(keys) == 1:  # one row found whole (a one-block submission): no lists to build
            key, size = keys[0], sizes[0]
            with self._lock:
                entry = self._objects.get(key)
                if entry is not None and entry[_SIZE] == size:
                    self._objects.move_to_end(key)
                    self._reading += 1
                else:
                    entry = None  # missing, or another size: the path below answers
            if entry is not None:
                try:
                    if pool is not None and pool.takes(size):
                        _copy_out([addresses[0]], [entry[_ADDRESS]], [size], size, parts, pool)
                    elif parts is None:
                        (_memmove_holding_gil if size <= SMALL_COPY_BYTES else _memmove)(
                            addresses[0], entry[_ADDRESS], size)
                    else:
                        _copy_out([addresses[0]], [entry[_ADDRESS]], [size], size, parts)
                finally:
                    self._end_read()
                return None, {}
        wrong: list[bool] = []
        with self._lock:
            objects = self._objects
            found = list(map(objects.get, keys))
            # Entries are non-empty tuples, so all() is true exactly when every key was found.
            whole = all(found)
            entries: list[_Entry]  # the entries found: no None among them
            if whole:
                hit: list[bool] = []
                entries, hit_keys, targets, want = cast("list[_Entry]", found), keys, addresses, sizes
            else:
                hit = list(map(is_not, found, repeat(None)))
                entries = cast("list[_Entry]", list(compress(found, hit)))
                hit_keys = list(compress(keys, hit))
                targets, want = list(compress(addresses, hit)), list(compress(sizes, hit))
            held = list(map(_size_of, entries))
            if type(want) is not list:
                want = list(want)
            if held != want:  # an object of another size: its row is a fault, nothing written
                wrong = list(map(ne, held, want))
                if whole:
                    hit = [True] * len(keys)
                whole = False
                right = list(map(not_, wrong))
                entries, targets, held = (list(compress(x, right)) for x in (entries, targets, held))
            _run(map(objects.move_to_end, hit_keys))
            self._reading += 1
        try:
            _copy_out(targets, list(map(_address_of, entries)), held, sum(held), parts, pool)
        finally:
            self._end_read()
        if whole:
            return None, {}
        status = np.where(np.fromiter(hit, dtype=bool, count=len(keys)), _OK, _MISSING).astype(np.uint8)
        reasons: dict[int, str] = {}
        if any(wrong):
            rows = list(compress(range(len(keys)), hit))
            for j in compress(range(len(wrong)), wrong):
                i = rows[j]
                status[i] = _FAILED
                reasons[i] = (f"object {keys[i]!r} holds {found[i][_SIZE]} bytes, "  # type: ignore[index]
                              f"the destination {sizes[i]}")
        return status, reasons

    def _end_read(self) -> None:
        """A read's copy is over: memory removed while it copied may be reused once no read copies."""
        with self._lock:
            self._reading -= 1
            if not self._reading and self._held_back:
                back, self._held_back = self._held_back, []
                self._give_many(back)

    def write_from(self, key: str, address: int, size: int) -> KeyStatus:
        """Store ``size`` bytes read at ``address`` as ``key`` (a batch of one)."""
        status = self.write_batch([key], [address], [size])
        return KeyStatus.OK if status is None else KeyStatus(int(status[0]))

    def read_into(self, key: str, address: int, size: int) -> tuple[KeyStatus, str | None]:
        """Copy object ``key`` to ``size`` bytes at ``address`` (a batch of one)."""
        status, reasons = self.read_batch([key], [address], [size])
        return (KeyStatus.OK, None) if status is None else (KeyStatus(int(status[0])), reasons.get(0))

    # -- by value: for tests and tools ------------------------------------------------------------

    def insert(self, key: str, data: bytes) -> KeyStatus:
        """Store ``data`` as ``key`` (see :meth:`write_batch`)."""
        source = np.frombuffer(data, dtype=np.uint8)
        return self.write_from(key, source.ctypes.data if source.size else 0, source.size)

    def lookup(self, key: str) -> bytes | None:
        """A copy of the object under ``key``, or ``None``."""
        with self._lock:
            entry = self._objects.get(key)
            if entry is None:
                return None
            self._objects.move_to_end(key)
            return ctypes.string_at(entry[_ADDRESS], entry[_SIZE]) if entry[_SIZE] else b""

    # -- removal ------------------------------------------------------------------------------

    def discard(self, key: str) -> bool:
        """Remove the object under ``key``; whether there was one."""
        with self._lock:
            entry = self._objects.pop(key, None)
            if entry is None:
                return False
            self._used -= entry[_SIZE]
            self._counted(entry[_SIZE], -1)
            self._give(entry)
            return True

    def clear(self) -> None:
        """Remove every object (their memory is kept for reuse; :meth:`trim` frees it)."""
        with self._lock:
            entries = list(self._objects.values())
            self._objects.clear()
            self._count_by_size.clear()
            self._used -= sum(map(_size_of, entries))
            self._give_many(entries)

    def trim(self) -> None:
        """Free the memory kept for reuse."""
        with self._lock:
            self._spare.clear()
            self._spare_bytes = 0

    # -- state --------------------------------------------------------------------------------

    def holds(self, key: str) -> bool:
        """Whether an object is stored under ``key`` now."""
        return key in self._objects

    @property
    def used_bytes(self) -> int:
        """Bytes of the objects stored (and of puts copying now)."""
        return self._used

    @property
    def evicted(self) -> int:
        """How many objects eviction has removed so far."""
        return self._evicted

    def keys(self) -> list[str]:
        """The stored keys, least recently used first."""
        with self._lock:
            return list(self._objects)

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: object) -> bool:
        return key in self._objects

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __repr__(self) -> str:
        return (f"MemoryStore({len(self)} objects, {self._used}/{self.capacity_bytes} bytes, "
                f"eviction {'on' if self.eviction else 'off'})")

    # -- under the lock -----------------------------------------------------------------------

    def _reserve(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]
                 ) -> tuple[list[bool] | None, list[str], list[int], list[_Entry], list[int], int] | None:
        """For a put of distinct keys: touch the keys already stored, make room for the others
        (evicting), reserve their bytes and take memory for them. ``None`` when not every new
        object fits (the caller goes row by row). Which keys were there comes back as ``None``
        when none was."""
        objects = self._objects
        there: list[bool] | None = None
        if not objects.keys().isdisjoint(keys):
            there = list(map(objects.__contains__, keys))
            fresh = list(map(not_, there))
            new_keys = list(compress(keys, fresh))
            sources, new_sizes = list(compress(addresses, fresh)), list(compress(sizes, fresh))
        else:
            new_keys, sources, new_sizes = list(keys), list(addresses), list(sizes)
        need = sum(new_sizes)
        if need > self.capacity_bytes or (not self.eviction and self._used + need > self.capacity_bytes):
            return None  # row by row, with nothing touched yet: each row's answer as if alone
        if there is not None:  # touched before the eviction, so that none of them is its victim
            _run(map(objects.move_to_end, compress(keys, there)))
        if not self._room_for(need):
            return None
        targets = self._take_many(new_sizes)
        self._used += need
        return there, new_keys, sources, targets, new_sizes, need

    def _write_row(self, key: str, address: int, size: int, parts: _Parts | None = None,
                   pool: CopyPool | None = None) -> KeyStatus:
        """A put of one key, or one row of a put the batch path does not take, with the same
        answers; a small copy holds the GIL, as the batch path's does. With ``parts``,
        ``address`` is the row's index into them."""
        with self._lock:
            if key in self._objects:
                self._objects.move_to_end(key)
                return KeyStatus.ALREADY_THERE
            if not self._room_for(size):
                return KeyStatus.DECLINED
            target = self._take_uniform(size, 1)[0]
            self._used += size
        try:
            if pool is not None and pool.takes(size):
                _copy_in([target[_ADDRESS]], [address], [size], size, parts, pool)
            elif parts is None:
                (_memmove_holding_gil if size <= SMALL_COPY_BYTES else _memmove)(target[_ADDRESS], address, size)
            else:
                _copy_in([target[_ADDRESS]], [address], [size], size, parts)
        except BaseException:
            self._unreserve([target], size)
            raise
        with self._lock:
            if key in self._objects:  # another writer of the same name came first
                self._used -= size
                self._give(target)
                return KeyStatus.ALREADY_THERE
            self._objects[key] = target
            self._counted(size, 1)
            self._inserted += 1
            self._trim_spare()
            return KeyStatus.OK

    def _unreserve(self, targets: list[_Entry], need: int) -> None:
        """A put whose copy raised: its reserved bytes and its memory go back (no object of it
        was stored, so no reader can be copying from that memory)."""
        with self._lock:
            self._used -= need
            self._give_many(targets)

    def _room_for(self, size: int) -> bool:
        """Whether ``size`` more bytes fit, evicting least-recently-used objects if allowed."""
        excess = self._used + size - self.capacity_bytes
        if excess <= 0:
            return True
        if not self.eviction or size > self.capacity_bytes:
            return False
        objects = self._objects
        counts = self._count_by_size
        each = next(iter(counts)) if len(counts) == 1 else 0
        if each:  # every object has this size: the count needs no sizes read
            count = min(-(-excess // each), counts[each])
            freed_bytes = count * each
        else:
            count, freed_bytes = self._oldest_freeing(excess)
        victims = list(map(objects.pop, list(islice(objects, count))))
        self._evicted += count
        if each:
            self._counted(each, -count)
        else:
            _run(map(self._counted, map(_size_of, victims), repeat(-1)))
        self._used -= freed_bytes  # the running sum of the victims' sizes
        self._give_many(victims)
        return self._used + size <= self.capacity_bytes

    def _oldest_freeing(self, excess: int) -> tuple[int, int]:
        """How many of the oldest objects free at least ``excess`` bytes (all, if they do not),
        and how many bytes they free."""
        freed = accumulate(map(_size_of, self._objects.values()))
        count = freed_bytes = 0
        length = 4
        while True:
            # Summed in runs that grow from 4 to 256: a one-row put at capacity sums a few
            # sizes, not 256 (measured 31 -> 11 us per put into a full store of 200k objects).
            run = list(islice(freed, length))
            at = bisect_left(run, excess)
            if at < len(run):
                return count + at + 1, run[at]
            count += len(run)
            if run:
                freed_bytes = run[-1]
            if len(run) < length:
                return count, freed_bytes
            length = min(length * 4, 256)

    def _counted(self, size: int, change: int) -> None:
        left = self._count_by_size.get(size, 0) + change
        if left:
            self._count_by_size[size] = left
        else:
            del self._count_by_size[size]

    def _take_many(self, sizes: list[int]) -> list[_Entry]:
        """Memory for objects of these sizes: kept memory of the same size first, then one new
        slab per size for the rest."""
        first = sizes[0] if sizes else 0
        if sizes.count(first) == len(sizes):
            return self._take_uniform(first, len(sizes))
        out: list[_Entry | None] = [None] * len(sizes)
        for size in set(sizes):
            rows = [i for i, s in enumerate(sizes) if s == size]
            for i, entry in zip(rows, self._take_uniform(size, len(rows)), strict=True):
                out[i] = entry
        return out  # type: ignore[return-value]

    def _take_uniform(self, size: int, count: int) -> list[_Entry]:
        if not size:
            return [(None, 0, 0)] * count
        taken: list[_Entry] = []
        spare = self._spare.get(size)
        if spare:
            taken = spare[-count:]
            del spare[-count:]
            self._spare_bytes -= size * len(taken)
            if not spare:
                del self._spare[size]
        missing = count - len(taken)
        if missing:
            slab = self._slab(size * missing)
            base = _address(slab)
            taken += zip(repeat(slab, missing), range(base, base + size * missing, size), repeat(size, missing), strict=True)
        return taken

    def _give(self, entry: _Entry) -> None:
        self._give_many([entry])

    def _give_many(self, entries: list[_Entry]) -> None:
        """Keep the memory of removed objects for reuse, once no read may still copy from it."""
        if not entries:
            return
        if self._reading:
            self._held_back += entries
            return
        sizes = set(map(_size_of, entries))
        if 0 in sizes:  # empty objects own no memory
            sizes.discard(0)
            entries = list(compress(entries, map(_size_of, entries)))
        if len(sizes) == 1:
            size = sizes.pop()
            self._spare.setdefault(size, []).extend(entries)
            self._spare_bytes += size * len(entries)
        else:
            for entry in entries:
                self._spare.setdefault(entry[_SIZE], []).append(entry)
                self._spare_bytes += entry[_SIZE]
        self._trim_spare()

    def _trim_spare(self) -> None:
        # Objects plus kept memory stay within the capacity.
        while self._spare_bytes and self._used + self._spare_bytes > self.capacity_bytes:
            size, entries = next(iter(self._spare.items()))
            over = self._used + self._spare_bytes - self.capacity_bytes
            drop = min(len(entries), -(-over // size))
            del entries[len(entries) - drop:]
            self._spare_bytes -= size * drop
            if not entries:
                del self._spare[size]


def _slab(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def _pinned_slab(nbytes: int) -> np.ndarray:
    """Pinned host memory as a numpy array (the array keeps the torch tensor that owns it)."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


_named: dict[str, MemoryStore] = {}
_named_lock = threading.Lock()


def named_store(name: str, *, capacity_bytes: int, eviction: bool, pinned: bool = False) -> MemoryStore:
    """The process's store called ``name``, made on first use. Every backend in this process
    that names the same store shares it; other processes never see it. Raises ``ValueError``
    if the store exists with another capacity or eviction setting, or without pinned memory
    where ``pinned`` asks for it (a pinned store serves a caller that does not ask, too)."""
    with _named_lock:
        store = _named.get(name)
        if store is None:
            store = _named[name] = MemoryStore(capacity_bytes, eviction=eviction, pinned=pinned)
            return store
    if pinned and not store.pinned:
        raise ValueError(
            f"in-memory store {name!r} already exists in this process in ordinary (not pinned) memory, which "
            "a CUDA device cannot reach; name another store for a 'memory-device' backend")
    if store.capacity_bytes != capacity_bytes:
        raise ValueError(
            f"in-memory store {name!r} already exists in this process with capacity_bytes="
            f"{store.capacity_bytes}, not {capacity_bytes}; use the same value or another store name")
    if store.eviction != bool(eviction):
        raise ValueError(
            f"in-memory store {name!r} already exists in this process with eviction "
            f"{'on' if store.eviction else 'off'}; use the same setting or another store name")
    return store


def forget_store(name: str) -> None:
    """Drop the process's store called ``name`` (its memory goes once no backend uses it)."""
    with _named_lock:
        _named.pop(name, None)
