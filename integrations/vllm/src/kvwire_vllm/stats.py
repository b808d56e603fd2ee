"""The connector's transfer counters, reported through vLLM's connector stats (logged by vLLM's
stat logger) and its Prometheus hooks (on ``vllm serve``'s ``/metrics``)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from kvwire.observe.metrics import LOAD_SECONDS_BUCKETS, METRICS
from kvwire_vllm.plan import COUNTERS

__all__ = ["KvwireStats", "KvwirePromMetrics", "COUNTERS", "PROM_PREFIX", "PINS", "SECONDS_EACH", "ERROR_CAUSES"]

#: kvwire's metric names on vLLM's ``/metrics``: vLLM's prefix, then the names a standalone
#: Worker's :class:`kvwire.observe.metrics.Metrics` exposes.
PROM_PREFIX = "vllm:"
#: Each load's seconds (a list), blocks loads missed by cause (a dict), and the blocks the
#: scheduler side pins now (a gauge: the latest value wins when intervals are aggregated).
SECONDS_EACH, ERROR_CAUSES, PINS = "load_seconds_each", "load_error_causes", "pins_held"


class KvwireStats(KVConnectorStats):
    """Counters of one interval: loads and saves (attempts, whole blocks moved, bytes, seconds
    spent until quiescence), blocks a load missed (reported to vLLM for recompute) by cause, saves
    that did not store every block, scheduler lookups, pulls served, and for staged caches the
    blocks whose save was skipped and the loads that waited for staging slots; each load's
    seconds, and the blocks pinned now (served pulls, producers' holds)."""

    data: dict[str, Any]  # KVConnectorStats's field, restated for type checkers run without vLLM

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=_empty() | dict(data or {}))

    def add(self, **counts: float) -> None:
        for key, value in counts.items():
            self.data[key] = self.data.get(key, 0) + value

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key == SECONDS_EACH:
                self.data[key] = [*self.data.get(key, ()), *value]
            elif key == ERROR_CAUSES:
                causes = dict(self.data.get(key) or {})
                for cause, blocks in value.items():
                    causes[cause] = causes.get(cause, 0) + blocks
                self.data[key] = causes
            elif key == PINS:
                if value is not None:  # a gauge: the later report is the truth
                    self.data[key] = value
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        seconds = float(self.data.get("load_seconds", 0))
        out["load_gbps"] = round(self.data.get("load_bytes", 0) / seconds / 1e9, 3) if seconds > 0 else 0.0
        if self.data.get(PINS) is not None:
            out[PINS] = self.data[PINS]
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in COUNTERS) and self.data.get(PINS) is None


def _empty() -> dict[str, Any]:
    return {**{k: 0 for k in COUNTERS}, SECONDS_EACH: [], ERROR_CAUSES: {}, PINS: None}


class KvwirePromMetrics(KVConnectorPromMetrics):
    """kvwire's metrics on vLLM's ``/metrics`` (names in :data:`kvwire.observe.metrics.METRICS`,
    prefixed ``vllm:``), per engine, fed from each interval's :class:`KvwireStats` data."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in METRICS.items():
            if key in ("load_error_blocks", "pins", "load_seconds"):
                continue
            metric = self._counter_cls(name=PROM_PREFIX + name, documentation=doc, labelnames=labelnames)
            self._counters[key] = self._per_engine(metric)
        name, doc = METRICS["load_error_blocks"]
        self._errors = self._counter_cls(name=PROM_PREFIX + name, documentation=doc,
                                         labelnames=[*labelnames, "cause"])
        name, doc = METRICS["pins"]
        self._pins = self._per_engine(self._gauge_cls(name=PROM_PREFIX + name, documentation=doc,
                                                      labelnames=labelnames, multiprocess_mode="mostrecent"))
        name, doc = METRICS["load_seconds"]
        self._seconds = self._per_engine(self._histogram_cls(name=PROM_PREFIX + name, documentation=doc,
                                                             buckets=LOAD_SECONDS_BUCKETS, labelnames=labelnames))

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for key, metric in self._counters.items():
            value = data.get(key, 0)
            if value:
                metric[engine_idx].inc(value)
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for cause, blocks in (data.get(ERROR_CAUSES) or {}).items():
            self._errors.labels(*labels, str(cause)).inc(blocks)
        for seconds in data.get(SECONDS_EACH) or ():
            self._seconds[engine_idx].observe(seconds)
        if data.get(PINS) is not None:
            self._pins[engine_idx].set(data[PINS])
