"""The conformance harness of the memory backend (entry point ``kvwire.harnesses: memory``).

Each pair of ends gets its own in-process store, named uniquely and forgotten afterwards. Tests
that need no control of the store get backends built exactly as the plugin builds them; the
others get :class:`~kvwire.blob.BlobBackend` on the same driver, wrapped so the suite can hold
the store or make it fail chosen objects.

With ``KVWIRE_MEMORY_DEVICE=1`` in the environment (on a host with a CUDA device) every end is
built with the option ``device`` on, over a pinned store, so the suite checks DEVICE rows as well
as HOST ones: ``KVWIRE_MEMORY_DEVICE=1 pytest --pyargs kvwire.testing.suite --kvwire-backend memory``."""

from __future__ import annotations

import itertools
import os
from typing import Any

from kvwire.blob import StoreDriver
from kvwire.contract import Backend
from kvwire.testing.stores import StoreHarness
from kvwire_memory import MemoryDriver, forget_store, named_store, plugin

__all__ = ["harness", "MemoryHarness"]

#: Large enough that nothing the suite stores is ever evicted.
CAPACITY_BYTES = 256 << 20

_stores = itertools.count(1)


def _device() -> bool:
    return os.environ.get("KVWIRE_MEMORY_DEVICE", "") == "1"


class MemoryHarness(StoreHarness):
    name = "memory"
    #: At the deadline an attempt concludes at once; it quiesces when the chunk inside the
    #: driver returns, which for the in-memory driver is one memcpy of at most a few MiB here.
    quiesce_grace_s = 2.0

    def new_store(self) -> str:
        name = f"kvwire-conformance-{os.getpid()}-{next(_stores)}"
        named_store(name, capacity_bytes=CAPACITY_BYTES, eviction=False, pinned=_device())
        return name

    def driver(self, store: Any) -> StoreDriver:
        return MemoryDriver(named_store(store, capacity_bytes=CAPACITY_BYTES, eviction=False, pinned=_device()),
                            device=_device())

    def drop_store(self, store: Any) -> None:
        forget_store(store)

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float,
                   max_in_flight: int | None) -> Backend | None:
        options: dict[str, Any] = {
            "store": store,
            "namespace": namespace,
            "timeout_s": timeout_s,
            "capacity_bytes": CAPACITY_BYTES,
            "eviction": False,
            "device": _device(),
        }
        if max_in_flight is not None:
            options["max_in_flight"] = max_in_flight
        return plugin.build(options)


harness = MemoryHarness()
