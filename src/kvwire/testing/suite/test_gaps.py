"""Clauses the fourth probing round found open: views that later work rewrites (V2.2), a refusal
that touched memory or woke (S3.5, S3.7), masks of failed outcomes (A6.5), fetches of the same
rows in flight together (A9.5), and the serving protocol's tickets, addresses and answers (H1.11,
H1.13, N2.3, N2.12). Each names the mutant of ``tests/conformance/mutants_round4.py`` it catches
in ``docs/conformance.md``."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kvwire.contract import (
    CacheKind,
    InvalidSubmission,
    LayerGroupRows,
    PullRequest,
    SubmissionRejected,
    TokenRange,
    View,
)
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import FaultPlan, Harness
from kvwire.testing.holder import (
    Submission,
    Wakes,
    check_refusal_message,
    refused,
    same_outcome,
    settle,
    submit,
)
from kvwire.testing.layout import BLOCK_TOKENS, Bench
from kvwire.testing.plans import pages, with_field
from kvwire.testing.serving import Answer
from kvwire.testing.suite.test_edges import _drain, _fill
from kvwire.testing.suite.test_view import _snapshot, _unchanged

# -- V2.2: later work leaves earlier views alone --------------------------------------------------


def _move(ex: Exchange, bench: Bench, select: dict[int, list[int]]) -> list[View]:
    """Move the rows of ``select`` the way the other end implies; return the views submitted."""
    if ex.store:
        source = bench.source_view(select)
        ex.settle(ex.publish(source))
        sink = bench.sink_view(select)
        bench.apply_fetch(ex.settle(ex.fetch(sink)), select)
        return [source, sink]
    sink = bench.sink_view(select)
    if ex.serves_pulls:
        ex.offer(bench, select)
        sub = ex.fetch(sink)
        holder = ex.holder()
        (request,) = holder.take(1)
        answer = holder.answer(request)
        holder.finish(answer)
        bench.apply_fetch(ex.settle(sub), select)
        assert answer.publish is not None
        return [answer.publish.view, sink]
    source = bench.source_view(select)
    pub, sub = ex.publish(source), ex.fetch(sink)
    ex.settle(pub)
    bench.apply_fetch(ex.settle(sub), select)
    return [source, sink]


def test_V2_later_submissions_leave_earlier_views_as_they_were(kvwire_harness: Harness) -> None:
    """V2.2 / V2.3: a backend never changes a view it was given, also not while it works on later
    submissions: after four transfers, the view of every earlier publish and fetch (a serving
    peer's answers included) still has the groups, slots and names it had, read-only."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 12), (32, 12)], 601, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        seen: list[tuple[View, list]] = []  # type: ignore[type-arg]
        for step in range(4):
            select = {gi: [3 * step, 3 * step + 1, 3 * step + 2] for gi in range(len(plan.groups))}
            for view in _move(ex, bench, select):
                seen.append((view, _snapshot(view)))
            for i, (view, before) in enumerate(seen):
                try:
                    _unchanged(view, before)
                except AssertionError as exc:
                    raise AssertionError(f"V2.2: view {i + 1} of {len(seen)} submitted changed while the backend "
                                         f"worked on later submissions: {exc}") from None


# -- S3.5 / S3.7: a refusal touches no memory and never wakes -------------------------------------


def test_S3_a_fetch_rejected_for_a_full_queue_leaves_its_rows_alone(kvwire_harness: Harness) -> None:
    """S3.5: a fetch rejected because ``max_in_flight`` attempts are in flight wrote nothing: its
    rows hold what the holder left there, before and after the queue drained."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=3, hold=True) as ex:
        bound = ex.caps.max_in_flight
        if bound > 64:
            pytest.skip(f"backend declares a queue bound of {bound}, too large to fill here")
        if not (ex.store and ex.ends.hold is not None or ex.serves_pulls):
            pytest.skip("the suite cannot hold this backend's other end")
        plan = pages([(48, bound + 1)], 607, needs.shares_names(caps))
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            ex.offer(bench)
            spare = {0: [bound]}
            subs, hold, requests = _fill(ex, bench, list(range(bound)))
            try:
                refused(lambda: ex.fetch(bench.sink_view(spare)), f"S3.9: fetch {bound + 1} with {bound} in flight",
                        SubmissionRejected)
                _rows_unchanged(bench, bound, "right after the rejection")
            finally:
                _drain(ex, subs, hold, requests)
            _rows_unchanged(bench, bound, "once the queue drained")
            bench.forget_sink({0: list(range(bound))})
            bench.verify("after the queue drained")


def _rows_unchanged(bench: Bench, row: int, when: str) -> None:
    slot = bench.sink.slots[0][[row]]
    actual = bench.sink.memories[0].read(slot)
    assert np.array_equal(actual, bench.sink.model[0][slot]), (
        f"S3.5: the row of a fetch rejected for a full queue changed ({when}); after SubmissionRejected no memory "
        "of the view was read or written")


def test_S3_a_fetch_refused_for_overlapping_rows_never_wakes(kvwire_harness: Harness) -> None:
    """S3.7 / S3.5 / V4.3: the wake passed with a fetch refused for overlapping rows is never
    called, however much work follows, and its rows are untouched."""
    caps = kvwire_harness.capabilities()
    needs.fetch(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (64, 3)], 613, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
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
            _move(ex, bench, {gi: [0, 1, 2] for gi in range(len(plan.groups))})
            _move(ex, bench, {gi: [2, 0] for gi in range(len(plan.groups))})
        for backend in ex.ends.backends:
            assert not backend.shutdown(), "B3: nothing was in flight"
        for what, wakes in refusals:
            assert wakes.count == 0, f"S3.7: the wake of a fetch refused for {what} was called {wakes.count} time(s)"


def _refused_wakes(ex: Exchange, view: View, what: str) -> Wakes:
    """Submit ``view`` as a fetch with a wake of its own; fail unless ``InvalidSubmission``."""
    wakes = Wakes()
    try:
        ex.ends.sink.fetch(view, ex.ends.fetch_hint, wakes)
    except InvalidSubmission as exc:
        check_refusal_message(exc, what)
        return wakes
    except Exception as exc:
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}; the contract refuses it with "
                             "InvalidSubmission") from exc
    raise AssertionError(f"{what} was accepted; the contract refuses it with InvalidSubmission")


# -- A6.5: the masks of a failed outcome never change ---------------------------------------------


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


# -- A9.5: fetches of the same rows in flight together ---------------------------------------------


def test_A9_fetches_of_the_same_rows_in_flight_together_each_get_them(kvwire_harness: Harness) -> None:
    """A9.5: two fetches of the same held rows (the same groups and names, into two sets of
    memory), in flight together on one instance, each get every row: neither passes rows the other
    is fetching for misses."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.misses(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 5), (48, 5)], 619, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench, \
            Bench(kvwire_harness, None, ex.ends.sink, plan, kind) as twin:
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


# -- the serving protocol: tickets, addresses, answers (H1.11, H1.13, N2.3, N2.12) -----------------


def _one_pull(ex: Exchange, bench: Bench, select: dict[int, list[int]] | None = None) -> tuple[Submission, PullRequest]:
    ex.offer(bench)
    sub = ex.fetch(bench.sink_view(select))
    (request,) = ex.holder().take(1)
    return sub, request


def test_H1_a_ticket_of_another_instance_is_rejected(kvwire_harness: Harness) -> None:
    """H1.13: an answer published on another serving instance with this one's ticket raises
    ``SubmissionRejected`` there and escapes nothing: the pull is still answered where it was
    made, and delivers."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (32, 3)], 631, True)
    with needs.open_exchange(kvwire_harness) as ex, needs.open_exchange(kvwire_harness) as other, \
            Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        sub, request = _one_pull(ex, bench)
        holder = ex.holder()
        answer = holder.tree.view_for(request, holder.tree.held_prefix(request))
        with other.ends.source.register_regions([m.region for m in bench.source.memories]):
            refused(functools.partial(submit, other.ends.source, "publish", answer, request.ticket),
                    "H1.13: an answer published on another instance with this instance's ticket", SubmissionRejected)
        holder.finish(holder.answer(request))
        out = ex.settle(sub)
        bench.apply_fetch(out)
        assert out.is_delivered and all(m.all() for m in out.masks), (
            f"H1.13: after another instance rejected the ticket, the pull must still be answered and deliver: {out!r}")


def test_H1_a_ticket_already_answered_is_refused(kvwire_harness: Harness) -> None:
    """H1.13: a second answer with a ticket already answered raises ``InvalidSubmission``, and
    changes nothing: the requester's fetch keeps the outcome and bytes of the first answer."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (32, 3)], 641, True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        sub, request = _one_pull(ex, bench)
        holder = ex.holder()
        holder.finish(holder.answer(request))
        out = ex.settle(sub)
        bench.apply_fetch(out)
        view = holder.tree.view_for(request, holder.tree.held_prefix(request))
        refused(functools.partial(submit, ex.ends.source, "publish", view, request.ticket),
                "H1.13: a second answer with a ticket already answered")
        try:
            same_outcome(out, sub.attempt.poll(), "fetch")  # type: ignore[arg-type]
        except AssertionError as exc:
            raise AssertionError(f"H1.13: a refused second answer changed the requester's outcome: {exc}") from None
        bench.verify("H1.13: after a second answer with an answered ticket was refused")


def test_H1_a_peer_address_that_is_not_bytes_or_is_empty_is_refused(kvwire_harness: Harness) -> None:
    """H1.11 / H1.5: a peer hint whose ``address`` is no bytes (the address as a str, an int) or
    empty bytes is refused with ``InvalidSubmission``; no pull reaches the serving end and the
    rows are untouched."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.fetch(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 643, True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        holder = ex.holder()
        ex.offer(bench)
        address = ex.ends.fetch_hint.get("address")
        bad = {"the address as a str": address.decode("latin-1") if isinstance(address, bytes) else "x",
               "an int": 7, "empty bytes": b""}
        for what, value in bad.items():
            hint = with_field(ex.ends.fetch_hint, "address", value)
            refused(functools.partial(ex.fetch, bench.sink_view(), hint), f"H1.11: a pull whose address is {what}")
        assert not holder.serving.incoming(), "S3.4: a pull refused for its address reached the serving end"
        bench.verify("S3.5: after pulls refused for their address")
        out = ex.fetch_settled(bench.sink_view())
        bench.apply_fetch(out)
        assert out.is_delivered and all(m.all() for m in out.masks), f"N2: a good pull afterwards must deliver: {out!r}"


def test_N2_a_pull_whose_groups_name_different_blocks_is_refused(kvwire_harness: Harness) -> None:
    """N2.3: a pull names each block once for all its groups: a view whose groups carry other
    names (the second group's in another order, or other blocks), or a group without names, is
    refused with ``InvalidSubmission``; no pull reaches the serving end, the rows are untouched."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.fetch(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (32, 3)], 647, True)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        holder = ex.holder()
        ex.offer(bench)
        view = bench.sink_view()
        g0, g1 = view.groups
        assert g1.names is not None
        other = np.array(g1.names[::-1])
        stranger = np.array(g1.names)
        stranger[-1] = stranger[-1] ^ 0xFF
        cases = {"the second group's names in another order": other,
                 "another block in the second group": stranger, "no names in the second group": None}
        for what, names in cases.items():
            bad = View((g0, LayerGroupRows(g1.group_id, g1.kind, g1.region, g1.slots, g1.tokens, names)))
            refused(functools.partial(ex.fetch, bad), f"N2.3: a pull with {what}")
        assert not holder.serving.incoming(), "S3.4: a pull refused for its names reached the serving end"
        bench.verify("S3.5: after pulls refused for their names")
        out = ex.fetch_settled(view)
        bench.apply_fetch(out)
        assert out.is_delivered and all(m.all() for m in out.masks), f"N2: a good pull afterwards must deliver: {out!r}"


def _misfit_answer(request: PullRequest, bench: Bench, how: str) -> View:
    """An answer to ``request`` (which names the bench's first two blocks) that does not fit it."""
    groups = []
    for gi, gid in enumerate(request.groups):
        region = bench.source.memories[gi].region
        rows = {"one row more than asked": [0, 1, 2], "names that are not the pull's prefix": [1, 0]}[how]
        groups.append(LayerGroupRows(gid, CacheKind.PAGED, region, bench.source.slots[gi][rows],
                                     TokenRange(0, BLOCK_TOKENS * len(rows)), bench.names[gi][rows]))
    return View(tuple(groups))


@pytest.mark.parametrize("how", ["one row more than asked", "names that are not the pull's prefix"])
def test_N2_an_answer_that_does_not_fit_its_pull_fails_both_ends(kvwire_harness: Harness, how: str) -> None:
    """N2.12: an answer with more rows than the pull asked for, or rows named other than the pull's
    prefix, fails: the answer concludes failed, and so does the requester's fetch, saying why,
    without waiting for its deadline; nothing it marks true is wrong (A7)."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (32, 3)], 653, True)
    patience = profiles.active().patience_s
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        take = {0: [0, 1], 1: [0, 1]}
        sub, request = _one_pull(ex, bench, take)
        holder = ex.holder()
        view = _misfit_answer(request, bench, how)
        try:
            answer = submit(ex.ends.source, "publish", view, request.ticket)
        except InvalidSubmission as exc:
            raise AssertionError(f"N2.12: an answer with {how} raised {exc!r}; it fails the answer (an outcome), and "
                                 "the requester's fetch fails saying why") from exc
        holder.answers.append(Answer(request, answer))
        published = settle(answer, patience, purpose=f"N2.12: the answer with {how} concluding")
        assert published.is_failed, f"N2.12: an answer with {how} must fail, got {published!r}"
        out = ex.settle(sub, purpose=f"N2.12: the fetch answered with {how} concluding before its deadline")
        bench.apply_fetch(out, take)
        assert out.is_failed and out.reason, (
            f"N2.12: the requester's fetch answered with {how} must fail saying why, got {out!r}")
