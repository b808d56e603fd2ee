"""Which backends the suite runs against, and their harnesses.

A target comes from ``--kvwire-backend NAME`` (the harness registered under ``NAME`` in the
entry-point group ``kvwire.harnesses``), from ``--kvwire-harness module:object`` or
``--kvwire-harness path/to/file.py:object`` (a harness not installed as a distribution, e.g. a
test's deliberately broken backend), or, with neither, from every installed backend that has a
harness. A harness that cannot load becomes a target whose tests fail with the reason."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kvwire.registry import GROUP, HARNESS_GROUP
from kvwire.testing.harness import Harness

__all__ = ["Target", "select_targets", "load_harness_spec", "installed_harnesses"]


@dataclass(frozen=True)
class Target:
    """One backend the suite runs against: its name, its harness, or why it has none."""

    name: str
    harness: Harness | None
    origin: str
    problem: str | None = None


def _as_harness(obj: object, where: str) -> Harness:
    if isinstance(obj, type) and issubclass(obj, Harness):
        obj = obj()
    elif callable(obj) and not isinstance(obj, Harness):
        obj = obj()
    if not isinstance(obj, Harness):
        raise TypeError(f"{where} must name a kvwire.testing.harness.Harness, got {type(obj).__name__}")
    if not obj.name:
        raise TypeError(f"{where}: the harness sets no backend name (Harness.name)")
    return obj


def load_harness_spec(spec: str) -> Harness:
    """The harness named by ``module:object`` or ``path/to/file.py:object``."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(f"--kvwire-harness {spec!r}: write module:object or path/to/file.py:object")
    if module_part.endswith(".py"):
        path = Path(module_part).resolve()
        if not path.is_file():
            raise ValueError(f"--kvwire-harness {spec!r}: no file {str(path)!r}")
        name = f"kvwire_harness_{path.stem}_{abs(hash(str(path)))}"
        module = sys.modules.get(name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ValueError(f"--kvwire-harness {spec!r}: cannot import {str(path)!r}")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            sys.path.insert(0, str(path.parent))
            try:
                loader_spec.loader.exec_module(module)
            finally:
                sys.path.remove(str(path.parent))
    else:
        module = importlib.import_module(module_part)
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"--kvwire-harness {spec!r}: {module_part} has no attribute {attr!r}") from None
    return _as_harness(obj, f"--kvwire-harness {spec}")


def installed_harnesses() -> dict[str, metadata.EntryPoint]:
    """Harness entry points by name, for names that are also installed backends."""
    backends = {ep.name for ep in metadata.entry_points(group=GROUP)}
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=HARNESS_GROUP):
        if ep.name in backends and ep.name not in found:
            found[ep.name] = ep
    return found


def _from_entry_point(name: str, ep: metadata.EntryPoint) -> Target:
    origin = f"entry point {HARNESS_GROUP}:{name} ({ep.value})"
    try:
        harness = _as_harness(ep.load(), origin)
    except Exception as exc:  # one broken plugin must not stop the others
        return Target(name, None, origin, f"its harness failed to load: {type(exc).__name__}: {exc}")
    if harness.name != name:
        return Target(name, None, origin, f"its harness is for backend {harness.name!r}, not {name!r}")
    return Target(name, harness, origin)


def select_targets(backends: Sequence[str], specs: Sequence[str]) -> list[Target]:
    """The targets the options ask for, in order; every installed one when both are empty.
    Raises ``ValueError`` for a backend that is not installed or has no harness."""
    targets: list[Target] = []
    harnesses = installed_harnesses()
    if not backends and not specs:
        return [_from_entry_point(name, ep) for name, ep in sorted(harnesses.items())]
    installed = {ep.name for ep in metadata.entry_points(group=GROUP)}
    for name in backends:
        if name not in installed:
            listed = ", ".join(sorted(installed)) or "none"
            raise ValueError(f"--kvwire-backend {name}: no backend {name!r} is installed (installed: {listed})")
        if name not in harnesses:
            raise ValueError(
                f"--kvwire-backend {name}: backend {name!r} is installed but registers no conformance harness; "
                f"its distribution must name one in the entry-point group {HARNESS_GROUP!r} under the same name")
        targets.append(_from_entry_point(name, harnesses[name]))
    for spec in specs:
        harness = load_harness_spec(spec)
        targets.append(Target(harness.name, harness, f"--kvwire-harness {spec}"))
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"the suite was asked to test one backend name twice: {names}")
    return targets
