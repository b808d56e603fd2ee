"""Objects made of several spans (block objects, K1): the default multi-part driver calls.

A block object is one stored object whose bytes are the rows of one block in every group of a
block layout, one after another. :meth:`~kvwire.blob.driver.StoreDriver.put_parts` and
:meth:`~kvwire.blob.driver.StoreDriver.get_parts_into` move such objects. A driver that cannot
gather or scatter by itself gets the functions here as its default: they copy the parts into (or
out of) a *bounce buffer*, host memory this module registers with the driver, and call the
driver's one-span ``put`` / ``get_into`` on it. So every driver of host memory, a third party's
too, keeps block objects, at the price of one extra copy of each byte.

The bounce is bounded: a call moves its objects in pieces of at most :data:`BOUNCE_BYTES` (or one
object, when one is larger), and each driver keeps at most :data:`KEPT_BOUNCES` buffers for reuse
(one per call running at once; more are made for a burst and given back after it). Copies run in
numpy, one assignment per part for the whole piece (a layout of 32 groups is 32 assignments,
whatever the number of blocks)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import numpy as np

from kvwire.blob.results import BatchResult, KeyStatus
from kvwire.contract import MemoryKind, SlotRegion

__all__ = ["BOUNCE_BYTES", "KEPT_BOUNCES", "check_parts", "gather", "scatter", "lend", "pieces",
           "put_parts_through", "get_parts_through"]

#: The most bytes of objects one call of the default moves through its bounce buffer at once.
BOUNCE_BYTES = 16 << 20

#: How many bounce buffers a driver keeps for reuse.
KEPT_BOUNCES = 2


class PartsDriver(Protocol):
    """What the bounce buffers and the default part moves use of a
    :class:`kvwire.blob.driver.StoreDriver` (a protocol: that module calls this one)."""

    def register(self, regions: Sequence[SlotRegion]) -> None: ...

    def unregister(self, regions: Sequence[SlotRegion]) -> None: ...

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult: ...


def check_parts(op: str, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, int]:
    """``addresses`` as a ``(keys, parts)`` uint64 array, ``sizes`` as a ``(parts,)`` int64 array
    of sizes >= 1, and the object size (their sum); ``ValueError`` naming ``op`` when they do not
    fit ``keys``."""
    at = np.asarray(addresses, dtype=np.uint64)
    lengths = np.asarray(sizes, dtype=np.int64)
    if lengths.ndim != 1 or lengths.size == 0 or int(lengths.min()) < 1:
        raise ValueError(f"{op}: sizes must be one size >= 1 byte per part, got shape {lengths.shape}")
    if at.shape != (len(keys), lengths.size):
        raise ValueError(f"{op}: addresses must have shape (keys, parts) = ({len(keys)}, {lengths.size}), "
                         f"got {at.shape}")
    return at, lengths, int(lengths.sum())


class _RawRows:
    """``count`` rows of ``size`` bytes of raw memory from address ``low``, ``stride`` bytes
    apart, for numpy (which touches only the rows an operation indexes)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, low: int, count: int, size: int, stride: int) -> None:
        self.__array_interface__ = {"version": 3, "shape": (count,), "typestr": f"|V{size}",
                                    "data": (low, False), "strides": (stride,)}


def _rows_at(addresses: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The ``size``-byte rows at ``addresses`` (uint64) as numpy elements: a strided view when
    they are evenly spaced upwards (index ``None``), else a view with an element at every byte
    from the lowest address to the highest and the index of each row in it."""
    first = int(addresses[0])
    if addresses.size == 1:
        return np.asarray(_RawRows(first, 1, size, size)), None
    steps = np.diff(addresses.astype(np.int64))
    step = int(steps[0])
    if step > 0 and bool((steps == step).all()):
        return np.asarray(_RawRows(first, addresses.size, size, step)), None
    low = int(addresses.min())
    at = (addresses - np.uint64(low)).astype(np.int64)
    return np.asarray(_RawRows(low, int(at.max()) + 1, size, 1)), at


def gather(base: int, addresses: np.ndarray, sizes: np.ndarray, total: int) -> None:
    """Copy the parts at ``addresses`` (``(objects, parts)``) into contiguous objects of
    ``total`` bytes from ``base``: part ``p`` of object ``i`` to ``base + i * total +
    sizes[:p].sum()``. One numpy assignment per part."""
    count = addresses.shape[0]
    offset = 0
    for p, size in enumerate(sizes.tolist()):
        target = np.asarray(_RawRows(base + offset, count, size, total))
        source, at = _rows_at(addresses[:, p], size)
        # A gather through an index makes its temporary of the piece's rows; np.take(out=) is
        # not used, since it copies its whole input (every byte between the rows) when that
        # may overlap the output.
        np.copyto(target, source if at is None else source[at])
        offset += size


def scatter(base: int, addresses: np.ndarray, sizes: np.ndarray, total: int,
            objects: np.ndarray | None = None) -> None:
    """The reverse of :func:`gather`: copy contiguous objects of ``total`` bytes from ``base``
    into their parts at ``addresses``; with ``objects``, only those objects (indices from
    ``base``, one per row of ``addresses``)."""
    count = addresses.shape[0] if objects is None else int(objects.max()) + 1
    offset = 0
    for p, size in enumerate(sizes.tolist()):
        source = np.asarray(_RawRows(base + offset, count, size, total))
        if objects is not None:
            source = source[objects]
        target, at = _rows_at(addresses[:, p], size)
        if at is None:
            np.copyto(target, source)
        else:
            target[at] = source
        offset += size


class _Bounce:
    """Host memory registered with one driver for the default's copies."""

    __slots__ = ("array", "region")

    def __init__(self, driver: PartsDriver, nbytes: int) -> None:
        self.array = np.empty(nbytes, dtype=np.uint8)
        self.region = SlotRegion(0, int(self.array.ctypes.data), nbytes, 1, MemoryKind.HOST)
        driver.register([self.region])

    @property
    def base(self) -> int:
        return self.region.base

    @property
    def nbytes(self) -> int:
        return self.region.nbytes


class _Bounces:
    """The bounce buffers one driver keeps: lent to one call at a time, at most
    :data:`KEPT_BOUNCES` kept between calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[_Bounce] = []

    @contextmanager
    def lend(self, driver: PartsDriver, nbytes: int) -> Iterator[_Bounce]:
        """A buffer of at least ``nbytes``, registered with ``driver``, for the ``with`` block.
        Pieces of at most :data:`BOUNCE_BYTES` share kept buffers of that size; a larger one
        (one object beyond it) is made for the call and given back after it."""
        size = BOUNCE_BYTES if nbytes <= BOUNCE_BYTES else nbytes
        with self._lock:
            bounce = self._free.pop() if size == BOUNCE_BYTES and self._free else None
        if bounce is None:
            bounce = _Bounce(driver, size)
        try:
            yield bounce
        finally:
            with self._lock:
                keep = bounce.nbytes == BOUNCE_BYTES and len(self._free) < KEPT_BOUNCES
                if keep:
                    self._free.append(bounce)
            if not keep:
                driver.unregister([bounce.region])


_pools_lock = threading.Lock()
_POOL = "_kvwire_parts_bounces"


def _bounces(driver: PartsDriver) -> _Bounces:
    pool = getattr(driver, _POOL, None)
    if pool is None:
        with _pools_lock:
            pool = getattr(driver, _POOL, None)
            if pool is None:
                pool = _Bounces()
                setattr(driver, _POOL, pool)
    return pool


def lend(driver: PartsDriver, nbytes: int) -> contextlib.AbstractContextManager[_Bounce]:
    """A bounce buffer of at least ``nbytes`` registered with ``driver`` (its ``base`` address),
    for a ``with`` block: one of the driver's kept buffers when ``nbytes`` is at most
    :data:`BOUNCE_BYTES`, else one made for the block and given back after it. For a driver's
    own parts calls that stage some objects (see :func:`pieces`)."""
    return _bounces(driver).lend(driver, nbytes)


def pieces(count: int, total: int) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` of ``count`` objects of ``total`` bytes in loads of one bounce buffer: as
    many whole objects as :data:`BOUNCE_BYTES` holds, at least one."""
    return _pieces(count, total)


def _pieces(count: int, total: int) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` of the objects each bounce load holds: as many whole objects as fit."""
    each = max(1, BOUNCE_BYTES // total)
    for lo in range(0, count, each):
        yield lo, min(count, lo + each)


def _joined(count: int, answers: list[tuple[int, BatchResult]], op: str) -> BatchResult:
    if len(answers) == 1 and answers[0][1].status.shape == (count,):
        return answers[0][1]
    status = np.empty(count, dtype=np.uint8)
    reasons: dict[int, str] = {}
    for i, (lo, result) in enumerate(answers):
        hi = answers[i + 1][0] if i + 1 < len(answers) else count
        if result.status.shape != (hi - lo,):
            status[lo:hi] = int(KeyStatus.FAILED)
            why = f"the driver's {op} answered {result.status.size} statuses for {hi - lo} keys"
            reasons.update((j, why) for j in range(lo, hi))
            continue
        status[lo:hi] = result.status
        reasons.update((lo + j, why) for j, why in result.reasons.items())
    return BatchResult(status, reasons)


def put_parts_through(driver: PartsDriver, keys: Sequence[str], addresses: np.ndarray,
                      sizes: np.ndarray) -> BatchResult:
    """The default :meth:`~kvwire.blob.driver.StoreDriver.put_parts`: each piece of objects is
    gathered into a bounce buffer and stored with the driver's ``put``."""
    at, lengths, total = check_parts("put_parts", keys, addresses, sizes)
    count = len(keys)
    answers: list[tuple[int, BatchResult]] = []
    with _bounces(driver).lend(driver, min(count, max(1, BOUNCE_BYTES // total)) * total) as bounce:
        for lo, hi in _pieces(count, total):
            gather(bounce.base, at[lo:hi], lengths, total)
            starts = bounce.base + np.arange(hi - lo, dtype=np.uint64) * np.uint64(total)
            answers.append((lo, driver.put(keys[lo:hi], starts, np.full(hi - lo, total, dtype=np.uint64))))
    return _joined(count, answers, "put")


def get_parts_through(driver: PartsDriver, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray,
                      read: Callable[[Sequence[str], np.ndarray, np.ndarray], BatchResult | None]
                      ) -> BatchResult | None:
    """The default :meth:`~kvwire.blob.driver.StoreDriver.get_parts_into` (``read`` is the
    driver's ``get_into``) and ``get_parts_into_now`` (``read`` is its ``get_into_now``): each
    piece is read into a bounce buffer, and the objects read whole are scattered into their
    parts. ``None`` as soon as ``read`` answers ``None``."""
    at, lengths, total = check_parts("get_parts_into", keys, addresses, sizes)
    count = len(keys)
    answers: list[tuple[int, BatchResult]] = []
    with _bounces(driver).lend(driver, min(count, max(1, BOUNCE_BYTES // total)) * total) as bounce:
        for lo, hi in _pieces(count, total):
            starts = bounce.base + np.arange(hi - lo, dtype=np.uint64) * np.uint64(total)
            result = read(keys[lo:hi], starts, np.full(hi - lo, total, dtype=np.uint64))
            if result is None:
                return None
            answers.append((lo, result))
            if result.status.shape != (hi - lo,):
                continue  # answered as a fault of every key of the piece
            whole = np.flatnonzero(result.status == int(KeyStatus.OK))
            if whole.size == hi - lo:
                scatter(bounce.base, at[lo:hi], lengths, total)
            elif whole.size:  # only the objects read whole reach their parts
                scatter(bounce.base, at[lo:hi][whole], lengths, total, objects=whole)
    return _joined(count, answers, "get_into")
