"""Finding backends through the entry-point group ``kvwire.backends``: lazy, cached, isolated."""

from __future__ import annotations

import functools
import logging
import traceback
from dataclasses import dataclass
from importlib import metadata

from kvwire.contract import CONTRACT_VERSION
from kvwire.registry.plugin import ConfigError, Plugin

__all__ = ["GROUP", "HARNESS_GROUP", "Entry", "PluginError", "available", "load", "survey", "Survey"]

log = logging.getLogger(__name__)

GROUP = "kvwire.backends"
HARNESS_GROUP = "kvwire.harnesses"


class PluginError(RuntimeError):
    """A plugin could not be loaded; the message names its distribution, the reason and the fix."""


@dataclass(frozen=True, slots=True)
class Entry:
    """An installed backend as its distribution's metadata describes it; nothing imported."""

    name: str
    value: str
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"{self.name} ({self.distribution} {self.version})"


@functools.cache
def _entry_points(group: str) -> dict[str, tuple[Entry, metadata.EntryPoint]]:
    found: dict[str, tuple[Entry, metadata.EntryPoint]] = {}
    for ep in metadata.entry_points(group=group):
        dist = ep.dist
        entry = Entry(
            ep.name,
            ep.value,
            dist.metadata["Name"] if dist is not None else "?",
            dist.version if dist is not None else "?",
        )
        if ep.name in found:
            log.warning("backend name %r is claimed by %s and %s; using the first", ep.name,
                        found[ep.name][0].distribution, entry.distribution)
            continue
        found[ep.name] = (entry, ep)
    return found


def refresh() -> None:
    """Forget what was discovered, e.g. after installing a distribution in this process."""
    _entry_points.cache_clear()
    _load.cache_clear()


def available(group: str = GROUP) -> tuple[Entry, ...]:
    """Every installed backend, sorted by name. Imports no plugin."""
    return tuple(entry for entry, _ in sorted(_entry_points(group).values(), key=lambda x: x[0].name))


def load(name: str) -> Plugin:
    """The plugin registered as ``name``: imports that plugin's module and no other."""
    return _load(name)


@functools.cache
def _load(name: str) -> Plugin:
    found = _entry_points(GROUP)
    if name not in found:
        names = ", ".join(sorted(found)) or "none installed"
        raise ConfigError(f"unknown backend {name!r}; installed backends: {names}")
    entry, ep = found[name]
    try:
        obj = ep.load()
    except Exception as exc:  # a broken plugin must never stop the others
        raise PluginError(
            f"backend {name!r} from distribution {entry.distribution} {entry.version} failed to "
            f"import ({ep.value}): {type(exc).__name__}: {exc}. Reinstall it "
            f"(pip install --force-reinstall {entry.distribution}) or uninstall it."
        ) from exc
    if callable(obj) and not isinstance(obj, Plugin):
        try:
            obj = obj()
        except Exception as exc:
            raise PluginError(
                f"backend {name!r} from {entry.distribution}: its entry point {ep.value} raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    if not isinstance(obj, Plugin):
        raise PluginError(
            f"backend {name!r} from {entry.distribution}: entry point {ep.value} must name a "
            f"kvwire.registry.Plugin, got {type(obj).__name__}"
        )
    major = obj.contract_version[0]
    if major != CONTRACT_VERSION[0]:
        raise PluginError(
            f"backend {name!r} from {entry.distribution} {entry.version} speaks contract "
            f"{obj.contract_version[0]}.{obj.contract_version[1]}, this kvwire speaks "
            f"{CONTRACT_VERSION[0]}.{CONTRACT_VERSION[1]}; install a {entry.distribution} built "
            f"for contract {CONTRACT_VERSION[0]}.x"
        )
    if tuple(obj.contract_version) > CONTRACT_VERSION:
        raise PluginError(
            f"backend {name!r} from {entry.distribution} {entry.version} speaks contract "
            f"{obj.contract_version[0]}.{obj.contract_version[1]}, newer than this kvwire's "
            f"{CONTRACT_VERSION[0]}.{CONTRACT_VERSION[1]}: it was written for clauses this kvwire does not know; "
            f"upgrade kvwire, or install a {entry.distribution} built for contract "
            f"{CONTRACT_VERSION[0]}.{CONTRACT_VERSION[1]} or earlier"
        )
    if tuple(obj.capabilities.contract_version) != tuple(obj.contract_version):
        raise PluginError(
            f"backend {name!r} from {entry.distribution} declares contract "
            f"{obj.contract_version[0]}.{obj.contract_version[1]} in its Plugin but "
            f"{obj.capabilities.contract_version[0]}.{obj.capabilities.contract_version[1]} in its capabilities; "
            "declare one literal version in both"
        )
    if obj.name != name:
        raise PluginError(
            f"backend entry point {name!r} from {entry.distribution} names a plugin called {obj.name!r}"
        )
    return obj


@dataclass(frozen=True, slots=True)
class Survey:
    """One row of ``kvwire backends``: the entry, its plugin if it loaded, and the problem if not."""

    entry: Entry
    plugin: Plugin | None
    problem: str | None
    detail: str | None = None


def survey() -> tuple[Survey, ...]:
    """Load every installed backend in isolation and say how each fared."""
    rows = []
    for entry in available():
        try:
            plugin = load(entry.name)
        except PluginError as exc:
            detail = "".join(traceback.format_exception(exc.__cause__)) if exc.__cause__ else None
            rows.append(Survey(entry, None, str(exc), detail))
            continue
        problem = None
        if plugin.check is not None:
            try:
                problem = plugin.check()
            except Exception as exc:  # a check must never break the listing
                problem = f"its library check raised {type(exc).__name__}: {exc}"
        if problem and plugin.install_hint:
            problem = f"{problem} (fix: {plugin.install_hint})"
        rows.append(Survey(entry, plugin, problem))
    return tuple(rows)
