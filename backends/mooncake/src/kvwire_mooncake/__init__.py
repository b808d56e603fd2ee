"""kvwire-mooncake: the Mooncake Store backend.

A :class:`~kvwire.blob.BlobBackend` over :class:`~kvwire_mooncake.driver.MooncakeDriver`. The
entry point ``kvwire.backends: mooncake`` names :data:`plugin`; importing this package does not
import ``mooncake``, so the plugin is listed, with the reason, where its library cannot load."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from kvwire.blob import BlobBackend, blob_capabilities, store_options
from kvwire.blob.options import MAX_IN_FLIGHT
from kvwire.contract import Backend, MemoryKind
from kvwire.registry import Plugin
from kvwire_mooncake.library import INSTALL_HINT, problem
from kvwire_mooncake.options import OPTIONS, ClientSettings

__all__ = ["plugin", "create", "local_services", "MEMORY_KINDS"]
__version__ = "0.1.0"

log = logging.getLogger(__name__)

#: The contract version this plugin implements, a literal (docs/contract.md, Versions): the suite
#: checks the clauses of this version and of no later one. Raise it only after reading a newer
#: version's clauses and keeping them; kvwire.contract.CONTRACT_VERSION would claim each new one.
CONTRACT = (1, 3)

#: Host memory: the non-CUDA build moves it over TCP (or RDMA).
MEMORY_KINDS = frozenset({MemoryKind.HOST})


def create(options: Mapping[str, Any]) -> Backend:
    """A backend from resolved options: one Mooncake client (and a private master when no
    master is configured), shut down with the backend."""
    from kvwire_mooncake.driver import MooncakeDriver

    shared = store_options(options, "mooncake")
    settings = ClientSettings.from_options(options)
    driver = MooncakeDriver.connect(settings, check_existing=options["check_existing"])
    try:
        return BlobBackend(
            driver,
            **shared,
            workers=options["workers"],
            chunk_bytes=options["chunk_bytes"],
            owns_driver=True,
            contract_version=CONTRACT,
        )
    except BaseException:
        driver.close()
        raise


def raw_bench(options: Mapping[str, Any], row_bytes: int, rows: int, repeat: int) -> float:
    """For ``kvwire bench``: median seconds of the raw ``batch_get_into`` of the same rows."""
    from kvwire_mooncake.raw import raw_fetch_seconds

    return raw_fetch_seconds(options, row_bytes, rows, repeat)


@contextlib.contextmanager
def local_services(options: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """For demos and tests: when no master is configured (option or ``$MOONCAKE_MASTER``),
    start one on free loopback ports for the block and yield ``{"master": address}``, so every
    backend built inside shares it; otherwise yield nothing to change."""
    from kvwire_mooncake.master import MasterProcess

    if ClientSettings.from_options(options).master:
        yield {}
        return
    with MasterProcess() as master:
        yield {"master": master.address}


plugin = Plugin(
    name="mooncake",
    contract_version=CONTRACT,
    capabilities=blob_capabilities(MEMORY_KINDS, MAX_IN_FLIGHT.default,
                                   lookup=True, contract_version=CONTRACT),
    create=create,
    options=OPTIONS,
    summary="Mooncake Store: a distributed KV store; rows move zero-copy from registered memory",
    check=problem,
    install_hint=INSTALL_HINT,
    local_services=local_services,
    extra={"raw_bench": raw_bench},
)
