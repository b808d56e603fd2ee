"""Counters per backend and per worker, exposed through ``prometheus-client``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvwire.contract.outcome import Cause, OutcomeStatus
from kvwire.observe import cause_label
from kvwire.observe.hooks import hookimpl

if TYPE_CHECKING:
    from kvwire.runtime.holding import Direction

__all__ = ["Metrics"]


class Metrics:
    """An observer that counts what workers announce. Give it a registry of its own (tests, one
    exporter per worker) or share the process's default one."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import REGISTRY

        self.registry = registry if registry is not None else REGISTRY
        labels = ("worker", "backend", "direction")
        self.submissions = Counter("kvwire_submissions", "attempts submitted", labels, registry=self.registry)
        self.rows = Counter("kvwire_rows", "rows submitted, by result", (*labels, "result"), registry=self.registry)
        self.bytes = Counter("kvwire_bytes", "bytes moved", labels, registry=self.registry)
        self.deadlines = Counter("kvwire_deadline_expiries", "attempts that failed at their deadline", labels,
                                 registry=self.registry)
        self.undelivered = Counter("kvwire_undelivered", "attempts that failed or were cancelled, by status and "
                                   "cause ('unspecified' from a contract 1.0 backend)", (*labels, "status", "cause"),
                                   registry=self.registry)
        self.refusals = Counter("kvwire_refusals", "submissions refused", labels, registry=self.registry)
        self.pulls = Counter("kvwire_pulls_served", "pulls answered", ("worker", "backend", "result"),
                             registry=self.registry)
        self.pins = Gauge("kvwire_pins", "blocks pinned now", ("worker",), registry=self.registry)
        self.blocks = Counter("kvwire_blocks", "reuse-tree block events", ("worker", "event"), registry=self.registry)

    @hookimpl
    def kvwire_transfer(self, worker: str, backend: str, direction: Direction, rows: int, delivered: int,
                        nbytes: int, seconds: float, status: OutcomeStatus, reason: str | None,
                        cause: Cause | None) -> None:
        lab = (worker, backend, direction.value)
        self.submissions.labels(*lab).inc()
        failed = status is OutcomeStatus.FAILED
        self.rows.labels(*lab, "delivered").inc(delivered)
        self.rows.labels(*lab, "failed" if failed else "missed").inc(rows - delivered)
        self.bytes.labels(*lab).inc(nbytes)
        if status is not OutcomeStatus.DELIVERED:
            self.undelivered.labels(*lab, status.value, cause_label(cause)).inc()
        if cause is Cause.DEADLINE:
            self.deadlines.labels(*lab).inc()

    @hookimpl
    def kvwire_refused(self, worker: str, backend: str, direction: Direction, reason: str) -> None:
        self.refusals.labels(worker, backend, direction.value).inc()

    @hookimpl
    def kvwire_pull_served(self, worker: str, backend: str, peer: str, requested: int, served: int) -> None:
        self.pulls.labels(worker, backend, "served").inc()

    @hookimpl
    def kvwire_pull_declined(self, worker: str, backend: str, peer: str, reason: str) -> None:
        self.pulls.labels(worker, backend, "declined").inc()

    @hookimpl
    def kvwire_blocks(self, worker: str, stored: int, evicted: int, pinned: int) -> None:
        self.blocks.labels(worker, "stored").inc(stored)
        self.blocks.labels(worker, "evicted").inc(evicted)
        self.pins.labels(worker).set(pinned)
