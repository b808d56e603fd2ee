"""What the clause tests of the conformance suite share: fixed plans of PAGED groups (and an
exchange with a bench of them), the held rows a store or a serving peer should hold, checks of a
fetch's bits against them, and a queue of held fetches to fill and drain."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvwire.contract import CacheKind, Capabilities, Hint
from kvwire.contract.errors import SubmissionError
from kvwire.testing import needs
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Harness, Hold
from kvwire.testing.holder import Submission
from kvwire.testing.layout import Bench, GroupPlan, ViewPlan

__all__ = ["pages", "paged_exchange", "offer_for", "check_bits", "transfer_checked", "needs_misses",
           "store_only", "with_field", "fillable_queue", "fill_queue", "drain_queue"]


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


@contextlib.contextmanager
def paged_exchange(harness: Harness, specs: list[tuple[int, int]], seed: int,
                   *required: Callable[[Capabilities], None],
                   shared: bool | None = None, spare: int = 1,
                   in_flight: int = 1) -> Iterator[tuple[Capabilities, Exchange, Bench]]:
    """Skip unless the backend declares what each of ``required`` asks (``needs.fetch``, ...),
    and takes ``in_flight`` attempts at once; then an exchange and a bench of :func:`pages`
    ``specs`` (``spare`` junk slots either side of the rows), sharing names as ``shared`` says
    (by default, as the backend's other end needs). Yields the capabilities, the exchange and
    the bench."""
    caps = harness.capabilities()
    for need in required:
        need(caps)
    kind = needs.usable_kind(harness, caps)
    plan = pages(specs, seed, needs.shares_names(caps) if shared is None else shared, spare)
    with needs.open_exchange(harness, max_in_flight=in_flight if in_flight > 1 else None) as ex, Bench(
            harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        needs.in_flight(ex.caps, in_flight)
        yield caps, ex, bench


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


@contextlib.contextmanager
def fillable_queue(harness: Harness, slot_bytes: int, seed: int) -> Iterator[tuple[Exchange, Bench, int]]:
    """An exchange (a queue bound of 3 asked for) whose other end the suite can hold, and a bench
    of one group of ``bound + 1`` rows, all offered: yields both and the declared bound. Skips a
    bound above 64, too large to fill here."""
    caps = harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(harness, caps)
    with needs.open_exchange(harness, max_in_flight=3, hold=True) as ex:
        bound = ex.caps.max_in_flight
        if bound > 64:
            pytest.skip(f"backend declares a queue bound of {bound}, too large to fill here")
        if not (ex.store and ex.ends.hold is not None or ex.serves_pulls):
            pytest.skip("the suite cannot hold this backend's other end")
        plan = pages([(slot_bytes, bound + 1)], seed, needs.shares_names(caps))
        with Bench(harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            ex.offer(bench)
            yield ex, bench, bound


def fill_queue(ex: Exchange, bench: Bench, rows: list[int]) -> tuple[list[Submission], Hold | None, list]:  # type: ignore[type-arg]
    """Hold the other end and submit one fetch per row; the requests a serving peer got are
    returned unanswered."""
    hold: Hold | None = None
    if ex.store:
        assert ex.ends.hold is not None
        hold = ex.ends.hold()
    subs = []
    try:
        for row in rows:
            subs.append(ex.fetch(bench.sink_view({0: [row]})))
    except SubmissionError:
        if hold is not None:
            hold.release()
        raise
    requests = ex.holder().take(len(subs)) if ex.serves_pulls else []
    return subs, hold, requests


def drain_queue(ex: Exchange, subs: list[Submission], hold: Hold | None, requests: list) -> None:  # type: ignore[type-arg]
    """Let the fetches :func:`fill_queue` submitted (and any more in ``subs``) finish."""
    if hold is not None:
        hold.release()
    for request in requests:
        ex.holder().finish(ex.holder().answer(request))
    for sub in subs:
        ex.settle(sub)
