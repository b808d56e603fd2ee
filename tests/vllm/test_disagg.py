"""Disaggregated prefill between real vLLM engines (issue 35): a producer (``kv_role``
``kv_producer``, or ``kv_both`` with a request's ``do_remote_decode``, as vLLM's proxy sends it)
computes a prompt with ``max_tokens=1``; its finished request keeps the prompt's blocks pinned and
answers the ``kv_transfer_params`` a consumer needs; the consumer's request with those params
pulls the blocks over kvwire-ucx before its first decode step and continues from them. The hold
ends when the consumer's pull of the last block ended, or after ``hold_s`` without one; the
blocks then go back to the producer's pool (vLLM resets its prefix cache only when no block is
referenced, which is how these tests see a pin). Both kvwire-ucx modes.

Each engine writes its connector trace (``KVWIRE_VLLM_TRACE``): which way a hold ended is read
there, never from a clock."""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engines import Engine, close_all, kvwire_transfer_config, start_all

from kvwire.testing.holder import wait_for

pytestmark = [pytest.mark.usefixtures("vllm_venv"), pytest.mark.xdist_group("vllm")]

BLOCK = 32
TIMEOUT_S = 8.0
HOLD_S = 20.0  # the producer's hold: long enough that a handoff never lapses on a loaded machine
BACKGROUND_S = 120.0


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(length)]


def first(answer: dict[str, Any]) -> dict[str, Any]:
    return answer["outputs"][0]


def whole_blocks(length: int) -> int:
    return (length - 1) // BLOCK


class Deployment:
    def __init__(self, engines: dict[str, Engine], traces: dict[str, Path]) -> None:
        self.producer, self.consumer, self.single = engines["producer"], engines["consumer"], engines["single"]
        self.traces = traces

    def holds_ended(self, why: str) -> list[str]:
        """Requests whose hold ended ``why`` ("pulled" or "lapsed"), from the producer's trace."""
        path = self.traces["producer"]
        if not path.exists():
            return []
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [e["req"] for e in events if e.get("event") == "hold_released" and e.get("why") == why]


@pytest.fixture(scope="module", params=["two-sided", "one-sided"])
def deployment(request: pytest.FixtureRequest, model_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    mode = str(request.param)
    logs = tmp_path_factory.mktemp(f"disagg-{mode}")
    options: dict[str, Any] = {"timeout_s": TIMEOUT_S, "grace_s": 1.0}
    if mode != "two-sided":
        options["mode"] = mode
    env = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_MODULES": "^ib",
           "NIXL_LOG_LEVEL": "WARN"}
    traces = {name: logs / f"{name}.jsonl" for name in ("producer", "consumer")}

    def config(role: str) -> dict[str, Any]:
        return {**kvwire_transfer_config("ucx", options, timeout_s=TIMEOUT_S, hold_s=HOLD_S), "kv_role": role}

    engines = {
        # kv_both: the request's do_remote_decode asks for the hold, as vLLM's proxy sends it
        "producer": Engine(f"{mode}-producer", model_dir, config("kv_both"), log_dir=logs, new_session=True,
                           env={**env, "KVWIRE_VLLM_TRACE": str(traces["producer"])}),
        "consumer": Engine(f"{mode}-consumer", model_dir, config("kv_consumer"), log_dir=logs, new_session=True,
                           env={**env, "KVWIRE_VLLM_TRACE": str(traces["consumer"])}),
        # the reference (no connector): its engine core runs in the driver's process, one process to start
        "single": Engine(f"{mode}-single", model_dir, None, log_dir=logs, processes=1),
    }
    try:
        start_all(list(engines.values()))
        yield Deployment(engines, traces)
    finally:
        close_all(engines.values())


def prefill(d: Deployment, p: list[int]) -> dict[str, Any]:
    """The proxy's first request: max_tokens=1 with do_remote_decode; the producer's output."""
    return first(d.producer.generate([p], max_tokens=1, params={"do_remote_decode": True,
                                                                "do_remote_prefill": False}))


def test_the_consumer_continues_from_the_producers_blocks_and_the_hold_ends_with_its_pull(
        deployment: Deployment) -> None:
    d = deployment
    p = prompt(3500, 9 * BLOCK + 7)
    reference = first(d.single.generate([p], max_tokens=6))["tokens"]
    produced = prefill(d, p)
    params = produced["kv_transfer_params"]
    assert produced["tokens"] == reference[:1]
    assert params["do_remote_prefill"] is True and params["kvwire_source"]
    assert params["kvwire_held_blocks"] == whole_blocks(len(p))
    assert not d.producer.reset_prefix_cache(), "the producer's blocks must be pinned for the consumer"

    decoded = first(d.consumer.generate([p], max_tokens=6, params=params))
    assert decoded["tokens"] == reference
    # (vLLM reports a P/D request's num_cached_tokens as the producer's hits, so kvwire's count)
    kv = decoded["kv_transfer_params"]["kvwire"]
    assert kv["loaded_blocks"] == whole_blocks(len(p)) and kv["failed_blocks"] == 0

    wait_for(d.producer.reset_prefix_cache, BACKGROUND_S, "the producer's blocks back in its pool")
    assert len(d.holds_ended("pulled")) == 1 and not d.holds_ended("lapsed")


def test_a_consumer_that_never_comes_lets_the_blocks_go_after_the_hold(deployment: Deployment) -> None:
    """Nobody pulls: the hold lapses (this request asks for 3 s of the engine's 20, a shorter
    hold a request may ask for) and the producer's idle engine is stepped to let the blocks go
    (no request of its own wakes it). A request asking for more than the engine's hold_s gets
    the engine's."""
    d = deployment
    pulled = len(d.holds_ended("pulled"))
    produced = first(d.producer.generate([prompt(3501, 6 * BLOCK + 1)], max_tokens=1,
                                         params={"do_remote_decode": True, "kvwire_hold_s": 3}))
    assert produced["kv_transfer_params"]["kvwire_held_blocks"] == 6
    assert produced["kv_transfer_params"]["kvwire_hold_s"] == 3
    assert not d.producer.reset_prefix_cache()
    wait_for(d.producer.reset_prefix_cache, BACKGROUND_S, "the lapsed hold's blocks back in the pool")
    assert len(d.holds_ended("lapsed")) == 1 and len(d.holds_ended("pulled")) == pulled
    greedy_prompt = prompt(3503, 2 * BLOCK + 1)
    greedy = first(d.producer.generate([greedy_prompt], max_tokens=1,
                                       params={"do_remote_decode": True, "kvwire_hold_s": 3600}))
    assert greedy["kv_transfer_params"]["kvwire_hold_s"] == HOLD_S
    d.consumer.generate([greedy_prompt], max_tokens=1, params=greedy["kv_transfer_params"])  # ends that hold
    wait_for(d.producer.reset_prefix_cache, BACKGROUND_S, "the pulled hold's blocks back in the pool")


def test_a_request_without_do_remote_decode_keeps_nothing(deployment: Deployment) -> None:
    d = deployment
    out = first(d.producer.generate([prompt(3502, 5 * BLOCK + 3)], max_tokens=1))
    params = out["kv_transfer_params"] or {}
    assert "kvwire_source" not in params and "do_remote_prefill" not in params
    assert d.producer.reset_prefix_cache()


def test_many_handoffs_at_once_leave_no_block_pinned(deployment: Deployment) -> None:
    """20 prompts prefilled together, then decoded together: every token right, every hold
    ended by its pull, nothing pinned at the producer afterwards."""
    d = deployment
    prompts = [prompt(3600 + i, 4 * BLOCK + 5 + i) for i in range(20)]
    reference = [o["tokens"] for o in d.single.generate(prompts, max_tokens=3)["outputs"]]
    produced = d.producer.generate(prompts, max_tokens=1, params={"do_remote_decode": True})["outputs"]
    assert [o["kv_transfer_params"]["kvwire_held_blocks"] for o in produced] == [4] * 20
    pulled = len(d.holds_ended("pulled"))
    ids = [f"h{i}" for i in range(20)]
    for i, out in enumerate(produced):
        d.consumer.add(ids[i], prompts[i], max_tokens=3, params=out["kv_transfer_params"])
    decoded = d.consumer.collect(*ids)
    assert [o["tokens"] for o in decoded] == reference
    assert [o["kv_transfer_params"]["kvwire"]["loaded_blocks"] for o in decoded] == [4] * 20
    wait_for(d.producer.reset_prefix_cache, BACKGROUND_S, "every held block back in the producer's pool")
    assert len(d.holds_ended("pulled")) == pulled + 20


def test_a_consumer_killed_mid_load_leaves_the_producers_blocks_to_come_back(deployment: Deployment) -> None:
    """The consumer's pull on its way to a stopped producer, then the consumer killed (SIGKILL,
    its whole process group): continued, the producer's reply meets a dead peer or the hold
    lapses; either way its blocks come back to its pool and it serves on. Runs last: the consumer
    is gone afterwards."""
    d = deployment
    p = prompt(3700, 6 * BLOCK + 4)
    params = prefill(d, p)["kv_transfer_params"]
    assert params["kvwire_held_blocks"] == 6
    ended = len(d.holds_ended("pulled")) + len(d.holds_ended("lapsed"))
    producer, consumer = d.producer.proc.pid, d.consumer.proc.pid
    os.killpg(producer, signal.SIGSTOP)
    try:
        d.consumer.add("victim", p, max_tokens=2, params=params)
        wait_for(lambda: "victim" in d.consumer.state()["loads"], BACKGROUND_S, "the consumer's pull in flight")
        os.killpg(consumer, signal.SIGKILL)
    finally:
        os.killpg(producer, signal.SIGCONT)
    d.consumer.proc.wait(timeout=60)
    wait_for(d.producer.reset_prefix_cache, HOLD_S + BACKGROUND_S, "the producer's blocks back after the consumer died")
    assert len(d.holds_ended("pulled")) + len(d.holds_ended("lapsed")) == ended + 1
    again = prefill(d, prompt(3701, 3 * BLOCK + 1))
    assert again["kv_transfer_params"]["kvwire_held_blocks"] == 3  # and it serves on
