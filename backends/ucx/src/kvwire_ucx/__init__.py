"""kvwire-ucx: a UCX peer-to-peer backend that serves and makes request-free pulls.

Importing this package imports neither ucxx nor numpy's UCX views: the registry can list the
plugin (and say what is missing) without loading UCX. ``plugin.build(options)`` loads it."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvwire.registry.plugin import Plugin
from kvwire_ucx.settings import CONTRACT, OPTIONS, UcxSettings, capabilities_for

if TYPE_CHECKING:
    from kvwire_ucx.backend import UcxBackend

__all__ = ["plugin", "UcxSettings", "create", "ucx_problem"]

__version__ = "0.1.0"

INSTALL_HINT = "pip install 'ucxx-cu12==0.52.0' (ucxx-cu13 on CUDA 13 hosts)"


def ucx_problem() -> str | None:
    """Why ucxx cannot be loaded here, or ``None``; never raises and imports nothing heavy."""
    try:
        if importlib.util.find_spec("ucxx") is None:
            return "ucxx is not installed"
    except (ImportError, ValueError) as exc:
        return f"ucxx cannot be found: {exc}"
    return None


def create(options: Mapping[str, Any]) -> UcxBackend:
    """A backend built from validated options (see :data:`kvwire_ucx.settings.OPTIONS`)."""
    from kvwire_ucx.backend import UcxBackend

    return UcxBackend(UcxSettings.from_options(options))


_DEFAULTS = UcxSettings()

plugin = Plugin(
    name="ucx",
    contract_version=CONTRACT,
    capabilities=capabilities_for(_DEFAULTS),
    create=create,
    options=OPTIONS,
    summary="UCX peer-to-peer transfers; serves request-free pulls from a peer's reuse tree",
    check=ucx_problem,
    install_hint=INSTALL_HINT,
    extra={"raw_bench": lambda options, row_bytes, rows, repeat: _raw_bench(options, row_bytes, rows, repeat),
           "doctor": lambda: _doctor()},
)


def _doctor() -> list[tuple[str, bool, str, str]]:
    """For ``kvwire doctor``: whether the opt-in one-sided mode can run here."""
    from kvwire_ucx.nixl import INSTALL_HINT, nixl_problem

    problem = nixl_problem()
    if problem is not None:
        return [("one-sided mode", False, "unavailable: NIXL is not installed (the default two-sided mode works)",
                 INSTALL_HINT)]
    return [("one-sided mode", True, "NIXL found: mode='one-sided' is available (trusted clusters only)", "")]


def _raw_bench(options: Any, row_bytes: int, rows: int, repeat: int) -> float:
    """For ``kvwire bench``: median seconds of bare ucxx tag messages moving the same rows."""
    from kvwire_ucx.raw import raw_bench

    return raw_bench(options, row_bytes, rows, repeat)
