"""Shared by the lender tests: small layouts, and the pages a deterministic "model" writes, so a
test can say which bytes every row must hold (a block's bytes follow from its name)."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from kvwire.contract import CacheKind
from kvwire.lender import CacheLayout, GroupSpec, Lender, Request

_PAGES: dict[tuple[bytes, int, tuple[int, ...], torch.dtype], torch.Tensor] = {}


def paged_layout(block_tokens: int = 2, num_blocks: int = 12) -> CacheLayout:
    return CacheLayout(
        block_tokens=block_tokens,
        num_blocks=num_blocks,
        num_state_slots=0,
        groups=(
            GroupSpec(0, CacheKind.PAGED, (2, 2, block_tokens, 3), torch.float32),
            GroupSpec(1, CacheKind.PAGED, (block_tokens, 2), torch.int32),
        ),
    )


def mixed_layout(block_tokens: int = 2, num_blocks: int = 12, num_state_slots: int = 3) -> CacheLayout:
    """PAGED, STATE, PAGED: the STATE group sits between, so layout order is exercised."""
    return CacheLayout(
        block_tokens=block_tokens,
        num_blocks=num_blocks,
        num_state_slots=num_state_slots,
        groups=(
            GroupSpec(0, CacheKind.PAGED, (2, 2, block_tokens, 3), torch.float32),
            GroupSpec(7, CacheKind.STATE, (3, 2), torch.float16),
            GroupSpec(1, CacheKind.PAGED, (block_tokens, 2), torch.int32),
        ),
    )


def page(key: bytes, group: GroupSpec) -> torch.Tensor:
    """The bytes a slot of ``group`` must hold for the content ``key`` (a block name, or a state
    key): small integers, exact in every dtype used here."""
    cache_key = (key, group.group_id, group.slot_shape, group.dtype)
    found = _PAGES.get(cache_key)
    if found is None:
        seed = int.from_bytes(hashlib.blake2b(key + bytes([group.group_id]), digest_size=8).digest(), "little")
        values = np.random.default_rng(seed).integers(0, 1000, size=group.slot_shape)
        found = _PAGES[cache_key] = torch.from_numpy(values).to(group.dtype)
    return found


def state_key(tokens: np.ndarray) -> bytes:
    """The content key of a STATE slot that has seen exactly ``tokens``."""
    return b"state:" + np.asarray(tokens, dtype="<i8").tobytes()


def garbage(group: GroupSpec) -> torch.Tensor:
    return torch.full(group.slot_shape, -7, dtype=group.dtype)


def write_blocks(lender: Lender, request: Request, first: int, stop: int) -> None:
    """What a model's prefill writes: blocks ``[first, stop)`` of the request, in every PAGED pool."""
    names = request.names
    for g in lender.layout.paged_groups:
        pool = lender.pool(g.group_id)
        for b in range(first, min(stop, len(names))):
            pool[int(request.block_table[b])] = page(names[b].tobytes(), g)


def write_state(lender: Lender, request: Request, upto: int) -> None:
    for g in lender.layout.state_groups:
        lender.pool(g.group_id)[request.state_slots[g.group_id]] = page(state_key(request.tokens[:upto]), g)


def prefill(lender: Lender, request: Request, upto: int | None = None) -> None:
    """Computes the request from its resume point to ``upto`` (default: all its tokens) and
    commits, as a model would."""
    upto = len(request.tokens) if upto is None else upto
    start = lender.resume_bounds(request)
    bt = lender.layout.block_tokens
    write_blocks(lender, request, start // bt, upto // bt)
    write_state(lender, request, upto)
    lender.commit(request, upto)
