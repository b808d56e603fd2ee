"""Clauses the seventh probing round found open: each test closes a gap a mutant of
``tests/conformance/mutants_round7.py`` showed (docs/conformance.md says which): memory kinds
named by a view (M1.4, M4.1), rows seen through a sub-span after their registration closed
(M4.5), a STATE row under another token range (V1.6), a publish whose groups share a slot
(V4.4), queues of instances on one store (B1.5), and peer hints without an address or with
credentials that are no bytes (H1.5, H1.11, H1.12)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kvwire.contract import (
    CacheKind,
    Hint,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    SlotRegion,
    TokenRange,
    View,
)
from kvwire.contract.errors import SubmissionError
from kvwire.testing import needs
from kvwire.testing.harness import Harness
from kvwire.testing.holder import Submission, refused
from kvwire.testing.layout import BLOCK_TOKENS, GroupPlan, ViewPlan
from kvwire.testing.plans import fill_queue, fillable_queue, paged_exchange, store_only, with_field
from kvwire.testing.suite.test_clauses import _sub_span_view, random_names_like
from kvwire.testing.suite.test_view import _Retokened

# -- M1.4 / M4.1: a view that names another memory kind over registered memory ----------------------


def _relabelled(view: View, kind: MemoryKind, device: int | None) -> View:
    """``view`` with every group's region described as memory of ``kind`` (on ``device``), at the
    same addresses."""
    groups = []
    for g in view.groups:
        r = g.region
        region = SlotRegion(r.region_id + 40_000, r.base, r.slot_bytes, r.slot_count, kind, device)
        groups.append(LayerGroupRows(g.group_id, g.kind, region, g.slots, g.tokens, g.names))
    return View(tuple(groups))


def _other_labels(kind: MemoryKind, device: int | None) -> list[tuple[str, MemoryKind, int | None]]:
    """Descriptions of memory of ``kind`` (on ``device``) as other memory (M1.2): the other kind,
    and for DEVICE memory another device."""
    labels: list[tuple[str, MemoryKind, int | None]] = []
    if kind is MemoryKind.HOST:
        labels.append(("DEVICE memory of device 0", MemoryKind.DEVICE, 0))
    else:
        labels.append(("HOST memory", MemoryKind.HOST, None))
        labels.append((f"DEVICE memory of device {(device or 0) + 1}", MemoryKind.DEVICE, (device or 0) + 1))
    return labels


def test_M1_a_view_naming_another_memory_kind_over_registered_memory_is_refused(kvwire_harness: Harness) -> None:
    """M1.4 / M4.1 / M1.2: a row is recognized only inside a registered region of the same memory
    kind and device: a publish or fetch whose regions name another kind (DEVICE over registered
    HOST memory, or the reverse, or another device) at registered addresses raises
    ``InvalidSubmission``; memory is untouched, nothing reaches the other end, and the same rows
    described as what they are move afterwards."""
    with paged_exchange(kvwire_harness, [(64, 3), (32, 3)], 701, needs.transfer) as (caps, ex, bench):
        region = bench.sink.memories[0].region
        if ex.serves_pulls:
            ex.offer(bench)
        for what, kind, device in _other_labels(region.memory_kind, region.device):
            declared = "declared" if kind in caps.memory_kinds else "not declared"
            if ex.store:
                refused(functools.partial(ex.publish, _relabelled(bench.source_view(), kind, device)),
                        f"M1.4/M4.1: a publish whose view names {what} ({declared}) over registered "
                        f"{region.memory_kind.value} memory")
            refused(functools.partial(ex.fetch, _relabelled(bench.sink_view(), kind, device)),
                    f"M1.4/M4.1: a fetch whose view names {what} ({declared}) over registered "
                    f"{region.memory_kind.value} memory")
        bench.verify("S3.5: after submissions refused for the memory kind their view names")
        if ex.serves_pulls:
            assert not ex.holder().serving.incoming(), (
                "S3.4: a pull refused for the memory kind its view names reached the serving end")
        if ex.store:
            empty = ex.settle(ex.fetch(bench.sink_view()))
            bench.apply_fetch(empty)
            assert empty.is_delivered and not any(m.any() for m in empty.masks), (
                f"S3.4/M1.4: only refused publishes were made, yet a fetch of their rows found some: {empty!r}")
        result = ex.transfer(bench)
        assert result.fetched.is_delivered and all(m.all() for m in result.fetched.masks), (
            f"M1.3: the same rows described as the memory they are must move afterwards: {result.fetched!r}")


# -- M4.5: rows seen through a sub-span, once their registration closed --------------------------------


def test_M4_rows_seen_through_a_sub_span_are_refused_once_their_registration_closed(kvwire_harness: Harness) -> None:
    """M4.5 / M3.7: rows moved through a view of another ``SlotRegion`` inside a registered region
    (a sub-span, M4.2) are no longer recognized once that registration closed: a later publish or
    fetch of them, through the sub-span or the registered region, raises ``InvalidSubmission``
    and touches nothing."""
    with paged_exchange(kvwire_harness, [(64, 3), (32, 3)], 709, needs.transfer, spare=2) as (caps, ex, bench):
        source, sink = _sub_span_view(bench.source_view(), 2), _sub_span_view(bench.sink_view(), 1)
        if ex.store:
            published = ex.settle(ex.publish(source))
            assert published.is_delivered, f"M4.2: a publish through a sub-span: {published!r}"
            fetched = ex.settle(ex.fetch(sink))
        elif ex.serves_pulls:
            ex.offer(bench)
            fetched = ex.fetch_settled(sink)
        else:
            pub, sub = ex.publish(source), ex.fetch(sink)
            ex.settle(pub)
            fetched = ex.settle(sub)
        bench.apply_fetch(fetched)
        assert fetched.is_delivered and all(m.all() for m in fetched.masks), (
            f"M4.2: a fetch through a sub-span of registered memory: {fetched!r}")
        bench.close()
        for what, view in (("the sub-span", sink), ("the registered region", bench.sink_view())):
            refused(functools.partial(ex.fetch, view),
                    f"M4.5: a fetch through {what} after the registration it was moved through closed")
        if not ex.serves_pulls:
            for what, view in (("the sub-span", source), ("the registered region", bench.source_view())):
                refused(functools.partial(ex.publish, view),
                        f"M4.5: a publish through {what} after the registration it was moved through closed")
        else:
            assert not ex.holder().serving.incoming(), (
                "S3.4: a pull refused for rows of a closed registration reached the serving end")
        bench.verify("S3.5: after submissions refused for rows of closed registrations")


# -- V1.6: a STATE row under another token range ---------------------------------------------------


#: (what, the fetch's token range per row count): a STATE row's checkpoint given otherwise than
#: when it was offered.
STATE_TOKENS = (
    ("a checkpoint five tokens further on", lambda rows: TokenRange(0, BLOCK_TOKENS * max(1, rows) + 5)),
    ("a range starting far from zero", lambda rows: TokenRange(1_000_003, 1_000_003 + BLOCK_TOKENS * rows)),
)


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


# -- B1.5: queues per instance, also on one store ---------------------------------------------------


def test_B1_an_instance_takes_its_whole_bound_while_another_beside_it_is_full(kvwire_harness: Harness) -> None:
    """B1.5 / S3.10: queues are per instance, also of two instances on one store or two connected
    peers: with the other end held and ``max_in_flight`` attempts in flight on one instance, the
    other instance of the pair still takes its whole declared bound (a store's fetches, a serving
    peer's answers to those pulls); every attempt delivers once the other end lets go."""
    with fillable_queue(kvwire_harness, 48, 733) as (ex, bench, bound):
        rows = list(range(bound))
        if ex.store:
            assert ex.ends.hold is not None
            hold = ex.ends.hold()
            subs: list[Submission] = []
            try:
                subs += [ex.publish(bench.source_view({0: [row]})) for row in rows]
                for row in rows:
                    try:
                        subs.append(ex.fetch(bench.sink_view({0: [row]})))
                    except SubmissionError as exc:
                        raise AssertionError(
                            f"B1.5: fetch {row + 1} on the fetching instance was refused ({type(exc).__name__}: {exc}) "
                            f"with {row} in flight there, while the publishing instance on the same store had its "
                            f"bound of {bound} in flight; attempts on one instance never count towards another's "
                            "max_in_flight") from exc
            finally:
                hold.release()
            outs = [ex.settle(sub) for sub in subs]
            assert all(out.is_delivered and out.masks[0].all() for out in outs), (
                f"S3.10: attempts taken below each instance's bound must deliver once the store lets go: {outs!r}")
            bench.forget_sink({0: rows})  # every fetch wrote its row; each is checked below
            for row, out in zip(rows, outs[bound:], strict=True):
                bench.apply_fetch(out, {0: [row]})
        else:
            subs, _, requests = fill_queue(ex, bench, rows)
            holder = ex.holder()
            answers = []
            for i, request in enumerate(requests):
                try:
                    answers.append(holder.answer(request))
                except SubmissionError as exc:
                    raise AssertionError(
                        f"B1.5: answer {i + 1} on the serving instance was refused ({type(exc).__name__}: {exc}) while "
                        f"the requesting instance had its bound of {bound} pulls in flight; attempts on one instance "
                        "never count towards another's max_in_flight") from exc
            for answer in answers:
                holder.finish(answer)
            outs = [ex.settle(sub) for sub in subs]
            assert all(out.is_delivered and out.masks[0].all() for out in outs), (
                f"N2.10: every pull was answered with its whole block: {outs!r}")
            bench.forget_sink({0: rows})  # every pull wrote its row; each is checked below
            for row, out in zip(rows, outs, strict=True):
                bench.apply_fetch(out, {0: [row]})


# -- H1.5 / H1.11 / H1.12: peer hints without an address, or with credentials that are no bytes ---------


def test_H1_a_peer_hint_without_an_address_or_with_credentials_not_bytes_is_refused(kvwire_harness: Harness) -> None:
    """H1.5 / H1.11 / H1.15: a peer hint must name the serving end by its ``address``, and its
    ``credentials``, when given, are bytes: after a good pull, a pull whose hint has no address
    (none at all, or only credentials) or whose credentials are a str or an int raises
    ``InvalidSubmission`` (never a pull to the peer pulled from last, or credentials converted);
    no pull reaches the serving end, the rows are untouched, and a good pull afterwards delivers."""
    with paged_exchange(kvwire_harness, [(64, 2)], 739, needs.serve_pulls, needs.fetch, shared=True) as (_, ex, bench):
        ex.offer(bench)
        first = ex.fetch_settled(bench.sink_view())
        bench.apply_fetch(first)
        assert first.is_delivered and all(m.all() for m in first.masks), f"N2: a good pull must deliver: {first!r}"
        hint = ex.ends.fetch_hint
        bad = {
            "no address": Hint.of("peer", timeout_s=hint.timeout_s),
            "credentials but no address": Hint.of("peer", timeout_s=hint.timeout_s, credentials=b"kvwire-suite"),
            "credentials as a str": with_field(hint, "credentials", "kvwire-suite"),
            "credentials as an int": with_field(hint, "credentials", 7),
        }
        for what, value in bad.items():
            refused(functools.partial(ex.fetch, bench.sink_view(), value), f"H1.5/H1.11/H1.12: a pull whose hint has {what}")
        assert not ex.holder().serving.incoming(), "S3.4: a pull refused for its hint reached the serving end"
        bench.verify("S3.5: after pulls refused for their hint")
        again = ex.fetch_settled(bench.sink_view())
        bench.apply_fetch(again)
        assert again.is_delivered and all(m.all() for m in again.masks), (
            f"N2: a good pull after the refused ones must deliver: {again!r}")
