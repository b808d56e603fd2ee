"""Clauses at their edges: each test here closes a gap that a planted single-clause mutant of the
reference backends, or mutation testing of the reference store, showed the rest of the suite
left open (``docs/conformance.md`` lists them). Each test names its clause of
``docs/contract.md`` in its docstring's first line. One file of ~570 lines because each test
stands for one mutant the rest missed, and they share the hold-and-fill helpers below."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvwire.contract import CacheKind, Cause, Hint, SubmissionRejected
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import FaultPlan, Harness, Hold
from kvwire.testing.holder import (
    Submission,
    call_briefly,
    check_refusal_message,
    refused,
    settle,
    speaks_causes,
    wait_for,
)
from kvwire.testing.layout import Bench, GroupPlan, ViewPlan
from kvwire.testing.plans import drain_queue, fill_queue, fillable_queue, pages, with_field
from kvwire.testing.serving import PullHold

SENTINEL = 0x3C
MiB = 1 << 20


def _spin_until_quiesced(sub: Submission, what: str) -> None:
    """Ask ``quiesced()`` as often as it takes (a holder may), to act the moment it turns true."""
    deadline = time.monotonic() + profiles.active().patience_s
    while not sub.quiesced():
        assert time.monotonic() < deadline, f"A2.5: {what} did not quiesce within the suite's patience"
        time.sleep(0)


# -- A2 / W1 at a held attempt's end ----------------------------------------------------------------

@pytest.mark.parametrize("ending", ["cancel", "deadline"])
def test_A2_an_attempt_ended_while_held_touches_nothing_once_quiesced(kvwire_harness: Harness, ending: str) -> None:
    """A2.3 / A2.2: a fetch cancelled, or failed by its deadline, while the other end holds it says
    it quiesced only once nothing will write its rows again; an attempt that quiesced earlier
    stays quiesced while later ones are held."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    if ending == "cancel":
        needs.cancellation(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(4096, 4), (64, 4)], 401, needs.shares_names(caps))
    patience = profiles.active().patience_s
    timeout = 0.5 if ending == "deadline" else needs.LONG_TIMEOUT_S
    with needs.open_exchange(kvwire_harness, hold=True, timeout_s=timeout) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        sub, hold = ex.held_fetch(bench)
        if ending == "cancel":
            call_briefly(sub.attempt.cancel, "A4: cancel()", on_block=hold.release)
        try:
            out = settle(sub, patience + timeout, quiesce=False,
                         purpose=f"A4/A8: the {ending} must conclude an attempt the other end holds")
        except AssertionError:
            hold.release()
            raise
        early = sub.quiesced()
        if early:
            bench.write_sink(None, SENTINEL)  # taken at its word while the other end still holds the call
        hold.release()
        ex.settle(sub, purpose=f"W1.3: the quiescence after the {ending} wakes the holder")
        if not early:
            bench.write_sink(None, SENTINEL)
        assert isinstance(hold, Hold) and hold.wait_idle(patience), "the other end did not go idle after release"
        # More work through the same backends: a writer of the ended fetch still running lands now.
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, pages([(4096, 4), (64, 4)], 402, plan.shared_names),
                   kind) as later:
            ex.transfer(later)
        bench.verify(f"A2.3: the fetch ended by its {ending} had said it quiesced, and the holder reused its rows")
        assert not out.is_delivered, f"A4/A8: the {ending} of a held fetch must not deliver: {out!r}"


def test_A2_quiesced_stays_true_while_other_attempts_are_held(kvwire_harness: Harness) -> None:
    """A2.2: once an attempt quiesced, ``quiesced()`` answers true whatever the backend does
    later, a held attempt included."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4)], 409, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        ex.offer(bench)
        done = ex.fetch(bench.sink_view({0: [0, 1]}))
        ex.serve_one()
        ex.settle(done)
        bench.forget_sink({0: [0, 1]})
        sub, hold = ex.held_fetch(bench)
        try:
            for _ in range(3):
                assert call_briefly(done.attempt.quiesced, "A2.1: quiesced()") is True, (
                    "A2.2: an attempt that had quiesced answers quiesced() False while another attempt is held")
        finally:
            hold.release()
        ex.settle(sub)
        bench.forget_sink()


def test_W1_a_quiescence_after_the_conclusion_is_woken(kvwire_harness: Harness) -> None:
    """W1.3: a fetch cancelled while the other end holds it concludes at once; its quiescence, which
    comes only when the other end lets go, is followed by a wake of its own."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.cancellation(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3)], 419, needs.shares_names(caps))
    patience = profiles.active().patience_s
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        sub, hold = ex.held_fetch(bench)
        before = sub.wakes.count
        call_briefly(sub.attempt.cancel, "A4: cancel()", on_block=hold.release)
        try:
            settle(sub, patience, quiesce=False, purpose="A4.4: cancel() concluding the held fetch")
            # The conclusion's own wake (W1.2) may trail the outcome: count from after it.
            assert sub.wakes.wait_beyond(before, time.monotonic() + patience), (
                "W1.2: the cancelled fetch concluded without a wake")
        except AssertionError:
            hold.release()
            raise
        quiet = sub.quiesced()
        seen = sub.wakes.count
        hold.release()
        ex.settle(sub, purpose="W1.3: the quiescence after the conclusion")
        if not quiet:
            assert sub.wakes.count > seen, "W1.3: the fetch quiesced after its conclusion without a wake"
        bench.forget_sink()


# -- A2 at the serving end -----------------------------------------------------------------------------

def test_A2_a_serving_answer_reads_nothing_once_quiesced(kvwire_harness: Harness) -> None:
    """A2.4 at the serving end: the moment an answer says it quiesced, the serving holder overwrites
    the rows it served; the requester still gets the bytes as they were.

    The suite cannot hold a serving end's copy, so a backend that says quiesced before it copied
    is caught only if the overwrite reaches a row before the copy does. To make that near
    certain: the rows are overwritten last row first (a copy in row order meets the overwrite
    instead of staying ahead of it), and the whole exchange runs three times."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(MiB, 6), (4096, 6)], 421, True)
    for trial, value in enumerate((SENTINEL, SENTINEL ^ 0xFF, SENTINEL ^ 0x55)):
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                              plan, kind) as bench:
            ex.offer(bench)
            sub = ex.fetch(bench.sink_view())
            holder = ex.holder()
            (request,) = holder.take(1)
            answer = holder.answer(request)
            assert answer.publish is not None
            _spin_until_quiesced(answer.publish, "the answer")
            for gi, rows in reversed(list(enumerate(bench.rows_of(None)))):
                for row in rows[::-1]:
                    bench.write_source({gi: [int(row)]}, value)
            holder.finish(answer)
            out = ex.settle(sub)
            # A7: every true bit holds the bytes as they were before the overwrite
            bench.apply_fetch(out)
            assert out.is_delivered and all(m.all() for m in out.masks), f"S1 (trial {trial}): {out!r}"


def test_A2_a_publish_reads_nothing_the_moment_it_quiesced(kvwire_harness: Harness) -> None:
    """A2.4: the moment a publish of large rows says it quiesced, the holder overwrites them; the
    other end still holds them as they were offered."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(MiB, 6), (4096, 6)], 431, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        if not ex.store:
            pytest.skip("backend's other end is a peer; a serving answer is checked by its own test")
        sub = ex.publish(bench.source_view())
        _spin_until_quiesced(sub, "the publish")
        bench.write_source(None, SENTINEL)
        ex.settle(sub)
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(fetched)
        assert all(m.all() for m in fetched.masks), f"S1: {fetched!r}"


# -- namespaces, credentials ----------------------------------------------------------------------------

def test_H1_rows_of_the_default_namespace_are_not_found_under_another(kvwire_harness: Harness) -> None:
    """H1.10: rows published with a store hint that names no namespace (the backend's configured
    one) are not found by a fetch naming another namespace."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4)], 433, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        if not ex.store:
            pytest.skip("backend's other end is a peer; a store namespace is a store's clause")
        default = Hint.of(ex.ends.publish_hint.kind, timeout_s=ex.ends.publish_hint.timeout_s,
                          **{k: v for k, v in ex.ends.publish_hint.fields if k != "namespace"})
        put = ex.settle(ex.publish(bench.source_view(), default))
        assert put.is_delivered and all(m.all() for m in put.masks), f"S1: {put!r}"
        other = with_field(ex.ends.fetch_hint, "namespace", "kvwire-suite/elsewhere")
        out = ex.settle(ex.fetch(bench.sink_view(), other))
        bench.apply_fetch(out)
        assert out.is_delivered and out.rows_delivered == 0, (
            f"H1.10: rows of the default namespace were found under namespace 'kvwire-suite/elsewhere': {out!r}")


def test_H1_a_pull_carries_the_requesters_credentials(kvwire_harness: Harness) -> None:
    """H1.12: the ``credentials`` bytes of the requester's hint reach the serving end unread, in
    ``PullRequest.credentials``."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 439, True)
    secret = bytes(range(7, 40)) + b"\x00kvwire"
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        ex.offer(bench)
        sub = ex.fetch(bench.sink_view(), with_field(ex.ends.fetch_hint, "credentials", secret))
        holder = ex.holder()
        (request,) = holder.take(1)
        assert request.credentials == secret, (
            f"H1.12: the requester's credentials {secret!r} arrived as {request.credentials!r}")
        holder.finish(holder.answer(request))
        bench.apply_fetch(ex.settle(sub))


# -- queue slots and capabilities -----------------------------------------------------------------------

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


def test_A8_a_held_attempt_concludes_at_its_deadline_not_later(kvwire_harness: Harness) -> None:
    """A8.2: a fetch the other end never answers concludes by its deadline, not a good while
    after it: with a deadline of 2 s, within 1.5 times the deadline after the submission call (the
    other A8 tests leave a fixed slack, which a deadline kept at twice its length fits)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    deadline_s = 2.0
    limit_s = 1.5 * deadline_s
    patience = profiles.active().patience_s
    plan = pages([(64, 2)], 491, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        hint = Hint(ex.ends.fetch_hint.kind, ex.ends.fetch_hint.fields, deadline_s)
        ex.offer(bench)
        hold: Hold
        if ex.store:
            assert ex.ends.hold is not None
            hold = ex.ends.hold()
            started = time.monotonic()
            sub = ex.fetch(bench.sink_view(), hint)
        else:
            holder = ex.holder()
            started = time.monotonic()
            sub = ex.fetch(bench.sink_view(), hint)
            (request,) = holder.take(1)
            hold = PullHold(holder, request)
        try:
            out = settle(sub, limit_s + patience, quiesce=False, purpose="A8.2: a held fetch concluding")
            took = time.monotonic() - started
        finally:
            hold.release()
        assert took <= limit_s, (
            f"A8.2: a fetch with a deadline of {deadline_s:g} s (from the hint) that the other end never answered "
            f"concluded {took:.2f} s after its submission; by the deadline it has concluded, and it does not "
            "conclude later")
        # Its cause (A10.7) is test_A8_a_held_attempt_fails_by_its_deadline's to check; this test is
        # about when, not why.
        assert out.is_failed, f"A8.2: a fetch the other end never answered must fail by its deadline, got {out!r}"
        settle(sub, kvwire_harness.quiesce_grace_s + patience)
        assert hold.wait_idle(patience)
        bench.forget_sink()
        bench.apply_fetch(out)


def test_B4_capabilities_do_not_change_with_work_in_flight(kvwire_harness: Harness) -> None:
    """B4.2: ``capabilities()`` answers the same with attempts in flight as when idle."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=3, hold=True) as ex:
        if not (ex.store and ex.ends.hold is not None or ex.serves_pulls):
            pytest.skip("the suite cannot hold this backend's other end")
        idle = [b.capabilities() for b in ex.ends.backends]
        plan = pages([(32, 2)], 449, needs.shares_names(caps))
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            ex.offer(bench)
            subs, hold, requests = fill_queue(ex, bench, [0, 1][: ex.caps.max_in_flight])
            try:
                busy = [b.capabilities() for b in ex.ends.backends]
            finally:
                drain_queue(ex, subs, hold, requests)
            assert busy == idle, f"B4.2: capabilities() changed with attempts in flight: {idle} -> {busy}"
            bench.forget_sink()


# -- faults --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["last group", "every group"])
def test_A5_a_fault_in_any_group_fails_the_fetch(kvwire_harness: Harness, where: str) -> None:
    """A5.9: a fault at the other end for a row of any group, not only the first, fails the fetch;
    that row is false and never passes as a miss."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)
    plan = pages([(64, 4), (32, 4), (16, 4)], 457, shared)
    probe = Bench(kvwire_harness, None, None, plan, kind)
    last = len(plan.groups) - 1
    faulty = {probe.names[last][2].tobytes()} if where == "last group" else {
        probe.names[gi][1].tobytes() for gi in range(len(plan.groups))}
    probe.close()
    with needs.open_exchange(kvwire_harness, faults=FaultPlan(fetch=frozenset(faulty))) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        if not ex.store:
            pytest.skip("backend's other end is a peer; the harness injects faults at a store")
        ex.offer(bench)
        out = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(out)
        assert out.is_failed, f"A5.9: a fault at the other end in the {where} must fail the fetch: {out!r}"
        if speaks_causes(ex.ends.sink):
            assert out.cause is Cause.FAULT, f"A10.9: a fault at the other end gives cause FAULT: {out!r}"
        for gi, mask in enumerate(out.masks):
            for row in range(plan.groups[gi].rows):
                if bench.names[gi][row].tobytes() in faulty:
                    assert not mask[row], f"A5.9: group {gi} row {row} faulted, yet is marked delivered"


def _schedule_or_skip(ex: Exchange) -> None:
    if not ex.store:
        pytest.skip("backend's other end is a peer; store fault schedules apply to stores")


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
            bench.apply_fetch(out)
        assert out.is_failed, f"S5.3: a store call that raised must fail the attempt: {out!r}"
        assert out.rows_delivered == 0, f"A5.5: rows of a call that raised are marked moved: {out!r}"
        if speaks_causes(ex.ends.source):
            assert out.cause is Cause.FAULT, f"A10.9: a store call that raised gives cause FAULT: {out!r}"


def test_A5_rows_declined_for_space_are_false_bits_in_a_delivered_publish(kvwire_harness: Harness) -> None:
    """A5.11: a store that declines some rows for space is no fault: the publish delivers, those
    rows' bits are false, and a fetch finds exactly the rows marked held."""
    from kvwire.testing.faults import Decline

    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4)], 463, False)
    schedule = (Decline(call=None, start=1, stop=2),)
    with needs.open_exchange(kvwire_harness, faults=FaultPlan(schedule=schedule)) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        _schedule_or_skip(ex)
        put = ex.settle(ex.publish(bench.source_view()))
        assert put.is_delivered, f"A5.11: a row declined for space is a false bit, never a failure: {put!r}"
        assert not put.masks[0].all(), f"A5.11: the store declined a row, yet every bit is true: {put!r}"
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(fetched)
        assert np.array_equal(fetched.masks[0], put.masks[0]), (
            f"A5.6: the publish marked {np.flatnonzero(put.masks[0]).tolist()} held; a fetch found "
            f"{np.flatnonzero(fetched.masks[0]).tolist()}")


# -- N2.5 ---------------------------------------------------------------------------------------------------

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


# -- STATE rows through a serving peer ------------------------------------------------------------------

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
