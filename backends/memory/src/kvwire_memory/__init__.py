"""kvwire-memory: an in-memory blob store backend, the embedded default.

It has the shape of the template for plugin authors, ``examples/third_party_plugin/``
(``kvwire-example``): a store plugin supplies a :class:`~kvwire.blob.StoreDriver` (here
:class:`MemoryDriver`), builds a :class:`~kvwire.blob.BlobBackend` on it, and names a
:class:`~kvwire.registry.Plugin` with its options in the entry point ``kvwire.backends``.

The store lives in this process only. Backends created in the same process with the same
``store`` name share one store, so two workers in one process can publish and fetch through it;
a backend in another process never sees it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvwire.blob import STORE_OPTIONS, BlobBackend, blob_capabilities, store_options
from kvwire.blob.options import MAX_IN_FLIGHT
from kvwire.registry import ConfigError, Option, Plugin
from kvwire_memory.driver import MemoryDriver
from kvwire_memory.store import (
    DEFAULT_COPY_THREADS,
    PARALLEL_COPY_BYTES,
    CopyPool,
    MemoryStore,
    forget_store,
    named_store,
)

__all__ = ["plugin", "OPTIONS", "create", "MemoryDriver", "MemoryStore", "CopyPool", "named_store", "forget_store"]

#: The contract version this plugin implements, a literal (docs/contract.md, Versions): the suite
#: checks the clauses of this version and of no later one. Raise it only after reading a newer
#: version's clauses and keeping them; kvwire.contract.CONTRACT_VERSION would claim each new one.
CONTRACT = (1, 3)

OPTIONS: tuple[Option, ...] = (
    Option("capacity_bytes", int, 1 << 30, "the most object bytes the store holds", minimum=1),
    Option("eviction", bool, True,
           "when full, evict least-recently-used objects; when off, a put that does not fit is declined"),
    *STORE_OPTIONS,  # timeout_s, max_in_flight, namespace: every blob store's (kvwire.blob.options)
    Option("store", str, "default",
           "the in-process store to use: backends of this process naming the same store share it"),
    Option("copy_threads", int, DEFAULT_COPY_THREADS,
           f"threads that copy one batch of {PARALLEL_COPY_BYTES >> 20} MiB or more at once (default: one per core, "
           "at most 8); 1 copies on the calling thread only", minimum=1, maximum=64),
    Option("device", bool, False,
           "also take rows in CUDA device memory (declare DEVICE): the store keeps its objects in pinned host memory "
           "and one copy kernel a batch moves rows between the GPU and them, with no staging (needs torch with CUDA; "
           "Triton for speed). The store named by 'store' is then made in pinned memory"),
)


def create(options: Mapping[str, Any]) -> BlobBackend:
    """A backend on the process's store named ``options["store"]``, from validated options."""
    shared = store_options(options, "memory")
    device = bool(options.get("device", False))
    if device:
        _need_cuda()
    try:
        store = named_store(options["store"], capacity_bytes=options["capacity_bytes"], eviction=options["eviction"],
                            pinned=device)
    except ValueError as exc:
        raise ConfigError(f"option 'store' of backend 'memory': {exc}") from None
    return BlobBackend(
        MemoryDriver(store, copy_threads=options.get("copy_threads", DEFAULT_COPY_THREADS), device=device),
        **shared,
        owns_driver=True,
        contract_version=CONTRACT,
    )


def _need_cuda() -> None:
    """Raise ``ConfigError`` saying why, where option ``device`` cannot work here."""
    try:
        import torch
    except ImportError:
        raise ConfigError("option 'device' of backend 'memory' needs torch with CUDA; torch is not installed") from None
    if not torch.cuda.is_available():
        raise ConfigError(f"option 'device' of backend 'memory' needs a CUDA device; torch {torch.__version__} "
                          "sees none here (leave 'device' off: the store then takes host memory only)")


plugin = Plugin(
    name="memory",
    contract_version=CONTRACT,
    capabilities=blob_capabilities(MemoryDriver.memory_kinds, max_in_flight=MAX_IN_FLIGHT.default, lookup=True,
                                   contract_version=CONTRACT),
    create=create,
    options=OPTIONS,
    summary="in-process blob store (the embedded default; shared by store name within one process)",
)
