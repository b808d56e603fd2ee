"""A1-A9: what an attempt answers, when, and what its outcome means.

One file for the attempt's rules, as each suite file holds one group of rules; it is over 600
lines because A3, A4 and A8 each run for fetch and publish, small and many-row views, and A6 and
A9 are checked again for a failed fetch's masks and for fetches of the same rows in flight."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import CacheKind, Cause, Hint, Outcome
from kvwire.contract.capabilities import OtherEnd
from kvwire.runtime import holding
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import FaultPlan, Harness, Hold, shut_down
from kvwire.testing.holder import Submission, call_briefly, same_outcome, settle, speaks_causes, wait_for
from kvwire.testing.layout import Bench, ViewPlan, simple_plan
from kvwire.testing.plans import pages
from kvwire.testing.serving import PullHold
from kvwire.testing.strategies import view_plans

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

@pytest.mark.parametrize("op", ["fetch", "publish"])
def test_A4_cancel_is_idempotent_yields_cancelled_and_still_quiesces(kvwire_harness: Harness, op: str) -> None:
    """A4.1-A4.3, A4.5: cancel() twice on a fetch or a publish the other end holds: it
    concludes CANCELLED, not by the peer (cause HOLDER_CANCELLED, A10.6, for a 1.1 backend), still
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


# -- A5 ----------------------------------------------------------------------------------------

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
        out = ex.settle(ex.fetch(bench.sink_view()))
        assert out.is_failed, f"A5: a fault at the other end must fail the fetch, not pass as a miss: {out!r}"
        assert not out.masks[0][2], "A5/A7: the row that faulted is marked delivered"
        bench.apply_fetch(out)


# -- A6 ----------------------------------------------------------------------------------------

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


# -- A8 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["options", "hint"])
def test_A8_a_held_attempt_fails_by_its_deadline(kvwire_harness: Harness, source: str) -> None:
    """With the other end not answering, the attempt concludes failed by its deadline (from the
    backend's options, or from the hint) with a reason that says so, and quiesces within the
    backend's documented grace once the other end lets go."""
    _fails_by_its_deadline(kvwire_harness, source, "fetch")


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


# -- A9 ----------------------------------------------------------------------------------------

def _parts(assignments: list[list[int]], count: int) -> list[dict[int, list[int]]]:
    """Split each group's rows over ``count`` parts: row ``r`` of group ``g`` goes to part
    ``assignments[g][r]``. Empty parts are dropped."""
    parts: list[dict[int, list[int]]] = [{} for _ in range(count)]
    for gi, assignment in enumerate(assignments):
        for row, part in enumerate(assignment):
            parts[part].setdefault(gi, []).append(row)
    return [p for p in parts if p]


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
