"""O1: standing offers (``offer-pulls``, contract 1.2), with the suite as the serving holder that
offers rows of its reuse tree and the requester that pulls them. Runs only for peer backends that
declare ``offer-pulls``.

What a user of an offer notices, and so what these tests look at: the requester's fetch (its
outcome, and the bytes in its rows, compared with the offered rows), whether the serving holder
was asked (a request in ``incoming()``), and the offer's own attempt (its outcome, its masks, its
cause, its quiescence and its wakes). The tests that hold an answer half-way use the harness's
hold (:attr:`kvwire.testing.harness.Ends.hold`), and skip when there is none.

Why one file of this size: it is one rule's tests, in the order of its clauses, and
they share the helpers at the top (a pull an offer answers, a pull that reaches the holder, an
offer's end); split by clause, each part would import most of them back."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvwire.contract import (
    Attempt,
    Cause,
    Hint,
    LayerGroupRows,
    OffersPulls,
    Outcome,
    PullRequest,
    ServesPulls,
    SlotRegion,
    SubmissionRejected,
    View,
)
from kvwire.contract.capabilities import OFFER_PULLS, SERVE_PULLS, Capabilities
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import FaultPlan, Harness, Hold, Unavailable, shut_down
from kvwire.testing.holder import (
    Submission,
    call_briefly,
    refused,
    settle,
    speaks_causes,
    submit,
    wait_for,
)
from kvwire.testing.layout import Bench
from kvwire.testing.marks import checks
from kvwire.testing.plans import (
    paged_exchange,
    pages,
    with_field,
)
from kvwire.testing.serving import Offered
from kvwire.testing.suite._kit import _patience, _requesters

# -- O1 under load: many pulls of one offer in flight at once ------------------------------------------------

@checks("O1.4", "O1.12", "O1.10", also=("O1.9",))
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


#: What the holder writes over offered rows it may reuse (once the offer quiesced).
SENTINEL = 0xA5


Select = dict[int, list[int]]


@contextmanager
def _offers(harness: Harness, seed: int, specs: list[tuple[int, int]] | None = None, in_flight: int = 1,
            ) -> Iterator[tuple[Capabilities, Exchange, Bench]]:
    """An exchange of an ``offer-pulls`` peer and a bench of PAGED groups of ``(slot_bytes,
    rows)`` (two groups of four blocks by default) that share their names (a pull's blocks)."""
    with paged_exchange(harness, specs or [(64, 4), (32, 4)], seed, needs.offer_pulls, needs.serve_pulls,
                        needs.transfer, shared=True, in_flight=in_flight) as (caps, ex, bench):
        yield caps, ex, bench


def _both(rows: list[int], groups: int = 2) -> Select:
    return {gi: list(rows) for gi in range(groups)}


def _with_timeout(hint: Hint, timeout_s: float) -> Hint:
    return Hint(hint.kind, hint.fields, timeout_s)


def _clause_bytes(clause: str, check: Callable[[], None]) -> None:
    """Run a byte check of the bench (A7, S2) and name ``clause`` when it fails."""
    try:
        check()
    except AssertionError as exc:
        raise AssertionError(f"{clause}: {exc}") from None


def _answered_by_offer(ex: Exchange, bench: Bench, take: Select, what: str, clause: str = "O1.4",
                       hint: Hint | None = None) -> Outcome:
    """Pull the sink rows of ``take``: an offer covers them, so the fetch delivers every row
    true with the offered bytes, and the serving holder is never asked."""
    holder = ex.holder()
    sub = ex.fetch(bench.sink_view(take), hint)
    try:
        out = ex.settle(sub, purpose=f"{clause}: {what}, which a standing offer covers, concluding")
    except AssertionError as exc:
        if holder.incoming():
            raise AssertionError(f"{clause}: {what}, which a standing offer covers whole, was handed to the serving "
                                 "holder through incoming() instead of being answered from the offer") from None
        raise exc
    asked = holder.incoming()
    if asked:
        holder.decline_waiting("conformance: an offer covered this pull")
    assert not asked, (
        f"{clause}: {what}, which a standing offer covers whole, reached the serving holder through incoming(); "
        "a pull an offer covers is answered without the holder")
    assert out.is_delivered and all(m.all() for m in out.masks), (
        f"{clause}: {what}, which a standing offer covers whole, must deliver with every row true, got {out!r}")
    _clause_bytes(clause, lambda: bench.apply_fetch(out, take))
    return out


def _reaches_holder(ex: Exchange, sub: Submission, what: str, clause: str = "O1.5") -> PullRequest:
    """Wait for the pull ``sub`` to reach the serving holder through ``incoming()`` (after a
    serve wake); fail naming ``clause`` if it never does."""
    holder = ex.holder()
    try:
        (request,) = holder.take(1)
    except AssertionError as exc:
        raise AssertionError(
            f"{clause}: {what} never reached the serving holder through incoming() (the fetch: "
            f"{sub.attempt.poll()!r}); a pull that no one standing offer covers whole goes to the holder, "
            f"as N2.4 says: {exc}") from None
    assert sub.view.groups[0].names is not None and np.array_equal(request.names, sub.view.groups[0].names), (
        f"N2.6: {what} reached the holder naming other blocks than the fetch asked for")
    return request


def _holder_delivers(ex: Exchange, bench: Bench, take: Select, what: str, clause: str) -> None:
    """Pull ``take``, which no standing offer covers: it reaches the holder, whose answer
    delivers every row with the right bytes."""
    sub = ex.fetch(bench.sink_view(take))
    request = _reaches_holder(ex, sub, what, clause)
    ex.holder().finish(ex.holder().answer(request))
    out = ex.settle(sub)
    assert out.is_delivered and all(m.all() for m in out.masks), f"N2: the holder's answer to {what} must deliver: {out!r}"
    bench.apply_fetch(out, take)


def _declined(ex: Exchange, sub: Submission, request: PullRequest, reason: str) -> Outcome:
    ex.holder().decline(request, reason)
    out = ex.settle(sub)
    assert out.is_failed, f"N2.11: a declined pull must fail, got {out!r}"
    return out


def _standing(offered: Offered, clause: str, after: str) -> None:
    out = offered.offer.poll()
    assert out is None, f"{clause}: the offer concluded ({out!r}) {after}; it stands until its deadline or cancel()"


def _end(ex: Exchange, offered: Offered) -> Outcome:
    """Cancel a standing offer and wait, as its holder, until it concluded and quiesced."""
    call_briefly(offered.offer.attempt.cancel, "A4.1: cancel() of an offer")
    ex.holder().withdraw(offered)
    assert offered.offer.outcome is not None
    return offered.offer.outcome


def _source_untouched(bench: Bench, when: str) -> None:
    _clause_bytes("O1.6", lambda: bench.source.verify(f"{when}: an offer never writes the rows it offers"))


# -- O1.1 -----------------------------------------------------------------------------------------

@checks("O1.1", also=("O1.7", "A4.3"))
def test_O1_a_backend_that_offers_also_serves_pulls(kvwire_harness: Harness) -> None:
    """O1.1: a backend that declares ``offer-pulls`` also declares ``serve-pulls`` and
    cancellation, implements ``OffersPulls`` and ``ServesPulls``, and ``offer()`` returns an
    ``Attempt``."""
    caps = kvwire_harness.capabilities()
    needs.offer_pulls(caps)
    assert SERVE_PULLS in caps.protocols, (
        f"O1.1: the backend declares {OFFER_PULLS!r} but not {SERVE_PULLS!r} (protocols {sorted(caps.protocols)}); "
        "standing offers answer request-free pulls, so a backend that offers also serves them")
    assert caps.cancellation, (
        f"O1.1: the backend declares {OFFER_PULLS!r} without cancellation; a holder withdraws an offer with "
        "cancel() (O1.7) before it may evict the offered blocks")
    with _offers(kvwire_harness, 1101) as (_, ex, bench):
        for end, backend in (("source", ex.ends.source), ("sink", ex.ends.sink)):
            assert OFFER_PULLS in backend.capabilities().protocols, f"B4: the built {end} does not declare {OFFER_PULLS}"
            assert isinstance(backend, OffersPulls) and isinstance(backend, ServesPulls), (
                f"O1.1: the {end} declares {OFFER_PULLS!r}, so it implements kvwire.contract.OffersPulls and "
                f"ServesPulls; it is a {type(backend).__name__}")
        offered = ex.stand(bench)  # checks that offer() returns an Attempt (O1.1)
        assert isinstance(offered.offer.attempt, Attempt)
        _answered_by_offer(ex, bench, _both([0, 1]), "a pull of two offered blocks", "O1.1")
        out = _end(ex, offered)
        assert out.is_cancelled, f"O1.1/A4.3: a cancelled offer concludes CANCELLED, got {out!r}"


# -- O1.2 -----------------------------------------------------------------------------------------

def _repeated(view: View) -> View:
    """``view`` with the second row of its first group named as its first."""
    g = view.groups[0]
    assert g.names is not None
    names = np.array(g.names)
    names[1] = names[0]
    return View((LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens, names), *view.groups[1:]))


@checks("O1.2", also=("S3.6",))
def test_O1_an_offer_of_a_bad_view_or_timeout_is_refused(kvwire_harness: Harness) -> None:
    """O1.2 / S3: an offer whose rows are not registered, whose group carries no names, that names
    one block twice in a group, that is no ``View``, or whose ``timeout_s`` is zero, negative, a
    bool, NaN, infinite (or an int beyond any float) or a str, raises ``InvalidSubmission``; nothing escaped: no offer stands (the pull of
    its blocks reaches the holder), no queue slot was kept (S3.6), the memory is untouched."""
    with _offers(kvwire_harness, 1201, in_flight=2) as (_, ex, bench):
        holder = ex.holder()
        ex.offer(bench)  # the reuse tree holds the rows: a pull no offer covers is the holder's
        memory = kvwire_harness.allocate(bench.source.memories[0].region.memory_kind, 64, 8)
        stray = memory.region  # never registered with the serving end
        good = bench.source_view()
        g0 = good.groups[0]
        unregistered = View((LayerGroupRows(g0.group_id, g0.kind, stray, np.arange(g0.rows), g0.tokens, g0.names),
                             *good.groups[1:]))
        views: dict[str, object] = {
            "rows in memory never registered": unregistered,
            "a group that carries no names": bench.source_view(names=False),
            "one block named on two rows of a group": _repeated(good),
            "a tuple of groups, not a View": tuple(good.groups),
        }
        for what, view in views.items():
            refused(functools.partial(holder.offer, view), f"O1.2: an offer of {what}")  # type: ignore[arg-type]
        for timeout in (0, -1.0, True, float("nan"), float("inf"), 10**400, "5"):
            refused(functools.partial(holder.offer, good, timeout),  # type: ignore[arg-type]
                    f"O1.2: an offer with timeout_s={timeout!r}")
        assert holder.tree.pinned == 0
        _holder_delivers(ex, bench, _both([0, 1]), "a pull of blocks whose offers were all refused", "O1.2/S3.4")
        # S3.6: the refusals kept no slot, so offers up to the bound are still taken; and a
        # timeout that is a numpy scalar is a real number (O1.2): those offers are taken too
        timeouts = [None, np.int64(600), np.float32(600.0)]
        offers = [ex.holder().offer(bench.source_view(_both([row])), timeouts[row % 3])  # type: ignore[arg-type]
                  for row in range(min(ex.caps.max_in_flight, bench.plan.groups[0].rows))]
        for offered in offers:
            _end(ex, offered)
        _clause_bytes("S3.5", lambda: bench.verify("after refused offers"))


@checks("O1.7", "O1.2", "B3.3")
def test_O1_an_offer_after_shutdown_is_rejected_and_a_standing_one_ends(kvwire_harness: Harness) -> None:
    """O1.7 / O1.2 / B3.3: ``shutdown()`` concludes a standing offer not delivered (cause
    ``SHUTDOWN`` from a 1.1 backend), returns it for as long as it has not quiesced, and then the
    empty set; an offer afterwards raises ``SubmissionRejected``."""
    with _offers(kvwire_harness, 1203) as (_, ex, bench):
        holder = ex.holder()
        offered = ex.stand(bench)
        _answered_by_offer(ex, bench, _both([0, 1]), "a pull of two offered blocks")
        source = ex.ends.source
        pending = call_briefly(source.shutdown, "B3: shutdown() of the serving end")
        out = settle(offered.offer, profiles.active().patience_s, quiesce=False,
                     purpose="O1.7/B3.2: the offer concluding by shutdown()")
        assert not out.is_delivered, (
            f"O1.7: shutdown() concludes a standing offer not delivered (B3), got {out!r}; only its deadline "
            "delivers it")
        if speaks_causes(source):
            assert out.cause is Cause.SHUTDOWN, f"O1.7/A10.8: an offer shutdown() concluded has cause SHUTDOWN: {out!r}"
        if not offered.offer.quiesced():
            assert offered.offer.attempt in pending, (
                "B3.3: shutdown() returned without the offer, which has not quiesced; it returns every attempt of "
                "the instance not yet quiesced")
        shut_down(source, profiles.active().patience_s + kvwire_harness.quiesce_grace_s)
        holder.withdraw(offered)
        refused(functools.partial(holder.offer, bench.source_view()), "O1.2: an offer after shutdown()",
                SubmissionRejected)
        _source_untouched(bench, "after shutdown() ended an offer")


# -- O1.3 -----------------------------------------------------------------------------------------

@checks("O1.3", "S3.9", "S3.11")
def test_O1_an_offer_takes_one_queue_slot_and_its_answers_none(kvwire_harness: Harness) -> None:
    """O1.3 / S3.9 / S3.11: each standing offer takes one queue slot: with the queue full of
    offers, one more raises ``SubmissionRejected``, while pulls they cover are still answered (an
    answer takes no slot); once one offer concluded and quiesced, its slot takes a new offer."""
    caps = kvwire_harness.capabilities()
    needs.offer_pulls(caps)
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=2) as ex:
        bound = ex.caps.max_in_flight
        if bound > 64:
            pytest.skip(f"backend declares a queue bound of {bound}, too large to fill with offers here")
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, pages([(32, bound + 1)], 1301, True), kind) as bench:
            holder = ex.holder()
            ex.offer(bench)
            offers: list[Offered] = []
            for row in range(bound):
                try:
                    offers.append(holder.offer(bench.source_view({0: [row]})))
                except SubmissionRejected as exc:
                    raise AssertionError(f"S3.10: offer {row + 1} of a queue bound of {bound} was rejected: {exc}") \
                        from None
            refused(functools.partial(holder.offer, bench.source_view({0: [bound]})),
                    f"O1.3: an offer beside {bound} standing offers that fill the queue bound", SubmissionRejected)
            for row in (0, bound - 1):
                _answered_by_offer(ex, bench, {0: [row]}, f"a pull of block {row}, beside a queue full of offers",
                                   "O1.3")
            _end(ex, offers.pop(0))
            try:
                offers.append(holder.offer(bench.source_view({0: [bound]})))
            except SubmissionRejected as exc:
                raise AssertionError(f"O1.3/S3.11: an offer concluded and quiesced, yet its queue slot takes no new "
                                     f"offer: {exc}") from None
            _answered_by_offer(ex, bench, {0: [bound]}, "a pull of the block the newest offer offers", "O1.3")
            for offered in offers:
                _end(ex, offered)


# -- O1.4 and O1.11 ---------------------------------------------------------------------------------

PULLS: dict[str, Select] = {
    "every offered block of every group": _both([0, 1, 2, 3]),
    "the blocks of one group only": {1: [0, 1, 2]},
    "blocks out of the offer's order": _both([3, 1]),
    "one block in the middle": _both([2]),
}


@checks("O1.4", also=("O1.6",))
def test_O1_an_offered_pull_is_answered_without_the_holder(kvwire_harness: Harness) -> None:
    """O1.4: while an offer stands and the backend serves, a pull of blocks it offers in every
    requested group (all of them, the groups' subset, blocks in another order than the offer's, a
    block in the middle) is answered without the holder: nothing in ``incoming()``, every row true
    and holding the offered row of its group and name (A7); the offer stands on."""
    with _offers(kvwire_harness, 1401) as (_, ex, bench):
        offered = ex.stand(bench)
        for what, take in PULLS.items():
            _answered_by_offer(ex, bench, take, f"a pull of {what}")
            bench.forget_sink(take)  # the next pull's rows are checked by the next pull
            _standing(offered, "O1.4", f"after answering a pull of {what}")
        assert ex.holder().tree.pinned == 4, "O1.6: the holder pins the offered blocks for the offer's life"
        _end(ex, offered)
        assert ex.holder().tree.pinned == 0
        _source_untouched(bench, "after pulls answered from an offer")


@checks("O1.11")
def test_O1_an_offer_answers_any_requester_whatever_its_credentials(kvwire_harness: Harness) -> None:
    """O1.11: an offer checks no credentials: pulls carrying credentials, other credentials, or
    none, are each answered from the offer, none reaching the holder."""
    with _offers(kvwire_harness, 1501) as (_, ex, bench):
        offered = ex.stand(bench)
        for row, secret in enumerate([b"tenant-a\x00", b"tenant-b\xff", None]):
            hint = ex.ends.fetch_hint if secret is None else with_field(ex.ends.fetch_hint, "credentials", secret)
            _answered_by_offer(ex, bench, _both([row]), f"a pull carrying credentials {secret!r}", "O1.11", hint)
        _end(ex, offered)


# -- O1.5 -----------------------------------------------------------------------------------------

def _double(view: View, group: int) -> View:
    """``view`` with group ``group`` seen as rows of twice the slot size over the same memory
    (M4.2): a pull that expects another slot size than the offered rows have."""
    groups = list(view.groups)
    g = groups[group]
    r = g.region
    region = SlotRegion(r.region_id + 70_000, r.base, r.slot_bytes * 2, r.slot_count // 2, r.memory_kind, r.device)
    groups[group] = LayerGroupRows(g.group_id, g.kind, region, g.slots // 2, g.tokens, g.names)
    return View(tuple(groups))


#: how -> (the offers, each a selection of source rows; the pull's sink rows)
UNCOVERED: dict[str, tuple[list[Select], Select]] = {
    "a block no offer names": ([_both([0, 1, 2])], _both([0, 3])),
    "a group no offer holds": ([{0: [0, 1, 2, 3]}], _both([0, 1])),
    "a name one group of the offer lacks": ([{0: [0, 1, 2], 1: [0, 1]}], _both([0, 2])),
    "another slot size than the offered rows": ([_both([0, 1, 2, 3])], {0: [1]}),
    "two offers that cover it only together": ([{0: [0, 1, 2, 3]}, {1: [0, 1, 2, 3]}], _both([0, 1])),
}


@checks("O1.5", also=("N2.6",))
@pytest.mark.parametrize("how", list(UNCOVERED))
def test_O1_a_pull_no_one_offer_covers_goes_to_the_holder(kvwire_harness: Harness, how: str) -> None:
    """O1.5: a pull with a block, a group or a slot size that no one standing offer covers (a
    block not offered, a group not offered, a name one offered group lacks, rows of another slot
    size, or two offers that cover it only together) reaches the holder through ``incoming()``
    whole; no part of it is answered from an offer, and the offers stand on."""
    offers, take = UNCOVERED[how]
    # the offers, the suite's own, and the holder's answer stand at once at the serving end
    with _offers(kvwire_harness, 1601, in_flight=len(offers) + 2) as (_, ex, bench):
        ex.offer(bench)
        holder = ex.holder()
        standing = [holder.offer(bench.source_view(select)) for select in offers]
        view = bench.sink_view(take)
        if how.startswith("another slot size"):
            view = _double(view, 0)
        sub = ex.fetch(view)
        request = _reaches_holder(ex, sub, f"a pull with {how}")
        assert request.blocks == view.groups[0].rows, "N2.6: the request names every block the pull asked for"
        out = _declined(ex, sub, request, f"conformance: {how} reached the holder, as it must")
        assert not any(m.any() for m in out.masks), f"O1.5: no part of a pull with {how} is answered: {out!r}"
        bench.forget_sink(take)
        if how.startswith("another slot size"):
            bench.forget_sink({0: [0, 1, 2, 3]})  # a doubled row spans its neighbour too
        for offered in standing:
            _standing(offered, "O1.5", f"after a pull with {how} went to the holder")
        _answered_by_offer(ex, bench, {0: [0]}, "a pull of block 0 from the first offer afterwards", "O1.5")
        for offered in standing:
            _end(ex, offered)
        _source_untouched(bench, f"after a pull with {how}")


# -- O1.7 -----------------------------------------------------------------------------------------

@checks("O1.7", "O1.6")
@pytest.mark.parametrize("deadline", ["argument", "options"])
def test_O1_an_offer_delivers_at_its_deadline_with_every_bit_true(kvwire_harness: Harness, deadline: str) -> None:
    """O1.7 / O1.6: at its deadline (the ``timeout_s`` argument, else the backend's deadline
    option) an offer concludes ``DELIVERED`` with every bit true and no cause, and quiesces; the
    rows it offered are unchanged; a pull of them afterwards goes to the holder."""
    short_s = 1.0
    caps = kvwire_harness.capabilities()
    needs.offer_pulls(caps)
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, timeout_s=short_s if deadline == "options" else needs.LONG_TIMEOUT_S,
                             ) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                            pages([(64, 3), (32, 3)], 1701, True), kind) as bench:
        holder = ex.holder()
        offered = ex.stand(bench, timeout_s=short_s if deadline == "argument" else None)
        try:
            holder.withdraw(offered)
        except AssertionError as exc:
            raise AssertionError(f"O1.7: an offer with a deadline of {short_s:g} s ({deadline}) did not conclude and "
                                 f"quiesce: {exc}") from None
        out = offered.offer.outcome
        assert out is not None and out.is_delivered, (
            f"O1.7: an offer that stood until its deadline ({deadline}) concludes DELIVERED, got {out!r}")
        assert all(m.all() for m in out.masks), (
            f"O1.7: an offer concluded at its deadline marks every row true (each stood offered its whole life), "
            f"got {[m.astype(int).tolist() for m in out.masks]}")
        _source_untouched(bench, "after an offer's deadline")
        sub = ex.fetch(bench.sink_view(_both([0, 1])), _with_timeout(ex.ends.fetch_hint, needs.LONG_TIMEOUT_S))
        request = _reaches_holder(ex, sub, "a pull of the blocks of an offer that concluded at its deadline", "O1.7")
        holder.finish(holder.answer(request))
        fetched = ex.settle(sub)
        assert fetched.is_delivered, f"N2: the holder's answer must deliver: {fetched!r}"
        bench.apply_fetch(fetched, _both([0, 1]))


@checks("O1.7", "O1.6", also=("A4.3",))
def test_O1_a_cancelled_offer_concludes_cancelled_and_answers_no_more(kvwire_harness: Harness) -> None:
    """O1.7 / O1.6: ``cancel()`` concludes a standing offer ``CANCELLED`` with cause
    ``HOLDER_CANCELLED``, ``by_peer`` false and every bit false, and it quiesces; its rows are
    unchanged; a later pull of its blocks reaches the holder, who answers it."""
    with _offers(kvwire_harness, 1703) as (_, ex, bench):
        ex.holder()  # serving (N2.7) before the offer
        offered = ex.stand(bench)
        _answered_by_offer(ex, bench, _both([0, 1]), "a pull of two offered blocks before the cancel")
        out = _end(ex, offered)
        assert out.is_cancelled and not out.by_peer, (
            f"O1.7/A4.3: an offer its holder cancelled concludes CANCELLED with by_peer false, got {out!r}")
        if speaks_causes(ex.ends.source):
            assert out.cause is Cause.HOLDER_CANCELLED, f"O1.7/A10.6: its cause is HOLDER_CANCELLED: {out!r}"
        assert not any(m.any() for m in out.masks), (
            f"O1.7: a cancelled offer marks every row false, got {[m.astype(int).tolist() for m in out.masks]}")
        _source_untouched(bench, "after an offer was cancelled")
        bench.forget_sink()
        _holder_delivers(ex, bench, _both([2, 3]), "a pull of the blocks of a cancelled offer", "O1.7")


# -- O1.8: an answer held half-way ------------------------------------------------------------------

def _held_answer(ex: Exchange, bench: Bench, take: Select, hint: Hint | None = None) -> tuple[Submission, Hold]:
    """Hold the serving end, then pull ``take`` (which an offer covers); return once the hold
    holds the answer. Skips when the harness cannot hold the serving end, or its hold does not
    hold a pull an offer answers."""
    if ex.ends.hold is None:
        pytest.skip("harness cannot hold the backend's other end (Ends.hold)")
    hold = ex.ends.hold()
    sub = ex.fetch(bench.sink_view(take), hint)
    wait_for(lambda: hold.waiting() > 0 or sub.wakes.count > 0 or ex.holder().wakes.count > 0,
             profiles.active().patience_s, "A3: the held serving end receiving the pull")
    if hold.waiting() == 0:
        hold.release()
        pytest.skip("the harness's hold does not hold a pull that a standing offer answers")
    return sub, hold


def _after_release(ex: Exchange, sub: Submission) -> Outcome:
    """The held pull's outcome once let go: it concludes, or it reaches the holder (which
    declines it)."""
    holder = ex.holder()
    wait_for(lambda: sub.attempt.poll() is not None or holder.wakes.count > 0, profiles.active().patience_s,
             "O1.8: the pull held while its offer ended concluding or reaching the holder")
    if sub.attempt.poll() is None:
        (request,) = holder.take(1)
        holder.decline(request, "conformance: the offer ended while this pull was held")
    return ex.settle(sub)


@checks("O1.8", "O1.7", "B3.3")
@pytest.mark.parametrize("how", ["cancel", "deadline", "shutdown"])
def test_O1_an_offer_ends_its_held_answers_and_reads_nothing_once_quiesced(kvwire_harness: Harness,
                                                                           how: str) -> None:
    """O1.8 / O1.7 / B3.3: with an answer from a standing offer held half-way at the serving end,
    the offer ends (``cancel()``, its deadline, or ``shutdown()``) and quiesces within the grace
    while the answer is still held; the holder then overwrites the offered rows; once let go, the
    requester's fetch does not deliver (the answer ended with its offer), and no row it marks holds
    the overwritten bytes (A7)."""
    patience = profiles.active().patience_s
    with _offers(kvwire_harness, 1801) as (_, ex, bench):
        holder = ex.holder()
        offered = ex.stand(bench, timeout_s=1.0 if how == "deadline" else None)
        take = _both([0, 1, 2])
        sub, hold = _held_answer(ex, bench, take)
        with hold:
            if how == "cancel":
                call_briefly(offered.offer.attempt.cancel, "A4.1: cancel() of an offer")
            elif how == "shutdown":
                pending = call_briefly(ex.ends.source.shutdown, "B3: shutdown() of the serving end")
                if not offered.offer.attempt.quiesced():
                    assert offered.offer.attempt in pending, (
                        "B3.3: shutdown() returned without the offer, which had not quiesced (an answer from it is "
                        "held); it returns every attempt of the instance not yet quiesced")
            try:
                settle(offered.offer, patience + kvwire_harness.quiesce_grace_s + (1.0 if how == "deadline" else 0.0),
                       purpose=f"O1.8: the offer, ended by {how} while an answer from it is held")
            except AssertionError as exc:
                raise AssertionError(f"O1.8: an offer ended by {how} must conclude and quiesce within the grace even "
                                     f"while an answer from it is held half-way (it ends that answer): {exc}") from None
            out = offered.offer.outcome
            assert out is not None
            assert out.is_delivered == (how == "deadline"), (
                f"O1.7: an offer ended by {how} concludes {'DELIVERED' if how == 'deadline' else 'not delivered'}, "
                f"got {out!r}")
            bench.write_source(None, SENTINEL)  # the holder reuses the rows the moment the offer quiesced
        fetched = _after_release(ex, sub)
        _clause_bytes("O1.8", lambda: bench.apply_fetch(fetched, take))
        assert not fetched.is_delivered, (
            f"O1.8: a pull whose answer from an offer was held when the offer ended by {how} must not deliver (the "
            f"offer's end ends its answers still moving rows: the fetch fails or is cancelled by the peer), got "
            f"{fetched!r}")
        if how == "shutdown":
            shut_down(ex.ends.source, patience + kvwire_harness.quiesce_grace_s)
        holder.withdraw(offered)


# -- O1.9 -----------------------------------------------------------------------------------------

@checks("O1.9")
@pytest.mark.parametrize("how", ["cancel", "deadline", "fault"])
def test_O1_a_requesters_end_ends_only_its_answer(kvwire_harness: Harness, how: str) -> None:
    """O1.9: a requester that cancels its pull, whose pull meets its deadline, or whose answer
    meets a fault, ends that pull and that answer only: the offer stands, and answers the next
    pull of its blocks without the holder."""
    caps = kvwire_harness.capabilities()
    needs.offer_pulls(caps)
    needs.serve_pulls(caps)
    needs.transfer(caps)
    if how == "cancel":
        needs.cancellation(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4), (32, 4)], 1901, True)
    faults = None
    if how == "fault":
        probe = Bench(kvwire_harness, None, None, plan, kind)
        faults = FaultPlan(fetch=frozenset({probe.names[0][0].tobytes()}))
        probe.close()
    with needs.open_exchange(kvwire_harness, faults=faults) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                         plan, kind) as bench:
        offered = ex.stand(bench)
        take = _both([0, 1])
        hint = _with_timeout(ex.ends.fetch_hint, 0.5) if how == "deadline" else None
        hold: Hold | None = None
        if how == "fault":
            sub = ex.fetch(bench.sink_view(take))
        elif ex.ends.hold is not None:
            sub, hold = _held_answer(ex, bench, take, hint)
        else:
            sub = ex.fetch(bench.sink_view(take), hint)
        if how == "cancel":
            call_briefly(sub.attempt.cancel, "A4.1: cancel() of a pull")
        out = ex.settle(sub, quiesce=False, purpose=f"O1.9: the pull ended by its requester's {how} concluding")
        if hold is not None:
            hold.release()
        out = ex.settle(sub)
        bench.forget_sink(take)
        if how == "fault":
            assert not out.is_delivered, f"O1.9: a pull whose answer met a fault must not deliver, got {out!r}"
        _standing(offered, "O1.9", f"after a requester's {how} ended the pull it answered")
        _answered_by_offer(ex, bench, _both([2, 3]), f"a pull after another pull ended by its {how}", "O1.9")
        _standing(offered, "O1.9", f"after a requester's {how} ended a pull it answered, and a next pull")
        _end(ex, offered)


# -- O1.10 ----------------------------------------------------------------------------------------

@checks("O1.10")
def test_O1_several_offers_of_the_same_blocks_each_answer_alone(kvwire_harness: Harness) -> None:
    """O1.10: two standing offers name the same blocks (one of both groups, one of the first
    group only); pulls either covers are answered; once the first is cancelled the second still
    answers the pulls it covers alone, and a pull only the first covered goes to the holder;
    once both ended every pull does."""
    with _offers(kvwire_harness, 2001, in_flight=3) as (_, ex, bench):  # two offers and a holder's answer
        holder = ex.holder()
        ex.offer(bench)
        both = holder.offer(bench.source_view())
        first_group = holder.offer(bench.source_view({0: [0, 1, 2, 3]}))
        _answered_by_offer(ex, bench, {0: [0, 1]}, "a pull both offers cover", "O1.10")
        _answered_by_offer(ex, bench, _both([1]), "a pull only the first offer covers", "O1.10")
        _end(ex, both)
        _answered_by_offer(ex, bench, {0: [2, 3]}, "a pull the offer still standing covers, after the other of the "
                           "same blocks was cancelled", "O1.10")
        sub = ex.fetch(bench.sink_view(_both([0])))
        _declined(ex, sub, _reaches_holder(ex, sub, "a pull only the cancelled offer covered", "O1.10/O1.7"),
                  "conformance: only a cancelled offer covered this pull")
        _end(ex, first_group)
        bench.forget_sink()
        sub = ex.fetch(bench.sink_view({0: [3]}))
        _declined(ex, sub, _reaches_holder(ex, sub, "a pull once both offers ended", "O1.10/O1.7"),
                  "conformance: no offer stands")
        _source_untouched(bench, "after two offers of the same blocks")


@checks("O1.10", "W1.2", "W1.3")
def test_O1_W1_answering_from_an_offer_wakes_no_holder(kvwire_harness: Harness) -> None:
    """O1.10 / W1.2 / W1.3: answering pulls from a standing offer calls neither the offer's wake
    nor the serve wake; the offer's wake is called once it concludes and once it quiesces."""
    with _offers(kvwire_harness, 2003) as (_, ex, bench):
        offered = ex.stand(bench, select={0: [0, 1, 2], 1: [0, 1, 2]})
        served_before = ex.holder().wakes.count
        for row in range(3):
            _answered_by_offer(ex, bench, _both([row]), f"pull {row + 1} of an offered block", "O1.10")
        served = ex.holder().wakes.count - served_before
        assert served == 0, (
            f"O1.10: answering three pulls from a standing offer called the serve wake {served} time(s); a pull an "
            "offer answers never reaches the holder, so nothing is there to wake it for")
        # A pull no offer covers reaches the holder after a serve wake; any wake the answers above
        # caused came before it from the same serving end.
        sub = ex.fetch(bench.sink_view(_both([3])))
        _declined(ex, sub, _reaches_holder(ex, sub, "a pull of a block not offered", "O1.5"),
                  "conformance: not offered")
        woken = offered.offer.wakes.count
        assert woken == 0, (
            f"O1.10: answering three pulls from a standing offer called the offer's wake {woken} time(s); a standing "
            "offer wakes its holder when it concludes and when it quiesces, not when it answers")
        _end(ex, offered)  # settle() checks the wakes of the conclusion and quiescence (W1.2, W1.3, W1.6)
