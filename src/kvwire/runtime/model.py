"""A tiny deterministic transformer whose K/V live in a lender's pages, so that a transfer is
proven by what a model computes: the logits after a pull equal those after a local prefill.

Random weights from a seed, a few layers, runs in milliseconds on the CPU. Its attention layers
are split into PAGED layer groups (``layers_per_group`` each); one slot of a group holds one block
of ``block_tokens`` tokens: ``(layers_in_group, 2, block_tokens, heads, head_dim)``.

A hybrid model (``recurrent_layers``, e.g. ``ModelConfig.hybrid()``) replaces some layers by a
gated linear recurrence ``h_t = g_t * h_(t-1) + (1 - g_t) * u_t`` (one ``d_model`` vector per
layer). Those layers form one STATE group, the last group of the layout, whose slot holds
``h`` of every recurrent layer after a given token: ``(recurrent layers, d_model)``. The model
reads the state at ``start`` from the request's state slot, writes the state after every block
it completes into that block's checkpoint row (``Request.checkpoint_rows``), and leaves the
state after ``end`` in the request's slot. The scan runs block by block, so a prefill resumed
at a block boundary does exactly the arithmetic a whole prefill does from there."""

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
    #: Indices of the layers that are gated linear recurrences instead of attention (a hybrid).
    recurrent_layers: tuple[int, ...] = ()
    #: Request state slots of a hybrid model's STATE pool (requests open at once).
    state_slots: int = 8

    def __post_init__(self) -> None:
        rec = tuple(sorted({int(i) for i in self.recurrent_layers}))
        object.__setattr__(self, "recurrent_layers", rec)
        if min(self.vocab, self.layers, self.heads, self.head_dim, self.block_tokens, self.max_tokens,
               self.state_slots) <= 0:
            raise ValueError("every ModelConfig size must be positive")
        if rec and not (0 <= rec[0] and rec[-1] < self.layers):
            raise ValueError(f"recurrent_layers {list(rec)} must lie in [0, {self.layers})")
        attention = self.layers - len(rec)
        if attention < 1:
            raise ValueError("a model needs at least one attention layer (the recurrence alone has no PAGED cache)")
        if attention % self.layers_per_group:
            raise ValueError(f"attention layers ({attention}) must be a multiple of layers_per_group "
                             f"({self.layers_per_group})")

    @classmethod
    def hybrid(cls, **overrides: object) -> ModelConfig:
        """A small hybrid: four layers, the second and fourth recurrent (two PAGED groups of one
        attention layer each, and one STATE group)."""
        base: dict[str, object] = {"layers": 4, "layers_per_group": 1, "recurrent_layers": (1, 3)}
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.layers) if i not in self.recurrent_layers)

    @property
    def state_group(self) -> int | None:
        """The STATE group's id (after the PAGED groups), or ``None`` without recurrent layers."""
        return len(self.attention_layers) // self.layers_per_group if self.recurrent_layers else None

    @property
    def d_model(self) -> int:
        return self.heads * self.head_dim

    @property
    def model_id(self) -> str:
        """Names the weights: equal ids mean equal weights, hence interchangeable K/V."""
        raw = f"tiny-v1:{self.vocab}:{self.layers}:{self.heads}:{self.head_dim}:{self.max_tokens}:{self.seed}:{self.dtype}"
        if self.recurrent_layers:
            raw += ":recurrent=" + ",".join(map(str, self.recurrent_layers))
        return "tiny-" + hashlib.blake2b(raw.encode(), digest_size=8).hexdigest()

    def layout(self, num_blocks: int) -> CacheLayout:
        """The cache layout this model needs, with ``num_blocks`` slots per PAGED pool."""
        dtype = getattr(torch, self.dtype)
        groups = tuple(
            GroupSpec(g, CacheKind.PAGED, (self.layers_per_group, 2, self.block_tokens, self.heads, self.head_dim), dtype)
            for g in range(len(self.attention_layers) // self.layers_per_group)
        )
        if self.state_group is None:
            return CacheLayout(block_tokens=self.block_tokens, num_blocks=num_blocks, num_state_slots=0, groups=groups)
        state = GroupSpec(self.state_group, CacheKind.STATE, (len(self.recurrent_layers), self.d_model), dtype)
        return CacheLayout(block_tokens=self.block_tokens, num_blocks=num_blocks, num_state_slots=self.state_slots,
                           groups=(*groups, state))


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
        # Drawn after every attention weight, so a model without recurrent layers keeps the
        # weights it always had.
        for li in config.recurrent_layers:
            layer = self.layers[li]
            layer["gate"] = w(d, d, scale=1 / math.sqrt(d))
            layer["gate_bias"] = w(d, scale=0.5) + 2.0   # gates near 0.9: the state remembers
            layer["input"] = w(d, d, scale=1 / math.sqrt(d))
            layer["output_gate"] = w(d, d, scale=1 / math.sqrt(d))
            del layer["qkv"]
        self._place = {li: divmod(k, config.layers_per_group) for k, li in enumerate(config.attention_layers)}
        self._rec = {li: k for k, li in enumerate(config.recurrent_layers)}

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
            if li in self._rec:
                x = x + self._recur(layer, self._rec[li], request, pools, x, start, end)
                h = torch.nn.functional.layer_norm(x, (cfg.d_model,))
                x = x + torch.nn.functional.gelu(h @ layer["up"]) @ layer["down"]
                continue
            group, lig = self._place[li]
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

    def _recur(self, layer: dict[str, torch.Tensor], index: int, request: Request, pools: dict[int, torch.Tensor],
               x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The recurrent layer ``index``'s output for positions ``[start, end)``: reads its state
        at ``start`` from the request's slot (zeros at 0), writes the state after each block it
        completes into that block's checkpoint row and the state after ``end`` into the slot."""
        cfg = self.config
        gid = cfg.state_group
        assert gid is not None
        pool = pools[gid]
        slot = request.state_slots[gid]
        rows = request.checkpoint_rows
        B = cfg.block_tokens
        h = torch.nn.functional.layer_norm(x, (cfg.d_model,))
        gate = torch.sigmoid(h @ layer["gate"] + layer["gate_bias"])
        drive = (1 - gate) * (h @ layer["input"])
        state = pool[slot, index].clone() if start else torch.zeros(cfg.d_model, dtype=x.dtype, device=self.device)
        out = torch.empty_like(x)
        # Chunks end at block boundaries, so a prefill resumed at a boundary repeats the same sums.
        cut = start
        while cut < end:
            stop = min(end, (cut // B + 1) * B)
            a, b = cut - start, stop - start
            log_g = torch.cumsum(torch.log(gate[a:b]), dim=0)                 # (n, d)
            later = ~torch.tril(torch.ones(b - a, b - a, device=self.device, dtype=torch.bool))
            diff = (log_g[:, None, :] - log_g[None, :, :]).masked_fill(later[:, :, None], -math.inf)
            decay = torch.exp(diff)                                           # (t, s, d): g_(s+1..t)
            seq = torch.exp(log_g) * state + (decay * drive[a:b][None, :, :]).sum(dim=1)
            out[a:b] = seq
            state = seq[-1]
            if stop % B == 0 and rows is not None:
                pool[int(rows[stop // B - 1]), index] = state
            cut = stop
        pool[slot, index] = state
        return (out * torch.nn.functional.silu(h @ layer["output_gate"])) @ layer["out"]
