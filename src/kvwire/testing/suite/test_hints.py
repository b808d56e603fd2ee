"""H1: hints. The suite's tests of the hint rule: namespaces, peer addresses and credentials, serving
tickets, deadlines and the fields a backend does not understand."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given

from kvwire.contract import (
    Cause,
    Hint,
    InvalidSubmission,
    SubmissionRejected,
)
from kvwire.contract.capabilities import OtherEnd
from kvwire.contract.lookup import LOOKUP, Lookup
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Harness, Unavailable
from kvwire.testing.holder import (
    call_briefly,
    refused,
    same_outcome,
    settle,
    speaks_causes,
    submit,
)
from kvwire.testing.layout import Bench, simple_plan
from kvwire.testing.marks import checks
from kvwire.testing.plans import (
    paged_exchange,
    pages,
    store_only,
    with_field,
)
from kvwire.testing.strategies import hints
from kvwire.testing.suite._kit import _one_pull, _patience, _pulls, _refused_pulls_left_no_trace

# -- namespaces, credentials ----------------------------------------------------------------------------

@checks("H1.10")
def test_H1_rows_of_the_default_namespace_are_not_found_under_another(kvwire_harness: Harness) -> None:
    """H1.10: rows published with a store hint that names no namespace (the backend's configured
    one) are not found by a fetch naming another namespace."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 4)], 433, False)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        if not ex.store:
            pytest.skip("backend's other end is a peer; a store namespace is a store's clause")
        default = Hint.of(ex.ends.publish_hint.kind, timeout_s=ex.ends.publish_hint.timeout_s,
                          **{k: v for k, v in ex.ends.publish_hint.fields if k != "namespace"})
        put = ex.settle(ex.publish(bench.source_view(), default))
        assert put.is_delivered and all(m.all() for m in put.masks), f"S1: {put!r}"
        other = with_field(ex.ends.fetch_hint, "namespace", "kvwire-suite/elsewhere")
        out = ex.settle(ex.fetch(bench.sink_view(), other))
        bench.apply_fetch(out)
        assert out.is_delivered and out.rows_delivered == 0, (
            f"H1.10: rows of the default namespace were found under namespace 'kvwire-suite/elsewhere': {out!r}")


@checks("H1.12")
def test_H1_a_pull_carries_the_requesters_credentials(kvwire_harness: Harness) -> None:
    """H1.12: the ``credentials`` bytes of the requester's hint reach the serving end unread, in
    ``PullRequest.credentials``."""
    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 439, True)
    secret = bytes(range(7, 40)) + b"\x00kvwire"
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                          plan, kind) as bench:
        ex.offer(bench)
        sub = ex.fetch(bench.sink_view(), with_field(ex.ends.fetch_hint, "credentials", secret))
        holder = ex.holder()
        (request,) = holder.take(1)
        assert request.credentials == secret, (
            f"H1.12: the requester's credentials {secret!r} arrived as {request.credentials!r}")
        holder.finish(holder.answer(request))
        bench.apply_fetch(ex.settle(sub))


# -- H1.6: a hint whose only content is its deadline ---------------------------------------------------------

@checks("H1.6", "A8.4", "A8.2")
@pytest.mark.parametrize("op", ["fetch", "publish"])
def test_H1_A8_a_hint_with_only_a_deadline_keeps_it(kvwire_harness: Harness, op: str) -> None:
    """H1.6 / A8.4 / A8.2: a store hint with no field at all, only ``timeout_s`` (0.4 s, the
    options' deadline far longer), sets the deadline as any hint's does: the held attempt fails
    by it (cause ``DEADLINE``), not by the options' deadline."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = pages([(64, 2)], 3913, needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness, hold=True) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                                     plan, kind) as bench:
        store_only(ex, "a hint with no field (a store hint's fields are optional, H1.7)")
        bare = Hint(ex.ends.fetch_hint.kind, (), 0.4)
        try:
            sub, hold = ex.held_fetch(bench, bare) if op == "fetch" else ex.held_publish(bench, bare)
        except Unavailable as exc:
            pytest.skip(f"harness cannot provide it: {exc}")
        with hold:
            out = settle(sub, 0.4 + _patience(), quiesce=False,
                         purpose=f"H1.6: a held {op} whose hint has only timeout_s=0.4 failing by that deadline")
            assert out.is_failed, f"A8.2: a held {op} must fail by its hint's deadline, got {out!r}"
            if speaks_causes(sub.backend):
                assert out.cause is Cause.DEADLINE, f"A10.7: a deadline failure has cause DEADLINE: {out!r}"
        ex.settle(sub)
        bench.forget_sink()


# -- H1 for stores -------------------------------------------------------------------------------------

@checks("H1.10")
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


@checks("H1.9")
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


@checks("H1.7")
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


@checks("H1.8", "H1.5", also=("L1.9",))
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


# -- H1.5 / H1.11 / H1.12: peer hints without an address, or with credentials that are no bytes ---------


@checks("H1.5", "H1.11", "H1.15", also=("S3.4",))
def test_H1_a_peer_hint_without_an_address_or_with_credentials_not_bytes_is_refused(kvwire_harness: Harness) -> None:
    """H1.5 / H1.11 / H1.15: a peer hint must name the serving end by its ``address``, and its
    ``credentials``, when given, are bytes: after a good pull, a pull whose hint has no address
    (none at all, or only credentials) or whose credentials are a str or an int raises
    ``InvalidSubmission`` (never a pull to the peer pulled from last, or credentials converted);
    no pull reaches the serving end, the rows are untouched, and a good pull afterwards delivers."""
    with paged_exchange(kvwire_harness, [(64, 2)], 739, needs.serve_pulls, needs.fetch, shared=True) as (_, ex, bench):
        ex.offer(bench)
        first = ex.fetch_settled(bench.sink_view())
        bench.apply_fetch(first)
        assert first.is_delivered and all(m.all() for m in first.masks), f"N2: a good pull must deliver: {first!r}"
        hint = ex.ends.fetch_hint
        bad = {
            "no address": Hint.of("peer", timeout_s=hint.timeout_s),
            "credentials but no address": Hint.of("peer", timeout_s=hint.timeout_s, credentials=b"kvwire-suite"),
            "credentials as a str": with_field(hint, "credentials", "kvwire-suite"),
            "credentials as an int": with_field(hint, "credentials", 7),
        }
        for what, value in bad.items():
            refused(functools.partial(ex.fetch, bench.sink_view(), value), f"H1.5/H1.11/H1.12: a pull whose hint has {what}")
        assert not ex.holder().serving.incoming(), "S3.4: a pull refused for its hint reached the serving end"
        bench.verify("S3.5: after pulls refused for their hint")
        again = ex.fetch_settled(bench.sink_view())
        bench.apply_fetch(again)
        assert again.is_delivered and all(m.all() for m in again.masks), (
            f"N2: a good pull after the refused ones must deliver: {again!r}")


@checks("H1.13")
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


@checks("H1.13")
def test_H1_a_ticket_already_answered_is_refused(kvwire_harness: Harness) -> None:
    """H1.13: a second answer with a ticket already answered raises ``InvalidSubmission``, and
    changes nothing: the requester's fetch keeps the outcome and bytes of the first answer."""
    with _pulls(kvwire_harness, [(64, 3), (32, 3)], 641, needs.transfer) as (_, ex, bench):
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


@checks("H1.14", "H1.5")
def test_H1_a_peer_address_that_is_not_bytes_or_is_empty_is_refused(kvwire_harness: Harness) -> None:
    """H1.14 / H1.5: a peer hint whose ``address`` is no bytes (the address as a str, an int) or
    empty bytes is refused with ``InvalidSubmission``; no pull reaches the serving end and the
    rows are untouched."""
    with _pulls(kvwire_harness, [(64, 2)], 643, needs.fetch) as (_, ex, bench):
        ex.offer(bench)
        address = ex.ends.fetch_hint.get("address")
        bad = {"the address as a str": address.decode("latin-1") if isinstance(address, bytes) else "x",
               "an int": 7, "empty bytes": b""}
        for what, value in bad.items():
            hint = with_field(ex.ends.fetch_hint, "address", value)
            refused(functools.partial(ex.fetch, bench.sink_view(), hint), f"H1.11: a pull whose address is {what}")
        _refused_pulls_left_no_trace(ex, bench, bench.sink_view(), "address")


@checks("H1.16", "N2.11")
def test_H1_a_declined_ticket_cannot_be_answered_afterwards(kvwire_harness: Harness) -> None:
    """H1.16 / N2.11: declining a request answers it: a publish with its ticket afterwards raises
    ``InvalidSubmission``, and the requester's fetch stays failed as the decline left it, its
    rows untouched."""
    with _pulls(kvwire_harness, [(64, 2), (32, 2)], 673, needs.transfer) as (_, ex, bench):
        sub, request = _one_pull(ex, bench)
        holder = ex.holder()
        holder.decline(request, "conformance: declined, then answered")
        out = ex.settle(sub)
        assert out.is_failed, f"N2.11: a declined pull must fail: {out!r}"
        view = holder.tree.view_for(request, holder.tree.held_prefix(request))
        refused(functools.partial(submit, ex.ends.source, "publish", view, request.ticket),
                "H1.13: an answer with the ticket of a request the holder declined")
        try:
            same_outcome(out, sub.attempt.poll(), "fetch")  # type: ignore[arg-type]
        except AssertionError as exc:
            raise AssertionError(f"H1.13: a refused answer after a decline changed the requester's outcome: {exc}") \
                from None
        bench.apply_fetch(out)


@checks("H1.3", "H1.13")
def test_H1_a_ticket_decoded_from_its_bytes_answers_the_pull(kvwire_harness: Harness) -> None:
    """H1.3 / H1.13: a serving holder may keep a ticket as bytes (``to_bytes()``) and answer with
    the hint decoded from them: the backend treats it exactly like the ticket it handed out, and
    the pull delivers."""
    with _pulls(kvwire_harness, [(64, 3), (32, 3)], 677, needs.transfer) as (_, ex, bench):
        sub, request = _one_pull(ex, bench)
        holder = ex.holder()
        ticket = Hint.from_bytes(request.ticket.to_bytes())
        assert ticket == request.ticket and ticket is not request.ticket
        try:
            answer = holder.answer(request, ticket=ticket)
        except InvalidSubmission as exc:
            raise AssertionError(f"H1.3/H1.13: an answer with the request's ticket decoded from its bytes raised "
                                 f"{exc!r}; a decoded hint is treated exactly like the original") from exc
        holder.finish(answer)
        out = ex.settle(sub)
        bench.apply_fetch(out)
        assert out.is_delivered and all(m.all() for m in out.masks), (
            f"H1.3/H1.13: the pull answered with its ticket decoded from bytes must deliver: {out!r}")


@checks("H1.12")
def test_H1_each_pull_carries_its_own_credentials(kvwire_harness: Harness) -> None:
    """H1.12: each pull's request carries the credentials of that pull's hint, also when the same
    requester pulled before with others: two credentials in turn, then none (empty bytes)."""
    with _pulls(kvwire_harness, [(32, 3)], 679, needs.transfer) as (_, ex, bench):
        holder = ex.holder()
        ex.offer(bench)
        for row, secret in enumerate([b"kvwire-first\x00", b"kvwire-second\xff", None]):
            hint = ex.ends.fetch_hint if secret is None else with_field(ex.ends.fetch_hint, "credentials", secret)
            sub = ex.fetch(bench.sink_view({0: [row]}), hint)
            (request,) = holder.take(1)
            plain = ex.ends.fetch_hint.get("credentials", b"")  # what the harness's own hint carries (H1.12)
            want = plain if secret is None else secret
            assert request.credentials == want, (
                f"H1.12: pull {row + 1} of one requester carried credentials {want!r}; its request carries "
                f"{request.credentials!r}")
            holder.finish(holder.answer(request))
            out = ex.settle(sub)
            bench.apply_fetch(out, {0: [row]})
            assert out.is_delivered and out.masks[0].all(), f"N2: pull {row + 1} must deliver: {out!r}"


#: A hint kind no backend uses.
UNUSABLE_KIND = "kvwire_conformance_unusable"


# -- H1 ----------------------------------------------------------------------------------------

@checks("H1.5")
def test_H1_unusable_hint_refused(kvwire_harness: Harness) -> None:
    """A hint of a kind the backend does not use is refused in either direction, and nothing
    escaped."""
    caps = kvwire_harness.capabilities()
    kind = needs.usable_kind(kvwire_harness, caps)

    @profiles.examples(max_examples=max(3, profiles.active().examples // 2))
    @given(hint=hints(kind=UNUSABLE_KIND))
    def run(hint: Hint) -> None:
        plan = simple_plan(groups=2, rows=3, seed=31, shared_names=needs.shares_names(caps))
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                              kind) as bench:
            if caps.publish:
                refused(lambda: ex.publish(bench.source_view(), hint), f"H1: a publish with the hint {hint!r}")
            if caps.fetch:
                refused(lambda: ex.fetch(bench.sink_view(), hint), f"H1: a fetch with the hint {hint!r}")
            bench.verify("after refused submissions")
            if caps.fetch and caps.publish and ex.store:
                fetched = ex.settle(ex.fetch(bench.sink_view()))
                bench.apply_fetch(fetched)
                assert fetched.rows_delivered == 0, "S3/H1: a publish refused for its hint reached the store"

    run()


@checks("H1.3")
def test_H1_a_hint_decoded_from_bytes_works_alike(kvwire_harness: Harness) -> None:
    """The hint's byte encoding is the hint: one decoded from ``to_bytes()`` moves rows alike."""
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = simple_plan(groups=2, rows=3, seed=37, shared_names=needs.shares_names(caps))
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        ex.ends.publish_hint = Hint.from_bytes(ex.ends.publish_hint.to_bytes())
        ex.ends.fetch_hint = Hint.from_bytes(ex.ends.fetch_hint.to_bytes())
        result = ex.transfer(bench)
        assert all(m.all() for m in result.fetched.masks), f"H1: decoded hints moved fewer rows: {result.fetched!r}"
