"""What both halves of the connector derive alike from vLLM's config: the KV layout a
one-group connector serves, what the store holds per block (one object per block where the
backend names ``block-objects``), the namespace of a tensor-parallel shard, and the scope and
plain facts that a block's names and a transceiver state depend on. The scheduler side and the
worker side each compute these on their own process; equal configs give equal answers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvwire.contract.capabilities import Capabilities, OtherEnd
from kvwire_vllm.kvcache import StoreRows, store_rows
from kvwire_vllm.names import scope_digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["layout_of", "resolved_layout", "rows_of", "store_namespace", "facts_of", "scope_of"]


def layout_of(kv_cache_config: KVCacheConfig) -> tuple[int, list[str], dict[str, Any]]:
    """Block size, attention layer names (their index is the kvwire group id) and the layout
    facts that go into the scope. Refuses layouts a one-group connector cannot serve."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"KvwireConnector serves models with one KV cache group (attention only); this one has "
                         f"{len(groups)} (hybrid or sliding-window models are not supported yet)")
    spec = groups[0].kv_cache_spec
    layout = {
        "spec": type(spec).__name__,
        "block_size": int(spec.block_size),
        "num_kv_heads": int(getattr(spec, "num_kv_heads", 0)),
        "head_size": int(getattr(spec, "head_size", 0)),
        "dtype": str(getattr(spec, "dtype", "")),
        "layers": list(groups[0].layer_names),
    }
    return int(spec.block_size), list(groups[0].layer_names), layout


def resolved_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str | None:
    """The KV cache layout the engine core resolved (a ``KVCacheLayout`` name), or None."""
    name = getattr(vllm_config.cache_config, "kv_cache_layout", None) or getattr(kv_cache_config, "kv_cache_layout",
                                                                                None)
    return str(name) if name else None


def rows_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, capabilities: Capabilities) -> StoreRows:
    """What the store holds per block for this engine and a backend of ``capabilities``
    (:func:`kvwire_vllm.kvcache.store_rows`, one object per block where the store names
    ``block-objects``): both sides derive it from the config alike."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    cuda = str(getattr(vllm_config.device_config, "device_type", "cpu")) == "cuda"
    heads = int(getattr(spec, "num_heads", getattr(spec, "num_kv_heads", 1)))
    try:
        page_bytes = int(spec.page_size_bytes)
    except (AttributeError, NotImplementedError, TypeError, ValueError):
        page_bytes = 0
    rows = store_rows(resolved_layout(vllm_config, kv_cache_config), cuda=cuda,
                      memory_kinds=capabilities.memory_kinds,
                      num_layers=len(kv_cache_config.kv_cache_groups[0].layer_names), num_kv_heads=heads,
                      page_bytes=page_bytes)
    if not rows.row_bytes:  # the row sizes are part of a block object's layout: unknown, keep per-group objects
        return rows
    return rows.with_block_objects(capabilities.protocols, capabilities.other_end is OtherEnd.STORE)


def store_namespace(namespace: str, tp_rank: int, tp_size: int) -> str:
    """The namespace one tensor-parallel shard stores under: each shard holds other heads."""
    return namespace if tp_size == 1 else f"{namespace}/tp{tp_rank}of{tp_size}"


def facts_of(vllm_config: VllmConfig, layout: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The plain facts an engine's blocks depend on, for a transceiver state: a pulling engine
    whose facts differ names the one that does (the scope digest only says that one does)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    facts = {
        "model": str(model.model)[-256:],
        "model_dtype": str(model.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "tensor_parallel_size": str(int(parallel.tensor_parallel_size)),
        "pipeline_parallel_size": str(int(parallel.pipeline_parallel_size)),
        "block_size": str(layout.get("block_size", "")),
        "num_layers": str(len(layout.get("layers", ()))),
        "num_kv_heads": str(layout.get("num_kv_heads", "")),
        "head_size": str(layout.get("head_size", "")),
        "kv_cache_layout": str(layout.get("kv_cache_layout", "")),
    }
    return tuple(sorted(facts.items()))


def scope_of(vllm_config: VllmConfig, layout: dict[str, Any]) -> bytes:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    scope: dict[str, Any] = {
        "model": str(model.model),
        "revision": str(model.revision),
        "model_dtype": str(model.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "tp": int(parallel.tensor_parallel_size),
        "pp": int(parallel.pipeline_parallel_size),
        "layout": layout,
    }
    load_format = str(vllm_config.load_config.load_format)
    if load_format == "dummy":  # random weights: only the same seed computes the same KV
        scope["dummy_seed"] = int(model.seed if model.seed is not None else 0)
    return scope_digest(scope)
