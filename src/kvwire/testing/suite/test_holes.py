"""Holes that single-rule breakers written outside the project found (issue 39), one test per
mechanism, each beside the clause it checks: an answer crossing a cancel on the wire (N2.13), a
serving end busy with waiting pulls (N2.4), an answer stopped between its offer and its last row
(A5.10), polls that block briefly (A1.1, A2.1), an attempt that says it quiesced before it ran
(A2.3), a queue slot kept by a refused overlapping fetch (S3.6), a hint whose only content is its
deadline (H1.6), work taken while ``shutdown()`` drains (B3.1), regions of other slot sizes over
the same bytes (M3.4, M3.5) and a store that is really full (A5.11).

The answers held on the wire use :attr:`Ends.hold <kvwire.testing.harness.Ends.hold>` of a
serving peer, the busy serving end :attr:`Ends.another_sink` and ``extra["pending_pulls"]``, the
full store :attr:`Ends.fill`; each test skips, naming the hook, where a harness has none."""

from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest

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
from kvwire.contract.backend import Backend
from kvwire.contract.lookup import LOOKUP, Lookup
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Harness, Hold, Unavailable, shut_down
from kvwire.testing.holder import (
    Submission,
    call_briefly,
    declares,
    refused,
    settle,
    speaks_causes,
    submit,
    wait_for,
)
from kvwire.testing.layout import Bench, GroupPlan, ViewPlan
from kvwire.testing.plans import drain_queue, fill_queue, fillable_queue, paged_exchange, pages, store_only
from kvwire.testing.regions import next_region_id

#: What the holder writes over rows it may reuse (an attempt said it quiesced).
SENTINEL = 0x5A


def _patience() -> float:
    return profiles.active().patience_s


def _held_answer(ex: Exchange, bench: Bench, what: str):  # type: ignore[no-untyped-def]
    """Hold the serving end's answers, pull every block of the bench (offered here), and answer
    the pull with the held prefix: the hold, the pull and the answer, once the answer is on the
    wire (published, not yet at the requester). Skips when the harness cannot hold it there."""
    if ex.ends.hold is None:
        pytest.skip("harness cannot hold the serving end's answers on the wire (Ends.hold)")
    ex.offer(bench)
    holder = ex.holder()
    sub = ex.fetch(bench.sink_view())
    (request,) = holder.take(1)
    hold = ex.ends.hold()
    answer = holder.answer(request)
    assert answer.publish is not None
    wait_for(lambda: hold.waiting() > 0 or sub.wakes.count > 0, _patience(),
             f"A3: {what}: the serving end's answer reaching the wire")
    if hold.waiting() == 0:
        hold.release()
        holder.finish(answer)
        ex.settle(sub)
        pytest.skip("the harness's hold did not hold the serving end's answer on the wire")
    return hold, sub, answer


# -- N2.13: an answer that crosses the requester's cancel --------------------------------------------------

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
        bench.write_sink(None, SENTINEL)  # the holder reuses the rows the moment the fetch quiesced
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


# -- N2.4: a serving end busy with pulls waiting for its holder ---------------------------------------------

def _requesters(ex: Exchange, harness: Harness, plan, kind: MemoryKind, count: int) -> list[tuple[Backend, Bench]]:  # type: ignore[no-untyped-def]
    """``count`` requesters of the serving end, each with its own sink memory of ``plan``."""
    out: list[tuple[Backend, Bench]] = []
    for i in range(count):
        backend = ex.ends.sink if i == 0 else ex.ends.make_another_sink()
        out.append((backend, Bench(harness, None, backend, plan, kind)))
    return out


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


# -- A5.10: an answer stopped between its offer and its last row ---------------------------------------------

def test_A5_an_answer_stopped_before_its_last_row_is_no_shorter_prefix(kvwire_harness: Harness) -> None:
    """A5.10 / A5.9 / A4.3 / A2.4: the serving holder answers a pull with every block it holds, and
    cancels the answer while it is on the wire: the answer concludes ``CANCELLED`` (not by the
    peer) and quiesces; the holder then overwrites the served rows. The requester's fetch either
    delivers every block (the serving end held them all throughout) with the bytes they had
    before the overwrite, or does not deliver: a stopped answer is never passed off as a shorter
    prefix, and no true bit holds bytes read after the answer quiesced."""
    with paged_exchange(kvwire_harness, [(64, 4), (32, 4)], 3905, needs.serve_pulls, needs.transfer,
                        needs.cancellation, shared=True) as (_, ex, bench):
        hold, sub, answer = _held_answer(ex, bench, "an answer stopped half-way")
        with hold:
            call_briefly(answer.publish.attempt.cancel, "A4.1: cancel() of an answer on the wire")
            stopped = settle(answer.publish, _patience(), quiesce=False,
                             purpose="A4.3: an answer its holder cancelled on the wire concluding")
            assert stopped.is_cancelled and not stopped.by_peer, (
                f"A4.3: an answer its holder cancelled concludes CANCELLED, not by the peer; got {stopped!r}")
            settle(answer.publish, _patience() + kvwire_harness.quiesce_grace_s,
                   purpose="A4.5: the cancelled answer quiescing while held on the wire")
            bench.write_source(None, SENTINEL)  # the serving holder reuses its rows the moment they quiesced
        out = ex.settle(sub)
        ex.holder().finish(answer)
        if out.is_delivered:
            short = [int(m.sum()) for m in out.masks if not m.all()]
            assert not short, (
                f"A5.10: the serving end held all {bench.plan.groups[0].rows} blocks throughout, and its answer was "
                f"stopped on the wire; the fetch delivered with only {short} of them: a stopped answer passed off as a "
                "shorter prefix (deliver them all, or fail)")
        try:
            bench.apply_fetch(out)
        except AssertionError as exc:
            raise AssertionError(f"A2.4/A7.1: a row of the stopped answer holds bytes the serving holder wrote after the "
                                 f"answer quiesced: {exc}") from None


# -- A1.1 / A2.1: a poll that blocks briefly ---------------------------------------------------------------

#: Calls in one burst; together they must return within the suite's blocking limit.
BURST = 200


def test_A1_A2_a_burst_of_polls_of_a_held_attempt_returns_at_once(kvwire_harness: Harness) -> None:
    """A1.1 / A2.1: ``poll()`` and ``quiesced()`` never block, not even briefly: 200 of each on a
    fetch its other end holds (and on a publish a store holds) return within the suite's blocking
    limit together, as a holder polling many attempts each step needs."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 3907, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        held: list[tuple[Submission, Hold]] = []
        try:
            held.append(ex.held_fetch(bench))
        except Unavailable as exc:
            pytest.skip(f"harness cannot provide it: {exc}")
        if ex.store:
            held[0][1].release()
            ex.settle(held[0][0])
            bench.forget_sink()
            held = [ex.held_fetch(bench), ex.held_publish(bench)]
        try:
            for sub, _ in held:
                for what, call in (("poll()", sub.poll), ("quiesced()", sub.quiesced)):
                    call_briefly(lambda call=call: [call() for _ in range(BURST)],  # type: ignore[misc]
                                 f"A1.1/A2.1: {BURST} calls of {what} of a held {sub.op}",
                                 on_block=held[0][1].release)
                assert sub.outcome is None or ex.serves_pulls, f"the held {sub.op} concluded: {sub.outcome!r}"
        finally:
            for _, hold in held:
                hold.release()
        for sub, _ in held:
            ex.settle(sub)
        for sub, _ in held:
            if sub.op == "fetch":
                bench.apply_fetch(sub.outcome)  # type: ignore[arg-type]


# -- A2.3: an attempt waiting behind others says it quiesced ------------------------------------------------

def test_A2_an_attempt_waiting_behind_others_has_not_quiesced(kvwire_harness: Harness) -> None:
    """A2.3 / A2.5: with the other end held, fetches submitted one after another wait behind the
    first; one that says ``quiesced()`` before it concluded promises that nothing will write its
    rows again, so the holder reuses them at once: once everything was let go and settled, such a
    row still holds what the holder wrote (a fetch that says it quiesced before it ran, and runs
    afterwards, breaks it)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=4, hold=True) as ex:
        count = min(ex.caps.max_in_flight, 4)
        if count < 2:
            pytest.skip("backend declares a queue bound of 1: nothing waits behind another attempt")
        if not (ex.store and ex.ends.hold is not None or ex.serves_pulls):
            pytest.skip("the suite cannot hold this backend's other end")
        plan = pages([(64, count)], 3909, needs.shares_names(caps))
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            ex.offer(bench)
            subs, hold, requests = fill_queue(ex, bench, list(range(count)))
            reused: list[int] = []
            try:
                for row, sub in enumerate(subs):
                    if sub.poll() is None and sub.quiesced():
                        bench.write_sink({0: [row]}, SENTINEL)
                        reused.append(row)
            finally:
                drain_queue(ex, subs, hold, requests)
            bench.forget_sink({0: [row for row in range(count) if row not in reused]})
            for row, sub in enumerate(subs):
                if row in reused:
                    got = bench.sink.memories[0].read(bench.sink.slots[0][[row]])
                    assert (got == SENTINEL).all(), (
                        f"A2.3: fetch {row + 1} of {count} said quiesced() before it concluded, while it waited behind "
                        "the others; the holder reused its row, and the backend wrote it afterwards")
                    bench.forget_sink({0: [row]})
                else:
                    bench.apply_fetch(sub.outcome, {0: [row]})  # type: ignore[arg-type]
            bench.verify("after fetches that waited behind others")


# -- S3.6: a refused overlapping fetch keeps a queue slot ----------------------------------------------------

def _overlapping(bench: Bench) -> View:
    """A fetch of two rows (named apart) on one sink slot: refused for overlapping rows (V4)."""
    view = bench.sink_view({0: [0, 1]})
    g = view.groups[0]
    slots = np.array([g.slots[0], g.slots[0]], dtype=np.int64)
    return View((LayerGroupRows(g.group_id, g.kind, g.region, slots, g.tokens, g.names),))


def test_S3_refused_overlapping_fetches_keep_no_queue_slot(kvwire_harness: Harness) -> None:
    """S3.6 / V4.3 / S3.9: 2 x bound + 1 fetches refused for overlapping rows take no queue slot:
    afterwards the declared bound of held fetches is taken, and one more is rejected; all deliver
    once let go."""
    with fillable_queue(kvwire_harness, 48, 3911) as (ex, bench, bound):
        for tried in range(2 * bound + 1):
            try:
                refused(lambda: ex.fetch(_overlapping(bench)), "V4.3: a fetch of two rows on one slot")
            except AssertionError as exc:
                if SubmissionRejected.__name__ not in str(exc):
                    raise
                raise AssertionError(f"S3.6: fetch {tried + 1} of overlapping rows, with nothing in flight, was rejected "
                                     f"as over the queue bound: the {tried} refused before it kept queue slots "
                                     f"({exc})") from None
        bench.verify("S3.5: after fetches refused for overlapping rows")
        try:
            subs, hold, requests = fill_queue(ex, bench, list(range(bound)))
        except SubmissionRejected as exc:
            raise AssertionError(f"S3.6: after {2 * bound + 1} fetches refused for overlapping rows, the queue no "
                                 f"longer takes its declared bound of {bound}: {exc}; a refusal takes no queue "
                                 "slot") from None
        try:
            refused(lambda: ex.fetch(bench.sink_view({0: [bound]})), f"S3.9: fetch {bound + 1} with {bound} in flight",
                    SubmissionRejected)
        finally:
            drain_queue(ex, subs, hold, requests)
        bench.forget_sink({0: list(range(bound))})  # each fetch wrote its row; each is checked below
        for row, sub in enumerate(subs):
            bench.apply_fetch(sub.outcome, {0: [row]})  # type: ignore[arg-type]


# -- H1.6: a hint whose only content is its deadline ---------------------------------------------------------

@pytest.mark.parametrize("op", ["fetch", "publish"])
def test_H1_A8_a_hint_with_only_a_deadline_keeps_it(kvwire_harness: Harness, op: str) -> None:
    """H1.6 / A8.4 / A8.2: a store hint with no field at all, only ``timeout_s`` (0.4 s, the
    options' deadline far longer), sets the deadline as any hint's does: the held attempt fails
    by it (cause ``DEADLINE``), not by the options' deadline."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 3913, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        store_only(ex, "a hint with no field (a store hint's fields are optional, H1.7)")
        bare = Hint(ex.ends.fetch_hint.kind, (), 0.4)
        try:
            sub, hold = ex.held_fetch(bench, bare) if op == "fetch" else ex.held_publish(bench, bare)
        except Unavailable as exc:
            pytest.skip(f"harness cannot provide it: {exc}")
        with hold:
            out = settle(sub, 0.4 + _patience(), quiesce=False,
                         purpose=f"H1.6: a held {op} whose hint has only timeout_s=0.4 failing by that deadline")
            assert out.is_failed, f"A8.2: a held {op} must fail by its hint's deadline, got {out!r}"
            if speaks_causes(sub.backend):
                assert out.cause is Cause.DEADLINE, f"A10.7: a deadline failure has cause DEADLINE: {out!r}"
        ex.settle(sub)
        bench.forget_sink()


# -- B3.1: a submission while shutdown() drains ------------------------------------------------------------

def test_B3_nothing_is_taken_while_shutdown_drains(kvwire_harness: Harness) -> None:
    """B3.1 / S3.1 / M3.10: with a fetch held at the other end, ``shutdown()`` of the fetching end
    may return it as not yet quiesced; from the first call on, a fetch (and a publish, a
    registration from contract 1.1, and a lookup where declared, L1.10) raises
    ``SubmissionRejected`` and nothing escapes, also while that shutdown still drains."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 3915, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        try:
            sub, hold = ex.held_fetch(bench)
        except Unavailable as exc:
            pytest.skip(f"harness cannot provide it: {exc}")
        sink = ex.ends.sink
        try:
            pending = sink.shutdown()
            draining = bool(pending)
            when = "while shutdown() still drains a fetch held at the other end" if draining else "after shutdown()"
            refused(lambda: ex.fetch(bench.sink_view({0: [1]})), f"B3.1: a fetch {when}", SubmissionRejected)
            if caps.publish:
                refused(lambda: submit(sink, "publish", bench.sink_view({0: [1]}), ex.ends.publish_hint),
                        f"B3.1: a publish {when}", SubmissionRejected)
            if LOOKUP in caps.protocols and isinstance(sink, Lookup):
                names = bench.names[0][:1]
                refused(lambda: sink.lookup([bench.plan.groups[0].group_id], names, ex.ends.fetch_hint),
                        f"L1.10: a lookup {when}", SubmissionRejected)
            if declares(sink, "M3.10"):
                memory = kvwire_harness.allocate(kind, 64, 2)
                refused(functools.partial(sink.register_regions, [memory.region]), f"M3.10: a registration {when}",
                        SubmissionRejected)
        finally:
            hold.release()
        out = settle(sub, _patience() + kvwire_harness.quiesce_grace_s)
        shut_down(sink, _patience() + kvwire_harness.quiesce_grace_s)
        bench.apply_fetch(out)


# -- M3.4 / M3.5: regions of other slot sizes over the same bytes -------------------------------------------

def _span(memory_region: SlotRegion, offset: int, slot_bytes: int, count: int) -> SlotRegion:
    r = memory_region
    return SlotRegion(next_region_id(), r.base + offset, slot_bytes, count, r.memory_kind, r.device)


def test_M3_regions_of_other_slot_sizes_overlap_by_their_bytes(kvwire_harness: Harness) -> None:
    """M3.5 / M3.4 / M3.2: overlap is judged by the bytes regions span, whatever their slot
    sizes: a region of 16-byte slots inside a registered region of 64-byte slots, or sharing its
    last 16 bytes, is refused, and so is a batch of two such regions; regions of other slot sizes
    that only touch are taken, in one batch and in two."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    memory = kvwire_harness.allocate(kind, 64, 16)  # 1024 bytes
    whole = memory.region
    with needs.open_exchange(kvwire_harness) as ex:
        backend = ex.ends.sink
        first = _span(whole, 0, 64, 8)  # bytes [0, 512)
        with backend.register_regions([first]):
            for what, region in (("inside it", _span(whole, 200, 16, 4)),
                                 ("sharing its last 16 bytes", _span(whole, 496, 16, 4)),
                                 ("covering it whole", _span(whole, 0, 512, 2))):
                refused(functools.partial(backend.register_regions, [region]),
                        f"M3.5: registering a region of {region.slot_bytes}-byte slots {what} (a registered region of "
                        "64-byte slots)")
            touching = _span(whole, 512, 16, 32)  # bytes [512, 1024)
            try:
                backend.register_regions([touching]).close()
            except InvalidSubmission as exc:
                raise AssertionError(f"M3.5: a region of 16-byte slots that only touches a registered region of 64-byte "
                                     f"slots was refused: {exc}") from None
        refused(functools.partial(backend.register_regions, [_span(whole, 0, 64, 8), _span(whole, 480, 32, 4)]),
                "M3.4: registering a batch of a 64-byte-slot region and a 32-byte-slot one sharing its last 32 bytes")
        try:
            backend.register_regions([_span(whole, 0, 64, 8), _span(whole, 512, 32, 16)]).close()
        except InvalidSubmission as exc:
            raise AssertionError(f"M3.4: a batch of two regions of other slot sizes that only touch was refused: "
                                 f"{exc}") from None


# -- A5.11: a store that is really full ------------------------------------------------------------------

def test_A5_a_publish_to_a_full_store_delivers_with_false_bits(kvwire_harness: Harness) -> None:
    """A5.11 / A5.8 / S1.3: with the store really full (the harness filled it, ``Ends.fill``), a
    publish of rows it already holds and rows it has no room for delivers, without a cause: the
    rows it held are true, a row it did not take is a false bit, never a failure; a fetch finds
    exactly the rows marked held. Once the store has room again, a publish delivers and what it
    marks held is found."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.names(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 6)], 3917, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        store_only(ex, "a full store")
        if ex.ends.fill is None:
            pytest.skip("harness cannot fill its store (Ends.fill)")
        early = {0: [0, 1]}
        first = ex.settle(ex.publish(bench.source_view(early)))
        assert first.is_delivered and first.masks[0].all(), f"S1.2: a publish to a store with room: {first!r}"
        try:
            free = ex.ends.fill(plan.groups[0].slot_bytes)
        except Unavailable as exc:
            pytest.skip(f"harness cannot provide it: {exc}")
        try:
            full = ex.settle(ex.publish(bench.source_view()))
            assert full.is_delivered, (
                f"A5.11: a publish to a full store delivers, the rows it has no room for false bits; it is not a "
                f"failure (a full store is no fault): got {full!r}")
            assert full.masks[0][:2].all(), (
                f"A5.11: rows the full store already held count as held; got {full.masks[0].astype(int).tolist()}")
            fetched = ex.settle(ex.fetch(bench.sink_view()))
            bench.apply_fetch(fetched)
            assert fetched.is_delivered, f"A5.8: a fetch from a full store, its misses no failure: {fetched!r}"
            assert np.array_equal(fetched.masks[0], full.masks[0]), (
                f"S1.3/A5.6: with the store full, the fetch found rows {fetched.masks[0].astype(int).tolist()}, the "
                f"publish marked held {full.masks[0].astype(int).tolist()}")
        finally:
            free()
        later = ex.settle(ex.publish(bench.source_view()))
        assert later.is_delivered, f"A5.11: a publish once the store has room again: {later!r}"
        bench.forget_sink()
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(fetched)
        assert (fetched.masks[0] >= later.masks[0]).all(), (
            f"S1.3: rows a publish marked held once the store had room were not found: publish "
            f"{later.masks[0].astype(int).tolist()}, fetch {fetched.masks[0].astype(int).tolist()}")


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


# -- found by mutation testing of the shipped backends (issue 39) ---------------------------------------------

def test_M4_a_region_reaching_past_its_registration_is_checked_row_by_row(kvwire_harness: Harness) -> None:
    """M4.1 / M4.4 / M4.2: a view's region may describe more memory than is registered, as long as
    its rows lie inside a registration: a fetch of rows inside is taken; the same region object
    then naming a row outside the registration is refused with ``InvalidSubmission`` and that row
    is not touched (a backend that remembers the region as recognized after the first view lets
    the second read or write memory nobody registered)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 3921, needs.shares_names(caps), spare=0)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, None, plan, kind) as bench:
        memory = kvwire_harness.allocate(kind, 64, 8)
        whole = memory.region
        registered = SlotRegion(next_region_id(), whole.base, 64, 4, whole.memory_kind, whole.device)
        wide = SlotRegion(next_region_id(), whole.base, 64, 8, whole.memory_kind, whole.device)  # reaches past it
        names = bench.names[0]
        with ex.ends.sink.register_regions([registered]):
            ex.offer(bench)
            inside = View((LayerGroupRows(0, CacheKind.PAGED, wide, np.array([0, 1]), TokenRange(0, 32), names),))
            out = ex.fetch_settled(inside)
            assert out.is_delivered, f"M4.2: rows inside a registration, described by a wider region: {out!r}"
            memory.fill([5, 6], SENTINEL)
            outside = View((LayerGroupRows(0, CacheKind.PAGED, wide, np.array([5, 6]), TokenRange(0, 32), names),))
            refused(lambda: ex.fetch(outside), "M4.4: a fetch whose rows lie past the registration of their region's "
                    "memory (the same region object that earlier named rows inside it)")
            got = memory.read([5, 6])
            assert (got == SENTINEL).all(), "S3.5/M4.4: a refused fetch of rows outside any registration wrote them"


def test_A9_rows_of_two_sizes_published_apart_arrive_in_adjacent_slots(kvwire_harness: Harness) -> None:
    """A9.2 / A7.1 / A9.4: four 64 KiB rows of one group and four 32 KiB rows of another, each
    published on its own in reverse order (so the store holds them apart), fetched in one view
    whose rows follow each other in memory (the two groups' regions are the two touching halves
    of one allocation): every row arrives with its own bytes (a copy that merges rows adjacent at
    one end only moves the wrong bytes), and nothing around them changes."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.names(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    if kind is not MemoryKind.HOST:
        pytest.skip("the test lays rows out in HOST memory")
    big, small, rows = 64 << 10, 32 << 10, 4
    rng = np.random.default_rng(3923)
    with needs.open_exchange(kvwire_harness) as ex:
        store_only(ex, "rows a store holds apart")
        source = [kvwire_harness.allocate(kind, size, rows) for size in (big, small)]
        data = [rng.integers(0, 256, (rows, size), dtype=np.uint8) for size in (big, small)]
        for memory, rows_data in zip(source, data, strict=True):
            memory.write(np.arange(rows), rows_data)
        names = [rng.integers(0, 256, (rows, 16), dtype=np.uint8) for _ in range(2)]
        sink = kvwire_harness.allocate(kind, big, rows * 2)  # both halves: rows * (big + small) fit
        whole = sink.region
        halves = (SlotRegion(next_region_id(), whole.base, big, rows, whole.memory_kind, whole.device),
                  SlotRegion(next_region_id(), whole.base + rows * big, small, rows, whole.memory_kind, whole.device))
        sink.fill(np.arange(rows * 2), SENTINEL)
        with ex.ends.source.register_regions([m.region for m in source]), \
                ex.ends.sink.register_regions([whole]):
            for row in reversed(range(rows)):
                for gi in (1, 0):
                    view = View((LayerGroupRows(gi, CacheKind.PAGED, source[gi].region, np.array([row]),
                                                TokenRange(0, 16), names[gi][[row]]),))
                    out = ex.settle(ex.publish(view))
                    assert out.is_delivered and out.masks[0].all(), f"S1.2: publish of group {gi} row {row}: {out!r}"
            view = View(tuple(LayerGroupRows(gi, CacheKind.PAGED, halves[gi], np.arange(rows), TokenRange(0, 16 * rows),
                                             names[gi]) for gi in (0, 1)))
            fetched = ex.settle(ex.fetch(view))
            assert fetched.is_delivered and all(m.all() for m in fetched.masks), (
                f"S1.3: rows published apart, fetched in one view: {fetched!r}")
        raw = sink.read(np.arange(rows * 2)).reshape(-1)
        for gi, size in ((0, big), (1, small)):
            offset = 0 if gi == 0 else rows * big
            got = raw[offset:offset + rows * size].reshape(rows, size)
            wrong = np.flatnonzero((got != data[gi]).any(axis=1))
            assert wrong.size == 0, (
                f"A7.1/A9.2: group {gi} row(s) {wrong.tolist()} are marked delivered but hold other bytes than were "
                "published (rows that follow each other in the fetch's memory, held apart by the store)")
        rest = raw[rows * (big + small):]
        assert (rest == SENTINEL).all(), "S2.4: the fetch wrote past its rows"
        assert sink.guards_intact(), "S2.4: the fetch wrote outside its region"


# -- O1 under load: many pulls of one offer in flight at once ------------------------------------------------

def test_O1_many_pulls_in_flight_at_once_are_answered_from_one_offer(kvwire_harness: Harness) -> None:
    """O1.4 / O1.12 / O1.10: three requesters each fill their queue bound with pulls of blocks one
    standing offer covers, all in flight at once: every pull delivers with the offered bytes (those
    beyond a bound the backend keeps on answers from offers reach the holder whole, who answers
    them), the offer's wake is not called, and the offer stands on."""
    caps = kvwire_harness.capabilities()
    needs.offer_pulls(caps)
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=4) as ex:
        bound = min(ex.caps.max_in_flight, 4)
        plan = pages([(64, 4), (32, 4)], 3925, True)
        try:
            requesters = _requesters(ex, kvwire_harness, plan, kind, 3)
        except Unavailable as exc:
            pytest.skip(f"harness cannot provide it: {exc}")
        with Bench(kvwire_harness, ex.ends.source, None, plan, kind) as served:
            offered = ex.stand(served)
            holder = ex.holder()
            serve_wakes = holder.wakes.count
            subs = []
            for backend, bench in requesters:
                bench.forget_sink()
                for i in range(bound):
                    rows = [i % 4, (i + 1) % 4]
                    subs.append((submit(backend, "fetch", bench.sink_view({0: rows, 1: rows}), ex.ends.fetch_hint),
                                 bench, rows))
            # A backend may bound the answers from offers in flight (O1.12): a pull beyond it goes to the
            # holder whole, who answers it from the reuse tree.
            seen, handed = serve_wakes, 0
            while True:
                wait_for(lambda seen=seen: all(sub.attempt.poll() is not None for sub, _, _ in subs)  # type: ignore[misc]
                         or holder.wakes.count > seen,
                         _patience(), "O1.4: pulls of offered blocks, many in flight, concluding")
                if holder.wakes.count == seen:
                    break
                seen = holder.wakes.count
                for request in holder.incoming():
                    assert holder.tree.held_prefix(request) == request.blocks, "O1.5: a pull reached the holder in part"
                    holder.finish(holder.answer(request))
                    handed += 1
            busy_ok = isinstance(ex.ends.extra.get("pending_pulls"), int)
            delivered = 0
            for sub, bench, rows in subs:
                out = settle(sub, _patience(), purpose="O1.4: a pull of offered blocks, one of many in flight")
                if busy_ok and out.is_failed and out.cause in (None, Cause.DECLINED):
                    pass  # beyond the pulls the serving end keeps waiting for its holder (N2.4)
                else:
                    assert out.is_delivered and all(m.all() for m in out.masks), (
                        f"O1.4: {len(subs)} pulls of blocks one standing offer covers were in flight at once ({handed} "
                        f"handed to the holder, O1.12); one gave {out!r}")
                    delivered += 1
                bench.apply_fetch(out, {0: rows, 1: rows})
                bench.forget_sink()  # the next pull of these rows writes them again
            assert delivered >= bound, f"O1.4: only {delivered} of {len(subs)} pulls an offer covers delivered"
            assert offered.offer.poll() is None, f"O1.9: the offer concluded under load: {offered.offer.poll()!r}"
            assert offered.offer.wakes.count == 0, "O1.10: answering pulls from an offer called the offer's wake"
            call_briefly(offered.offer.attempt.cancel, "A4.1: cancel() of an offer")
            holder.withdraw(offered)
        for _, bench in requesters:
            bench.close()
