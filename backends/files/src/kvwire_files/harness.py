"""The conformance harness of the files backend (entry point ``kvwire.harnesses: files``).

Each pair of ends gets a fresh directory under ``/dev/shm`` (or the temp directory), removed
afterwards. Tests that need no control of the store get backends built exactly as the plugin
builds them; the others get :class:`~kvwire.blob.BlobBackend` on the same driver, wrapped so the
suite can hold the store or make it fail chosen objects."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from kvwire.blob import StoreDriver
from kvwire.contract import Backend
from kvwire.testing.stores import StoreHarness
from kvwire_files import FilesDriver, FileStore, plugin

__all__ = ["harness", "FilesHarness"]

#: Large enough that nothing the suite stores is ever evicted.
CAPACITY_BYTES = 256 << 20


class FilesHarness(StoreHarness):
    name = "files"
    #: At the deadline an attempt concludes at once; it quiesces when the chunk inside the
    #: driver returns: the reads or writes of at most a few MiB of files in shared memory, or a
    #: wait for the store's lock, which gives up 0.2 s after the deadline.
    quiesce_grace_s = 2.0
    #: A store is a directory other processes open too: the suite's cross-process cases run a
    #: backend of another process on it through this harness.
    process_harness = "kvwire_files.harness:harness"

    def new_store(self) -> str:
        # KVWIRE_FILES_CONFORMANCE_DIR: run the suite on a root elsewhere (a disk, whose reads
        # take another path than tmpfs's); by default shared memory, as the plugin's default root.
        base = os.environ.get("KVWIRE_FILES_CONFORMANCE_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        return tempfile.mkdtemp(prefix=f"kvwire-conformance-{os.getpid()}-", dir=base)

    def driver(self, store: Any) -> StoreDriver:
        return FilesDriver(FileStore(store, capacity_bytes=CAPACITY_BYTES, eviction=False), owns_store=True)

    def drop_store(self, store: Any) -> None:
        shutil.rmtree(store, ignore_errors=True)

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float,
                   max_in_flight: int | None) -> Backend | None:
        options: dict[str, Any] = {"root": store, "namespace": namespace, "timeout_s": timeout_s,
                                   "capacity_bytes": CAPACITY_BYTES, "eviction": False}
        if max_in_flight is not None:
            options["max_in_flight"] = max_in_flight
        return plugin.build(options)


harness = FilesHarness()
