"""Counters per backend and per worker, exposed through ``prometheus-client``."""

from __future__ import annotations

import threading
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvwire.contract.outcome import Cause, OutcomeStatus
from kvwire.holding import Direction
from kvwire.observe import cause_label
from kvwire.observe.hooks import hookimpl


class _Pins(Protocol):
    def pins(self) -> int: ...


class Watched(Protocol):
    """What :meth:`Metrics.watch` reads of a worker (a ``kvwire.runtime.Worker``): its name and
    its cache's pins. A protocol, so that ``observe`` does not import the runtime that imports it."""

    @property
    def name(self) -> str: ...

    @property
    def lender(self) -> _Pins: ...

__all__ = ["Metrics", "METRICS", "LOAD_SECONDS_BUCKETS", "MISSING"]

#: The metrics a worker's loads, saves and pulls are seen by, under the same names wherever
#: kvwire runs: a :class:`Metrics` of standalone Workers, and kvwire-vllm's connector on vLLM's
#: ``/metrics`` (there prefixed ``vllm:`` and labelled by vLLM's model and engine). Counters are
#: exposed with prometheus' ``_total`` suffix. key: (name, help).
METRICS: dict[str, tuple[str, str]] = {
    "load_blocks": ("kvwire_load_blocks", "blocks loaded whole (arrived in every layer group)"),
    "load_bytes": ("kvwire_load_bytes", "bytes loaded"),
    "save_blocks": ("kvwire_save_blocks", "blocks saved (held by the store in every layer group)"),
    "save_bytes": ("kvwire_save_bytes", "bytes saved"),
    "load_error_blocks": ("kvwire_load_error_blocks", "blocks a load did not get, by cause ('missing': the other "
                          "end did not hold them; else the outcome's cause); they are recomputed"),
    "pulls_served": ("kvwire_pulls_served", "pulls of this worker's blocks answered"),
    "pins": ("kvwire_pins", "blocks pinned now (for pulls being answered, leases, producers' holds)"),
    "load_seconds": ("kvwire_load_seconds", "seconds per load, from its submission until it quiesced"),
}
#: Buckets of the seconds-per-load histogram: a local load of a few blocks to a deadline's worth.
LOAD_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: The load-error cause of blocks the other end concluded without holding.
MISSING = "missing"


class Metrics:
    """An observer that counts what workers announce. Give it a registry of its own (tests, one
    exporter per worker) or share the process's default one. :meth:`serve` exposes the registry
    over HTTP for Prometheus to scrape; :meth:`watch` keeps a worker's pins gauge current."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from prometheus_client import REGISTRY

        self.registry = registry if registry is not None else REGISTRY
        self._server: Any = None
        self._thread: threading.Thread | None = None
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
        self.pins = Gauge(METRICS["pins"][0], METRICS["pins"][1], ("worker",), registry=self.registry)
        kinds = ("worker", "backend")

        def counter(key: str, labels: tuple[str, ...] = kinds) -> Counter:
            return Counter(*METRICS[key], labels, registry=self.registry)

        self.load_blocks, self.load_bytes = counter("load_blocks"), counter("load_bytes")
        self.save_blocks, self.save_bytes = counter("save_blocks"), counter("save_bytes")
        self.load_errors = counter("load_error_blocks", (*kinds, "cause"))
        self.load_seconds = Histogram(*METRICS["load_seconds"], kinds, buckets=LOAD_SECONDS_BUCKETS,
                                      registry=self.registry)
        self.blocks = Counter("kvwire_blocks", "reuse-tree block events", ("worker", "event"), registry=self.registry)

    @hookimpl
    def kvwire_transfer(self, worker: str, backend: str, direction: Direction, rows: int, delivered: int,
                        nbytes: int, seconds: float, status: OutcomeStatus, reason: str | None,
                        cause: Cause | None, blocks: int, whole: int) -> None:
        if direction is Direction.FETCH:
            self.load_blocks.labels(worker, backend).inc(whole)
            self.load_bytes.labels(worker, backend).inc(nbytes)
            self.load_seconds.labels(worker, backend).observe(seconds)
            if blocks > whole:
                label = MISSING if status is OutcomeStatus.DELIVERED else cause_label(cause)
                self.load_errors.labels(worker, backend, label).inc(blocks - whole)
        else:
            self.save_blocks.labels(worker, backend).inc(whole)
            self.save_bytes.labels(worker, backend).inc(nbytes)
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

    def watch(self, worker: Watched) -> None:
        """Keep ``worker``'s pins gauge current: read from its cache at each scrape."""
        self.pins.labels(worker.name).set_function(worker.lender.pins)

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Expose this registry for Prometheus at ``http://addr:port/metrics`` (port 0: a free
        one) from a thread of its own until :meth:`close`; returns the port."""
        if self._server is not None:
            raise RuntimeError(f"already serving on port {self._server.server_port}")
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop serving (if serving): the port and the thread are given back. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
