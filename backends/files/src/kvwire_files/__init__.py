"""kvwire-files: a blob store in a directory that every process on this machine can share.

No server: objects are files under ``root`` (by default a per-user directory under
``/dev/shm``, so they live in shared memory on Linux). A process publishes, another fetches the
same bytes; vLLM's scheduler and worker processes, or two engines, meet in the same directory.
A put writes one pack file for its whole batch (a temp file renamed into place, then committed
to an index every process shares), fetches read straight into the lent rows without taking a
lock, and lookups (L1) ask which names are held. See :mod:`kvwire_files.store` for the layout
and why eviction never removes an object mid-read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvwire.blob import STORE_OPTIONS, BlobBackend, blob_capabilities, store_options
from kvwire.blob.options import MAX_IN_FLIGHT
from kvwire.registry import ConfigError, Option, Plugin
from kvwire_files.driver import FilesDriver
from kvwire_files.local import doctor, local_services
from kvwire_files.store import DEFAULT_COPY_THREADS, PARALLEL_IO_BYTES, FileStore, default_root

__all__ = ["plugin", "OPTIONS", "create", "FilesDriver", "FileStore", "default_root"]

#: The contract version this plugin implements, a literal (docs/contract.md, Versions): the suite
#: checks the clauses of this version and of no later one. Raise it only after reading a newer
#: version's clauses and keeping them; kvwire.contract.CONTRACT_VERSION would claim each new one.
CONTRACT = (1, 3)

OPTIONS: tuple[Option, ...] = (
    Option("root", str, default_root(),
           "the store's directory, shared by every backend that names it (created, mode 0700, if missing)"),
    Option("capacity_bytes", int, 1 << 30, "the most bytes the store's files hold (all processes together)",
           minimum=1),
    Option("eviction", bool, True,
           "when full, evict least-recently-used objects; when off, a put that does not fit is declined"),
    Option("fsync", bool, False,
           "fsync each pack and the index before a put is committed (only a root on disk that must survive power loss)"),
    *STORE_OPTIONS,  # timeout_s, max_in_flight, namespace: every blob store's (kvwire.blob.options)
    Option("copy_threads", int, DEFAULT_COPY_THREADS,
           f"threads that write or read one batch of {PARALLEL_IO_BYTES >> 20} MiB or more at once, as that many pack "
           "files (default: one per core, at most 8); 1: one pack, on the calling thread", minimum=1, maximum=64),
)


def create(options: Mapping[str, Any]) -> BlobBackend:
    """A backend on the directory ``options["root"]``, from validated options."""
    shared = store_options(options, "files")
    if not options["root"].strip():
        raise ConfigError("option 'root' of backend 'files' is empty; name the store's directory (an empty root "
                          "would put the store in the current directory)")
    if "\0" in options["root"]:
        raise ConfigError(f"option 'root' of backend 'files' ({options['root']!r}) holds a NUL byte, which no path "
                          "can hold")
    try:
        store = FileStore(options["root"], capacity_bytes=options["capacity_bytes"], eviction=options["eviction"],
                          fsync=options["fsync"],
                          copy_threads=options.get("copy_threads", DEFAULT_COPY_THREADS))
    except OSError as exc:
        raise ConfigError(f"option 'root' of backend 'files': {exc}") from None
    return BlobBackend(
        FilesDriver(store, owns_store=True),
        **shared,
        owns_driver=True,
        contract_version=CONTRACT,
    )


plugin = Plugin(
    name="files",
    contract_version=CONTRACT,
    capabilities=blob_capabilities(FilesDriver.memory_kinds, max_in_flight=MAX_IN_FLIGHT.default, lookup=True, contract_version=CONTRACT),
    create=create,
    options=OPTIONS,
    summary="blob store in a shared directory (default /dev/shm): no server, shared by every process on this machine",
    local_services=local_services,
    extra={"doctor": doctor},
)
