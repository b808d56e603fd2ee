"""Observers of workers: metrics exporters and event sinks, attached through pluggy hooks and
found through the entry-point group ``kvwire.observers``, as backends are. An observer that
raises is logged and detached from nothing else: it never breaks a transfer."""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Any

import pluggy

from kvwire.observe.hooks import ObserverSpec, hookimpl, hookspec

__all__ = ["Observers", "ObserverSpec", "hookimpl", "hookspec", "OBSERVER_GROUP"]

log = logging.getLogger(__name__)
OBSERVER_GROUP = "kvwire.observers"


class Observers:
    """The observers one worker announces to. ``announce(event, **fields)`` never raises."""

    def __init__(self, *observers: object, discover: bool = True) -> None:
        self._pm = pluggy.PluginManager("kvwire")
        self._pm.add_hookspecs(ObserverSpec)
        self.failures = 0
        for obs in observers:
            self._pm.register(obs)
        if discover:
            for ep in metadata.entry_points(group=OBSERVER_GROUP):
                try:
                    self._pm.register(ep.load(), name=f"{OBSERVER_GROUP}:{ep.name}")
                except Exception:  # a broken observer must not stop a worker
                    log.exception("observer %s (%s) failed to load", ep.name, ep.value)

    def attach(self, observer: object) -> None:
        self._pm.register(observer)

    def detach(self, observer: object) -> None:
        self._pm.unregister(observer)

    def announce(self, event: str, **fields: Any) -> None:
        caller = getattr(self._pm.hook, f"kvwire_{event}")
        for impl in caller.get_hookimpls():
            try:
                impl.function(**{k: fields[k] for k in impl.argnames if k in fields})
            except Exception:
                self.failures += 1
                log.exception("observer %s raised on %s; the transfer goes on", impl.plugin_name, event)
