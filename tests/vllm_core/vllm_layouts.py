"""KV cache tensors as vLLM hands them to ``register_kv_caches``, built without vLLM.

vLLM 0.32 (``vllm/v1/worker/utils.py: allocate_kv_cache``, ``kv_cache_interface.py:
create_kv_cache_views``) allocates one flat int8 buffer for every layer, views it as the logical
``[L, B, H, N, C]`` (layers, blocks, KV heads, tokens of a block, K and V of a head side by side)
with strides in the physical order its resolved ``KVCacheLayout`` names (a stride permutation of
those five axes, innermost last), and gives each layer ``view[l]`` in the cache dtype. Older CUDA
backends gave a tensor per layer: FlashAttention's ``(2, B, N, H, D)`` and FlashInfer's HND
``(B, 2, H, N, D)``. The bytes are random, drawn from a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ORDERS", "LEGACY", "LAYOUTS", "Shape", "make_cache", "block_bytes"]

#: vLLM 0.32's KVCacheLayout members: the physical order of the logical axes (L=0, B=1, H=2, N=3, C=4).
ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
#: Per-layer tensors of vLLM's CUDA backends before 0.32.
LEGACY = ("FLASH_ATTN_KV_SPLIT", "FLASHINFER_HND")
LAYOUTS = (*ORDERS, *LEGACY)


@dataclass(frozen=True)
class Shape:
    layers: int = 3
    blocks: int = 24
    heads: int = 2
    block_size: int = 4
    head_dim: int = 8
    dtype: torch.dtype = torch.bfloat16

    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]


def _random_bytes(count: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: GiBs on a GPU in no time
    return torch.randint(-128, 128, (count,), dtype=torch.int8, generator=g, device=device)


def make_cache(layout: str, shape: Shape = Shape(), *, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One tensor per layer name, in ``layout``, filled with random bytes."""
    s = shape
    el = torch.empty(0, dtype=s.dtype).element_size()
    names = s.layer_names()
    if layout in ORDERS:
        logical = (s.layers, s.blocks, s.heads, s.block_size, 2 * s.head_dim * el)  # C in bytes, as vLLM's
        strides = [0] * 5
        step = 1
        for axis in reversed(ORDERS[layout]):
            strides[axis] = step
            step *= logical[axis]
        raw = _random_bytes(step, seed, device)
        view = torch.as_strided(raw, logical, strides)
        return {name: view[i].view(s.dtype) for i, name in enumerate(names)}
    per_layer = s.blocks * s.heads * s.block_size * 2 * s.head_dim * el
    out = {}
    for i, name in enumerate(names):
        raw = _random_bytes(per_layer, seed * 1000 + i, device).view(s.dtype)
        if layout == "FLASH_ATTN_KV_SPLIT":
            out[name] = raw.view(2, s.blocks, s.block_size, s.heads, s.head_dim)
        elif layout == "FLASHINFER_HND":
            out[name] = raw.view(s.blocks, 2, s.heads, s.block_size, s.head_dim)
        else:
            raise ValueError(f"no layout {layout!r}")
    return out


def block_bytes(cache: dict[str, torch.Tensor], layout: str, block: int) -> list[bytes]:
    """Block ``block`` of every layer as bytes, read through plain indexing of the logical view
    (not the planes the connector cuts): what vLLM's attention reads for that block."""
    dim = 1 if layout == "FLASH_ATTN_KV_SPLIT" else 0
    return [t.select(dim, block).contiguous().cpu().view(torch.uint8).numpy().tobytes() for t in cache.values()]
