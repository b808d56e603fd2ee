"""Clauses of registration, recognition, empty and repeated rows, queue slots, outcomes that
outlive their backend, group order, many attempts in flight and raising wakes. Each test names
its clause of ``docs/contract.md`` in its docstring's first line. One file of ~560 lines: the
M4 tests share the views described over registered memory at its top, and the rest are the few
clauses no other suite file holds."""


from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from kvwire.contract import (
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Outcome,
    SlotRegion,
    SubmissionRejected,
    TokenRange,
    View,
)
from kvwire.contract.errors import SubmissionError
from kvwire.runtime.holding import Direction
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Harness, shut_down
from kvwire.testing.holder import (
    RaisingWakes,
    Submission,
    call_briefly,
    check_refusal_message,
    refused,
    settle,
    wait_for,
)
from kvwire.testing.layout import BLOCK_TOKENS, Bench
from kvwire.testing.plans import (
    check_bits,
    needs_misses,
    offer_for,
    paged_exchange,
    pages,
    store_only,
    transfer_checked,
)

# -- registration and recognition ------------------------------------------------------------------

def test_M3_registration_after_shutdown_is_rejected_and_closing_still_works(kvwire_harness: Harness) -> None:
    """M3.10 / M3.11: after ``shutdown()`` a registration raises ``SubmissionRejected`` and
    registers nothing; closing an earlier registration is still allowed, twice."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 313, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        late = Bench(kvwire_harness, None, None, plan, kind)
        try:
            for backend in ex.ends.backends:
                shut_down(backend, timeout_s=max(10.0, kvwire_harness.quiesce_grace_s))
                refused(lambda: backend.register_regions([m.region for m in late.source.memories]),  # noqa: B023
                        "M3.10: a registration after shutdown()", SubmissionRejected)
            for registration in bench.registrations:
                call_briefly_close(registration)
                call_briefly_close(registration)
            bench.registrations.clear()
        finally:
            late.close()


def call_briefly_close(registration) -> None:  # type: ignore[no-untyped-def]
    from kvwire.testing.holder import call_briefly

    call_briefly(registration.close, "M3.11: closing a registration after shutdown()")


def _sub_span_view(view: View, offset_slots: int) -> View:
    """The same rows, each group described by another region inside the registered one: starting
    ``offset_slots`` slots later, with its slot indices shifted to match (M4.2)."""
    groups = []
    for g in view.groups:
        r = g.region
        lo = min(offset_slots, int(g.slots.min()) if g.rows else 0)
        inner = SlotRegion(r.region_id + 30_000, r.base + lo * r.slot_bytes, r.slot_bytes, r.slot_count - lo,
                           r.memory_kind, r.device)
        groups.append(LayerGroupRows(g.group_id, g.kind, inner, g.slots - lo, g.tokens, g.names))
    return View(tuple(groups))


def test_M4_a_view_over_part_of_a_registered_region_moves_its_rows(kvwire_harness: Harness) -> None:
    """M4.1 / M4.2: a row is recognized by where its bytes lie: a view whose regions are other
    descriptions of registered memory (a sub-span under another id) moves its rows like any other."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4), (16, 4)], 317, needs.shares_names(caps), spare=2)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        try:
            if ex.store:
                out = ex.settle(ex.publish(_sub_span_view(bench.source_view(), 2)))
                assert out.is_delivered and all(m.all() for m in out.masks), f"M4.2: {out!r}"
            elif ex.serves_pulls:
                ex.offer(bench)
            sub = ex.fetch(_sub_span_view(bench.sink_view(), 1))
        except InvalidSubmission as exc:
            raise AssertionError(f"M4.2: rows inside a registered region were refused because the view describes "
                                 f"them with another SlotRegion: {exc}") from exc
        ex.serve_one()
        fetched = ex.settle(sub)
        bench.apply_fetch(fetched)
        assert fetched.is_delivered and all(m.all() for m in fetched.masks), f"M4.2: {fetched!r}"


def _halved_view(view: View) -> View:
    """``view`` with every region described in slots of half its slot size: each row becomes two
    rows, its first and its second half, named as the row with one byte more (0 or 1) (M4.2)."""
    groups = []
    for g in view.groups:
        r = g.region
        half = SlotRegion(r.region_id + 40_000, r.base, r.slot_bytes // 2, r.slot_count * 2, r.memory_kind, r.device)
        slots = (np.repeat(g.slots * 2, 2) + np.tile([0, 1], g.rows)).astype(np.int64)
        names = None
        if g.names is not None:
            names = np.zeros((2 * g.rows, g.names.shape[1] + 1), dtype=np.uint8)
            names[:, :-1] = np.repeat(g.names, 2, axis=0)
            names[:, -1] = np.tile([0, 1], g.rows)
        groups.append(LayerGroupRows(g.group_id, g.kind, half, slots, TokenRange(0, BLOCK_TOKENS * 2 * g.rows),
                                     names))
    return View(tuple(groups))


def _moved_as_described(ex: Exchange, source: View, sink: View, how: str) -> Outcome:
    """Offer ``source`` (publish to a store, into the serving holder's tree, or publish to a peer)
    and fetch ``sink``, both describing registered memory ``how``; the fetch's outcome, which
    must have delivered every row (M4.2: rows inside registered regions are recognized however
    a view describes them)."""
    pub = None
    try:
        if ex.store:
            published = ex.settle(ex.publish(source))
            assert published.is_delivered and all(m.all() for m in published.masks), f"M4.2: {published!r}"
        elif ex.serves_pulls:
            ex.holder().tree.add_view(source)
        else:
            pub = ex.publish(source)
        sub = ex.fetch(sink)
    except InvalidSubmission as exc:
        raise AssertionError(f"M4.2: rows inside registered regions were refused because the view describes them "
                             f"{how}: {exc}") from exc
    ex.serve_one()
    fetched = ex.settle(sub)
    if pub is not None:
        ex.settle(pub)
    assert fetched.is_delivered and all(m.all() for m in fetched.masks), (
        f"M4.2: a fetch of rows described {how} must deliver them all: {fetched!r}")
    return fetched


def test_M4_rows_described_with_another_slot_size_move(kvwire_harness: Harness) -> None:
    """M4.2 / M4.1: recognition reads where a row's bytes lie, not the registered slot size: a view
    that describes registered memory in slots of half the registered size (every registered row
    as two rows) is taken, and both halves of every row arrive, byte for byte."""
    with paged_exchange(kvwire_harness, [(64, 3), (32, 3)], 347, needs.transfer) as (_, ex, bench):
        source, sink = _halved_view(bench.source_view()), _halved_view(bench.sink_view())
        fetched = _moved_as_described(ex, source, sink, "in slots of half the registered size")
        bench.apply_fetch(Outcome.delivered([m[0::2] & m[1::2] for m in fetched.masks]))


#: Other descriptions of registered memory whose rows each span two registered slots (M4.2): per
#: case, the region over a registered one of ``n`` slots of ``size`` bytes, and the slots of its
#: rows, over the registered slots 2..5 (the bench's rows, with two spare slots either side; "half a
#: slot further on" covers 2.5..5.5).
ACROSS_SLOTS: dict[str, Callable[[SlotRegion], tuple[SlotRegion, list[int]]]] = {
    "twice the slot size": lambda r: (SlotRegion(r.region_id + 50_000, r.base, 2 * r.slot_bytes, r.slot_count // 2,
                                                 r.memory_kind, r.device), [1, 2]),
    "half a slot further on": lambda r: (SlotRegion(r.region_id + 60_000, r.base + r.slot_bytes // 2, r.slot_bytes,
                                                    r.slot_count - 1, r.memory_kind, r.device), [2, 3, 4]),
}


def _across_view(view: View, case: str, names: np.ndarray) -> View:
    """``view`` with every group's region described as ``ACROSS_SLOTS[case]`` says, its rows named
    ``names`` (alike in every group)."""
    groups = []
    for g in view.groups:
        region, slots = ACROSS_SLOTS[case](g.region)
        groups.append(LayerGroupRows(g.group_id, g.kind, region, np.asarray(slots, dtype=np.int64),
                                     TokenRange(0, BLOCK_TOKENS * len(slots)), names[: len(slots)]))
    return View(tuple(groups))


@pytest.mark.parametrize("case", list(ACROSS_SLOTS))
def test_M4_rows_that_span_registered_slots_move(kvwire_harness: Harness, case: str) -> None:
    """M4.2 / M4.1 / M2.4: recognition reads where a row's bytes lie, not the registered slots: a
    view describing registered memory in slots twice the registered size, or starting half a slot
    further on (every row across two registered slots), is taken, and exactly its rows' bytes
    arrive."""
    with paged_exchange(kvwire_harness, [(64, 4), (32, 4)], 661, needs.transfer, spare=2) as (_, ex, bench):
        assert all(g.region_slots == 8 and set(g.source_slots) == {2, 3, 4, 5} for g in bench.plan.groups)
        names = np.random.default_rng(661).integers(0, 256, size=(4, 16), dtype=np.uint8)
        names[:, 0] = np.arange(4)  # distinct
        source, sink = _across_view(bench.source_view(), case, names), _across_view(bench.sink_view(), case, names)
        _moved_as_described(ex, source, sink, f"with {case} (each row across two registered slots)")
        for gi, g in enumerate(sink.groups):
            start = int(g.addresses()[0]) - bench.sink.memories[gi].region.base
            end = int(g.addresses()[-1]) + g.region.slot_bytes - bench.sink.memories[gi].region.base
            want = bench.sink.model[gi].reshape(-1).copy()
            want[start:end] = bench.source.model[gi].reshape(-1)[start:end]
            got = bench.sink.memories[gi].read_all().reshape(-1)
            wrong = np.flatnonzero(got != want)
            assert wrong.size == 0, (
                f"M4.2/M2.3: group {g.group_id}: byte(s) {wrong[:8].tolist()} of the sink region differ from the source's "
                f"rows (bytes {start}..{end}) or from what was there before; a row moves exactly its bytes")
            bench.sink.model[gi] = want.reshape(bench.sink.model[gi].shape)
        bench.verify("M4.2: after rows spanning registered slots moved")


def test_M4_rows_registered_only_with_another_instance_are_refused(kvwire_harness: Harness) -> None:
    """M4.6 / B1.2: memory registered with one instance is not registered with another."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3)], 331, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as first, needs.open_exchange(kvwire_harness) as second, Bench(
            kvwire_harness, first.ends.source, first.ends.sink, plan, kind) as bench:
        if caps.publish:
            refused(lambda: second.publish(bench.source_view()),
                    "M4.6: a publish on an instance of rows registered only with another")
        if caps.fetch:
            refused(lambda: second.fetch(bench.sink_view()),
                    "M4.6: a fetch on an instance of rows registered only with another")
        bench.verify("M4.6: after refused submissions")


# -- empty views, repeated publish rows ------------------------------------------------------------

def test_V1_empty_views_and_groups_conclude_like_any_other(kvwire_harness: Harness) -> None:
    """V1.7: a view with no groups, and a group with zero rows beside others, are valid and
    conclude with masks of the right (zero) length."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (32, 3)], 337, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        if ex.store or not ex.serves_pulls:
            out = ex.settle(ex.publish(View(())))
            assert out.is_delivered and out.masks == (), f"V1.7: an empty publish: {out!r}"
        if ex.store or ex.serves_pulls:  # a pull of no group names no block: nothing to ask, delivered
            out = ex.settle(ex.fetch(View(())))
            assert out.is_delivered and out.masks == (), f"V1.7: an empty fetch: {out!r}"
        # A group with zero rows beside one with rows.
        offer = {0: [0, 1, 2], 1: [0, 1, 2]}
        take = {0: [0, 1, 2], 1: []}
        if not (ex.store or ex.serves_pulls):
            pytest.skip("backend's other end is a peer without the serve-pulls protocol")
        if ex.serves_pulls:
            take = {0: [0, 1, 2], 1: [0, 1, 2]}  # a pull names its blocks for every group alike
        transfer_checked(ex, bench, offer, take, "V1.7")


def test_V4_the_rows_of_a_publish_may_repeat(kvwire_harness: Harness) -> None:
    """V4.4: a publish only reads its rows, so two rows may locate the same memory; it is
    accepted and delivers."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3)], 347, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "a publish's repeated rows")
        g = bench.source_view().groups[0]
        assert g.names is not None
        names = np.vstack([g.names, random_names_like(g.names, 1)])
        twice = LayerGroupRows(g.group_id, g.kind, g.region, np.append(g.slots, g.slots[0]), g.tokens, names)
        try:
            out = ex.settle(ex.publish(View((twice,))))
        except SubmissionError as exc:
            raise AssertionError(f"V4.4: a publish whose rows repeat one slot was refused: {exc}") from exc
        assert out.is_delivered and out.masks[0].all(), f"V4.4: {out!r}"
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        bench.apply_fetch(fetched)
        assert fetched.masks[0].all(), f"S1: {fetched!r}"


def random_names_like(names: np.ndarray, count: int) -> np.ndarray:
    rng = np.random.default_rng(int(names.sum()) + count)
    while True:
        extra = rng.integers(0, 256, size=(count, names.shape[1]), dtype=np.uint8)
        if not any((names == row).all(axis=1).any() for row in extra):
            return extra


# -- queue slots ------------------------------------------------------------------------------------

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


# -- A1.5, A9.4, A9.5 --------------------------------------------------------------------------------

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


# -- W1.6, W1.7 ----------------------------------------------------------------------------------------

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
