"""The connector's transfer counters, reported through vLLM's connector stats."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvwire_vllm.plan import COUNTERS

__all__ = ["KvwireStats", "COUNTERS"]


class KvwireStats(KVConnectorStats):
    """Counters of one interval: loads and saves (attempts, whole blocks moved, bytes, seconds
    spent until quiescence), blocks a load missed (reported to vLLM for recompute), saves that
    did not store every block, scheduler lookups, and for staged caches the blocks whose save was
    skipped and the loads that waited for staging slots."""

    data: dict[str, Any]  # KVConnectorStats's field, restated for type checkers run without vLLM

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data={k: 0 for k in COUNTERS} | dict(data or {}))

    def add(self, **counts: float) -> None:
        for key, value in counts.items():
            self.data[key] = self.data.get(key, 0) + value

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        seconds = float(self.data.get("load_seconds", 0))
        out["load_gbps"] = round(self.data.get("load_bytes", 0) / seconds / 1e9, 3) if seconds > 0 else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in COUNTERS)
