"""One stored object per block (contract K1, ``block-objects``): where a store names the protocol,
the worker core publishes all planes of a block (every layer's K and V) as one object under the
block's name, loads read a block's planes together, and the scheduler side's lookup finds them
under the block layout it derives from vLLM's config alone. Without the protocol (or without the
row sizes in the config) the store holds one object per block and plane, as before."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from core_driver import load, names, save, start_load
from kvwire_files import FileStore
from kvwire_vllm.core import WorkerCore
from kvwire_vllm.kvcache import LAYOUTS, StoreRows, store_rows
from vllm_layouts import ORDERS, Shape, block_bytes, make_cache

from kvwire.contract import Backend, Hint
from kvwire.contract.blocks import BLOCK_OBJECTS

SHAPE = Shape()
#: Layouts vLLM 0.32 hands over that a host store takes directly (BHLNC is staged): the
#: layer-outer ones as one region per plane, the block-outer ones as one region of whole rows.
DIRECT = [layout for layout in ORDERS if layout != "BHLNC"]


def page_bytes(shape: Shape = SHAPE) -> int:
    """One layer's block in bytes: vLLM's ``page_size_bytes`` (K and V of every head)."""
    return 2 * shape.block_size * shape.heads * shape.head_dim * torch.empty(0, dtype=shape.dtype).element_size()


def config_rows(layout: str, backend: Backend, *, with_sizes: bool = True) -> StoreRows:
    """What vLLM's config makes both sides expect (``kvwire_vllm.layout.rows_of`` without vLLM)."""
    caps = backend.capabilities()
    rows = store_rows(layout, cuda=False, memory_kinds=caps.memory_kinds, num_layers=SHAPE.layers,
                      num_kv_heads=SHAPE.heads, page_bytes=page_bytes() if with_sizes else 0)
    return rows.with_block_objects(caps.protocols, True) if rows.row_bytes else rows


def objects_in(root: Path) -> int:
    store = FileStore(str(root), capacity_bytes=1)
    try:
        return len(store.keys())
    finally:
        store.close()


def lookup(backend: Backend, rows: StoreRows, block_names: np.ndarray, *, blocks: bool) -> list[bool]:
    fields = {"blocks": rows.block_layout()} if blocks else {}
    try:
        return [bool(b) for b in backend.lookup(rows.groups, block_names,  # type: ignore[attr-defined]
                                                Hint.of("store", namespace="t", **fields), timeout_s=5.0)]
    finally:
        assert backend.shutdown() == frozenset()
        backend.close()


@pytest.mark.parametrize("layout", DIRECT)
def test_a_store_with_block_objects_holds_one_object_per_block_and_loads_them_bit_for_bit(
        layout: str, tmp_path: Path, store_backend: Callable[[str], Backend],
        make_core: Callable[..., WorkerCore]) -> None:
    a_backend, b_backend = store_backend("files"), store_backend("files")
    assert BLOCK_OBJECTS in a_backend.capabilities().protocols
    rows = config_rows(layout, a_backend)
    planes = LAYOUTS[layout][0] == "plane"  # block-outer: a block is one row, one group already
    assert rows.block_objects is planes and (len(rows.groups) > 1) is planes
    a = make_core(a_backend, SHAPE.layer_names(), rows=rows)
    b = make_core(b_backend, SHAPE.layer_names(), rows=rows)
    a_cache, b_cache = make_cache(layout, SHAPE, seed=1), make_cache(layout, SHAPE, seed=2)
    a.register_kv_caches(a_cache, SHAPE.blocks)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    assert a.block_objects is planes and not a.staged and len(a.groups) == len(rows.groups)
    block_names = names(5, seed=21)

    save(a, "a", [4, 0, 19, 7, 12], block_names)
    assert objects_in(tmp_path / "files-store") == 5  # not 5 x planes

    assert load(b, "b", [1, 2, 3, 5, 6], block_names) == set()
    for src, dst in zip([4, 0, 19, 7, 12], [1, 2, 3, 5, 6], strict=True):
        assert block_bytes(b_cache, layout, dst) == block_bytes(a_cache, layout, src), (src, dst)
    if planes:
        assert lookup(store_backend("files"), rows, block_names, blocks=True) == [True] * 5
        # The objects are block objects: asked per plane, the store holds none of them (K1.6).
        assert lookup(store_backend("files"), rows, block_names, blocks=False) == [False] * 5
    else:
        assert lookup(store_backend("files"), rows, block_names, blocks=False) == [True] * 5


def test_without_row_sizes_in_the_config_the_store_keeps_an_object_per_block_and_plane(
        tmp_path: Path, store_backend: Callable[[str], Backend], make_core: Callable[..., WorkerCore]) -> None:
    backend = store_backend("files")
    rows = config_rows("LBHNC", backend, with_sizes=False)
    core = make_core(backend, SHAPE.layer_names(), rows=rows)
    core.register_kv_caches(make_cache("LBHNC", SHAPE, seed=3), SHAPE.blocks)
    assert not core.block_objects
    save(core, "a", [2, 3], names(2, seed=22))
    assert objects_in(tmp_path / "files-store") == 2 * SHAPE.layers


def test_a_load_inside_the_step_reads_every_layer_of_a_block_object_before_the_first_layer_computes(
        tmp_path: Path, store_backend: Callable[[str], Backend], make_core: Callable[..., WorkerCore]) -> None:
    """``load_async`` false with block objects: one fetch for all layers, waited for at the first
    layer (a part of a block cannot be read alone); a block the store lacks is a load error in
    every layer, and the held ones are whole."""
    layout = "LBHNC"
    a_backend, b_backend = store_backend("files"), store_backend("files")
    rows = config_rows(layout, a_backend)
    a = make_core(a_backend, SHAPE.layer_names(), rows=rows)
    b = make_core(b_backend, SHAPE.layer_names(), rows=rows)
    a_cache, b_cache = make_cache(layout, SHAPE, seed=4), make_cache(layout, SHAPE, seed=5)
    a.register_kv_caches(a_cache, SHAPE.blocks)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    all_names = names(3, seed=23)
    save(a, "a", [1, 2], all_names[:2])

    start_load(b, "b", [8, 9, 10], all_names, sync=True)
    b.wait_for_layer_load(SHAPE.layer_names()[0])
    for src, dst in ((1, 8), (2, 9)):  # every layer, after the first layer's wait
        assert block_bytes(b_cache, layout, dst) == block_bytes(a_cache, layout, src)
    for layer in SHAPE.layer_names()[1:]:
        b.wait_for_layer_load(layer)
    b.wait_for_save()
    assert b.take_load_errors() == {10}


def test_a_cache_whose_blocks_differ_from_the_configs_is_refused_at_registration(
        store_backend: Callable[[str], Backend], make_core: Callable[..., WorkerCore]) -> None:
    """The scheduler side asks the store for block objects of the config's layout: a worker
    whose tensors give other row sizes would store objects no lookup finds."""
    backend = store_backend("files")
    rows = config_rows("LBHNC", backend)
    wrong = StoreRows(rows.grouping, rows.groups, rows.staged, tuple(b * 2 for b in rows.row_bytes), True)
    core = make_core(backend, SHAPE.layer_names(), rows=wrong)
    with pytest.raises(ValueError, match="block.*layout|layout"):
        core.register_kv_caches(make_cache("LBHNC", SHAPE, seed=6), SHAPE.blocks)
    assert core.registration is None
