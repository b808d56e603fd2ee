"""Disaggregated prefill with ``vllm serve`` as a user runs it (issue 35): a producer server and a
consumer server with ``KvwireConnector`` over kvwire-ucx, the kvwire proxy in front of them, and
an OpenAI client (plain HTTP) that talks to the proxy only; a server without a connector computes
the reference tokens. The producer's pins are seen through vLLM's ``/reset_prefix_cache``, which
succeeds only when no block is held. The seed's request-free pull goes through the same servers,
the serving state got over HTTP (the proxy's ``/kvwire/source``), never through insecure
serialization."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from engines import kvwire_transfer_config
from servers import Process, get, kvwire_proxy, post, vllm_server

from kvwire.testing.holder import wait_for

pytestmark = [pytest.mark.usefixtures("vllm_venv"), pytest.mark.xdist_group("vllm")]

BLOCK = 32
BACKGROUND_S = 120.0
UCX_ENV = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(length)]


class Deployment:
    def __init__(self, servers: dict[str, Process], model: str) -> None:
        self.servers, self.model = servers, model
        self.proxy, self.producer = servers["proxy"], servers["producer"]
        self.consumer, self.single = servers["consumer"], servers["single"]

    def complete(self, server: Process, p: list[int], max_tokens: int = 5, **extra: Any) -> dict[str, Any]:
        return post(server.url + "/v1/completions", {"model": self.model, "prompt": p, "max_tokens": max_tokens,
                                                     "temperature": 0, "return_token_ids": True, **extra})

    def tokens(self, server: Process, p: list[int], max_tokens: int = 5, **extra: Any) -> list[int]:
        return list(self.complete(server, p, max_tokens, **extra)["choices"][0]["token_ids"])

    def producer_holds_nothing(self) -> bool:
        return bool(post(self.producer.url + "/reset_prefix_cache", {})["success"])


@pytest.fixture(scope="module")
def deployment(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    logs = tmp_path_factory.mktemp("serve")
    options = {"timeout_s": 8.0, "grace_s": 1.0}

    def config(role: str) -> dict[str, Any]:
        return {**kvwire_transfer_config("ucx", options, timeout_s=8.0, hold_s=30.0), "kv_role": role}

    servers = {
        "producer": vllm_server("producer", model_dir, logs, config("kv_producer"), UCX_ENV),
        "consumer": vllm_server("consumer", model_dir, logs, config("kv_consumer"), UCX_ENV),
        "single": vllm_server("single", model_dir, logs, None),
    }
    try:
        for server in servers.values():
            server.wait_ready()
        servers["proxy"] = kvwire_proxy(logs, [servers["producer"].url], [servers["consumer"].url])
        servers["proxy"].wait_ready(60)
        yield Deployment(servers, str(model_dir))
    finally:
        for server in servers.values():
            server.close()


def test_a_completion_through_the_proxy_continues_from_the_producers_blocks(deployment: Deployment) -> None:
    d = deployment
    p = prompt(4000, 9 * BLOCK + 11)
    answer = d.complete(d.proxy, p)
    assert answer["choices"][0]["token_ids"] == d.tokens(d.single, p)
    kv = answer["kv_transfer_params"]["kvwire"]
    assert kv["loaded_blocks"] == 9 and kv["failed_blocks"] == 0
    assert get(d.proxy.url + "/kvwire/stats")["handoffs"] >= 1
    wait_for(d.producer_holds_nothing, BACKGROUND_S, "the producer's blocks back in its pool after the handoff")


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
