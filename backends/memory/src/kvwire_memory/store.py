"""An in-memory store of named, immutable byte objects, shared by name within one process.

An object enters the table only once its bytes are whole, and its bytes are never written while
it is there, so no reader sees a half-written object and a put under an existing name changes
nothing. The store bounds the bytes it holds; when full it evicts least-recently-used objects,
or, with eviction off, declines the new object.

Memory of removed objects is kept, up to the capacity, and reused for new objects of the same
size once no reader is copying from it: a store at capacity then stops asking the system for
fresh pages, whose first touch costs more than the copy itself (worker threads allocate from
their own malloc arena, which hands freed memory back eagerly)."""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from kvwire.blob import KeyStatus

__all__ = ["MemoryStore", "named_store", "forget_store"]


class _Object:
    """One stored object: its buffer, and how many readers are copying out of it now."""

    __slots__ = ("buffer", "readers", "removed")

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.readers = 0
        self.removed = False


class MemoryStore:
    """At most ``capacity_bytes`` of object bytes (keys are not counted); with the memory kept
    for reuse, never more than that in all. Safe to use from many threads at once; the copies
    themselves run outside the lock, without the GIL."""

    def __init__(self, capacity_bytes: int, *, eviction: bool = True) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.eviction = bool(eviction)
        self._objects: OrderedDict[str, _Object] = OrderedDict()  # least recently used first
        self._used = 0
        self._evicted = 0
        self._spare: dict[int, list[np.ndarray]] = {}  # size -> buffers free for reuse
        self._spare_bytes = 0
        self._lock = threading.Lock()

    # -- by address: what the driver uses --------------------------------------------------------

    def write_from(self, key: str, address: int, size: int) -> KeyStatus:
        """Store ``size`` bytes read at ``address`` as ``key``: ``OK``, ``ALREADY_THERE`` (the
        first bytes stay) or ``DECLINED`` (no space)."""
        with self._lock:
            if key in self._objects:
                self._objects.move_to_end(key)
                return KeyStatus.ALREADY_THERE
            if not self._room_for(size):
                return KeyStatus.DECLINED
            buffer = self._take(size)
        ctypes.memmove(buffer.ctypes.data, address, size)
        with self._lock:
            if key in self._objects:  # another writer of the same name came first
                self._give(buffer)
                return KeyStatus.ALREADY_THERE
            if not self._room_for(size):
                self._give(buffer)
                return KeyStatus.DECLINED
            self._objects[key] = _Object(buffer)
            self._used += size
            self._trim_spare()
            return KeyStatus.OK

    def read_into(self, key: str, address: int, size: int) -> tuple[KeyStatus, str | None]:
        """Copy object ``key`` to ``size`` bytes at ``address``: ``OK``, ``MISSING``, or
        ``FAILED`` with a reason when the object has another size (nothing is written then)."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return KeyStatus.MISSING, None
            if obj.buffer.size != size:
                return KeyStatus.FAILED, f"object {key!r} holds {obj.buffer.size} bytes, the destination {size}"
            self._objects.move_to_end(key)
            obj.readers += 1
        try:
            ctypes.memmove(address, obj.buffer.ctypes.data, size)
        finally:
            with self._lock:
                obj.readers -= 1
                if obj.removed and obj.readers == 0:
                    self._give(obj.buffer)
        return KeyStatus.OK, None

    # -- by value: for tests and tools ------------------------------------------------------------

    def insert(self, key: str, data: bytes) -> KeyStatus:
        """Store ``data`` as ``key`` (see :meth:`write_from`)."""
        source = np.frombuffer(data, dtype=np.uint8)
        return self.write_from(key, source.ctypes.data, source.size) if source.size else self._insert_empty(key)

    def lookup(self, key: str) -> bytes | None:
        """A copy of the object under ``key``, or ``None``."""
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return None
            self._objects.move_to_end(key)
            return obj.buffer.tobytes()

    def _insert_empty(self, key: str) -> KeyStatus:
        with self._lock:
            if key in self._objects:
                return KeyStatus.ALREADY_THERE
            self._objects[key] = _Object(np.zeros(0, dtype=np.uint8))
            return KeyStatus.OK

    # -- removal ------------------------------------------------------------------------------

    def discard(self, key: str) -> bool:
        """Remove the object under ``key``; whether there was one."""
        with self._lock:
            obj = self._objects.pop(key, None)
            if obj is None:
                return False
            self._drop(obj)
            return True

    def clear(self) -> None:
        """Remove every object (their memory is kept for reuse; :meth:`trim` frees it)."""
        with self._lock:
            while self._objects:
                self._drop(self._objects.popitem(last=False)[1])

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

    def _room_for(self, size: int) -> bool:
        """Whether ``size`` more bytes fit, evicting least-recently-used objects if allowed."""
        if self._used + size <= self.capacity_bytes:
            return True
        if not self.eviction or size > self.capacity_bytes:
            return False
        while self._used + size > self.capacity_bytes:
            self._drop(self._objects.popitem(last=False)[1])
            self._evicted += 1
        return True

    def _drop(self, obj: _Object) -> None:
        self._used -= obj.buffer.size
        obj.removed = True
        if obj.readers == 0:
            self._give(obj.buffer)

    def _take(self, size: int) -> np.ndarray:
        spare = self._spare.get(size)
        if spare:
            self._spare_bytes -= size
            return spare.pop()
        return np.empty(size, dtype=np.uint8)

    def _give(self, buffer: np.ndarray) -> None:
        if buffer.size:
            self._spare.setdefault(buffer.size, []).append(buffer)
            self._spare_bytes += buffer.size
            self._trim_spare()

    def _trim_spare(self) -> None:
        # Objects plus kept memory stay within the capacity.
        while self._spare_bytes and self._used + self._spare_bytes > self.capacity_bytes:
            size, buffers = next(iter(self._spare.items()))
            buffers.pop()
            self._spare_bytes -= size
            if not buffers:
                del self._spare[size]


_named: dict[str, MemoryStore] = {}
_named_lock = threading.Lock()


def named_store(name: str, *, capacity_bytes: int, eviction: bool) -> MemoryStore:
    """The process's store called ``name``, made on first use. Every backend in this process
    that names the same store shares it; other processes never see it. Raises ``ValueError``
    if the store exists with another capacity or eviction setting."""
    with _named_lock:
        store = _named.get(name)
        if store is None:
            store = _named[name] = MemoryStore(capacity_bytes, eviction=eviction)
            return store
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
