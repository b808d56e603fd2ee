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


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample the exporter at ``port`` serves, parsed as Prometheus parses it."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_worker_exposes_loads_saves_errors_pulls_and_pins_to_a_scrape():
    """The metrics kvwire-vllm's connector puts on vLLM's /metrics, from standalone Workers
    through prometheus-client's HTTP exporter: blocks and bytes loaded and saved, load errors by
    cause, pulls served, pins, seconds per load."""
    from kvwire.observe.metrics import METRICS

    registry = CollectorRegistry()
    metrics = Metrics(registry)
    store = "observe-scrape"
    port = metrics.serve()
    try:
        with Worker(MODEL, backend="memory", options={"store": store}, name="A", observers=(metrics,)) as a, \
             Worker(MODEL, backend="memory", options={"store": store}, name="B", observers=(metrics,)) as b:
            metrics.watch(a)
            p = np.random.default_rng(3).integers(0, MODEL.vocab, 96)
            a.generate(p[:64])
            assert a.publish(p[:64]).blocks_moved == 4
            pulled = b.pull(p, source=a.transceiver_state())   # 6 wanted: 4 arrive, 2 the store lacks
            assert pulled.blocks_moved == 4
            samples = scrape(port)
            held = a.lender.open_request(p[:64])  # a request reusing the 4 blocks pins them
            try:
                assert scrape(port)[("kvwire_pins", (("worker", "A"),))] == a.pins() == 4
            finally:
                a.lender.close_request(held)
            assert scrape(port)[("kvwire_pins", (("worker", "A"),))] == 0
    finally:
        metrics.close()
    A = (("backend", "memory"), ("worker", "A"))
    B = (("backend", "memory"), ("worker", "B"))
    assert samples[(METRICS["save_blocks"][0] + "_total", A)] == 4
    assert samples[(METRICS["save_bytes"][0] + "_total", A)] > 0
    assert samples[(METRICS["load_blocks"][0] + "_total", B)] == 4
    assert samples[(METRICS["load_bytes"][0] + "_total", B)] == pulled.bytes_moved
    assert samples[(METRICS["load_error_blocks"][0] + "_total", (*B[:1], ("cause", "missing"), B[1]))] == 2
    assert samples[(METRICS["load_seconds"][0] + "_count", B)] == 1
    assert samples[(METRICS["load_seconds"][0] + "_sum", B)] > 0
    import urllib.error

    import pytest

    with pytest.raises(urllib.error.URLError):  # closed: the port is given back
        scrape(port)
