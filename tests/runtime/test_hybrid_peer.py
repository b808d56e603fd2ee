"""A hybrid model over UCX, two-sided and one-sided: B pulls a prompt's attention blocks and then
its STATE checkpoint (a one-name pull, the checkpoint named like its block) straight from A's
reuse tree, and decodes with logits equal to a local prefill; a partial prefix resumes at the
last checkpoint that arrived; a lost STATE row is never used; a checkpoint never stands for
another prompt.

The one-sided cases run in a pytest process of their own (``test_the_one_sided_cases_in_their_own_process``):
once a process has loaded NIXL, a later two-sided UCX transfer in it can crash when a peer dies
(UCX 1.21 without its registration cache; see backends/ucx/README.md), and this run goes on to
two-sided tests that kill peers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hybrid_support import MODEL, LosesState, prompt, same
from worker_support import backend_problem, worker_pool

from kvwire.registry import load, load_config
from kvwire.runtime import Worker

if _why := backend_problem("ucx"):
    pytest.skip(f"the ucx backend is unavailable: {_why}", allow_module_level=True)


#: Which mode this process tests: two-sided here, one-sided in the child process below.
MODE = os.environ.get("KVWIRE_HYBRID_PEER_MODE", "two-sided")


def test_the_one_sided_cases_in_their_own_process(tmp_path: Path) -> None:
    """Every case of this module, one-sided, in a fresh pytest process."""
    if MODE != "two-sided":
        pytest.skip("this is the child process")
    from kvwire_ucx.nixl import nixl_problem

    if nixl_problem() is not None:
        pytest.skip(nixl_problem())
    here = Path(__file__).parent
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, KVWIRE_HYBRID_PEER_MODE="one-sided",
               PYTHONPATH=os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]


@pytest.fixture(params=[MODE])
def workers(request: pytest.FixtureRequest) -> Iterator[Callable[..., Worker]]:
    options = {"mode": request.param}

    def build(name: str, *, lose_state: bool = False, **kw: object) -> Worker:
        instance = None
        if lose_state:
            config = load_config(backend="ucx", validate=False)
            instance = LosesState(load("ucx").build({**config.options, **options}))
        return Worker(MODEL, backend="ucx", options=options, num_blocks=kw.pop("num_blocks", 64), name=name,
                      timeout_s=10, instance=instance, **kw)

    with worker_pool(build, wait_served=True) as make:
        yield make


def test_a_hybrid_prompt_pulled_from_a_peer_and_decoded_equals_a_local_prefill(workers):
    a, b = workers("A"), workers("B")
    p = prompt(200)
    local = a.generate(p, max_tokens=3)
    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.status == "delivered" and pulled.blocks_moved == 12 and pulled.state_rows_moved == 1
    assert pulled.cached_tokens == 192
    remote = b.generate(p, max_tokens=3)
    assert remote.cached_tokens == 192
    assert same(remote.logits, local.logits) and remote.tokens == local.tokens
    assert b.pull(p, source=a.transceiver_state()).status == "skipped"
    assert a.counters.pulls_served == 2, "one pull of the PAGED groups, one of the STATE group"


def test_a_prompt_of_whole_blocks_pulls_the_checkpoint_where_its_request_resumes(workers):
    a, b = workers("A"), workers("B")
    p = prompt(192, seed=2)
    local = a.generate(p)
    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.blocks_moved == 12 and pulled.state_rows_moved == 1 and pulled.cached_tokens == 176
    remote = b.generate(p)
    assert remote.cached_tokens == 176 and same(remote.logits, local.logits)
    assert b.pull(p, source=a.transceiver_state()).status == "skipped"


def test_a_sender_holding_part_of_the_prefix_gives_the_checkpoint_at_its_end(workers):
    a, b, c = workers("A", num_blocks=12), workers("B"), workers("C")
    p = prompt(160)                                     # 10 whole blocks
    a.generate(p)
    a.generate(prompt(120, seed=8))                     # pressure: A evicts the LRU tail of p
    held = a.cached_tokens(p) // 16
    assert 0 < held < 10
    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.status == "delivered" and pulled.blocks_moved == held and pulled.state_rows_moved == 1
    assert pulled.cached_tokens == held * 16
    remote = b.generate(p, max_tokens=2)
    assert remote.cached_tokens == held * 16
    local = c.generate(p, max_tokens=2)
    assert same(remote.logits, local.logits) and remote.tokens == local.tokens


def test_a_state_row_that_did_not_arrive_is_never_used(workers):
    a, c = workers("A"), workers("C")
    b = workers("B", lose_state=True)
    p = prompt(200)
    a.generate(p)
    b.generate(p[:100])                                 # B's own last checkpoint: 96
    pulled = b.pull(p, source=a.transceiver_state())
    assert b.backend.rows_lost == 1
    assert pulled.blocks_moved == 6 and pulled.state_rows_moved == 0 and pulled.cached_tokens == 96
    remote = b.generate(p, max_tokens=2)
    assert remote.cached_tokens == 96
    local = c.generate(p, max_tokens=2)
    assert same(remote.logits, local.logits) and remote.tokens == local.tokens


def test_the_state_of_one_prompt_is_never_served_for_another(workers):
    """A computed the first prompt (checkpoints at each of its block boundaries); B pulls a
    second prompt sharing 72 tokens: it gets the 4 shared blocks and the checkpoint after the 4th
    (the state of the shared prefix), never a state of the first prompt past the divergence."""
    a, b, c = workers("A"), workers("B"), workers("C")
    shared = prompt(72, seed=1)
    first = np.concatenate([shared, prompt(128, seed=2)])
    second = np.concatenate([shared, prompt(128, seed=3)])
    a.generate(first)
    pulled = b.pull(second, source=a.transceiver_state())
    assert pulled.blocks_moved == 4 and pulled.state_rows_moved == 1 and pulled.cached_tokens == 64
    remote = b.generate(second, max_tokens=2)
    assert remote.cached_tokens == 64
    local = c.generate(second, max_tokens=2)
    assert same(remote.logits, local.logits) and remote.tokens == local.tokens


def test_a_signed_hybrid_pull_signs_both_fetches(workers):
    a = workers("A", pull_secret="s3cret", allowed_peers=["B"])
    b = workers("B", pull_secret="s3cret")
    p = prompt(100, seed=5)
    local = a.generate(p)
    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.status == "delivered" and pulled.state_rows_moved == 1 and pulled.cached_tokens == 96
    assert same(b.generate(p).logits, local.logits)
    assert a.counters.pulls_declined == 0
