"""S1-S5: submitting, the holder's guarantee, the two refusals, and failures after escape. One
file, long as it is, as each suite file holds one group of rules."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import cast

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import (
    LOOKUP,
    Backend,
    CacheKind,
    Cause,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Lookup,
    MemoryKind,
    SubmissionRejected,
    TokenRange,
    View,
)
from kvwire.contract.errors import SubmissionError
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import FaultPlan, Harness
from kvwire.testing.holder import (
    Submission,
    Wakes,
    call_briefly,
    check_refusal_message,
    refused,
    settle,
    speaks_causes,
    submit,
    wait_for,
)
from kvwire.testing.layout import BLOCK_TOKENS, Bench, GroupPlan, ViewPlan, simple_plan
from kvwire.testing.marks import checks
from kvwire.testing.plans import (
    check_bits,
    drain_queue,
    fill_queue,
    fillable_queue,
    paged_exchange,
    pages,
    store_only,
)
from kvwire.testing.regions import fake_region
from kvwire.testing.strategies import fault_plans, fault_schedules, selections, view_plans
from kvwire.testing.suite._kit import _schedule_or_skip

# -- queue slots ------------------------------------------------------------------------------------

@checks("S3.11", also=("S3.6", "A3.2"))
def test_S3_a_slot_frees_without_polling(kvwire_harness: Harness) -> None:
    """S3.11: once the attempts of a full queue concluded and quiesced, new submissions are taken,
    though the holder never called ``poll()`` or ``quiesced()`` on them.

    The holder waits for each attempt's wakes only, then submits again until one is taken (a
    rejected submission costs nothing, S3.6); only once its patience ran out does it ask the
    attempts, to tell a slot never freed (S3.11) from an attempt never done (A3)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=3) as ex:
        bound = ex.caps.max_in_flight
        if bound > 64:
            pytest.skip(f"backend declares a queue bound of {bound}, too large to fill here")
        if not (ex.store or ex.serves_pulls):
            pytest.skip("backend's other end is a peer without the serve-pulls protocol")
        plan = pages([(32, bound + 1)], 349, needs.shares_names(caps))
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            ex.offer(bench)
            subs = [ex.fetch(bench.sink_view({0: [row]})) for row in range(bound)]
            if ex.serves_pulls:
                holder = ex.holder()
                for request in holder.take(bound):
                    holder.finish(holder.answer(request))
            patience = profiles.active().patience_s
            deadline = time.monotonic() + patience
            for sub in subs:  # a wake from each; never poll() or quiesced()
                assert sub.wakes.wait_beyond(0, deadline), (
                    f"A3/W1: a fetch of the full queue did not wake the holder within {patience:g} s")
            taken: list[Submission] = []

            def submit_again() -> bool:
                try:
                    taken.append(ex.fetch(bench.sink_view({0: [bound]})))
                except SubmissionRejected as exc:
                    check_refusal_message(exc, "a fetch rejected for a full queue")
                    return False
                return True

            try:
                wait_for(submit_again, patience, "a new fetch being taken")
            except AssertionError:
                done = [sub.poll() is not None and sub.quiesced() for sub in subs]
                if all(done) and submit_again():
                    raise AssertionError(
                        f"A3.2: the {bound} attempts of the full queue freed no slot for {patience:g} s after they "
                        "woke the holder, and one was free at once after the holder called poll() and quiesced(): "
                        "an attempt quiesces without any call from the holder") from None
                if all(done):
                    raise AssertionError(
                        f"S3.11: all {bound} attempts of the full queue had concluded and quiesced (each had woken "
                        f"the holder), yet new fetches were rejected for {patience:g} s; a slot frees once its "
                        "attempt concluded and quiesced, whether or not the holder called poll() or quiesced()"
                    ) from None
                raise AssertionError(f"A3: {done.count(False)} of the {bound} fetches had not concluded and quiesced "
                                     f"{patience:g} s after they woke the holder") from None
            ex.serve_one()
            bench.forget_sink({0: list(range(bound))})
            for sub in subs:
                ex.settle(sub)
            bench.apply_fetch(ex.settle(taken[0]), {0: [bound]})


# -- queue slots and capabilities -----------------------------------------------------------------------

@checks("S3.6", "S3.10")
def test_S3_a_full_queue_rejection_leaks_no_slot(kvwire_harness: Harness) -> None:
    """S3.6 / S3.10: after a submission was rejected for a full queue and the queue drained, the
    queue takes its whole bound again."""
    with fillable_queue(kvwire_harness, 32, 443) as (ex, bench, bound):
        for round_ in range(2):
            try:
                subs, hold, requests = fill_queue(ex, bench, list(range(bound)))
            except SubmissionRejected as exc:
                raise AssertionError(f"S3.6: after a rejection for a full queue and a drain, the queue took fewer "
                                     f"than its bound of {bound} (round {round_ + 1}): {exc}") from exc
            try:
                if round_ == 0:
                    refused(lambda: ex.fetch(bench.sink_view({0: [bound]})),  # noqa: B023
                            f"S3.9: fetch {bound + 1} with {bound} in flight", SubmissionRejected)
            finally:
                drain_queue(ex, subs, hold, requests)
        bench.forget_sink()


@checks("S3.9", "S3.10")
def test_S3_a_slot_stays_taken_until_its_attempt_also_quiesced(kvwire_harness: Harness) -> None:
    """S3.9 / S3.10: an attempt that concluded but has not quiesced still holds its queue slot.
    A full queue of held fetches is cancelled (each concludes; those the other end still holds
    cannot quiesce); then new fetches are taken exactly while fewer than the bound are not both
    concluded and quiesced, and the next is rejected."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.cancellation(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    patience = profiles.active().patience_s
    with needs.open_exchange(kvwire_harness, max_in_flight=3, hold=True) as ex:
        bound = ex.caps.max_in_flight
        if bound > 64:
            pytest.skip(f"backend declares a queue bound of {bound}, too large to fill here")
        plan = pages([(32, 2 * bound + 1)], 487, needs.shares_names(caps))
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            ex.offer(bench)
            subs, hold, requests = fill_queue(ex, bench, list(range(bound)))
            fresh: list[Submission] = []
            try:
                if hold is not None:
                    # at least one fetch has reached the other end (held there, it cannot quiesce
                    # once cancelled), else all might be cancelled before any left the queue
                    wait_for(lambda: hold.waiting() >= 1, patience, "a held fetch at the other end")
                for sub in subs:
                    call_briefly(sub.attempt.cancel, "A4.1: cancel()", on_block=hold.release if hold else None)
                for sub in subs:
                    settle(sub, patience, quiesce=False, purpose="A4.3: cancel() concluding a held fetch")

                def in_flight() -> int:
                    """Attempts not both concluded and quiesced. Only ever falls while the other end is
                    held (A2.2), bar the fetches submitted since."""
                    return (sum(not sub.quiesced() for sub in subs)
                            + sum(not (sub.poll() is not None and sub.quiesced()) for sub in fresh))

                for row in range(bound, 2 * bound + 1):
                    before = in_flight()
                    try:
                        fresh.append(ex.fetch(bench.sink_view({0: [row]})))
                    except SubmissionRejected as exc:
                        assert before >= bound, (
                            f"S3.10: a fetch was rejected ({exc}) with {before} attempt(s) not both concluded and "
                            f"quiesced, below the declared bound of {bound}")
                        check_refusal_message(exc, "a fetch rejected for a full queue")
                        break
                    after = in_flight() - 1
                    assert after < bound, (
                        f"S3.9: a fetch was taken with {after} attempt(s) in flight besides it, and the declared "
                        f"bound is {bound}: {sum(not s.quiesced() for s in subs)} cancelled fetch(es) concluded but "
                        "have not quiesced (the other end still holds them); max_in_flight bounds the attempts "
                        "that are not both concluded and quiesced")
                else:
                    raise AssertionError(f"S3.9: {len(fresh)} new fetches were taken beside {bound} cancelled ones, "
                                         f"beyond the declared bound of {bound}")
            finally:
                if ex.serves_pulls:
                    requests += ex.holder().take(len(fresh))
                drain_queue(ex, subs + fresh, hold, requests)
            bench.forget_sink()


@checks("S5.3", also=("A5.5",))
@pytest.mark.parametrize("op", ["get", "put"])
def test_S5_a_store_call_that_raises_fails_the_attempt_with_a_fault(kvwire_harness: Harness, op: str) -> None:
    """S5.3: a store call that raises (a broken client) is a fault in the outcome: the
    attempt fails with cause FAULT and quiesces; nothing raises out of ``poll()``."""
    from kvwire.testing.faults import FailCall

    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (16, 3)], 461, False)
    schedule = (FailCall(op=op, call=None, raises=True),)  # type: ignore[arg-type]
    with needs.open_exchange(kvwire_harness, faults=FaultPlan(schedule=schedule)) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        _schedule_or_skip(ex)
        put = ex.settle(ex.publish(bench.source_view()))
        out = put
        if op == "get":
            assert put.is_delivered, f"S1: only gets fail here: {put!r}"
            out = ex.settle(ex.fetch(bench.sink_view()))
        assert out.is_failed, f"S5.3: a store call that raised must fail the attempt: {out!r}"
        assert out.rows_delivered == 0, f"A5.5: rows of a call that raised are marked moved: {out!r}"
        if op == "get":
            bench.apply_fetch(out)
        if speaks_causes(ex.ends.source):
            assert out.cause is Cause.FAULT, f"A10.9: a store call that raised gives cause FAULT: {out!r}"


# -- S3.6: a refused overlapping fetch keeps a queue slot ----------------------------------------------------

def _overlapping(bench: Bench) -> View:
    """A fetch of two rows (named apart) on one sink slot: refused for overlapping rows (V4)."""
    view = bench.sink_view({0: [0, 1]})
    g = view.groups[0]
    slots = np.array([g.slots[0], g.slots[0]], dtype=np.int64)
    return View((LayerGroupRows(g.group_id, g.kind, g.region, slots, g.tokens, g.names),))


@checks("S3.6", "V4.3", "S3.9")
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


# -- refusals leave no trace ----------------------------------------------------------------------

def _stray_group(harness: Harness, kind: MemoryKind, template: LayerGroupRows, gid: int) -> tuple[LayerGroupRows, Bench]:
    """A group in memory no backend registered, shaped like ``template``."""
    plan = pages([(template.region.slot_bytes, template.rows)], 263, False)
    stray = Bench(harness, None, None, plan, kind)
    view = stray.sink_view()
    g = view.groups[0]
    names = template.names
    return LayerGroupRows(gid, CacheKind.PAGED, g.region, g.slots, g.tokens, names), stray


@checks("S3.3", also=("S3.7",))
def test_S3_each_refusal_is_raised_by_the_call_with_a_message(kvwire_harness: Harness) -> None:
    """S3.3: a fetch or publish the contract refuses (rows not registered, an unusable hint; after
    ``shutdown()``, any) raises from the call itself, before anything escapes: a
    ``SubmissionError`` (``InvalidSubmission`` or ``SubmissionRejected``) whose message says
    something beyond its type's name, never an attempt that fails later. Nothing was in flight
    after the refusals, their wakes never came (S3.7) and no row was touched."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3)], 2239, needs.shares_names(caps))
    unusable = Hint.of("kvwire_conformance_unusable")
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        stray = Bench(kvwire_harness, None, None, plan, kind)
        ops = [op for op in ("publish", "fetch") if getattr(caps, op)]

        def case(op: str, what: str, stray_rows: bool, hint: Hint | None) -> tuple[str, str, Backend, View, Hint]:
            side = stray if stray_rows else bench
            view = side.source_view() if op == "publish" else side.sink_view()
            backend = ex.ends.source if op == "publish" else ex.ends.sink
            default = ex.ends.publish_hint if op == "publish" else ex.ends.fetch_hint
            return op, what, backend, view, default if hint is None else hint

        before = [case(op, "rows not registered", True, None) for op in ops]
        before += [case(op, "an unusable hint", False, unusable) for op in ops]
        after = [case(op, "a valid view, after shutdown()", False, None) for op in ops]
        wakes: list[tuple[str, Wakes]] = []

        def refuse(op: str, what: str, backend: Backend, view: View, hint: Hint,
                   error: type[SubmissionError]) -> None:
            wake = Wakes()
            call = backend.publish if op == "publish" else backend.fetch
            try:
                got = call(view, hint, wake)
            except SubmissionError as exc:
                assert isinstance(exc, error), (
                    f"S3.3: a {op} with {what} raised {type(exc).__name__}; the contract refuses it with "
                    f"{error.__name__}")
                check_refusal_message(exc, f"S3.3: a {op} with {what}")
                message = str(exc).strip()
                assert message.lower() not in {type(exc).__name__.lower(), error.__name__.lower()}, (
                    f"S3.3: a {op} with {what} raised {type(exc).__name__} whose message is only {message!r}; a "
                    "refusal's message says what was wrong and what to do")
            except Exception as exc:
                raise AssertionError(f"S3.3/S4.1: a {op} with {what} raised {type(exc).__name__}: {exc}; the contract "
                                     f"refuses it with {error.__name__}, a SubmissionError") from exc
            else:
                raise AssertionError(
                    f"S3.3: a {op} with {what} returned {got!r}; the contract refuses it with {error.__name__}, raised "
                    "by the call itself before anything escapes (never an attempt that fails later)")
            wakes.append((f"{op} with {what}", wake))

        for op, what, backend, view, hint in before:
            refuse(op, what, backend, view, hint, InvalidSubmission)
        bench.verify("S3.3: after refused submissions")
        stray.verify("S3.3: after refused submissions")
        for backend in ex.ends.backends:
            pending = call_briefly(backend.shutdown, "B3: shutdown()", limit_s=profiles.active().patience_s)
            assert not pending, (
                f"S3.3: only refused submissions were made, yet shutdown() returns {len(pending)} attempt(s): something "
                "escaped")
        for op, what, backend, view, hint in after:
            refuse(op, what, backend, view, hint, SubmissionRejected)
        bench.verify("S3.3: after submissions rejected after shutdown()")
        for what, wake in wakes:
            assert wake.count == 0, f"S3.7: the wake of a refused {what} was called {wake.count} time(s)"
        stray.close()


@checks("S3.4", "S3.6")
def test_S3_a_refused_view_leaves_no_trace_of_its_valid_groups(kvwire_harness: Harness) -> None:
    """S3.4-S3.6: a view refused for its last group (rows nobody registered, or no names where names
    are required) told the other end nothing about its first groups: nothing stored, nothing
    written, no pull sent."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (32, 3)], 269, needs.shares_names(caps))
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


@checks("S3.7")
def test_S3_a_refused_submission_never_wakes(kvwire_harness: Harness) -> None:
    """S3.7: after ``InvalidSubmission`` or ``SubmissionRejected`` the backend never calls that
    submission's wake, however much work follows."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3)], 271, needs.shares_names(caps))
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


# -- S4.1 / H1.5: a hint that is no Hint -------------------------------------------------------------


def _not_hints(hint: Hint) -> dict[str, object]:
    """Values a holder might pass where a ``Hint`` belongs: none, the hint's bytes, its fields."""
    fields: dict[str, object] = dict(hint.fields)
    fields["kind"] = hint.kind
    return {"None": None, "the hint's bytes": hint.to_bytes(), "a dict of the hint's fields": fields}


@checks("S4.1", "S3.2", "H1.5", "L1.9")
def test_S4_a_hint_that_is_no_Hint_is_refused(kvwire_harness: Harness) -> None:
    """S4.1 / S3.2 / H1.5 (and L1.9 for a lookup): a fetch, a publish or a lookup whose hint is not
    a ``Hint`` (``None``, the hint's bytes, a dict of its fields) raises ``InvalidSubmission``,
    never ``AttributeError`` or another exception; memory is untouched, no pull reaches a serving
    end, and nothing is left in flight."""
    with paged_exchange(kvwire_harness, [(64, 2)], 821) as (caps, ex, bench):
        if ex.serves_pulls:
            ex.holder()  # serving, so a pull that escaped would show in incoming()
        cases: list[tuple[str, Callable[[], object]]] = []
        if caps.fetch:
            cases += [(f"a fetch whose hint is {what}", functools.partial(submit, ex.ends.sink, "fetch", bench.sink_view(),
                                                                          cast(Hint, value)))
                      for what, value in _not_hints(ex.ends.fetch_hint).items()]
        if caps.publish:
            cases += [(f"a publish whose hint is {what}", functools.partial(submit, ex.ends.source, "publish",
                                                                            bench.source_view(), cast(Hint, value)))
                      for what, value in _not_hints(ex.ends.publish_hint).items()]
        sink = ex.ends.sink
        if LOOKUP in caps.protocols and isinstance(sink, Lookup):
            names = bench.names[0]
            cases += [(f"a lookup whose hint is {what}", functools.partial(sink.lookup, [0], names, cast(Hint, value)))
                      for what, value in _not_hints(ex.ends.fetch_hint).items()]
        for what, call in cases:
            refused(call, f"S4.1/H1.5: {what}")
        bench.verify("S3.5: after submissions refused for a hint that is no Hint")
        if ex.serves_pulls:
            assert not ex.holder().serving.incoming(), (
                "S3.4: a pull refused for a hint that is no Hint reached the serving end")
        for backend in ex.ends.backends:
            pending = call_briefly(backend.shutdown, "B3: shutdown() after refused submissions only")
            assert not pending, (
                f"S3/S4.1: only refused submissions were made, yet shutdown() returns {len(pending)} attempt(s)")


UNUSABLE = Hint.of("kvwire_conformance_unusable")


def _check_masks(ex: Exchange, bench: Bench, offer, take, fetched) -> None:  # type: ignore[no-untyped-def]
    expected = ex.expected(bench, offer, take)
    for gi, mask, want in zip(bench.groups_in(take), fetched.masks, expected, strict=True):
        gid = bench.plan.groups[gi].group_id
        skipped = np.flatnonzero(want & ~mask)
        assert skipped.size == 0, (
            f"A5: row(s) {skipped.tolist()} of group {gid} are held by the other end but their bits are false in a "
            f"{fetched!r}; a backend never skips rows")
        extra = np.flatnonzero(mask & ~want)
        assert extra.size == 0, (
            f"A5/A7: row(s) {extra.tolist()} of group {gid} are not held by the other end, yet marked delivered")


# -- S1 ----------------------------------------------------------------------------------------

@checks("S1.1", "S1.2", "S1.3", "S1.4")
def test_S1_publish_then_fetch_moves_exactly_what_is_held(kvwire_harness: Harness) -> None:
    """Offer some rows, fetch some rows: every fetched row the other end holds arrives with its
    bit set and its bytes equal; every other row is a miss; both attempts deliver."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    p = profiles.active()
    subsets = not needs.shares_names(caps)

    @profiles.examples()
    @given(plan=view_plans(max_groups=p.max_groups, max_rows=p.max_rows, shared_names=not subsets), data=st.data())
    def run(plan: ViewPlan, data: st.DataObject) -> None:
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                              kind) as bench:
            offer = data.draw(selections(plan), label="offered rows") if subsets and ex.store else None
            take = data.draw(selections(plan), label="fetched rows") if subsets and ex.store else None
            result = ex.transfer(bench, offer, take)
            if result.published is not None:
                assert result.published.is_delivered and all(m.all() for m in result.published.masks), (
                    f"A5: a publish to a store with room to spare must hold every row: {result.published!r}")
            assert result.fetched.is_delivered, f"A5: misses are no failure; the fetch gave {result.fetched!r}"
            _check_masks(ex, bench, offer, take, result.fetched)

    run()


#: Group ids the same names are published and fetched under (S1.4): 300, 300 kept in 8 bits, and
#: two ids that are 300 once kept in 16 or 32 bits.
GROUP_IDS = (300, 300 % 256, 300 + (1 << 16), 300 + (1 << 32))


@checks("S1.4", "S1.3", "V1.2", also=("S1.2",))
def test_S1_a_store_finds_rows_only_under_the_group_id_they_were_published_with(kvwire_harness: Harness) -> None:
    """S1.4 / S1.3 / V1.2: a group id is any int >= 0: rows published under group 300 are found by
    a fetch of group 300, and a fetch of the same names under group 44 (300 kept in 8 bits), 65836
    or 2**32 + 300 (each 300 once kept in 16 or 32 bits) finds none of them."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.misses(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = ViewPlan(tuple(GroupPlan(gid, CacheKind.PAGED, 32, 3, (1, 2, 3), (3, 2, 1), 5) for gid in GROUP_IDS), 631,
                    shared_names=True)  # the same names in every group
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        store_only(ex, "finding rows by group and name")
        published = ex.offer(bench, {0: [0, 1, 2]})
        assert published is not None and published.is_delivered and published.masks[0].all(), (
            f"S1.2: a publish of three rows under group {GROUP_IDS[0]}: {published!r}")
        for gi, gid in enumerate(GROUP_IDS):
            take = {gi: [0, 1, 2]}
            fetched = ex.settle(ex.fetch(bench.sink_view(take)))
            held = gi == 0
            assert fetched.is_delivered and fetched.masks[0].tolist() == [held] * 3, (
                f"S1.3/S1.4: rows were published under group {GROUP_IDS[0]} only; a fetch of their names under group "
                f"{gid} gave {fetched!r}; a store finds a row only under the group and name it was published with")
            bench.apply_fetch(fetched, take)


# -- S2 ----------------------------------------------------------------------------------------

@checks("S1.3", "A5.6")
def test_S1_every_row_of_a_long_run_of_publishes_is_found(kvwire_harness: Harness) -> None:
    """S1.3 / A5.6: a store finds every row a publish marked held, however many publishes came
    before it on the instance: eight publishes one after another (one of three rows, then ones of
    one row), then one fetch of every row, which delivers exactly the rows marked held."""
    with paged_exchange(kvwire_harness, [(48, 10)], 467, needs.transfer) as (_, ex, bench):
        store_only(ex, "finding what a publish marked held")
        batches = [[0, 1, 2], *([row] for row in range(3, 10))]
        held: list[int] = []
        for rows in batches:
            published = ex.offer(bench, {0: rows})
            assert published is not None and published.is_delivered, f"S1.2: a publish of rows {rows}: {published!r}"
            held += [row for row, bit in zip(rows, published.masks[0].tolist(), strict=True) if bit]
        fetched = ex.fetch_settled(bench.sink_view())
        bench.apply_fetch(fetched)
        check_bits(ex, bench, {0: held}, None, fetched, "S1.3")


@checks("S2.4", "S2.5")
def test_S2_backend_touches_only_the_rows_given(kvwire_harness: Harness) -> None:
    """Around the fetched rows lie slots of the same regions and guard bytes; none changes, and
    a publish never writes the rows it reads."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    p = profiles.active()
    subsets = not needs.shares_names(caps)

    @profiles.examples()
    @given(plan=view_plans(max_groups=p.max_groups, max_rows=p.max_rows, min_rows=1, shared_names=not subsets),
           data=st.data())
    def run(plan: ViewPlan, data: st.DataObject) -> None:
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                              kind) as bench:
            take = data.draw(selections(plan, min_size=1), label="fetched rows") if subsets else None
            ex.transfer(bench, None, take)
            bench.verify("after a transfer of some rows")

    run()


# -- S3 ----------------------------------------------------------------------------------------

@checks("S3.1", "S3.4")
def test_S3_rejected_after_shutdown_and_nothing_escaped(kvwire_harness: Harness) -> None:
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=41, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        if caps.publish:
            assert not ex.ends.source.shutdown(), "B3: shutdown() with nothing in flight has nothing to wait for"
            refused(lambda: ex.publish(bench.source_view()), "S3/B3: a publish after shutdown()", SubmissionRejected)
        if caps.fetch:
            if ex.ends.sink is not ex.ends.source and caps.publish and ex.store:
                fetched = ex.settle(ex.fetch(bench.sink_view()))
                bench.apply_fetch(fetched)
                assert fetched.rows_delivered == 0, "S3: a publish rejected after shutdown reached the store"
            ex.ends.sink.shutdown()
            refused(lambda: ex.fetch(bench.sink_view()), "S3/B3: a fetch after shutdown()", SubmissionRejected)
        bench.verify("after rejected submissions")


#: The most submissions the suite holds in flight at once: a declared bound above it is filled
#: this far (S3.10), not beyond.
FILL_LIMIT = 256


@checks("S3.9", "S3.10", "S3.4", also=("S3.1",))
def test_S3_full_queue_rejected_and_nothing_escaped(kvwire_harness: Harness) -> None:
    """S3.9 / S3.10 / S3.4: with the other end held, ``max_in_flight`` submissions are taken and
    the next is rejected; the rejected one never reaches the other end, and once the queue
    drains a submission is taken again. A bound too large to fill is filled as far as the suite
    goes, and nothing below it may be refused."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=3, hold=True) as ex:
        bound = ex.caps.max_in_flight
        if not (ex.store or ex.serves_pulls):
            pytest.skip("backend's other end is a peer without the serve-pulls protocol; the suite cannot hold it")
        if bound > FILL_LIMIT:
            _below_a_large_bound(ex, kvwire_harness, kind, bound)
        elif ex.store:
            _fill_a_store(ex, kvwire_harness, kind, bound)
        else:
            _fill_with_pulls(ex, kvwire_harness, kind, bound)


def _taken(what: str, row: int, bound: int, submit, on_fail) -> Submission:  # type: ignore[no-untyped-def]
    try:
        return submit()  # type: ignore[no-any-return]
    except SubmissionError as exc:
        on_fail()
        raise AssertionError(f"S3.10: {what} {row + 1} was refused ({type(exc).__name__}: {exc}) with {row} in "
                             f"flight, though the backend declares a queue bound of {bound}; below the bound no "
                             "valid submission is refused for capacity") from exc


def _below_a_large_bound(ex: Exchange, harness: Harness, kind: MemoryKind, bound: int) -> None:
    """S3.10 for a bound too large to fill: hold the other end and submit :data:`FILL_LIMIT`
    one-row fetches; none may be refused. Then let them all finish."""
    count = FILL_LIMIT
    plan = simple_plan(groups=1, rows=count, slot_bytes=8, seed=44, spare=0, shared_names=ex.serves_pulls)
    with Bench(harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        ex.offer(bench)
        hold = ex.ends.hold() if ex.store else None  # type: ignore[misc]
        release = hold.release if hold is not None else (lambda: None)
        subs: list[Submission] = []
        try:
            for row in range(count):
                subs.append(_taken("fetch", row, bound, functools.partial(ex.fetch, bench.sink_view({0: [row]})),
                                   release))
        finally:
            release()
            if ex.serves_pulls:
                holder = ex.holder()
                requests = holder.take(len(subs))
                for request in requests:
                    holder.answer(request)
                for answer in holder.answers:
                    holder.finish(answer)
            for sub in subs:
                ex.settle(sub)
        bench.forget_sink()


def _fill_a_store(ex: Exchange, harness: Harness, kind: MemoryKind, bound: int) -> None:
    plan = simple_plan(groups=1, rows=bound + 1, seed=43)
    with Bench(harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        assert ex.ends.hold is not None
        hold = ex.ends.hold()
        accepted = [_taken("publish", row, bound, functools.partial(ex.publish, bench.source_view({0: [row]})),
                           hold.release) for row in range(bound)]
        refused(lambda: ex.publish(bench.source_view({0: [bound]})),
                f"S3: publish {bound + 1} with {bound} in flight (declared bound {bound})", SubmissionRejected)
        hold.release()
        for sub in accepted:
            ex.settle(sub)
        # A submission that escaped despite the refusal runs behind the ones taken: let the
        # store finish whatever it was asked, so the fetch below sees it if it landed.
        hold.wait_idle(harness.quiesce_grace_s)
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(fetched)
        assert fetched.masks[0][:bound].all(), f"S1: the publishes taken did not all arrive: {fetched!r}"
        assert not fetched.masks[0][bound], "S3: the publish rejected for a full queue reached the store"
        try:
            again = ex.settle(ex.publish(bench.source_view({0: [bound]})))
        except SubmissionRejected as exc:
            raise AssertionError(f"S3.1: after the queue drained, the publish rejected for a full queue was rejected "
                                 f"again ({exc}); a rejection means 'not now', and the same submission succeeds later"
                                 ) from None
        assert again.is_delivered, f"S3: after the queue drained, a publish must be taken and delivered: {again!r}"


def _fill_with_pulls(ex: Exchange, harness: Harness, kind: MemoryKind, bound: int) -> None:
    plan = simple_plan(groups=1, rows=bound + 1, seed=43, shared_names=True)
    with Bench(harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        holder = ex.holder()
        ex.offer(bench)
        pulls = [_taken("pull", row, bound, functools.partial(ex.fetch, bench.sink_view({0: [row]})), lambda: None)
                 for row in range(bound)]
        requests = holder.take(bound)  # held: the suite answers none yet
        refused(lambda: ex.fetch(bench.sink_view({0: [bound]})),
                f"S3: pull {bound + 1} with {bound} in flight (declared bound {bound})", SubmissionRejected)
        for request in requests:
            holder.finish(holder.answer(request))
        bench.forget_sink({0: list(range(bound))})  # each pull's row is checked as it is applied
        for row, sub in enumerate(pulls):
            out = ex.settle(sub)
            bench.apply_fetch(out, {0: [row]})
            assert out.is_delivered and out.masks[0].all(), f"S1: a pull taken did not deliver: {out!r}"
        assert not holder.serving.incoming(), "S3: the pull rejected for a full queue reached the serving end"
        try:
            again = ex.fetch_settled(bench.sink_view({0: [bound]}))
        except SubmissionRejected as exc:
            raise AssertionError(f"S3.1: after the queue drained, the pull rejected for a full queue was rejected "
                                 f"again ({exc}); a rejection means 'not now', and the same submission succeeds later"
                                 ) from None
        assert again.is_delivered, f"S3: after the queue drained, a pull must be taken and delivered: {again!r}"


@checks("S3.6")
def test_S3_refusals_consume_no_capacity(kvwire_harness: Harness) -> None:
    """Many more refused submissions than the queue holds leave the queue as it was."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=2, seed=47, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, max_in_flight=2) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        bound = min(ex.caps.max_in_flight, 1024)
        for _ in range(2 * bound + 1):
            if caps.publish:
                refused(lambda: ex.publish(bench.source_view(), UNUSABLE), "H1: a publish with an unusable hint")
            if caps.fetch:
                refused(lambda: ex.fetch(bench.sink_view(), UNUSABLE), "H1: a fetch with an unusable hint")
        if caps.fetch and caps.publish:
            try:
                ex.transfer(bench)
            except SubmissionRejected as exc:
                raise AssertionError(f"S3: refused submissions consumed queue capacity: {exc}") from exc


@checks("S3.5")
def test_S3_a_fetch_rejected_for_a_full_queue_leaves_its_rows_alone(kvwire_harness: Harness) -> None:
    """S3.5: a fetch rejected because ``max_in_flight`` attempts are in flight wrote nothing: its
    rows hold what the holder left there, before and after the queue drained."""
    with fillable_queue(kvwire_harness, 48, 607) as (ex, bench, bound):
        spare = {0: [bound]}
        subs, hold, requests = fill_queue(ex, bench, list(range(bound)))
        try:
            refused(lambda: ex.fetch(bench.sink_view(spare)), f"S3.9: fetch {bound + 1} with {bound} in flight",
                    SubmissionRejected)
            _rows_unchanged(bench, bound, "right after the rejection")
        finally:
            drain_queue(ex, subs, hold, requests)
        _rows_unchanged(bench, bound, "once the queue drained")
        bench.forget_sink({0: list(range(bound))})
        bench.verify("after the queue drained")


@checks("S3.9", also=("S3.10",))
def test_S3_one_queue_bound_counts_fetches_and_publishes_together(kvwire_harness: Harness) -> None:
    """S3.9: ``max_in_flight`` bounds the attempts in flight on an instance, fetches and publishes
    together: with one held fetch and held publishes filling the declared bound on one instance, a
    further publish and a further fetch on it are each rejected; all those taken deliver once the
    store lets go."""
    with fillable_queue(kvwire_harness, 48, 641) as (ex, bench, bound):
        store_only(ex, "a queue of publishes and fetches together")
        assert ex.ends.hold is not None
        # Both directions on the publishing instance: its fetches go into the source rows, which
        # hold the bytes the store has for them (every row was offered), so nothing changes there.
        one = ex.ends.source

        def fetch(row: int) -> Submission:
            return submit(one, "fetch", bench.source_view({0: [row]}), ex.ends.fetch_hint)

        hold = ex.ends.hold()
        subs: list[Submission] = []
        try:
            subs.append(fetch(0))
            subs += [ex.publish(bench.source_view({0: [row]})) for row in range(1, bound)]
            mix = f"1 fetch and {bound - 1} publish(es) in flight on the instance; declared bound {bound}"
            refused(lambda: ex.publish(bench.source_view({0: [bound]})), f"S3.9: a publish with {mix}",
                    SubmissionRejected)
            refused(lambda: fetch(bound), f"S3.9: a fetch with {mix}", SubmissionRejected)
        finally:
            hold.release()
        outs = [ex.settle(sub) for sub in subs]
        assert all(out.is_delivered and out.masks[0].all() for out in outs), (
            f"S3.10: attempts taken below the bound must deliver once the store lets go: {outs!r}")
        bench.verify("S3.5: after a fetch rejected for a full queue")


def _rows_unchanged(bench: Bench, row: int, when: str) -> None:
    slot = bench.sink.slots[0][[row]]
    actual = bench.sink.memories[0].read(slot)
    assert np.array_equal(actual, bench.sink.model[0][slot]), (
        f"S3.5: the row of a fetch rejected for a full queue changed ({when}); after SubmissionRejected no memory "
        "of the view was read or written")


@checks("S3.7", "S3.5", "V4.3")
def test_S3_a_fetch_refused_for_overlapping_rows_never_wakes(kvwire_harness: Harness) -> None:
    """S3.7 / S3.5 / V4.3: the wake passed with a fetch refused for overlapping rows is never
    called, however much work follows, and its rows are untouched."""
    with paged_exchange(kvwire_harness, [(64, 3), (64, 3)], 613, needs.fetch) as (caps, ex, bench):
        view = bench.sink_view()
        g0, g1 = view.groups
        within = LayerGroupRows(g0.group_id, g0.kind, g0.region, np.append(g0.slots, g0.slots[0]),
                                TokenRange(0, BLOCK_TOKENS * (g0.rows + 1)),
                                None if g0.names is None else np.vstack([g0.names, g0.names[[0]]]))
        across = LayerGroupRows(g1.group_id + 1, CacheKind.PAGED, g0.region, g0.slots[[1]], TokenRange(0, BLOCK_TOKENS),
                                None if g0.names is None else g0.names[[1]])
        cases = {"two rows of one group on one slot": View((within, g1)),
                 "rows of two groups on one slot": View((g0, g1, across))}
        refusals = [(what, _refused_wakes(ex, bad, f"V4.3: a fetch with {what}")) for what, bad in cases.items()]
        bench.verify("S3.5: after fetches refused for overlapping rows")
        if caps.publish:
            first = {gi: [0, 1, 2] for gi in range(len(bench.plan.groups))}
            ex.transfer(bench, first, first)
            again = {gi: [2, 0] for gi in range(len(bench.plan.groups))}
            ex.transfer(bench, again, again)
        for backend in ex.ends.backends:
            assert not backend.shutdown(), "B3: nothing was in flight"
        for what, wakes in refusals:
            assert wakes.count == 0, f"S3.7: the wake of a fetch refused for {what} was called {wakes.count} time(s)"


def _refused_wakes(ex: Exchange, view: View, what: str) -> Wakes:
    """Submit ``view`` as a fetch with a wake of its own; fail unless ``InvalidSubmission``."""
    wakes = Wakes()
    refused(functools.partial(ex.ends.sink.fetch, view, ex.ends.fetch_hint, wakes), what)
    return wakes


# -- S4 ----------------------------------------------------------------------------------------

@checks("S4.1")
def test_S4_wrong_submissions_raise_only_the_contract_refusals(kvwire_harness: Harness) -> None:
    """Rows it does not recognize, overlapping fetch rows, an unusable hint, memory of an
    undeclared kind: each raises ``InvalidSubmission`` (never another exception, which would
    make the holder keep the lease), and afterwards nothing is in flight."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=53, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex:
        bench = Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind)
        stray = Bench(kvwire_harness, None, None, plan, kind)
        cases: list[tuple[str, str, View, Hint | None]] = [
            ("publish", "unregistered rows", stray.source_view(), None),
            ("fetch", "unregistered rows", stray.sink_view(), None),
            ("publish", "an unusable hint", bench.source_view(), UNUSABLE),
            ("fetch", "an unusable hint", bench.sink_view(), UNUSABLE),
        ]
        group = bench.sink_view().groups[0]
        doubled = LayerGroupRows(group.group_id, CacheKind.PAGED, group.region, np.append(group.slots, group.slots[0]),
                                 group.tokens, None if group.names is None else np.vstack([group.names,
                                                                                          group.names[:1]]))
        cases.append(("fetch", "overlapping rows", View((doubled,)), None))
        for missing in (k for k in MemoryKind if k not in caps.memory_kinds):
            region = fake_region(missing)
            names = np.arange(2 * 16, dtype=np.uint8).reshape(2, 16)
            view = View((LayerGroupRows(0, CacheKind.PAGED, region, np.arange(2), group.tokens, names),))
            cases += [("publish", f"{missing.value} memory", view, None), ("fetch", f"{missing.value} memory", view, None)]
        for op, what, view, hint in cases:
            if not getattr(caps, op):
                continue
            call = ex.publish if op == "publish" else ex.fetch
            refused(functools.partial(call, view, hint), f"S4: a {op} with {what}")
        bench.verify("after refused submissions")
        stray.verify("after refused submissions")
        for backend in ex.ends.backends:
            pending = backend.shutdown()
            assert not pending, f"S3/S4: only refused submissions were made, yet shutdown() returns {len(pending)} attempts"
        bench.close()


# -- S5 ----------------------------------------------------------------------------------------

@checks("S5.1", "S5.2")
def test_S5_faults_at_the_other_end_arrive_in_the_outcome(kvwire_harness: Harness) -> None:
    """Objects that fault at the other end make the attempt fail with a reason, in its outcome
    (never an exception); the masks say exactly which rows moved."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.misses(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    p = profiles.active()

    @profiles.examples()
    @given(plan=view_plans(max_groups=2, max_rows=p.max_rows, min_rows=1, kinds=(CacheKind.PAGED,),
                           shared_names=needs.shares_names(caps)), data=st.data())
    def run(plan: ViewPlan, data: st.DataObject) -> None:
        probe = Bench(kvwire_harness, None, None, plan, kind)
        names = sorted({n.tobytes() for g in probe.names for n in g})
        faults = data.draw(fault_plans(names), label="faults")
        with needs.open_exchange(kvwire_harness, faults=faults) as ex:
            if not ex.store:
                return
            bench = Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind)
            bad_put = [np.array([n.tobytes() in faults.publish for n in g], dtype=bool) for g in bench.names]
            bad_get = [np.array([n.tobytes() in faults.fetch for n in g], dtype=bool) for g in bench.names]
            published = ex.settle(ex.publish(bench.source_view()))
            if any(b.any() for b in bad_put):
                assert published.is_failed, f"A5/S5: publishing objects the store fails must fail, got {published!r}"
                if speaks_causes(ex.ends.source):
                    assert published.cause is Cause.FAULT, f"A10: a fault at the store gives cause FAULT: {published!r}"
            else:
                assert published.is_delivered, f"A5: no fault was injected into this publish: {published!r}"
            for g, mask, bad in zip(plan.groups, published.masks, bad_put, strict=True):
                assert not (mask & bad).any(), f"A5: group {g.group_id}: rows the store failed are marked held"
                # A5.12 bounds a failed outcome's true bits from above only: a backend may not know
                # which rows the store took before the fault, and mark none of them.
                if published.is_delivered:
                    assert (mask | bad).all(), f"A5.6: group {g.group_id}: rows the store took are not marked held"
            fetched = ex.settle(ex.fetch(bench.sink_view()))
            bench.apply_fetch(fetched)
            if any(b.any() for b in bad_get):
                assert fetched.is_failed, f"A5/S5: fetching objects the store fails must fail, not miss: {fetched!r}"
                if speaks_causes(ex.ends.sink):
                    assert fetched.cause is Cause.FAULT, f"A10: a fault at the store gives cause FAULT: {fetched!r}"
            else:
                assert fetched.is_delivered, f"A5: no fetch fault was injected; misses are no failure: {fetched!r}"
            for g, mask, bget, bput, put in zip(plan.groups, fetched.masks, bad_get, bad_put, published.masks,
                                                strict=True):
                movable = ~bget & ~bput
                # Rows the publish marked held are held (S1.3); a failed publish may have stored more
                # rows than it marked (A5.12 bounds its true bits from above only), or fewer than it
                # was given. So a delivered fetch marks at least the held rows it does not fault
                # (A5.10) and a fetch never marks a row it faulted or no one stored (A5.9, S1.4); a
                # failed fetch's true bits are only rows that moved whole (A5.12).
                held = put & ~bget
                if fetched.is_delivered and published.is_delivered:
                    exact = np.array_equal(mask, movable)
                elif fetched.is_delivered:
                    exact = not (held & ~mask).any() and not (mask & ~movable).any()
                else:
                    exact = not (mask & ~movable).any()
                assert exact, (
                    f"A5: group {g.group_id}: the fetch marked {mask.astype(int).tolist()}; the rows held and not "
                    f"faulted are {movable.astype(int).tolist()}, of which the publish marked "
                    f"{held.astype(int).tolist()} held")
            bench.close()

    run()


@checks("S5.1", "S5.2", "S5.3")
def test_S5_store_fault_schedules_never_raise(kvwire_harness: Harness) -> None:
    """Under drawn store fault schedules (failed calls and keys, declines, evictions, slow
    calls), submissions return attempts, polls return outcomes, every attempt concludes and
    quiesces, and every true bit is true."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    p = profiles.active()

    @profiles.examples()
    @given(plan=view_plans(max_groups=2, max_rows=p.max_rows, min_rows=1), schedule=fault_schedules())
    def run(plan: ViewPlan, schedule: tuple[object, ...]) -> None:
        with needs.open_exchange(kvwire_harness, faults=FaultPlan(schedule=schedule)) as ex, Bench(
                kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            published = ex.settle(ex.publish(bench.source_view()))
            fetched = ex.settle(ex.fetch(bench.sink_view()))
            bench.apply_fetch(fetched)
            if published.is_failed or fetched.is_failed:
                return
            # Nothing failed: what the publish says the store holds, the fetch must find, unless
            # an eviction removed it behind the backend's back.
            from kvwire.testing.faults import Evict

            if not any(isinstance(f, Evict) for f in schedule):
                for g, put, got in zip(plan.groups, published.masks, fetched.masks, strict=True):
                    assert (got | ~put).all(), (
                        f"A5: group {g.group_id}: rows the publish marked held were not fetched: {fetched!r}")

    if not needs.shares_names(caps):
        run()
    else:
        pytest.skip("backend's other end is a peer; store fault schedules apply to stores")


@checks("S4.1", "S3.2")
def test_S4_a_view_that_is_not_a_View_is_refused(kvwire_harness: Harness) -> None:
    """S4.1 / S3.2: a submission whose view is no ``View`` (its groups as a bare tuple, or one
    ``LayerGroupRows`` alone) is a malformed view: ``InvalidSubmission``, never another exception;
    memory untouched, nothing in flight."""
    with paged_exchange(kvwire_harness, [(64, 2), (32, 2)], 647) as (caps, ex, bench):
        for op, view in (("publish", bench.source_view()), ("fetch", bench.sink_view())):
            if not getattr(caps, op):
                continue
            call = ex.publish if op == "publish" else ex.fetch
            for what, bad in (("a tuple of groups", view.groups), ("one LayerGroupRows", view.groups[0])):
                refused(functools.partial(call, bad), f"S4.1: a {op} whose view is {what}")  # type: ignore[arg-type]
        bench.verify("S3.5: after submissions refused for a malformed view")
        for backend in ex.ends.backends:
            pending = backend.shutdown()
            assert not pending, f"S4.1: only refused submissions were made, yet shutdown() returns {len(pending)} attempts"
