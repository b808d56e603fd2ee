"""Clauses the eighth probing round found open: each test closes a gap a mutant of
``tests/conformance/mutants_round8.py`` showed (docs/conformance.md says which): what
``shutdown()`` owes a fetch its other end holds (B3.2, A10.8, W1.2), a name asked twice in one
fetch (A5.10), a hint that is no ``Hint`` (S4.1), ``cancel()`` of a fetch that concluded but has
not quiesced (A4.6, A4.2), a lookup of thousands of names (L1.3), and a pull made before the
serving end called ``serve()`` (N2.7)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import numpy as np
import pytest

from kvwire.contract import (
    LOOKUP,
    CacheKind,
    Cause,
    Hint,
    LayerGroupRows,
    Lookup,
    ServesPulls,
    TokenRange,
    View,
)
from kvwire.contract.capabilities import OtherEnd
from kvwire.testing import needs, profiles
from kvwire.testing.harness import Harness, Hold
from kvwire.testing.holder import call_briefly, refused, same_outcome, settle, speaks_causes, submit, wait_for
from kvwire.testing.layout import BLOCK_TOKENS, Bench, simple_plan
from kvwire.testing.plans import paged_exchange, pages, store_only

#: Bytes the holder writes into rows an attempt said it is done with.
SENTINEL = 0x6B


# -- B3.2 / A10.8 / W1.2: shutdown() concludes a fetch its other end holds ------------------------------


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


# -- A5.10: a name asked twice in one fetch ------------------------------------------------------------


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


# -- S4.1 / H1.5: a hint that is no Hint -------------------------------------------------------------


def _not_hints(hint: Hint) -> dict[str, object]:
    """Values a holder might pass where a ``Hint`` belongs: none, the hint's bytes, its fields."""
    fields: dict[str, object] = dict(hint.fields)
    fields["kind"] = hint.kind
    return {"None": None, "the hint's bytes": hint.to_bytes(), "a dict of the hint's fields": fields}


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


# -- A4.6 / A4.2: cancel() of a fetch that concluded but has not quiesced ----------------------------------


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
                bench.write_sink(None, SENTINEL)  # taken at its word while the other end still holds the call
        finally:
            hold.release()
        ex.settle(sub, purpose="A4.5: the cancelled fetch quiescing once its other end let go")
        if not early:
            bench.write_sink(None, SENTINEL)
        assert isinstance(hold, Hold) and hold.wait_idle(patience), "the other end did not go idle after release"
        # More work through the same backends: a writer of the cancelled fetch still running lands now.
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, pages([(4096, 4), (64, 4)], 842, plan.shared_names),
                   kind) as later:
            ex.transfer(later)
        bench.verify("A4.2/A2.3: after a second cancel() the fetch had said it quiesced, and the holder reused its rows")
        assert out.is_cancelled, f"A4.3: cancel() before the conclusion yields a cancelled outcome: {out!r}"


# -- L1.3: a lookup of thousands of names ----------------------------------------------------------------


def test_L1_thousands_of_names_in_one_lookup_each_answer(kvwire_harness: Harness) -> None:
    """L1.3 (A9.6 for a lookup): one lookup of 1500 names, of which the store holds every row but
    those at positions 3, 10, 17, ... (also past the first thousand): each bit answers its own
    name, whatever batches the backend asks its store in."""
    caps = kvwire_harness.capabilities()
    if LOOKUP not in caps.protocols:
        pytest.skip(f"backend does not declare the {LOOKUP} protocol")
    if caps.other_end is not OtherEnd.STORE:
        pytest.skip(f"backend declares {LOOKUP} for a peer; this test makes a store other end hold rows")
    rows = 1500
    with paged_exchange(kvwire_harness, [(8, rows)], 861, needs.publish, shared=False) as (_, ex, bench):
        held = np.arange(rows) % 7 != 3
        published = ex.settle(ex.publish(bench.source_view({0: np.flatnonzero(held).tolist()})))
        assert published.is_delivered and published.masks[0].all(), (
            f"S1.2: a publish of {int(held.sum())} rows of 8 bytes must deliver with room to spare: {published!r}")
        sink = ex.ends.sink
        assert isinstance(sink, Lookup), f"B4.6: the backend declares {LOOKUP!r} but does not implement Lookup"
        gid = bench.plan.groups[0].group_id
        answer = call_briefly(lambda: sink.lookup([gid], bench.names[0], ex.ends.fetch_hint), "L1: lookup()",
                              limit_s=profiles.active().patience_s)
        assert type(answer) is np.ndarray and answer.dtype == np.bool_ and answer.shape == (rows,), (
            f"L1.2: a lookup of {rows} names answers a plain bool array of {rows} bits, got {answer!r}")
        wrong = np.flatnonzero(answer != held)
        assert wrong.size == 0, (
            f"L1.3: a lookup of {rows} names answered {wrong.size} bit(s) wrong, first at name(s) {wrong[:8].tolist()} "
            f"(held: {held[wrong[:8]].tolist()}); bit i answers names[i], whatever its place among thousands")


# -- N2.7 / N2.5: a pull declined before serve() ------------------------------------------------------


def test_N2_a_pull_declined_before_serve_is_not_handed_over_once_serving(kvwire_harness: Harness) -> None:
    """N2.7 / N2.5: a pull made before the serving end's holder called ``serve()`` is declined
    (cause ``DECLINED`` for 1.1), and is done with: once ``serve()`` is called, ``incoming()``
    hands over only the pulls made since, and a pull made then delivers."""
    with paged_exchange(kvwire_harness, [(48, 4), (32, 4)], 851, needs.serve_pulls, needs.transfer) as (_, ex, bench):
        early_rows = {0: [0, 1], 1: [0, 1]}
        early = ex.settle(ex.fetch(bench.sink_view(early_rows)))
        assert early.is_failed, f"N2.7: a pull made before serve() is declined, so the fetch fails: {early!r}"
        if speaks_causes(ex.ends.sink):
            assert early.cause is Cause.DECLINED, f"N2.7/A10.10: a pull made before serve() is declined: {early!r}"
        bench.apply_fetch(early, early_rows)
        holder = ex.holder()  # serve() now
        ex.offer(bench)
        late_rows = {0: [2, 3], 1: [2, 3]}
        late = ex.fetch(bench.sink_view(late_rows))
        (request,) = holder.take(1)
        asked = bench.names[0][[2, 3]]
        assert np.array_equal(request.names, asked), (
            "N2.7: once serve() was called, incoming() handed over a request naming blocks "
            f"{request.names.tolist()}, not the pull made since ({asked.tolist()}); a pull made before serve() was "
            "declined, and is never handed over later")
        holder.finish(holder.answer(request))
        out = ex.settle(late)
        bench.apply_fetch(out, late_rows)
        assert out.is_delivered and all(m.all() for m in out.masks), f"N2: the pull made after serve() delivers: {out!r}"
        serving = ex.ends.source
        assert isinstance(serving, ServesPulls)
        left = (*holder._pending, *call_briefly(serving.incoming, "N2.5: incoming()"))
        assert left == (), (
            f"N2.7/N2.5: every pull made since serve() was taken, yet incoming() handed over {len(left)} more "
            "(a pull declined before serve())")
