"""Backends a run expects: ``--kvwire-require NAME[,NAME...]`` (or ``KVWIRE_REQUIRE``).

A CI that runs the suite must not stay green by skipping. For each required backend the run
checks, before any test, that its plugin loads, that its library check finds nothing wrong and
that its conformance harness loads; any problem stops the run with the reason (pytest's usage
error, exit status 4). Tests that need a backend's own library call :func:`backend_module`: it
skips, naming the module, when the backend is not required, and fails when it is."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from types import ModuleType

__all__ = ["set_required", "required", "problems", "backend_module", "backend_usable", "parse"]

_required: frozenset[str] = frozenset()


def parse(values: Iterable[str]) -> frozenset[str]:
    """Names from repeated and comma-separated option values (and ``KVWIRE_REQUIRE``)."""
    names = {n.strip() for value in values for n in value.split(",")}
    names |= {n.strip() for n in os.environ.get("KVWIRE_REQUIRE", "").split(",")}
    return frozenset(n for n in names if n)


def set_required(names: Iterable[str]) -> None:
    global _required
    _required = frozenset(names)


def required() -> frozenset[str]:
    """The backends this run requires."""
    return _required


def problems(names: Iterable[str]) -> list[str]:
    """For each required backend that cannot be tested here, one line saying why."""
    from kvwire.registry import PluginError, load
    from kvwire.registry.plugin import ConfigError
    from kvwire.testing.targets import installed_harnesses

    out = []
    harnesses = installed_harnesses()
    for name in sorted(names):
        try:
            plugin = load(name)
        except (PluginError, ConfigError) as exc:
            out.append(f"backend {name!r} is required but does not load: {exc}")
            continue
        if plugin.check is not None:
            try:
                problem = plugin.check()
            except Exception as exc:  # a check that raises is itself the problem
                problem = f"its library check raised {type(exc).__name__}: {exc}"
            if problem:
                out.append(f"backend {name!r} is required but its library is not usable: {problem}")
                continue
        if name not in harnesses:
            out.append(f"backend {name!r} is required but registers no conformance harness (kvwire.harnesses)")
            continue
        try:
            harnesses[name].load()
        except Exception as exc:
            out.append(f"backend {name!r} is required but its harness does not load: {type(exc).__name__}: {exc}")
    return out


def backend_module(module: str, backend: str, why: str = "") -> ModuleType:
    """Import ``module``, which tests of ``backend`` need. When it cannot be imported: fail if the
    run requires ``backend``, else skip; either way saying which module and why."""
    import pytest

    try:
        return importlib.import_module(module)
    except Exception as exc:
        message = f"{module} is not importable here ({type(exc).__name__}: {exc}){': ' + why if why else ''}"
        if backend in _required:
            pytest.fail(f"backend {backend!r} is required (--kvwire-require) but {message}", pytrace=False)
        pytest.skip(message, allow_module_level=True)
    raise AssertionError("unreachable")


def backend_usable(backend: str) -> None:
    """Skip (or, when the run requires ``backend``, fail) unless ``backend`` loads, its library
    check passes and its harness loads."""
    import pytest

    found = problems([backend])
    if not found:
        return
    if backend in _required:
        pytest.fail(found[0] + " (--kvwire-require)", pytrace=False)
    pytest.skip(found[0].replace(" is required but", ""))
