"""The conformance harnesses of the memory backends (entry points ``kvwire.harnesses: memory``
and ``memory-device``).

Each pair of ends gets its own in-process store, named uniquely and forgotten afterwards. Tests
that need no control of the store get backends built exactly as the plugin builds them; the
others get :class:`~kvwire.blob.BlobBackend` on the same driver, wrapped so the suite can hold
the store or make it fail chosen objects.

``memory-device``'s harness builds every end over a pinned store, so the suite checks DEVICE rows
as well as HOST ones (``pytest --pyargs kvwire.testing.suite --kvwire-backend memory-device`` on a
host with a CUDA device; elsewhere each test skips, saying why)."""

from __future__ import annotations

import itertools
import os
from typing import Any, ClassVar

from kvwire.blob import StoreDriver
from kvwire.contract import Backend
from kvwire.registry import Plugin
from kvwire.testing.harness import Ends, FaultPlan, Unavailable
from kvwire.testing.stores import StoreHarness
from kvwire_memory import MemoryDriver, cuda_problem, device_plugin, forget_store, named_store, plugin

__all__ = ["harness", "device_harness", "MemoryHarness", "MemoryDeviceHarness"]

#: Large enough that nothing the suite stores is ever evicted.
CAPACITY_BYTES = 256 << 20

_stores = itertools.count(1)


class MemoryHarness(StoreHarness):
    name = "memory"
    #: Whether the stores are pinned and the ends reach CUDA memory (``memory-device``).
    device: ClassVar[bool] = False
    plugin: ClassVar[Plugin] = plugin
    #: At the deadline an attempt concludes at once; it quiesces when the chunk inside the
    #: driver returns, which for the in-memory driver is one memcpy of at most a few MiB here.
    quiesce_grace_s = 2.0

    def new_store(self) -> str:
        name = f"kvwire-conformance-{os.getpid()}-{next(_stores)}"
        named_store(name, capacity_bytes=CAPACITY_BYTES, eviction=False, pinned=self.device)
        return name

    def driver(self, store: Any) -> StoreDriver:
        return MemoryDriver(named_store(store, capacity_bytes=CAPACITY_BYTES, eviction=False, pinned=self.device),
                            device=self.device)

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
        }
        if max_in_flight is not None:
            options["max_in_flight"] = max_in_flight
        return self.plugin.build(options)


class MemoryDeviceHarness(MemoryHarness):
    name = "memory-device"
    device = True
    plugin = device_plugin

    def open(self, *, timeout_s: float, max_in_flight: int | None = None,
             faults: FaultPlan | None = None, hold: bool = False) -> Ends:
        problem = cuda_problem()
        if problem:
            raise Unavailable(f"backend 'memory-device' {problem}")
        return super().open(timeout_s=timeout_s, max_in_flight=max_in_flight, faults=faults, hold=hold)


harness = MemoryHarness()
device_harness = MemoryDeviceHarness()
