"""The conformance harness of the example backend (entry point ``kvwire.harnesses: example``).

A store plugin built on :class:`~kvwire.blob.BlobBackend` gets everything from
:class:`~kvwire.testing.stores.StoreHarness`: it says how to make a fresh store, a driver that
reaches it, and (optionally) how the plugin itself builds an end."""

from __future__ import annotations

import itertools
from typing import Any

from kvwire.blob import StoreDriver
from kvwire.contract import Backend
from kvwire.testing.stores import StoreHarness
from kvwire_example import DictDriver, plugin, stores

_names = itertools.count(1)


class ExampleHarness(StoreHarness):
    name = "example"
    #: At its deadline an attempt concludes at once and quiesces when the chunk inside the
    #: driver returns: one memcpy here.
    quiesce_grace_s = 2.0

    def new_store(self) -> str:
        return f"conformance-{next(_names)}"

    def driver(self, store: Any) -> StoreDriver:
        return DictDriver(store)

    def drop_store(self, store: Any) -> None:
        stores.pop(store, None)

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float, max_in_flight: int | None) -> Backend:
        options: dict[str, Any] = {"store": store, "namespace": namespace, "timeout_s": timeout_s}
        if max_in_flight is not None:
            options["max_in_flight"] = max_in_flight
        return plugin.build(options)


harness = ExampleHarness()
