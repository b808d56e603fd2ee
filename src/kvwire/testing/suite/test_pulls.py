"""N2: request-free pulls from a serving peer, with the suite as the serving holder (its reuse
tree is a dict from block name to row, with pin counts), and the H1 clauses of a pull's ticket
and peer address. Runs only for backends that declare the ``serve-pulls`` protocol. One file, long as
it is: every test shares its pull set-ups (``_pulls``, ``_one_pull``) and misfit answers."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import (
    CacheKind,
    Cause,
    InvalidSubmission,
    LayerGroupRows,
    PullRequest,
    ServesPulls,
    SlotRegion,
    TokenRange,
    View,
)
from kvwire.contract.capabilities import SERVE_PULLS, OtherEnd
from kvwire.testing import needs, profiles
from kvwire.testing.harness import Harness, Unavailable
from kvwire.testing.holder import (
    Submission,
    call_briefly,
    declares,
    refused,
    same_outcome,
    settle,
    speaks_causes,
    submit,
)
from kvwire.testing.layout import BLOCK_TOKENS, Bench, GroupPlan, ViewPlan, simple_plan
from kvwire.testing.marks import checks
from kvwire.testing.plans import (
    needs_misses,
    offer_for,
    paged_exchange,
    pages,
    store_only,
    transfer_checked,
    with_field,
)
from kvwire.testing.serving import Answer
from kvwire.testing.strategies import view_plans
from kvwire.testing.suite._kit import (
    _held_answer,
    _one_pull,
    _patience,
    _pulls,
    _refused_pulls_left_no_trace,
    _requesters,
)

SENTINEL_5A = 0x5A


# -- N2.5 ---------------------------------------------------------------------------------------------------

@checks("N2.5")
def test_N2_incoming_hands_over_each_request_once(kvwire_harness: Harness) -> None:
    """N2.5: a request taken through ``incoming()`` and not yet answered is not handed over again
    when the next one arrives."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 467, True)
    with needs.open_exchange(kvwire_harness, max_in_flight=2) as ex, Bench(kvwire_harness, ex.ends.source,
                                                                           ex.ends.sink, plan, kind) as bench:
        needs.in_flight(ex.caps, 2)
        ex.offer(bench)
        holder = ex.holder()
        first = ex.fetch(bench.sink_view({0: [0]}))
        (one,) = holder.take(1)
        second = ex.fetch(bench.sink_view({0: [1]}))
        (two,) = holder.take(1)
        assert two is not one and two.ticket != one.ticket, "N2.5: incoming() handed over the same request twice"
        assert [int(b) for b in two.names[0]] == [int(b) for b in bench.names[0][1]], (
            "N2.5: the second request taken is not the second pull's")
        for request in (one, two):
            holder.finish(holder.answer(request))
        bench.forget_sink()
        for row, sub in enumerate((first, second)):
            bench.apply_fetch(ex.settle(sub), {0: [row]})


# -- N2.13: an answer that crosses the requester's cancel --------------------------------------------------

@checks("N2.13", "A4.3", "A2.3")
def test_N2_an_answer_that_crosses_a_cancel_ends_cancelled_by_the_peer(kvwire_harness: Harness) -> None:
    """N2.13 / A4.3 / A2.3: with the serving holder's answer on the wire (published, its rows not yet
    at the requester), the requester cancels: its fetch concludes ``CANCELLED`` at once, not by the
    peer; once the answer is let go it writes nothing into rows the holder reused after the fetch
    quiesced; and the answer concludes ``CANCELLED`` with ``by_peer`` true (cause
    ``PEER_CANCELLED``) and quiesces, so the serving holder's pins come back."""
    with paged_exchange(kvwire_harness, [(64, 3), (32, 3)], 3901, needs.serve_pulls, needs.transfer,
                        needs.cancellation, shared=True) as (_, ex, bench):
        hold, sub, answer = _held_answer(ex, bench, "an answer crossing a cancel")
        with hold:
            call_briefly(sub.attempt.cancel, "A4.1: cancel() of a pull whose answer is on the wire")
            out = settle(sub, _patience(), quiesce=False,
                         purpose="A4.3/A4.4: a pull cancelled while its answer is on the wire concluding")
            assert out.is_cancelled and not out.by_peer, (
                f"A4.3: a pull cancelled while its answer was on the wire must conclude CANCELLED, not by the peer; "
                f"got {out!r}")
            if speaks_causes(sub.backend):
                assert out.cause is Cause.HOLDER_CANCELLED, f"A10.6: a pull its holder cancelled: {out!r}"
        settle(sub, _patience() + kvwire_harness.quiesce_grace_s,
               purpose="A4.5: the cancelled pull quiescing once its answer was let go")
        bench.apply_fetch(out)  # A4.7: its true bits, if any, are rows that moved whole before the cancel
        bench.write_sink(None, SENTINEL_5A)  # the holder reuses the rows the moment the fetch quiesced
        holder = ex.holder()
        try:
            holder.finish(answer)
        except AssertionError as exc:
            raise AssertionError(f"N2.13: the answer whose requester cancelled while it was on the wire never "
                                 f"concluded and quiesced: {exc}") from None
        done = answer.publish.outcome
        assert done is not None and done.is_cancelled and done.by_peer, (
            f"N2.13: the requester cancelled before the answer concluded, so the answer concludes CANCELLED with "
            f"by_peer true; got {done!r}")
        if speaks_causes(ex.ends.source):
            assert done.cause is Cause.PEER_CANCELLED, f"A10.4: an answer its requester cancelled: {done!r}"
        assert holder.tree.pinned == 0
        try:
            bench.verify("after the answer a cancel crossed was let go")
        except AssertionError as exc:
            raise AssertionError(f"A2.3: the cancelled pull said it quiesced, yet its rows changed afterwards: "
                                 f"{exc}") from None
        again = ex.fetch_settled(bench.sink_view())
        assert again.is_delivered and all(m.all() for m in again.masks), (
            f"N2.13: a pull of the same blocks after the crossing must deliver: {again!r}")
        bench.apply_fetch(again)


@checks("N2.4", "N2.11", "A10.10")
def test_N2_a_busy_serving_end_declines_only_beyond_its_bound(kvwire_harness: Harness) -> None:
    """N2.4 / N2.11 / A10.10: pulls from several requesters wait for the serving holder, who takes
    none: while fewer than the serving end's declared bound of waiting pulls
    (``extra["pending_pulls"]``; without it, any number) wait, each pull reaches the holder; each
    one beyond it is declined at once (the fetch fails, cause ``DECLINED``). Once the holder
    answered the waiting pulls, nothing waits: the next pulls reach the holder again, and
    deliver."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=4) as ex:
        bound = ex.caps.max_in_flight
        pending = ex.ends.extra.get("pending_pulls")
        if isinstance(pending, bool) or not isinstance(pending, int | type(None)):
            raise AssertionError(f"Ends.extra['pending_pulls'] must be an int, got {pending!r}")
        if bound > 64:
            pytest.skip(f"backend declares a queue bound of {bound}, too large to fill here")
        if pending is not None and pending > 64:
            pytest.skip(f"the serving end keeps {pending} pulls waiting, too many to reach here")
        total = (pending + 2) if pending is not None else 2 * bound
        plan = pages([(32, total)], 3903, True)
        try:
            requesters = _requesters(ex, kvwire_harness, plan, kind, math.ceil(total / bound))
        except Unavailable as exc:
            pytest.skip(f"harness cannot provide it: {exc}")
        with Bench(kvwire_harness, ex.ends.source, None, plan, kind) as served:
            ex.offer(served)
            holder = ex.holder()
            subs: list[tuple[Submission, Bench, int]] = []
            for row in range(total):
                backend, bench = requesters[row // bound]
                subs.append((submit(backend, "fetch", bench.sink_view({0: [row]}), ex.ends.fetch_hint), bench, row))
            waiting = total if pending is None else pending
            try:
                taken = holder.take(waiting)
            except AssertionError as exc:
                raise AssertionError(f"N2.4: {total} pulls were made and at most {pending} may wait for the serving "
                                     f"holder, yet fewer than {waiting} reached it: {exc}") from None
            asked = {request.names[0].tobytes() for request in taken}
            for _, bench in requesters:
                bench.forget_sink()  # each pull writes its row; each is checked once it settled
            for sub, bench, row in subs:
                if bench.names[0][row].tobytes() in asked:
                    continue
                out = settle(sub, _patience(), purpose=f"N2.4: pull {row + 1} of {total}, beyond the {pending} "
                                                      "the serving end keeps waiting, being declined")
                assert out.is_failed, f"N2.11: a pull the serving end declined as busy must fail, got {out!r}"
                if speaks_causes(sub.backend):
                    assert out.cause is Cause.DECLINED, f"A10.10: a pull declined as busy has cause DECLINED: {out!r}"
                bench.apply_fetch(out, {0: [row]})
            late = holder.incoming()
            assert not late, f"N2.4: {len(late)} more pull(s) reached the holder after those beyond the bound failed"
            for request in taken:
                holder.finish(holder.answer(request))
            for sub, bench, row in subs:
                if bench.names[0][row].tobytes() in asked:
                    out = settle(sub, _patience())
                    assert out.is_delivered and out.masks[0].all(), f"N2.8: an answered pull must deliver: {out!r}"
                    bench.apply_fetch(out, {0: [row]})
            # Nothing waits now: the next pulls reach the holder, however many were declined before.
            again = [(submit(backend, "fetch", bench.sink_view({0: [row]}), ex.ends.fetch_hint), bench, row)
                     for row, (backend, bench) in enumerate(requesters[: max(1, min(len(requesters), waiting))])]
            for _, bench, row in again:
                bench.forget_sink({0: [row]})
            try:
                for request in holder.take(len(again)):
                    holder.finish(holder.answer(request))
            except AssertionError as exc:
                raise AssertionError(f"N2.4: once the serving holder answered every pull that waited, a new pull "
                                     f"must reach it again: {exc}; outcomes: "
                                     f"{[sub.attempt.poll() for sub, _, _ in again]}") from None
            for sub, bench, row in again:
                out = settle(sub, _patience())
                assert out.is_delivered and out.masks[0].all(), f"N2.8: an answered pull must deliver: {out!r}"
                bench.apply_fetch(out, {0: [row]})
        for _, bench in requesters:
            bench.close()


# -- N2.7 / N2.5: a pull declined before serve() ------------------------------------------------------


@checks("N2.7", "N2.5")
def test_N2_a_pull_declined_before_serve_is_not_handed_over_once_serving(kvwire_harness: Harness) -> None:
    """N2.7 / N2.5: a pull made before the serving end's holder called ``serve()`` is declined
    (cause ``DECLINED`` for 1.1), and is done with: once ``serve()`` is called, ``incoming()``
    hands over only the pulls made since, and a pull made then delivers."""
    with paged_exchange(kvwire_harness, [(48, 4), (32, 4)], 851, needs.serve_pulls, needs.transfer) as (_, ex, bench):
        early_rows = {0: [0, 1], 1: [0, 1]}
        early = ex.settle(ex.fetch(bench.sink_view(early_rows)))
        assert early.is_failed, f"N2.7: a pull made before serve() is declined, so the fetch fails: {early!r}"
        if speaks_causes(ex.ends.sink):
            assert early.cause is Cause.DECLINED, f"N2.7/A10.10: a pull made before serve() is declined: {early!r}"
        bench.apply_fetch(early, early_rows)
        holder = ex.holder()  # serve() now
        ex.offer(bench)
        late_rows = {0: [2, 3], 1: [2, 3]}
        late = ex.fetch(bench.sink_view(late_rows))
        (request,) = holder.take(1)
        asked = bench.names[0][[2, 3]]
        assert np.array_equal(request.names, asked), (
            "N2.7: once serve() was called, incoming() handed over a request naming blocks "
            f"{request.names.tolist()}, not the pull made since ({asked.tolist()}); a pull made before serve() was "
            "declined, and is never handed over later")
        holder.finish(holder.answer(request))
        out = ex.settle(late)
        bench.apply_fetch(out, late_rows)
        assert out.is_delivered and all(m.all() for m in out.masks), f"N2: the pull made after serve() delivers: {out!r}"
        serving = ex.ends.source
        assert isinstance(serving, ServesPulls)
        left = (*holder._pending, *call_briefly(serving.incoming, "N2.5: incoming()"))
        assert left == (), (
            f"N2.7/N2.5: every pull made since serve() was taken, yet incoming() handed over {len(left)} more "
            "(a pull declined before serve())")


def _prefix(bench: Bench, count: int) -> dict[int, list[int]]:
    return {gi: list(range(min(count, g.rows))) for gi, g in enumerate(bench.plan.groups)}


@checks(also=("N2.4", "N2.6", "N2.10"))
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


@checks(also=("N2.11", "A10.10"))
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


@checks("N2.13", "N2.9")
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


@checks("N2.7")
def test_N2_a_peer_that_is_not_serving_fails_the_fetch(kvwire_harness: Harness) -> None:
    """N2.7: a pull from a peer whose holder never called ``serve()`` is declined: the
    fetch fails saying why, before its deadline, and (contract 1.1) with cause ``DECLINED``."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=2, seed=179, shared_names=True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, None, ex.ends.sink, plan, kind) as bench:
        sub = ex.fetch(bench.sink_view())
        out = ex.settle(sub)
        assert out.is_failed and out.reason, f"N2: pulling from a peer that does not serve must fail, got {out!r}"
        assert out.rows_delivered == 0
        if speaks_causes(sub.backend):
            assert out.cause is Cause.DECLINED, (
                f"N2.7/A10.10: a pull from a peer that is not serving is declined, so its cause is DECLINED: {out!r}")
        bench.apply_fetch(out)


@checks(also=("N2.14",))
def test_N2_blocks_the_requester_holds_are_not_sent_again(kvwire_harness: Harness) -> None:
    """A requester that already holds the first blocks (pulled from this server before) fetches
    only the rest: the request names only those, and only those arrive."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=5, seed=181, shared_names=True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        holder = ex.holder()
        ex.offer(bench)
        held = {gi: [0, 1] for gi in range(len(plan.groups))}
        sub = ex.fetch(bench.sink_view(held))
        (request,) = holder.take(1)
        holder.finish(holder.answer(request))
        first = ex.settle(sub)
        assert first.is_delivered and all(m.all() for m in first.masks), f"N2: the first blocks must arrive: {first!r}"
        bench.apply_fetch(first, held)
        missing = {gi: [2, 3, 4] for gi in range(len(plan.groups))}
        view = bench.sink_view(missing)
        sub = ex.fetch(view)
        (request,) = holder.take(1)
        assert request.blocks == 3 and view.groups[0].names is not None and np.array_equal(
            request.names, view.groups[0].names), (
            f"N2.14: the request must name only the {view.groups[0].rows} blocks the requester lacks, not the ones "
            f"it pulled before; it names {request.blocks}")
        holder.finish(holder.answer(request))
        out = ex.settle(sub)
        assert out.is_delivered and all(m.all() for m in out.masks), f"N2: the missing blocks must arrive: {out!r}"
        bench.apply_fetch(out, missing)
        assert all(g.kind is CacheKind.PAGED for g in plan.groups)


@checks("N2.2", "H1.11", also=("N2.1",))
def test_N2_the_serving_address_is_at_most_4_KiB_of_bytes_a_pull_can_name(kvwire_harness: Harness) -> None:
    """N2.2 / H1.11: ``address()`` of the serving end returns non-empty bytes of at most 4 KiB,
    and a pull whose peer hint names exactly those bytes delivers."""
    with _pulls(kvwire_harness, [(32, 2)], 663, needs.transfer) as (_, ex, bench):
        source = ex.ends.source
        assert isinstance(source, ServesPulls), "N2.1: a backend that declares serve-pulls implements ServesPulls"
        address = call_briefly(source.address, "N2.2: address()")
        assert isinstance(address, bytes) and 0 < len(address) <= 4096, (
            f"N2.2: address() returns opaque bytes of at most 4 KiB (4096 bytes), got a {type(address).__name__} of "
            f"length {len(address) if hasattr(address, '__len__') else '?'}")
        ex.offer(bench)
        out = ex.fetch_settled(bench.sink_view(), with_field(ex.ends.fetch_hint, "address", address))
        bench.apply_fetch(out)
        assert out.is_delivered and all(m.all() for m in out.masks), (
            f"N2.2/H1.11: a pull naming the serving end's address() must deliver: {out!r}")


@checks("N2.5")
def test_N2_incoming_with_nothing_waiting_answers_at_once(kvwire_harness: Harness) -> None:
    """N2.5: ``incoming()`` never blocks: with no request waiting (before any pull, and once the
    only one was taken and answered) it answers an empty tuple at once."""
    with _pulls(kvwire_harness, [(32, 2)], 667, needs.transfer) as (_, ex, bench):
        holder = ex.holder()
        serving = ex.ends.source
        assert isinstance(serving, ServesPulls)
        empty = call_briefly(serving.incoming, "N2.5: incoming() with no request waiting")
        assert empty == (), f"N2.5: no pull was made, yet incoming() answered {empty!r}"
        sub, request = _one_pull(ex, bench)
        holder.finish(holder.answer(request))
        out = ex.settle(sub)
        bench.apply_fetch(out)
        assert out.is_delivered, f"N2: the pull must deliver: {out!r}"
        empty = call_briefly(serving.incoming, "N2.5: incoming() once the only request was taken and answered")
        assert empty == (), f"N2.5: the only request was taken before, yet incoming() answered {empty!r}"


@checks("N2.3")
def test_N2_a_pull_whose_groups_name_different_blocks_is_refused(kvwire_harness: Harness) -> None:
    """N2.3: a pull names each block once for all its groups: a view whose groups carry other
    names (the second group's in another order, or other blocks), or a group without names, is
    refused with ``InvalidSubmission``; no pull reaches the serving end, the rows are untouched."""
    with _pulls(kvwire_harness, [(64, 3), (32, 3)], 647, needs.fetch) as (_, ex, bench):
        ex.offer(bench)
        view = bench.sink_view()
        g0, g1 = view.groups
        assert g1.names is not None
        other = np.array(g1.names[::-1])
        stranger = np.array(g1.names)
        stranger[-1] = stranger[-1] ^ 0xFF
        cases = {"the second group's names in another order": other,
                 "another block in the second group": stranger, "no names in the second group": None}
        for what, names in cases.items():
            bad = View((g0, LayerGroupRows(g1.group_id, g1.kind, g1.region, g1.slots, g1.tokens, names)))
            refused(functools.partial(ex.fetch, bad), f"N2.3: a pull with {what}")
        _refused_pulls_left_no_trace(ex, bench, view, "names")


MISFITS = ["one row more than asked", "names that are not the pull's prefix", "rows of another slot size",
           "other groups", "fewer groups than asked", "the pull's groups in another order"]


_MISFITS_SINCE_1_2 = ("fewer groups than asked", "the pull's groups in another order")


def _misfit_answer(request: PullRequest, bench: Bench, how: str) -> View:
    """An answer to ``request`` (which names the bench's first two blocks) that does not fit it:
    one row too many, its names out of order, rows twice the requested size (a region over the
    same registered memory in slots of double size, M4.2), group ids the pull did not name, only
    the first of the pull's groups, or the pull's groups in reverse order (N2.8: per requested
    group, in order)."""
    order = list(enumerate(request.groups))
    if how == "fewer groups than asked":
        order = order[:1]
    elif how == "the pull's groups in another order":
        order.reverse()
    groups = []
    for gi, gid in order:
        region = bench.source.memories[gi].region
        rows = [0, 1, 2] if how == "one row more than asked" else [1, 0] if how.startswith("names") else [0, 1]
        slots = bench.source.slots[gi][rows]
        if how == "rows of another slot size":
            region = SlotRegion(region.region_id + 50_000, region.base, region.slot_bytes * 2, region.slot_count // 2,
                                region.memory_kind, region.device)
            slots = slots // 2
        if how == "other groups":
            gid = max(request.groups) + 1 + gi
        groups.append(LayerGroupRows(gid, CacheKind.PAGED, region, slots, TokenRange(0, BLOCK_TOKENS * len(rows)),
                                     bench.names[gi][rows]))
    return View(tuple(groups))


@checks("N2.12", also=("H1.13", "N2.15"))
@pytest.mark.parametrize("how", MISFITS)
def test_N2_an_answer_that_does_not_fit_its_pull_fails_both_ends(kvwire_harness: Harness, how: str) -> None:
    """N2.12: an answer with more rows than the pull asked for, rows named other than the pull's
    prefix, rows of another slot size than the pull expects, groups the pull did not name, fewer
    of its groups or its groups in another order, fails: the answer concludes failed, and so does
    the requester's fetch, saying why, without waiting for its deadline; nothing it marks true is
    wrong (A7). The request is used up: a fitting answer afterwards is refused (H1.13). Fewer
    groups and groups in another order are misfits from contract 1.2 (N2.15)."""
    patience = profiles.active().patience_s
    with _pulls(kvwire_harness, [(64, 3), (32, 3)], 653, needs.transfer) as (_, ex, bench):
        take = {0: [0, 1], 1: [0, 1]}
        sub, request = _one_pull(ex, bench, take)
        holder = ex.holder()
        if how in _MISFITS_SINCE_1_2 and not declares(ex.ends.source, "N2.15"):
            pytest.skip(f"N2.15 (an answer with {how} is a misfit) arrived in contract 1.2; the backend declares "
                        f"contract {'.'.join(map(str, ex.ends.source.capabilities().contract_version))}")
        view = _misfit_answer(request, bench, how)
        try:
            answer = submit(ex.ends.source, "publish", view, request.ticket)
        except InvalidSubmission as exc:
            raise AssertionError(f"N2.12: an answer with {how} raised {exc!r}; it fails the answer (an outcome), and "
                                 "the requester's fetch fails saying why") from exc
        holder.answers.append(Answer(request, answer))
        published = settle(answer, patience, purpose=f"N2.12: the answer with {how} concluding")
        assert published.is_failed, f"N2.12: an answer with {how} must fail, got {published!r}"
        out = ex.settle(sub, purpose=f"N2.12: the fetch answered with {how} concluding before its deadline")
        bench.apply_fetch(out, take)
        assert out.is_failed and out.reason, (
            f"N2.12: the requester's fetch answered with {how} must fail saying why, got {out!r}")
        fitting = holder.tree.view_for(request, holder.tree.held_prefix(request))
        refused(functools.partial(submit, ex.ends.source, "publish", fitting, request.ticket),
                f"N2.12/H1.13: a fitting answer to a pull whose answer with {how} failed (the request is used up)")
        try:
            same_outcome(out, sub.attempt.poll(), "fetch")  # type: ignore[arg-type]
        except AssertionError as exc:
            raise AssertionError(f"N2.12: a second answer after the one with {how} changed the requester's outcome: "
                                 f"{exc}") from None


@checks("N1.7", also=("N2.12", "N1.5", "S3.4"))
def test_N1_an_answer_whose_groups_carry_no_names_is_refused(kvwire_harness: Harness) -> None:
    """N1.7 / S3: an answer is a publish, so a serving backend that declares content addressing
    refuses one whose groups carry no names with ``InvalidSubmission``, before the
    request is looked at (a missing name is never a misfit, N2.12). Nothing escaped: the request
    is still open, and a fitting answer afterwards delivers both ends."""
    with paged_exchange(kvwire_harness, [(64, 3), (32, 3)], 907, needs.serve_pulls, needs.transfer, needs.names,
                        shared=True) as (_, ex, bench):
        take = {0: [0, 1], 1: [0, 1]}
        sub, request = _one_pull(ex, bench, take)
        holder = ex.holder()
        fitting = holder.tree.view_for(request, holder.tree.held_prefix(request))
        nameless = View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens, None)
                              for g in fitting.groups))
        refused(functools.partial(submit, ex.ends.source, "publish", nameless, request.ticket),
                "N1.5: an answer whose groups carry no names")
        holder.finish(holder.answer(request))
        out = ex.settle(sub, purpose="N1.5/S3.4: the pull answered properly after a refused nameless answer")
        bench.apply_fetch(out, take)
        assert out.is_delivered and all(m.all() for m in out.masks), (
            f"N1.5/S3.4: after a nameless answer was refused, a fitting answer must deliver the pull: {out!r}")


# -- names ----------------------------------------------------------------------------------------

def _crafted_names(rows: int, width: int) -> np.ndarray:
    """Distinct names that a backend treating names as text, trimming zero bytes, or reading
    only part of them would confuse: all zeros, one byte apart at either end, trailing zeros,
    two names apart only in a byte that is not UTF-8 (0xFF and 0xFE)."""
    names = np.zeros((rows, width), dtype=np.uint8)
    for i in range(1, rows):
        if i % 4 == 1:
            names[i, -1] = i  # differs from all-zeros in the last byte
        elif i % 4 == 2:
            names[i, 0] = i  # ... in the first byte, then zeros
        elif i % 4 == 3:
            names[i, width // 2] = i
        elif i % 8 == 4:
            names[i, :] = names[i - 1]
            names[i, 1] = 0xFF
        else:  # ... only in a byte that is no UTF-8 text: 0xFE where row i - 4 has 0xFF
            names[i, :] = names[i - 4]
            names[i, 1] = 0xFE
    assert len(np.unique(names, axis=0)) == rows
    return names


@checks("N1.3", "N1.4")
def test_N1_names_are_opaque_bytes_every_byte_counts(kvwire_harness: Harness) -> None:
    """N1.3 / N1.4: names are opaque fixed-width bytes: zero bytes count, and names one byte apart name
    different blocks, also when neither byte is text (names never decoded as text)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(32, 12), (48, 12)], 227, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        needs_misses(ex)
        crafted = _crafted_names(12, 16)
        for gi in range(len(plan.groups)):
            bench.names[gi] = crafted
        offer = offer_for(ex, plan, lambda gi, n: [0, 2, 3, 5, 8, 11] if ex.store else range(7))
        transfer_checked(ex, bench, offer, None, "N1.4")


@checks("N1.2")
def test_N1_a_store_keys_rows_by_group_and_name(kvwire_harness: Harness) -> None:
    """N1.2: the same name in two groups stands for two rows with different bytes; each group's
    row is found only in that group."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.names(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 6), (64, 6), (32, 6)], 229, shared=True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "keying stored rows")
        offer = {0: [0, 1, 2], 1: [3, 4, 5], 2: [1, 4]}
        transfer_checked(ex, bench, offer, None, "N1.2")


@checks("N1.6")
def test_N1_a_peer_without_content_addressing_moves_rows_by_position(kvwire_harness: Harness) -> None:
    """N1.6: a peer backend without content addressing (and without ``serve-pulls``) moves rows by
    position and ignores names: the publish names its rows one way, the fetch meeting it names
    them in the reverse order, or not at all, and row ``j`` of each group still arrives in row
    ``j`` of the same group, every bit true."""
    caps = kvwire_harness.capabilities()
    if caps.other_end is not OtherEnd.PEER or caps.content_addressed or SERVE_PULLS in caps.protocols:
        pytest.skip("backend is not a peer without content addressing (a store, a content-addressed peer, or one "
                    "that serves pulls); N1.6 binds a peer that moves rows by position")
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4), (32, 4)], 2251, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        for case in ("names in reverse order", "no names"):
            groups = []
            for group in bench.sink_view().groups:
                names = None if case == "no names" or group.names is None else group.names[::-1].copy()
                groups.append(LayerGroupRows(group.group_id, group.kind, group.region, group.slots, group.tokens,
                                             names))
            pub = ex.publish(bench.source_view())
            try:
                sub = ex.fetch(View(tuple(groups)))
            except InvalidSubmission as exc:
                raise AssertionError(f"N1.6: a fetch whose rows carry {case} was refused ({exc}); a peer without "
                                     "content addressing ignores names") from exc
            published, fetched = ex.settle(pub), ex.settle(sub)
            try:
                bench.apply_fetch(fetched)
            except AssertionError as exc:
                raise AssertionError(f"N1.6: a fetch with {case}, meeting a publish of the same rows: {exc}; row j "
                                     "of a group moves to row j of the same group, whatever the names") from None
            assert published.is_delivered and fetched.is_delivered and all(m.all() for m in fetched.masks), (
                f"N1.6: a fetch with {case} meeting a publish of as many rows per group must get every row by "
                f"position: the publish gave {published!r}, the fetch {fetched!r}")


@checks("N1.5", "S3.2")
def test_N1_a_content_addressed_backend_refuses_views_without_names(kvwire_harness: Harness) -> None:
    """N1.5 / S3.2: a backend that declares content addressing refuses a publish and a fetch whose
    groups carry no names with ``InvalidSubmission`` (never as rows nobody holds), touching no
    memory and storing nothing: a named fetch afterwards finds none of those rows."""
    specs = [(32, 3), (48, 3)]
    with paged_exchange(kvwire_harness, specs, 233, needs.transfer, needs.names) as (caps, ex, bench):
        if caps.publish:
            refused(lambda: ex.publish(bench.source_view(names=False)),
                    "N1.5: a publish whose groups carry no names, on a content-addressed backend,")
        if caps.fetch:
            refused(lambda: ex.fetch(bench.sink_view(names=False)),
                    "N1.5: a fetch whose groups carry no names, on a content-addressed backend,")
        bench.verify("N1.5: after submissions refused for carrying no names")
        if ex.store:
            transfer_checked(ex, bench, {}, None, "N1.5")


@checks("N1.3")
@pytest.mark.parametrize("width", [1, 64])
def test_N1_names_of_one_byte_and_of_64_bytes_name_their_blocks(kvwire_harness: Harness, width: int) -> None:
    """N1.3: names are 1 to 64 bytes wide, and a name of either extreme names its block: rows named
    by one byte, or by 64 bytes that differ only in the last, move and are found like any others
    (from a store, the rows offered; from a serving peer, the held prefix)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    rows = 6
    plan = ViewPlan(tuple(GroupPlan(gi, CacheKind.PAGED, size, rows, tuple(range(1, 1 + rows)),
                                    tuple(reversed(range(1, 1 + rows))), rows + 2, width)
                          for gi, size in enumerate((32, 48))), 251, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        needs_misses(ex)
        names = np.full((rows, width), 0x5A, dtype=np.uint8)
        names[:, -1] = np.arange(rows) * 37  # distinct only in the last byte (the only byte, at width 1)
        for gi in range(len(plan.groups)):
            bench.names[gi] = names
        offer = offer_for(ex, plan, lambda gi, n: [0, 1, 2, 4] if ex.store else range(4))
        transfer_checked(ex, bench, offer, None, f"N1.3 (names of {width} bytes)")


@checks("N1.4", "S1.4")
def test_N1_a_name_with_a_trailing_zero_or_a_byte_less_is_another_name(kvwire_harness: Harness) -> None:
    """N1.4 / S1.4: a name and the same name with one more trailing zero byte, or with its last
    byte dropped, are different names: after a publish of names of width w (1, 16 and 64, some
    ending in a zero byte), a fetch of the same group and rows under those names of width w + 1
    or w - 1 finds nothing."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    widths = (1, 16, 64)
    rows = 4
    plan = ViewPlan(tuple(GroupPlan(gi, CacheKind.PAGED, 32, rows, tuple(range(1, 1 + rows)),
                                    tuple(reversed(range(1, 1 + rows))), rows + 2, w)
                          for gi, w in enumerate(widths)), 241)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "which names a stored row is found under")
        needs.names(caps)
        for names in bench.names:
            names[:, 0] = np.arange(rows) + 1  # distinct, also once the last byte is dropped
            if names.shape[1] > 1:
                names[::2, -1] = 0  # a trailing zero: dropping it leaves the same bytes, zero-padded
        published = ex.offer(bench)
        assert published is not None
        if not any(m.any() for m in published.masks):
            pytest.skip("the store took none of the published rows")
        for what, delta in (("one trailing zero byte added", +1), ("the last byte dropped", -1)):
            select = {gi: list(range(rows)) for gi, w in enumerate(widths) if 1 <= w + delta <= 64}
            view = bench.sink_view(select)
            groups = []
            for gi, g in zip(bench.groups_in(select), view.groups, strict=True):
                w = widths[gi]
                names = np.zeros((rows, w + delta), dtype=np.uint8)
                names[:, : min(w, w + delta)] = bench.names[gi][:, : min(w, w + delta)]
                groups.append(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens, names))
            fetched = ex.settle(ex.fetch(View(tuple(groups))))
            bench.apply_fetch(fetched, select)
            for gi, mask in zip(bench.groups_in(select), fetched.masks, strict=True):
                assert not mask.any(), (
                    f"N1.4/S1.4: group {gi}: rows {np.flatnonzero(mask).tolist()} were published under names of "
                    f"{widths[gi]} bytes, and found under the same names with {what} ({widths[gi] + delta} bytes); "
                    "those are different names, which no one published")
