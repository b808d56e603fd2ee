"""Disaggregated prefill with ``vllm serve`` as a user runs it (issue 35): a producer server and a
consumer server with ``KvwireConnector`` over kvwire-ucx, the kvwire proxy in front of them, and
an OpenAI client (plain HTTP) that talks to the proxy only; a server without a connector computes
the reference tokens. The producer's pins are seen through vLLM's ``/reset_prefix_cache``, which
succeeds only when no block is held. The seed's request-free pull goes through the same servers,
the serving state got over HTTP (the proxy's ``/kvwire/source``), never through insecure
serialization. Producer and consumer write their connector traces (``KVWIRE_VLLM_TRACE``): where a
test needs a load in flight it waits for it there, and the producer's shows its engine woken."""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from engines import kvwire_transfer_config
from servers import Process, close_all, get, kvwire_proxy, post, vllm_server

from kvwire.holding import TransceiverState
from kvwire.testing.holder import wait_for

pytestmark = [pytest.mark.usefixtures("vllm_venv"), pytest.mark.xdist_group("vllm")]

BLOCK = 32
BACKGROUND_S = 120.0
UCX_ENV = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(length)]


class Deployment:
    def __init__(self, servers: dict[str, Process], model: str, traces: dict[str, Path]) -> None:
        self.servers, self.model, self.traces = servers, model, traces
        self.proxy, self.producer = servers["proxy"], servers["producer"]
        self.consumer, self.single = servers["consumer"], servers["single"]
        self.victim = servers["victim"]  # a second consumer, not behind the proxy, that a test kills
        self.producer_tp2 = servers["producer_tp2"]  # a producer of tensor-parallel size 2

    def complete(self, server: Process, p: list[int], max_tokens: int = 5, **extra: Any) -> dict[str, Any]:
        return post(server.url + "/v1/completions", {"model": self.model, "prompt": p, "max_tokens": max_tokens,
                                                     "temperature": 0, "return_token_ids": True, **extra})

    def tokens(self, server: Process, p: list[int], max_tokens: int = 5, **extra: Any) -> list[int]:
        return list(self.complete(server, p, max_tokens, **extra)["choices"][0]["token_ids"])

    def producer_holds_nothing(self) -> bool:
        return bool(post(self.producer.url + "/reset_prefix_cache", {})["success"])

    def consumer_holds_nothing(self) -> bool:
        return bool(post(self.consumer.url + "/reset_prefix_cache", {})["success"])

    def events(self, server: str, name: str) -> list[dict[str, Any]]:
        """The connector trace events called ``name`` of ``server`` (producer or consumer)."""
        path = self.traces[server]
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        events = [json.loads(line) for line in lines[:-1] if line.strip()]  # the last may be half written
        return [e for e in events if e.get("event") == name]


@pytest.fixture(scope="module")
def deployment(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("serve")
    options = {"timeout_s": 8.0, "grace_s": 1.0}

    def config(role: str) -> dict[str, Any]:
        return {**kvwire_transfer_config("ucx", options, timeout_s=8.0, hold_s=30.0), "kv_role": role}

    traces = {name: logs / f"{name}.jsonl" for name in ("producer", "consumer", "victim")}
    roles = {"producer": "kv_producer", "consumer": "kv_consumer", "victim": "kv_consumer"}
    servers = {
        name: vllm_server(name, model_dir, logs, config(role), {**UCX_ENV, "KVWIRE_VLLM_TRACE": str(traces[name])})
        for name, role in roles.items()
    }
    servers["single"] = vllm_server("single", model_dir, logs, None)
    # A producer really at tensor-parallel size 2 (two CPU workers, one core each: vLLM's CPU build
    # binds each worker to a NUMA node unless told its cores), for the consumer to refuse.
    servers["producer_tp2"] = vllm_server("producer_tp2", model_dir, logs, config("kv_producer"),
                                          {**UCX_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                                          extra_argv=["--tensor-parallel-size", "2"])
    try:
        for server in servers.values():
            server.wait_ready()
        servers["proxy"] = kvwire_proxy(logs, [servers["producer"].url], [servers["consumer"].url])
        servers["proxy"].wait_ready(60)
        yield Deployment(servers, str(model_dir), traces)
    finally:
        close_all(servers.values())


def test_servers_on_shared_cores_are_told_so(deployment: Deployment) -> None:
    """These servers keep vLLM's default CPU binding, every server on the same cores: the
    connector's workers say so at start, with the fix (each server its own cores)."""
    logs = [server.log_path.read_text(errors="replace") for server in (deployment.producer, deployment.consumer)]
    warned = [log for log in logs if "shares its cores with another vLLM worker" in log]
    assert warned and all("VLLM_CPU_OMP_THREADS_BIND" in log for log in warned)


def test_a_completion_through_the_proxy_continues_from_the_producers_blocks(deployment: Deployment) -> None:
    d = deployment
    p = prompt(4000, 9 * BLOCK + 11)
    answer = d.complete(d.proxy, p)
    assert answer["choices"][0]["token_ids"] == d.tokens(d.single, p)
    kv = answer["kv_transfer_params"]["kvwire"]
    assert kv["loaded_blocks"] == 9 and kv["failed_blocks"] == 0
    assert get(d.proxy.url + "/kvwire/stats")["handoffs"] >= 1
    wait_for(d.producer_holds_nothing, BACKGROUND_S, "the producer's blocks back in its pool after the handoff")
    # the consumer's pull rang the idle producer's engine, found under the API server's engine core
    rings = d.events("producer", "rang")
    assert rings and all(e["core"] for e in rings)


def test_twenty_concurrent_completions_leave_no_block_pinned(deployment: Deployment) -> None:
    d = deployment
    prompts = [prompt(4100 + i, 5 * BLOCK + 3 + i) for i in range(20)]
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda p: d.complete(d.proxy, p, max_tokens=3), prompts))
    for p, answer in zip(prompts, answers, strict=True):
        assert answer["choices"][0]["token_ids"] == d.tokens(d.single, p, max_tokens=3)
        assert answer["kv_transfer_params"]["kvwire"]["loaded_blocks"] == 5
    wait_for(d.producer_holds_nothing, BACKGROUND_S, "no block of the 20 handoffs left pinned at the producer")


def test_a_streamed_completion_through_the_proxy(deployment: Deployment) -> None:
    d = deployment
    p = prompt(4200, 4 * BLOCK + 9)
    body = {"model": d.model, "prompt": p, "max_tokens": 4, "temperature": 0, "stream": True,
            "return_token_ids": True}
    request = urllib.request.Request(d.proxy.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        events = [line for line in reply.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    streamed = [t for e in events[:-1] for t in (json.loads(e[6:])["choices"][0].get("token_ids") or [])]
    assert streamed == d.tokens(d.single, p, max_tokens=4)


def test_the_seeds_request_free_pull_with_the_state_got_over_http(deployment: Deployment) -> None:
    """The producer computes a prompt as a plain request; a client gets the producer's state from
    the proxy and sends the prompt to the consumer directly, which pulls it from the producer's
    prefix cache."""
    d = deployment
    p = prompt(4300, 7 * BLOCK + 2)
    d.tokens(d.producer, p, max_tokens=1)
    source = get(d.proxy.url + f"/kvwire/source?server=0&model={d.model}")["kvwire_source"]
    answer = d.complete(d.consumer, p, kv_transfer_params={"kvwire_source": source})
    assert answer["choices"][0]["token_ids"] == d.tokens(d.single, p)
    assert answer["kv_transfer_params"]["kvwire"]["loaded_blocks"] == 7


def test_a_consumer_refuses_a_producer_of_another_tensor_parallel_size(deployment: Deployment) -> None:
    """A producer server really at tensor-parallel size 2 hands a prompt off to the consumer at
    size 1: the consumer refuses the state before any byte moves, naming the fact and both values,
    computes the prompt itself (a single server's tokens), and says why in its answer; the
    producer's unpulled hold lapses (a short one asked for) and its blocks go back to its pool."""
    d = deployment
    p = prompt(4500, 5 * BLOCK + 3)
    params = d.complete(d.producer_tp2, p, max_tokens=1,
                        kv_transfer_params={"do_remote_decode": True, "kvwire_hold_s": 1})["kv_transfer_params"]
    state = TransceiverState.from_bytes(base64.b64decode(params["kvwire_source"]))
    assert dict(state.facts)["tensor_parallel_size"] == "2"
    submitted = len(d.events("consumer", "load_submitted"))
    answer = d.complete(d.consumer, p, kv_transfer_params=params)
    assert answer["choices"][0]["token_ids"] == d.tokens(d.single, p)
    kv = answer["kv_transfer_params"]["kvwire"]
    assert "tensor_parallel_size '2' there, '1' here" in kv["source_refused"]
    assert kv["loaded_blocks"] == 0
    assert len(d.events("consumer", "load_submitted")) == submitted  # nothing was asked of the producer
    wait_for(lambda: bool(post(d.producer_tp2.url + "/reset_prefix_cache", {})["success"]), BACKGROUND_S,
             "the unpulled hold's blocks back in the size-2 producer's pool")


def test_a_consumer_killed_mid_load_leaves_the_producer_holding_nothing(deployment: Deployment) -> None:
    """A consumer server SIGKILLed (its whole process group) while its load of a handoff is on
    its way: the producer is stopped while the consumer asks, so the load is surely in flight
    when the consumer dies. Once the producer runs again it gives every block of the handoff back
    (its answer to a requester that is gone fails, or the hold lapses) and serves on."""
    d = deployment
    p = prompt(4600, 6 * BLOCK + 7)
    params = d.complete(d.producer, p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})[
        "kv_transfer_params"]
    assert params["kvwire_held_blocks"] == 6
    assert not d.producer_holds_nothing()  # the handoff's blocks are pinned for the consumer
    os.killpg(d.producer.proc.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(d.complete, d.victim, p, kv_transfer_params=params)
            wait_for(lambda: len(d.events("victim", "load_submitted")) > 0, BACKGROUND_S,
                     "the victim consumer's load from the stopped producer in flight")
            d.victim.kill()
            with pytest.raises(OSError):  # the client's connection to the dead server breaks
                answer.result(timeout=BACKGROUND_S)
    finally:
        os.killpg(d.producer.proc.pid, signal.SIGCONT)
    wait_for(d.producer_holds_nothing, BACKGROUND_S, "the dead consumer's handoff back in the producer's pool")
    again = prompt(4601, 4 * BLOCK + 1)
    assert d.tokens(d.proxy, again) == d.tokens(d.single, again)


def test_a_producer_killed_mid_load_leaves_the_consumer_to_recompute(deployment: Deployment) -> None:
    """The producer stopped while the consumer's load of its handoff is on its way, then killed
    (SIGKILL, its whole process group): the consumer's load fails, vLLM recomputes the prompt,
    and the tokens are a single server's; the consumer holds no block afterwards and serves on
    (the proxy's prefill to the dead producer fails, so the consumer computes the prompt itself).
    Runs last: the producer is gone afterwards."""
    d = deployment
    p = prompt(4400, 6 * BLOCK + 5)
    reference = d.tokens(d.single, p)
    params = d.complete(d.producer, p, max_tokens=1, kv_transfer_params={"do_remote_decode": True})[
        "kv_transfer_params"]
    assert params["kvwire_held_blocks"] == 6
    submitted = len(d.events("consumer", "load_submitted"))
    os.killpg(d.producer.proc.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(d.complete, d.consumer, p, kv_transfer_params=params)
            wait_for(lambda: len(d.events("consumer", "load_submitted")) > submitted, BACKGROUND_S,
                     "the consumer's load from the stopped producer in flight")
            d.producer.kill()
            out = answer.result(timeout=BACKGROUND_S)
    finally:
        if d.producer.proc.poll() is None:
            os.killpg(d.producer.proc.pid, signal.SIGCONT)
    assert out["choices"][0]["token_ids"] == reference
    kv = out["kv_transfer_params"]["kvwire"]
    assert kv["loaded_blocks"] == 0 and kv["failed_blocks"] == 6
    wait_for(d.consumer_holds_nothing, BACKGROUND_S, "no block of the failed load held at the consumer")
    again = prompt(4401, 3 * BLOCK + 2)
    assert d.tokens(d.proxy, again) == d.tokens(d.single, again)
    assert get(d.proxy.url + "/kvwire/stats")["prefill_failures"] >= 1
