"""Clause by clause, under pressure: deadlines of attempts queued behind others, several pairs
of instances at once, refusals that must leave no trace (and no wake), memory described by a
second region, large rows reused the moment they quiesce, pulls that arrive together, store
namespaces and hint fields. Each test names its clause of ``docs/contract.md`` in its
docstring's first line. One file of ~550 lines: the store-namespace tests share their helpers
with the pressure tests (the lookup end, the held rows of an offer)."""


from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from kvwire.contract import (
    CacheKind,
    Cause,
    Hint,
    LayerGroupRows,
    MemoryKind,
    SlotRegion,
    SubmissionRejected,
    TokenRange,
    View,
)
from kvwire.contract.capabilities import OtherEnd
from kvwire.contract.errors import SubmissionError
from kvwire.contract.lookup import LOOKUP, Lookup
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Harness, Hold, shut_down
from kvwire.testing.holder import Submission, Wakes, call_briefly, refused, settle, speaks_causes
from kvwire.testing.layout import Bench
from kvwire.testing.plans import (
    check_bits,
    pages,
    store_only,
    with_field,
)

SENTINEL = 0xA5
MiB = 1 << 20


# -- deadlines ------------------------------------------------------------------------------------

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


# -- instances -----------------------------------------------------------------------------------

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


# -- refusals leave no trace ----------------------------------------------------------------------

def _stray_group(harness: Harness, kind: MemoryKind, template: LayerGroupRows, gid: int) -> tuple[LayerGroupRows, Bench]:
    """A group in memory no backend registered, shaped like ``template``."""
    plan = pages([(template.region.slot_bytes, template.rows)], 263, False)
    stray = Bench(harness, None, None, plan, kind)
    view = stray.sink_view()
    g = view.groups[0]
    names = template.names
    return LayerGroupRows(gid, CacheKind.PAGED, g.region, g.slots, g.tokens, names), stray


def test_S3_a_refused_view_leaves_no_trace_of_its_valid_groups(kvwire_harness: Harness) -> None:
    """S3.4-S3.6: a view refused for its last group (rows nobody registered, or no names where names
    are required) told the other end nothing about its first groups: nothing stored, nothing
    written, no pull sent."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3), (32, 3)], 269, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        strays: list[Bench] = []
        try:
            def spoiled(view: View) -> list[tuple[str, View]]:
                stray, extra = _stray_group(kvwire_harness, kind, view.groups[0], 99)
                strays.append(extra)
                out = [("rows nobody registered", View((*view.groups, stray)))]
                if caps.content_addressed:
                    last = view.groups[-1]
                    bare = LayerGroupRows(last.group_id, last.kind, last.region, last.slots, last.tokens, None)
                    out.append(("a group without names", View((*view.groups[:-1], bare))))
                return out

            if ex.serves_pulls:
                ex.offer(bench)
            if caps.publish and (ex.store or not ex.serves_pulls):
                for what, view in spoiled(bench.source_view()):
                    refused(functools.partial(ex.publish, view), f"S3.4: a publish with {what} in its last group")
            if caps.fetch:
                for what, view in spoiled(bench.sink_view()):
                    refused(functools.partial(ex.fetch, view), f"S3.4: a fetch with {what} in its last group")
            bench.verify("S3.5: after refused submissions")
            if caps.fetch and (ex.store or ex.serves_pulls):
                sub = ex.fetch(bench.sink_view())
                if ex.serves_pulls:
                    holder = ex.holder()
                    (request,) = holder.take(1)
                    holder.finish(holder.answer(request))
                    assert not holder.serving.incoming(), "S3.4: a refused fetch's pull reached the serving end"
                    assert len(holder.answers) == 1, "S3.4: a refused fetch's pull reached the serving end"
                out = ex.settle(sub)
                bench.apply_fetch(out)
                if ex.store:
                    assert out.rows_delivered == 0, (
                        f"S3.4: a refused publish stored rows of its valid groups: a fetch found {out!r}")
        finally:
            for stray in strays:
                stray.close()


def test_S3_a_refused_submission_never_wakes(kvwire_harness: Harness) -> None:
    """S3.7: after ``InvalidSubmission`` or ``SubmissionRejected`` the backend never calls that
    submission's wake, however much work follows."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3)], 271, needs.shares_names(caps))
    unusable = Hint.of("kvwire_conformance_unusable")
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        stray = Bench(kvwire_harness, None, None, plan, kind)
        wakes: list[tuple[str, Wakes]] = []
        cases = []
        if caps.publish:
            cases += [("publish", bench.source_view(), unusable), ("publish", stray.source_view(), ex.ends.publish_hint)]
        if caps.fetch:
            cases += [("fetch", bench.sink_view(), unusable), ("fetch", stray.sink_view(), ex.ends.fetch_hint)]
        for op, view, hint in cases:
            wake = Wakes()
            backend = ex.ends.source if op == "publish" else ex.ends.sink
            call = backend.publish if op == "publish" else backend.fetch
            try:
                call(view, hint, wake)
            except SubmissionError:
                wakes.append((op, wake))
            else:
                raise AssertionError(f"S3/H1/M4: a {op} the contract refuses was accepted")
        if caps.fetch and caps.publish:
            ex.transfer(bench)
        for backend in ex.ends.backends:
            assert not backend.shutdown(), "B3: nothing was in flight"
        for op, wake in wakes:
            assert wake.count == 0, f"S3.2: the wake of a refused {op} was called {wake.count} time(s)"
        stray.close()


# -- V4 through a second region ---------------------------------------------------------------------

def test_V4_rows_that_alias_through_a_second_region_are_refused(kvwire_harness: Harness) -> None:
    """V4.1 / V4.2: a fetch whose rows overlap through a second region describing the same
    registered memory (shifted by half a slot, the same span under another id, or a region of
    smaller slots whose row lies inside a larger row past its own size) is refused, whichever
    group comes first, and touches nothing."""
    caps = kvwire_harness.capabilities()
    needs.fetch(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4), (64, 4)], 277, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, None, ex.ends.sink, plan, kind) as bench:
        view = bench.sink_view()
        first = view.groups[0]
        r = first.region
        extra_names = np.full((1, 16), 0xEE, dtype=np.uint8)
        if (second_names := view.groups[1].names) is not None:
            extra_names = second_names[:1]
        quarter = max(1, r.slot_bytes // 4)
        for label, alias, slot in (
                ("shifted by half a slot", SlotRegion(r.region_id + 10_000, r.base + r.slot_bytes // 2, r.slot_bytes,
                                                      r.slot_count - 1, r.memory_kind, r.device), int(first.slots[0])),
                ("the same span under another id", SlotRegion(r.region_id + 20_000, r.base, r.slot_bytes, r.slot_count,
                                                             r.memory_kind, r.device), int(first.slots[-1])),
                # Slots of a quarter row from the middle of slot 0: slot 4*s is the third quarter
                # of row slot s, a small row lying inside a big one, past its own size from the
                # big row's start.
                ("of smaller slots, a row inside a larger row",
                 SlotRegion(r.region_id + 30_000, r.base + r.slot_bytes // 2, quarter,
                            (r.slot_count - 1) * r.slot_bytes // quarter, r.memory_kind, r.device),
                 int(first.slots[0]) * r.slot_bytes // quarter)):
            clash = LayerGroupRows(view.groups[1].group_id, CacheKind.PAGED, alias, np.array([slot]),
                                   TokenRange(0, 16), extra_names if first.names is not None else None)
            for order, bad in (("after", View((first, clash))), ("before", View((clash, first)))):
                assert bad.overlapping_rows() is not None
                refused(functools.partial(ex.fetch, bad),
                        f"V4.1/V4.2: a fetch whose rows overlap through a region {label} (its group {order} the other)")
        bench.verify("V4.2: after refused overlapping fetches")


# -- A2 with large rows -------------------------------------------------------------------------------

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
            bench.write_source(None, SENTINEL)  # as soon as it quiesced
        elif ex.serves_pulls:
            ex.offer(bench)
        fetch = ex.fetch(bench.sink_view())
        if ex.serves_pulls:
            holder = ex.holder()
            (request,) = holder.take(1)
            answer = holder.answer(request)
            holder.finish(answer)
            bench.write_source(None, SENTINEL)
        out = ex.settle(fetch)
        # The holder reuses the rows the moment the fetch quiesced (A2.3): it takes what arrived,
        # then overwrites the rows, before anything else. A writer still copying the last chunk of
        # a large fetch would land on the holder's bytes.
        arrived = [bench.sink.memories[gi].read(bench.sink.slots[gi]) for gi in range(len(plan.groups))]
        bench.write_sink(None, SENTINEL)
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


# -- W1 for serving peers ----------------------------------------------------------------------------

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


# -- H1 for stores -------------------------------------------------------------------------------------

def test_H1_a_store_keeps_namespaces_apart(kvwire_harness: Harness) -> None:
    """H1.10: a store hint's namespace is where rows are stored and found: a fetch under another
    namespace misses, one under the same namespace finds them."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4), (16, 4)], 307, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "a store namespace")
        tenant_a = with_field(ex.ends.publish_hint, "namespace", "kvwire-suite/tenant-a")
        tenant_b = with_field(ex.ends.fetch_hint, "namespace", "kvwire-suite/tenant-b")
        fetch_a = with_field(ex.ends.fetch_hint, "namespace", "kvwire-suite/tenant-a")
        put = ex.settle(ex.publish(bench.source_view(), tenant_a))
        assert put.is_delivered and all(m.all() for m in put.masks), f"S1: {put!r}"
        for hint, label in ((tenant_b, "another namespace"), (ex.ends.fetch_hint, "the harness's own hint")):
            other = ex.settle(ex.fetch(bench.sink_view(), hint))
            bench.apply_fetch(other)
            assert other.is_delivered and other.rows_delivered == 0, (
                f"H1.10: rows published under namespace 'kvwire-suite/tenant-a' were found under {label}: {other!r}")
        same = ex.settle(ex.fetch(bench.sink_view(), fetch_a))
        bench.apply_fetch(same)
        assert all(m.all() for m in same.masks), f"H1.10: rows were not found under their own namespace: {same!r}"


def test_H1_a_store_refuses_hint_fields_it_does_not_understand(kvwire_harness: Harness) -> None:
    """H1.9: a store hint with a field the backend does not understand is refused, and nothing
    escaped."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 311, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "a store hint's fields")
        if caps.publish:
            odd = with_field(ex.ends.publish_hint, "kvwire_suite_unknown_field", 1)
            refused(functools.partial(ex.publish, bench.source_view(), odd), "H1.9: a publish with an unknown field")
        if caps.fetch:
            odd = with_field(ex.ends.fetch_hint, "kvwire_suite_unknown_field", 1)
            refused(functools.partial(ex.fetch, bench.sink_view(), odd), "H1.9: a fetch with an unknown field")
            if caps.publish:
                out = ex.settle(ex.fetch(bench.sink_view()))
                bench.apply_fetch(out)
                assert out.rows_delivered == 0, f"S3: a refused publish reached the store: {out!r}"
        bench.verify("after refused submissions")


def _without_field(hint: Hint, key: str) -> Hint:
    return Hint.of(hint.kind, timeout_s=hint.timeout_s, **{k: v for k, v in hint.fields if k != key})


def _lookup_end(ex: Exchange) -> Lookup | None:
    """The fetching end, when it declares ``lookup`` of a store (L1), else ``None``."""
    sink = ex.ends.sink
    if LOOKUP in ex.caps.protocols and ex.caps.other_end is OtherEnd.STORE and isinstance(sink, Lookup):
        return sink
    return None


def _held(bench: Bench, offer: dict[int, list[int]]) -> list[np.ndarray]:
    """Per group of ``bench``, which of its rows ``offer`` holds."""
    return [np.isin(np.arange(g.rows), offer.get(gi, ())) for gi, g in enumerate(bench.plan.groups)]


def test_H1_a_hint_without_a_namespace_means_the_configured_one(kvwire_harness: Harness) -> None:
    """H1.7: a store hint without ``namespace`` means the namespace the backend was configured
    with: rows published without one are found by a fetch (and a lookup) that names it, and
    rows published naming it are found by a fetch without one."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4), (16, 4)], 313, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "a store's configured namespace")
        configured = ex.ends.extra.get("namespace")
        if not isinstance(configured, str):
            pytest.skip("harness does not say which namespace its store backends were configured with "
                        "(Ends.extra['namespace'])")
        bare_publish = _without_field(ex.ends.publish_hint, "namespace")
        bare_fetch = _without_field(ex.ends.fetch_hint, "namespace")
        named_publish = with_field(ex.ends.publish_hint, "namespace", configured)
        named_fetch = with_field(ex.ends.fetch_hint, "namespace", configured)
        first = {0: [0, 1], 1: [0, 1]}
        steps = ((first, bare_publish, named_fetch, "without a namespace", f"naming namespace {configured!r}"),
                 ({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, named_publish, bare_fetch,
                  f"naming namespace {configured!r}", "without a namespace"))
        for offer, put_hint, get_hint, put_label, get_label in steps:
            put = ex.settle(ex.publish(bench.source_view(offer), put_hint))
            assert put.is_delivered and all(m.all() for m in put.masks), (
                f"H1.7: a publish {put_label} (the backend's configured namespace {configured!r}) did not "
                f"deliver: {put!r}")
            got = ex.settle(ex.fetch(bench.sink_view(), get_hint))
            bench.apply_fetch(got)
            for gi, (mask, want) in enumerate(zip(got.masks, _held(bench, offer), strict=True)):
                assert np.array_equal(mask, want), (
                    f"H1.7: rows published {put_label} were fetched {get_label}, the namespace the backend was "
                    f"configured with: group {plan.groups[gi].group_id} marks rows {np.flatnonzero(mask).tolist()}, "
                    f"held are rows {np.flatnonzero(want).tolist()}; a store hint without a namespace means the "
                    f"configured one")
            asker = _lookup_end(ex)
            if asker is not None:
                gid = plan.groups[0].group_id
                for hint in (named_fetch, bare_fetch):
                    answer = call_briefly(functools.partial(asker.lookup, [gid], bench.names[0], hint),
                                          "L1: lookup()", limit_s=profiles.active().patience_s)
                    want = np.isin(np.arange(plan.groups[0].rows), offer[0])
                    assert np.array_equal(np.asarray(answer), want), (
                        f"H1.7/L1.3: after a publish {put_label}, a lookup "
                        f"{'naming ' + repr(configured) if hint is named_fetch else 'without a namespace'} answered "
                        f"{np.asarray(answer).astype(int).tolist()}, held are {want.astype(int).tolist()}")


#: Namespaces outside H1.8's form (1-128 ASCII letters, digits or ``._:@+=-/``, not starting
#: with ``/``) and values that are no namespace at all (H1.5: an ill-typed field).
MALFORMED_NAMESPACES: tuple[tuple[str, str, object], ...] = (
    ("H1.8", "starting with '/'", "/kvwire-suite"),
    ("H1.8", "holding a space", "kvwire suite"),
    ("H1.8", "of 129 characters", "x" * 129),
    ("H1.8", "empty", ""),
    ("H1.8", "holding a non-ASCII letter", "\u00e9"),
    ("H1.8", "holding a newline", "kvwire-suite\nb"),
    ("H1.8", "holding a backslash", "kvwire\\suite"),
    ("H1.5", "an int", 5),
    ("H1.5", "bytes", b"bytes"),
    ("H1.5", "a float", 1.5),
    ("H1.5", "a bool", True),
)

#: Namespaces at the edge of H1.8's form, which a store takes like any other.
EDGE_NAMESPACES: tuple[tuple[str, str], ...] = (
    ("of 128 characters", "x" * 128),
    ("of one character", "z"),
    ("of every allowed character", "kvwire-suite/AZaz09._:@+=-/x"),
)


def test_H1_a_namespace_of_the_wrong_form_or_type_is_refused(kvwire_harness: Harness) -> None:
    """H1.8 / H1.5: a store hint whose namespace is not 1-128 ASCII letters, digits or
    ``._:@+=-/`` not starting with ``/`` (or is no str at all) is refused with
    ``InvalidSubmission`` by a publish, a fetch and a lookup (L1.9), and nothing escaped; a
    namespace at the edge of that form (128 characters, one, every allowed character) is taken."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 3)], 317, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        store_only(ex, "a store namespace's form")
        asker = _lookup_end(ex)
        gid = plan.groups[0].group_id
        for clause, label, value in MALFORMED_NAMESPACES:
            what = f"whose store hint's namespace is {label} ({value!r})"
            if caps.publish:
                hint = with_field(ex.ends.publish_hint, "namespace", value)
                refused(functools.partial(ex.publish, bench.source_view(), hint), f"{clause}: a publish {what}")
            if caps.fetch:
                hint = with_field(ex.ends.fetch_hint, "namespace", value)
                refused(functools.partial(ex.fetch, bench.sink_view(), hint), f"{clause}: a fetch {what}")
            if asker is not None:
                hint = with_field(ex.ends.fetch_hint, "namespace", value)
                refused(functools.partial(call_briefly, functools.partial(asker.lookup, [gid], bench.names[0], hint),
                                          "L1: lookup()", profiles.active().patience_s),
                        f"{clause}/L1.9: a lookup {what}")
        bench.verify(f"{'/'.join(sorted({c for c, _, _ in MALFORMED_NAMESPACES}))}: after refused submissions")
        if not (caps.publish and caps.fetch):
            return
        for hint, label in ((ex.ends.fetch_hint, "the harness's fetch hint"),
                            (_without_field(ex.ends.fetch_hint, "namespace"), "a hint without a namespace")):
            out = ex.settle(ex.fetch(bench.sink_view(), hint))
            bench.apply_fetch(out)
            assert out.rows_delivered == 0, (
                f"H1.8: publishes refused for their namespace stored rows: a fetch with {label} found {out!r}")
        for label, value in EDGE_NAMESPACES:
            put = ex.settle(ex.publish(bench.source_view(), with_field(ex.ends.publish_hint, "namespace", value)))
            got = ex.settle(ex.fetch(bench.sink_view(), with_field(ex.ends.fetch_hint, "namespace", value)))
            bench.apply_fetch(got)
            assert put.is_delivered and got.is_delivered and all(m.all() for m in got.masks), (
                f"H1.8: rows published under a namespace {label} ({value!r}), which is a namespace, were not all "
                f"found under it: publish {put!r}, fetch {got!r}")
