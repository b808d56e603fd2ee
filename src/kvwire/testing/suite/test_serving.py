"""N2: request-free pulls from a serving peer, with the suite as the serving holder (its reuse
tree is a dict from block name to row, with pin counts). Runs only for backends that declare
the ``serve-pulls`` protocol."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import CacheKind, Cause
from kvwire.testing import needs, profiles
from kvwire.testing.harness import Harness
from kvwire.testing.holder import call_briefly, settle, speaks_causes
from kvwire.testing.layout import Bench, ViewPlan, simple_plan
from kvwire.testing.strategies import view_plans


def _prefix(bench: Bench, count: int) -> dict[int, list[int]]:
    return {gi: list(range(min(count, g.rows))) for gi, g in enumerate(bench.plan.groups)}


def test_N2_the_held_prefix_is_served_pinned_and_unpinned(kvwire_harness: Harness) -> None:
    """The serving end asks its holder for exactly the fetched names; the holder pins the held
    prefix and publishes it; the fetch delivers that prefix (a partial prefix is no error), and
    the pins go back once the answer quiesced."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    p = profiles.active()

    @profiles.examples()
    @given(plan=view_plans(max_groups=p.max_groups, max_rows=p.max_rows, min_rows=1, shared_names=True),
           data=st.data())
    def run(plan: ViewPlan, data: st.DataObject) -> None:
        rows = plan.groups[0].rows
        held = data.draw(st.integers(0, rows), label="blocks held by the serving end")
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                              kind) as bench:
            holder = ex.holder()
            ex.offer(bench, _prefix(bench, held))
            view = bench.sink_view()
            sub = ex.fetch(view)
            (request,) = holder.take(1)
            assert request.groups == tuple(g.group_id for g in view.groups), (
                f"N2: the request names groups {request.groups}; the fetch asked for {[g.group_id for g in view.groups]}")
            assert request.slot_bytes == tuple(g.region.slot_bytes for g in view.groups), (
                "N2: the request's row sizes differ from the fetch's")
            assert view.groups[0].names is not None
            assert np.array_equal(request.names, view.groups[0].names), (
                "N2: the request must name exactly the blocks the fetch asks for, in prefix order")
            answer = holder.answer(request)
            assert holder.tree.pinned == held, f"N2: the holder pinned {holder.tree.pinned} blocks, {held} held"
            holder.finish(answer)
            assert holder.tree.pinned == 0, "N2: pins must all be returned once the answer quiesced"
            assert answer.publish is not None and answer.publish.outcome is not None
            assert answer.publish.outcome.is_delivered, f"N2: the answer must deliver: {answer.publish.outcome!r}"
            out = ex.settle(sub)
            assert out.is_delivered, f"N2: a partial prefix is a delivered attempt, not an error: {out!r}"
            for g, mask in zip(plan.groups, out.masks, strict=True):
                want = np.arange(g.rows) < held
                assert np.array_equal(mask, want), (
                    f"N2: group {g.group_id} marked {mask.astype(int).tolist()}; the served prefix is {held} blocks")
            bench.apply_fetch(out)

    run()


def test_N2_a_declined_pull_fails_the_fetch_with_the_reason(kvwire_harness: Harness) -> None:
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=171, shared_names=True)
    reason = "conformance: this holder declines"
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        holder = ex.holder()
        ex.offer(bench)
        sub = ex.fetch(bench.sink_view())
        (request,) = holder.take(1)
        call_briefly(lambda: holder.decline(request, reason), "N2: decline()")
        out = ex.settle(sub)
        assert out.is_failed and reason in (out.reason or ""), (
            f"N2: a declined pull fails the fetch with the holder's reason, got {out!r}")
        if speaks_causes(sub.backend):
            assert out.cause is Cause.DECLINED, f"A10: a declined pull's cause is DECLINED: {out!r}"
        assert holder.tree.pinned == 0
        bench.apply_fetch(out)


def test_N2_a_cancelled_pull_still_quiesces_and_unpins(kvwire_harness: Harness) -> None:
    """N2.13 / N2.9: the requester cancels before the serving holder answers: both attempts
    conclude and quiesce, the requester's as cancelled, the answer as CANCELLED with ``by_peer``
    true (cause PEER_CANCELLED), and every pin goes back."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.cancellation(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=4, seed=173, shared_names=True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        holder = ex.holder()
        ex.offer(bench)
        sub = ex.fetch(bench.sink_view())
        (request,) = holder.take(1)
        call_briefly(sub.attempt.cancel, "A4: cancel() of a pull")
        out = settle(sub, profiles.active().patience_s, quiesce=False, purpose="A4: a cancelled pull must conclude")
        assert out.is_cancelled, f"A4: a pull cancelled before it concluded is cancelled, got {out!r}"
        answer = holder.answer(request)
        holder.finish(answer)  # the answer to a cancelled pull still quiesces
        assert holder.tree.pinned == 0, "N2.9: pins must go back after a cancelled pull"
        assert answer.publish is not None
        answered = answer.publish.outcome
        assert answered is not None and answered.is_cancelled and answered.by_peer, (
            f"N2.13: the requester cancelled its pull before the answer concluded, so the answer concludes "
            f"CANCELLED with by_peer true; it concluded {answered!r}")
        if speaks_causes(answer.publish.backend):
            assert answered.cause is Cause.PEER_CANCELLED, (
                f"N2.13/A10.4: the answer to a pull its requester cancelled has cause PEER_CANCELLED: {answered!r}")
        ex.settle(sub)
        bench.forget_sink()
        bench.apply_fetch(out)


def test_N2_a_peer_that_is_not_serving_fails_the_fetch(kvwire_harness: Harness) -> None:
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=2, seed=179, shared_names=True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, None, ex.ends.sink, plan, kind) as bench:
        out = ex.settle(ex.fetch(bench.sink_view()))
        assert out.is_failed and out.reason, f"N2: pulling from a peer that does not serve must fail, got {out!r}"
        assert out.rows_delivered == 0
        bench.apply_fetch(out)


def test_N2_blocks_the_requester_holds_are_not_sent_again(kvwire_harness: Harness) -> None:
    """A requester that already holds the first blocks fetches only the rest: the request names
    only those, and only those arrive."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=5, seed=181, shared_names=True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        holder = ex.holder()
        ex.offer(bench)
        missing = {gi: [2, 3, 4] for gi in range(len(plan.groups))}
        view = bench.sink_view(missing)
        sub = ex.fetch(view)
        (request,) = holder.take(1)
        assert request.blocks == 3 and view.groups[0].names is not None and np.array_equal(
            request.names, view.groups[0].names), "N2: the request must name only the blocks the requester lacks"
        holder.finish(holder.answer(request))
        out = ex.settle(sub)
        assert out.is_delivered and all(m.all() for m in out.masks), f"N2: the missing blocks must arrive: {out!r}"
        bench.apply_fetch(out, missing)
        assert all(g.kind is CacheKind.PAGED for g in plan.groups)
