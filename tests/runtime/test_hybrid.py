"""A hybrid model (attention layers in PAGED groups, gated linear recurrences in a STATE group)
end to end over the stores, memory and Mooncake: published with the STATE checkpoint at the end
of its prefix, pulled, and decoded with logits equal to a local prefill; a partial prefix
resumes at the last checkpoint that arrived; a STATE row that did not arrive is never used; a
checkpoint never stands for another prompt. (Over UCX: ``test_hybrid_peer.py``.)"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from hybrid_support import MODEL, POISON, LosesState, prompt, same
from worker_support import backend_problem, worker_pool

from kvwire.registry import load_config
from kvwire.runtime import Worker


@pytest.fixture(scope="module")
def mooncake_config() -> Iterator[object]:
    if why := backend_problem("mooncake"):
        pytest.skip(f"the mooncake backend is unavailable: {why}")
    with load_config(backend="mooncake", validate=False).services() as config:
        yield config


@pytest.fixture(params=["memory", "mooncake"])
def workers(request: pytest.FixtureRequest) -> Iterator[Callable[..., Worker]]:
    """Workers on one store; each test has its own store (memory) or namespace (Mooncake)."""
    tag = re.sub(r"[^A-Za-z0-9.-]", "-", request.node.name)
    if request.param == "memory":
        config = load_config(backend="memory", validate=False)
        options = {"store": f"hybrid-{tag}"}
    else:
        config = request.getfixturevalue("mooncake_config")
        options = {"namespace": f"hybrid-{tag}"}

    def build(name: str, *, lose_state: bool = False, **kw: object) -> Worker:
        cfg = type(config)(config.name, {**config.options, **options}, config.source, config.worker)
        instance = LosesState(cfg.build()) if lose_state else None
        return Worker(MODEL, config=cfg, num_blocks=kw.pop("num_blocks", 64), name=name, timeout_s=10,
                      instance=instance, **kw)

    with worker_pool(build) as make:
        yield make


def test_a_hybrid_prompt_published_pulled_and_decoded_equals_a_local_prefill(workers):
    a, b = workers("A"), workers("B")
    p = prompt(200)
    local = a.generate(p, max_tokens=3)
    published = a.publish(p)
    assert published.status == "delivered" and published.blocks_moved == 12
    assert published.state_rows_moved == 1, "the checkpoint at the prefix's end goes with its blocks"

    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.status == "delivered" and pulled.blocks_moved == 12 and pulled.state_rows_moved == 1
    assert pulled.cached_tokens == 192
    assert b.cached_tokens(p) == 192

    remote = b.generate(p, max_tokens=3)
    assert remote.cached_tokens == 192, "B resumed at the pulled checkpoint, not at 0"
    assert same(remote.logits, local.logits) and remote.tokens == local.tokens
    again = b.pull(p, source=a.transceiver_state())
    assert again.status == "skipped" and again.blocks_moved == 0 and again.state_rows_moved == 0


def test_a_prompt_of_whole_blocks_moves_the_checkpoint_where_its_request_resumes(workers):
    """A request computes at least its last token, so a 192-token prompt resumes at 176: the
    publish offers the checkpoints at 192 (for a longer prompt) and at 176, the pull fetches
    the one at 176 and commits all 12 blocks, and a second pull moves nothing."""
    a, b = workers("A"), workers("B")
    p = prompt(192, seed=2)
    local = a.generate(p)
    published = a.publish(p)
    assert published.blocks_moved == 12 and published.state_rows_moved == 2
    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.blocks_moved == 12 and pulled.state_rows_moved == 1 and pulled.cached_tokens == 176
    remote = b.generate(p)
    assert remote.cached_tokens == 176 and same(remote.logits, local.logits)
    assert b.pull(p, source=a.transceiver_state()).status == "skipped"
    longer = np.concatenate([p, prompt(40, seed=9)])
    assert b.pull(longer, source=a.transceiver_state()).cached_tokens == 192, "the checkpoint at 192 was published"


def test_a_partial_prefix_resumes_at_the_last_checkpoint_that_arrived(workers):
    a, b, c = workers("A"), workers("B"), workers("C")
    longer = prompt(200)
    a.generate(longer[:100])
    a.publish(longer[:100])                 # the store holds 6 blocks and the checkpoint at 96
    pulled = b.pull(longer, source=a.transceiver_state())
    assert pulled.status == "delivered" and pulled.blocks_moved == 6 and pulled.state_rows_moved == 1
    assert pulled.cached_tokens == 96
    remote = b.generate(longer, max_tokens=2)
    assert remote.cached_tokens == 96
    local = c.generate(longer, max_tokens=2)
    assert same(remote.logits, local.logits) and remote.tokens == local.tokens


def test_a_state_row_that_did_not_arrive_is_never_used(workers):
    """The store holds the whole prompt and its checkpoint, but B's backend loses the STATE row
    (false bit, bytes overwritten): B resumes at its own last good checkpoint and recomputes
    from there, and its logits equal a local prefill's."""
    a, c = workers("A"), workers("C")
    b = workers("B", lose_state=True)
    p = prompt(200)
    a.generate(p)
    a.publish(p)
    b.generate(p[:100])                     # B's own checkpoints: blocks 0..5 (96 tokens)
    pulled = b.pull(p, source=a.transceiver_state())
    assert b.backend.rows_lost == 1
    assert pulled.blocks_skipped == 6 and pulled.blocks_moved == 6 and pulled.state_rows_moved == 0
    assert pulled.cached_tokens == 96, "no checkpoint arrived: resume at the last good one"
    assert b.cached_tokens(p) == 96
    remote = b.generate(p, max_tokens=2)
    assert remote.cached_tokens == 96
    local = c.generate(p, max_tokens=2)
    assert same(remote.logits, local.logits) and remote.tokens == local.tokens
    assert torch.isfinite(remote.logits).all()


def test_a_lost_state_row_with_no_checkpoint_held_recomputes_from_the_start(workers):
    a = workers("A")
    b = workers("B", lose_state=True)
    p = prompt(120, seed=4)
    local = a.generate(p)
    a.publish(p)
    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.blocks_moved == 7 and pulled.state_rows_moved == 0 and pulled.cached_tokens == 0
    remote = b.generate(p)
    assert remote.cached_tokens == 0 and same(remote.logits, local.logits)


def test_the_state_of_one_prompt_is_never_used_for_another(workers):
    """Two prompts share 72 tokens (4 whole blocks), then diverge. The store holds the first's
    blocks and its checkpoint at 192; B, pulling the second, gets the 4 shared blocks but no
    checkpoint (none was published at 64), so it resumes at 0 and its logits are still right."""
    a, b, c = workers("A"), workers("B"), workers("C")
    shared = prompt(72, seed=1)
    first = np.concatenate([shared, prompt(128, seed=2)])
    second = np.concatenate([shared, prompt(128, seed=3)])
    a.generate(first)
    a.publish(first)
    pulled = b.pull(second, source=a.transceiver_state())
    assert pulled.blocks_moved == 4 and pulled.state_rows_moved == 0 and pulled.cached_tokens == 0
    remote = b.generate(second, max_tokens=2)
    local = c.generate(second, max_tokens=2)
    assert same(remote.logits, local.logits) and remote.tokens == local.tokens
    # and the first prompt, published whole, still resumes at its own checkpoint
    assert b.pull(first, source=a.transceiver_state()).cached_tokens == 192


def test_a_wrong_state_changes_the_logits():
    """What the tests above lean on: the recurrence's state matters, so a state used where it
    does not belong (or a poisoned one) would show in the logits."""
    with Worker(MODEL, backend="memory", options={"store": "hybrid-wrong-state"}, num_blocks=32, name="W") as w:
        p = prompt(100, seed=6)
        want = w.generate(p).logits
        rows = w.lender.pool(MODEL.state_group)
        base = w.lender.layout.num_state_slots
        rows[base:] += 0.5                                 # every checkpoint off by a little
        bent = w.generate(p)
        assert bent.cached_tokens == 96 and not same(bent.logits, want)
        rows[base:] = torch.frombuffer(bytearray([POISON] * rows[base:].numel() * 4), dtype=torch.float32
                                       ).reshape(rows[base:].shape)
        assert not same(w.generate(p).logits, want)
