"""A tiny deterministic transformer whose K/V live in a lender's pages, so that a transfer is
proven by what a model computes: the logits after a pull equal those after a local prefill.

Random weights from a seed, a few layers, runs in milliseconds on the CPU. Its layers are split
into PAGED layer groups (``layers_per_group`` each); one slot of a group holds one block of
``block_tokens`` tokens: ``(layers_in_group, 2, block_tokens, heads, head_dim)``."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from kvwire.contract import CacheKind
from kvwire.lender import CacheLayout, GroupSpec, Request

__all__ = ["ModelConfig", "TinyTransformer"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of the tiny model and of its cache."""

    vocab: int = 512
    layers: int = 4
    layers_per_group: int = 2
    heads: int = 2
    head_dim: int = 16
    block_tokens: int = 16
    max_tokens: int = 8192
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.layers % self.layers_per_group:
            raise ValueError(f"layers ({self.layers}) must be a multiple of layers_per_group ({self.layers_per_group})")
        if min(self.vocab, self.layers, self.heads, self.head_dim, self.block_tokens, self.max_tokens) <= 0:
            raise ValueError("every ModelConfig size must be positive")

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim

    @property
    def model_id(self) -> str:
        """Names the weights: equal ids mean equal weights, hence interchangeable K/V."""
        raw = f"tiny-v1:{self.vocab}:{self.layers}:{self.heads}:{self.head_dim}:{self.max_tokens}:{self.seed}:{self.dtype}"
        return "tiny-" + hashlib.blake2b(raw.encode(), digest_size=8).hexdigest()

    def layout(self, num_blocks: int) -> CacheLayout:
        """The cache layout this model needs, with ``num_blocks`` slots per PAGED pool."""
        dtype = getattr(torch, self.dtype)
        groups = tuple(
            GroupSpec(g, CacheKind.PAGED, (self.layers_per_group, 2, self.block_tokens, self.heads, self.head_dim), dtype)
            for g in range(self.layers // self.layers_per_group)
        )
        return CacheLayout(block_tokens=self.block_tokens, num_blocks=num_blocks, num_state_slots=0, groups=groups)


class TinyTransformer:
    """Pre-norm attention + MLP blocks with learned absolute positions; greedy decoding.

    ``forward(request, pools, tokens, start, end)`` computes positions ``[start, end)`` of
    ``tokens``: it reads K/V of ``[0, start)`` from the request's pages, writes the K/V of the new
    positions at and beyond ``request_written`` into the pages, and returns the logits of the
    last position."""

    def __init__(self, config: ModelConfig, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(config.seed)
        dtype = getattr(torch, config.dtype)
        d, f = config.d_model, 4 * config.d_model

        def w(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=self.device)

        self.embed = w(config.vocab, d, scale=1.0)
        self.pos = w(config.max_tokens, d, scale=0.1)
        self.layers = [
            {
                "qkv": w(d, 3 * d, scale=1 / math.sqrt(d)),
                "out": w(d, d, scale=1 / math.sqrt(d)),
                "up": w(d, f, scale=1 / math.sqrt(d)),
                "down": w(f, d, scale=1 / math.sqrt(f)),
            }
            for _ in range(config.layers)
        ]
        self.unembed = w(d, config.vocab, scale=1 / math.sqrt(d))

    @torch.no_grad()
    def forward(
        self,
        request: Request,
        pools: dict[int, torch.Tensor],
        tokens: np.ndarray,
        start: int,
        end: int,
        written: int,
    ) -> torch.Tensor:
        """Logits after position ``end - 1``. Positions below ``written`` already have their K/V
        in the pages (pulled or reused) and are only read; later ones are written."""
        cfg = self.config
        if not 0 <= start < end <= min(len(tokens), cfg.max_tokens):
            raise ValueError(f"positions [{start}, {end}) outside the prompt of {len(tokens)} tokens (max {cfg.max_tokens})")
        B, H, D = cfg.block_tokens, cfg.heads, cfg.head_dim
        table = torch.from_numpy(np.array(request.block_table, dtype=np.int64)).to(self.device)
        ids = torch.as_tensor(np.asarray(tokens[start:end], dtype=np.int64), device=self.device)
        x = self.embed[ids] + self.pos[start:end]
        n_blocks = (end + B - 1) // B
        blocks = table[:n_blocks]
        pos = torch.arange(start, end, device=self.device)
        new = pos >= written
        new_pos = pos[new]
        causal = torch.arange(end, device=self.device)[None, :] <= pos[:, None]
        for li, layer in enumerate(self.layers):
            group, lig = divmod(li, cfg.layers_per_group)
            pool = pools[group]
            h = torch.nn.functional.layer_norm(x, (cfg.d_model,))
            q, k, v = (h @ layer["qkv"]).split(cfg.d_model, dim=-1)
            q, k, v = (t.reshape(-1, H, D) for t in (q, k, v))
            if new_pos.numel():
                slots = blocks[new_pos // B]
                offs = new_pos % B
                pool[slots, lig, 0, offs] = k[new]
                pool[slots, lig, 1, offs] = v[new]
            kv = pool.index_select(0, blocks)[:, lig]            # (n_blocks, 2, B, H, D)
            keys = kv[:, 0].reshape(-1, H, D)[:end]
            vals = kv[:, 1].reshape(-1, H, D)[:end]
            att = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1), attn_mask=causal
            ).transpose(0, 1).reshape(-1, cfg.d_model)
            x = x + att @ layer["out"]
            h = torch.nn.functional.layer_norm(x, (cfg.d_model,))
            x = x + torch.nn.functional.gelu(h @ layer["up"]) @ layer["down"]
        x = torch.nn.functional.layer_norm(x[-1:], (cfg.d_model,))
        return (x @ self.unembed)[0]
