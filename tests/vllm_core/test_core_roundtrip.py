"""The worker core's save -> load round trip: one engine saves a request's blocks, another engine of
the same model loads them into other blocks, and they are vLLM's blocks bit for bit, in every
layout vLLM hands over, through a host store directly (vLLM's CPU build), through staging slots
(a CUDA cache, or one forced through staging on the CPU), and from a CUDA cache straight into the
in-memory store in pinned memory (its option ``device``); the scheduler side's lookup finds them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from core_driver import load, names, save
from kvwire_vllm.core import WorkerCore
from kvwire_vllm.kvcache import Grouping, store_rows
from vllm_layouts import LAYOUTS, LEGACY, ORDERS, Shape, block_bytes, make_cache

from kvwire.contract import Backend, Hint, MemoryKind

SHAPE = Shape()
SAVED = [3, 17, 0, 9, 22, 5]
LOADED = [11, 2, 20, 7, 14, 1]


def rows_for(layout: str, device: str, backend: Backend) -> object:
    """What vLLM's config makes both sides expect (None for layouts before 0.32, which carry no name)."""
    if layout in LEGACY:
        return None
    return store_rows(layout, cuda=device == "cuda", memory_kinds=backend.capabilities().memory_kinds,
                      num_layers=SHAPE.layers, num_kv_heads=SHAPE.heads)


@pytest.mark.parametrize("store", ["memory", "files", "memory-device"])
@pytest.mark.parametrize("path", ["auto", "staged"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_saved_by_one_engine_load_bit_for_bit_into_another(
        layout: str, path: str, store: str, device: str, store_backend: Callable[[str], Backend],
        make_core: Callable[..., WorkerCore]) -> None:
    a_cache = make_cache(layout, SHAPE, seed=1, device=device)
    b_cache = make_cache(layout, SHAPE, seed=2, device=device)
    stage = True if path == "staged" else None
    a_backend, b_backend = store_backend(store), store_backend(store)
    a = make_core(a_backend, SHAPE.layer_names(), stage=stage, rows=None if stage else rows_for(layout, device, a_backend))
    b = make_core(b_backend, SHAPE.layer_names(), stage=stage, rows=None if stage else rows_for(layout, device, b_backend))
    a.register_kv_caches(a_cache, SHAPE.blocks)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    if store == "memory-device" and device == "cpu":
        pytest.skip("backend 'memory-device' is for a KV cache in CUDA memory")
    # a store that takes the cache's own memory: host memory on the CPU, CUDA memory with 'memory-device'
    direct = path == "auto" and layout != "BHLNC" and (device == "cpu" or store == "memory-device")
    assert a.staged is not direct
    before = {blk: block_bytes(b_cache, layout, blk) for blk in range(SHAPE.blocks)}
    block_names = names(len(SAVED), seed=5)

    save(a, "a", SAVED, block_names)
    # the names of the blocks the store now holds go to the scheduler side (its KV events)
    assert a.report().saved_names() == [n.tobytes() for n in block_names]
    errors = load(b, "b", LOADED, block_names)

    assert errors == set()
    for src, dst in zip(SAVED, LOADED, strict=True):
        assert block_bytes(b_cache, layout, dst) == block_bytes(a_cache, layout, src), (src, dst)
    for blk in set(range(SHAPE.blocks)) - set(LOADED):
        assert block_bytes(b_cache, layout, blk) == before[blk], f"block {blk} was not loaded but changed"
    counts = b.take_counts()
    assert counts is not None and counts["load_blocks"] == len(LOADED) and counts["load_error_blocks"] == 0
    assert len(counts["load_seconds_each"]) == 1 and counts["load_error_causes"] == {}
    row = sum(len(x) for x in block_bytes(a_cache, layout, 0))
    assert counts["load_bytes"] == len(LOADED) * row


@pytest.mark.parametrize("layout", list(ORDERS))
def test_the_scheduler_sides_lookup_finds_what_a_worker_saved(
        layout: str, device: str, store_backend: Callable[[str], Backend],
        make_core: Callable[..., WorkerCore]) -> None:
    """The scheduler asks the store by the names and groups it derives from vLLM's config alone;
    what the worker stored (directly or staged) answers under exactly those groups."""
    backend = store_backend("memory")
    rows = rows_for(layout, device, backend)
    core = make_core(backend, SHAPE.layer_names(), rows=rows)
    core.register_kv_caches(make_cache(layout, SHAPE, seed=3, device=device), SHAPE.blocks)
    assert core.groups == rows.groups  # type: ignore[attr-defined]
    block_names = names(4, seed=9)
    save(core, "r", [1, 2, 3, 4], block_names)
    scheduler = store_backend("memory")
    try:
        held = scheduler.lookup(rows.groups, block_names, Hint.of("store", namespace="t"),  # type: ignore
                                timeout_s=5.0)
        unheld = scheduler.lookup(rows.groups, names(2, seed=10), Hint.of("store", namespace="t"),  # type: ignore
                                  timeout_s=5.0)
    finally:
        assert scheduler.shutdown() == frozenset()
        scheduler.close()
    assert list(held) == [True] * 4 and list(unheld) == [False, False]


def test_a_cuda_cache_is_staged_for_a_host_store_and_registered_as_one_region_of_whole_blocks(
        store_backend: Callable[[str], Backend], make_core: Callable[..., WorkerCore]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is false here)")
    backend = store_backend("memory")
    core = make_core(backend, SHAPE.layer_names())
    core.register_kv_caches(make_cache("LBNHC", SHAPE, device="cuda"), SHAPE.blocks)
    assert core.staged and core.rows is not None and core.rows.grouping is Grouping.BLOCK
    (region,) = core.regions
    assert region.memory_kind is MemoryKind.HOST and region.slot_bytes == core.block_bytes
    assert core.pool is not None and core.pool.rows is not None and core.pool.rows.is_pinned()
