"""kvwire-memory: an in-memory blob store backend, the embedded default.

It has the shape of the template for plugin authors, ``examples/third_party_plugin/``
(``kvwire-example``): a store plugin supplies a :class:`~kvwire.blob.StoreDriver` (here
:class:`MemoryDriver`), builds a :class:`~kvwire.blob.BlobBackend` on it, and names a
:class:`~kvwire.registry.Plugin` with its options in the entry point ``kvwire.backends``.

The store lives in this process only. Backends created in the same process with the same
``store`` name share one store, so two workers in one process can publish and fetch through it;
a backend in another process never sees it.

Two plugins: ``memory`` takes rows in host memory; ``memory-device`` takes rows in CUDA device
memory as well (it declares DEVICE, so a lease holder registers its GPU rows directly, with no
staging): its stores keep their objects in pinned host memory and one copy kernel a batch moves
rows between the GPU and them. Two plugins, not an option, because a plugin's declaration is
what every backend it builds declares (B4.3)."""

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

__all__ = ["plugin", "device_plugin", "OPTIONS", "DEVICE_OPTIONS", "create", "create_device", "MemoryDriver", "MemoryStore", "CopyPool", "named_store", "forget_store"]

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
)

#: ``memory-device``'s options: the same, its stores named apart by default (they are pinned).
DEVICE_OPTIONS: tuple[Option, ...] = tuple(
    Option("store", str, "device",
           "the in-process store to use, made in pinned host memory: backends of this process naming the same "
           "store share it (a 'memory' backend may name it too)") if o.name == "store" else o
    for o in OPTIONS)


#: ``memory-device``'s chunks (a chunk is one copy-kernel launch and one wait for its event): the
#: blob backend's 64 MiB. Measured on an H100 (bench_gpu core, 4 GiB saves and loads, memory-device@MiB):
#: 64 MiB saved at 0.76x / loaded at 0.51x of the pinned copy, 256 MiB 0.69 / 0.48, 1 GiB 0.71 / 0.45.
DEVICE_CHUNK_BYTES = 64 << 20


def create(options: Mapping[str, Any]) -> BlobBackend:
    """A ``memory`` backend on the process's store named ``options["store"]``, from validated
    options."""
    return _create(options, device=False)


def create_device(options: Mapping[str, Any]) -> BlobBackend:
    """A ``memory-device`` backend: as :func:`create`, over a pinned store, reaching CUDA memory
    too. ``ConfigError`` where there is no CUDA device."""
    problem = cuda_problem()
    if problem:
        raise ConfigError(f"backend 'memory-device': {problem}")
    return _create(options, device=True)


def _create(options: Mapping[str, Any], *, device: bool) -> BlobBackend:
    shared = store_options(options, "memory-device" if device else "memory")
    try:
        store = named_store(options["store"], capacity_bytes=options["capacity_bytes"], eviction=options["eviction"],
                            pinned=device)
    except ValueError as exc:
        raise ConfigError(f"option 'store' of backend {'memory-device' if device else 'memory'!r}: {exc}") from None
    return BlobBackend(
        MemoryDriver(store, copy_threads=options.get("copy_threads", DEFAULT_COPY_THREADS), device=device),
        **shared,
        **({"chunk_bytes": DEVICE_CHUNK_BYTES} if device else {}),
        owns_driver=True,
        contract_version=CONTRACT,
    )


def cuda_problem() -> str | None:
    """Why ``memory-device`` cannot work here (no torch, or no CUDA device), else ``None``."""
    try:
        import torch
    except ImportError:
        return "needs torch with CUDA; torch is not installed"
    if not torch.cuda.is_available():
        return (f"needs a CUDA device; torch {torch.__version__} sees none here (backend 'memory' takes host "
                "memory and needs none)")
    return None


plugin = Plugin(
    name="memory",
    contract_version=CONTRACT,
    capabilities=blob_capabilities(MemoryDriver.memory_kinds, max_in_flight=MAX_IN_FLIGHT.default, lookup=True,
                                   contract_version=CONTRACT),
    create=create,
    options=OPTIONS,
    summary="in-process blob store (the embedded default; shared by store name within one process)",
)

device_plugin = Plugin(
    name="memory-device",
    contract_version=CONTRACT,
    capabilities=blob_capabilities(MemoryDriver.device_memory_kinds, max_in_flight=MAX_IN_FLIGHT.default, lookup=True,
                                   contract_version=CONTRACT),
    create=create_device,
    options=DEVICE_OPTIONS,
    summary="in-process blob store in pinned memory that takes CUDA rows directly (one copy kernel a batch)",
    check=cuda_problem,
    install_hint="run it where torch sees a CUDA device; on a host without one, use backend 'memory'",
    # kvwire bench moves host rows, where this is 'memory' over pinned pages: measured when named
    extra={"bench": False},
)
