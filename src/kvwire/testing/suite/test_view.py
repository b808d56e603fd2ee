"""V1-V4 and H1: what a backend does with the views and hints it is given."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import CacheKind, Hint, LayerGroupRows, TokenRange, View
from kvwire.testing import needs, profiles
from kvwire.testing.harness import Harness
from kvwire.testing.holder import refused
from kvwire.testing.layout import Bench, simple_plan
from kvwire.testing.plans import offer_for, paged_exchange, pages
from kvwire.testing.strategies import hints, view_plans

#: A hint kind no backend uses.
UNUSABLE_KIND = "kvwire_conformance_unusable"


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


# -- H1 ----------------------------------------------------------------------------------------

def test_H1_unusable_hint_refused(kvwire_harness: Harness) -> None:
    """A hint of a kind the backend does not use is refused in either direction, and nothing
    escaped."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)

    @profiles.examples(max_examples=max(3, profiles.active().examples // 2))
    @given(hint=hints(kind=UNUSABLE_KIND))
    def run(hint: Hint) -> None:
        plan = simple_plan(groups=2, rows=3, seed=31, shared_names=needs.shares_names(caps))
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                              kind) as bench:
            if caps.publish:
                refused(lambda: ex.publish(bench.source_view(), hint), f"H1: a publish with the hint {hint!r}")
            if caps.fetch:
                refused(lambda: ex.fetch(bench.sink_view(), hint), f"H1: a fetch with the hint {hint!r}")
            bench.verify("after refused submissions")
            if caps.fetch and caps.publish and ex.store:
                fetched = ex.settle(ex.fetch(bench.sink_view()))
                bench.apply_fetch(fetched)
                assert fetched.rows_delivered == 0, "S3/H1: a publish refused for its hint reached the store"

    run()


def test_H1_a_hint_decoded_from_bytes_works_alike(kvwire_harness: Harness) -> None:
    """The hint's byte encoding is the hint: one decoded from ``to_bytes()`` moves rows alike."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=37, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        ex.ends.publish_hint = Hint.from_bytes(ex.ends.publish_hint.to_bytes())
        ex.ends.fetch_hint = Hint.from_bytes(ex.ends.fetch_hint.to_bytes())
        result = ex.transfer(bench)
        assert all(m.all() for m in result.fetched.masks), f"H1: decoded hints moved fewer rows: {result.fetched!r}"
