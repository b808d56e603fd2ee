"""Loading the Mooncake client library lazily, and saying why it cannot load.

Nothing here imports ``mooncake`` at module import time, so ``kvwire backends`` lists this
plugin, with the reason and the fix, even where the library or its system libraries are absent."""

from __future__ import annotations

import importlib
import os
import re
from importlib import metadata
from types import ModuleType

__all__ = ["DISTRIBUTIONS", "INSTALL_HINT", "MooncakeUnavailable", "problem", "store_module"]

#: The two builds of the client; both install the same module ``mooncake``.
DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
SYSTEM_LIBRARIES = "apt-get install -y libibverbs1 librdmacm1 libnuma1"
INSTALL_HINT = (
    f"{SYSTEM_LIBRARIES}; then pip install 'kvwire-mooncake[cpu]' "
    "(or 'kvwire-mooncake[cuda]' on a GPU host with a CUDA 12 driver)"
)

_MISSING_SO = re.compile(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file")
_SYSTEM_SO = ("libibverbs", "librdmacm", "libnuma", "libnl", "libcurl")
_CUDA_SO = ("libcudart", "libcuda.", "libcuda.so", "libnvidia")


class MooncakeUnavailable(RuntimeError):
    """The Mooncake client library cannot be imported here; the message says why and the fix."""


def _installed() -> list[str]:
    found = []
    for dist in DISTRIBUTIONS:
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        found.append(dist)
    return found


def _explain(exc: ImportError) -> str:
    text = str(exc)
    if isinstance(exc, ModuleNotFoundError) and exc.name in ("mooncake", "mooncake.store"):
        return (
            "the Mooncake client library is not installed (neither "
            f"{' nor '.join(DISTRIBUTIONS)} is present)"
        )
    match = _MISSING_SO.search(text)
    if match:
        lib = match.group(1)
        if lib.startswith(_SYSTEM_SO):
            return (
                f"the Mooncake client library cannot load the system library {lib}: "
                f"{SYSTEM_LIBRARIES}"
            )
        if lib.startswith(_CUDA_SO):
            return (
                f"the CUDA build of Mooncake (mooncake-transfer-engine) is installed but {lib} is "
                "missing: on a machine without a CUDA driver, pip uninstall -y "
                "mooncake-transfer-engine and install 'kvwire-mooncake[cpu]' instead"
            )
    return f"the Mooncake client library failed to import: {type(exc).__name__}: {text}"


def store_module() -> ModuleType:
    """``mooncake.store``, imported on first use. Raises :class:`MooncakeUnavailable` saying
    why it cannot load and what to do."""
    # The client library reads MC_LOG_LEVEL once, when it loads (setting it before a client's
    # setup is too late): without it every client logs ~15 INFO lines to stderr. The user's own
    # value wins; ERROR is the plugin's default ``log_level``.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        return importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise MooncakeUnavailable(_explain(exc)) from exc


def problem() -> str | None:
    """Why this plugin cannot work here, or ``None``. Never raises."""
    both = _installed()
    if len(both) > 1:
        return (
            f"both {both[0]} and {both[1]} are installed; they overwrite each other's files "
            f"(module 'mooncake'): pip uninstall -y {' '.join(both)} and install one extra of "
            "kvwire-mooncake, [cpu] or [cuda]"
        )
    try:
        store_module()
    except MooncakeUnavailable as exc:
        return str(exc)
    return None
