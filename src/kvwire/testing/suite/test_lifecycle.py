"""W1 and B1-B4: waking, instances, call sequences, shutdown, declared capabilities. One file,
long as it is, as each suite file holds one group of rules."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvwire.contract import (
    CONTRACT_VERSION,
    LOOKUP,
    Backend,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    Lookup,
    SubmissionRejected,
)
from kvwire.contract.capabilities import SERVE_PULLS
from kvwire.contract.errors import SubmissionError
from kvwire.testing import needs, profiles
from kvwire.testing.harness import Harness, Hold, Unavailable, shut_down
from kvwire.testing.holder import (
    Submission,
    call_briefly,
    declares,
    refused,
    same_outcome,
    settle,
    speaks_causes,
    submit,
    wait_for,
)
from kvwire.testing.layout import Bench, simple_plan
from kvwire.testing.marks import checks
from kvwire.testing.plans import (
    check_bits,
    drain_queue,
    fill_queue,
    fillable_queue,
    pages,
)
from kvwire.testing.suite._kit import _patience


@checks("B4.2")
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


# -- B3.1: a submission while shutdown() drains ------------------------------------------------------------

@checks("B3.1", "S3.1", "M3.10", also=("L1.10",))
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


SENTINEL = 0x3C


# -- B1 ----------------------------------------------------------------------------------------

@checks("B1.1", "B1.2", "B1.4")
def test_B1_instances_share_no_state(kvwire_harness: Harness) -> None:
    """Two instances in one process: the same memory registered with both, one shut down, the
    other works on as if alone."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=139, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as first, needs.open_exchange(kvwire_harness) as second:
        bench = Bench(kvwire_harness, first.ends.source, first.ends.sink, plan, kind)
        try:
            again = [second.ends.source.register_regions([m.region for m in bench.source.memories]),
                     second.ends.sink.register_regions([m.region for m in bench.sink.memories])]
        except InvalidSubmission as exc:
            raise AssertionError(f"B1: registering memory with one instance refused it in another: {exc}") from exc
        for backend in first.ends.backends:
            assert not backend.shutdown(), "B3: nothing was in flight"
        try:
            result = second.transfer(bench)
        except SubmissionRejected as exc:
            raise AssertionError(f"B1: shutting down one instance stopped another: {exc}") from exc
        assert all(m.all() for m in result.fetched.masks), f"B1: the second instance moved fewer rows: {result!r}"
        for registration in again:
            registration.close()
        bench.close()


@checks("B1.4", "B3.3")
def test_B1_B3_shutdown_of_one_instance_leaves_anothers_attempt_in_flight(kvwire_harness: Harness) -> None:
    """B1.4 / B3.3: with a fetch held in flight on one pair of instances, shutting another pair
    down returns the empty set (it lists only attempts of its own instance) and leaves that fetch
    alone: it is still in flight, and delivers once its other end lets go."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=173, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, needs.open_exchange(kvwire_harness) as other, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        sub, hold = ex.held_fetch(bench)
        try:
            for backend in other.ends.backends:
                pending = call_briefly(backend.shutdown, "B3: shutdown() of an idle instance", on_block=hold.release)
                assert not pending, (
                    f"B3.3: shutdown() of an instance with nothing in flight returned {len(pending)} attempt(s) while "
                    "another instance held a fetch; it returns only attempts of its own instance")
            early = sub.poll()
            assert early is None, (
                f"B1.4: shutting down another instance concluded a fetch still held at its other end: {early!r}")
        finally:
            hold.release()
        out = ex.settle(sub)
        bench.apply_fetch(out)
        assert out.is_delivered and all(m.all() for m in out.masks), (
            f"B1.4: after another instance shut down, a fetch in flight here must still deliver every row: {out!r}")


# -- B2 ----------------------------------------------------------------------------------------

def _on_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a new thread and return its result: one call sequence, many threads."""
    out: list[Any] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            err.append(exc)

    thread = threading.Thread(target=run, name="kvwire-suite-caller")
    thread.start()
    thread.join()
    if err:
        raise err[0]
    return out[0]


@checks("B2.2")
def test_B2_one_call_sequence_may_span_threads(kvwire_harness: Harness) -> None:
    """The holder calls in sequence but not always from one thread: registering, submitting,
    polling and shutting down from different threads works alike."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=149, shared_names=needs.shares_names(caps))
    why = "B2: an attempt must answer whichever thread the holder calls it from"
    with needs.open_exchange(kvwire_harness) as ex:
        bench = _on_thread(lambda: Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind))
        if ex.store:
            pub: Submission = _on_thread(lambda: ex.publish(bench.source_view()))
            _on_thread(lambda: ex.settle(pub, purpose=why))
        else:
            _on_thread(lambda: ex.offer(bench))
        sub: Submission = _on_thread(lambda: ex.fetch(bench.sink_view()))
        _on_thread(ex.serve_one)
        out = _on_thread(lambda: ex.settle(sub, purpose=why))
        bench.apply_fetch(out)
        assert all(m.all() for m in out.masks), f"B2: rows went missing across threads: {out!r}"
        for backend in ex.ends.backends:
            assert not _on_thread(backend.shutdown), "B3: nothing was in flight"
        _on_thread(bench.close)


# -- B3 ----------------------------------------------------------------------------------------

@checks("B3.1", "B3.4")
def test_B3_shutdown_refuses_later_submissions_and_is_idempotent(kvwire_harness: Harness) -> None:
    """B3.1, B3.4: with nothing in flight shutdown() returns an empty frozenset, again and again;
    later submissions raise SubmissionRejected and touch nothing; close() after it is idempotent."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=2, seed=151, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        for backend in ex.ends.backends:
            for _ in range(3):
                pending = call_briefly(backend.shutdown, "B3: shutdown() with nothing in flight")
                assert isinstance(pending, frozenset), f"B3: shutdown() returns a frozenset, got {type(pending)}"
                assert not pending, f"B3: nothing was in flight, yet shutdown() returned {len(pending)} attempts"
        if caps.publish:
            refused(lambda: ex.publish(bench.source_view()), "B3: a publish after shutdown()", SubmissionRejected)
        if caps.fetch:
            refused(lambda: ex.fetch(bench.sink_view()), "B3: a fetch after shutdown()", SubmissionRejected)
        bench.verify("after submissions refused at shutdown")
        bench.close()
        for backend in ex.ends.backends:
            for _ in range(2):  # once shutdown() is empty and registrations closed: close(), idempotent
                call_briefly(backend.close, "B3: close() after shutdown", limit_s=10.0)


@checks("B3.2", "B3.3", "B3.5", "B3.6", also=("A10.8",))
def test_B3_shutdown_ends_work_in_flight_before_it_returns_empty(kvwire_harness: Harness) -> None:
    """B3.2, B3.3, B3.5, B3.6: with a fetch held at the other end, shutdown() ends or
    cancels it (cause SHUTDOWN, A10.8, for a 1.1 backend) and keeps returning it until its memory access
    has ended; once the other end lets go it returns the empty set within the grace without the
    holder polling; then the holder may reuse the rows, and nothing writes them again."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=157, shared_names=needs.shares_names(caps))
    patience = profiles.active().patience_s
    grace = kvwire_harness.quiesce_grace_s
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        sub, hold = ex.held_fetch(bench)
        before = sub.poll()  # None: shutdown() is what concludes it
        pending = call_briefly(ex.ends.sink.shutdown, "B3: shutdown() with a fetch held", on_block=hold.release)
        assert isinstance(pending, frozenset)
        for attempt in pending:
            assert attempt is sub.attempt, "B3.3: shutdown() returned an attempt that was never submitted"
        if not pending:
            assert sub.quiesced(), "B3.3: shutdown() returned empty while the fetch says it has not quiesced"
            bench.write_sink(None, SENTINEL)
        elif not sub.quiesced():
            again = ex.ends.sink.shutdown()
            assert sub.attempt in again or sub.quiesced(), (
                "B3.4: a second shutdown() left out the fetch, which has not quiesced")
        hold.release()
        # B3.5: from here the holder neither polls nor asks quiesced(); shutdown() alone must
        # come to the empty set within the documented grace.
        wait_for(lambda: not ex.ends.sink.shutdown(), grace + 1.0,
                 f"B3.5: shutdown() returning the empty set, without the holder polling, within the grace of {grace:g} s "
                 "after the other end let go,")
        if pending:
            bench.write_sink(None, SENTINEL)
        out = settle(sub, patience, quiesce=False)
        assert sub.quiesced(), "B3.3: shutdown() returned empty while the fetch has not quiesced"
        assert hold.wait_idle(patience)
        bench.verify("B3.6: after shutdown() returned empty the holder reused the rows")
        if before is not None:
            same_outcome(before, out, "fetch")
        elif speaks_causes(sub.backend) and not out.is_delivered:
            assert out.cause is Cause.SHUTDOWN, (
                f"A10.8/B3.2: shutdown() concluded a fetch that was still held, so its cause is SHUTDOWN: {out!r}")
        refused(lambda: ex.fetch(bench.sink_view()), "B3.1: a fetch after shutdown()", SubmissionRejected)


def _shutdown_lists_it(backend: Backend, sub: Submission, call: str, hold: Hold, what: str) -> None:
    """The ``call`` ("first" or "second") ``shutdown()`` of ``backend``, with ``sub`` held at
    the other end: its set names nothing but ``sub``, and ``sub`` while it has not quiesced
    (B3.3 for the first call, B3.4 for a later one); ``what`` says what ``sub`` is."""
    pending = call_briefly(backend.shutdown, f"B3: a {call} shutdown() with {what}", on_block=hold.release)
    # Asked after shutdown() returned: quiesced() is monotone, so False now means the attempt
    # had not quiesced when shutdown() made its set.
    if not sub.quiesced():
        clause = "B3.3" if call == "first" else "B3.4"
        assert sub.attempt in pending, (
            f"{clause}: the {call} shutdown() left out {what}; every call returns every attempt not quiesced, "
            "however it concluded")
    assert all(a is sub.attempt for a in pending), "B3.3: shutdown() returned an attempt never submitted"


@checks("B3.3", "B3.4", "A1.5")
@pytest.mark.parametrize("end", ["cancel", "deadline"])
def test_B3_A1_shutdown_lists_concluded_attempts_until_quiesced_and_keeps_their_outcome(
        kvwire_harness: Harness, end: str) -> None:
    """B3.3, B3.4, A1.5: a held fetch that concluded before shutdown() (cancelled by the holder,
    or failed by its deadline) but has not quiesced is in every shutdown() set until it
    quiesces, and shutdown() leaves its outcome as it was (no SHUTDOWN cause written over it)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    if end == "cancel":
        needs.cancellation(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=3, seed=159, shared_names=needs.shares_names(caps))
    patience = profiles.active().patience_s
    grace = kvwire_harness.quiesce_grace_s
    deadline_s = 0.3
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        sink = ex.ends.sink
        hint = ex.ends.fetch_hint
        if end == "deadline":
            hint = Hint(hint.kind, hint.fields, deadline_s)
        sub, hold = ex.held_fetch(bench, hint)
        try:
            if end == "cancel":
                call_briefly(sub.attempt.cancel, "A4.1: cancel()", on_block=hold.release)
            out = settle(sub, deadline_s + 1.0 + patience, quiesce=False,
                         purpose=f"A4/A8: the held fetch concluding by its {end}")
        except AssertionError:
            hold.release()
            raise

        def unchanged(when: str) -> None:
            later = call_briefly(sub.attempt.poll, "A1.1: poll()", on_block=hold.release)
            assert later is not None, f"A1.4: poll() answered None {when}, after it had answered {out!r}"
            try:
                same_outcome(out, later, "fetch")
            except AssertionError as exc:
                raise AssertionError(f"A1.5: the fetch's outcome changed {when}: {exc}") from None

        for call in ("first", "second"):
            _shutdown_lists_it(sink, sub, call, hold,
                               f"a fetch that concluded ({out.status.value}) before it but has not quiesced")
            unchanged(f"after the {call} shutdown()")
        hold.release()
        wait_for(lambda: not sink.shutdown(), grace + 1.0,
                 f"B3.5: shutdown() returning the empty set within the grace of {grace:g} s after the other end "
                 "let go,")
        bench.write_sink(None, SENTINEL)
        settle(sub, patience, purpose="B3.3: shutdown() returned empty, so the fetch has quiesced")
        unchanged("once shutdown() returned the empty set")
        assert hold.wait_idle(patience)
        bench.verify("B3.6: after shutdown() returned empty the holder reused the rows")


@checks("B3.5", "B3.2")
def test_B3_shutdown_comes_to_the_empty_set_without_polling(kvwire_harness: Harness) -> None:
    """B3.5, B3.2: a fetch the holder waits on through its wakes alone, never calling poll() or
    quiesced(): shutdown(), asked again, returns the empty set within the documented grace."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=161, shared_names=needs.shares_names(caps))
    patience = profiles.active().patience_s
    grace = kvwire_harness.quiesce_grace_s
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        pub = None
        if ex.store or ex.serves_pulls:
            ex.offer(bench)
        else:
            pub = ex.publish(bench.source_view())
        sub = ex.fetch(bench.sink_view())
        ex.serve_one()
        wait_for(lambda: sub.wakes.count > 0 and (pub is None or pub.wakes.count > 0), patience,
                 "A3/W1: a wake from the fetch, with no call to poll() or quiesced(),")
        for backend in ex.ends.backends:
            wait_for(lambda: not backend.shutdown(), grace + 1.0,  # noqa: B023
                     f"B3.5: shutdown() returning the empty set within the grace of {grace:g} s, with the holder "
                     "never polling,")
        out = settle(sub, patience, purpose="B3.3: shutdown() returned empty, so the fetch has quiesced")
        if pub is not None:
            settle(pub, patience, purpose="B3.3: shutdown() returned empty, so the publish has quiesced")
        bench.apply_fetch(out)
        bench.write_sink(None, SENTINEL)
        bench.verify("B3.6: after shutdown() returned empty the holder reused the rows")
        if not out.is_delivered and speaks_causes(sub.backend):
            assert out.cause is Cause.SHUTDOWN, f"A10.8: a fetch shutdown() concluded has cause SHUTDOWN: {out!r}"


@checks("B3.3")
def test_B3_shutdown_after_work_that_quiesced_returns_the_empty_set(kvwire_harness: Harness) -> None:
    """B3.3: attempts that concluded and quiesced are not in a shutdown() set: after transfers the
    holder waited out (each concluded and quiesced), the very first shutdown() of each end returns
    the empty set."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=163, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        for select in (None, {0: [1]}):
            assert ex.transfer(bench, select if ex.store else None, None).fetched is not None
        for backend in ex.ends.backends:
            pending = call_briefly(backend.shutdown, "B3: shutdown() once every attempt quiesced")
            assert pending == frozenset(), (
                f"B3.3: every attempt of {type(backend).__name__} had concluded and quiesced, yet its first shutdown() returned "
                f"{len(pending)} attempt(s); it returns only the attempts whose memory access may not have ended")


@checks("B3.2", "B3.3")
def test_B3_shutdown_concludes_a_publish_its_store_holds(kvwire_harness: Harness) -> None:
    """B3.2 / B3.3: ``shutdown()`` concludes a publish its store holds without waiting for
    the store (cause ``SHUTDOWN`` for a 1.1 backend), with a wake, and returns it until it
    quiesced; once the store lets go, it comes to the empty set within the grace."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=171)
    patience = profiles.active().patience_s
    grace = kvwire_harness.quiesce_grace_s
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        if not ex.store:
            pytest.skip("backend's other end is a peer; a peer's publish answers a pull")
        sub, hold = ex.held_publish(bench)
        source = ex.ends.source
        try:
            for call in ("first", "second"):
                _shutdown_lists_it(source, sub, call, hold, "a publish its store still holds (not quiesced)")
            out = settle(sub, patience, quiesce=False,
                         purpose="B3.2: shutdown() must conclude a publish its store still holds")
        finally:
            hold.release()
        assert not out.is_delivered, f"B3.2: a publish its store never answered cannot have delivered: {out!r}"
        if speaks_causes(source):
            assert out.cause is Cause.SHUTDOWN, (
                f"A10.8/B3.2: shutdown() concluded a publish its store held, so its cause is SHUTDOWN: {out!r}")
        wait_for(lambda: not source.shutdown(), grace + 1.0,
                 f"B3.5: shutdown() returning the empty set within the grace of {grace:g} s after the store let go,")
        ex.settle(sub, purpose="B3.3: shutdown() returned empty, so the publish has quiesced")
        assert hold.wait_idle(patience)
        bench.verify("S2.5: a publish concluded by shutdown()")


@checks("B3.8")
def test_B3_close_ends_the_backends_threads_and_is_idempotent(kvwire_harness: Harness) -> None:
    """B3.8: once ``shutdown()`` has returned the empty set, ``close()`` releases what the backend
    holds: every thread that started with the pair of ends and its work has ended soon after
    (what the harness keeps for the whole session started before the count, with a first pair).
    A second ``close()`` does nothing and raises nothing."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    patience = profiles.active().patience_s
    plan = simple_plan(groups=2, rows=3, seed=2243, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        if caps.fetch and caps.publish:
            ex.transfer(bench)  # what a harness or its session starts at first use starts now
    before = set(threading.enumerate())
    failure: AssertionError | None = None
    try:
        with needs.open_exchange(kvwire_harness) as ex:
            with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
                if caps.fetch and caps.publish:
                    ex.transfer(bench)
            for backend in ex.ends.backends:
                shut_down(backend, timeout_s=max(patience, kvwire_harness.quiesce_grace_s))
            try:
                for backend in ex.ends.backends:
                    for which in ("close()", "a second close()"):
                        try:
                            call_briefly(backend.close, f"B3.8: {which}", limit_s=patience)
                        except AssertionError:
                            raise
                        except Exception as exc:
                            raise AssertionError(f"B3.8: {which} after shutdown() returned the empty set raised "
                                                 f"{type(exc).__name__}: {exc}; close() is idempotent") from exc
            except AssertionError as exc:
                failure = exc
    except Exception as exc:  # the harness tears the ends down, closing each backend once more
        if failure is None:
            raise AssertionError(f"B3.8: tearing the ends down after close() raised {type(exc).__name__}: {exc}; "
                                 "close() is idempotent") from exc
    if failure is not None:
        raise failure

    def started() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before and t.is_alive()]

    try:
        wait_for(lambda: not started(), patience, "the threads started with the ends ending")
    except AssertionError:
        left = sorted(t.name for t in started())
        if left:
            raise AssertionError(
                f"B3.8: {len(left)} thread(s) that started with a pair of ends are still running {patience:g} s after "
                f"shutdown() returned the empty set and close() was called on both ends (and the harness tore them "
                f"down): {left[:8]}; close() releases what the backend holds, its threads included") from None


# -- B4 ----------------------------------------------------------------------------------------

@checks("B4.1", "B4.2", "B4.3")
def test_B4_capabilities_are_frozen_data_that_match_the_declaration(kvwire_harness: Harness) -> None:
    declared = kvwire_harness.capabilities()
    assert isinstance(declared, Capabilities)
    assert declared.contract_version[0] == CONTRACT_VERSION[0], (
        f"B4: the backend speaks contract {declared.contract_version}, this kvwire {CONTRACT_VERSION}")
    with needs.open_exchange(kvwire_harness) as ex:
        for backend in ex.ends.backends:
            caps = backend.capabilities()
            assert isinstance(caps, Capabilities), f"B4: capabilities() returned a {type(caps).__name__}"
            with pytest.raises((dataclasses.FrozenInstanceError, AttributeError)):
                caps.fetch = not caps.fetch  # type: ignore[misc]
            for _ in range(3):
                assert backend.capabilities() == caps, "B4: capabilities() answered differently on a later call"
            hash(caps)  # frozen data is hashable
            ours = dataclasses.replace(caps, max_in_flight=declared.max_in_flight)
            differ = [f"{f.name}: {getattr(ours, f.name)!r} built, {getattr(declared, f.name)!r} declared"
                      for f in dataclasses.fields(declared) if getattr(ours, f.name) != getattr(declared, f.name)]
            assert ours == declared, (
                f"B4.3: a built backend declares {caps.summary()!r}; its plugin declares {declared.summary()!r} "
                f"({'; '.join(differ)}; only the queue bound may follow the options)")


@checks("B4.4")
def test_B4_undeclared_directions_refused(kvwire_harness: Harness) -> None:
    caps = kvwire_harness.capabilities()
    if caps.fetch and caps.publish:
        pytest.skip("backend declares both fetch and publish")
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=2, seed=163)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        if not caps.fetch:
            refused(lambda: ex.fetch(bench.sink_view()), "B4: a fetch on a backend that does not declare fetch")
        if not caps.publish:
            refused(lambda: ex.publish(bench.source_view()), "B4: a publish on a backend that does not declare it")
        bench.verify("after refused submissions")


@checks("B4.5")
def test_B4_undeclared_cancellation_is_harmless(kvwire_harness: Harness) -> None:
    """B4.5: without declared cancellation, ``cancel()`` of a fetch in flight returns at once and
    raises nothing, and the fetch still concludes and quiesces."""
    caps = kvwire_harness.capabilities()
    if caps.cancellation:
        pytest.skip("backend declares cancellation")
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=2, seed=167, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        ex.offer(bench)
        sub = ex.fetch(bench.sink_view())
        call_briefly(sub.attempt.cancel, "B4.5: cancel() on a backend that does not declare cancellation")
        ex.serve_one()
        out = ex.settle(sub, purpose="B4.5: a fetch cancelled without declared cancellation still concludes and "
                                     "quiesces")
        bench.forget_sink()
        bench.apply_fetch(out)


@checks("B4.5")
def test_B4_undeclared_cancellation_of_a_held_fetch_never_blocks(kvwire_harness: Harness) -> None:
    """B4.5: without declared cancellation, ``cancel()`` of a fetch whose other end holds it (so it
    cannot conclude yet) still returns at once and raises nothing; the fetch concludes and
    quiesces once the other end lets go."""
    caps = kvwire_harness.capabilities()
    if caps.cancellation:
        pytest.skip("backend declares cancellation")
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=2, seed=169, shared_names=needs.shares_names(caps))
    patience = profiles.active().patience_s
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        sub, hold = ex.held_fetch(bench)
        try:
            call_briefly(sub.attempt.cancel, "B4.5: cancel() of a held fetch on a backend that does not declare "
                         "cancellation", on_block=hold.release)
        finally:
            hold.release()
        out = ex.settle(sub, purpose="B4.5: a fetch cancelled without declared cancellation still concludes and "
                                     "quiesces")
        assert hold.wait_idle(patience)
        bench.forget_sink()
        bench.apply_fetch(out)


@checks("B4.7")
def test_B4_an_undeclared_serving_protocol_refuses_every_call(kvwire_harness: Harness) -> None:
    """B4.7: a backend that implements ``ServesPulls`` without declaring ``serve-pulls`` refuses
    every call of it with ``InvalidSubmission`` (``address()``, ``serve()``, ``incoming()``), and
    never calls the wake it was given."""
    from kvwire.contract.serving import ServesPulls

    caps = kvwire_harness.capabilities()
    if SERVE_PULLS in caps.protocols:
        pytest.skip(f"backend declares the {SERVE_PULLS} protocol")
    with needs.open_exchange(kvwire_harness) as ex:
        for backend in ex.ends.backends:
            if not isinstance(backend, ServesPulls):
                continue
            woken: list[int] = []
            calls = {"address()": backend.address, "serve(wake)": lambda: backend.serve(lambda: woken.append(1)),  # noqa: B023
                     "incoming()": backend.incoming}
            for what, call in calls.items():
                refused(call, f"B4.7: {what} on a backend that does not declare the {SERVE_PULLS} protocol")
            assert not woken, f"B4.7: a refused serve() called its wake {len(woken)} time(s)"


@checks("B4.7")
def test_B4_an_undeclared_lookup_refuses_every_call(kvwire_harness: Harness) -> None:
    """B4.7: a backend that implements ``Lookup`` without declaring ``lookup`` refuses every
    lookup with ``InvalidSubmission``."""
    from kvwire.contract import LOOKUP, Lookup

    caps = kvwire_harness.capabilities()
    if LOOKUP in caps.protocols:
        pytest.skip(f"backend declares the {LOOKUP} protocol")
    with needs.open_exchange(kvwire_harness) as ex:
        for backend in ex.ends.backends:
            if isinstance(backend, Lookup):
                names = np.zeros((2, 16), dtype=np.uint8)
                refused(lambda: backend.lookup([0], names, ex.ends.fetch_hint),  # noqa: B023
                        "B4.7: a lookup on a backend that does not declare the lookup protocol")


@checks("B4.2")
def test_B4_capabilities_stay_the_same_after_shutdown(kvwire_harness: Harness) -> None:
    """B4.2: ``capabilities()`` answers equal data for the instance's life, after shutdown too."""
    with needs.open_exchange(kvwire_harness) as ex:
        for backend in ex.ends.backends:
            before = backend.capabilities()
            backend.shutdown()
            assert backend.capabilities() == before, "B4.2: capabilities() changed after shutdown()"


# -- instances -----------------------------------------------------------------------------------

@checks("B1.3", also=("A8.2",))
def test_B1_each_instance_keeps_its_own_deadline_option(kvwire_harness: Harness) -> None:
    """B1.3: options are per instance: a pair built with a deadline option of 0.4 s, then another
    pair built with a far longer one; a fetch of the first pair that its other end holds still
    fails by its own 0.4 s deadline (a backend that keeps its options at class or module level
    gives it the deadline of the instance built last)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    deadline_s, slack_s = 0.4, 2.0
    plan = simple_plan(groups=1, rows=2, seed=2261, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True, timeout_s=deadline_s) as first, Bench(
            kvwire_harness, first.ends.source, first.ends.sink, plan, kind) as bench, \
            needs.open_exchange(kvwire_harness, timeout_s=needs.LONG_TIMEOUT_S):
        sub, hold = first.held_fetch(bench)
        try:
            out = settle(sub, deadline_s + slack_s + _patience(), quiesce=False,
                         purpose=f"B1.3: a held fetch of the pair built with a {deadline_s:g} s deadline option, "
                                 f"after another pair was built with {needs.LONG_TIMEOUT_S:g} s, failing by its own")
        finally:
            hold.release()
        assert out.is_failed, (
            f"B1.3: the pair built with a deadline option of {deadline_s:g} s concluded {out!r} though its other end "
            f"held the fetch, once another pair was built with {needs.LONG_TIMEOUT_S:g} s")
        settle(sub, kvwire_harness.quiesce_grace_s + slack_s + _patience())
        bench.forget_sink()
        bench.apply_fetch(out)


@checks("B1.3", "B1.5")
def test_B1_pairs_of_instances_share_no_store_queue_or_shutdown(kvwire_harness: Harness) -> None:
    """B1.3-B1.5: two pairs of instances in one process: what one pair's other end holds the other's
    does not; one's full queue does not refuse the other's submissions; one's shutdown leaves the
    other working."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)
    plan = pages([(64, 4), (32, 4)], 251, shared)
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
                filler = pages([(8, bound)], 257, shared)
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
                        check_bits(second, two, None, None, result.fetched, "B1.5")
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
            check_bits(second, two, None, None, result.fetched, "B1.3")
        finally:
            one.close()
            two.close()


# -- B1.5: queues per instance, also on one store ---------------------------------------------------


@checks("B1.5", "S3.10")
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


# -- B3.2 / A10.8 / W1.2: shutdown() concludes a fetch its other end holds ------------------------------


@checks("B3.2", "W1.2", also=("B3.3",))
def test_B3_shutdown_concludes_a_fetch_the_other_end_holds(kvwire_harness: Harness) -> None:
    """B3.2 / W1.2: ``shutdown()`` ends or cancels every attempt in flight: a fetch its
    other end still holds concludes (not delivered; cause ``SHUTDOWN`` for a 1.1 backend) with a
    wake, while the other end goes on holding it; it is returned until it quiesced, and once the
    other end lets go ``shutdown()`` comes to the empty set within the grace."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=801, shared_names=needs.shares_names(caps))
    patience = profiles.active().patience_s
    grace = kvwire_harness.quiesce_grace_s
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        sink = ex.ends.sink
        sub, hold = ex.held_fetch(bench)
        try:
            assert sub.poll() is None, "the fetch concluded while its other end held it"
            pending = call_briefly(sink.shutdown, "B3: shutdown() with a fetch held", on_block=hold.release)
            assert all(a is sub.attempt for a in pending), "B3.3: shutdown() returned an attempt never submitted"
            out = settle(sub, patience, quiesce=False,
                         purpose="B3.2: shutdown() must conclude a fetch its other end still holds, without waiting "
                                 "for the other end (and wake its holder)")
        finally:
            hold.release()
        assert not out.is_delivered, f"B3.2: a fetch its other end never answered cannot have delivered: {out!r}"
        if speaks_causes(sink):
            assert out.cause is Cause.SHUTDOWN, (
                f"A10.8/B3.2: shutdown() concluded a fetch its other end held, so its cause is SHUTDOWN: {out!r}")
        wait_for(lambda: not sink.shutdown(), grace + 1.0,
                 f"B3.5: shutdown() returning the empty set within the grace of {grace:g} s after the other end let go,")
        ex.settle(sub, purpose="B3.3: shutdown() returned empty, so the fetch has quiesced")
        assert isinstance(hold, Hold) and hold.wait_idle(patience), "the other end did not go idle after release"
        bench.forget_sink()
        bench.apply_fetch(out)
