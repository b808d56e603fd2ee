"""N2: request-free pulls from a serving peer, with the suite as the serving holder (its reuse
tree is a dict from block name to row, with pin counts), and the H1 clauses of a pull's ticket
and peer address. Runs only for backends that declare the ``serve-pulls`` protocol. One file of
~570 lines: every test shares its pull set-ups (``_pulls``, ``_one_pull``) and misfit answers."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import (
    CacheKind,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    PullRequest,
    ServesPulls,
    SlotRegion,
    SubmissionRejected,
    TokenRange,
    View,
)
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Harness, shut_down
from kvwire.testing.holder import (
    RaisingWakes,
    Submission,
    call_briefly,
    declares,
    refused,
    same_outcome,
    settle,
    speaks_causes,
    submit,
)
from kvwire.testing.layout import BLOCK_TOKENS, Bench, ViewPlan, simple_plan
from kvwire.testing.plans import paged_exchange, pages, with_field
from kvwire.testing.serving import Answer
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


@pytest.mark.parametrize("wake", ["plain", "raising"])
def test_W1_a_pull_beside_an_untaken_one_gets_its_own_serve_wake(kvwire_harness: Harness, wake: str) -> None:
    """W1.4 / N2.4 (and W1.7 with a serve wake that raises): a second pull that arrives while the
    first still waits, untaken, in ``incoming()`` is followed by a serve wake of its own; a serve
    wake that raised is called again for the next pull; both pulls are then served."""
    patience = profiles.active().patience_s
    with _pulls(kvwire_harness, [(32, 2)], 669, needs.transfer, in_flight=2) as (_, ex, bench):
        holder = ex.holder(RaisingWakes() if wake == "raising" else None)
        ex.offer(bench)
        first = ex.fetch(bench.sink_view({0: [0]}))
        assert holder.wakes.wait_beyond(0, time.monotonic() + patience), (
            f"W1.4: no serve wake followed the first pull within {patience:g} s")
        seen = holder.wakes.count
        second = ex.fetch(bench.sink_view({0: [1]}))
        if not holder.wakes.wait_beyond(seen, time.monotonic() + patience):
            raise AssertionError(
                f"W1.4{'/W1.7' if wake == 'raising' else ''}: a second pull, made while the first waited untaken in "
                f"incoming(){' after a serve wake that raised' if wake == 'raising' else ''}, got no serve wake "
                f"within {patience:g} s; each new pull request is followed by a wake of its own")
        for request in holder.take(2):
            holder.finish(holder.answer(request))
        outs = [ex.settle(first), ex.settle(second)]
        bench.forget_sink({0: [1]})  # the second pull's row is checked with its own outcome
        for row, out in enumerate(outs):
            bench.apply_fetch(out, {0: [row]})
            assert out.is_delivered and out.masks[0].all(), f"N2: the pull of block {row} must deliver: {out!r}"


# -- tickets, addresses and answers (H1.11, H1.13, N2.3, N2.12) -------------------------------

def _pulls(
    harness: Harness, specs: list[tuple[int, int]], seed: int, need: Callable[[Capabilities], None],
    in_flight: int = 1,
) -> AbstractContextManager[tuple[Capabilities, Exchange, Bench]]:
    """For a ``serve-pulls`` peer that also declares ``need`` and takes ``in_flight`` attempts at
    once: an exchange and a bench of PAGED groups of ``(slot_bytes, rows)`` that share their
    names (the blocks of a pull)."""
    return paged_exchange(harness, specs, seed, needs.serve_pulls, need, shared=True, in_flight=in_flight)


def _one_pull(ex: Exchange, bench: Bench, select: dict[int, list[int]] | None = None) -> tuple[Submission, PullRequest]:
    ex.offer(bench)
    sub = ex.fetch(bench.sink_view(select))
    (request,) = ex.holder().take(1)
    return sub, request


def test_H1_a_ticket_of_another_instance_is_rejected(kvwire_harness: Harness) -> None:
    """H1.13: an answer published on another serving instance with this one's ticket raises
    ``SubmissionRejected`` there and escapes nothing: the pull is still answered where it was
    made, and delivers."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (32, 3)], 631, True)
    with needs.open_exchange(kvwire_harness) as ex, needs.open_exchange(kvwire_harness) as other, \
            Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        sub, request = _one_pull(ex, bench)
        holder = ex.holder()
        answer = holder.tree.view_for(request, holder.tree.held_prefix(request))
        with other.ends.source.register_regions([m.region for m in bench.source.memories]):
            refused(functools.partial(submit, other.ends.source, "publish", answer, request.ticket),
                    "H1.13: an answer published on another instance with this instance's ticket", SubmissionRejected)
        holder.finish(holder.answer(request))
        out = ex.settle(sub)
        bench.apply_fetch(out)
        assert out.is_delivered and all(m.all() for m in out.masks), (
            f"H1.13: after another instance rejected the ticket, the pull must still be answered and deliver: {out!r}")


def test_H1_a_ticket_already_answered_is_refused(kvwire_harness: Harness) -> None:
    """H1.13: a second answer with a ticket already answered raises ``InvalidSubmission``, and
    changes nothing: the requester's fetch keeps the outcome and bytes of the first answer."""
    with _pulls(kvwire_harness, [(64, 3), (32, 3)], 641, needs.transfer) as (_, ex, bench):
        sub, request = _one_pull(ex, bench)
        holder = ex.holder()
        holder.finish(holder.answer(request))
        out = ex.settle(sub)
        bench.apply_fetch(out)
        view = holder.tree.view_for(request, holder.tree.held_prefix(request))
        refused(functools.partial(submit, ex.ends.source, "publish", view, request.ticket),
                "H1.13: a second answer with a ticket already answered")
        try:
            same_outcome(out, sub.attempt.poll(), "fetch")  # type: ignore[arg-type]
        except AssertionError as exc:
            raise AssertionError(f"H1.13: a refused second answer changed the requester's outcome: {exc}") from None
        bench.verify("H1.13: after a second answer with an answered ticket was refused")


def test_H1_a_peer_address_that_is_not_bytes_or_is_empty_is_refused(kvwire_harness: Harness) -> None:
    """H1.14 / H1.5: a peer hint whose ``address`` is no bytes (the address as a str, an int) or
    empty bytes is refused with ``InvalidSubmission``; no pull reaches the serving end and the
    rows are untouched."""
    with _pulls(kvwire_harness, [(64, 2)], 643, needs.fetch) as (_, ex, bench):
        ex.offer(bench)
        address = ex.ends.fetch_hint.get("address")
        bad = {"the address as a str": address.decode("latin-1") if isinstance(address, bytes) else "x",
               "an int": 7, "empty bytes": b""}
        for what, value in bad.items():
            hint = with_field(ex.ends.fetch_hint, "address", value)
            refused(functools.partial(ex.fetch, bench.sink_view(), hint), f"H1.11: a pull whose address is {what}")
        _refused_pulls_left_no_trace(ex, bench, bench.sink_view(), "address")


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


def _refused_pulls_left_no_trace(ex: Exchange, bench: Bench, good: View, why: str) -> None:
    """After pulls refused for their ``why``: none reached the serving end (S3.4), the rows are
    untouched (S3.5), and a pull of ``good`` afterwards delivers."""
    assert not ex.holder().serving.incoming(), f"S3.4: a pull refused for its {why} reached the serving end"
    bench.verify(f"S3.5: after pulls refused for their {why}")
    out = ex.fetch_settled(good)
    bench.apply_fetch(out)
    assert out.is_delivered and all(m.all() for m in out.masks), f"N2: a good pull afterwards must deliver: {out!r}"


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


# -- the serving holder's calls, tickets and credentials (W1.6, H1.3, H1.12, H1.13) -----------

def _by_block(requests: list[PullRequest], bench: Bench) -> list[PullRequest]:
    """``requests`` of one-block pulls, in the order of the bench's rows they name."""
    rows = {bench.names[0][row].tobytes(): row for row in range(bench.plan.groups[0].rows)}
    return sorted(requests, key=lambda r: rows[r.names[0].tobytes()])


def test_W1_the_serve_wake_never_comes_from_inside_the_holders_calls(kvwire_harness: Harness) -> None:
    """W1.6 (serve wake): the serving holder calls ``serve()``, ``incoming()`` and ``decline()``
    maybe holding a lock its serve wake takes: the backend never calls that wake from inside
    them. Two pulls are taken, one declined, one answered; both requesters get their outcome."""
    with _pulls(kvwire_harness, [(32, 2)], 671, needs.transfer, in_flight=2) as (_, ex, bench):
        holder = ex.holder()
        ex.offer(bench)
        first = ex.fetch(bench.sink_view({0: [0]}))
        second = ex.fetch(bench.sink_view({0: [1]}))
        one, two = _by_block(holder.take(2), bench)
        holder.decline(one, "conformance: the serving holder declines this pull")
        holder.finish(holder.answer(two))
        declined, served = ex.settle(first), ex.settle(second)
        holder.incoming()
        holder.check_no_wake_inside()
        bench.forget_sink({0: [1]})  # the served row is checked with its own outcome
        bench.apply_fetch(declined, {0: [0]})
        bench.apply_fetch(served, {0: [1]})
        assert declined.is_failed, f"N2.11: the declined pull must fail: {declined!r}"
        assert served.is_delivered and served.masks[0].all(), f"N2: the answered pull must deliver: {served!r}"


def test_H1_a_declined_ticket_cannot_be_answered_afterwards(kvwire_harness: Harness) -> None:
    """H1.16 / N2.11: declining a request answers it: a publish with its ticket afterwards raises
    ``InvalidSubmission``, and the requester's fetch stays failed as the decline left it, its
    rows untouched."""
    with _pulls(kvwire_harness, [(64, 2), (32, 2)], 673, needs.transfer) as (_, ex, bench):
        sub, request = _one_pull(ex, bench)
        holder = ex.holder()
        holder.decline(request, "conformance: declined, then answered")
        out = ex.settle(sub)
        assert out.is_failed, f"N2.11: a declined pull must fail: {out!r}"
        view = holder.tree.view_for(request, holder.tree.held_prefix(request))
        refused(functools.partial(submit, ex.ends.source, "publish", view, request.ticket),
                "H1.13: an answer with the ticket of a request the holder declined")
        try:
            same_outcome(out, sub.attempt.poll(), "fetch")  # type: ignore[arg-type]
        except AssertionError as exc:
            raise AssertionError(f"H1.13: a refused answer after a decline changed the requester's outcome: {exc}") \
                from None
        bench.apply_fetch(out)


def test_H1_a_ticket_decoded_from_its_bytes_answers_the_pull(kvwire_harness: Harness) -> None:
    """H1.3 / H1.13: a serving holder may keep a ticket as bytes (``to_bytes()``) and answer with
    the hint decoded from them: the backend treats it exactly like the ticket it handed out, and
    the pull delivers."""
    with _pulls(kvwire_harness, [(64, 3), (32, 3)], 677, needs.transfer) as (_, ex, bench):
        sub, request = _one_pull(ex, bench)
        holder = ex.holder()
        ticket = Hint.from_bytes(request.ticket.to_bytes())
        assert ticket == request.ticket and ticket is not request.ticket
        try:
            answer = holder.answer(request, ticket=ticket)
        except InvalidSubmission as exc:
            raise AssertionError(f"H1.3/H1.13: an answer with the request's ticket decoded from its bytes raised "
                                 f"{exc!r}; a decoded hint is treated exactly like the original") from exc
        holder.finish(answer)
        out = ex.settle(sub)
        bench.apply_fetch(out)
        assert out.is_delivered and all(m.all() for m in out.masks), (
            f"H1.3/H1.13: the pull answered with its ticket decoded from bytes must deliver: {out!r}")


def test_H1_each_pull_carries_its_own_credentials(kvwire_harness: Harness) -> None:
    """H1.12: each pull's request carries the credentials of that pull's hint, also when the same
    requester pulled before with others: two credentials in turn, then none (empty bytes)."""
    with _pulls(kvwire_harness, [(32, 3)], 679, needs.transfer) as (_, ex, bench):
        holder = ex.holder()
        ex.offer(bench)
        for row, secret in enumerate([b"kvwire-first\x00", b"kvwire-second\xff", None]):
            hint = ex.ends.fetch_hint if secret is None else with_field(ex.ends.fetch_hint, "credentials", secret)
            sub = ex.fetch(bench.sink_view({0: [row]}), hint)
            (request,) = holder.take(1)
            plain = ex.ends.fetch_hint.get("credentials", b"")  # what the harness's own hint carries (H1.12)
            want = plain if secret is None else secret
            assert request.credentials == want, (
                f"H1.12: pull {row + 1} of one requester carried credentials {want!r}; its request carries "
                f"{request.credentials!r}")
            holder.finish(holder.answer(request))
            out = ex.settle(sub)
            bench.apply_fetch(out, {0: [row]})
            assert out.is_delivered and out.masks[0].all(), f"N2: pull {row + 1} must deliver: {out!r}"


# -- A10.11: a pull from a serving end that is gone ----------------------------------------------

def test_A10_a_pull_from_a_serving_end_that_is_gone_fails_as_peer_gone(kvwire_harness: Harness) -> None:
    """A10.11: once the serving end has shut down and closed, a pull naming its address fails
    with cause ``PEER_GONE`` (the backend knows its other end is gone), or, from a backend that
    cannot tell, with ``DEADLINE`` by the hint's deadline; never as a fault the peer reported."""
    with _pulls(kvwire_harness, [(32, 2)], 683, needs.fetch) as (caps, ex, bench):
        source = ex.ends.source
        shut_down(source, profiles.active().patience_s)  # B3.5: an idle serving end comes to the empty set
        call_briefly(source.close, "B3.8: close() of the serving end")
        sub = ex.fetch(bench.sink_view(), Hint(ex.ends.fetch_hint.kind, ex.ends.fetch_hint.fields, 2.0))
        out = ex.settle(sub, purpose="A10.11: a pull from a serving end that is gone concluding")
        bench.apply_fetch(out)
        assert out.is_failed and out.cause in (Cause.PEER_GONE, Cause.DEADLINE), (
            f"A10.11: a pull from a serving end that shut down and closed must fail with cause PEER_GONE (or DEADLINE "
            f"from a backend that cannot tell it is gone), got {out!r}")
