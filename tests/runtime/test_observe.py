"""Metrics and observers: counts add up to the rows submitted; a raising observer never breaks
a transfer."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from kvwire.observe import hookimpl
from kvwire.observe.metrics import Metrics
from kvwire.runtime import ModelConfig, Worker

MODEL = ModelConfig(layers=2, layers_per_group=1, heads=2, head_dim=8, block_tokens=16, max_tokens=512, seed=5)


class Exploding:
    calls = 0

    @hookimpl
    def kvwire_transfer(self, worker: str) -> None:
        Exploding.calls += 1
        raise RuntimeError("observer bug")


def test_counts_add_up_and_a_raising_observer_is_harmless():
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    store = "observe-test"
    with Worker(MODEL, backend="memory", options={"store": store}, name="A", observers=(metrics, Exploding())) as a, \
         Worker(MODEL, backend="memory", options={"store": store}, name="B", observers=(metrics,)) as b:
        p = np.random.default_rng(1).integers(0, MODEL.vocab, 96)
        a.generate(p[:64])
        published = a.publish(p[:64])                 # 4 blocks held → 4 rows per group, 2 groups
        pulled = b.pull(p, source=a.transceiver_state())  # wants 6 blocks; 4 arrive, 2 miss
        assert published.status == pulled.status == "delivered"
        assert Exploding.calls == 1 and a.observers.failures == 1

    def value(name, **labels):
        return registry.get_sample_value(name, labels) or 0.0

    groups = len(MODEL.layout(8).groups)
    fetch = {"worker": "B", "backend": "memory", "direction": "fetch"}
    pub = {"worker": "A", "backend": "memory", "direction": "publish"}
    assert value("kvwire_submissions_total", **pub) == 1 and value("kvwire_submissions_total", **fetch) == 1
    assert value("kvwire_rows_total", **pub, result="delivered") == 4 * groups
    delivered = value("kvwire_rows_total", **fetch, result="delivered")
    missed = value("kvwire_rows_total", **fetch, result="missed")
    assert (delivered, missed) == (4 * groups, 2 * groups)
    assert delivered + missed == 6 * groups                       # every submitted row counted once
    assert value("kvwire_bytes_total", **fetch) == pulled.bytes_moved


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []

    @hookimpl
    def kvwire_blocks(self, worker: str, stored: int, evicted: int, pinned: int) -> None:
        self.events.append((stored, evicted))


def test_block_events_report_what_was_stored_and_evicted():
    rec = Recorder()
    with Worker(MODEL, backend="memory", options={"store": "blocks-events"}, name="W", num_blocks=8,
                observers=(rec,)) as w:
        rng = np.random.default_rng(2)
        w.generate(rng.integers(0, MODEL.vocab, 16 * 5 + 1))        # stores 5 blocks
        assert rec.events == [(5, 0)]
        w.generate(rng.integers(0, MODEL.vocab, 16 * 5 + 1))        # 5 more: 8 slots, so 2+ evicted
        stored, evicted = rec.events[-1]
        assert stored == 5 and evicted >= 2
        assert sum(s for s, _ in rec.events) - sum(e for _, e in rec.events) == w.lender.stats()["blocks_committed"]
