"""KvwireConnector inside real vLLM engines (CPU build, dummy weights), each in its own process.

Engines are started once per module and kept across tests (a start costs ~25 s here): A and B
use kvwire over one Mooncake master (A asks the store what it holds before loading; B does not,
so a load that misses goes through vLLM's load-error path), P has no connector at all."""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines import VLLM_PYTHON, Engine, EngineError, kvwire_transfer_config, start_all, store_key_count, wait_for_keys

BLOCK = 32
LAYERS = 2  # the tiny model's: the store holds one object per block and layer
NAMESPACE = "vllm-test"


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(length)]


def kvwire_params(answer: dict[str, Any]) -> dict[str, int]:
    return answer["outputs"][0]["kv_transfer_params"]["kvwire"]


@pytest.fixture(scope="module")
def engines(model_dir: Path, master: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    logs = tmp_path_factory.mktemp("engine-logs")
    options = {"master": master.address, "segment_bytes": 64 << 20, "namespace": NAMESPACE}
    started = {
        "A": Engine("A", model_dir, kvwire_transfer_config("mooncake", options), log_dir=logs),
        "B": Engine("B", model_dir, kvwire_transfer_config("mooncake", options, lookup=False), log_dir=logs),
        "P": Engine("P", model_dir, None, log_dir=logs),
    }
    try:
        start_all(list(started.values()))
        yield started
    finally:
        for engine in started.values():
            engine.close()


def test_a_then_b_over_mooncake(engines: dict[str, Engine], master: Any) -> None:
    p = prompt(1, 9 * BLOCK + 9)
    keys = store_key_count(master.metrics_port)
    a = engines["A"].generate([p])
    wait_for_keys(master.metrics_port, keys + 9 * LAYERS)  # A's saves end after its output returns
    b = engines["B"].generate([p])
    plain = engines["P"].generate([p])
    tokens = plain["outputs"][0]["tokens"]
    assert a["outputs"][0]["tokens"] == tokens
    assert b["outputs"][0]["tokens"] == tokens
    assert kvwire_params(a)["save_blocks"] == 9
    assert b["outputs"][0]["num_cached_tokens"] == 9 * BLOCK
    assert kvwire_params(b) == {**kvwire_params(b), "loaded_blocks": 9, "failed_blocks": 0}
    again = engines["B"].generate([p])
    assert again["outputs"][0]["tokens"] == tokens
    assert again["outputs"][0]["num_cached_tokens"] == 9 * BLOCK  # its own prefix cache now
    assert kvwire_params(again) == {**kvwire_params(again), "loaded_blocks": 0, "save_blocks": 0}


def remove_all_objects(master_address: str) -> int:
    """Remove every object under the test namespace from the store (a pure client, no segment)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master_address) == 0
    try:
        return int(store.remove_by_regex(f"^kvw1/{NAMESPACE}/", True))
    finally:
        store.close()


def test_partial_store_is_recomputed(engines: dict[str, Engine], master: Any) -> None:
    a, b = engines["A"], engines["B"]
    p = prompt(2, 16 * BLOCK + 7)
    tokens = engines["P"].generate([p])["outputs"][0]["tokens"]
    keys = store_key_count(master.metrics_port)
    assert a.generate([p])["outputs"][0]["tokens"] == tokens
    wait_for_keys(master.metrics_port, keys + 16 * LAYERS)
    assert remove_all_objects(master.address) >= 16 * LAYERS
    keys = store_key_count(master.metrics_port)
    # The store now gets only the first 8 blocks back.
    a.call({"op": "reset_prefix_cache"})
    assert kvwire_params(a.generate([p[: 8 * BLOCK + 5]]))["save_blocks"] == 8
    wait_for_keys(master.metrics_port, keys + 8 * LAYERS)
    # B assumes the store holds all 16 blocks: 8 arrive, 8 are load errors vLLM recomputes.
    out = b.generate([p])
    assert out["outputs"][0]["tokens"] == tokens
    assert kvwire_params(out) == {**kvwire_params(out), "loaded_blocks": 8, "failed_blocks": 8}
    # B saved the blocks it recomputed; A, asking the store first, now finds all 16 there.
    wait_for_keys(master.metrics_port, keys + 16 * LAYERS)
    a.call({"op": "reset_prefix_cache"})
    full = a.generate([p])
    assert full["outputs"][0]["tokens"] == tokens
    assert full["outputs"][0]["num_cached_tokens"] == 16 * BLOCK
    assert kvwire_params(full) == {**kvwire_params(full), "loaded_blocks": 16, "failed_blocks": 0}


def files_store_installed() -> bool:
    """Whether the no-server store plugin ``files`` is installed in .venv-vllm."""
    if not VLLM_PYTHON.exists():
        return False
    check = "import sys; from kvwire.registry import available; sys.exit('files' not in {e.name for e in available()})"
    return subprocess.run([str(VLLM_PYTHON), "-c", check], capture_output=True).returncode == 0


@pytest.mark.xfail(not files_store_installed(), reason="needs backends/files", run=False)
def test_a_then_b_over_files_store(model_dir: Path, vllm_venv: Path, engines: dict[str, Engine],
                                   tmp_path: Path) -> None:
    options = {"root": str(tmp_path / "store")}
    a = Engine("A-files", model_dir, kvwire_transfer_config("files", options), log_dir=tmp_path)
    b = Engine("B-files", model_dir, kvwire_transfer_config("files", options), log_dir=tmp_path)
    try:
        start_all([a, b])
        p = prompt(3, 9 * BLOCK + 9)
        tokens = engines["P"].generate([p])["outputs"][0]["tokens"]
        assert a.generate([p])["outputs"][0]["tokens"] == tokens
        out = b.generate([p])
        assert out["outputs"][0]["tokens"] == tokens
        assert out["outputs"][0]["num_cached_tokens"] == 9 * BLOCK
        again = b.generate([p])
        assert kvwire_params(again) == {**kvwire_params(again), "loaded_blocks": 0, "save_blocks": 0}
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("extra", "message"), [
    ({"backend": "no-such-store", "options": {}}, "unknown backend 'no-such-store'; installed backends:"),
    ({"backend": "mooncake", "options": {"mastr": "127.0.0.1:1"}}, "backend 'mooncake' has no option 'mastr'"),
])
def test_bad_configuration_refuses_to_start(model_dir: Path, vllm_venv: Path, tmp_path: Path,
                                            extra: dict[str, Any], message: str) -> None:
    config = {"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire_vllm", "kv_role": "kv_both",
              "kv_connector_extra_config": extra}
    engine = Engine("bad", model_dir, config, log_dir=tmp_path)
    try:
        with pytest.raises(EngineError):
            engine.start()
        assert message in engine.log_tail(200_000)
    finally:
        engine.close()
