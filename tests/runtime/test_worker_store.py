"""The runtime over the embedded in-memory store: publish on one worker, pull on another, and
prove the transfer by what the tiny model computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from worker_support import worker_pool

from kvwire.runtime import ModelConfig, StateError, Worker

MODEL = ModelConfig(layers=4, layers_per_group=2, heads=2, head_dim=16, block_tokens=16, max_tokens=1024, seed=3)


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MODEL.vocab, n)


@pytest.fixture
def workers(request):
    store = f"test-{request.node.name}"

    def build(name: str, **kw) -> Worker:
        return Worker(MODEL, backend="memory", options={"store": store}, num_blocks=128, name=name, timeout_s=10, **kw)

    with worker_pool(build) as make:
        yield make


def test_seed_flow_publish_then_pull_then_decode(workers):
    a, b = workers("A"), workers("B")
    p = prompt(200)
    local = a.generate(p, max_tokens=4)
    assert local.cached_tokens == 0
    published = a.publish(p)
    assert published.status == "delivered" and published.blocks_moved == 200 // 16
    state = a.transceiver_state()
    assert isinstance(state, bytes) and state

    pulled = b.pull(p, source=state)
    assert pulled.status == "delivered"
    assert pulled.blocks_moved == 12 and pulled.blocks_skipped == 0
    assert pulled.cached_tokens == 192
    assert pulled.bytes_moved == 12 * sum(a.lender.layout.group(g.group_id).slot_bytes for g in a.lender.layout.groups)

    remote = b.generate(p, max_tokens=4)
    assert remote.cached_tokens == 192            # the pulled blocks were used, not recomputed
    assert torch.allclose(remote.logits, local.logits, rtol=1e-4, atol=1e-5)
    assert remote.tokens == local.tokens

    again = b.pull(p, source=state)                # a second pull of the same prompt moves nothing
    assert again.status == "skipped" and again.blocks_moved == 0 and again.blocks_skipped == 12

    unrelated = b.generate(prompt(100, seed=9), max_tokens=1)
    assert unrelated.cached_tokens < remote.cached_tokens


def test_partial_prefix_is_a_success_and_the_rest_is_computed(workers):
    a, b = workers("A"), workers("B")
    p = prompt(160)
    a.generate(p[:64], max_tokens=1)               # A holds only the first 4 blocks
    a.publish(p[:64])
    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.status == "delivered"
    assert pulled.cached_tokens == 64 and pulled.blocks_moved == 4
    reference = workers("C").generate(p, max_tokens=2)
    remote = b.generate(p, max_tokens=2)
    assert remote.cached_tokens == 64
    assert torch.allclose(remote.logits, reference.logits, rtol=1e-4, atol=1e-5)
    assert remote.tokens == reference.tokens


def test_blocks_already_held_are_skipped(workers):
    a, b = workers("A"), workers("B")
    p = prompt(128)
    a.generate(p, max_tokens=1)
    a.publish(p)
    b.generate(p[:48], max_tokens=1)               # B already holds 3 blocks
    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.blocks_skipped == 3 and pulled.blocks_moved == 5 and pulled.cached_tokens == 128


def test_states_of_another_scope_or_garbage_are_refused(workers):
    a = workers("A")
    other_tenant = workers("T", tenant_salt=b"tenant-2")
    p = prompt(64)
    a.generate(p)
    a.publish(p)
    with pytest.raises(StateError, match="scope"):
        other_tenant.pull(p, source=a.transceiver_state())
    with pytest.raises(StateError, match="magic"):
        other_tenant.pull(p, source=b"\x00garbage")
    assert other_tenant.cached_tokens(p) == 0


def test_another_tenants_prompt_misses_in_a_shared_store(workers):
    a = workers("A")
    t = workers("T", tenant_salt=b"tenant-2")
    p = prompt(64)
    a.generate(p)
    a.publish(p)
    # T names the same tokens differently, so even reading the same namespace finds nothing
    t.generate(p[:16])
    assert not np.array_equal(t.lender.names(p), a.lender.names(p))
    forged = t.transceiver_state()  # T's own state, same store namespace as A's
    pulled = t.pull(p, source=forged)
    assert pulled.status == "delivered" and pulled.blocks_moved == 0 and pulled.cached_tokens == 16


def test_a_config_files_worker_table_sets_name_deadline_and_pull_guard(tmp_path):
    from kvwire.registry import ConfigError, load_config

    good = tmp_path / "kvwire.toml"
    good.write_text('[backend]\nname = "memory"\n[backend.options]\nstore = "worker-table"\n'
                    '[worker]\nname = "prefill-0"\ntimeout_s = 7\npull_secret = "s3cret"\nallowed_peers = ["decode-0"]\n')
    w = Worker(MODEL, config=load_config(good), num_blocks=16)
    try:
        assert (w.name, w.timeout_s) == ("prefill-0", 7.0)
        assert w.guard.secret == b"s3cret" and w.guard.allowed == frozenset({"decode-0"})
    finally:
        w.close()
    for table, problem in (('nmae = "x"', "unknown key worker.nmae"), ("timeout_s = true", "worker.timeout_s has the wrong type"),
                           ("allowed_peers = [1]", "worker.allowed_peers must be a list of worker names")):
        bad = tmp_path / "bad.toml"
        bad.write_text(f'[backend]\nname = "memory"\n[worker]\n{table}\n')
        with pytest.raises(ConfigError, match=problem):
            Worker(MODEL, config=load_config(bad), num_blocks=16)
