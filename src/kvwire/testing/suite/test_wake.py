"""W1: wakes. The suite's tests of the wake rule: a wake follows every visible change, never comes
from inside the holder's own calls, and a wake that raises does not stop the backend."""

from __future__ import annotations

import time

import pytest

from kvwire.contract import (
    Hint,
    PullRequest,
    View,
)
from kvwire.holding import Direction
from kvwire.testing import needs, profiles
from kvwire.testing.harness import Harness, shut_down
from kvwire.testing.holder import (
    RaisingWakes,
    Submission,
    call_briefly,
    settle,
    wait_for,
)
from kvwire.testing.layout import Bench, simple_plan
from kvwire.testing.marks import checks
from kvwire.testing.plans import (
    paged_exchange,
    pages,
)
from kvwire.testing.suite._kit import _pulls

# -- W1.6, W1.7 ----------------------------------------------------------------------------------------

@checks("W1.6")
def test_W1_registration_and_capabilities_never_wake_from_inside(kvwire_harness: Harness) -> None:
    """W1.6: ``register_regions()``, ``Registration.close()`` and ``capabilities()`` are calls the
    holder makes too: while a fetch is in flight (held at its other end), none of them calls the
    fetch's wake (or any other) from inside itself, on the holder's thread."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 379, needs.shares_names(caps))
    patience = profiles.active().patience_s
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        other = Bench(kvwire_harness, None, None, plan, kind)  # memory no attempt uses, not yet registered
        sub, hold = ex.held_fetch(bench)
        try:
            for backend, memories in ((ex.ends.sink, other.sink.memories), (ex.ends.source, other.source.memories)):
                regions = [m.region for m in memories]
                registration = call_briefly(lambda: backend.register_regions(regions),  # noqa: B023
                                            "W1.6: register_regions() while a fetch is in flight", patience,
                                            on_block=hold.release)
                call_briefly(backend.capabilities, "W1.6: capabilities() while a fetch is in flight",
                             on_block=hold.release)
                call_briefly(registration.close, "W1.6: Registration.close() while a fetch is in flight", patience,
                             on_block=hold.release)
        finally:
            hold.release()
        out = ex.settle(sub)  # fails naming W1.6 if a wake came from inside any of those calls
        assert hold.wait_idle(patience)
        bench.forget_sink()
        bench.apply_fetch(out)


@checks("W1.6")
def test_W1_close_never_wakes_from_inside(kvwire_harness: Harness) -> None:
    """W1.6: ``close()`` is a call the holder makes too: once ``shutdown()`` returned the empty set
    and the registrations are closed, ``close()`` calls no wake of the attempts the instance made
    from inside itself."""
    with paged_exchange(kvwire_harness, [(64, 2)], 383, needs.transfer) as (_, ex, bench):
        subs: list[Submission] = []
        if ex.serves_pulls:
            ex.offer(bench)
        else:
            subs.append(ex.publish(bench.source_view()))
            if ex.store:
                ex.settle(subs[-1])
        fetch = ex.fetch(bench.sink_view())
        subs.append(fetch)
        if ex.serves_pulls:
            holder = ex.holder()
            (request,) = holder.take(1)
            answer = holder.answer(request)
            holder.finish(answer)
            assert answer.publish is not None
            subs.append(answer.publish)
        for sub in subs:
            ex.settle(sub)
        bench.apply_fetch(fetch.outcome)  # type: ignore[arg-type]
        bench.close()
        for backend in ex.ends.backends:
            shut_down(backend, timeout_s=max(10.0, kvwire_harness.quiesce_grace_s))
            call_briefly(backend.close, "W1.6: close() once shutdown() returned the empty set", limit_s=10.0)
        for sub in subs:
            assert not sub.wakes.inside, (
                f"W1.6: the backend called the {sub.op}'s wake from inside {sub.wakes.inside[0]}, a call the holder "
                "made to it; a holder may hold a lock its wake takes while it calls the backend")


# -- W1.7 ----------------------------------------------------------------------------------------------

@checks("W1.7")
def test_W1_a_wake_that_raises_does_not_stop_the_backend(kvwire_harness: Harness) -> None:
    """W1.7: a wake that raises is survived: the attempt still concludes and quiesces, and the
    backend goes on working."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3)], 373, needs.shares_names(caps))

    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        if not (ex.store or ex.serves_pulls):
            pytest.skip("backend's other end is a peer without the serve-pulls protocol")
        ex.offer(bench)
        wake = RaisingWakes()
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


@checks("W1.7", "W1.3")
def test_W1_a_raising_wake_is_called_again_for_a_later_quiescence(kvwire_harness: Harness) -> None:
    """W1.7 / W1.3: a wake that raised is not dropped: a held fetch fails by its deadline (its wake
    raises), and the quiescence that follows once the other end lets go comes with a wake too."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 389, needs.shares_names(caps))
    deadline_s = 1.5  # the serving holder takes the pull first; a loaded CI host needs the time
    patience = profiles.active().patience_s
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        hint = Hint(ex.ends.fetch_hint.kind, ex.ends.fetch_hint.fields, deadline_s)
        sub, hold = ex.held_fetch(bench, hint, RaisingWakes())
        try:
            out = settle(sub, deadline_s + patience, quiesce=False, purpose="A8: the held fetch failing by its deadline")
        finally:
            hold.release()
        # settle() fails naming W1 if the quiescence after the release comes without a wake.
        ex.settle(sub, purpose="A8.3: the fetch quiescing once the other end let go")
        assert hold.wait_idle(patience)
        bench.forget_sink()
        bench.apply_fetch(out)


@checks("W1.3", also=("W1.2",))
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


# -- W1 ----------------------------------------------------------------------------------------

@checks("W1.1", "W1.2", "W1.3")
def test_W1_a_wake_follows_every_visible_change(kvwire_harness: Harness) -> None:
    """A holder that looks only after wakes sees every conclusion and every quiescence: after
    each wake it polls, and the last change is always followed by a wake."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=6, seed=131, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        for select in (None, {0: [1, 2]}, {1: [0]}):
            # settle() looks only after wakes and fails naming W1 if a change came without one.
            result = ex.transfer(bench, select if ex.store else None, None)
            assert result.fetched is not None
        # W1.2: an attempt with nothing to move (no groups, or groups without rows) may conclude
        # at once, and a wake still follows (settle() waits for one).
        empty: list[tuple[str, View]] = []
        if ex.store or not ex.serves_pulls:
            empty.append(("publish", View(())))
        if ex.store:
            empty += [("publish", bench.source_view({0: [], 1: []})), ("fetch", View(())),
                      ("fetch", bench.sink_view({0: [], 1: []}))]
        for op, view in empty:
            sub = ex.publish(view) if op == "publish" else ex.fetch(view)
            assert ex.settle(sub).is_delivered, f"V1.7: a {op} of {len(view.groups)} groups without rows: {sub.outcome!r}"


@checks("W1.2", "W1.3")
def test_W1_wakes_come_for_changes_while_held(kvwire_harness: Harness) -> None:
    """Attempts that conclude while their other end is held (by cancellation) and quiesce once it
    lets go: a wake follows each change."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=1, rows=3, seed=137)
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        if not ex.store:
            pytest.skip("backend's other end is a peer; holding is exercised through a store")
        assert ex.ends.hold is not None
        hold = ex.ends.hold()
        pub = ex.publish(bench.source_view())
        wait_for(lambda: hold.waiting() > 0 or pub.wakes.count > 0, profiles.active().patience_s,
                 "the held store receiving the publish")
        seen = pub.wakes.count
        if caps.cancellation:
            pub.attempt.cancel()
            settle(pub, profiles.active().patience_s, quiesce=False)
        hold.release()
        settle(pub, profiles.active().patience_s)
        assert pub.wakes.count > seen, "W1: no wake followed the publish's conclusion and quiescence"


# -- W1 for serving peers ----------------------------------------------------------------------------

@checks("W1.4")
def test_W1_every_pull_request_is_followed_by_a_wake(kvwire_harness: Harness) -> None:
    """W1.4: pulls that arrive together are each announced: the serving holder, looking only after
    wakes, sees every one of them."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    count = 5
    plan = pages([(64, count)], 293, True)
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


@checks("W1.4", "N2.4", "W1.7")
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


# -- the serving holder's calls, tickets and credentials (W1.6, H1.3, H1.12, H1.13) -----------

def _by_block(requests: list[PullRequest], bench: Bench) -> list[PullRequest]:
    """``requests`` of one-block pulls, in the order of the bench's rows they name."""
    rows = {bench.names[0][row].tobytes(): row for row in range(bench.plan.groups[0].rows)}
    return sorted(requests, key=lambda r: rows[r.names[0].tobytes()])


@checks("W1.6", also=("N2.11",))
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
