"""Outcomes are counted by their structured cause (A10), never by their reason text: a reason
that says "deadline" with another cause is not a deadline, and a contract 1.0 backend's failure
(no cause) is counted as "unspecified"."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvwire.contract import Attempt, Backend, Capabilities, Hint, Outcome, SlotRegion, View
from kvwire.contract.backend import Registration, WakeFn
from kvwire.contract.outcome import Cause, OutcomeStatus
from kvwire.holding import Direction
from kvwire.observe.metrics import Metrics
from kvwire.registry import load
from kvwire.runtime import ModelConfig, Worker

MODEL = ModelConfig(layers=2, layers_per_group=1, heads=2, head_dim=8, block_tokens=16, max_tokens=512, seed=5)


class Concluded(Attempt):
    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome

    def poll(self) -> Outcome | None:
        return self.outcome

    def quiesced(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


class FailingFetches(Backend):
    """The memory backend, except that every fetch fails at once with this reason and cause."""

    def __init__(self, inner: Backend, reason: str, cause: Cause | None) -> None:
        self.inner, self.reason, self.cause = inner, reason, cause

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        return self.inner.register_regions(regions)

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        attempt = Concluded(Outcome.failed(self.reason, view.row_masks(), cause=self.cause))
        wake()
        return attempt

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self.inner.publish(view, hint, wake)

    def shutdown(self) -> frozenset[Attempt]:
        return self.inner.shutdown()

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("reason,cause,label,deadline", [
    ("the store faulted", Cause.DEADLINE, "deadline", 1),
    ("deadline text, but a fault", Cause.FAULT, "fault", 0),
    ("deadline passed (a 1.0 backend)", None, "unspecified", 0),
])
def test_a_worker_counts_failures_by_cause(reason: str, cause: Cause | None, label: str, deadline: int):
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    store = f"causes-{label}"
    options = {"store": store}
    inner = load("memory").build(options)
    with Worker(MODEL, backend="memory", options=options, name="A") as a, \
         Worker(MODEL, backend="memory", options=options, name="B", observers=(metrics,),
                instance=FailingFetches(inner, reason, cause)) as b:
        p = np.random.default_rng(3).integers(0, MODEL.vocab, 64)
        a.generate(p)
        a.publish(p)
        pulled = b.pull(p, source=a.transceiver_state())
        assert pulled.status == "failed" and pulled.cached_tokens == 0
        assert b.counters.deadline_expiries == deadline and b.counters.causes == {label: 1}

    labels = {"worker": "B", "backend": "memory", "direction": "fetch"}
    assert registry.get_sample_value("kvwire_undelivered_total", {**labels, "status": "failed", "cause": label}) == 1
    assert (registry.get_sample_value("kvwire_deadline_expiries_total", labels) or 0.0) == deadline


def test_metrics_label_cancellations_by_cause():
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.kvwire_transfer("W", "memory", Direction.FETCH, 4, 1, 64, 0.1, OutcomeStatus.CANCELLED, None,
                            Cause.PEER_CANCELLED, 4, 1)
    metrics.kvwire_transfer("W", "memory", Direction.FETCH, 4, 4, 256, 0.1, OutcomeStatus.DELIVERED, None, None, 4, 4)
    labels = {"worker": "W", "backend": "memory", "direction": "fetch"}
    assert registry.get_sample_value("kvwire_undelivered_total",
                                     {**labels, "status": "cancelled", "cause": "peer-cancelled"}) == 1
    # the 3 blocks the cancelled load did not get are load errors under its cause
    assert registry.get_sample_value("kvwire_load_error_blocks_total",
                                     {"worker": "W", "backend": "memory", "cause": "peer-cancelled"}) == 3
    assert registry.get_sample_value("kvwire_submissions_total", labels) == 2
    assert registry.get_sample_value("kvwire_rows_total", {**labels, "result": "missed"}) == 3
