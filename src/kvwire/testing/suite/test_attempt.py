"""A1-A9: what an attempt answers, when, and what its outcome means.

One file for the attempt's rules, as each suite file holds one group of rules; it is over 600
lines because A3, A4 and A8 each run for fetch and publish, small and many-row views, and A6 and
A9 are checked again for a failed fetch's masks and for fetches of the same rows in flight."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvwire import holding
from kvwire.contract import (
    CacheKind,
    Cause,
    Hint,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    SlotRegion,
    TokenRange,
    View,
)
from kvwire.contract.capabilities import OtherEnd
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import FaultPlan, Harness, Hold, Unavailable, shut_down
from kvwire.testing.holder import (
    Submission,
    call_briefly,
    same_outcome,
    settle,
    speaks_causes,
    wait_for,
)
from kvwire.testing.layout import BLOCK_TOKENS, Bench, ViewPlan, simple_plan
from kvwire.testing.marks import checks
from kvwire.testing.plans import (
    check_bits,
    drain_queue,
    fill_queue,
    needs_misses,
    offer_for,
    paged_exchange,
    pages,
    store_only,
    transfer_checked,
)
from kvwire.testing.regions import next_region_id
from kvwire.testing.serving import PullHold
from kvwire.testing.strategies import view_plans
from kvwire.testing.suite._kit import _held_answer, _patience, _pulls, _schedule_or_skip

SENTINEL_3C = 0x3C
SENTINEL_6B = 0x6B
SENTINEL_A5 = 0xA5


#: Bytes the holder writes into rows it got back, to see whether a backend writes after.
SENTINEL = 0x5A


def _store_only(ex: Exchange) -> None:
    if not ex.store:
        pytest.skip("backend's other end is a peer; holding is exercised through a store")


# -- A1 ----------------------------------------------------------------------------------------

def _held(ex: Exchange, bench: Bench, op: str) -> tuple[Submission, Hold]:
    """A fetch of the bench's rows, or a publish of them to a store, held at its other end."""
    if op == "fetch":
        return ex.held_fetch(bench)
    _store_only(ex)  # a peer's publish answers a pull; the suite cannot hold the requester
    return ex.held_publish(bench)


@checks("A1.1", "A1.4", also=("A1.2",))
@pytest.mark.parametrize("op", ["fetch", "publish"])
def test_A1_poll_never_blocks_and_answers_the_same_outcome(kvwire_harness: Harness, op: str) -> None:
    """A1.1-A1.4: ``poll()`` of a fetch, or of a publish to a store, returns ``None`` at once while
    the other end holds it, and after the conclusion the same outcome on every call, also after
    later work."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=61, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        sub, hold = _held(ex, bench, op)
        first = call_briefly(sub.attempt.poll, f"A1.1: poll() of a {op} while the other end is held",
                             on_block=hold.release)
        assert first is None, f"A1.2: poll() answered {first!r} while the {op} was still held at the other end"
        hold.release()
        out = ex.settle(sub)
        for _ in range(5):
            later = call_briefly(sub.attempt.poll, "A1: poll() after the conclusion")
            assert later is not None, "A1.4: poll() answered None after it had answered an outcome"
            same_outcome(out, later, op)
        if op == "fetch":
            bench.apply_fetch(out)
        # Later work on the same backend does not change an earlier outcome.
        bench.apply_fetch(ex.fetch_settled(bench.sink_view()))
        same_outcome(out, sub.attempt.poll(), op)  # type: ignore[arg-type]


# -- A2 ----------------------------------------------------------------------------------------

@checks("A2.1", "A2.2")
@pytest.mark.parametrize("op", ["fetch", "publish"])
def test_A2_quiesced_never_blocks_and_stays_true(kvwire_harness: Harness, op: str) -> None:
    """A2.1 / A2.2: ``quiesced()`` of a fetch, or of a publish to a store, returns at once while the
    other end holds it, and once true stays true."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=4, seed=67, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        sub, hold = _held(ex, bench, op)
        call_briefly(sub.attempt.quiesced, f"A2.1: quiesced() of a {op} while the other end is held",
                     on_block=hold.release)
        hold.release()
        out = ex.settle(sub)
        for _ in range(5):
            assert call_briefly(sub.attempt.quiesced, "A2: quiesced() after quiescence") is True, (
                "A2.2: quiesced() turned false after it had been true")
        bench.apply_fetch(out if op == "fetch" else ex.fetch_settled(bench.sink_view()))


@checks("A2.3")
def test_A2_fetch_writes_nothing_after_quiesced(kvwire_harness: Harness) -> None:
    """Once a fetch says it quiesced, the holder may reuse the rows at once: nothing the backend
    does afterwards may change them."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=4, seed=71, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        sub, hold = ex.held_fetch(bench)
        early = sub.quiesced()
        if early:
            # It claims no more access while its work is held: take it at its word.
            bench.write_sink(None, SENTINEL)
        hold.release()
        ex.settle(sub)
        if not early:
            bench.write_sink(None, SENTINEL)
        assert hold.wait_idle(profiles.active().patience_s), "the other end did not go idle after release"
        bench.verify("A2: the fetch had said it quiesced, and the holder then reused its rows")


@checks("A2.4")
def test_A2_publish_reads_nothing_after_quiesced(kvwire_harness: Harness) -> None:
    """Once a publish says it quiesced, the holder may overwrite its rows: the other end must
    still hold the bytes as they were at submission."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=4, seed=73)
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        _store_only(ex)
        control = ex.ends.hold
        assert control is not None
        hold = control()
        sub = ex.publish(bench.source_view())
        wait_for(lambda: hold.waiting() > 0 or sub.wakes.count > 0, profiles.active().patience_s,
                 "A3: the held store receiving the publish")
        early = sub.quiesced()
        if early:
            bench.write_source(None, SENTINEL)
        hold.release()
        published = ex.settle(sub)
        if not early:
            bench.write_source(None, SENTINEL)
        assert hold.wait_idle(profiles.active().patience_s)
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(fetched)  # A7: a true bit means the bytes as they were offered
        for put, got in zip(published.masks, fetched.masks, strict=True):
            assert (got | ~put).all(), f"A5: rows the publish marked held were not fetched: {fetched!r}"


# -- A3 ----------------------------------------------------------------------------------------

#: Rows per group of the A3 tests: a small view, and one of many rows that a backend moves in
#: several chunks or batches (A3 holds for every chunk, not only the first).
A3_ROWS = {"small": 4, "many-rows": 96}


@checks("A3.1", "A3.3")
@pytest.mark.parametrize("size", list(A3_ROWS))
def test_A3_fetch_progresses_without_poll(kvwire_harness: Harness, size: str) -> None:
    """A3.1 / A3.3: without a single call to poll() or quiesced(), the fetched bytes land and
    wake() comes, for a small view and for one of many rows."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=A3_ROWS[size], seed=79, shared_names=needs.shares_names(caps))
    patience = profiles.active().patience_s
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        if not (ex.store or ex.serves_pulls):
            pytest.skip("backend's other end is a peer without the serve-pulls protocol")
        ex.offer(bench)
        sub = ex.fetch(bench.sink_view())
        ex.serve_one()

        def landed() -> bool:
            return sub.wakes.count > 0 and all(
                np.array_equal(bench.sink.memories[gi].read(bench.sink.slots[gi]), bench.data[gi])
                for gi in range(len(plan.groups)))

        wait_for(landed, patience, f"A3.1/A3.3: the fetched bytes of {plan.rows} row(s) landing and a wake, "
                 "with no call to poll() or quiesced(),")
        out = ex.settle(sub)
        bench.apply_fetch(out)
        assert all(m.all() for m in out.masks), f"A5: every row was held: {out!r}"


@checks("A3.1", "A3.3")
def test_A3_a_serving_publish_progresses_without_poll(kvwire_harness: Harness) -> None:
    """A3.1-A3.3 at the serving end: an answer nobody polls still reaches the requester, and its
    conclusion and quiescence come with a wake."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=85, shared_names=True)
    patience = profiles.active().patience_s
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        ex.offer(bench)
        sub = ex.fetch(bench.sink_view())
        holder = ex.holder()
        (request,) = holder.take(1)
        answer = holder.answer(request)  # never polled until the requester has everything
        published = answer.publish
        assert published is not None
        out = ex.settle(sub)
        bench.apply_fetch(out)
        assert out.is_delivered and all(m.all() for m in out.masks), f"A3: an unpolled answer did not arrive: {out!r}"
        wait_for(lambda: published.wakes.count > 0, patience, "A3/W1: a wake from the unpolled answer")
        holder.finish(answer)


@checks("A3.1", "A3.3")
@pytest.mark.parametrize("size", list(A3_ROWS))
def test_A3_publish_progresses_without_poll(kvwire_harness: Harness, size: str) -> None:
    """A3.1 / A3.3: a publish nobody polls still reaches the other end: a fetch on the other end
    finds it, for a small view and for one of many rows."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=A3_ROWS[size] - 1, seed=83)
    patience = profiles.active().patience_s
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        _store_only(ex)
        pub = ex.publish(bench.source_view())
        deadline = time.monotonic() + patience
        while True:
            fetched = ex.settle(ex.fetch(bench.sink_view()))
            bench.apply_fetch(fetched)
            if fetched.masks[0].all() and pub.wakes.count > 0:
                break
            assert time.monotonic() < deadline, (
                f"A3.1/A3.3: a publish of {plan.rows} row(s) never polled did not reach the store within "
                f"{patience:g} s (or never woke)")
        ex.settle(pub)


# -- A4 ----------------------------------------------------------------------------------------

@checks("A4.1", "A4.3", "A4.4", "A4.5", also=("A10.6",))
@pytest.mark.parametrize("op", ["fetch", "publish"])
def test_A4_cancel_is_idempotent_yields_cancelled_and_still_quiesces(kvwire_harness: Harness, op: str) -> None:
    """A4.1-A4.5: cancel() twice on a fetch or a publish the other end holds: it concludes
    CANCELLED at once, without waiting for the other end to answer (A4.4), not by the peer (cause HOLDER_CANCELLED, A10.6, for a 1.1 backend), still
    quiesces once the other end lets go, and the backend works on afterwards."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.cancellation(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=89, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        if op == "fetch":
            sub, hold = ex.held_fetch(bench)
        else:
            _store_only(ex)  # a peer's publish answers a pull; the suite cannot hold the requester
            assert ex.ends.hold is not None
            hold = ex.ends.hold()
            sub = ex.publish(bench.source_view())
            wait_for(lambda: hold.waiting() > 0 or sub.wakes.count > 0, profiles.active().patience_s,
                     "A3: the held store receiving the publish")
        assert sub.poll() is None, f"the {op} concluded while the other end was held"
        call_briefly(sub.attempt.cancel, "A4.1: cancel()", on_block=hold.release)
        call_briefly(sub.attempt.cancel, "A4.1/A4.2: a second cancel()", on_block=hold.release)
        out = settle(sub, profiles.active().patience_s, quiesce=False,
                     purpose=f"A4.3/A4.4: cancel() must conclude a {op} the other end holds")
        assert out.is_cancelled and not out.by_peer, (
            f"A4.3: cancel() before the conclusion must yield a cancelled {op} outcome, not by the peer; got {out!r}")
        if speaks_causes(sub.backend):
            assert out.cause is Cause.HOLDER_CANCELLED, (
                f"A10.6: a {op} the holder's cancel() concluded has cause HOLDER_CANCELLED: {out!r}")
        hold.release()
        ex.settle(sub, purpose=f"A4.5: a cancelled {op} still quiesces")
        call_briefly(sub.attempt.cancel, "A4.1: cancel() after the conclusion")
        same_outcome(out, sub.attempt.poll(), op)  # type: ignore[arg-type]
        if op == "fetch":
            bench.forget_sink()
            bench.apply_fetch(out)
            again = ex.fetch_settled(bench.sink_view())
            assert again.is_delivered, f"A4: after a cancelled fetch the backend must still fetch: {again!r}"
            bench.apply_fetch(again)
        else:
            put = ex.settle(ex.publish(bench.source_view()))
            assert put.is_delivered, f"A4: after a cancelled publish the backend must still publish: {put!r}"
            got = ex.fetch_settled(bench.sink_view())
            bench.apply_fetch(got)
            for held, fetched in zip(put.masks, got.masks, strict=True):
                assert (fetched | ~held).all(), f"A5.6/S1.3: rows the publish marked held were not fetched: {got!r}"


@checks("A4.6", "A4.1", "A4.2", also=("A2.2",))
@pytest.mark.parametrize("op", ["fetch", "publish"])
def test_A4_cancel_after_conclusion_changes_nothing(kvwire_harness: Harness, op: str) -> None:
    """A4.6, A4.1, A4.2: cancel() (twice) after a fetch or a publish delivered changes nothing:
    the same outcome, and the same bytes at the other end (a store still gives every row the
    publish marked held; a requester's fetched rows stay as they arrived)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=3, seed=97, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        fetched: Submission | None = None
        if op == "fetch":
            ex.offer(bench)
            sub = ex.fetch(bench.sink_view())
            ex.serve_one()
        elif ex.store:
            sub = ex.publish(bench.source_view())
        elif ex.serves_pulls:  # the publish is the serving end's answer to a pull
            ex.offer(bench)
            fetched = ex.fetch(bench.sink_view())
            holder = ex.holder()
            (request,) = holder.take(1)
            answer = holder.answer(request)
            holder.finish(answer)
            assert answer.publish is not None
            sub = answer.publish
        else:  # plain peers: the publish meets the fetch
            sub = ex.publish(bench.source_view())
            fetched = ex.fetch(bench.sink_view())
        out = ex.settle(sub)
        if fetched is not None:
            bench.apply_fetch(ex.settle(fetched))
        assert op == "fetch" or out.is_delivered, f"A4: the publish to cancel afterwards did not deliver: {out!r}"
        call_briefly(sub.attempt.cancel, "A4.1: cancel() after the conclusion")
        call_briefly(sub.attempt.cancel, "A4.1/A4.2: a second cancel() after the conclusion")
        try:
            same_outcome(out, sub.attempt.poll(), op)  # type: ignore[arg-type]
        except AssertionError as exc:
            raise AssertionError(f"A4.6: cancel() after the conclusion changed the {op}'s outcome: {exc}") from None
        assert sub.quiesced(), f"A2.2: the {op} no longer says it quiesced after cancel()"
        if op == "fetch":
            bench.apply_fetch(out)
        elif fetched is None:
            got = ex.fetch_settled(bench.sink_view())
            bench.apply_fetch(got)
            for held, mask in zip(out.masks, got.masks, strict=True):
                missing = np.flatnonzero(held & ~mask)
                assert missing.size == 0, (
                    f"A4.6: cancel() after the publish delivered took back row(s) {missing.tolist()} it had stored: "
                    f"a fetch now gives {got!r}")
        else:
            try:
                same_outcome(fetched.outcome, fetched.attempt.poll(), "fetch")  # type: ignore[arg-type]
            except AssertionError as exc:
                raise AssertionError(f"A4.6: cancel() of the delivered publish changed the fetch's outcome: {exc}") from None
            bench.verify("A4.6: cancel() after the publish delivered changed the rows the requester got")


@checks("A4.1", "A4.6", "S5.2")
def test_A4_cancel_raises_nothing_after_a_failure_or_shutdown(kvwire_harness: Harness) -> None:
    """A4.1 / A4.6 / S5.2: ``cancel()`` never raises: not on a fetch a fault at the other end
    failed (a store's), and not on any attempt of an instance that was shut down since; each
    keeps the outcome it had."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4)], 643, needs.shares_names(caps))
    probe = Bench(kvwire_harness, None, None, plan, kind)
    faulty = probe.names[0][3].tobytes()
    probe.close()
    store = caps.other_end is OtherEnd.STORE
    faults = FaultPlan(fetch=frozenset({faulty})) if store else None
    with needs.open_exchange(kvwire_harness, faults=faults) as ex, Bench(kvwire_harness, ex.ends.source,
                                                                         ex.ends.sink, plan, kind) as bench:
        done: list[Submission] = []
        clean = {0: [0, 1, 2]}
        if ex.store:
            done.append(ex.publish(bench.source_view()))
            ex.settle(done[-1])
            failed = ex.fetch(bench.sink_view({0: [2, 3]}))
            out = ex.settle(failed)
            assert out.is_failed, f"A5.9: a fault at the other end must fail the fetch: {out!r}"
            bench.apply_fetch(out, {0: [2, 3]})
            _cancel_quietly(failed, "cancel() of a fetch that failed at the other end")
            same_outcome(out, failed.attempt.poll(), "fetch")  # type: ignore[arg-type]
            done.append(failed)
        elif ex.serves_pulls:
            ex.offer(bench)
        else:
            done.append(ex.publish(bench.source_view(clean)))
        done.append(ex.fetch(bench.sink_view(clean)))
        ex.serve_one()
        for sub in done:
            ex.settle(sub)
        bench.apply_fetch(done[-1].outcome, clean)  # type: ignore[arg-type]
        for backend in ex.ends.backends:
            shut_down(backend, timeout_s=max(10.0, kvwire_harness.quiesce_grace_s))
        for sub in done:
            _cancel_quietly(sub, f"cancel() of a concluded {sub.op} after shutdown()")
            try:
                same_outcome(sub.outcome, sub.attempt.poll(), sub.op)  # type: ignore[arg-type]
            except AssertionError as exc:
                raise AssertionError(f"A4.6: cancel() after shutdown() changed the {sub.op}'s outcome: {exc}") from None


def _cancel_quietly(sub: Submission, what: str) -> None:
    """``cancel()``, failing naming A4.1 if it blocks or raises."""
    try:
        call_briefly(sub.attempt.cancel, f"A4.1: {what}")
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(f"A4.1/S5.2: {what} raised {type(exc).__name__}: {exc}; cancel() never raises") from exc


# -- A4.7 / A8.6: the true bits of a fetch that ended before its other end answered --------------

def _ended_fetch_marks_only_moved_rows(harness: Harness, ending: str, clause: str, seed: int) -> None:
    """A fetch of six rows per group, of which a store holds only the even ones (a serving peer's
    holder answers nothing, and declines once the fetch has ended), held at its other end and
    ended there by ``ending`` (``"cancel"``, or ``"deadline"``: the hint's, 0.4 s): each true bit
    of its outcome is a row that moved whole before the end (``clause``, A7), so a row the other
    end holds, whose bytes are the source's."""
    caps = harness.capabilities()
    needs.transfer(caps)
    if ending == "cancel":
        needs.cancellation(caps)
    kind = needs.usable_kind(harness, caps)
    deadline_s = 0.4
    patience = profiles.active().patience_s
    plan = pages([(64, 6), (32, 6)], seed, needs.shares_names(caps))
    with needs.open_exchange(harness, hold=True) as ex, Bench(harness, ex.ends.source, ex.ends.sink, plan,
                                                              kind) as bench:
        hint = ex.ends.fetch_hint
        if ending == "deadline":
            hint = Hint(hint.kind, hint.fields, deadline_s)
        hold: Hold | None = None
        request = None
        if ex.store:
            held = {gi: [0, 2, 4] for gi in range(len(plan.groups))}
            ex.offer(bench, held)
            assert ex.ends.hold is not None
            hold = ex.ends.hold()
            sub = ex.fetch(bench.sink_view(), hint)
            wait_for(lambda: hold.waiting() > 0 or sub.wakes.count > 0, patience,  # type: ignore[union-attr]
                     "A3: the held store receiving the fetch")
        else:
            held = {}
            ex.offer(bench)  # the serving holder holds every row, and answers nothing
            sub = ex.fetch(bench.sink_view(), hint)
            (request,) = ex.holder().take(1)
        try:
            if ending == "cancel":
                call_briefly(sub.attempt.cancel, "A4.1: cancel()", on_block=None if hold is None else hold.release)
                out = settle(sub, patience, quiesce=False, purpose="A4.3/A4.4: cancel() concluding the held fetch")
            else:
                out = settle(sub, deadline_s + patience, quiesce=False,
                             purpose=f"A8.2: the held fetch failing by its deadline of {deadline_s:g} s")
        finally:
            if hold is not None:
                hold.release()
            if request is not None:
                ex.holder().decline(request, "conformance: the fetch ended before its pull was answered")
        ex.settle(sub, purpose=f"A4.5/A8.3: the fetch ended by its {ending} quiescing once its other end let go")
        assert not out.is_delivered, f"{clause}: the fetch its other end held was ended by its {ending}, got {out!r}"
        for gi, mask in enumerate(out.masks):
            lied = np.setdiff1d(np.flatnonzero(mask), held.get(gi, []))
            assert lied.size == 0, (
                f"{clause}: row(s) {lied.tolist()} of group {plan.groups[gi].group_id} are true bits of the fetch its "
                f"{ending} ended ({out!r}), but the other end never held them: a true bit of an ended attempt is a "
                "row that moved whole before the end")
        bench.forget_sink()
        try:
            bench.apply_fetch(out)
        except AssertionError as exc:
            raise AssertionError(f"{clause}: in the fetch its {ending} ended, {exc}") from None


@checks("A4.7")
def test_A4_a_cancelled_fetch_marks_only_rows_that_moved_whole(kvwire_harness: Harness) -> None:
    """A4.7: a fetch cancelled while its other end holds it (a store that holds half its rows; a
    serving peer that never answers) marks true only rows that moved whole before the cancel: none
    the other end lacks, and each with the source's bytes."""
    _ended_fetch_marks_only_moved_rows(kvwire_harness, "cancel", "A4.7", 2213)


# -- A5 ----------------------------------------------------------------------------------------

@checks("A5.7", "A5.8")
def test_A5_a_miss_is_a_false_bit_in_a_delivered_outcome(kvwire_harness: Harness) -> None:
    """Fetching rows the other end never held delivers, with their bits false."""
    caps = kvwire_harness.capabilities()
    needs.fetch(caps)
    needs.misses(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=4, seed=101, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, None, ex.ends.sink, plan, kind) as bench:
        ex.offer(bench, {})
        sub = ex.fetch(bench.sink_view())
        ex.serve_one()
        out = ex.settle(sub)
        assert out.is_delivered, f"A5: a miss is never a failure; fetching rows nobody holds gave {out!r}"
        assert out.rows_delivered == 0, f"A5/A7: rows nobody holds were marked delivered: {out!r}"
        bench.apply_fetch(out)


@checks("A5.9", "A7.2", also=("A5.12", "A2.5"))
def test_A5_a_fault_is_a_failure_not_a_miss(kvwire_harness: Harness) -> None:
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.misses(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=4, seed=103, shared_names=needs.shares_names(caps))
    probe = Bench(kvwire_harness, None, None, plan, kind)
    from kvwire.testing.harness import FaultPlan

    faulty = probe.names[0][2].tobytes()
    with needs.open_exchange(kvwire_harness, faults=FaultPlan(fetch=frozenset({faulty}))) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        _store_only(ex)
        ex.offer(bench)
        sub = ex.fetch(bench.sink_view())
        out = ex.settle(sub, quiesce=False)
        ex.settle(sub, purpose="A2.5: a fetch the store failed must still quiesce")
        assert out.is_failed, f"A5: a fault at the other end must fail the fetch, not pass as a miss: {out!r}"
        assert not out.masks[0][2], (
            "A5.12/A7: the row that faulted is marked true in the failed fetch; a failed outcome marks true only "
            "rows that moved whole before the end")
        bench.apply_fetch(out)


@checks("A5.2")
def test_A5_a_failed_outcome_says_why_and_a_delivered_one_gives_no_reason(kvwire_harness: Harness) -> None:
    """A5.2: a fetch that delivers carries no reason; a fetch that fails (its other end held past
    the hint's deadline) carries a reason: a str that says something."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    deadline_s = 0.4
    patience = profiles.active().patience_s
    plan = simple_plan(groups=2, rows=3, seed=2209, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        if not (ex.store or ex.serves_pulls):
            pytest.skip("backend's other end is a peer without the serve-pulls protocol; the suite cannot hold it")
        ex.offer(bench)
        good = ex.fetch_settled(bench.sink_view())
        bench.apply_fetch(good)
        assert good.is_delivered and good.reason is None, (
            f"A5.2: a delivered fetch carries no reason; got {good!r} with reason {good.reason!r}")
        sub, hold = ex.held_fetch(bench, Hint(ex.ends.fetch_hint.kind, ex.ends.fetch_hint.fields, deadline_s))
        try:
            out = settle(sub, deadline_s + patience, quiesce=False,
                         purpose=f"A8.2: the held fetch failing by its deadline of {deadline_s:g} s")
        finally:
            hold.release()
        ex.settle(sub)
        assert out.is_failed, f"A8.2: a fetch held past its deadline fails, got {out!r}"
        assert isinstance(out.reason, str) and out.reason.strip(), (
            f"A5.2: a failed outcome carries a reason that says what happened; got reason {out.reason!r}")
        hold.wait_idle(patience)
        bench.forget_sink()
        bench.apply_fetch(out)


# -- A6 ----------------------------------------------------------------------------------------

@checks("A6.5", "A6.3", "A6.4")
def test_A6_masks_are_plain_read_only_bool_and_never_change(kvwire_harness: Harness) -> None:
    """Every outcome's masks are plain read-only bool arrays, and later work on the backend
    never changes a mask it handed over."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=4, seed=107, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        outcomes: list[tuple[Outcome, list[np.ndarray]]] = []
        selects: list[dict[int, list[int]] | None] = [{0: [0, 1]}, {0: [2], 1: [0, 1, 2, 3]}, None, {1: []}]
        for select in selects:
            fetched = ex.transfer(bench, select if ex.store else None, None).fetched
            outcomes.append((fetched, [m.copy() for m in fetched.masks]))
            for out, copies in outcomes:
                for mask, copy in zip(out.masks, copies, strict=True):
                    assert type(mask) is np.ndarray and mask.dtype == np.bool_ and not mask.flags.writeable, (
                        "A6: an outcome's mask must stay a plain read-only bool array")
                    assert np.array_equal(mask, copy), (
                        f"A6: a mask handed over in {out!r} changed during later work on the backend")


@checks("A6.5", "A6.3")
def test_A6_the_masks_of_a_failed_fetch_never_change(kvwire_harness: Harness) -> None:
    """A6.5 / A6.3: a fetch that failed (a fault at the other end on one row) hands over masks
    that stay as they were while later transfers run, like those of a delivered one."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.misses(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 6), (32, 6)], 617, needs.shares_names(caps))
    probe = Bench(kvwire_harness, None, None, plan, kind)
    faulty = probe.names[0][4].tobytes()
    probe.close()
    with needs.open_exchange(kvwire_harness, faults=FaultPlan(fetch=frozenset({faulty}))) as ex:
        if not ex.store:
            pytest.skip("backend's other end is a peer; the suite faults rows of a store")
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            ex.offer(bench)
            failed: list[Submission] = []
            for select in ({0: [0, 1, 4], 1: [0, 1]}, {0: [4, 2], 1: [2, 3, 4]}):
                sub = ex.fetch(bench.sink_view(select))
                out = ex.settle(sub)
                assert out.is_failed, f"A5.9: a fault at the other end must fail the fetch: {out!r}"
                bench.apply_fetch(out, select)
                failed.append(sub)
                again = {0: [5], 1: [5]}
                bench.apply_fetch(ex.settle(ex.fetch(bench.sink_view(again))), again)
                for earlier in failed:
                    earlier.masks_unchanged()  # the bits poll() first answered (A6.5)
                    assert all(not m.flags.writeable for m in earlier.outcome.masks), (  # type: ignore[union-attr]
                        "A6: a mask of a failed fetch became writable after hand-over")
                    earlier.poll()


# -- A7 ----------------------------------------------------------------------------------------

@checks("A7.1")
def test_A7_a_true_bit_means_identical_bytes(kvwire_harness: Harness) -> None:
    """Over drawn views, with the sink full of junk: every row marked delivered holds exactly the
    source's bytes; rows marked missing are left to the holder."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    p = profiles.active()
    shared = needs.shares_names(caps)

    @profiles.examples()
    @given(plan=view_plans(max_groups=p.max_groups, max_rows=p.max_rows, min_rows=1, shared_names=shared),
           data=st.data())
    def run(plan: ViewPlan, data: st.DataObject) -> None:
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                              kind) as bench:
            offer = None
            if ex.store:
                offer = {gi: data.draw(st.lists(st.integers(0, g.rows - 1), unique=True), label=f"offered {gi}")
                         for gi, g in enumerate(plan.groups)}
            result = ex.transfer(bench, offer, None)  # apply_fetch checks every true bit's bytes
            assert result.fetched.rows_delivered == sum(len(r) for r in bench.rows_of(offer)), (
                f"A5: every offered row must arrive: {result.fetched!r}")

    run()


@checks("A7.4")
def test_A7_a_published_row_marked_held_is_held_with_its_bytes_at_submission(kvwire_harness: Harness) -> None:
    """A7.4: every row a publish marks held is held at the other end with the bytes it had when it
    was submitted. For a store the holder overwrites the published rows once the publish has
    quiesced (A2.4), and a fetch on the other end still gives the bytes as they were; for a peer
    the requester's rows hold them."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4), (24, 4)], 2207, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        published: Outcome | None
        try:
            if ex.store:
                published = ex.settle(ex.publish(bench.source_view()))
                bench.write_source(None, SENTINEL_A5)  # the holder reuses rows a quiesced publish left
                fetched = ex.settle(ex.fetch(bench.sink_view()))
                bench.apply_fetch(fetched)
            else:
                result = ex.transfer(bench)
                published, fetched = result.published, result.fetched
        except AssertionError as exc:
            if not str(exc).startswith("A7:"):
                raise
            raise AssertionError(f"A7.4: rows a publish marked held: {exc}") from None
        assert published is not None and published.is_delivered and any(m.any() for m in published.masks), (
            f"A7.4: a publish to an other end with room for its rows must deliver and mark them held: {published!r}")
        for gi, (held, got) in enumerate(zip(published.masks, fetched.masks, strict=True)):
            lost = np.flatnonzero(held & ~got)
            assert lost.size == 0, (
                f"A7.4: row(s) {lost.tolist()} of group {plan.groups[gi].group_id} were marked held by the publish "
                f"({published!r}), yet a fetch of them from the other end did not get them ({fetched!r})")


@checks("A7.2", also=("A5.8",))
def test_A7_an_object_lost_between_store_calls_is_never_a_torn_row_marked_true(kvwire_harness: Harness) -> None:
    """A7.2: the store loses the first object of a fetch's second and of its third store call
    behind the backend's back (evicted just before those calls, as another process may), however
    the backend splits the fetch into calls (one per group, or several reads of each row): the
    fetch delivers (a lost object is a miss), and every row it marks true holds the published
    bytes whole; a row that arrived in part is a false bit."""
    from kvwire.testing.faults import Evict

    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(4096, 3), (64, 3)], 2243, False)
    schedule = (Evict(op="get", call=2, stop=1), Evict(op="get", call=3, stop=1))
    with needs.open_exchange(kvwire_harness, faults=FaultPlan(schedule=schedule)) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        _schedule_or_skip(ex)
        published = ex.offer(bench)
        assert published is not None and published.is_delivered and all(m.all() for m in published.masks), (
            f"S1.2: a publish to a store with room to spare must hold every row: {published!r}")
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        assert fetched.is_delivered, f"A5.8: objects the store lost are misses, and a miss no failure: {fetched!r}"
        try:
            bench.apply_fetch(fetched)
        except AssertionError as exc:
            raise AssertionError(f"A7.2: a fetch while the store lost objects between its calls: {exc}") from None


# -- A8 ----------------------------------------------------------------------------------------

@checks("A8.2", "A8.3", "A8.4", "A8.5")
@pytest.mark.parametrize("source", ["options", "hint"])
def test_A8_a_held_attempt_fails_by_its_deadline(kvwire_harness: Harness, source: str) -> None:
    """With the other end not answering, the attempt concludes failed by its deadline (from the
    backend's options, or from the hint) with a reason that says so, and quiesces within the
    backend's documented grace once the other end lets go."""
    _fails_by_its_deadline(kvwire_harness, source, "fetch")


@checks("A8.4", "A8.2", "H1.6", also=("A10.7",))
@pytest.mark.parametrize("source", ["options", "hint"])
def test_A8_a_held_publish_fails_by_its_deadline(kvwire_harness: Harness, source: str) -> None:
    """A8.4 / A8.2 / H1.6: a publish has a deadline too: with its store not answering, it
    concludes failed by the deadline option, or by the hint's ``timeout_s`` when the option is far
    longer (cause ``DEADLINE``, A10.7, for a 1.1 backend), and quiesces within the grace once the store lets
    go; the rows it marked held are found."""
    _fails_by_its_deadline(kvwire_harness, source, "publish")


def _fails_by_its_deadline(harness: Harness, source: str, op: str) -> None:
    """Hold the other end of a ``op`` whose deadline (0.4 s) comes from ``source``, and check it
    fails by then, saying so, and quiesces within the grace once the other end lets go."""
    caps = harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(harness, caps)
    deadline_s = 0.4
    slack_s = 2.0
    plan = simple_plan(groups=1, rows=2, seed=109, shared_names=needs.shares_names(caps))
    options_timeout = deadline_s if source == "options" else needs.LONG_TIMEOUT_S
    with needs.open_exchange(harness, hold=True, timeout_s=options_timeout) as ex, Bench(
            harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        hint = ex.ends.fetch_hint if op == "fetch" else ex.ends.publish_hint
        if source == "hint":
            hint = Hint(hint.kind, hint.fields, deadline_s)
        if op == "publish":
            _store_only(ex)  # a peer's publish answers a pull; the suite cannot hold the requester
        started = time.monotonic()
        sub, hold = ex.held_fetch(bench, hint) if op == "fetch" else ex.held_publish(bench, hint)
        try:
            out = settle(sub, deadline_s + slack_s + profiles.active().patience_s, quiesce=False,
                         purpose=f"A8.2/A8.4: a held {op} must fail by its deadline of {deadline_s:g} s (from the {source})")
        except AssertionError:
            hold.release()
            raise
        took = time.monotonic() - started
        hold.release()
        assert out.is_failed, f"A8: a {op} the other end never answered must fail by its deadline, got {out!r}"
        if speaks_causes(sub.backend):
            assert out.cause is Cause.DEADLINE, f"A10.7: a deadline failure's cause is DEADLINE: {out!r}"
        else:
            assert any(w in (out.reason or "").lower() for w in ("deadline", "timeout", "timed out")), (
                f"A8: the failure must say the deadline passed, said {out.reason!r}")
        assert took <= deadline_s + slack_s, (
            f"A8: the {op}'s deadline was {deadline_s:g} s (from the {source}); it concluded after {took:.2f} s")
        grace = harness.quiesce_grace_s
        quiesced_by = time.monotonic() + grace + slack_s
        settle(sub, grace + slack_s)
        assert time.monotonic() <= quiesced_by, f"A8: quiescence took longer than the documented grace of {grace:g} s"
        assert hold.wait_idle(profiles.active().patience_s)
        if op == "fetch":
            bench.forget_sink()
            bench.apply_fetch(out)
            return
        bench.verify("S2.5: a publish failed by its deadline")
        got = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(got)
        for held, mask in zip(out.masks, got.masks, strict=True):
            assert (mask | ~held).all(), f"A5.12/A7.4: rows the failed publish marked held were not found: {got!r}"


@checks("A8.4", "H1.6")
def test_A8_a_hint_deadline_longer_than_the_option_is_kept(kvwire_harness: Harness) -> None:
    """A8.4 / H1.6: a hint's ``timeout_s`` overrides the deadline option also when it is longer:
    with the other end held past the option's deadline, the attempt is still in flight, and once
    the other end answers it delivers."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    option_s = 0.2
    slack_s = 0.3
    plan = simple_plan(groups=1, rows=2, seed=113, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True, timeout_s=option_s) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        hint = Hint(ex.ends.fetch_hint.kind, ex.ends.fetch_hint.fields, needs.LONG_TIMEOUT_S)
        sub, hold = ex.held_fetch(bench, hint)
        try:
            # Sleep until woken (or the option's deadline and some slack have passed): nothing
            # may conclude, since the hint gave the fetch far longer.
            waited = holding.wait(sub, option_s + slack_s, quiesce=False,
                                  at_deadline=holding.AtDeadline.RETURN)
        finally:
            hold.release()
        assert waited.outcome is None, (
            f"A8.4/H1.6: the hint's timeout_s was {needs.LONG_TIMEOUT_S:g} s and the deadline option "
            f"{option_s:g} s; the hint's deadline overrides the option, also when it is longer, but the fetch concluded "
            f"{waited.outcome!r}")
        out = ex.settle(sub)
        assert out.is_delivered and all(m.all() for m in out.masks), (
            f"A8.4: once the held other end answered, the fetch (hint deadline {needs.LONG_TIMEOUT_S:g} s) must "
            f"deliver every offered row: {out!r}")
        bench.apply_fetch(out)


@checks("A8.2", "H1.6")
@pytest.mark.parametrize("far_s", [1e10, 1e300], ids=["1e10 s", "1e300 s"])
def test_A8_a_far_deadline_leaves_a_near_one_kept(kvwire_harness: Harness, far_s: float) -> None:
    """A8.2 / H1.6: a hint's ``timeout_s`` may be any finite number of seconds. With the other end
    held, a fetch whose deadline is ``far_s`` away stays in flight, and a second fetch on the same
    backend whose deadline is 0.4 s fails by then; once the other end answers, the far one
    delivers. (A deadline thread that hands the far wait to a lock, which refuses waits past
    ``threading.TIMEOUT_MAX``, about 9.2e9 s, dies and keeps no deadline afterwards.)"""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.in_flight(caps, 2)
    kind = needs.usable_kind(kvwire_harness, caps)
    near_s, slack_s = 0.4, 2.0
    plan = simple_plan(groups=1, rows=2, seed=127, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        base = ex.ends.fetch_hint
        ex.offer(bench)
        holds: list[Hold] = []
        if ex.store:
            assert ex.ends.hold is not None
            holds.append(ex.ends.hold())
        try:
            far = ex.fetch(bench.sink_view({0: [0]}), Hint(base.kind, base.fields, far_s))
            if ex.serves_pulls:
                holds.append(PullHold(ex.holder(), ex.holder().take(1)[0]))
            else:
                wait_for(lambda: holds[0].waiting() > 0 or far.wakes.count > 0, profiles.active().patience_s,
                         "A3: the held other end receiving the far fetch")
            started = time.monotonic()
            near = ex.fetch(bench.sink_view({0: [1]}), Hint(base.kind, base.fields, near_s))
            if ex.serves_pulls:
                holds.append(PullHold(ex.holder(), ex.holder().take(1)[0]))
            out = settle(near, near_s + slack_s + profiles.active().patience_s, quiesce=False,
                         purpose=f"A8.2: a fetch with a deadline of {near_s:g} s, beside one whose deadline is "
                                 f"{far_s:g} s away, concluding by its deadline")
            took = time.monotonic() - started
            assert out.is_failed and took <= near_s + slack_s, (
                f"A8.2: beside a fetch whose deadline is {far_s:g} s away, a fetch with a deadline of {near_s:g} s must "
                f"fail by then; it concluded after {took:.2f} s: {out!r}")
            assert far.poll() is None, (
                f"A8.2/H1.6: the fetch whose deadline is {far_s:g} s away concluded while its other end was held: "
                f"{far.poll()!r}")
        finally:
            for hold in holds:
                hold.release()
        got = ex.settle(far)
        assert got.is_delivered and got.masks[0].all(), (
            f"A8.2: once its other end answered, the fetch with a deadline {far_s:g} s away must deliver: {got!r}")
        for hold in holds:
            hold.wait_idle(profiles.active().patience_s)
        ex.settle(near)
        bench.forget_sink()
        bench.apply_fetch(got, {0: [0]})


@checks("A8.6")
def test_A8_a_deadline_failure_marks_only_rows_that_moved_whole(kvwire_harness: Harness) -> None:
    """A8.6: a fetch that fails by its deadline while its other end holds it (a store that holds
    half its rows; a serving peer that never answers) marks true only rows that moved whole
    before the deadline: none the other end lacks, and each with the source's bytes."""
    _ended_fetch_marks_only_moved_rows(kvwire_harness, "deadline", "A8.6", 2221)


# -- A9 ----------------------------------------------------------------------------------------

def _parts(assignments: list[list[int]], count: int) -> list[dict[int, list[int]]]:
    """Split each group's rows over ``count`` parts: row ``r`` of group ``g`` goes to part
    ``assignments[g][r]``. Empty parts are dropped."""
    parts: list[dict[int, list[int]]] = [{} for _ in range(count)]
    for gi, assignment in enumerate(assignments):
        for row, part in enumerate(assignment):
            parts[part].setdefault(gi, []).append(row)
    return [p for p in parts if p]


@checks("A9.1", "A9.2", "A9.3")
def test_A9_batching_and_order_do_not_change_the_result(kvwire_harness: Harness) -> None:
    """The same rows, published in one view or split over several, fetched whole or in parts, in
    any order: the same bits, the same bytes."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    p = profiles.active()

    @profiles.examples()
    @given(plan=view_plans(max_groups=p.max_groups, max_rows=max(p.max_rows, 12), min_rows=1,
                           kinds=(CacheKind.PAGED,)), data=st.data())
    def run(plan: ViewPlan, data: st.DataObject) -> None:
        def split(label: str) -> list[dict[int, list[int]]]:
            assignment = [data.draw(st.lists(st.integers(0, 3), min_size=g.rows, max_size=g.rows), label=f"{label} {gi}")
                          for gi, g in enumerate(plan.groups)]
            parts = _parts(assignment, 4)
            return [{gi: data.draw(st.permutations(rows), label=f"{label} order") for gi, rows in part.items()}
                    for part in parts]

        whole = [{gi: list(range(g.rows)) for gi, g in enumerate(plan.groups)}]
        results = []
        for pub_parts, fetch_parts in ((whole, whole), (split("publish"), split("fetch"))):
            with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                  plan, kind) as bench:
                _store_only(ex)
                for part in pub_parts:
                    ex.settle(ex.publish(bench.source_view(part)))
                bits = [np.zeros(g.rows, dtype=bool) for g in plan.groups]
                for part in fetch_parts:
                    fetched = ex.settle(ex.fetch(bench.sink_view(part)))
                    bench.apply_fetch(fetched, part)
                    for gi, mask in zip(bench.groups_in(part), fetched.masks, strict=True):
                        bits[gi][np.asarray(part[gi], dtype=np.int64)] = mask
                results.append(bits)
        for g, one, many in zip(plan.groups, results[0], results[1], strict=True):
            assert np.array_equal(one, many), (
                f"A9: group {g.group_id}: one view moved rows {np.flatnonzero(one).tolist()}, split views moved "
                f"{np.flatnonzero(many).tolist()}")

    run()


@checks("A9.5")
def test_A9_fetches_of_the_same_rows_in_flight_together_each_get_them(kvwire_harness: Harness) -> None:
    """A9.5: two fetches of the same held rows (the same groups and names, into two sets of
    memory), in flight together on one instance, each get every row: neither passes rows the other
    is fetching for misses."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.misses(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 5), (48, 5)], 619, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True, max_in_flight=2) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench, \
            Bench(kvwire_harness, None, ex.ends.sink, plan, kind) as twin:
        needs.in_flight(ex.caps, 2)
        ex.offer(bench)
        hold = ex.ends.hold() if ex.store and ex.ends.hold is not None else None
        try:
            subs = [ex.fetch(bench.sink_view()), ex.fetch(twin.sink_view())]
        finally:
            if hold is not None:
                hold.release()
        if ex.serves_pulls:
            holder = ex.holder()
            for request in holder.take(2):
                holder.finish(holder.answer(request))
        for which, (sub, b) in enumerate(zip(subs, (bench, twin), strict=True)):
            out = ex.settle(sub)
            b.apply_fetch(out)
            assert out.is_delivered and all(m.all() for m in out.masks), (
                f"A9.5: fetch {which + 1} of two in flight together for the same held rows did not get them all: "
                f"{out!r}; an outcome does not depend on other attempts in flight")


# -- A1.5, A9.4, A9.5 --------------------------------------------------------------------------------

@checks("A1.5", also=("A2.2",))
def test_A1_an_outcome_outlives_shutdown_and_closed_registrations(kvwire_harness: Harness) -> None:
    """A1.5: the outcome an attempt answered stays the same after later work, ``shutdown()`` and
    closing the registrations."""
    from kvwire.testing.holder import same_outcome

    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (8, 3)], 353, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex:
        bench = Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind)
        if ex.store or ex.serves_pulls:
            ex.offer(bench, offer_for(ex, plan, lambda gi, n: range(2)))
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


@checks("A9.4")
def test_A9_the_order_of_groups_does_not_change_the_bits(kvwire_harness: Harness) -> None:
    """A9.4: the same groups in another order in the view: each group's bits are the same."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 5), (16, 5), (3, 5)], 359, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        needs_misses(ex)
        offer = offer_for(ex, plan, lambda gi, n: [r for r in range(n) if (r * (gi + 1)) % 3 != 2])
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


@checks("A9.5")
def test_A9_many_attempts_in_flight_each_get_their_own_rows(kvwire_harness: Harness) -> None:
    """A9.5: up to the queue bound of fetches in flight at once, each of other rows: each outcome
    is exactly its own rows' bits, whatever the others do."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=8) as ex:
        needs_misses(ex)
        count = min(ex.caps.max_in_flight, 8)
        rows_each = 3
        plan = pages([(96, count * rows_each), (8, count * rows_each)], 367, needs.shares_names(caps))
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            n = count * rows_each
            offer = offer_for(ex, plan, lambda gi, m: [r for r in range(m) if r % rows_each != 2])
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
                check_bits(ex, bench, offer, take, out, "A9.5")


MiB = 1 << 20


def _spin_until_quiesced(sub: Submission, what: str) -> None:
    """Ask ``quiesced()`` as often as it takes (a holder may), to act the moment it turns true."""
    deadline = time.monotonic() + profiles.active().patience_s
    while not sub.quiesced():
        assert time.monotonic() < deadline, f"A2.5: {what} did not quiesce within the suite's patience"
        time.sleep(0)


# -- A2 / W1 at a held attempt's end ----------------------------------------------------------------

@checks("A2.3", "A2.2")
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
            bench.write_sink(None, SENTINEL_3C)  # taken at its word while the other end still holds the call
        hold.release()
        ex.settle(sub, purpose=f"W1.3: the quiescence after the {ending} wakes the holder")
        if not early:
            bench.write_sink(None, SENTINEL_3C)
        assert isinstance(hold, Hold) and hold.wait_idle(patience), "the other end did not go idle after release"
        # More work through the same backends: a writer of the ended fetch still running lands now.
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, pages([(4096, 4), (64, 4)], 402, plan.shared_names),
                   kind) as later:
            ex.transfer(later)
        bench.verify(f"A2.3: the fetch ended by its {ending} had said it quiesced, and the holder reused its rows")
        assert not out.is_delivered, f"A4/A8: the {ending} of a held fetch must not deliver: {out!r}"


@checks("A2.2")
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


# -- A2 at the serving end -----------------------------------------------------------------------------

@checks("A2.4")
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
    for trial, value in enumerate((SENTINEL_3C, SENTINEL_3C ^ 0xFF, SENTINEL_3C ^ 0x55)):
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


@checks("A2.4")
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
        bench.write_source(None, SENTINEL_3C)
        ex.settle(sub)
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(fetched)
        assert all(m.all() for m in fetched.masks), f"S1: {fetched!r}"


@checks("A8.2")
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


# -- faults --------------------------------------------------------------------------------------------------

@checks("A5.9", also=("A10.9",))
@pytest.mark.parametrize("where", ["last group", "every group"])
def test_A5_a_fault_in_any_group_fails_the_fetch(kvwire_harness: Harness, where: str) -> None:
    """A5.9: a fault at the other end for a row of any group, not only the first, fails the fetch
    (with cause ``FAULT``, A10.9, for a 1.1 backend); that row is false and never passes as a
    miss."""
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


@checks("A5.11", also=("A5.6",))
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


# -- A5.10: an answer stopped between its offer and its last row ---------------------------------------------

@checks("A5.10", "A5.9", "A4.3", "A2.4")
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


@checks("A1.1", "A2.1")
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

@checks("A2.3", "A2.5")
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


# -- A5.11: a store that is really full ------------------------------------------------------------------

@checks("A5.11", "A5.8", "S1.3", also=("S1.2", "A5.6"))
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


@checks("A9.2", "A7.1", "A9.4", also=("S1.3", "S2.4"))
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


# -- deadlines ------------------------------------------------------------------------------------

@checks("A8.1")
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
        plan = pages([(64, count)], 241, needs.shares_names(caps))
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


# -- A2 with large rows -------------------------------------------------------------------------------

@checks("A2.3", "A2.4")
def test_A2_large_rows_are_left_alone_once_quiesced(kvwire_harness: Harness) -> None:
    """A2.3 / A2.4: with rows of 1 MiB, once a publish says it quiesced the holder overwrites its
    rows and the other end still holds them as offered; once a fetch says it quiesced the holder
    overwrites its rows and nothing changes them afterwards."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(MiB, 6), (4096, 6)], 281, needs.shares_names(caps))
    after = pages([(MiB, 6), (4096, 6)], 283, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, after, kind) as later:
        if ex.store:
            sub = ex.publish(bench.source_view())
            ex.settle(sub)
            bench.write_source(None, SENTINEL_A5)  # as soon as it quiesced
        elif ex.serves_pulls:
            ex.offer(bench)
        fetch = ex.fetch(bench.sink_view())
        if ex.serves_pulls:
            holder = ex.holder()
            (request,) = holder.take(1)
            answer = holder.answer(request)
            holder.finish(answer)
            bench.write_source(None, SENTINEL_A5)
        out = ex.settle(fetch)
        # The holder reuses the rows the moment the fetch quiesced (A2.3): it takes what arrived,
        # then overwrites the rows, before anything else. A writer still copying the last chunk of
        # a large fetch would land on the holder's bytes.
        arrived = [bench.sink.memories[gi].read(bench.sink.slots[gi]) for gi in range(len(plan.groups))]
        bench.write_sink(None, SENTINEL_A5)
        assert out.is_delivered and all(m.all() for m in out.masks), f"S1: {out!r}"
        for gi, got in enumerate(arrived):
            wrong = np.flatnonzero((got != bench.data[gi]).any(axis=1))
            assert wrong.size == 0, (
                f"A7.1: row(s) {wrong[:8].tolist()} of group {plan.groups[gi].group_id} are marked delivered but "
                "held other bytes than the source's when the fetch quiesced")
        # More work of the same size through the same backends: a writer still running would land now.
        ex.transfer(later)
        bench.verify("A2.3: the fetch had quiesced, and the holder then reused its rows; something still "
                     "wrote them")


# -- A5.10: a name asked twice in one fetch ------------------------------------------------------------


@checks("A5.10", "N1.1", "A9.1")
def test_A5_a_name_asked_twice_in_one_fetch_fills_both_rows(kvwire_harness: Harness) -> None:
    """A5.10 / N1.1 / A9.1: equal names in one group name interchangeable bytes, so a store fetch
    may ask one name on several rows (into distinct slots): every such row of a held name is a
    true bit and holds the published bytes, however the backend batches its gets."""
    with paged_exchange(kvwire_harness, [(64, 3), (40, 2)], 811, needs.transfer, needs.names, shared=False,
                        spare=3) as (_, ex, bench):
        store_only(ex, "a fetch naming one block on several rows")
        ex.offer(bench)
        asked = ([0, 1, 0, 2, 1], [1, 1, 0])  # per group: which published row each fetched row names
        used = [set(bench.sink.slots[gi].tolist()) for gi in range(2)]
        slots = [np.array([s for s in range(g.region_slots) if s not in used[gi]][: len(asked[gi])], dtype=np.int64)
                 for gi, g in enumerate(bench.plan.groups)]
        groups = []
        for gi, g in enumerate(bench.plan.groups):
            rows = np.asarray(asked[gi], dtype=np.int64)
            groups.append(LayerGroupRows(g.group_id, CacheKind.PAGED, bench.sink.memories[gi].region, slots[gi],
                                         TokenRange(0, rows.size * BLOCK_TOKENS), bench.names[gi][rows]))
        out = ex.settle(ex.fetch(View(tuple(groups))))
        assert out.is_delivered and all(m.all() for m in out.masks), (
            f"A5.10: every name of this fetch is held (groups {[g.group_id for g in bench.plan.groups]} ask rows "
            f"{list(asked)}, some twice), so every row is a true bit; got {out!r}")
        for gi, g in enumerate(bench.plan.groups):
            want = bench.data[gi][np.asarray(asked[gi])]
            got = bench.sink.memories[gi].read(slots[gi])
            wrong = np.flatnonzero((got != want).any(axis=1))
            assert wrong.size == 0, (
                f"A7.1/A5.10: group {g.group_id}: fetched row(s) {wrong.tolist()} (naming published rows "
                f"{[asked[gi][i] for i in wrong.tolist()]}) do not hold the bytes published under their name")
            bench.sink.model[gi][slots[gi]] = want
        bench.verify("S2: after a fetch naming some blocks twice")


# -- A4.6 / A4.2: cancel() of a fetch that concluded but has not quiesced ----------------------------------


@checks("A4.6", "A1.3", also=("A8.2",))
def test_A4_cancel_of_a_fetch_that_failed_by_its_deadline_changes_nothing(kvwire_harness: Harness) -> None:
    """A4.6 / A1.3: a fetch its other end holds fails by its deadline; ``cancel()`` (twice)
    afterwards, while the other end still holds the call and the fetch may not have quiesced,
    changes nothing: the same failed outcome (cause ``DEADLINE`` for 1.1), before and after it
    quiesces."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=2, seed=831, shared_names=needs.shares_names(caps))
    deadline_s = 0.4
    patience = profiles.active().patience_s
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        hint = Hint(ex.ends.fetch_hint.kind, ex.ends.fetch_hint.fields, deadline_s)
        sub, hold = ex.held_fetch(bench, hint)
        try:
            out = settle(sub, deadline_s + 2.0 + patience, quiesce=False,
                         purpose=f"A8.2: a held fetch must fail by its deadline of {deadline_s:g} s")
            assert out.is_failed, f"A8.2: a fetch its other end never answered fails by its deadline: {out!r}"
            for call in ("cancel()", "a second cancel()"):
                call_briefly(sub.attempt.cancel, f"A4.1: {call} of a fetch that failed by its deadline",
                             on_block=hold.release)
                later = call_briefly(sub.attempt.poll, "A1.1: poll()", on_block=hold.release)
                assert later is not None, f"A1.4: poll() answered None after {call}, after it had answered {out!r}"
                try:
                    same_outcome(out, later, "fetch")
                except AssertionError as exc:
                    raise AssertionError(
                        f"A4.6: {call} after the fetch failed by its deadline (its other end still holding the call) "
                        f"changed its outcome: {exc}") from None
        finally:
            hold.release()
        ex.settle(sub, purpose="A8.3: the failed fetch quiescing once its other end let go")
        same_outcome(out, sub.attempt.poll(), "fetch")  # type: ignore[arg-type]
        assert isinstance(hold, Hold) and hold.wait_idle(patience), "the other end did not go idle after release"
        bench.forget_sink()
        bench.apply_fetch(out)


@checks("A4.2", "A2.3", "A4.5", also=("A4.3",))
def test_A4_a_second_cancel_changes_nothing_the_first_did_not(kvwire_harness: Harness) -> None:
    """A4.2 / A2.3 / A4.5: ``cancel()`` twice does what once does: a fetch its other end holds,
    cancelled and concluded, then cancelled again, says it quiesced only once nothing will write
    its rows again, also while its other end still holds the call."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.cancellation(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(4096, 4), (64, 4)], 841, needs.shares_names(caps))
    patience = profiles.active().patience_s
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        sub, hold = ex.held_fetch(bench)
        try:
            call_briefly(sub.attempt.cancel, "A4.1: cancel()", on_block=hold.release)
            out = settle(sub, patience, quiesce=False, purpose="A4.3/A4.4: cancel() concluding the held fetch")
            call_briefly(sub.attempt.cancel, "A4.1/A4.2: a second cancel() of the cancelled fetch", on_block=hold.release)
            same_outcome(out, sub.attempt.poll(), "fetch")  # type: ignore[arg-type]
            early = sub.quiesced()
            if early:
                bench.write_sink(None, SENTINEL_6B)  # taken at its word while the other end still holds the call
        finally:
            hold.release()
        ex.settle(sub, purpose="A4.5: the cancelled fetch quiescing once its other end let go")
        if not early:
            bench.write_sink(None, SENTINEL_6B)
        assert isinstance(hold, Hold) and hold.wait_idle(patience), "the other end did not go idle after release"
        # More work through the same backends: a writer of the cancelled fetch still running lands now.
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, pages([(4096, 4), (64, 4)], 842, plan.shared_names),
                   kind) as later:
            ex.transfer(later)
        bench.verify("A4.2/A2.3: after a second cancel() the fetch had said it quiesced, and the holder reused its rows")
        assert out.is_cancelled, f"A4.3: cancel() before the conclusion yields a cancelled outcome: {out!r}"


# -- A10: the cause an outcome carries, by its status -------------------------------------------

@checks("A10.2")
def test_A10_a_delivered_outcome_has_no_cause(kvwire_harness: Harness) -> None:
    """A10.2: a delivered fetch, and the delivered publish it fetched from (to a store, or a
    serving peer's answer), carry no cause."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=2219, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        result = ex.transfer(bench)
        for what, out in (("publish", result.published), ("fetch", result.fetched)):
            if out is None:
                continue
            assert out.is_delivered, f"A5: a {what} of rows the other end takes must deliver: {out!r}"
            assert out.cause is None, f"A10.2: a delivered {what} has no cause; got cause {out.cause!r}"


@checks("A10.3", "A10.5")
@pytest.mark.parametrize("failure", ["deadline", "fault", "declined"])
def test_A10_a_failed_outcome_has_a_failure_cause(kvwire_harness: Harness, failure: str) -> None:
    """A10.3 / A10.5: a failed fetch carries a cause, one of ``DEADLINE``, ``FAULT``,
    ``PEER_GONE``, ``DECLINED`` or ``SHUTDOWN``: one its other end held past the hint's deadline,
    one a fault at a store failed, and one a serving peer's holder declined."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    deadline_s = 0.4
    patience = profiles.active().patience_s
    plan = pages([(64, 3)], 2227, needs.shares_names(caps))
    probe = Bench(kvwire_harness, None, None, plan, kind)
    faulty = probe.names[0][1].tobytes()
    probe.close()
    if failure == "fault" and caps.other_end is not OtherEnd.STORE:
        pytest.skip("backend's other end is a peer; the harness injects faults at a store")
    if failure == "declined":
        needs.serve_pulls(caps)
    faults = FaultPlan(fetch=frozenset({faulty})) if failure == "fault" else None
    with needs.open_exchange(kvwire_harness, hold=failure == "deadline", faults=faults) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        if failure == "deadline":
            if not (ex.store or ex.serves_pulls):
                pytest.skip("backend's other end is a peer without the serve-pulls protocol; the suite cannot hold it")
            sub, hold = ex.held_fetch(bench, Hint(ex.ends.fetch_hint.kind, ex.ends.fetch_hint.fields, deadline_s))
            try:
                out = settle(sub, deadline_s + patience, quiesce=False,
                             purpose=f"A8.2: the held fetch failing by its deadline of {deadline_s:g} s")
            finally:
                hold.release()
            ex.settle(sub)
            hold.wait_idle(patience)
        elif failure == "fault":
            ex.offer(bench)
            out = ex.settle(ex.fetch(bench.sink_view()))
        else:
            ex.offer(bench)
            sub = ex.fetch(bench.sink_view())
            holder = ex.holder()
            (request,) = holder.take(1)
            holder.decline(request, "conformance: declined on purpose")
            out = ex.settle(sub)
        bench.forget_sink()
        bench.apply_fetch(out)
        assert out.is_failed, f"A10: the fetch ({failure}) must fail, got {out!r}"
        assert out.cause is not None, (
            f"A10.5: the backend declares contract 1.1 or later, so its failed fetch ({failure}) carries a cause; got "
            f"{out!r}")
        assert out.cause in (Cause.DEADLINE, Cause.FAULT, Cause.PEER_GONE, Cause.DECLINED, Cause.SHUTDOWN), (
            f"A10.3: a failed outcome's cause is DEADLINE, FAULT, PEER_GONE, DECLINED or SHUTDOWN; the fetch "
            f"({failure}) has {out.cause!r}")


@checks("A10.4")
@pytest.mark.parametrize("ending", ["cancel", "shutdown"])
def test_A10_a_cancelled_outcome_has_a_cancel_cause(kvwire_harness: Harness, ending: str) -> None:
    """A10.4: a fetch its other end holds, ended by the holder's ``cancel()`` or by ``shutdown()``,
    concludes; when it concludes cancelled, its cause is ``HOLDER_CANCELLED``, ``PEER_CANCELLED``
    or ``SHUTDOWN``, ``PEER_CANCELLED`` exactly when ``by_peer`` is true (neither ending is the
    peer's)."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    if ending == "cancel":
        needs.cancellation(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    patience = profiles.active().patience_s
    plan = pages([(64, 3)], 2237, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        if not (ex.store or ex.serves_pulls):
            pytest.skip("backend's other end is a peer without the serve-pulls protocol; the suite cannot hold it")
        sub, hold = ex.held_fetch(bench)
        try:
            if ending == "cancel":
                call_briefly(sub.attempt.cancel, "A4.1: cancel()", on_block=hold.release)
            else:
                call_briefly(ex.ends.sink.shutdown, "B3: shutdown()", limit_s=patience, on_block=hold.release)
            out = settle(sub, patience, quiesce=False, purpose=f"A4.3/B3.2: the held fetch concluding after {ending}")
        finally:
            hold.release()
        ex.settle(sub)
        hold.wait_idle(patience)
        bench.forget_sink()
        bench.apply_fetch(out)
        if ending == "cancel":
            assert out.is_cancelled, f"A4.3: cancel() of a held fetch concludes it cancelled, got {out!r}"
        if out.is_cancelled:
            assert out.cause in (Cause.HOLDER_CANCELLED, Cause.PEER_CANCELLED, Cause.SHUTDOWN), (
                f"A10.4: a cancelled outcome's cause is HOLDER_CANCELLED, PEER_CANCELLED or SHUTDOWN; the fetch ended "
                f"by {ending} has {out.cause!r}")
            assert (out.cause is Cause.PEER_CANCELLED) == bool(out.by_peer), (
                f"A10.4: a cancelled outcome's cause is PEER_CANCELLED exactly when by_peer is true: {out!r}")


# -- A10.11: a pull from a serving end that is gone ----------------------------------------------

@checks("A10.11")
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


# -- sizes and shapes ---------------------------------------------------------------------------

@checks("A7.1")
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
        plan = pages(specs, seed=sum(sizes) + rows, shared=shared)
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                              plan, kind) as bench:
            result = ex.transfer(bench)
            assert result.fetched.is_delivered and all(m.all() for m in result.fetched.masks), (
                f"A5/A7: rows of {sizes} bytes did not all arrive: {result.fetched!r}")

    run()


@checks("A9.6")
def test_A9_views_of_thousands_of_rows_and_many_groups(kvwire_harness: Harness) -> None:
    """A9.6: a view's size does not change what moves: 3 groups of 1500 rows, and 16 groups,
    each with held and missing rows in place."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    shared = needs.shares_names(caps)
    for specs, seed in (([(8, 1500), (24, 1500), (1, 1500)], 211), ([(16 + g, 24) for g in range(16)], 223)):
        plan = pages(specs, seed, shared)
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                              plan, kind) as bench:
            if ex.store or ex.serves_pulls:
                offer = offer_for(ex, plan, lambda gi, n: [r for r in range(n) if (r + gi) % 3 != 1]
                                   if ex.store else range(n * 3 // 4))
            else:
                offer = None
            transfer_checked(ex, bench, offer, None, "A9.6")


@checks("A9.2", "A9.3")
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
        plan = pages([(data.draw(st.sampled_from([3, 64, 200])), rows) for _ in range(groups)],
                     data.draw(st.integers(0, 2**31)), shared)
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                              plan, kind) as bench:
            needs_misses(ex)
            offer = offer_for(ex, plan, lambda gi, n: data.draw(
                st.lists(st.integers(0, n - 1), unique=True, min_size=1, max_size=n - 1), label=f"held {gi}"))
            if ex.serves_pulls:
                # One pull, its blocks in a drawn order: the served prefix is the held names'
                # run from the start of that order.
                order = data.draw(st.permutations(range(rows)), label="order")
                take = {gi: list(order) for gi in range(groups)}
                transfer_checked(ex, bench, offer, take, "A9.2")
                return
            ex.offer(bench, offer)
            parts = data.draw(st.integers(1, 3), label="parts")
            for part in range(parts):
                take = {gi: data.draw(st.permutations([r for r in range(g.rows) if r % parts == part]),
                                      label=f"part {part} of {gi}") for gi, g in enumerate(plan.groups)}
                fetched = ex.settle(ex.fetch(bench.sink_view(take)))
                bench.apply_fetch(fetched, take)
                check_bits(ex, bench, offer, take, fetched, "A9.2")

    run()


# -- publish masks ---------------------------------------------------------------------------------

@checks("A5.6", "A5.11", also=("A5.4",))
def test_A5_a_publish_counts_rows_the_store_already_holds(kvwire_harness: Harness) -> None:
    """A5.6 / A5.11: a publish's mask marks the rows the other end holds once it concluded, those it held
    before included."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 5), (128, 5)], 233, shared=False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "a publish's mask of held rows")
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


@checks("A5.6", "A5.9", "S1.3", also=("A5.3",))
def test_A5_publish_masks_say_exactly_what_the_store_holds(kvwire_harness: Harness) -> None:
    """A5.6 / A5.9 / S1.3: with faults on some names, a row the publish marks true is found by a fetch,
    and a row that faulted is marked false and not found."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 6), (40, 6)], 239, shared=False)
    probe = Bench(kvwire_harness, None, None, plan, kind)
    faulty = {probe.names[0][3].tobytes(), probe.names[1][1].tobytes()}
    try:
        with needs.open_exchange(kvwire_harness, faults=FaultPlan(publish=frozenset(faulty))) as ex, Bench(
                kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            store_only(ex, "a publish's mask of held rows")
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
