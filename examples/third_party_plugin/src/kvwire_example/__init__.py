"""kvwire-example: the smallest store backend worth copying.

A store plugin writes only a :class:`~kvwire.blob.StoreDriver` (here :class:`DictDriver`, a
process-wide dict of ``bytes``) and a :class:`~kvwire.registry.Plugin` naming its options;
:class:`~kvwire.blob.BlobBackend` keeps the whole contract on top of it (queues, deadlines,
cancellation, masks, waking). Backends of one process naming the same ``store`` share it."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvwire.blob import (
    STORE_OPTIONS,
    BatchResult,
    BlobBackend,
    KeyStatus,
    StoreDriver,
    blob_capabilities,
    store_options,
)
from kvwire.contract import MemoryKind, SlotRegion
from kvwire.registry import Option, Plugin

__all__ = ["DictDriver", "plugin", "stores"]

#: The contract version this plugin implements, a literal (docs/contract.md, Versions): the suite
#: checks the clauses of this version and of no later one. Raise it only after reading a newer
#: version's clauses and keeping them; kvwire.contract.CONTRACT_VERSION would claim each new one.
CONTRACT = (1, 3)

#: Every store of this process, by name: key -> the object's bytes (immutable once stored).
stores: dict[str, dict[str, bytes]] = {}
_lock = threading.Lock()


class DictDriver(StoreDriver):
    """Reads and writes host memory at the addresses of registered regions only."""

    memory_kinds = frozenset({MemoryKind.HOST})

    def __init__(self, store: str) -> None:
        with _lock:
            self.objects = stores.setdefault(store, {})
        self.spans: list[tuple[int, int]] = []

    def register(self, regions: Sequence[SlotRegion]) -> None:
        with _lock:
            self.spans += [(r.base, r.end) for r in regions]

    def unregister(self, regions: Sequence[SlotRegion]) -> None:
        with _lock:
            for r in regions:
                if (r.base, r.end) in self.spans:
                    self.spans.remove((r.base, r.end))

    def _check(self, addresses: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
        pairs = list(zip(np.asarray(addresses).tolist(), np.asarray(sizes).tolist(), strict=True))
        spans = list(self.spans)
        for address, size in pairs:
            if not any(lo <= address and address + size <= hi for lo, hi in spans):
                raise ValueError(f"{size} bytes at {address:#x} lie in no registered region")
        return pairs

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        status = []
        for key, (address, size) in zip(keys, self._check(addresses, sizes), strict=True):
            with _lock:
                there = key in self.objects
                if not there:
                    self.objects[key] = ctypes.string_at(address, size)
            status.append(KeyStatus.ALREADY_THERE if there else KeyStatus.OK)
        return BatchResult(np.array(status, dtype=np.uint8))

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        status, reasons = [], {}
        for i, (key, (address, size)) in enumerate(zip(keys, self._check(addresses, sizes), strict=True)):
            data = self.objects.get(key)
            if data is None:
                status.append(KeyStatus.MISSING)
            elif len(data) != size:
                status.append(KeyStatus.FAILED)
                reasons[i] = f"object {key!r} holds {len(data)} bytes, the destination {size}"
            else:
                ctypes.memmove(address, data, size)
                status.append(KeyStatus.OK)
        return BatchResult(np.array(status, dtype=np.uint8), reasons)

    def exists(self, keys: Sequence[str]) -> np.ndarray:
        return np.array([key in self.objects for key in keys], dtype=bool)

    def remove(self, keys: Sequence[str]) -> BatchResult:
        with _lock:
            found = [self.objects.pop(key, None) is not None for key in keys]
        return BatchResult(np.array([KeyStatus.OK if f else KeyStatus.MISSING for f in found], dtype=np.uint8))


OPTIONS = (
    Option("store", str, "default", "the in-process store: backends naming the same one share it"),
    *STORE_OPTIONS,  # timeout_s, max_in_flight, namespace: every blob store has them, declared once
)


def create(options: Mapping[str, Any]) -> BlobBackend:
    """A backend on the store named ``options["store"]``, from validated options."""
    return BlobBackend(DictDriver(options["store"]), **store_options(options, "example"), owns_driver=True,
                       contract_version=CONTRACT)


plugin = Plugin(
    name="example",
    contract_version=CONTRACT,
    capabilities=blob_capabilities(DictDriver.memory_kinds, max_in_flight=64, contract_version=CONTRACT),
    create=create,
    options=OPTIONS,
    summary="example out-of-tree store backend (a dict in this process)",
    # A template, not a backend to compare: kvwire bench measures it only when named (--backend).
    extra={"bench": False},
)
