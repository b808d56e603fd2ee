"""The seed's request-free pull, through the public API, over real UCX endpoints: worker B pulls
a prompt's blocks straight from worker A's reuse tree given only A's transceiver state."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from worker_support import backend_problem, worker_pool

from kvwire.observe import hookimpl
from kvwire.runtime import ModelConfig, Worker

if _why := backend_problem("ucx"):
    pytest.skip(f"the ucx backend is unavailable: {_why}", allow_module_level=True)

MODEL = ModelConfig(layers=4, layers_per_group=2, heads=2, head_dim=16, block_tokens=16, max_tokens=1024, seed=3)


def settled_pins(worker: Worker, timeout: float = 10.0) -> int:
    """The worker's pins once its replies have settled: a serving worker releases a reply's lease
    when that reply quiesces, just after the receiver has its rows."""
    deadline = time.monotonic() + timeout
    while worker.pins() and time.monotonic() < deadline:
        time.sleep(0.01)
    return worker.pins()


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MODEL.vocab, n)


@pytest.fixture
def workers():
    def build(name: str, **kw) -> Worker:
        return Worker(MODEL, backend="ucx", num_blocks=kw.pop("num_blocks", 128), name=name, timeout_s=10, **kw)

    with worker_pool(build) as make:
        yield make


def test_seed_flow_pull_from_a_peers_reuse_tree(workers):
    a, b = workers("A"), workers("B")
    p = prompt(200)
    local = a.generate(p, max_tokens=3)                 # 1. fills A's reuse tree
    state = a.transceiver_state()                       # 2. opaque bytes
    assert isinstance(state, bytes) and state
    pulled = b.pull(p, source=state)                    # 3. B pulls with only the state
    assert pulled.status == "delivered" and pulled.blocks_moved == 12 and pulled.cached_tokens == 192
    remote = b.generate(p, max_tokens=3)
    assert remote.cached_tokens == 192                  # the pulled blocks are used, not recomputed
    assert torch.allclose(remote.logits, local.logits, rtol=1e-4, atol=1e-5)
    assert remote.tokens == local.tokens
    assert b.generate(p, max_tokens=1).cached_tokens > 0          # 4. a normal request reuses them
    assert b.generate(prompt(80, seed=5)).cached_tokens < 192     # 5. an unrelated prompt does not
    assert b.pull(p, source=state).blocks_moved == 0              # a second pull moves nothing
    assert a.counters.pulls_served == 1


def test_a_standing_offer_serves_pulls_without_the_serving_loop_and_gives_its_pins_back(workers):
    """Worker.offer (contract O1): B's pull of an offered prompt is answered by A's backend
    alone (A's serving loop answers nothing), the logits match a local prefill, and A's pins come
    back when the offer ends; afterwards the serving loop answers as before."""
    a, b, c, d = workers("A"), workers("B"), workers("C"), workers("D")
    p = prompt(200)
    local = a.generate(p, max_tokens=2)
    offer = a.offer(p, timeout_s=1.5)
    assert offer.blocks == 12 and not offer.ended and a.pins() == 12
    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.status == "delivered" and pulled.blocks_moved == 12
    assert a.counters.pulls_served == 0, "the serving loop answered an offered pull"
    assert a.backend.stats().pulls_offered == 1
    remote = b.generate(p, max_tokens=2)
    assert remote.cached_tokens == 192 and torch.allclose(remote.logits, local.logits, rtol=1e-4, atol=1e-5)
    nothing = a.offer(prompt(40, seed=9))  # nothing of it held: nothing offered, nothing pinned
    assert nothing.blocks == 0 and nothing.ended
    nothing.withdraw()
    assert settled_pins(a) == 0, "the offer's pins were not given back once it ran out"
    assert offer.ended
    assert c.pull(p, source=a.transceiver_state()).blocks_moved == 12
    assert a.counters.pulls_served == 1
    # withdrawn before it runs out: the pins come back, and the serving loop answers again
    again = a.offer(p, timeout_s=600)
    assert again.blocks == 12
    again.withdraw()
    again.withdraw()  # idempotent
    assert again.ended and settled_pins(a) == 0, "a withdrawn offer's pins were not given back"
    assert d.pull(p, source=a.transceiver_state()).blocks_moved == 12
    assert a.counters.pulls_served == 2 and a.backend.stats().pulls_offered == 1


def test_a_worker_that_checks_pulls_cannot_offer(workers):
    from kvwire.runtime.worker import TransferError

    a = workers("A", pull_secret=b"s" * 32)
    p = prompt(64)
    a.generate(p)
    with pytest.raises(TransferError, match="O1.11"):
        a.offer(p)
    assert a.pins() == 0


def test_settle_waits_until_the_serving_end_has_its_pins_back(workers):
    """The requester's pull returns as soon as its rows arrived; the serving end unpins when the
    requester's acknowledgement reaches it, a moment later. settle() waits for that."""
    a, b = workers("A"), workers("B")
    p = prompt(200)
    a.generate(p, max_tokens=1)
    from kvwire_ucx import wire
    from kvwire_ucx.faults import FrameFlow

    acks = b.backend.engine.faults.hold(FrameFlow.OUTGOING, lambda message: isinstance(message, wire.Ack))
    assert b.pull(p, source=a.transceiver_state()).blocks_moved == 12
    assert a.pins() > 0  # B is done; A still waits for the Ack, held at B
    acks.release(after_s=0.3)  # a slow Ack
    assert a.settle(5)
    assert a.pins() == 0


class ServedWatcher:
    """Observes pull_served on the serving worker: asks it, inside the announcement, whether
    every reply has ended, then holds the announcement until the test has asked too."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.inside: list[tuple[bool, int]] = []
        self.announced = threading.Event()
        self.checked = threading.Event()

    @hookimpl
    def kvwire_pull_served(self, worker: str, served: int) -> None:
        assert self.worker is not None
        self.inside.append((self.worker.wait_served(0), self.worker.pins()))
        self.announced.set()
        self.checked.wait(10)


def test_a_pull_announced_as_served_is_in_flight_for_wait_served(workers):
    """pull_served used to be announced before the reply was counted in flight: an observer
    asking wait_served(0), or a wait_served on another thread racing the announcement, was told
    every reply had ended while the reply's pins were still held. Both now find it in flight,
    and wait_served returns once its pins are back."""
    watcher = ServedWatcher()
    a, b = workers("A", observers=(watcher,)), workers("B")
    watcher.worker = a
    p = prompt(200)
    a.generate(p, max_tokens=1)
    pulled: list[object] = []
    puller = threading.Thread(target=lambda: pulled.append(b.pull(p, source=a.transceiver_state())))
    puller.start()
    try:
        assert watcher.announced.wait(10), "A never announced the pull it served"
        outside = a.wait_served(0)
    finally:
        watcher.checked.set()
        puller.join(30)
    ended_inside, pins_inside = watcher.inside[0]
    assert pins_inside > 0
    assert not ended_inside, "an observer of pull_served was told every reply had ended"
    assert not outside, "wait_served racing pull_served said every reply had ended"
    assert pulled and pulled[0].blocks_moved == 12, pulled
    assert a.wait_served(10) and a.pins() == 0


def test_sender_evicted_part_of_the_prefix_receiver_gets_the_held_prefix(workers):
    a, b = workers("A", num_blocks=12), workers("B")
    p = prompt(160)                                     # 10 whole blocks
    a.generate(p, max_tokens=1)
    a.generate(prompt(120, seed=8), max_tokens=1)       # pressure: A must evict the LRU tail
    held = a.cached_tokens(p) // 16
    assert 0 < held < 10
    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.status == "delivered" and pulled.cached_tokens == held * 16
    reference = workers("C").generate(p, max_tokens=2)
    remote = b.generate(p, max_tokens=2)
    assert torch.allclose(remote.logits, reference.logits, rtol=1e-4, atol=1e-5)
    assert a.generate(prompt(50, seed=9)).tokens                 # both keep serving
    assert b.pull(prompt(64, seed=10), source=a.transceiver_state()).status == "delivered"


def test_signed_pulls_and_refusals(workers):
    a = workers("A", pull_secret="s3cret", allowed_peers=["B"])
    b = workers("B", pull_secret="s3cret")
    intruder = workers("X", pull_secret="guess")
    stranger = workers("C", pull_secret="s3cret")
    p = prompt(64)
    a.generate(p)
    assert b.pull(p, source=a.transceiver_state()).cached_tokens == 64
    forged = intruder.pull(p, source=a.transceiver_state())
    assert forged.status == "failed" and "signature" in forged.reason and forged.cached_tokens == 0
    other = stranger.pull(p, source=a.transceiver_state())
    assert other.status == "failed" and "allowlist" in other.reason
    assert a.guard.refused == {"forged": 1, "not-allowed": 1}
    assert a.counters.pulls_declined == 2


def test_concurrent_pulls_from_several_receivers_leave_no_pins(workers):
    a = workers("A", num_blocks=256)
    prompts = [prompt(64, seed=100 + s) for s in range(25)]   # 4 whole blocks each
    for p in prompts:
        a.generate(p)
    state = a.transceiver_state()
    receivers = [workers(f"R{i}", num_blocks=128) for i in range(4)]
    results, errors = [], []

    def run(r: Worker, k: int) -> None:
        try:
            for j in range(len(prompts)):
                results.append(r.pull(prompts[(k * 7 + j) % len(prompts)], source=state))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r, i)) for i, r in enumerate(receivers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 100
    assert all(r.status == "delivered" and r.blocks_moved == 4 and r.cached_tokens == 64 for r in results)
    assert a.counters.pulls_served == 100
    assert settled_pins(a) == 0
