"""kvwire-ucx's standing offers (contract O1): two backends in one process, real UCX endpoints on
loopback. The serving holder offers blocks in advance; pulls of them are answered by the serving
progress thread, and never reach the holder's ``incoming()``. (The conformance suite checks the
protocol's clauses on every backend that declares it; these tests check what is kvwire-ucx's
own: its counters, its wire, a flood of pulls, the holder fallback beside an offer.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvwire.testing.require import backend_module

backend_module("ucxx._lib.libucxx", "ucx", "ucxx-cu12==0.52.0")  # skips, or fails when the run requires ucx

from kvwire_ucx import wire  # noqa: E402
from kvwire_ucx.faults import FrameFlow  # noqa: E402
from test_ucx_pull import check_rows, ends  # noqa: E402
from ucx_holders import Requester, block_names  # noqa: E402

from kvwire.contract import (  # noqa: E402
    OFFER_PULLS,
    Attempt,
    Cause,
    InvalidSubmission,
    OutcomeStatus,
    SubmissionRejected,
)

GROUPS = (0, 1)
SLOT = 8192


class Wake:
    """A wake that counts, and a wait on a condition with a deadline."""

    def __init__(self) -> None:
        self.calls = 0
        self._cond = threading.Condition()

    def __call__(self) -> None:
        with self._cond:
            self.calls += 1
            self._cond.notify_all()

    def until(self, condition: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not condition():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True


def offer(e, slots, names, timeout_s: float | None = None) -> tuple[Attempt, Wake]:
    wake = Wake()
    return e.a.offer(e.pa.view(slots, names), wake, timeout_s), wake


def pull(e, names, timeout_s: float | None = None, requester: Requester | None = None):
    req = requester or e.req
    attempt, slots = req.fetch(e.a.address(), names, timeout_s)
    return req.wait(attempt, slots, 10), slots


def test_declares_offer_pulls(make_backend) -> None:
    assert OFFER_PULLS in make_backend().capabilities().protocols


def test_an_offered_prompt_is_pulled_without_the_holder_and_the_offer_ends_at_its_deadline(make_backend,
                                                                                            holders) -> None:
    e = ends(make_backend, holders, GROUPS, 8, SLOT)
    attempt, wake = offer(e, list(range(8)), e.names, timeout_s=1.5)
    for names in (e.names, e.names[:3]):  # the whole prompt, then a prefix of it
        for rows in e.pb.arrays:
            rows[...] = 0
        outcome, slots = pull(e, names)
        assert outcome.is_delivered and [m.tolist() for m in outcome.masks] == [[True] * len(names)] * 2
        check_rows(e.pb, slots, names)
    assert e.holder.requests_seen == 0, "an offered pull reached the holder"
    stats = e.a.stats()
    assert stats.pulls_received == stats.pulls_offered == 2
    assert attempt.poll() is None and not attempt.quiesced(), "the offer ended before its deadline"
    assert wake.until(lambda: attempt.quiesced(), 10)
    outcome = attempt.poll()
    assert outcome is not None and outcome.is_delivered and all(m.all() for m in outcome.masks)
    # once it ended, the holder answers the same pull from its reuse tree
    outcome, slots = pull(e, e.names[:4])
    assert outcome.is_delivered and e.holder.requests_seen == 1
    check_rows(e.pb, slots, e.names[:4])
    assert e.a.stats().pulls_offered == 2


def test_a_pull_an_offer_does_not_cover_whole_goes_to_the_holder(make_backend, holders) -> None:
    e = ends(make_backend, holders, GROUPS, 8, SLOT)
    attempt, _ = offer(e, [0, 1, 2], e.names[:3])
    outcome, slots = pull(e, e.names[:5])  # two blocks beyond the offer: the holder holds them
    assert outcome.is_delivered and outcome.rows_delivered == 10
    check_rows(e.pb, slots, e.names[:5])
    assert e.holder.requests_seen == 1 and e.a.stats().pulls_offered == 0
    outcome, slots = pull(e, [e.names[2], e.names[0]])  # out of order, both offered: the offer answers
    assert outcome.is_delivered and e.holder.requests_seen == 1 and e.a.stats().pulls_offered == 1
    check_rows(e.pb, slots, [e.names[2], e.names[0]])
    attempt.cancel()
    assert attempt.poll().status is OutcomeStatus.CANCELLED
    assert e.tree.wait_unpinned(5)


def test_cancelling_an_offer_ends_an_answer_mid_flight_and_the_offer_quiesces(make_backend, holders) -> None:
    e = ends(make_backend, holders, GROUPS, 8, SLOT)
    attempt, wake = offer(e, list(range(8)), e.names)
    hold = e.b.engine.faults.hold(FrameFlow.OUTGOING, lambda m: isinstance(m, wire.Ack))  # the pull never finishes
    fetch, slots = e.req.fetch(e.a.address(), e.names, 10)
    assert wake.until(lambda: e.a.stats().pulls_offered == 1, 5)
    assert wake.until(lambda: e.b.stats().rows_received >= 16, 5)  # the rows are in; the Ack is held back
    assert not attempt.quiesced(), "the offer quiesced while an answer was still open"
    attempt.cancel()
    outcome = attempt.poll()
    assert outcome is not None and outcome.status is OutcomeStatus.CANCELLED and outcome.cause is Cause.HOLDER_CANCELLED
    assert not any(m.any() for m in outcome.masks)
    assert wake.until(lambda: attempt.quiesced(), 10), "the cancelled offer never quiesced"
    hold.release()
    e.req.wait(fetch, slots, 10)  # the requester's fetch ends whichever way the race went, and quiesces
    assert e.holder.requests_seen == 0


def test_a_requester_that_cancels_ends_its_answer_only(make_backend, holders) -> None:
    e = ends(make_backend, holders, GROUPS, 8, SLOT)
    attempt, _ = offer(e, list(range(8)), e.names)
    hold = e.a.engine.faults.hold(FrameFlow.OUTGOING, lambda m: isinstance(m, wire.Offer))
    fetch, slots = e.req.fetch(e.a.address(), e.names, 10)
    assert Wake().until(lambda: bool(hold.messages), 5)
    fetch.cancel()
    assert e.req.wait(fetch, slots, 10).status is OutcomeStatus.CANCELLED
    hold.release()
    outcome, slots = pull(e, e.names[:2])
    assert outcome.is_delivered, "a requester's cancel ended the offer"
    check_rows(e.pb, slots, e.names[:2])
    assert attempt.poll() is None
    attempt.cancel()
    assert Wake().until(lambda: attempt.quiesced(), 10)


def test_pulls_at_once_are_all_answered_from_one_offer(make_backend, holders) -> None:
    e = ends(make_backend, holders, GROUPS, 8, SLOT, requester={"max_in_flight": 64})
    attempt, wake = offer(e, list(range(8)), e.names)
    fetches = []
    for i in range(4):  # the requester's pool has 8 rows a group: four pulls of two blocks at once
        names = e.names[2 * i:2 * i + 2]
        fetches.append((e.req.fetch(e.a.address(), names, 10), names))
    for (fetch, slots), names in fetches:
        outcome = e.req.wait(fetch, slots, 10)
        assert outcome.is_delivered
        check_rows(e.pb, slots, names)
    assert e.a.stats().pulls_offered == 4 and e.holder.requests_seen == 0
    attempt.cancel()
    assert wake.until(lambda: attempt.quiesced(), 10)


def test_a_pull_before_serve_is_declined_though_offered(make_backend) -> None:
    a, b = make_backend(), make_backend()
    from ucx_holders import Pool, ReuseTree, fill

    pa, pb = Pool(GROUPS, 4, SLOT), Pool(GROUPS, 4, SLOT, first_region_id=10)
    a.register_regions(pa.regions)
    b.register_regions(pb.regions)
    names = block_names(2)
    fill(pa, ReuseTree(), names)
    attempt = a.offer(pa.view([0, 1], names), lambda: None)
    req = Requester(b, pb)
    fetch, slots = req.fetch(a.address(), names, 5)
    outcome = req.wait(fetch, slots, 10)
    assert outcome.is_failed and outcome.cause is Cause.DECLINED and "not serving" in (outcome.reason or "")
    attempt.cancel()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "5"])
def test_an_offer_timeout_that_is_not_a_finite_positive_number_is_refused(make_backend, holders, bad) -> None:
    e = ends(make_backend, holders, GROUPS, 4, SLOT)
    with pytest.raises(InvalidSubmission, match="timeout_s"):
        e.a.offer(e.pa.view([0], e.names[:1]), lambda: None, bad)


def test_an_offer_without_names_or_with_a_name_twice_is_refused_and_nothing_stands(make_backend, holders) -> None:
    e = ends(make_backend, holders, GROUPS, 4, SLOT)
    with pytest.raises(InvalidSubmission, match="names"):
        e.a.offer(e.pa.view([0, 1], None), lambda: None)
    with pytest.raises(InvalidSubmission, match="two rows"):
        e.a.offer(e.pa.view([0, 1], [e.names[0], e.names[0]]), lambda: None)
    assert e.a.engine.live() == 0
    outcome, _ = pull(e, e.names[:1])
    assert outcome.is_delivered and e.holder.requests_seen == 1


def test_shutdown_ends_a_standing_offer_and_refuses_the_next(make_backend, holders) -> None:
    e = ends(make_backend, holders, GROUPS, 4, SLOT)
    attempt, wake = offer(e, [0, 1], e.names[:2])
    assert wake.until(lambda: not e.a.shutdown(), 10), "shutdown never let go of the offer"
    outcome = attempt.poll()
    assert outcome is not None and not outcome.is_delivered and attempt.quiesced()
    with pytest.raises(SubmissionRejected):
        e.a.offer(e.pa.view([0], e.names[:1]), lambda: None)


def test_an_offer_of_a_group_with_other_names_per_group_answers_by_group(make_backend, holders) -> None:
    """N1.2: names are keyed by (group, name); an offer whose group 1 holds other blocks than
    group 0 answers a pull only of what both groups hold."""
    e = ends(make_backend, holders, GROUPS, 8, SLOT)
    view = e.pa.view([0, 1], e.names[:2])
    other = e.pa.view([2, 3], e.names[2:4])
    from kvwire.contract import View

    mixed = View((view.groups[0], other.groups[1]))
    attempt = e.a.offer(mixed, lambda: None)
    outcome, slots = pull(e, e.names[:2])  # group 1 of the offer names other blocks: the holder answers
    assert outcome.is_delivered and e.holder.requests_seen == 1 and e.a.stats().pulls_offered == 0
    check_rows(e.pb, slots, e.names[:2])
    attempt.cancel()
    assert np.all(attempt.poll().masks[0] == np.zeros(2, dtype=bool))


def test_an_offer_about_to_run_out_leaves_a_pull_to_the_holder(make_backend, holders) -> None:
    """O1.12: kvwire-ucx answers from no offer that runs out within grace_s (the answer would be
    cut at once); such a pull goes to the holder, whole, and delivers."""
    e = ends(make_backend, holders, GROUPS, 8, SLOT, serving={"grace_s": 5.0})
    attempt, wake = offer(e, list(range(8)), e.names, timeout_s=2.0)
    outcome, slots = pull(e, e.names[:3])
    assert outcome.is_delivered and e.holder.requests_seen == 1 and e.a.stats().pulls_offered == 0
    check_rows(e.pb, slots, e.names[:3])
    assert wake.until(lambda: attempt.quiesced(), 10) and attempt.poll().is_delivered


def test_answers_from_offers_beyond_max_pending_pulls_go_to_the_holder(make_backend, holders) -> None:
    """O1.12: at most max_pending_pulls answers from offers are in flight; the next covered pull
    goes to the holder (who may decline it when busy) instead of opening another."""
    e = ends(make_backend, holders, GROUPS, 8, SLOT, serving={"max_pending_pulls": 1})
    attempt, wake = offer(e, list(range(8)), e.names)
    hold = e.b.engine.faults.hold(FrameFlow.OUTGOING, lambda m: isinstance(m, wire.Ack))  # the first stays open
    first, first_slots = e.req.fetch(e.a.address(), e.names[:2], 10)
    assert wake.until(lambda: e.a.stats().pulls_offered == 1, 5)
    second, second_slots = e.req.fetch(e.a.address(), e.names[2:4], 10)
    assert e.holder.wait_requests(1, 5), "the pull beyond the bound never reached the holder"
    assert e.a.stats().pulls_offered == 1
    hold.release()
    for fetch, slots, names in ((first, first_slots, e.names[:2]), (second, second_slots, e.names[2:4])):
        assert e.req.wait(fetch, slots, 10).is_delivered
        check_rows(e.pb, slots, names)
    attempt.cancel()
    assert wake.until(lambda: attempt.quiesced(), 10)


@pytest.mark.parametrize("end", ["deadline", "shutdown"])
def test_an_offer_that_ends_with_an_answer_open_quiesces_once_that_answer_ended(make_backend, holders,
                                                                                end: str) -> None:
    """O1.7/O1.8: an answer left open (the requester's Ack held back) when its offer runs out or
    the serving end shuts down: the offer concludes (DELIVERED at its deadline, not delivered at
    shutdown), and quiesces once the answer has ended, at the latest when the grace closes the
    requester's connection; shutdown() then returns the empty set."""
    e = ends(make_backend, holders, GROUPS, 8, SLOT, serving={"grace_s": 0.5})
    attempt, wake = offer(e, list(range(8)), e.names, timeout_s=3.0)
    hold = e.b.engine.faults.hold(FrameFlow.OUTGOING, lambda m: isinstance(m, wire.Ack | wire.Cancel))
    fetch, slots = e.req.fetch(e.a.address(), e.names, 30)
    assert wake.until(lambda: e.b.stats().rows_received >= 16, 5)  # the rows are in; the Ack is held back
    assert attempt.poll() is None and not attempt.quiesced()
    if end == "shutdown":
        e.a.shutdown()
    assert wake.until(lambda: attempt.poll() is not None, 10), "the offer never concluded"
    outcome = attempt.poll()
    assert outcome.is_delivered if end == "deadline" else (not outcome.is_delivered and outcome.cause is Cause.SHUTDOWN)
    assert wake.until(lambda: attempt.quiesced(), 10), "the offer never quiesced with its answer's requester mute"
    assert wake.until(lambda: not e.a.shutdown(), 10), "shutdown() never let go of the offer"
    hold.release()
    e.req.wait(fetch, slots, 10)  # the requester's fetch ends too, whichever way


def test_a_withdrawn_offer_is_not_kept_until_its_deadline(make_backend, holders) -> None:
    """An offer of an hour withdrawn at once lets go of its view and rows' index when its holder
    drops it, not an hour later (the deadline's timer holds it weakly)."""
    import gc
    import weakref

    e = ends(make_backend, holders, GROUPS, 8, SLOT)
    attempt, wake = offer(e, list(range(8)), e.names, timeout_s=3600.0)
    outcome, _ = pull(e, e.names[:2])
    assert outcome.is_delivered and e.a.stats().pulls_offered == 1
    kept = weakref.ref(attempt.job)
    attempt.cancel()
    assert wake.until(lambda a=attempt: a.quiesced(), 10)
    del attempt
    assert Wake().until(lambda: (gc.collect(), kept() is None)[1], 5), "the withdrawn offer is still held"


def test_shutdown_with_a_grace_beyond_any_single_wait_returns_once_the_offer_quiesces(make_backend, holders) -> None:
    """A grace of 1e10 s is allowed (a finite number > 0) and longer than Python's longest single
    wait (threading.TIMEOUT_MAX, 9.2e9 s): ``shutdown()`` waits for the attempts in flight through
    ``kvwire.waiting``, in pieces, so it returns once the offer has quiesced instead of raising
    ``OverflowError`` (issue 41)."""
    e = ends(make_backend, holders, GROUPS, 4, SLOT, serving={"grace_s": 1e10})
    attempt, wake = offer(e, [0, 1], e.names[:2], timeout_s=60.0)
    go = threading.Event()
    e.a.engine.submit(go.wait)  # the progress thread takes the shutdown up only after go: it is in flight
    threading.Timer(0.2, go.set).start()
    started = time.monotonic()
    assert e.a.shutdown() == frozenset()
    assert time.monotonic() - started < 10
    outcome = attempt.poll()
    assert outcome is not None and outcome.cause is Cause.SHUTDOWN and attempt.quiesced()
