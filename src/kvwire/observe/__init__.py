"""Observers of workers: metrics exporters and event sinks, attached through pluggy hooks and
found through the entry-point group ``kvwire.observers``, as backends are. An observer that
raises is logged and detached from nothing else: it never breaks a transfer."""

from __future__ import annotations

import logging
from importlib import metadata
from typing import TYPE_CHECKING, Any

import pluggy

from kvwire.observe.hooks import ObserverSpec, hookimpl, hookspec

if TYPE_CHECKING:
    from kvwire.contract.outcome import Cause

__all__ = ["Observers", "ObserverSpec", "hookimpl", "hookspec", "OBSERVER_GROUP", "cause_label", "UNSPECIFIED"]

log = logging.getLogger(__name__)
OBSERVER_GROUP = "kvwire.observers"

#: The label of an outcome that did not deliver and names no cause (a contract 1.0 backend).
UNSPECIFIED = "unspecified"


def cause_label(cause: Cause | None) -> str:
    """The metric label of an outcome's cause: its value, or :data:`UNSPECIFIED` for ``None``.
    Never guessed from the reason text."""
    return UNSPECIFIED if cause is None else cause.value


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
