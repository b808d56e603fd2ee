"""The store-driver boundary: what a blob backend needs from a store of named, immutable objects.

A driver moves whole objects between the store and memory the caller names by address: each
object from one span (``put``, ``get_into``) or from several, one after another (``put_parts``,
``get_parts_into``: the block objects of K1, whose default goes through the one-span calls). It
answers every key with a :class:`KeyStatus`; it raises only for a broken call (bad arguments),
never for a store fault, which is a ``FAILED`` status with a reason."""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence

import numpy as np

from kvwire.blob.parts import get_parts_through, put_parts_through
from kvwire.blob.results import BatchResult, KeyStatus, all_ok
from kvwire.contract import MemoryKind, SlotRegion

__all__ = ["KeyStatus", "BatchResult", "StoreDriver", "call_deadline", "all_ok", "overrides_parts"]

#: The deadline of the attempt the current thread's driver call works for (set by the blob backend).
_call = threading.local()


def call_deadline() -> float | None:
    """Inside a driver call the blob backend made: the ``time.monotonic()`` time by which the
    attempt it works for concludes; ``None`` elsewhere. A driver that may wait for another party
    (a lock another process holds, a server) waits no longer, so the attempt quiesces within its
    grace after the deadline (A8.3, A8.5)."""
    return getattr(_call, "deadline", None)


class StoreDriver(abc.ABC):
    """A store of named, immutable objects, reached in batches.

    Visibility is atomic per key: no reader sees a half-written object, and a put under an
    existing key never changes that object's bytes. Calls may come from several backend worker
    threads at once; a driver that cannot take that serializes them itself."""

    #: The memory kinds whose addresses ``put`` may read and ``get_into`` may write.
    memory_kinds: frozenset[MemoryKind] = frozenset({MemoryKind.HOST})

    #: The most bytes of a submission the blob backend may move inside the holder's ``fetch``
    #: or ``publish`` call, on the holder's thread, instead of handing them to a worker. Only a
    #: driver whose ``put``/``get_into`` never wait for anything but a bounded memory copy (the
    #: in-memory store) sets it; a networked store keeps 0, since a call that stalls would
    #: hold the holder's thread past the deadline (A8.5). A driver that wraps another keeps 0
    #: unless it makes the same promise.
    inline_bytes: int = 0

    #: The same for a fetch alone; None: :attr:`inline_bytes`. The fetch is tried inside the
    #: call with :meth:`get_into_now`, so it suits a driver whose reads only copy memory while its
    #: writes may wait for another party (the files store on tmpfs, whose writers take a lock
    #: other processes share), and one whose reads usually copy memory but sometimes would wait
    #: (the files store on a disk, whose pages are cached or not): it answers ``None`` then.
    inline_get_bytes: int | None = None

    #: The most keys one ``put`` or ``get_into`` call is given, or ``None`` for no bound: the blob
    #: backend cuts a submission into chunks of at most this many rows, besides its byte bound.
    #: A parts call counts each part of each key (``keys x parts`` spans): block objects of 32
    #: groups come at most ``max_batch_keys // 32`` to a call (at least one).
    #: A store whose client queues one request per span and refuses or stalls past some depth
    #: (Mooncake's transfer queue) sets it, so one call never asks more than it takes.
    max_batch_keys: int | None = None

    #: How many calls of one submission the blob backend makes at once, or ``None`` for as many
    #: as it has workers. A store whose client moves one call fastest alone sets 1: a
    #: submission's chunks then go one after another (each still its own call, so cancellation
    #: and the deadline are checked between them), while other submissions' calls may run
    #: beside them. Mooncake sets 1: its client moved a 252 MiB submission cut in four calls on
    #: two workers at 0.6x the speed of one call at a time.
    chunks_at_once: int | None = None

    #: Whether a lookup (L1) first tries :meth:`contains_now` on the caller's thread, rather than
    #: handing ``contains`` to the backend's lookup thread at once (a lookup must answer within its
    #: deadline, L1.7, also when the store stalls).
    inline_contains: bool = False

    def register(self, regions: Sequence[SlotRegion]) -> None:
        """Make these spans usable as sources and destinations (zero-copy stores register them
        with their client). Raises ``RuntimeError`` naming the region if the store refuses."""

    def unregister(self, regions: Sequence[SlotRegion]) -> None:
        """Undo :meth:`register` for these spans. Never raises for a span already gone."""

    @abc.abstractmethod
    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """Store ``sizes[i]`` bytes read at ``addresses[i]`` as the object ``keys[i]``."""

    @abc.abstractmethod
    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """Read object ``keys[i]`` into ``sizes[i]`` bytes at ``addresses[i]``. ``OK`` only when
        the whole object, of exactly that size, was written there."""

    def put_parts(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """Store objects made of several parts (block objects, K1): object ``keys[i]`` is the
        ``sizes[p]`` bytes read at ``addresses[i, p]`` for each part ``p``, one after another
        (``addresses`` of shape ``(keys, parts)``, ``sizes`` of ``(parts,)``, each >= 1). The
        answers are :meth:`put`'s for an object of ``sizes.sum()`` bytes. The default gathers
        the parts into a bounded bounce buffer it registers with this driver and calls
        :meth:`put` (:mod:`kvwire.blob.parts`); a driver that can gather by itself overrides it."""
        return put_parts_through(self, keys, addresses, sizes)

    def get_parts_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """Read objects into several parts: the first ``sizes[0]`` bytes of object ``keys[i]``
        to ``addresses[i, 0]``, the next ``sizes[1]`` to ``addresses[i, 1]``, and so on. ``OK``
        only when the whole object, of exactly ``sizes.sum()`` bytes, was written there; an
        object of another size is not one of this layout: never ``OK`` (``FAILED``, as for
        :meth:`get_into`), and its parts may hold anything. The default reads into a bounded
        bounce buffer with :meth:`get_into` and scatters what was read whole; a driver that can
        scatter by itself overrides it."""
        result = get_parts_through(self, keys, addresses, sizes, self.get_into)
        if result is None:
            raise TypeError(f"{type(self).__name__}.get_into answered None, not a BatchResult")
        return result

    def get_parts_into_now(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray
                           ) -> BatchResult | None:
        """:meth:`get_parts_into` if it can be done waiting for nothing but memory copies, else
        ``None`` at once, as :meth:`get_into_now` says. The default is :meth:`get_parts_into`
        for a driver that overrides it (right when its reads never wait), else the bounce
        buffer's way through :meth:`get_into_now`."""
        if type(self).get_parts_into is not StoreDriver.get_parts_into:
            return self.get_parts_into(keys, addresses, sizes)
        return get_parts_through(self, keys, addresses, sizes, self.get_into_now)

    @property
    def offers_parts(self) -> bool:
        """Whether :meth:`put_parts` and :meth:`get_parts_into` work for every memory kind the
        driver reaches, so that a blob backend on it may declare ``block-objects`` (K1): when the
        driver overrides them, or when it reaches host memory only (the default's bounce buffer
        and its copies are host memory). A wrapping driver answers for the driver it wraps."""
        return overrides_parts(self) or self.memory_kinds <= {MemoryKind.HOST}

    def get_into_now(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult | None:
        """:meth:`get_into` if it can be done waiting for nothing but memory copies, else
        ``None`` at once (the destination may then hold anything). The blob backend calls it
        inside the holder's ``fetch`` for a fetch of at most :attr:`inline_get_bytes`, and hands
        the fetch to a worker (which calls :meth:`get_into`) when it answers ``None``. The
        default is :meth:`get_into`: right for a driver that sets :attr:`inline_get_bytes` only
        because its reads never wait."""
        return self.get_into(keys, addresses, sizes)

    def contains_now(self, keys: Sequence[str]) -> BatchResult | None:
        """:meth:`contains` if it can be answered waiting for nothing but memory, else ``None``
        at once: then the lookup goes to the backend's lookup thread. Called only when
        :attr:`inline_contains` is set; the default is :meth:`contains`."""
        return self.contains(keys)

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> np.ndarray:
        """A bool array: which keys name a stored object now."""

    def contains(self, keys: Sequence[str]) -> BatchResult:
        """Optional (the ``lookup`` protocol, L1): which keys name a whole stored object now,
        answered ``OK`` (held), ``MISSING`` (not held) or ``FAILED`` with a reason (a fault: the
        store did not answer for that key). Unlike :meth:`exists` a fault is never read as
        "not held". Touches no object and takes no lease. The default raises
        ``NotImplementedError``: the driver does not offer it, and a blob backend on it does not
        declare ``lookup``."""
        raise NotImplementedError(f"{type(self).__name__} does not offer contains()")

    @property
    def offers_contains(self) -> bool:
        """Whether :meth:`contains` is offered: by default, whether the driver's class overrides
        it. A wrapping driver answers for the driver it wraps."""
        return type(self).contains is not StoreDriver.contains

    @abc.abstractmethod
    def remove(self, keys: Sequence[str]) -> BatchResult:
        """Remove objects: ``OK``, ``MISSING``, ``BUSY`` or ``FAILED`` per key."""

    def close(self) -> None:
        """Release the store connection. Idempotent."""


def overrides_parts(driver: StoreDriver) -> bool:
    """Whether ``driver`` gathers and scatters block objects itself (overrides both
    :meth:`~StoreDriver.put_parts` and :meth:`~StoreDriver.get_parts_into`) rather than through
    the default's host bounce buffer. A wrapping driver forwards the parts calls when the driver
    it wraps answers true."""
    return (type(driver).put_parts is not StoreDriver.put_parts
            and type(driver).get_parts_into is not StoreDriver.get_parts_into)
