"""Clause by clause, over the input space real engines use: rows from one byte to 4 MiB, views of
thousands of rows and many groups, names that differ in one byte or hold zero bytes, queues
filled to their bound, several instances and namespaces in one process, memory described by a
second region, refusals of every kind followed by normal work, deadlines of attempts that wait
behind others. Each test names the clause it checks (``docs/contract.md``) in its docstring's
first line; every check runs for stores and for serving peers unless the clause is a store's."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvwire.contract import (
    CacheKind,
    Cause,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    SlotRegion,
    SubmissionRejected,
    TokenRange,
    View,
)
from kvwire.contract.errors import SubmissionError
from kvwire.runtime.holding import Direction
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import FaultPlan, Harness, Hold, shut_down
from kvwire.testing.holder import Submission, Wakes, refused, settle, speaks_causes, wait_for
from kvwire.testing.layout import Bench, GroupPlan, ViewPlan

SENTINEL = 0xA5
MiB = 1 << 20


def _plan(specs: list[tuple[int, int]], seed: int, shared: bool, spare: int = 1) -> ViewPlan:
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


def _offer_for(ex: Exchange, plan: ViewPlan, pick) -> dict[int, list[int]]:  # type: ignore[no-untyped-def]
    """What the other end should hold: for a store ``pick(gi, rows)`` of each group; for a serving
    peer a prefix of the same length in every group (a pull serves a prefix)."""
    offer = {gi: list(pick(gi, g.rows)) for gi, g in enumerate(plan.groups)}
    if ex.serves_pulls:
        keep = min(len(v) for v in offer.values()) if offer else 0
        offer = {gi: list(range(keep)) for gi in offer}
    return offer


def _check_bits(ex: Exchange, bench: Bench, offer, take, fetched, clause: str) -> None:  # type: ignore[no-untyped-def]
    expected = ex.expected(bench, offer, take)
    for gi, mask, want in zip(bench.groups_in(take), fetched.masks, expected, strict=True):
        gid = bench.plan.groups[gi].group_id
        assert fetched.is_delivered, f"{clause}: a fetch of held and missing rows must deliver, got {fetched!r}"
        wrong = np.flatnonzero(mask != want)
        assert wrong.size == 0, (
            f"{clause}: group {gid}: row(s) {wrong[:10].tolist()} of {mask.size} have the wrong bit; the other end "
            f"holds rows {np.flatnonzero(want)[:10].tolist()}..., the outcome marks {np.flatnonzero(mask)[:10].tolist()}...")


def _transfer_checked(ex: Exchange, bench: Bench, offer, take, clause: str):  # type: ignore[no-untyped-def]
    result = ex.transfer(bench, offer, take)  # checks A7 on every true bit and S2 on all memory
    _check_bits(ex, bench, offer, take, result.fetched, clause)
    return result


def _needs_misses(ex: Exchange) -> None:
    if not (ex.store or ex.serves_pulls):
        pytest.skip("backend's other end is a peer without the serve-pulls protocol: a fetch cannot miss")


def _store_only(ex: Exchange, why: str) -> None:
    if not ex.store:
        pytest.skip(f"backend's other end is a peer; {why} is a store's clause")


def _with_field(hint: Hint, key: str, value: object) -> Hint:
    fields = dict(hint.fields)
    fields[key] = value  # type: ignore[assignment]
    return Hint.of(hint.kind, timeout_s=hint.timeout_s, **fields)  # type: ignore[arg-type]


# -- sizes and shapes ---------------------------------------------------------------------------

def test_A7_rows_from_one_byte_to_four_mebibytes(kvwire_harness: Harness) -> None:
    """A7.1 / M2: rows of any size, drawn on a log scale from 1 B to 4 MiB, arrive byte for byte."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)

    @profiles.examples(max_examples=max(3, profiles.active().examples // 2))
    @example(exponents=[0, 22], jitter=0, rows=2)
    @example(exponents=[13, 16, 18], jitter=0, rows=3)
    @given(exponents=st.lists(st.integers(0, 22), min_size=1, max_size=3),
           jitter=st.integers(-3, 3), rows=st.integers(1, 4))
    def run(exponents: list[int], jitter: int, rows: int) -> None:
        sizes = [min(4 * MiB, max(1, 2**e + (jitter if e > 2 else 0))) for e in exponents]
        specs = [(s, rows if s <= MiB else min(rows, 2)) for s in sizes]
        plan = _plan(specs, seed=sum(sizes) + rows, shared=shared)
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                              plan, kind) as bench:
            result = ex.transfer(bench)
            assert result.fetched.is_delivered and all(m.all() for m in result.fetched.masks), (
                f"A5/A7: rows of {sizes} bytes did not all arrive: {result.fetched!r}")

    run()


def test_A9_views_of_thousands_of_rows_and_many_groups(kvwire_harness: Harness) -> None:
    """A9.6: a view's size does not change what moves: 3 groups of 1500 rows, and 16 groups,
    each with held and missing rows in place."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)
    for specs, seed in (([(8, 1500), (24, 1500), (1, 1500)], 211), ([(16 + g, 24) for g in range(16)], 223)):
        plan = _plan(specs, seed, shared)
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                              plan, kind) as bench:
            if ex.store or ex.serves_pulls:
                offer = _offer_for(ex, plan, lambda gi, n: [r for r in range(n) if (r + gi) % 3 != 1]
                                   if ex.store else range(n * 3 // 4))
            else:
                offer = None
            _transfer_checked(ex, bench, offer, None, "A9.6")


def test_A9_misses_keep_their_place_whatever_the_order(kvwire_harness: Harness) -> None:
    """A9.2 / A9.3: the rows of a fetch in any order, whole or split over views: every bit stays with its
    row, held rows true and missing rows false."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)
    p = profiles.active()

    @profiles.examples()
    @given(groups=st.integers(1, p.max_groups), rows=st.integers(2, max(p.max_rows, 12)), data=st.data())
    def run(groups: int, rows: int, data: st.DataObject) -> None:
        plan = _plan([(data.draw(st.sampled_from([3, 64, 200])), rows) for _ in range(groups)],
                     data.draw(st.integers(0, 2**31)), shared)
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                              plan, kind) as bench:
            _needs_misses(ex)
            offer = _offer_for(ex, plan, lambda gi, n: data.draw(
                st.lists(st.integers(0, n - 1), unique=True, min_size=1, max_size=n - 1), label=f"held {gi}"))
            if ex.serves_pulls:
                # One pull, its blocks in a drawn order: the served prefix is the held names'
                # run from the start of that order.
                order = data.draw(st.permutations(range(rows)), label="order")
                take = {gi: list(order) for gi in range(groups)}
                _transfer_checked(ex, bench, offer, take, "A9.2")
                return
            ex.offer(bench, offer)
            parts = data.draw(st.integers(1, 3), label="parts")
            for part in range(parts):
                take = {gi: data.draw(st.permutations([r for r in range(g.rows) if r % parts == part]),
                                      label=f"part {part} of {gi}") for gi, g in enumerate(plan.groups)}
                fetched = ex.settle(ex.fetch(bench.sink_view(take)))
                bench.apply_fetch(fetched, take)
                _check_bits(ex, bench, offer, take, fetched, "A9.2")

    run()


# -- names ----------------------------------------------------------------------------------------

def _crafted_names(rows: int, width: int) -> np.ndarray:
    """Distinct names that a backend treating names as text, trimming zero bytes, or reading
    only part of them would confuse: all zeros, one byte apart at either end, trailing zeros."""
    names = np.zeros((rows, width), dtype=np.uint8)
    for i in range(1, rows):
        if i % 4 == 1:
            names[i, -1] = i  # differs from all-zeros in the last byte
        elif i % 4 == 2:
            names[i, 0] = i  # ... in the first byte, then zeros
        elif i % 4 == 3:
            names[i, width // 2] = i
        else:
            names[i, :] = names[i - 1]
            names[i, 1] = 0xFF
    assert len(np.unique(names, axis=0)) == rows
    return names


def test_N1_names_are_opaque_bytes_every_byte_counts(kvwire_harness: Harness) -> None:
    """N1.3 / N1.4: names are opaque fixed-width bytes: zero bytes count, and names one byte apart name
    different blocks."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(32, 12), (48, 12)], 227, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        _needs_misses(ex)
        crafted = _crafted_names(12, 16)
        for gi in range(len(plan.groups)):
            bench.names[gi] = crafted
        offer = _offer_for(ex, plan, lambda gi, n: [0, 2, 3, 5, 8, 11] if ex.store else range(7))
        _transfer_checked(ex, bench, offer, None, "N1.4")


def test_N1_a_store_keys_rows_by_group_and_name(kvwire_harness: Harness) -> None:
    """N1.2: the same name in two groups stands for two rows with different bytes; each group's
    row is found only in that group."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.names(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 6), (64, 6), (32, 6)], 229, shared=True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        _store_only(ex, "keying stored rows")
        offer = {0: [0, 1, 2], 1: [3, 4, 5], 2: [1, 4]}
        _transfer_checked(ex, bench, offer, None, "N1.2")


# -- publish masks ---------------------------------------------------------------------------------

def test_A5_a_publish_counts_rows_the_store_already_holds(kvwire_harness: Harness) -> None:
    """A5.6 / A5.11: a publish's mask marks the rows the other end holds once it concluded, those it held
    before included."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 5), (128, 5)], 233, shared=False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        _store_only(ex, "a publish's mask of held rows")
        first = ex.settle(ex.publish(bench.source_view({0: [0, 1], 1: [4]})))
        assert first.is_delivered and all(m.all() for m in first.masks), f"S1: {first!r}"
        again = ex.settle(ex.publish(bench.source_view()))
        assert again.is_delivered, f"A5.4: publishing rows the store holds and rows it lacks failed: {again!r}"
        for g, mask in zip(plan.groups, again.masks, strict=True):
            assert mask.all(), (
                f"A5.4: group {g.group_id}: the store holds every row after the second publish, but its mask marks "
                f"only {np.flatnonzero(mask).tolist()}; rows held before count as held")
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(fetched)
        assert all(m.all() for m in fetched.masks), f"S1: {fetched!r}"


def test_A5_publish_masks_say_exactly_what_the_store_holds(kvwire_harness: Harness) -> None:
    """A5.6 / A5.9 / S1.3: with faults on some names, a row the publish marks true is found by a fetch,
    and a row that faulted is marked false and not found."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 6), (40, 6)], 239, shared=False)
    probe = Bench(kvwire_harness, None, None, plan, kind)
    faulty = {probe.names[0][3].tobytes(), probe.names[1][1].tobytes()}
    try:
        with needs.open_exchange(kvwire_harness, faults=FaultPlan(publish=frozenset(faulty))) as ex, Bench(
                kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            _store_only(ex, "a publish's mask of held rows")
            published = ex.settle(ex.publish(bench.source_view()))
            assert published.is_failed, f"A5.3: a publish that met faults at the store must fail: {published!r}"
            fetched = ex.settle(ex.fetch(bench.sink_view()))
            bench.apply_fetch(fetched)
            for gi, (put, got) in enumerate(zip(published.masks, fetched.masks, strict=True)):
                lost = np.flatnonzero(put & ~got)
                assert lost.size == 0, (
                    f"A5.4: group {gi}: row(s) {lost.tolist()} marked held by the publish were not found by a fetch")
                for row in range(plan.groups[gi].rows):
                    if bench.names[gi][row].tobytes() in faulty:
                        assert not put[row] and not got[row], (
                            f"A5.4: group {gi} row {row} faulted at the store, yet is marked held or was found")
    finally:
        probe.close()


# -- deadlines ------------------------------------------------------------------------------------

def test_A8_the_deadline_counts_from_submission_also_behind_others(kvwire_harness: Harness) -> None:
    """A8.1: with the other end not answering, every attempt of a full queue concludes failed by
    its own deadline, counted from its submission, not from when the backend got to it."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    deadline_s, slack_s = 0.6, 0.8
    with needs.open_exchange(kvwire_harness, hold=True, timeout_s=deadline_s, max_in_flight=6) as ex:
        count = min(ex.caps.max_in_flight, 6)
        if count < 2:
            pytest.skip("backend declares a queue bound of 1: nothing waits behind another attempt")
        plan = _plan([(64, count)], 241, needs.shares_names(caps))
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            hold: Hold | None = None
            if ex.store:
                if ex.ends.hold is None:
                    pytest.skip("harness cannot hold the backend's other end")
                ex.offer(bench)
                hold = ex.ends.hold()
            elif ex.serves_pulls:
                ex.offer(bench)
                ex.holder()  # serving, but the suite answers none of the pulls
            else:
                pytest.skip("backend's other end is a peer without the serve-pulls protocol; the suite cannot hold it")
            try:
                subs: list[tuple[float, Submission]] = []
                for row in range(count):
                    subs.append((time.monotonic(), ex.fetch(bench.sink_view({0: [row]}))))
                for started, sub in subs:
                    out = settle(sub, deadline_s + slack_s + profiles.active().patience_s, quiesce=False)
                    took = time.monotonic() - started
                    assert out.is_failed, f"A8.2: an attempt the other end never answered must fail, got {out!r}"
                    if speaks_causes(sub.backend):
                        assert out.cause is Cause.DEADLINE, f"A10: a deadline failure's cause is DEADLINE: {out!r}"
                    assert took <= deadline_s + slack_s, (
                        f"A8.1: attempt {subs.index((started, sub)) + 1} of {count} had a deadline of {deadline_s:g} s "
                        f"from its submission, and concluded {took:.2f} s after it; the deadline counts from "
                        "submission, also for attempts queued behind others")
            finally:
                if hold is not None:
                    hold.release()
            for _, sub in subs:
                settle(sub, kvwire_harness.quiesce_grace_s + slack_s + profiles.active().patience_s)
            if hold is not None:
                assert hold.wait_idle(profiles.active().patience_s)
            bench.forget_sink()
            bench.verify("after attempts that failed by their deadlines")


# -- instances -----------------------------------------------------------------------------------

def test_B1_pairs_of_instances_share_no_store_queue_or_shutdown(kvwire_harness: Harness) -> None:
    """B1.3-B1.5: two pairs of instances in one process: what one pair's other end holds the other's
    does not; one's full queue does not refuse the other's submissions; one's shutdown leaves the
    other working."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)
    plan = _plan([(64, 4), (32, 4)], 251, shared)
    with needs.open_exchange(kvwire_harness, max_in_flight=3, hold=True) as first, \
            needs.open_exchange(kvwire_harness, max_in_flight=3) as second:
        one = Bench(kvwire_harness, first.ends.source, first.ends.sink, plan, kind)
        two = Bench(kvwire_harness, second.ends.source, second.ends.sink, plan, kind)  # same names, same bytes
        try:
            if first.store:
                first.offer(one)
                fetched = second.settle(second.fetch(two.sink_view()))
                two.apply_fetch(fetched)
                assert fetched.rows_delivered == 0, (
                    f"B1.1: rows published through one pair of instances were found through another pair, whose "
                    f"harness gave it a store of its own: {fetched!r}")
            # Fill the first pair's queue with held attempts, then work on the second.
            bound = first.caps.max_in_flight
            held: list[Submission] = []
            hold: Hold | None = None
            if bound <= 64 and (first.store and first.ends.hold is not None or first.serves_pulls):
                if first.store:
                    hold = first.ends.hold()  # type: ignore[misc]
                else:
                    first.offer(one)
                    first.holder()
                filler = _plan([(8, bound)], 257, shared)
                with Bench(kvwire_harness, first.ends.source, first.ends.sink, filler, kind) as fill:
                    requests = []
                    try:
                        for row in range(bound):
                            held.append(first.fetch(fill.sink_view({0: [row]})))
                        if first.serves_pulls:
                            requests = first.holder().take(bound)  # held: none answered yet
                        try:
                            result = second.transfer(two)
                        except SubmissionRejected as exc:
                            raise AssertionError(f"B1.2: one instance's full queue refused another's work: {exc}") from exc
                        _check_bits(second, two, None, None, result.fetched, "B1.5")
                    finally:
                        if hold is not None:
                            hold.release()
                        for request in requests:
                            first.holder().decline(request, "the suite declines the filler pulls")
                        for sub in held:
                            first.settle(sub)
                        fill.forget_sink()
            for backend in first.ends.backends:
                shut_down(backend, timeout_s=max(10.0, kvwire_harness.quiesce_grace_s))
            two.forget_sink()
            try:
                result = second.transfer(two)
            except SubmissionRejected as exc:
                raise AssertionError(f"B1.3: shutting down one pair of instances stopped another: {exc}") from exc
            _check_bits(second, two, None, None, result.fetched, "B1.3")
        finally:
            one.close()
            two.close()


# -- refusals leave no trace ----------------------------------------------------------------------

def _stray_group(harness: Harness, kind: MemoryKind, template: LayerGroupRows, gid: int) -> tuple[LayerGroupRows, Bench]:
    """A group in memory no backend registered, shaped like ``template``."""
    plan = _plan([(template.region.slot_bytes, template.rows)], 263, False)
    stray = Bench(harness, None, None, plan, kind)
    view = stray.sink_view()
    g = view.groups[0]
    names = template.names
    return LayerGroupRows(gid, CacheKind.PAGED, g.region, g.slots, g.tokens, names), stray


def test_S3_a_refused_view_leaves_no_trace_of_its_valid_groups(kvwire_harness: Harness) -> None:
    """S3.4-S3.6: a view refused for its last group (rows nobody registered, or no names where names
    are required) told the other end nothing about its first groups: nothing stored, nothing
    written, no pull sent."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 3), (32, 3)], 269, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        strays: list[Bench] = []
        try:
            def spoiled(view: View) -> list[tuple[str, View]]:
                stray, extra = _stray_group(kvwire_harness, kind, view.groups[0], 99)
                strays.append(extra)
                out = [("rows nobody registered", View((*view.groups, stray)))]
                if caps.content_addressed:
                    last = view.groups[-1]
                    bare = LayerGroupRows(last.group_id, last.kind, last.region, last.slots, last.tokens, None)
                    out.append(("a group without names", View((*view.groups[:-1], bare))))
                return out

            if ex.serves_pulls:
                ex.offer(bench)
            if caps.publish and (ex.store or not ex.serves_pulls):
                for what, view in spoiled(bench.source_view()):
                    refused(functools.partial(ex.publish, view), f"S3.4: a publish with {what} in its last group")
            if caps.fetch:
                for what, view in spoiled(bench.sink_view()):
                    refused(functools.partial(ex.fetch, view), f"S3.4: a fetch with {what} in its last group")
            bench.verify("S3.5: after refused submissions")
            if caps.fetch and (ex.store or ex.serves_pulls):
                sub = ex.fetch(bench.sink_view())
                if ex.serves_pulls:
                    holder = ex.holder()
                    (request,) = holder.take(1)
                    holder.finish(holder.answer(request))
                    assert not holder.serving.incoming(), "S3.4: a refused fetch's pull reached the serving end"
                    assert len(holder.answers) == 1, "S3.4: a refused fetch's pull reached the serving end"
                out = ex.settle(sub)
                bench.apply_fetch(out)
                if ex.store:
                    assert out.rows_delivered == 0, (
                        f"S3.4: a refused publish stored rows of its valid groups: a fetch found {out!r}")
        finally:
            for stray in strays:
                stray.close()


def test_S3_a_refused_submission_never_wakes(kvwire_harness: Harness) -> None:
    """S3.7: after ``InvalidSubmission`` or ``SubmissionRejected`` the backend never calls that
    submission's wake, however much work follows."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 3)], 271, needs.shares_names(caps))
    unusable = Hint.of("kvwire_conformance_unusable")
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        stray = Bench(kvwire_harness, None, None, plan, kind)
        wakes: list[tuple[str, Wakes]] = []
        cases = []
        if caps.publish:
            cases += [("publish", bench.source_view(), unusable), ("publish", stray.source_view(), ex.ends.publish_hint)]
        if caps.fetch:
            cases += [("fetch", bench.sink_view(), unusable), ("fetch", stray.sink_view(), ex.ends.fetch_hint)]
        for op, view, hint in cases:
            wake = Wakes()
            backend = ex.ends.source if op == "publish" else ex.ends.sink
            call = backend.publish if op == "publish" else backend.fetch
            try:
                call(view, hint, wake)
            except SubmissionError:
                wakes.append((op, wake))
            else:
                raise AssertionError(f"S3/H1/M4: a {op} the contract refuses was accepted")
        if caps.fetch and caps.publish:
            ex.transfer(bench)
        for backend in ex.ends.backends:
            assert not backend.shutdown(), "B3: nothing was in flight"
        for op, wake in wakes:
            assert wake.count == 0, f"S3.2: the wake of a refused {op} was called {wake.count} time(s)"
        stray.close()


# -- V4 through a second region ---------------------------------------------------------------------

def test_V4_rows_that_alias_through_a_second_region_are_refused(kvwire_harness: Harness) -> None:
    """V4.2: a fetch whose rows overlap through a second region describing the same registered
    memory (shifted by half a slot, or the same span under another id) is refused and touches
    nothing."""
    caps = kvwire_harness.capabilities()
    needs.fetch(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 4), (64, 4)], 277, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, None, ex.ends.sink, plan, kind) as bench:
        view = bench.sink_view()
        first = view.groups[0]
        r = first.region
        extra_names = np.full((1, 16), 0xEE, dtype=np.uint8)
        if view.groups[0].names is not None:
            extra_names = view.groups[1].names[:1]
        for label, alias, slot in (
                ("shifted by half a slot", SlotRegion(r.region_id + 10_000, r.base + r.slot_bytes // 2, r.slot_bytes,
                                                      r.slot_count - 1, r.memory_kind, r.device), int(first.slots[0])),
                ("the same span under another id", SlotRegion(r.region_id + 20_000, r.base, r.slot_bytes, r.slot_count,
                                                             r.memory_kind, r.device), int(first.slots[-1]))):
            clash = LayerGroupRows(view.groups[1].group_id, CacheKind.PAGED, alias, np.array([slot]),
                                   TokenRange(0, 16), extra_names if first.names is not None else None)
            bad = View((first, clash))
            assert bad.overlapping_rows() is not None
            refused(functools.partial(ex.fetch, bad), f"V4.2: a fetch whose rows overlap through a region {label}")
        bench.verify("V4.2: after refused overlapping fetches")


# -- A2 with large rows -------------------------------------------------------------------------------

def test_A2_large_rows_are_left_alone_once_quiesced(kvwire_harness: Harness) -> None:
    """A2.3 / A2.4: with rows of 1 MiB, once a publish says it quiesced the holder overwrites its
    rows and the other end still holds them as offered; once a fetch says it quiesced the holder
    overwrites its rows and nothing changes them afterwards."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(MiB, 6), (4096, 6)], 281, needs.shares_names(caps))
    after = _plan([(MiB, 6), (4096, 6)], 283, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, after, kind) as later:
        if ex.store:
            sub = ex.publish(bench.source_view())
            ex.settle(sub)
            bench.write_source(None, SENTINEL)  # as soon as it quiesced
        elif ex.serves_pulls:
            ex.offer(bench)
        fetch = ex.fetch(bench.sink_view())
        if ex.serves_pulls:
            holder = ex.holder()
            (request,) = holder.take(1)
            answer = holder.answer(request)
            holder.finish(answer)
            bench.write_source(None, SENTINEL)
        out = ex.settle(fetch)
        assert out.is_delivered and all(m.all() for m in out.masks), f"S1: {out!r}"
        bench.apply_fetch(out)  # A7: the bytes as offered, though the source was overwritten since
        bench.write_sink(None, SENTINEL)
        # More work of the same size through the same backends: a writer still running would land now.
        ex.transfer(later)
        bench.verify("A2: the fetch had quiesced, and the holder then reused its rows")


# -- W1 for serving peers ----------------------------------------------------------------------------

def test_W1_every_pull_request_is_followed_by_a_wake(kvwire_harness: Harness) -> None:
    """W1.4: pulls that arrive together are each announced: the serving holder, looking only after
    wakes, sees every one of them."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    count = 5
    plan = _plan([(64, count)], 293, True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        ex.offer(bench)
        count = min(count, ex.caps.max_in_flight)
        subs = [ex.fetch(bench.sink_view({0: [row]})) for row in range(count)]
        holder = ex.holder()
        requests = holder.take(count)
        for request in requests:
            holder.finish(holder.answer(request))
        bench.forget_sink()
        for row, sub in enumerate(subs):
            out = ex.settle(sub)
            bench.apply_fetch(out, {0: [row]})
            assert out.is_delivered and out.masks[0].all(), f"S1: {out!r}"


# -- H1 for stores -------------------------------------------------------------------------------------

def test_H1_a_store_keeps_namespaces_apart(kvwire_harness: Harness) -> None:
    """H1.10: a store hint's namespace is where rows are stored and found: a fetch under another
    namespace misses, one under the same namespace finds them."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 4), (16, 4)], 307, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        _store_only(ex, "a store namespace")
        tenant_a = _with_field(ex.ends.publish_hint, "namespace", "kvwire-suite/tenant-a")
        tenant_b = _with_field(ex.ends.fetch_hint, "namespace", "kvwire-suite/tenant-b")
        fetch_a = _with_field(ex.ends.fetch_hint, "namespace", "kvwire-suite/tenant-a")
        put = ex.settle(ex.publish(bench.source_view(), tenant_a))
        assert put.is_delivered and all(m.all() for m in put.masks), f"S1: {put!r}"
        for hint, label in ((tenant_b, "another namespace"), (ex.ends.fetch_hint, "the harness's own hint")):
            other = ex.settle(ex.fetch(bench.sink_view(), hint))
            bench.apply_fetch(other)
            assert other.is_delivered and other.rows_delivered == 0, (
                f"H1.3: rows published under namespace 'kvwire-suite/tenant-a' were found under {label}: {other!r}")
        same = ex.settle(ex.fetch(bench.sink_view(), fetch_a))
        bench.apply_fetch(same)
        assert all(m.all() for m in same.masks), f"H1.3: rows were not found under their own namespace: {same!r}"


def test_H1_a_store_refuses_hint_fields_it_does_not_understand(kvwire_harness: Harness) -> None:
    """H1.9: a store hint with a field the backend does not understand is refused, and nothing
    escaped."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 2)], 311, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        _store_only(ex, "a store hint's fields")
        if caps.publish:
            odd = _with_field(ex.ends.publish_hint, "kvwire_suite_unknown_field", 1)
            refused(functools.partial(ex.publish, bench.source_view(), odd), "H1.4: a publish with an unknown field")
        if caps.fetch:
            odd = _with_field(ex.ends.fetch_hint, "kvwire_suite_unknown_field", 1)
            refused(functools.partial(ex.fetch, bench.sink_view(), odd), "H1.4: a fetch with an unknown field")
            if caps.publish:
                out = ex.settle(ex.fetch(bench.sink_view()))
                bench.apply_fetch(out)
                assert out.rows_delivered == 0, f"S3: a refused publish reached the store: {out!r}"
        bench.verify("after refused submissions")



# -- registration and recognition ------------------------------------------------------------------

def test_M3_registration_after_shutdown_is_rejected_and_closing_still_works(kvwire_harness: Harness) -> None:
    """M3.10 / M3.11: after ``shutdown()`` a registration raises ``SubmissionRejected`` and
    registers nothing; closing an earlier registration is still allowed, twice."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 2)], 313, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        late = Bench(kvwire_harness, None, None, plan, kind)
        try:
            for backend in ex.ends.backends:
                shut_down(backend, timeout_s=max(10.0, kvwire_harness.quiesce_grace_s))
                refused(lambda: backend.register_regions([m.region for m in late.source.memories]),  # noqa: B023
                        "M3.10: a registration after shutdown()", SubmissionRejected)
            for registration in bench.registrations:
                call_briefly_close(registration)
                call_briefly_close(registration)
            bench.registrations.clear()
        finally:
            late.close()


def call_briefly_close(registration) -> None:  # type: ignore[no-untyped-def]
    from kvwire.testing.holder import call_briefly

    call_briefly(registration.close, "M3.11: closing a registration after shutdown()")


def _sub_span_view(view: View, offset_slots: int) -> View:
    """The same rows, each group described by another region inside the registered one: starting
    ``offset_slots`` slots later, with its slot indices shifted to match (M4.2)."""
    groups = []
    for g in view.groups:
        r = g.region
        lo = min(offset_slots, int(g.slots.min()) if g.rows else 0)
        inner = SlotRegion(r.region_id + 30_000, r.base + lo * r.slot_bytes, r.slot_bytes, r.slot_count - lo,
                           r.memory_kind, r.device)
        groups.append(LayerGroupRows(g.group_id, g.kind, inner, g.slots - lo, g.tokens, g.names))
    return View(tuple(groups))


def test_M4_a_view_over_part_of_a_registered_region_moves_its_rows(kvwire_harness: Harness) -> None:
    """M4.1 / M4.2: a row is recognized by where its bytes lie: a view whose regions are other
    descriptions of registered memory (a sub-span under another id) moves its rows like any other."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 4), (16, 4)], 317, needs.shares_names(caps), spare=2)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        try:
            if ex.store:
                out = ex.settle(ex.publish(_sub_span_view(bench.source_view(), 2)))
                assert out.is_delivered and all(m.all() for m in out.masks), f"M4.2: {out!r}"
            elif ex.serves_pulls:
                ex.offer(bench)
            sub = ex.fetch(_sub_span_view(bench.sink_view(), 1))
        except InvalidSubmission as exc:
            raise AssertionError(f"M4.2: rows inside a registered region were refused because the view describes "
                                 f"them with another SlotRegion: {exc}") from exc
        ex.serve_one()
        fetched = ex.settle(sub)
        bench.apply_fetch(fetched)
        assert fetched.is_delivered and all(m.all() for m in fetched.masks), f"M4.2: {fetched!r}"


def test_M4_rows_registered_only_with_another_instance_are_refused(kvwire_harness: Harness) -> None:
    """M4.6 / B1.2: memory registered with one instance is not registered with another."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 3)], 331, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as first, needs.open_exchange(kvwire_harness) as second, Bench(
            kvwire_harness, first.ends.source, first.ends.sink, plan, kind) as bench:
        if caps.publish:
            refused(lambda: second.publish(bench.source_view()),
                    "M4.6: a publish on an instance of rows registered only with another")
        if caps.fetch:
            refused(lambda: second.fetch(bench.sink_view()),
                    "M4.6: a fetch on an instance of rows registered only with another")
        bench.verify("M4.6: after refused submissions")


# -- empty views, repeated publish rows ------------------------------------------------------------

def test_V1_empty_views_and_groups_conclude_like_any_other(kvwire_harness: Harness) -> None:
    """V1.7: a view with no groups, and a group with zero rows beside others, are valid and
    conclude with masks of the right (zero) length."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 3), (32, 3)], 337, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        if ex.store or not ex.serves_pulls:
            out = ex.settle(ex.publish(View(())))
            assert out.is_delivered and out.masks == (), f"V1.7: an empty publish: {out!r}"
        if ex.store:
            out = ex.settle(ex.fetch(View(())))
            assert out.is_delivered and out.masks == (), f"V1.7: an empty fetch: {out!r}"
        # A group with zero rows beside one with rows.
        offer = {0: [0, 1, 2], 1: [0, 1, 2]}
        take = {0: [0, 1, 2], 1: []}
        if not (ex.store or ex.serves_pulls):
            pytest.skip("backend's other end is a peer without the serve-pulls protocol")
        if ex.serves_pulls:
            take = {0: [0, 1, 2], 1: [0, 1, 2]}  # a pull names its blocks for every group alike
        _transfer_checked(ex, bench, offer, take, "V1.7")


def test_V4_the_rows_of_a_publish_may_repeat(kvwire_harness: Harness) -> None:
    """V4.4: a publish only reads its rows, so two rows may locate the same memory; it is
    accepted and delivers."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 3)], 347, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        _store_only(ex, "a publish's repeated rows")
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


# -- queue slots ------------------------------------------------------------------------------------

def test_S3_a_slot_frees_without_polling(kvwire_harness: Harness) -> None:
    """S3.11: once the attempts of a full queue concluded and quiesced, new submissions are taken,
    though the holder never called ``poll()`` on them."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=3) as ex:
        bound = ex.caps.max_in_flight
        if bound > 64:
            pytest.skip(f"backend declares a queue bound of {bound}, too large to fill here")
        if not (ex.store or ex.serves_pulls):
            pytest.skip("backend's other end is a peer without the serve-pulls protocol")
        plan = _plan([(32, bound)], 349, needs.shares_names(caps))
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            ex.offer(bench)
            subs = [ex.fetch(bench.sink_view({0: [row]})) for row in range(bound)]
            if ex.serves_pulls:
                holder = ex.holder()
                for request in holder.take(bound):
                    holder.finish(holder.answer(request))
            patience = profiles.active().patience_s
            # Wait for a wake from each and for quiescence only: never poll().
            for sub in subs:
                wait_for(lambda: sub.wakes.count > 0 and sub.quiesced(), patience,  # noqa: B023
                         "A3/W1: a fetch waking and quiescing")
            try:
                again = ex.fetch(bench.sink_view({0: [0]}))
            except SubmissionRejected as exc:
                raise AssertionError(f"S3.11: every attempt of the full queue had concluded and quiesced, yet a new "
                                     f"fetch was rejected because poll() was never called: {exc}") from exc
            ex.serve_one()
            bench.forget_sink()
            for sub in subs:
                ex.settle(sub)
            bench.apply_fetch(ex.settle(again), {0: [0]})


# -- A1.5, A9.4, A9.5 --------------------------------------------------------------------------------

def test_A1_an_outcome_outlives_shutdown_and_closed_registrations(kvwire_harness: Harness) -> None:
    """A1.5: the outcome an attempt answered stays the same after later work, ``shutdown()`` and
    closing the registrations."""
    from kvwire.testing.holder import same_outcome

    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 3), (8, 3)], 353, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex:
        bench = Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind)
        if ex.store or ex.serves_pulls:
            ex.offer(bench, _offer_for(ex, plan, lambda gi, n: range(2)))
        elif caps.publish:
            pytest.skip("backend's other end is a peer without the serve-pulls protocol")
        sub = ex.fetch(bench.sink_view())
        ex.serve_one()
        out = ex.settle(sub)
        bench.apply_fetch(out)
        for backend in ex.ends.backends:
            shut_down(backend, timeout_s=max(10.0, kvwire_harness.quiesce_grace_s))
        same_outcome(out, sub.poll(), "fetch")  # type: ignore[arg-type]
        bench.close()
        same_outcome(out, sub.poll(), "fetch")  # type: ignore[arg-type]
        assert sub.quiesced(), "A2.2: quiesced() turned false after shutdown and closed registrations"


def test_A9_the_order_of_groups_does_not_change_the_bits(kvwire_harness: Harness) -> None:
    """A9.4: the same groups in another order in the view: each group's bits are the same."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 5), (16, 5), (3, 5)], 359, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        _needs_misses(ex)
        offer = _offer_for(ex, plan, lambda gi, n: [r for r in range(n) if (r * (gi + 1)) % 3 != 2])
        ex.offer(bench, offer)
        expected = ex.expected(bench, offer, None)
        view = bench.sink_view()
        order = [2, 0, 1]
        sub = ex.fetch(View(tuple(view.groups[i] for i in order)))
        ex.serve_one()
        out = ex.settle(sub)
        for pos, gi in enumerate(order):
            assert np.array_equal(out.masks[pos], expected[gi]), (
                f"A9.4: with the view's groups in the order {order}, group {plan.groups[gi].group_id}'s bits are "
                f"{np.flatnonzero(out.masks[pos]).tolist()}, expected {np.flatnonzero(expected[gi]).tolist()}; masks "
                "follow the view's group order")
        reordered = tuple(out.masks[order.index(gi)] for gi in range(len(order)))
        from kvwire.contract import Outcome

        bench.apply_fetch(Outcome(out.status, reordered, out.reason, out.by_peer, out.cause))


def test_A9_many_attempts_in_flight_each_get_their_own_rows(kvwire_harness: Harness) -> None:
    """A9.5: up to the queue bound of fetches in flight at once, each of other rows: each outcome
    is exactly its own rows' bits, whatever the others do."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=8) as ex:
        _needs_misses(ex)
        count = min(ex.caps.max_in_flight, 8)
        rows_each = 3
        plan = _plan([(96, count * rows_each), (8, count * rows_each)], 367, needs.shares_names(caps))
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            n = count * rows_each
            offer = _offer_for(ex, plan, lambda gi, m: [r for r in range(m) if r % rows_each != 2])
            if ex.serves_pulls:
                offer = {gi: [r for r in range(n) if r % rows_each != 2] for gi in range(2)}
                ex.offer(bench, offer)
            else:
                ex.offer(bench, offer)
            takes = [{gi: list(range(k * rows_each, (k + 1) * rows_each)) for gi in range(2)} for k in range(count)]
            subs = [ex.fetch(bench.sink_view(take)) for take in takes]
            if ex.serves_pulls:
                holder = ex.holder()
                for request in holder.take(count):
                    holder.finish(holder.answer(request))
            outs = [ex.settle(sub) for sub in subs]  # all of them, before any memory is checked
            bench.forget_sink({gi: list(range(n)) for gi in range(2)})  # every fetched row is checked below
            for take, out in zip(takes, outs, strict=True):
                bench.apply_fetch(out, take)
                _check_bits(ex, bench, offer, take, out, "A9.5")


# -- W1.7 ----------------------------------------------------------------------------------------------

def test_W1_a_wake_that_raises_does_not_stop_the_backend(kvwire_harness: Harness) -> None:
    """W1.7: a wake that raises is survived: the attempt still concludes and quiesces, and the
    backend goes on working."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([(64, 3)], 373, needs.shares_names(caps))

    class Raising(Wakes):
        def __call__(self) -> None:
            super().__call__()
            raise RuntimeError("kvwire suite: this wake raises on purpose")

    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        if not (ex.store or ex.serves_pulls):
            pytest.skip("backend's other end is a peer without the serve-pulls protocol")
        ex.offer(bench)
        wake = Raising()
        attempt = ex.ends.sink.fetch(bench.sink_view(), ex.ends.fetch_hint, wake)
        sub = Submission(Direction.FETCH, ex.ends.sink, bench.sink_view(), attempt, wake)
        ex.serve_one()
        out = ex.settle(sub)
        bench.apply_fetch(out)
        assert out.is_delivered and out.masks[0].all(), f"W1.7: {out!r}"
        bench.forget_sink()
        again = ex.fetch_settled(bench.sink_view())
        bench.apply_fetch(again)
        assert again.is_delivered, f"W1.7: after a raising wake the backend must go on working: {again!r}"
