"""kvwire as an operator runs it under ``vllm serve`` (issue 38): inside vLLM's ``MultiConnector``
(``KvwireConnector`` over ``files`` first, vLLM's ``ExampleConnector`` second), on one real API
server whose ``/metrics`` carries kvwire's metrics (``vllm:kvwire_*``, through the connector's
Prometheus hooks), scraped and parsed as Prometheus does.

kvwire runs with ``"lookup": false`` here, so the first request of a prompt loads and misses every
block (a load error of cause ``missing``, recomputed, never a failed request: inside a
MultiConnector too, whose engine-wide ``kv_load_failure_policy`` kvwire sets to ``recompute``);
that request computed the whole prompt and its tokens are the reference. One server start."""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engines import TINY_LLAMA, files_object_count, kv_bytes_per_block, kvwire_transfer_config
from servers import Process, post, vllm_server

from kvwire.testing.holder import wait_for

pytestmark = [pytest.mark.usefixtures("vllm_venv"), pytest.mark.xdist_group("vllm")]

BLOCK = 32
BACKGROUND_S = 120.0


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(length)]


def scrape(server: Process) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the server's ``/metrics`` whose name is kvwire's, without vLLM's labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name")))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("vllm:kvwire_")}


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Process, Path]]:
    top = tmp_path_factory.mktemp("metrics-multi")
    root = top / "store"
    kvwire = kvwire_transfer_config("files", {"root": str(root)}, lookup=False)
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"shared_storage_path": str(top / "example")}}
    config = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"connectors": [kvwire, example]}}
    process = vllm_server("multi", model_dir, top, config)
    try:
        process.wait_ready()
        yield process, root
    finally:
        process.close()


def test_kvwire_first_in_a_multiconnector_loads_and_its_metrics_reach_vllm_serve(
        server: tuple[Process, Path], model_dir: Path) -> None:
    process, root = server
    model = str(model_dir)

    def complete(p: list[int]) -> dict[str, Any]:
        return post(process.url + "/v1/completions", {"model": model, "prompt": p, "max_tokens": 4,
                                                      "temperature": 0, "return_token_ids": True})

    p = prompt(3800, 9 * BLOCK + 9)
    first = complete(p)
    tokens = first["choices"][0]["token_ids"]
    assert first["kv_transfer_params"]["kvwire"] == {**first["kv_transfer_params"]["kvwire"], "loaded_blocks": 0,
                                                     "failed_blocks": 9, "save_blocks": 9}
    wait_for(lambda: files_object_count(root) == 9, BACKGROUND_S, "kvwire's 9 blocks in the files store")
    wait_for(lambda: bool(post(process.url + "/reset_prefix_cache", {})["success"]), BACKGROUND_S,
             "the server's blocks all free")
    second = complete(p)
    assert second["choices"][0]["token_ids"] == tokens
    assert second["kv_transfer_params"]["kvwire"] == {**second["kv_transfer_params"]["kvwire"], "loaded_blocks": 9,
                                                      "failed_blocks": 0}

    block = kv_bytes_per_block(TINY_LLAMA, BLOCK)
    expected = {("vllm:kvwire_load_blocks_total", ()): 9, ("vllm:kvwire_load_bytes_total", ()): 9 * block,
                ("vllm:kvwire_save_blocks_total", ()): 9, ("vllm:kvwire_save_bytes_total", ()): 9 * block,
                ("vllm:kvwire_load_error_blocks_total", (("cause", "missing"),)): 9,
                ("vllm:kvwire_load_seconds_count", ()): 2, ("vllm:kvwire_pulls_served_total", ()): 0,
                ("vllm:kvwire_pins", ()): 0}

    def seen() -> dict[Any, float | None]:
        samples = scrape(process)
        return {key: samples.get(key) for key in expected}

    # Stats reach the API server with the engine's outputs, a step or so after the response.
    wait_for(lambda: seen() == expected, BACKGROUND_S, f"kvwire's metrics on /metrics: {expected}")
    assert scrape(process)[("vllm:kvwire_load_seconds_sum", ())] > 0
