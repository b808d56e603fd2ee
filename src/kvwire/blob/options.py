"""The options every blob-family store plugin has, declared once: :data:`STORE_OPTIONS`.

A store plugin (memory, files, Mooncake, the example) lists them beside its own in its
``Plugin.options`` and hands the resolved values to :class:`~kvwire.blob.BlobBackend` with
:func:`store_options`; :class:`~kvwire.blob.BlobBackend` checks its ``timeout_s`` and
``max_in_flight`` by these same declarations, so a bound cannot differ between the registry, a
plugin and the backend."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvwire.blob.keys import check_namespace
from kvwire.registry.plugin import ConfigError, Option

__all__ = ["STORE_OPTIONS", "TIMEOUT_S", "MAX_IN_FLIGHT", "NAMESPACE", "store_options"]

#: Each attempt's (and lookup's) deadline when its hint gives none (A8.4, L1.7).
TIMEOUT_S = Option("timeout_s", float, 30.0, "each attempt's and lookup's deadline unless its hint gives one",
                   minimum=0.001)
#: Attempts neither concluded nor quiesced at once; more are refused (S3.9).
MAX_IN_FLIGHT = Option("max_in_flight", int, 64, "attempts in flight before submissions are rejected", minimum=1,
                       maximum=1 << 16)
#: The namespace a submission uses when its hint names none (H1.7, H1.8).
NAMESPACE = Option("namespace", str, "default",
                   "key namespace when a hint names none (1-128 letters, digits, ._:@+=-/)")

STORE_OPTIONS: tuple[Option, ...] = (TIMEOUT_S, MAX_IN_FLIGHT, NAMESPACE)


def store_options(options: Mapping[str, Any], backend: str) -> dict[str, Any]:
    """The :class:`~kvwire.blob.BlobBackend` keywords of the shared options, from resolved
    ``options`` of the plugin named ``backend``: ``namespace`` checked (H1.8; else a
    :class:`~kvwire.registry.ConfigError` naming the option and ``backend``), ``timeout_s`` and
    ``max_in_flight`` (already checked by the registry; the backend checks them again)."""
    try:
        namespace = check_namespace(options[NAMESPACE.name])
    except ValueError as exc:
        raise ConfigError(f"option 'namespace' of backend {backend!r}: {exc}") from None
    return {"namespace": namespace, "timeout_s": options[TIMEOUT_S.name], "max_in_flight": options[MAX_IN_FLIGHT.name]}
