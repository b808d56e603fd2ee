"""``gated``: a test-only kvwire store plugin that wraps a real one and can hold its store calls.

It exists so the vLLM tests can keep a load (or a save) *inside the store* for as long as they
need, deterministically, and then let it go on, kill the store under it, abort its request or
shut its engine down. The tests install it into a throwaway folder as a distribution of its own
(``kvwire-vllm-gated``, entry point ``kvwire.backends: gated``), put on the engines' PYTHONPATH
only; kvwire selects it through its registry by name like any backend.

Options: ``inner`` (the real backend's name, e.g. ``files`` or ``mooncake``, a blob store),
``inner_options`` (its options as a JSON object string), ``gate`` (a directory), ``namespace``.
The inner backend's own driver does every store call. Before a fetch's driver call (``get_into``)
the driver looks for ``{gate}/hold-get``, before a publish's (``put``) for ``{gate}/hold-put``:
while that file exists the call waits, after first creating ``{gate}/arrived-get-{pid}-{n}``
(or ``arrived-put-...``) so a test sees that a call is inside the store. Removing the hold file
lets the held calls go on to the real store. ``shutdown()`` of the backend interrupts held calls:
they return FAILED for their keys without touching the store, as a networked client's calls end
when it is closed; that is what a real driver's bounded request timeout gives."""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.blob import BatchResult, BlobBackend, KeyStatus, StoreDriver, blob_capabilities
from kvwire.contract import CONTRACT_VERSION, Attempt, MemoryKind, SlotRegion
from kvwire.registry import REQUIRED, ConfigError, Option, Plugin, load

__all__ = ["plugin", "GatedDriver", "GatedBackend"]

#: How often a held call looks for its hold file again (only while a test holds it).
_LOOK_S = 0.005


class GatedDriver(StoreDriver):
    def __init__(self, inner: BlobBackend, gate: Path) -> None:
        self.inner = inner
        self.gate = gate
        self.interrupted = threading.Event()
        self._seq = itertools.count()

    @property
    def memory_kinds(self) -> frozenset[MemoryKind]:  # type: ignore[override]
        return self.inner.driver.memory_kinds

    @property
    def offers_contains(self) -> bool:
        return self.inner.driver.offers_contains

    @property
    def max_batch_keys(self) -> int | None:  # type: ignore[override]
        return self.inner.driver.max_batch_keys

    def _held(self, op: str, n: int) -> BatchResult | None:
        """Wait while ``{gate}/hold-{op}`` exists; a FAILED answer if interrupted meanwhile."""
        hold = self.gate / f"hold-{op}"
        if not hold.exists():
            return None
        (self.gate / f"arrived-{op}-{os.getpid()}-{next(self._seq)}").touch()
        while hold.exists():
            if self.interrupted.wait(_LOOK_S):
                return BatchResult.uniform(n, KeyStatus.FAILED, f"gated {op}: interrupted by shutdown while held")
        return None

    def register(self, regions: Sequence[SlotRegion]) -> None:
        self.inner.driver.register(regions)

    def unregister(self, regions: Sequence[SlotRegion]) -> None:
        self.inner.driver.unregister(regions)

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return self._held("put", len(keys)) or self.inner.driver.put(keys, addresses, sizes)

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return self._held("get", len(keys)) or self.inner.driver.get_into(keys, addresses, sizes)

    def exists(self, keys: Sequence[str]) -> np.ndarray:
        return self.inner.driver.exists(keys)

    def contains(self, keys: Sequence[str]) -> BatchResult:
        return self.inner.driver.contains(keys)

    def remove(self, keys: Sequence[str]) -> BatchResult:
        return self.inner.driver.remove(keys)

    def close(self) -> None:
        self.interrupted.set()
        self.inner.close()


class GatedBackend(BlobBackend):
    def shutdown(self) -> frozenset[Attempt]:
        driver = self.driver
        assert isinstance(driver, GatedDriver)
        driver.interrupted.set()
        return super().shutdown()


OPTIONS = (
    Option("inner", str, REQUIRED, "the real store backend's name (a blob store: files, mooncake)"),
    Option("inner_options", str, "{}", "the real backend's options, a JSON object"),
    Option("gate", str, REQUIRED, "directory of hold-get / hold-put files and arrived-* markers"),
    Option("namespace", str, "default", "key namespace when a hint names none"),
)


def create(options: Mapping[str, Any]) -> BlobBackend:
    try:
        inner_options = json.loads(options["inner_options"])
    except ValueError as exc:
        raise ConfigError(f"option 'inner_options' of backend 'gated' is not JSON: {exc}") from None
    inner = load(options["inner"]).build(inner_options)
    if not isinstance(inner, BlobBackend):
        inner.close()
        raise ConfigError(f"backend 'gated' wraps blob stores; {options['inner']!r} is a {type(inner).__name__}")
    gate = Path(options["gate"])
    gate.mkdir(parents=True, exist_ok=True)
    return GatedBackend(GatedDriver(inner, gate), namespace=options["namespace"], owns_driver=True)


plugin = Plugin(
    name="gated",
    contract_version=CONTRACT_VERSION,
    capabilities=blob_capabilities(frozenset({MemoryKind.HOST}), max_in_flight=64, lookup=True),
    create=create,
    options=OPTIONS,
    summary="test only: a real blob store whose calls a test can hold at a gate",
)


def install(site: Path) -> Path:
    """Install this module into ``site`` as the distribution ``kvwire-vllm-gated`` (a module and
    its dist-info: what pip would write), for a PYTHONPATH of its own. Returns ``site``."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "kvwire_vllm_gated.py").write_text(Path(__file__).read_text())
    info = site / "kvwire_vllm_gated-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvwire-vllm-gated\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[kvwire.backends]\ngated = kvwire_vllm_gated:plugin\n")
    (info / "top_level.txt").write_text("kvwire_vllm_gated\n")
    return site
