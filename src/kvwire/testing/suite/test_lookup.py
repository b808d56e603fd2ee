"""L1: the optional protocol ``lookup`` (contract 1.1): which names the other end holds now.

Every test skips, naming the capability, unless the backend declares ``lookup`` for a store
other end. The store is made to hold rows by a publish, as in every other test, and each answer
is checked against what the suite knows it holds."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import (
    LOOKUP,
    Capabilities,
    Hint,
    InvalidSubmission,
    Lookup,
    SubmissionRejected,
)
from kvwire.contract.capabilities import OtherEnd
from kvwire.contract.errors import LookupFailed, SubmissionError
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import FaultPlan, Harness
from kvwire.testing.holder import (
    call_briefly,
    declares,
    settle,
    wait_for,
)
from kvwire.testing.layout import Bench, ViewPlan, random_names, simple_plan
from kvwire.testing.marks import checks
from kvwire.testing.plans import paged_exchange
from kvwire.testing.strategies import selections

UNUSABLE = Hint.of("kvwire_conformance_unusable")


#: How long after its deadline a lookup may take to raise ``LookupFailed`` (L1.7): scheduling
#: delay on a loaded machine, never a second wait.
LOOKUP_SLACK_S = 1.0


def _needs_lookup(caps: Capabilities) -> None:
    if LOOKUP not in caps.protocols:
        pytest.skip(f"backend does not declare the {LOOKUP} protocol")
    if caps.other_end is not OtherEnd.STORE:
        pytest.skip(f"backend declares {LOOKUP} for a peer; these tests make a store other end hold rows")
    needs.publish(caps)


def _asker(ex: Exchange) -> Lookup:
    """The end that asks: the fetching end, about the other end its fetch hint names."""
    sink = ex.ends.sink
    assert LOOKUP in sink.capabilities().protocols, "B4: a built backend does not declare the lookup its plugin declares"
    assert isinstance(sink, Lookup), (
        f"B4/L1: the backend declares {LOOKUP!r} but does not implement kvwire.contract.Lookup")
    return sink


def _ask(ex: Exchange, groups: list[int], names: np.ndarray, hint: Hint | None = None,
         timeout_s: float | None = None) -> np.ndarray:
    """A lookup, checked for the shape of its answer (a new, plain, read-only bool array of one
    bit per name) and bounded so a hang fails instead of stalling the suite."""
    asker = _asker(ex)
    # A uint8 array is passed as given (strided or not, L1.3); anything else as such an array.
    if not (isinstance(names, np.ndarray) and names.dtype == np.uint8):
        names = np.array(names, dtype=np.uint8)
    asked = names.copy()
    limit = (timeout_s or 0) + profiles.active().patience_s
    answer = call_briefly(lambda: asker.lookup(groups, names, hint or ex.ends.fetch_hint, timeout_s),
                          "L1: lookup()", limit_s=limit)
    assert type(answer) is np.ndarray, f"L1: lookup() answered a {type(answer).__name__}, not a plain numpy.ndarray"
    assert answer.dtype == np.bool_, f"L1: lookup() answered dtype {answer.dtype}, not bool"
    assert answer.shape == (names.shape[0],), (
        f"L1: lookup() of {names.shape[0]} names answered shape {answer.shape}; it answers one bit per name")
    assert not answer.flags.writeable, "L1: lookup()'s answer is writable; it is a read-only array"
    assert not np.shares_memory(answer, names), "L1: lookup()'s answer shares memory with the names asked"
    np.testing.assert_array_equal(names, asked, err_msg="L1: lookup() changed the names it was given")
    return answer


def _expect(answer: np.ndarray, want: np.ndarray, what: str) -> None:
    wrong = np.flatnonzero(answer != want)
    assert wrong.size == 0, (
        f"L1: {what}: lookup() answered {answer.astype(int).tolist()}, the other end holds "
        f"{np.asarray(want).astype(int).tolist()} (first wrong name: {int(wrong[0])})")


def _plan(caps: Capabilities, *, groups: int = 2, rows: int = 4, seed: int, width: int = 16) -> ViewPlan:
    # Names shared by every group, so one name can be asked about in several groups at once.
    return simple_plan(groups=groups, rows=rows, seed=seed, name_width=width, shared_names=True)


@checks(also=("L1.1", "L1.2", "L1.3"))
def test_L1_held_names_answer_true_and_others_false(kvwire_harness: Harness) -> None:
    """Property: offer some rows of every group; a lookup of each group's names answers true
    exactly for the offered ones, and names never stored answer false."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    kind = needs.usable_kind(kvwire_harness, caps)

    @profiles.examples()
    @given(data=st.data(), rows=st.integers(1, 8), seed=st.integers(0, 2**16))
    def run(data: st.DataObject, rows: int, seed: int) -> None:
        plan = simple_plan(groups=2, rows=rows, seed=seed)
        with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                              kind) as bench:
            offer = data.draw(selections(plan), label="offered rows")
            ex.offer(bench, offer)
            for gi, g in enumerate(plan.groups):
                held = np.isin(np.arange(g.rows), bench.rows_of(offer)[gi])
                _expect(_ask(ex, [g.group_id], bench.names[gi]), held, f"group {g.group_id}'s names")
            strangers = random_names(np.random.default_rng(seed + 1), 5, plan.groups[0].name_width)
            strangers = strangers[~(strangers[:, None, :] == np.vstack(bench.names)[None]).all(-1).any(-1)]
            _expect(_ask(ex, [plan.groups[0].group_id], strangers), np.zeros(len(strangers), bool),
                    "names never stored")
            bench.verify("after lookups")

    run()


@checks("L1.3", "N1.2")
def test_L1_a_name_held_in_one_group_is_not_held_in_another(kvwire_harness: Harness) -> None:
    """L1.3 / N1.2: a store keys rows by (group, name): names offered in group 0 only answer false
    for group 1, and for groups (0, 1) and (1, 0) together; names offered in both answer true; of
    three groups listed, a name missing from any one of them (the middle one too) is not held."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan(caps, groups=3, seed=311)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        ex.offer(bench, {0: [0, 1, 2, 3], 1: [0, 1], 2: [0, 1, 2, 3]})
        names = bench.names[0]
        both = np.array([True, True, False, False])
        g0, g1, g2 = (g.group_id for g in plan.groups)
        _expect(_ask(ex, [g0], names), np.ones(4, bool), "names offered in group 0, asked in group 0")
        _expect(_ask(ex, [g1], names), both, "names offered in group 0 only, asked in group 1")
        _expect(_ask(ex, [g0, g1], names), both, "a name is held only if held in every group listed")
        _expect(_ask(ex, [g1, g0], names), both, "the order of the groups does not matter")
        _expect(_ask(ex, [g0, g1 + 7], names), np.zeros(4, bool), "a group nothing was offered in")
        _expect(_ask(ex, [g0, g2], names), np.ones(4, bool), "names offered in groups 0 and 2, asked in both")
        for listed in ([g0, g1, g2], [g2, g1, g0], [g0, g2, g1]):
            _expect(_ask(ex, listed, names), both, f"groups {listed}: names held in two of them but not in group {g1}")


@checks(also=("L1.3",))
@pytest.mark.parametrize("width", [1, 16, 64])
def test_L1_names_that_differ_in_one_byte_or_hold_zero_bytes(kvwire_harness: Harness, width: int) -> None:
    """Names are opaque fixed-width bytes: an all-zero name is a name like any other; names
    that differ from a held one in a single byte (first, last), or are a prefix of it, are
    not held."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan(caps, groups=1, rows=4, seed=317 + width, width=width)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        names = np.zeros((4, width), dtype=np.uint8)
        names[1, -1] = 1           # differs from row 0 in its last byte
        names[2, 0] = 0x80         # ... in its first byte
        names[3, :] = 0xFF
        bench.names[0] = names
        ex.offer(bench, {0: [0, 3]})
        gid = plan.groups[0].group_id
        _expect(_ask(ex, [gid], names), np.array([True, False, False, True]), "zero-byte and one-byte-apart names")
        flipped = names[[0, 3]].copy()
        flipped[:, width // 2] ^= 0x01
        _expect(_ask(ex, [gid], flipped), np.zeros(2, bool), "held names with one byte flipped in the middle")
        if width > 1:
            _expect(_ask(ex, [gid], names[[0, 3], : width - 1]), np.zeros(2, bool),
                    "a prefix of a held name is another name")
        if caps.fetch:  # a backend may declare lookup and publish only (B4)
            fetched = ex.fetch_settled(bench.sink_view())
            bench.apply_fetch(fetched)
            np.testing.assert_array_equal(fetched.masks[0], [True, False, False, True],
                                          err_msg="A5: the fetch after the lookup holds what the lookup said")


@checks("L1.3")
def test_L1_names_that_are_a_slice_of_a_larger_array_are_read_as_given(kvwire_harness: Harness) -> None:
    """L1.3: bit ``i`` answers ``names[i]`` as the caller's array holds it, also when the array is
    not one contiguous block: every other row of a larger array, a column slice of wider rows, the
    rows in reverse, an array in Fortran order."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan(caps, groups=1, rows=4, seed=359)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        ex.offer(bench, {0: [0, 2]})
        gid = plan.groups[0].group_id
        names = bench.names[0]
        want = np.array([True, False, True, False])
        rng = np.random.default_rng(359)
        interleaved = np.repeat(names, 2, axis=0)
        interleaved[1::2] = random_names(rng, 4, names.shape[1])  # never stored
        wide = rng.integers(0, 256, size=(4, names.shape[1] + 24), dtype=np.uint8)
        wide[:, 8: 8 + names.shape[1]] = names
        cases = {"every other row of a larger array": (interleaved[::2], want),
                 "a column slice of wider rows": (wide[:, 8: 8 + names.shape[1]], want),
                 "the rows in reverse": (names[::-1], want[::-1]),
                 "an array in Fortran order": (np.asfortranarray(names), want)}
        for what, (given, expected) in cases.items():
            assert not given.flags.c_contiguous or what.startswith("an array in Fortran")
            _expect(_ask(ex, [gid], given), expected, f"names given as {what}")


@checks("L1.3")
def test_L1_a_name_asked_several_times_answers_each_time(kvwire_harness: Harness) -> None:
    """L1.3: bit ``i`` answers ``names[i]`` wherever else that name appears in the same lookup: a
    name asked several times (as when the lookups of requests that share a prefix are batched)
    answers the same at each place, held or not."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan(caps, groups=1, rows=3, seed=361)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        ex.offer(bench, {0: [0, 2]})
        order = [0, 1, 0, 2, 0, 1, 2]
        _expect(_ask(ex, [plan.groups[0].group_id], bench.names[0][order]), np.isin(order, [0, 2]),
                f"rows {order} asked in one lookup, rows 0 and 2 held")


@checks(also=("L1.11", "H1.7"))
def test_L1_names_of_another_namespace_are_not_held(kvwire_harness: Harness) -> None:
    """A store namespace (a tenant) is part of the key: names held in the hint's namespace
    answer false when the hint names another one."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan(caps, groups=1, rows=3, seed=331)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        hint = ex.ends.fetch_hint
        if hint.get("namespace") is None:
            pytest.skip("the backend's fetch hint names no store namespace")
        ex.offer(bench)
        gid = plan.groups[0].group_id
        _expect(_ask(ex, [gid], bench.names[0]), np.ones(3, bool), "names held in the hint's namespace")
        namespace = hint["namespace"]
        assert isinstance(namespace, str), f"H1.7: a store hint's namespace is a str, got {namespace!r}"
        fields = {**dict(hint.fields), "namespace": f"{namespace}-another-tenant"}
        other = Hint(hint.kind, tuple(fields.items()), hint.timeout_s)
        _expect(_ask(ex, [gid], bench.names[0], other), np.zeros(3, bool), "the same names in another namespace")


@checks("L1.9", also=("L1.13",))
def test_L1_unusable_hints_and_bad_arguments_refused(kvwire_harness: Harness) -> None:
    """L1.9: an unusable hint, names that are not a 2-D uint8 array of width 1..64 (one or three
    dimensions, another dtype, a list), no groups, a group id that is negative or no int (a
    float, a str, None; a bool, L1.13, for a 1.2 backend), or a timeout that is not a positive
    number: ``InvalidSubmission``."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    with needs.open_exchange(kvwire_harness) as ex:
        asker = _asker(ex)
        names = np.zeros((2, 16), dtype=np.uint8)
        hint = ex.ends.fetch_hint
        bad: list[tuple[str, object]] = [
            ("an unusable hint", lambda: asker.lookup([0], names, UNUSABLE)),
            ("names of one dimension", lambda: asker.lookup([0], names[0], hint)),
            ("names of dtype int64", lambda: asker.lookup([0], names.astype(np.int64), hint)),
            ("names of width 0", lambda: asker.lookup([0], np.zeros((2, 0), np.uint8), hint)),
            ("names of width 65", lambda: asker.lookup([0], np.zeros((2, 65), np.uint8), hint)),
            ("a list instead of an array", lambda: asker.lookup([0], names.tolist(), hint)),  # type: ignore[arg-type]
            ("names of three dimensions", lambda: asker.lookup([0], names.reshape(2, 1, 16), hint)),
            ("no groups", lambda: asker.lookup([], names, hint)),
            ("a negative group id", lambda: asker.lookup([-1], names, hint)),
            ("a float group id", lambda: asker.lookup([0.0], names, hint)),  # type: ignore[list-item]
            ("a str group id", lambda: asker.lookup(["0"], names, hint)),  # type: ignore[list-item]
            ("a group id of None", lambda: asker.lookup([None], names, hint)),  # type: ignore[list-item]
            ("a bool group id", lambda: asker.lookup([True], names, hint)),
            ("a zero timeout", lambda: asker.lookup([0], names, hint, 0.0)),
        ]
        def clause_of(what: str) -> str:
            return "L1.13" if what == "a bool group id" else "L1.9"

        if not declares(ex.ends.sink, "L1.13"):  # a bool group id is refused from contract 1.2
            bad = [(what, call) for what, call in bad if what != "a bool group id"]
        for what, call in bad:
            try:
                call_briefly(call, f"L1: lookup() with {what}", limit_s=profiles.active().patience_s)  # type: ignore[arg-type]
            except InvalidSubmission:
                continue
            except Exception as exc:
                raise AssertionError(f"{clause_of(what)}: lookup() with {what} raised {type(exc).__name__}: {exc}; "
                                     "the contract refuses it with InvalidSubmission") from exc
            raise AssertionError(f"{clause_of(what)}: lookup() with {what} was answered; the contract refuses it "
                                 "with InvalidSubmission")


@checks(also=("L1.10",))
def test_L1_lookup_after_shutdown_rejected(kvwire_harness: Harness) -> None:
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    with needs.open_exchange(kvwire_harness) as ex:
        asker = _asker(ex)
        assert not ex.ends.sink.shutdown(), "B3: shutdown() with nothing in flight has nothing to wait for"
        try:
            call_briefly(lambda: asker.lookup([0], np.zeros((1, 16), np.uint8), ex.ends.fetch_hint),
                         "L1: lookup() after shutdown()", limit_s=profiles.active().patience_s)
        except SubmissionRejected:
            return
        except Exception as exc:
            raise AssertionError(f"L1/B3: lookup() after shutdown() raised {type(exc).__name__}: {exc}; the "
                                 "contract rejects it with SubmissionRejected") from exc
        raise AssertionError("L1/B3: lookup() after shutdown() was answered; it raises SubmissionRejected")


@checks(also=("L1.4", "L1.5"))
def test_L1_lookup_takes_no_capacity_and_changes_nothing(kvwire_harness: Harness) -> None:
    """More lookups than the queue bound leave the queue free; asking about names that are not
    held stores nothing; a fetch afterwards delivers exactly the held rows, byte for byte, and
    no memory changed."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan(caps, groups=2, rows=4, seed=337)
    with needs.open_exchange(kvwire_harness, max_in_flight=2) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        offer = {0: [0, 2], 1: [0, 2]}
        ex.offer(bench, offer)
        bound = ex.caps.max_in_flight
        if bound > 256:
            pytest.skip(f"backend declares a queue bound of {bound}, too large to exceed here")
        gids = [g.group_id for g in plan.groups]
        want = np.isin(np.arange(4), bench.rows_of(offer)[0])
        for _ in range(2 * bound + 1):
            _expect(_ask(ex, gids, bench.names[0]), want, "a repeated lookup")
        bench.verify("after lookups: a lookup reads and writes no lent memory")
        if not caps.fetch:  # a backend may declare lookup and publish only (B4): a publish shows the queue free
            try:
                again = ex.settle(ex.publish(bench.source_view(offer)))
            except SubmissionError as exc:
                raise AssertionError(f"L1: after {2 * bound + 1} lookups a publish was refused ({exc}); a lookup "
                                     "takes no capacity") from exc
            assert again.is_delivered and all(m.all() for m in again.masks), f"A5.11: {again!r}"
            _expect(_ask(ex, gids, bench.names[0]), want, "a lookup after the publish of held rows")
            return
        try:
            fetched = ex.fetch_settled(bench.sink_view())
        except SubmissionError as exc:
            raise AssertionError(f"L1: after {2 * bound + 1} lookups a fetch was refused ({exc}); a lookup takes no "
                                 "capacity") from exc
        bench.apply_fetch(fetched)
        assert fetched.is_delivered, f"A5: the fetch after lookups gave {fetched!r}"
        for gi, mask in enumerate(fetched.masks):
            np.testing.assert_array_equal(mask, want, err_msg=(
                f"L1: after lookups the fetch of group {gids[gi]} delivered other rows than are held; a lookup "
                "changes nothing at the other end"))
        _expect(_ask(ex, gids, bench.names[0]), want, "a lookup after the fetch")


@checks(also=("L1.2",))
def test_L1_answers_are_new_plain_read_only_bool_arrays(kvwire_harness: Harness) -> None:
    """Each answer is a new array: two lookups never share memory, and no answer changes when a
    later lookup or a publish happens; asking about no names answers an empty array."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan(caps, groups=1, rows=3, seed=347)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        gid = plan.groups[0].group_id
        before = _ask(ex, [gid], bench.names[0])
        kept = before.copy()
        ex.offer(bench)
        after = _ask(ex, [gid], bench.names[0])
        np.testing.assert_array_equal(before, kept, err_msg="L1: an answer changed after it was handed over")
        assert not np.shares_memory(before, after), "L1: two lookups answered arrays that share memory"
        empty = _ask(ex, [gid], np.zeros((0, plan.groups[0].name_width), np.uint8))
        assert empty.shape == (0,)
        _expect(before, np.zeros(3, bool), "names before they were offered")
        _expect(after, np.ones(3, bool), "names after they were offered")


@checks("L1.8")
def test_L1_a_fault_at_the_other_end_fails_the_lookup_never_answers_not_held(kvwire_harness: Harness) -> None:
    """L1.8: a lookup during which the other end fails for one of the names it asks about (the
    harness injects the fault, ``FaultPlan.lookup``) raises ``LookupFailed``, saying why; it never
    answers that name "not held", nor lets the store's own exception out. A lookup of the other
    names alone answers as usual."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    if not kvwire_harness.lookup_faults:
        pytest.skip("harness cannot fail a lookup's names (Harness.lookup_faults is off)")
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan(caps, groups=1, rows=4, seed=331)
    faulty = Bench(kvwire_harness, None, None, plan, kind).names[0][2].tobytes()
    with needs.open_exchange(kvwire_harness, faults=FaultPlan(lookup=frozenset({faulty}))) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        ex.offer(bench)
        gid, names = plan.groups[0].group_id, bench.names[0]
        for asked, what in ((names, "every offered name, one of them faulty"), (names[2:3], "the faulty name alone")):
            try:
                answer = call_briefly(functools.partial(_asker(ex).lookup, [gid], asked, ex.ends.fetch_hint),
                                      f"L1.8: a lookup of {what}")
            except LookupFailed as exc:
                assert str(exc).strip(), f"L1.8: LookupFailed for a fault at the other end ({what}) gave no reason"
                continue
            except Exception as exc:
                raise AssertionError(f"L1.8: a lookup of {what} met a fault at the other end and raised "
                                     f"{type(exc).__name__}: {exc}; the contract raises LookupFailed") from exc
            raise AssertionError(f"L1.8: a lookup of {what} met a fault at the other end and answered "
                                 f"{np.asarray(answer).astype(int).tolist()}; a fault is never \"not held\"")
        _expect(_ask(ex, [gid], np.delete(names, 2, axis=0)), np.ones(3, dtype=bool), "the offered names without the faulty one")


@checks("L1.6", also=("A5.7", "A5.8"))
def test_L1_a_name_reported_held_then_lost_is_a_miss_never_a_fault(kvwire_harness: Harness) -> None:
    """L1.6: a lookup is advice. Every offered name answers held; then the store loses some of
    them behind the backend's back (the first two objects of the fetch's first store read and
    the first of its second are evicted just before those reads, as another process or an
    eviction may). The fetch of all of them delivers, never fails: each lost name is a miss
    (a false bit, A5.7), each other row a true bit holding its bytes, so the fetch's bits in
    every group are what a lookup answers afterwards."""
    from kvwire.testing.faults import Evict

    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    needs.fetch(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan(caps, groups=2, rows=4, seed=367)
    schedule = (Evict(op="get", call=1, stop=2), Evict(op="get", call=2, stop=1))
    with needs.open_exchange(kvwire_harness, faults=FaultPlan(schedule=schedule)) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        published = ex.offer(bench)
        assert published is not None and published.is_delivered and all(m.all() for m in published.masks), (
            f"S1.2: a publish to a store with room to spare must hold every row: {published!r}")
        gids = [g.group_id for g in plan.groups]
        for gi, gid in enumerate(gids):
            _expect(_ask(ex, [gid], bench.names[gi]), np.ones(plan.groups[gi].rows, bool),
                    f"group {gid}'s offered names, before the fetch")
        fetched = ex.settle(ex.fetch(bench.sink_view()))
        assert fetched.is_delivered, (
            f"L1.6: objects a lookup reported held and the store then lost are misses (A5.7), never a fault: the "
            f"fetch of them gave {fetched!r}")
        bench.apply_fetch(fetched)
        after = [_ask(ex, [gid], bench.names[gi]) for gi, gid in enumerate(gids)]
        if all(a.all() for a in after):
            pytest.skip("the fetch lost nothing: the backend made no store read the harness's Evict schedule acts on")
        for gid, mask, held in zip(gids, fetched.masks, after, strict=True):
            wrong = np.flatnonzero(mask != held)
            assert wrong.size == 0, (
                f"L1.6/A5.7: row(s) {wrong.tolist()} of group {gid}: the fetch marked {mask.astype(int).tolist()}, the "
                f"store holds {held.astype(int).tolist()} now; every name was reported held, a lost one is a false "
                "bit and a held one a true bit")


@checks("L1.7", "L1.8")
@pytest.mark.parametrize("source", ["argument", "hint", "options", "argument over hint"])
def test_L1_a_held_other_end_fails_the_lookup_by_its_deadline(kvwire_harness: Harness, source: str) -> None:
    """L1.7 / L1.8: with the other end not answering, a lookup raises ``LookupFailed`` by its
    deadline (given as the argument, by the hint, or by the backend's options; an argument wins
    over a longer deadline of the hint; at most ``LOOKUP_SLACK_S`` late) instead of hanging; once
    the other end answers again, lookups answer again."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    deadline_s = 0.3
    plan = _plan(caps, groups=1, rows=2, seed=353)
    options_timeout = deadline_s if source == "options" else needs.LONG_TIMEOUT_S
    with needs.open_exchange(kvwire_harness, hold=True, timeout_s=options_timeout) as ex, Bench(
            kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
        if ex.ends.hold is None:
            pytest.skip("harness cannot hold the backend's other end")
        ex.offer(bench)
        asker = _asker(ex)
        gid = plan.groups[0].group_id
        hint = ex.ends.fetch_hint
        if source == "hint":
            hint = Hint(hint.kind, hint.fields, deadline_s)
        elif source == "argument over hint":
            hint = Hint(hint.kind, hint.fields, needs.LONG_TIMEOUT_S)
        timeout = deadline_s if source.startswith("argument") else None
        hold = ex.ends.hold()
        try:
            started = time.monotonic()
            try:
                call_briefly(lambda: asker.lookup([gid], bench.names[0], hint, timeout),
                             f"L1.7: a lookup of a held other end (deadline {deadline_s:g} s from the {source})",
                             limit_s=deadline_s + profiles.active().patience_s, on_block=hold.release)
            except LookupFailed as exc:
                took = time.monotonic() - started
                assert str(exc).strip(), "L1.8: LookupFailed must say why"
                assert took <= deadline_s + LOOKUP_SLACK_S, (
                    f"L1.7: a lookup of a held other end with a deadline of {deadline_s:g} s (from the {source}) "
                    f"raised LookupFailed only after {took:.2f} s; a lookup answers, or fails, within its deadline")
            except AssertionError:
                raise
            except Exception as exc:
                raise AssertionError(f"L1: a lookup past its deadline raised {type(exc).__name__}: {exc}; it raises "
                                     "LookupFailed") from exc
            else:
                raise AssertionError("L1: a lookup of an other end that never answered was answered; it raises "
                                     "LookupFailed by its deadline")
        finally:
            hold.release()
        _expect(_ask(ex, [gid], bench.names[0], timeout_s=profiles.active().patience_s), np.ones(2, bool),
                "once the other end answers again")


@checks("L1.5", "L1.12", also=("W1.6",))
def test_L1_a_lookup_beside_a_full_queue_is_not_refused_and_wakes_nothing(kvwire_harness: Harness) -> None:
    """L1.5 / L1.12: with the queue full of fetches the held other end does not answer, a lookup
    on the same instance is not refused for capacity (it answers, or raises ``LookupFailed`` by
    its deadline) and calls none of their wakes from inside the call (W1.6); once released,
    the fetches conclude as ever and lookups answer again."""
    caps = kvwire_harness.capabilities()
    _needs_lookup(caps)
    needs.fetch(caps)  # the queue is filled with held fetches
    kind = needs.usable_kind(kvwire_harness, caps)
    deadline_s = 0.2
    with needs.open_exchange(kvwire_harness, hold=True, max_in_flight=2) as ex:
        if ex.ends.hold is None:
            pytest.skip("harness cannot hold the backend's other end")
        bound = ex.caps.max_in_flight
        if bound > 64:
            pytest.skip(f"backend declares a queue bound of {bound}, too large to fill here")
        plan = _plan(caps, groups=1, rows=bound, seed=359)
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            ex.offer(bench)
            asker = _asker(ex)
            gid = plan.groups[0].group_id
            hold = ex.ends.hold()
            subs = []
            try:
                subs = [ex.fetch(bench.sink_view({0: [row]})) for row in range(bound)]
                wait_for(lambda: hold.waiting() > 0 or any(s.wakes.count for s in subs),
                         profiles.active().patience_s, "A3: the held other end receiving a fetch")
                what = f"a lookup while {bound} held fetch(es) fill the queue (bound {bound})"
                earlier = [len(s.wakes.inside) for s in subs]  # W1.6 inside fetch() is another test's
                started = time.monotonic()
                try:
                    answer = call_briefly(lambda: asker.lookup([gid], bench.names[0], ex.ends.fetch_hint, deadline_s),
                                          f"L1.7: {what}", limit_s=deadline_s + profiles.active().patience_s,
                                          on_block=hold.release)
                except LookupFailed:
                    assert time.monotonic() - started <= deadline_s + LOOKUP_SLACK_S, (
                        f"L1.7: {what} raised LookupFailed after more than its deadline of {deadline_s:g} s")
                except AssertionError:
                    raise
                except SubmissionRejected as exc:
                    raise AssertionError(
                        f"L1.5: {what} raised SubmissionRejected ({exc}); a lookup takes no queue slot and does not "
                        "count towards max_in_flight, so a full queue never refuses it") from exc
                except Exception as exc:
                    raise AssertionError(f"L1.8: {what} raised {type(exc).__name__}: {exc}; a lookup that gets no "
                                         "answer raises LookupFailed") from exc
                else:
                    assert type(answer) is np.ndarray and answer.dtype == np.bool_ and answer.shape == (bound,), (
                        f"L1.2: {what} answered {answer!r}; it answers one bool per name")
                inside = [i for i, s in enumerate(subs) if len(s.wakes.inside) > earlier[i]]
                assert not inside, (
                    f"L1.12/W1.6: {what}: the backend called the wake of fetch {inside[0] + 1} of {bound} from inside "
                    "lookup(), a call the holder made to it; lookup calls no wake")
            finally:
                hold.release()
            outs = [settle(sub, profiles.active().patience_s) for sub in subs]
            bench.forget_sink()  # each fetch wrote its own row; check each below
            for row, out in enumerate(outs):
                bench.apply_fetch(out, {0: [row]})
                assert out.is_delivered and out.masks[0].all(), (
                    f"L1.4: a held fetch of a held row, released after a lookup, gave {out!r}")
            _expect(_ask(ex, [gid], bench.names[0], timeout_s=profiles.active().patience_s), np.ones(bound, bool),
                    "once the other end answers again")


# -- L1.3: a lookup of thousands of names ----------------------------------------------------------------


@checks("L1.3", "A9.6", also=("S1.2", "B4.6", "L1.2"))
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
