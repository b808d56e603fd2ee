"""How the worker core reads vLLM's KV tensors: the grouping vLLM's config predicts is the one the
tensors give, for every layout; a layout it does not know, a cache that disagrees with the config,
and caches it cannot serve are refused with a ``ValueError`` naming the shapes and strides, before
anything is registered; the connector's staging option is validated like its others."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from kvwire_vllm.config import ConnectorConfig
from kvwire_vllm.core import WorkerCore
from kvwire_vllm.kvcache import Grouping, PagedCache, StoreRows, store_rows
from vllm_layouts import LEGACY, ORDERS, Shape, make_cache

from kvwire.contract import Backend, MemoryKind
from kvwire.registry import ConfigError

SHAPE = Shape()
HOST = frozenset({MemoryKind.HOST})
DEVICE = frozenset({MemoryKind.DEVICE})
BOTH = HOST | DEVICE


@pytest.mark.parametrize("layout", list(ORDERS))
@pytest.mark.parametrize("kinds", [HOST, BOTH], ids=["host-backend", "device-backend"])
def test_the_config_predicts_the_grouping_the_tensors_give(layout: str, kinds: frozenset[MemoryKind]) -> None:
    """The scheduler side derives the store's groups from vLLM's config alone; a cache in that
    layout, as vLLM allocates it, gives the same ones (so lookups ask for what saves stored)."""
    cache = PagedCache(make_cache(layout, SHAPE), SHAPE.layer_names(), SHAPE.blocks)
    for cuda in (False, True):
        predicted = store_rows(layout, cuda=cuda, memory_kinds=kinds, num_layers=SHAPE.layers,
                               num_kv_heads=SHAPE.heads)
        direct_kind = MemoryKind.DEVICE if cuda else MemoryKind.HOST
        grouping = cache.grouping()
        if direct_kind in kinds and grouping is not None:
            count = len(cache.planes) if grouping is Grouping.PLANE else 1
            assert predicted == StoreRows(grouping, tuple(range(count)), staged=False), (layout, cuda)
        else:
            assert predicted == StoreRows(Grouping.BLOCK, (0,), staged=True), (layout, cuda)


@pytest.mark.parametrize("layout", [*ORDERS, *LEGACY])
def test_planes_cover_each_block_once_and_rows_are_the_blocks_bytes(layout: str) -> None:
    """A row is every plane's block, in layer order: its bytes are exactly the layer blocks'."""
    kv = make_cache(layout, SHAPE)
    cache = PagedCache(kv, SHAPE.layer_names(), SHAPE.blocks)
    assert cache.row_bytes == SHAPE.layers * SHAPE.heads * SHAPE.block_size * 2 * SHAPE.head_dim * 2
    assert len(cache.planes) % SHAPE.layers == 0 and set(cache.plane_layer) == set(range(SHAPE.layers))
    dim = 1 if layout == "FLASH_ATTN_KV_SPLIT" else 0
    for blk in (0, 7, SHAPE.blocks - 1):
        row = b"".join(p[blk].contiguous().view(torch.uint8).numpy().tobytes() for p in cache.planes)
        layer_bytes = [t.select(dim, blk) for t in kv.values()]
        assert sorted(row) == sorted(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes()
                                              for t in layer_bytes))


def test_a_block_that_is_no_few_spans_is_refused_naming_shape_and_strides() -> None:
    blocks_innermost = {name: torch.zeros(2, 8, 4, 16, SHAPE.blocks).permute(4, 0, 1, 2, 3)
                        for name in SHAPE.layer_names()}
    with pytest.raises(ValueError, match=r"shape \(24, 2, 8, 4, 16\), strides \(1, 12288, 1536, 384, 24\)"):
        PagedCache(blocks_innermost, SHAPE.layer_names(), SHAPE.blocks)


def test_layers_sharing_memory_are_refused() -> None:
    kv = make_cache("LBNHC", SHAPE)
    names = SHAPE.layer_names()
    kv[names[2]] = kv[names[0]]
    with pytest.raises(ValueError, match="share KV memory"):
        PagedCache(kv, names, SHAPE.blocks)


def test_a_missing_layer_a_mixed_dtype_and_a_wrong_block_count_are_refused() -> None:
    kv = make_cache("LBNHC", SHAPE)
    names = SHAPE.layer_names()
    with pytest.raises(ValueError, match="registered no KV cache for layer"):
        PagedCache({n: kv[n] for n in names[:2]}, names, SHAPE.blocks)
    mixed = dict(kv)
    mixed[names[1]] = kv[names[1]].float()
    with pytest.raises(ValueError, match="one device and dtype"):
        PagedCache(mixed, names, SHAPE.blocks)
    with pytest.raises(ValueError, match="but vLLM allocated 7"):
        PagedCache(kv, names, 7)


def test_kernel_blocks_of_one_block_make_one_block() -> None:
    """vLLM views a block split into kernel blocks as ``[blocks * ratio, ...]``: the core takes
    ``ratio`` consecutive kernel blocks as one block."""
    kv = make_cache("LBNHC", SHAPE)
    cache = PagedCache(kv, SHAPE.layer_names(), SHAPE.blocks // 2)
    assert cache.num_blocks == SHAPE.blocks // 2
    assert cache.row_bytes == 2 * PagedCache(kv, SHAPE.layer_names(), SHAPE.blocks).row_bytes


def test_a_cache_the_config_does_not_describe_is_refused_before_registering(
        store_backend: Callable[[str], Backend], make_core: Callable[..., WorkerCore]) -> None:
    backend = store_backend("memory")
    said = store_rows("LBNHC", cuda=False, memory_kinds=HOST, num_layers=SHAPE.layers, num_kv_heads=SHAPE.heads)
    core = make_core(backend, SHAPE.layer_names(), rows=said)
    with pytest.raises(ValueError, match=r"config says .* plane rows in 3 group.*shape \(24, 2, 4, 16\), strides \(384, 16, 32, 1\)"):
        core.register_kv_caches(make_cache("BLNHC", SHAPE), SHAPE.blocks)
    assert core.registration is None and core.pool is None


def test_a_cache_that_can_only_be_staged_is_refused_when_staging_is_forbidden(
        store_backend: Callable[[str], Backend], make_core: Callable[..., WorkerCore]) -> None:
    core = make_core(store_backend("memory"), SHAPE.layer_names(), stage=False)
    with pytest.raises(ValueError, match="cannot be registered without staging"):
        core.register_kv_caches(make_cache("BHLNC", SHAPE), SHAPE.blocks)
    assert core.registration is None


def test_store_rows_refuses_an_unknown_layout_and_a_backend_that_reaches_neither_memory() -> None:
    with pytest.raises(ValueError, match="'XYZ' is not one kvwire-vllm knows"):
        store_rows("XYZ", cuda=True, memory_kinds=BOTH, num_layers=2, num_kv_heads=2)
    with pytest.raises(ValueError, match="HOST memory for staging"):
        store_rows("LBNHC", cuda=False, memory_kinds=DEVICE, num_layers=2, num_kv_heads=2)
    assert store_rows(None, cuda=False, memory_kinds=HOST, num_layers=2, num_kv_heads=2).groups == (0, 1)


@pytest.mark.parametrize("value", [0, -1, float("nan"), True, "64"])
def test_the_staging_option_is_validated(value: object) -> None:
    with pytest.raises(ConfigError, match="'staging_mib' must be a number of MiB > 0"):
        ConnectorConfig.parse({"backend": "memory", "staging_mib": value})
    assert ConnectorConfig.parse({"backend": "memory", "staging_mib": 8}).staging_mib == 8.0
