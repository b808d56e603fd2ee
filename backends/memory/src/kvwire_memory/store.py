"""An in-memory store of named, immutable byte objects, shared by name within one process.

Objects are Python ``bytes``: immutable, so a reader holding one never sees it change, and an
object is visible only once it is whole (it enters the table in one step under the lock).
The store bounds the bytes it holds; when full it evicts least-recently-used objects, or, with
eviction off, declines the new object."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

__all__ = ["MemoryStore", "named_store", "forget_store"]


class MemoryStore:
    """At most ``capacity_bytes`` of object bytes (keys are not counted). Safe to use from many
    threads at once."""

    def __init__(self, capacity_bytes: int, *, eviction: bool = True) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.eviction = bool(eviction)
        self._objects: OrderedDict[str, bytes] = OrderedDict()  # least recently used first
        self._used = 0
        self._evicted = 0
        self._lock = threading.Lock()

    def holds(self, key: str) -> bool:
        """Whether an object is stored under ``key`` now."""
        return key in self._objects

    def insert(self, key: str, data: bytes) -> tuple[bool, bool]:
        """Store ``data`` under ``key`` unless something is there already. Returns ``(stored,
        already_there)``: ``(False, False)`` means declined for space."""
        size = len(data)
        with self._lock:
            if key in self._objects:
                self._objects.move_to_end(key)
                return False, True
            if self._used + size > self.capacity_bytes:
                if not self.eviction or size > self.capacity_bytes:
                    return False, False
                while self._used + size > self.capacity_bytes:
                    _, old = self._objects.popitem(last=False)
                    self._used -= len(old)
                    self._evicted += 1
            self._objects[key] = data
            self._used += size
            return True, False

    def lookup(self, key: str) -> bytes | None:
        """The object under ``key`` (now the most recently used), or ``None``."""
        with self._lock:
            data = self._objects.get(key)
            if data is not None:
                self._objects.move_to_end(key)
            return data

    def discard(self, key: str) -> bool:
        """Remove the object under ``key``; whether there was one."""
        with self._lock:
            data = self._objects.pop(key, None)
            if data is None:
                return False
            self._used -= len(data)
            return True

    def clear(self) -> None:
        """Remove every object."""
        with self._lock:
            self._objects.clear()
            self._used = 0

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
    """Drop the process's store called ``name`` (its objects go once no backend uses it)."""
    with _named_lock:
        _named.pop(name, None)
