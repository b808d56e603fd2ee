"""KvwireConnector in vLLM engines whose KV cache has the geometry of real models (dummy weights,
small hidden size: the KV cache is what a connector moves): 32 layers of 8 KV heads x 128 (an
8B-class model, 4 MiB a block of 32 tokens in bf16) and 24 layers of 2 x 64 (a 0.5B-class one,
384 KiB a block). The tiny model of the other modules has 2 layers; at these shapes a store
object per block and layer would be 32 or 24 objects a block.

Per shape: the store flow over the ``files`` store (A computes and saves, B loads; the store
holds exactly one object of the block's full size per block) and the seed's request-free pull
over kvwire-ucx. (Loads inside the step with block objects are checked without vLLM in
``tests/vllm_core/test_core_block_objects.py`` and in real engines at the tiny shape in
``test_connector.py``: each engine start here costs CI half a minute.) Prompts are 20 blocks (640 tokens): two engines of the
32-layer shape with 1 GiB of KV cache each (256 blocks) and the store fit this 24 GiB machine with
room for the rest of the suite beside them."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engines import (
    REAL_BLOCK,
    REAL_SHAPES,
    Engine,
    close_all,
    files_object_count,
    kv_bytes_per_block,
    kvwire_transfer_config,
    start_all,
    write_model,
)
from kvwire_files import FileStore

from kvwire.testing.holder import wait_for

pytestmark = [pytest.mark.usefixtures("vllm_venv"), pytest.mark.xdist_group("vllm")]

BLOCKS = 20
BACKGROUND_S = 120.0
TIMEOUT_S = 30.0


def prompt(seed: int, blocks: int, extra: int = 5) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(blocks * REAL_BLOCK + extra)]


def first(answer: dict[str, Any]) -> dict[str, Any]:
    return answer["outputs"][0]


def kv(output: dict[str, Any]) -> dict[str, int]:
    return (output.get("kv_transfer_params") or {}).get("kvwire", {})


def engine(name: str, model: Path, config: dict[str, Any] | None, logs: Path, **env: str) -> Engine:
    return Engine(name, model, config, log_dir=logs, env=env, dtype="bfloat16", block_size=REAL_BLOCK,
                  kv_cache_gib=1, max_model_len=2048, new_session=True)


def object_sizes(root: Path) -> list[int]:
    store = FileStore(str(root), capacity_bytes=1)
    try:
        sizes = []
        for key in store.keys():
            located = store.locate(key)
            assert located is not None, key
            sizes.append(located[2])
        return sizes
    finally:
        store.close()


def settled(e: Engine) -> bool:
    state = e.state()
    return state == {**state, "loads": [], "step_loads": [], "saves": [], "kept": 0, "holding_blocks_of": []}


@pytest.fixture(scope="module", params=list(REAL_SHAPES))
def shape(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = str(request.param)
    return name, write_model(tmp_path_factory.mktemp(f"model-{name}") / name, REAL_SHAPES[name])


@pytest.fixture(scope="module")
def store_engines(shape: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A and B over one ``files`` store as a user runs them."""
    name, model = shape
    top = tmp_path_factory.mktemp(f"store-{name}")
    root = top / "store"
    started = {
        "A": engine(f"A-{name}", model, kvwire_transfer_config("files", {"root": str(root)}), top),
        "B": engine(f"B-{name}", model, kvwire_transfer_config("files", {"root": str(root)}), top),
    }
    try:
        start_all(list(started.values()))
        yield {"root": root, "name": name, **started}
    finally:
        close_all(started.values())


def test_a_prompt_saved_at_a_real_shape_is_one_object_per_block_and_loads_whole(
        store_engines: dict[str, Any]) -> None:
    root, a, b, name = store_engines["root"], store_engines["A"], store_engines["B"], store_engines["name"]
    p = prompt(1, BLOCKS)
    computed = first(a.generate([p]))
    assert kv(computed)["save_blocks"] == BLOCKS
    wait_for(lambda: files_object_count(root) >= BLOCKS, BACKGROUND_S, f"{BLOCKS} objects in the store")
    wait_for(lambda: settled(a), BACKGROUND_S, "A's saves all concluded")
    # One object per block, each the block of every layer (not one per block and layer).
    assert object_sizes(root) == [kv_bytes_per_block(REAL_SHAPES[name], REAL_BLOCK)] * BLOCKS
    loaded = first(b.generate([p]))
    assert loaded["tokens"] == computed["tokens"]
    assert loaded["num_cached_tokens"] == BLOCKS * REAL_BLOCK
    assert kv(loaded) == {**kv(loaded), "loaded_blocks": BLOCKS, "failed_blocks": 0, "save_blocks": 0}
    wait_for(lambda: settled(b), BACKGROUND_S, "B's transfers all concluded")
    assert files_object_count(root) == BLOCKS  # B saved nothing it loaded


@pytest.fixture(scope="module")
def pull_engines(shape: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """Engine 0 serves pulls from its prefix cache through kvwire-ucx; engine 1 pulls."""
    name, model = shape
    logs = tmp_path_factory.mktemp(f"pull-{name}")
    config = kvwire_transfer_config("ucx", {"timeout_s": TIMEOUT_S, "grace_s": 1.0}, timeout_s=TIMEOUT_S)
    env = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}
    started = {"serving": engine(f"serving-{name}", model, config, logs, **env),
               "pulling": engine(f"pulling-{name}", model, config, logs, **env)}
    try:
        start_all(list(started.values()))
        yield started
    finally:
        close_all(started.values())


def test_a_request_free_pull_at_a_real_shape(pull_engines: dict[str, Engine]) -> None:
    serving, pulling = pull_engines["serving"], pull_engines["pulling"]
    p = prompt(4, BLOCKS)
    served = first(serving.generate([p], max_tokens=2))
    (state,) = serving.call({"op": "transceiver_state"})["states"]
    pulled = first(pulling.generate([p], max_tokens=2, source=state))
    assert pulled["tokens"] == served["tokens"]
    assert pulled["num_cached_tokens"] == BLOCKS * REAL_BLOCK
    assert kv(pulled) == {**kv(pulled), "loaded_blocks": BLOCKS, "failed_blocks": 0}

    def served_all() -> bool:
        s = serving.state()
        return s["replies_in_flight"] == 0 and s["pulls_pending"] == 0

    wait_for(served_all, BACKGROUND_S, "engine 0's replies all quiesced")
    wait_for(serving.reset_prefix_cache, BACKGROUND_S, "engine 0's prefix cache reset (no block pinned)")
