"""V1-V4 and H1: what a backend does with the views and hints it is given."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import (
    CacheKind,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    SlotRegion,
    TokenRange,
    View,
)
from kvwire.contract.errors import SubmissionError
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Harness
from kvwire.testing.holder import (
    check_refusal_message,
    refused,
)
from kvwire.testing.layout import BLOCK_TOKENS, Bench, GroupPlan, ViewPlan, simple_plan
from kvwire.testing.marks import checks
from kvwire.testing.plans import (
    offer_for,
    paged_exchange,
    pages,
    store_only,
    transfer_checked,
)
from kvwire.testing.strategies import view_plans

# -- empty views, repeated publish rows ------------------------------------------------------------

@checks("V1.7")
def test_V1_empty_views_and_groups_conclude_like_any_other(kvwire_harness: Harness) -> None:
    """V1.7: a view with no groups, and a group with zero rows beside others, are valid and
    conclude with masks of the right (zero) length."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (32, 3)], 337, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        if ex.store or not ex.serves_pulls:
            out = ex.settle(ex.publish(View(())))
            assert out.is_delivered and out.masks == (), f"V1.7: an empty publish: {out!r}"
        if ex.store or ex.serves_pulls:  # a pull of no group names no block: nothing to ask, delivered
            out = ex.settle(ex.fetch(View(())))
            assert out.is_delivered and out.masks == (), f"V1.7: an empty fetch: {out!r}"
        # A group with zero rows beside one with rows.
        offer = {0: [0, 1, 2], 1: [0, 1, 2]}
        take = {0: [0, 1, 2], 1: []}
        if not (ex.store or ex.serves_pulls):
            pytest.skip("backend's other end is a peer without the serve-pulls protocol")
        if ex.serves_pulls:
            take = {0: [0, 1, 2], 1: [0, 1, 2]}  # a pull names its blocks for every group alike
        transfer_checked(ex, bench, offer, take, "V1.7")


@checks("V4.4")
def test_V4_the_rows_of_a_publish_may_repeat(kvwire_harness: Harness) -> None:
    """V4.4: a publish only reads its rows, so two rows may locate the same memory; it is
    accepted and delivers."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3)], 347, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "a publish's repeated rows")
        g = bench.source_view().groups[0]
        assert g.names is not None
        names = np.vstack([g.names, random_names_like(g.names, 1)])
        twice = LayerGroupRows(g.group_id, g.kind, g.region, np.append(g.slots, g.slots[0]), g.tokens, names)
        try:
            out = ex.settle(ex.publish(View((twice,))))
        except SubmissionError as exc:
            raise AssertionError(f"V4.4: a publish whose rows repeat one slot was refused: {exc}") from exc
        assert out.is_delivered and out.masks[0].all(), f"V4.4: {out!r}"
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(fetched)
        assert fetched.masks[0].all(), f"S1: {fetched!r}"


def random_names_like(names: np.ndarray, count: int) -> np.ndarray:
    rng = np.random.default_rng(int(names.sum()) + count)
    while True:
        extra = rng.integers(0, 256, size=(count, names.shape[1]), dtype=np.uint8)
        if not any((names == row).all(axis=1).any() for row in extra):
            return extra


# -- STATE rows through a serving peer ------------------------------------------------------------------

@checks("V1.4", "N2.3", also=("A5.7",))
@pytest.mark.parametrize("groups", ["state alone", "paged and state"])
def test_V1_a_pull_moves_a_state_row_with_the_block_it_stands_for(kvwire_harness: Harness, groups: str) -> None:
    """V1.4 / N2.3 for peers: a one-block pull whose view has a STATE group (one row, named like
    the block) moves that row, alone or beside the block's PAGED rows; a peer that does not hold it
    answers a miss."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    specs = [(256, 1)] if groups == "state alone" else [(64, 1), (48, 1), (256, 1)]
    plan = pages(specs, 479, True)
    last = len(plan.groups) - 1
    plan = ViewPlan(tuple(g if gi != last else GroupPlan(g.group_id, CacheKind.STATE, g.slot_bytes, 1,
                                                         g.source_slots, g.sink_slots, g.region_slots, g.name_width)
                          for gi, g in enumerate(plan.groups)), plan.seed, True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        result = ex.transfer(bench)  # A7 checks the bytes of every true bit
        assert result.fetched.is_delivered and all(m.all() for m in result.fetched.masks), (
            f"V1.4: the pull of one block with its STATE row did not move every row: {result.fetched!r}")
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        miss = ex.transfer(bench, offer={gi: [] for gi in range(len(plan.groups))})
        assert miss.fetched.is_delivered and miss.fetched.rows_delivered == 0, (
            f"A5.7: a STATE row the peer does not hold is a miss: {miss.fetched!r}")


# -- V1.8: a group-id limit holds at the limit and one past it ------------------------------------------------

#: A limit named in a refusal: ``2**32`` / ``2^32``, or a number of at least 256.
_POWER = re.compile(r"\b2\s*(?:\*\*|\^)\s*(\d{1,3})\b")


_NUMBER = re.compile(r"(?<![\w.*^])(\d{3,})(?![\w.])")


def _stated_limit(message: str, group_id: int) -> int | None:
    """The group-id limit a V1.8 refusal names (the largest number it states below the refused
    id, a power of two written ``2**N`` included), or ``None``."""
    found = [1 << int(n) for n in _POWER.findall(message)]
    found += [int(n) for n in _NUMBER.findall(_POWER.sub(" ", message)) if int(n) != group_id]
    below = [n for n in found if 256 <= n <= group_id]
    return max(below) if below else None


def _large_group_transfer(ex: Exchange, harness: Harness, kind: MemoryKind, group_id: int) -> InvalidSubmission | None:
    """Move three rows of group 0 and of ``group_id``: ``None`` when that delivered every row,
    the refusal when the submission raised ``InvalidSubmission`` (nothing escaped)."""
    plan = ViewPlan((GroupPlan(0, CacheKind.PAGED, 32, 3, (1, 2, 3), (3, 2, 1), 5),
                     GroupPlan(group_id, CacheKind.PAGED, 32, 3, (0, 2, 4), (4, 0, 2), 5)), 3919, shared_names=True)
    with Bench(harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        try:
            result = ex.transfer(bench)
        except InvalidSubmission as exc:
            bench.verify(f"S3.5: after a view with group id {group_id} was refused")
            return exc
        assert result.fetched.is_delivered and all(m.all() for m in result.fetched.masks), (
            f"V1.8: a view with group id {group_id} was taken, so its rows move like any others: {result.fetched!r}")
        return None


@checks("V1.8", "S3.2")
def test_V1_a_group_id_limit_holds_at_the_limit_and_one_past_it(kvwire_harness: Harness) -> None:
    """V1.8 / S3.2: a backend that refuses a large group id (2**62) names its limit in the
    refusal, and keeps it exactly: a view with the id just below the limit it names moves every
    row, and one just past it is refused with ``InvalidSubmission``. A limit kept tighter than the
    one stated (a wire of 32 bits that refuses ids from 2**31) refuses ids it promised to carry.
    A backend that takes 2**62 has no limit to check."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    huge = 1 << 62
    with needs.open_exchange(kvwire_harness) as ex:
        refusal = _large_group_transfer(ex, kvwire_harness, kind, huge)
        if refusal is None:
            return
        limit = _stated_limit(str(refusal), huge)
        assert limit is not None, (
            f"V1.8: a view with group id {huge} was refused without naming the limit it passed ({refusal}); the "
            "refusal names the id and its limit")
        below, past = limit - 1, limit + 1
        refused_below = _large_group_transfer(ex, kvwire_harness, kind, below)
        assert refused_below is None, (
            f"V1.8: the backend names {limit} as its group-id limit, yet refused group id {below} just below it "
            f"({refused_below}); it carries every id its limit admits")
        assert _large_group_transfer(ex, kvwire_harness, kind, past) is not None, (
            f"V1.8: the backend names {limit} as its group-id limit, yet took group id {past} just past it; a view "
            "with an id beyond it is refused when it is submitted")


# -- V4 through a second region ---------------------------------------------------------------------

@checks("V4.1", "V4.2")
def test_V4_rows_that_alias_through_a_second_region_are_refused(kvwire_harness: Harness) -> None:
    """V4.1 / V4.2: a fetch whose rows overlap through a second region describing the same
    registered memory (shifted by half a slot, the same span under another id, or a region of
    smaller slots whose row lies inside a larger row past its own size) is refused, whichever
    group comes first, and touches nothing."""
    caps = kvwire_harness.capabilities()
    needs.fetch(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4), (64, 4)], 277, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, None, ex.ends.sink, plan, kind) as bench:
        view = bench.sink_view()
        first = view.groups[0]
        r = first.region
        extra_names = np.full((1, 16), 0xEE, dtype=np.uint8)
        if (second_names := view.groups[1].names) is not None:
            extra_names = second_names[:1]
        quarter = max(1, r.slot_bytes // 4)
        for label, alias, slot in (
                ("shifted by half a slot", SlotRegion(r.region_id + 10_000, r.base + r.slot_bytes // 2, r.slot_bytes,
                                                      r.slot_count - 1, r.memory_kind, r.device), int(first.slots[0])),
                ("the same span under another id", SlotRegion(r.region_id + 20_000, r.base, r.slot_bytes, r.slot_count,
                                                             r.memory_kind, r.device), int(first.slots[-1])),
                # Slots of a quarter row from the middle of slot 0: slot 4*s is the third quarter
                # of row slot s, a small row lying inside a big one, past its own size from the
                # big row's start.
                ("of smaller slots, a row inside a larger row",
                 SlotRegion(r.region_id + 30_000, r.base + r.slot_bytes // 2, quarter,
                            (r.slot_count - 1) * r.slot_bytes // quarter, r.memory_kind, r.device),
                 int(first.slots[0]) * r.slot_bytes // quarter)):
            clash = LayerGroupRows(view.groups[1].group_id, CacheKind.PAGED, alias, np.array([slot]),
                                   TokenRange(0, 16), extra_names if first.names is not None else None)
            for order, bad in (("after", View((first, clash))), ("before", View((clash, first)))):
                assert bad.overlapping_rows() is not None
                refused(functools.partial(ex.fetch, bad),
                        f"V4.1/V4.2: a fetch whose rows overlap through a region {label} (its group {order} the other)")
        bench.verify("V4.2: after refused overlapping fetches")


# -- V1.6: a STATE row under another token range ---------------------------------------------------


#: (what, the fetch's token range per row count): a STATE row's checkpoint given otherwise than
#: when it was offered.
STATE_TOKENS = (
    ("a checkpoint five tokens further on", lambda rows: TokenRange(0, BLOCK_TOKENS * max(1, rows) + 5)),
    ("a range starting far from zero", lambda rows: TokenRange(1_000_003, 1_000_003 + BLOCK_TOKENS * rows)),
)


@checks("V1.6", "V1.4", "S1.3")
@pytest.mark.parametrize("case", range(len(STATE_TOKENS)), ids=[what for what, _ in STATE_TOKENS])
def test_V1_a_state_row_is_found_whatever_token_range_names_it(kvwire_harness: Harness, case: int) -> None:
    """V1.6 / V1.4 / S1.3: which bytes move depends only on the regions, the slots and the names;
    a STATE group's token end is for the holder. A STATE row (beside a PAGED group) offered under
    one token range and fetched under another, same group and name, arrives like any other row."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)
    paged_rows = 1 if shared else 3  # a pull's STATE row stands for its one block
    plan = ViewPlan((GroupPlan(0, CacheKind.PAGED, 48, paged_rows, tuple(range(1, 1 + paged_rows)),
                               tuple(reversed(range(1, 1 + paged_rows))), paged_rows + 2),
                     GroupPlan(1, CacheKind.STATE, 40, 1, (1,), (1,), 3)), 719 + case, shared)
    what, tokens = STATE_TOKENS[case]
    with needs.open_exchange(kvwire_harness) as ex, _Retokened(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                               plan, kind) as bench:
        bench.source_tokens = lambda rows: TokenRange(0, BLOCK_TOKENS * max(1, rows))
        bench.sink_tokens = tokens
        result = ex.transfer(bench)  # checks every true bit's bytes (A7) and all other memory (S2)
        fetched = result.fetched
        assert fetched.is_delivered and all(m.all() for m in fetched.masks), (
            f"V1.6: a PAGED and a STATE row offered under matching token ranges and fetched under {what} gave "
            f"{fetched!r}; every row is held, and which rows move never depends on the token range")


# -- V4.4: a publish whose groups share a slot -------------------------------------------------------


@checks("V4.4", "V4.1", also=("S1.3", "A7.1"))
def test_V4_a_publish_whose_groups_share_a_slot_is_taken(kvwire_harness: Harness) -> None:
    """V4.4 / V4.1: a publish only reads its rows, so rows of two groups may locate the same
    memory: a publish of a group and a second group (another id, other names) over one of its
    slots is taken and delivers, and a fetch finds both groups' rows with those bytes."""
    with paged_exchange(kvwire_harness, [(64, 3)], 727, needs.transfer, shared=False) as (caps, ex, bench):
        store_only(ex, "a publish's rows shared across groups")
        g = bench.source_view().groups[0]
        assert g.names is not None
        name = random_names_like(g.names, 1)
        extra_id = g.group_id + 1
        twin = LayerGroupRows(extra_id, CacheKind.PAGED, g.region, g.slots[[0]], TokenRange(0, BLOCK_TOKENS), name)
        try:
            published = ex.settle(ex.publish(View((g, twin))))
        except SubmissionError as exc:
            raise AssertionError(f"V4.4: a publish whose two groups share a slot was refused: {exc}") from exc
        assert published.is_delivered and all(m.all() for m in published.masks), (
            f"V4.4: a publish whose two groups share a slot must deliver with room to spare: {published!r}")
        sink = bench.sink_view().groups[0]
        spare = int(bench.plan.groups[0].region_slots) - 1  # a junk slot no row of the bench uses
        fetch_twin = LayerGroupRows(extra_id, CacheKind.PAGED, sink.region, np.array([spare]), TokenRange(0, BLOCK_TOKENS),
                                    name)
        fetched = ex.settle(ex.fetch(View((sink, fetch_twin))))
        assert fetched.is_delivered and all(m.all() for m in fetched.masks), (
            f"S1.3/V4.4: both groups' rows were marked held, so a fetch finds them: {fetched!r}")
        got = bench.sink.memories[0].read(np.array([spare]))
        assert np.array_equal(got[0], bench.data[0][0]), (
            f"A7.1/V4.4: group {extra_id}'s row, published from the slot of row 0 of group {g.group_id}, arrived with "
            "other bytes than that slot held")
        bench.sink.model[0][spare] = got[0]
        bench.apply_fetch(_first_group(fetched))


def _first_group(outcome: Outcome) -> Outcome:
    """``outcome`` with its first group's mask only: the group the bench knows."""
    return Outcome(outcome.status, outcome.masks[:1], outcome.reason, outcome.by_peer, outcome.cause)


@checks("V1.8", "V1.2")
@pytest.mark.parametrize("group_id", [(1 << 31) - 1, (1 << 32) - 1, 1 << 32, 1 << 62],
                         ids=["31_bits", "32_bits", "33_bits", "63_bits"])
def test_V1_a_large_group_id_moves_or_is_refused_when_submitted(kvwire_harness: Harness, group_id: int) -> None:
    """V1.8 / V1.2 / S3 / A8: a group id is any int >= 0. A backend that cannot carry one refuses the
    submission with ``InvalidSubmission`` (nothing escaped: the rows are untouched); one that
    takes it moves the rows as any others: a transfer of two groups, 0 and the large id, delivers
    every row of both, byte for byte. Accepting the view and then never concluding (a wire that
    carries fewer bits, failing on a thread the holder never hears from) is neither."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = ViewPlan((GroupPlan(0, CacheKind.PAGED, 32, 3, (1, 2, 3), (3, 2, 1), 5),
                     GroupPlan(group_id, CacheKind.PAGED, 32, 3, (0, 2, 4), (4, 0, 2), 5)), 659, shared_names=True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        what = f"V1.8: a view with group id {group_id}"
        try:
            result = ex.transfer(bench)  # checks the bytes of every true bit (A7)
        except InvalidSubmission as exc:
            check_refusal_message(exc, what)
            bench.verify(f"S3.5: after {what} was refused")
            return
        fetched = result.fetched
        assert fetched.is_delivered and all(m.all() for m in fetched.masks), (
            f"{what} was taken, so its rows move like any others: a transfer of every row gave {fetched!r}")


def _snapshot(view: View) -> list[tuple]:  # type: ignore[type-arg]
    return [(g.group_id, g.kind, g.region, g.slots.copy(), g.tokens,
             None if g.names is None else g.names.copy()) for g in view.groups]


def _unchanged(view: View, before: list[tuple]) -> None:  # type: ignore[type-arg]
    for g, (gid, kind, region, slots, tokens, names) in zip(view.groups, before, strict=True):
        assert (g.group_id, g.kind, g.region, g.tokens) == (gid, kind, region, tokens), (
            f"V2: group {gid} of the view changed after submission")
        assert not g.slots.flags.writeable and np.array_equal(g.slots, slots), (
            f"V2: the slots of group {gid} changed or became writable; a view is an immutable snapshot")
        if names is not None:
            assert g.names is not None and not g.names.flags.writeable and np.array_equal(g.names, names), (
                f"V2: the names of group {gid} changed or became writable")


# -- V1 ----------------------------------------------------------------------------------------

@checks("V1.6", "A5.4")
def test_V1_every_group_moves_in_view_order(kvwire_harness: Harness) -> None:
    """Views of several groups, PAGED and STATE, with names: every offered row arrives, and the
    outcome carries one mask per group, in the view's order."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    p = profiles.active()
    kinds = (CacheKind.PAGED,) if needs.shares_names(caps) else tuple(CacheKind)

    @profiles.examples()
    @given(plan=view_plans(max_groups=p.max_groups, max_rows=p.max_rows, kinds=kinds,
                           shared_names=needs.shares_names(caps)))
    def run(plan) -> None:  # type: ignore[no-untyped-def]
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                              kind) as bench:
            result = ex.transfer(bench)
            for g, mask in zip(plan.groups, result.fetched.masks, strict=True):
                assert mask.all(), (
                    f"V1/A5: group {g.group_id} ({g.kind.value}, {g.rows} rows) was offered whole, yet rows "
                    f"{np.flatnonzero(~mask).tolist()} did not arrive: {result.fetched!r}")
            assert result.fetched.is_delivered, f"A5: a transfer of held rows must deliver: {result.fetched!r}"

    run()


class _Retokened(Bench):
    """A bench whose views carry the token ranges ``tokens(rows)`` gives, per side, instead of
    ranges that match their row count."""

    source_tokens: Callable[[int], TokenRange]
    sink_tokens: Callable[[int], TokenRange]

    def source_view(self, select=None, *, names=True) -> View:  # type: ignore[no-untyped-def]
        return _retokened(super().source_view(select, names=names), self.source_tokens)

    def sink_view(self, select=None, *, names=True) -> View:  # type: ignore[no-untyped-def]
        return _retokened(super().sink_view(select, names=names), self.sink_tokens)


def _retokened(view: View, tokens: Callable[[int], TokenRange]) -> View:
    return View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, tokens(g.rows), g.names)
                      for g in view.groups))


#: Token ranges that say nothing of how many rows a group lends (V1.6: tokens are for the holder).
ODD_TOKENS: tuple[tuple[str, Callable[[int], TokenRange]], ...] = (
    ("one token", lambda rows: TokenRange(0, 1)),
    ("no tokens", lambda rows: TokenRange(5, 5)),
    ("a range starting far from zero", lambda rows: TokenRange(1_000_003, 1_000_003 + 16 * rows)),
    ("a very long range", lambda rows: TokenRange(0, 1 << 40)),
)


@checks("V1.6")
def test_V1_token_ranges_do_not_decide_which_rows_move(kvwire_harness: Harness) -> None:
    """V1.6: which bytes move depends only on the regions, the slots and the names, never on the
    token ranges: the same rows under ranges unrelated to their count (one token, none, a range
    far from zero, a very long one; another on each side) give the bits and bytes they give under
    ranges that match."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)
    plan = pages([(48, 6), (32, 6)], 41, shared)
    for i, (what, source_tokens) in enumerate(ODD_TOKENS):
        sink_what, sink_tokens = ODD_TOKENS[(i + 1) % len(ODD_TOKENS)]
        with needs.open_exchange(kvwire_harness) as ex, _Retokened(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                   plan, kind) as bench:
            bench.source_tokens, bench.sink_tokens = source_tokens, sink_tokens
            offer = (offer_for(ex, plan, lambda gi, n: [r for r in range(n) if (r + gi) % 3 != 2])
                     if ex.store or ex.serves_pulls else None)
            result = ex.transfer(bench, offer)  # checks every true bit's bytes (A7) and all other memory (S2)
            for gi, (mask, want) in enumerate(zip(result.fetched.masks, ex.expected(bench, offer, None), strict=True)):
                wrong = np.flatnonzero(mask != want)
                assert result.fetched.is_delivered and wrong.size == 0, (
                    f"V1.6: group {gi}: with {what} on the publish and {sink_what} on the fetch, row(s) "
                    f"{wrong.tolist()} have the wrong bit ({result.fetched!r}); which rows move depends on the "
                    "regions, slots and names, not on the token range")


# -- V2 ----------------------------------------------------------------------------------------

@checks("V2.2")
def test_V2_backend_leaves_the_view_as_it_was(kvwire_harness: Harness) -> None:
    """A view is an immutable snapshot: after a submission its groups, slots and names are what
    they were, still read-only; the outcome stays valid after the memory is given back."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=3, rows=5, seed=21, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex:
        bench = Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind)
        source_view, sink_view = bench.source_view(), bench.sink_view()
        before = (_snapshot(source_view), _snapshot(sink_view))
        if ex.store:
            published = ex.settle(ex.publish(source_view))
            _unchanged(source_view, before[0])
            fetched = ex.settle(ex.fetch(sink_view))
        else:
            fetched = ex.transfer(bench).fetched
        _unchanged(sink_view, before[1])
        bench.apply_fetch(fetched)
        masks = [m.copy() for m in fetched.masks]
        bench.close()
        del bench
        assert all(np.array_equal(a, b) for a, b in zip(masks, fetched.masks, strict=True)), (
            "V2/A6: the outcome's masks changed after the registrations were closed")
        if ex.store:
            assert all(m.all() for m in published.masks)


@checks("V2.2", "V2.3")
def test_V2_later_submissions_leave_earlier_views_as_they_were(kvwire_harness: Harness) -> None:
    """V2.2 / V2.3: a backend never changes a view it was given, also not while it works on later
    submissions: after four transfers, the view of every earlier publish and fetch (a serving
    peer's answers included) still has the groups, slots and names it had, read-only."""
    with paged_exchange(kvwire_harness, [(64, 12), (32, 12)], 601, needs.transfer) as (_, ex, bench):
        seen: list[tuple[View, list]] = []  # type: ignore[type-arg]
        for step in range(4):
            select = {gi: [3 * step, 3 * step + 1, 3 * step + 2] for gi in range(len(bench.plan.groups))}
            for view in ex.transfer(bench, select, select).views:
                seen.append((view, _snapshot(view)))
            for i, (view, before) in enumerate(seen):
                try:
                    _unchanged(view, before)
                except AssertionError as exc:
                    raise AssertionError(f"V2.2: view {i + 1} of {len(seen)} submitted changed while the backend "
                                         f"worked on later submissions: {exc}") from None


@checks("V2.2", "V4.3")
def test_V2_a_fetch_refused_for_overlapping_rows_leaves_its_view_as_it_was(kvwire_harness: Harness) -> None:
    """V2.2 / V4.3: a backend never changes a view, also not one it refuses: a fetch whose rows
    overlap (two rows of one group on one slot, or rows of two groups on one slot), its slots in
    no sorted order, is refused, and its groups, slots and names are what they were, read-only."""
    with paged_exchange(kvwire_harness, [(64, 4), (32, 4)], 659, needs.fetch) as (_, ex, bench):
        view = bench.sink_view()  # the sink's slots run backwards
        g0, g1 = view.groups
        within = LayerGroupRows(g0.group_id, g0.kind, g0.region, np.append(g0.slots, g0.slots[1]),
                                TokenRange(0, 16 * (g0.rows + 1)),
                                None if g0.names is None else np.vstack([g0.names, g0.names[[1]]]))
        across = LayerGroupRows(g1.group_id + 1, CacheKind.PAGED, g0.region, g0.slots[[2, 0]], TokenRange(0, 32),
                                None if g0.names is None else g0.names[[2, 0]])
        for what, bad in (("two rows of one group on one slot", View((within, g1))),
                          ("rows of two groups on one slot", View((g1, g0, across)))):
            before = _snapshot(bad)
            refused(lambda: ex.fetch(bad), f"V4.3: a fetch with {what}")  # noqa: B023
            try:
                _unchanged(bad, before)
            except AssertionError as exc:
                raise AssertionError(f"V2.2: a fetch refused for {what} changed its view: {exc}") from None
        bench.verify("V4.3: after fetches refused for overlapping rows")


# -- V3 ----------------------------------------------------------------------------------------

@checks("V3.1", "V3.2")
def test_V3_row_masks_stay_fresh_beside_an_outcome(kvwire_harness: Harness) -> None:
    """After a backend concluded, ``row_masks()`` still gives new, writable, all-false arrays,
    and writing them changes no outcome mask."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=4, seed=23, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        view = bench.sink_view()
        ex.offer(bench)
        sub = ex.fetch(view)
        ex.serve_one()
        fetched = ex.settle(sub)
        first, second = view.row_masks(), view.row_masks()
        for a, b, out in zip(first, second, fetched.masks, strict=True):
            assert a is not b and a is not out and not np.shares_memory(a, out), (
                "V3: row_masks() must return new arrays on every call, shared with no outcome")
            assert a.flags.writeable and a.dtype == np.bool_ and not a.any(), (
                "V3: row_masks() must return writable, all-false bool arrays")
            before = out.copy()
            a[:] = True
            assert np.array_equal(out, before), "V3/A6: writing a fresh row mask changed an outcome mask"


# -- V4 ----------------------------------------------------------------------------------------

@checks("V4.3")
def test_V4_overlapping_fetch_rows_refused(kvwire_harness: Harness) -> None:
    """A fetch with two rows on the same memory is refused and touches nothing."""
    caps = kvwire_harness.capabilities()
    needs.fetch(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    p = profiles.active()

    @profiles.examples()
    @given(plan=view_plans(max_groups=p.max_groups, max_rows=p.max_rows, min_rows=1,
                           kinds=(CacheKind.PAGED,), shared_names=needs.shares_names(caps)), data=st.data())
    def run(plan, data) -> None:  # type: ignore[no-untyped-def]
        gi = data.draw(st.integers(0, len(plan.groups) - 1), label="group")
        g = plan.groups[gi]
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, None, ex.ends.sink, plan, kind) as bench:
            view = bench.sink_view()
            group = view.groups[gi]
            across = data.draw(st.booleans(), label="overlap with another group") and len(plan.groups) > 1
            twin = data.draw(st.integers(0, g.rows - 1), label="row to repeat")
            if across:
                # A second group over the same region, repeating one slot of the first.
                extra_id = max(x.group_id for x in plan.groups) + 1
                names = None if group.names is None else group.names[[twin]]
                clash = LayerGroupRows(extra_id, CacheKind.PAGED, group.region, group.slots[[twin]],
                                       TokenRange(0, 16), names)
                bad = View((*view.groups, clash))
            else:
                slots = np.append(group.slots, group.slots[twin])
                names = None if group.names is None else np.vstack([group.names, group.names[[twin]]])
                doubled = LayerGroupRows(group.group_id, group.kind, group.region, slots,
                                         TokenRange(0, 16 * slots.size), names)
                bad = View(tuple(doubled if i == gi else x for i, x in enumerate(view.groups)))
            refused(lambda: ex.fetch(bad), "V4: a fetch whose rows overlap")
            bench.verify("after a refused overlapping fetch")

    run()


@checks("V4.5")
def test_V4_names_that_repeat_are_accepted(kvwire_harness: Harness) -> None:
    """V4.5: a store backend accepts names that repeat: a publish naming one block on two rows
    (equal bytes) delivers with both rows held, and a fetch naming one block on several rows, into
    distinct slots, delivers with every such row a true bit holding the block's bytes."""
    with paged_exchange(kvwire_harness, [(64, 4), (40, 4)], 1213, needs.transfer, needs.names, shared=False,
                        spare=3) as (_, ex, bench):
        store_only(ex, "names that repeat in a view")
        for gi in range(len(bench.plan.groups)):  # row 3 repeats row 0: same name, same bytes
            bench.names[gi][3] = bench.names[gi][0]
            bench.data[gi][3] = bench.data[gi][0]
            slot = bench.source.slots[gi][[3]]
            bench.source.memories[gi].write(slot, bench.data[gi][[0]])
            bench.source.model[gi][slot] = bench.data[gi][0]
        try:
            published = ex.settle(ex.publish(bench.source_view()))
        except InvalidSubmission as exc:
            raise AssertionError(f"V4.5: a publish naming one block on two rows was refused: {exc!r}") from exc
        assert published.is_delivered and all(m.all() for m in published.masks), (
            f"V4.5: a publish naming one block on two rows (equal bytes) must deliver with every row held: "
            f"{published!r}")
        asked = ([0, 1, 0, 3, 1], [2, 2, 0])  # per group: which published row each fetched row names
        used = [set(bench.sink.slots[gi].tolist()) for gi in range(2)]
        slots = [np.array([s for s in range(g.region_slots) if s not in used[gi]][: len(asked[gi])], dtype=np.int64)
                 for gi, g in enumerate(bench.plan.groups)]
        view = View(tuple(LayerGroupRows(g.group_id, CacheKind.PAGED, bench.sink.memories[gi].region, slots[gi],
                                         TokenRange(0, len(asked[gi]) * BLOCK_TOKENS), bench.names[gi][asked[gi]])
                          for gi, g in enumerate(bench.plan.groups)))
        try:
            out = ex.settle(ex.fetch(view))
        except InvalidSubmission as exc:
            raise AssertionError(f"V4.5: a fetch naming one block on several rows (distinct slots) was refused: "
                                 f"{exc!r}") from exc
        assert out.is_delivered and all(m.all() for m in out.masks), (
            f"V4.5: every name of this fetch is held (rows {list(asked)}, some named twice), so every row is a "
            f"true bit; got {out!r}")
        for gi, g in enumerate(bench.plan.groups):
            want = bench.data[gi][np.asarray(asked[gi])]
            got = bench.sink.memories[gi].read(slots[gi])
            wrong = np.flatnonzero((got != want).any(axis=1))
            assert wrong.size == 0, (
                f"V4.5: group {g.group_id}: fetched row(s) {wrong.tolist()} do not hold the bytes of the block "
                "they name")
            bench.sink.model[gi][slots[gi]] = want
        bench.verify("V4.5: after a fetch naming some blocks twice")
