"""What the clause tests of the conformance suite share: fixed plans of PAGED groups, the held
rows a store or a serving peer should hold, and checks of a fetch's bits against them."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire.contract import CacheKind, Hint
from kvwire.testing.exchange import Exchange
from kvwire.testing.layout import Bench, GroupPlan, ViewPlan

__all__ = ["pages", "offer_for", "check_bits", "transfer_checked", "needs_misses", "store_only", "with_field"]


def pages(specs: list[tuple[int, int]], seed: int, shared: bool, spare: int = 1) -> ViewPlan:
    """PAGED groups of ``(slot_bytes, rows)``; sink slots reversed so row order and slot order
    differ; with ``shared`` every group has the same row count and names (a pull's blocks)."""
    if shared:
        rows = max(r for _, r in specs)
        specs = [(size, rows) for size, _ in specs]
    groups = []
    for gid, (size, rows) in enumerate(specs):
        src = tuple(range(spare, spare + rows))
        dst = tuple(reversed(src))
        groups.append(GroupPlan(gid, CacheKind.PAGED, size, rows, src, dst, rows + 2 * spare, 16))
    return ViewPlan(tuple(groups), seed, shared)


def offer_for(ex: Exchange, plan: ViewPlan, pick) -> dict[int, list[int]]:  # type: ignore[no-untyped-def]
    """What the other end should hold: for a store ``pick(gi, rows)`` of each group; for a serving
    peer a prefix of the same length in every group (a pull serves a prefix)."""
    offer = {gi: list(pick(gi, g.rows)) for gi, g in enumerate(plan.groups)}
    if ex.serves_pulls:
        keep = min(len(v) for v in offer.values()) if offer else 0
        offer = {gi: list(range(keep)) for gi in offer}
    return offer


def check_bits(ex: Exchange, bench: Bench, offer, take, fetched, clause: str) -> None:  # type: ignore[no-untyped-def]
    expected = ex.expected(bench, offer, take)
    for gi, mask, want in zip(bench.groups_in(take), fetched.masks, expected, strict=True):
        gid = bench.plan.groups[gi].group_id
        assert fetched.is_delivered, f"{clause}: a fetch of held and missing rows must deliver, got {fetched!r}"
        wrong = np.flatnonzero(mask != want)
        assert wrong.size == 0, (
            f"{clause}: group {gid}: row(s) {wrong[:10].tolist()} of {mask.size} have the wrong bit; the other end "
            f"holds rows {np.flatnonzero(want)[:10].tolist()}..., the outcome marks {np.flatnonzero(mask)[:10].tolist()}...")


def transfer_checked(ex: Exchange, bench: Bench, offer, take, clause: str):  # type: ignore[no-untyped-def]
    result = ex.transfer(bench, offer, take)  # checks A7 on every true bit and S2 on all memory
    check_bits(ex, bench, offer, take, result.fetched, clause)
    return result


def needs_misses(ex: Exchange) -> None:
    if not (ex.store or ex.serves_pulls):
        pytest.skip("backend's other end is a peer without the serve-pulls protocol: a fetch cannot miss")


def store_only(ex: Exchange, why: str) -> None:
    if not ex.store:
        pytest.skip(f"backend's other end is a peer; {why} is a store's clause")


def with_field(hint: Hint, key: str, value: object) -> Hint:
    fields = dict(hint.fields)
    fields[key] = value  # type: ignore[assignment]
    return Hint.of(hint.kind, timeout_s=hint.timeout_s, **fields)  # type: ignore[arg-type]
