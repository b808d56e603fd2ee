"""K1: the optional protocol ``block-objects`` (contract 1.3): a store keeps all the groups of one
block as one object when a submission's store hint carries ``blocks``, the view's block layout.

Every test skips, naming the protocol, unless the backend declares ``block-objects``; the K1.1
test then checks the backend is the content-addressed store the protocol asks for. Views name
their blocks alike in every group (one name per block), the bytes are checked through memory the
suite writes and reads itself, and every mask of a block submission is checked to hold each
block whole: bit ``j`` the same in every group. One file, in clause order, as each suite file
holds one rule."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvwire.contract import (
    BLOCK_OBJECTS,
    CacheKind,
    Cause,
    Hint,
    LayerGroupRows,
    Outcome,
    SubmissionRejected,
    TokenRange,
    View,
    block_layout,
)
from kvwire.contract.blocks import BLOCKS_FIELD
from kvwire.contract.capabilities import OtherEnd
from kvwire.contract.errors import SubmissionError
from kvwire.contract.lookup import LOOKUP, Lookup
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.faults import Decline
from kvwire.testing.harness import FaultPlan, Harness, Unavailable
from kvwire.testing.holder import (
    Submission,
    Wakes,
    call_briefly,
    refused,
    settle,
    speaks_causes,
    submit,
    wait_for,
)
from kvwire.testing.layout import BLOCK_TOKENS, Bench, GroupPlan, ViewPlan
from kvwire.testing.marks import checks
from kvwire.testing.plans import store_only, with_field
from kvwire.testing.strategies import view_plans

#: Which blocks (row indices, the same in every group) a view holds; ``None``: all of them.
Blocks = Sequence[int] | None


# -- plans, views and hints ----------------------------------------------------------------------

def _plan(sizes: Sequence[int], rows: int, seed: int, ids: Sequence[int] | None = None, spare: int = 1) -> ViewPlan:
    """PAGED groups of ``sizes`` bytes (ids ``ids``, else 0, 1, ...), each of ``rows`` blocks
    named alike in every group; sink slots reversed, ``spare`` junk slots either side."""
    ids = list(range(len(sizes))) if ids is None else list(ids)
    src = tuple(range(spare, spare + rows))
    groups = tuple(GroupPlan(gid, CacheKind.PAGED, size, rows, src, tuple(reversed(src)), rows + 2 * spare, 16)
                   for gid, size in zip(ids, sizes, strict=True))
    return ViewPlan(groups, seed, shared_names=True)


def _select(bench: Bench, blocks: Blocks) -> dict[int, list[int]] | None:
    """The same rows of every group: the blocks ``blocks`` names, in its order."""
    if blocks is None:
        return None
    return {gi: list(blocks) for gi in range(len(bench.plan.groups))}


def _blocks_hint(hint: Hint, view: View) -> Hint:
    """``hint`` asking for block objects of ``view`` (K1.2)."""
    return with_field(hint, BLOCKS_FIELD, block_layout(view))


def _reordered(view: View, order: Sequence[int] | None) -> View:
    """``view`` with its groups in ``order`` (view positions); the layout does not change."""
    return view if order is None else View(tuple(view.groups[i] for i in order))


def _in_plan_order(out: Outcome, order: Sequence[int] | None) -> Outcome:
    """``out`` of a view reordered by ``order``, its masks back in the plan's group order."""
    if order is None:
        return out
    masks: list[np.ndarray] = [np.zeros(0, bool)] * len(order)
    for position, gi in enumerate(order):
        masks[gi] = out.masks[position]
    return Outcome(out.status, tuple(masks), out.reason, out.by_peer, out.cause)


def _whole(out: Outcome, view: View, what: str, clause: str) -> np.ndarray:
    """The one bit per block of a block submission's outcome; fail unless every group's mask
    says the same (a block is held, moved or missed whole)."""
    if not out.masks:
        return np.zeros(0, dtype=bool)
    first = out.masks[0]
    for group, mask in zip(view.groups[1:], out.masks[1:], strict=True):
        split = np.flatnonzero(mask != first)
        assert split.size == 0, (
            f"{clause}: {what}: block(s) {split[:8].tolist()} are marked in group {group.group_id} but not in group "
            f"{view.groups[0].group_id}, or the other way round ({out!r}); with block objects bit j is the same in "
            "every group's mask: a block is held, found or missed whole")
    return np.asarray(first)


def _taken(submit_it: Callable[[], Submission], op: str, view: View) -> Submission:
    """A block submission whose view fits (K1.3 lists what does not): refusing it breaks K1.1."""
    try:
        return submit_it()
    except SubmissionError as exc:
        raise AssertionError(
            f"K1.1/K1.3: a block {op} of groups {[g.group_id for g in view.groups]}, {view.groups[0].rows if view.groups else 0} "
            f"block(s) named alike in every group, with {BLOCKS_FIELD}={block_layout(view)!r}, fits and was refused "
            f"({type(exc).__name__}: {exc})") from exc


def _publish(ex: Exchange, bench: Bench, blocks: Blocks = None, order: Sequence[int] | None = None,
             hint: Hint | None = None) -> tuple[Outcome, np.ndarray]:
    """Publish the source rows of ``blocks`` as block objects (groups in ``order``); the outcome
    and its one bit per block (checked whole, K1.4)."""
    view = _reordered(bench.source_view(_select(bench, blocks)), order)
    sub = _taken(lambda: ex.publish(view, _blocks_hint(hint or ex.ends.publish_hint, view)), "publish", view)
    out = ex.settle(sub)
    return _in_plan_order(out, order), _whole(out, view, "a publish of block objects", "K1.4")


def _fetch(ex: Exchange, bench: Bench, blocks: Blocks = None, order: Sequence[int] | None = None,
           hint: Hint | None = None, want: np.ndarray | None = None, clause: str = "K1.5",
           what: str = "a fetch of block objects") -> tuple[Outcome, np.ndarray]:
    """Fetch the sink rows of ``blocks`` as block objects (groups in ``order``); check every bit
    (the same in every group, and ``want`` when given: before the bytes, so a wrong bit is named
    as one), then every true bit's bytes and every other byte of memory (A7, S2)."""
    select = _select(bench, blocks)
    view = _reordered(bench.sink_view(select), order)
    out = ex.settle(_taken(lambda: ex.fetch(view, _blocks_hint(hint or ex.ends.fetch_hint, view)), "fetch", view))
    bits = _whole(out, view, what, clause)
    if want is not None:
        assert out.is_delivered, f"{clause}: {what}: misses are no failure (A5.8), got {out!r}"
        wrong = np.flatnonzero(bits != want)
        assert wrong.size == 0, (
            f"{clause}: {what}: block(s) {wrong[:8].tolist()} of the view have the wrong bit: the store holds "
            f"{np.flatnonzero(want).tolist()} of them as block objects of this layout, the outcome marks "
            f"{np.flatnonzero(bits).tolist()}")
    planned = _in_plan_order(out, order)
    rows = bench.rows_of(select)
    for gi, mask in zip(bench.groups_in(select), planned.masks, strict=True):
        found = rows[gi][mask]
        actual = bench.sink.memories[gi].read(bench.sink.slots[gi][found])
        wrong = found[(actual != bench.data[gi][found]).any(axis=1)]
        assert wrong.size == 0, (
            f"{clause}/A7.1: {what}: block(s) {wrong[:8].tolist()} are marked found, but group "
            f"{bench.plan.groups[gi].group_id}'s row of each holds other bytes than that row of the publish")
    bench.apply_fetch(planned, select)
    return out, bits


def _per_group_fetch(ex: Exchange, bench: Bench, blocks: Blocks = None) -> Outcome:
    """Fetch the sink rows of ``blocks`` without ``blocks`` in the hint (per-group objects)."""
    select = _select(bench, blocks)
    out = ex.settle(ex.fetch(bench.sink_view(select)))
    bench.apply_fetch(out, select)
    return out


def _renamed(bench: Bench, names: np.ndarray) -> Bench:
    """Name every group's rows of ``bench`` with ``names`` (another bench's blocks)."""
    for gi, g in enumerate(bench.plan.groups):
        bench.names[gi] = names[: g.rows].copy()
    return bench


@contextlib.contextmanager
def _blocks_exchange(harness: Harness, plan: ViewPlan, *, hold: bool = False, timeout_s: float = needs.LONG_TIMEOUT_S,
                     max_in_flight: int | None = None, faults: FaultPlan | None = None,
                     ) -> Iterator[tuple[Exchange, Bench]]:
    """Skip unless the backend declares block objects and both directions; an exchange with a
    store other end and a bench of ``plan`` over it."""
    caps = harness.capabilities()
    needs.block_objects(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(harness, caps)
    with needs.open_exchange(harness, hold=hold, timeout_s=timeout_s, max_in_flight=max_in_flight,
                             faults=faults) as ex:
        store_only(ex, "block objects")
        with Bench(harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            yield ex, bench


def _sink_bench(harness: Harness, ex: Exchange, plan: ViewPlan, names: np.ndarray) -> Bench:
    """A bench of ``plan`` on the sink only, its blocks named ``names``."""
    return _renamed(Bench(harness, None, ex.ends.sink, plan, needs.usable_kind(harness, ex.caps)), names)


# -- K1.1 ------------------------------------------------------------------------------------------

@checks("K1.1")
def test_K1_a_backend_with_block_objects_is_a_store_that_takes_the_blocks_field(kvwire_harness: Harness) -> None:
    """K1.1: a backend that names ``block-objects`` has a store at the other end and declares
    content addressing, and takes the store hint field ``blocks``: on a publish (it delivers,
    every block held), on a fetch (it delivers, every block published found) and on a lookup
    when it also names ``lookup`` (answered, true for every block published)."""
    caps = kvwire_harness.capabilities()
    needs.block_objects(caps)
    assert caps.other_end is OtherEnd.STORE, (
        f"K1.1: the backend names {BLOCK_OBJECTS!r} but declares a {caps.other_end.value} at the other end; block "
        "objects are kept by a store")
    assert caps.content_addressed, (
        f"K1.1: the backend names {BLOCK_OBJECTS!r} but does not declare content addressing; a block object is "
        "found by its name")
    kind = needs.usable_kind(kvwire_harness, caps)
    plan = _plan([64, 24, 5], 3, 1101)
    with needs.open_exchange(kvwire_harness) as ex, Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan,
                                                          kind) as bench:
        for end in ex.ends.backends:
            assert BLOCK_OBJECTS in end.capabilities().protocols, (
                f"B4.3/K1.1: the plugin declares {BLOCK_OBJECTS!r}, a built backend does not")
        held = np.zeros(3, dtype=bool)
        if caps.publish:  # a refusal of either fails naming K1.1 (_taken)
            published, held = _publish(ex, bench)
            assert published.is_delivered and held.all(), (
                f"K1.1/A5.6: a publish of 3 block objects to a store with room to spare must hold each: {published!r}")
        if caps.fetch:
            _fetch(ex, bench, want=held, clause="K1.1")
        if LOOKUP in caps.protocols:
            try:
                answer = _lookup(ex, [g.group_id for g in plan.groups], bench.names[0],
                                 _blocks_hint(ex.ends.fetch_hint, bench.sink_view()), "K1.1")
            except SubmissionError as exc:
                raise AssertionError(f"K1.1: a lookup with the store hint field {BLOCKS_FIELD!r} was refused "
                                     f"({type(exc).__name__}: {exc}); a backend that names {BLOCK_OBJECTS!r} and "
                                     f"{LOOKUP!r} takes it") from exc
            assert np.array_equal(answer, held), (
                f"K1.1/K1.7: a lookup with {BLOCKS_FIELD!r} of 3 blocks answered {answer.astype(int).tolist()}; the "
                f"store holds {held.astype(int).tolist()}")


# -- K1.3 ------------------------------------------------------------------------------------------

def _misfits(bench: Bench, view: View) -> list[tuple[str, View, object]]:
    """Submissions that do not fit block objects, as (what, view, value of ``blocks``): values
    that are not the view's layout, and views the layout cannot describe."""
    layout = block_layout(view)
    g0, g1, g2 = view.groups
    other_size = layout.replace(f"{g1.group_id}:{g1.region.slot_bytes}", f"{g1.group_id}:{g1.region.slot_bytes + 16}")
    values: list[tuple[str, object]] = [
        ("another row size for one group", other_size),
        ("a group left out", block_layout([(g.group_id, g.region.slot_bytes) for g in (g0, g1)])),
        ("a group too many", block_layout([(g.group_id, g.region.slot_bytes) for g in view.groups] + [(9, 64)])),
        ("another group id", block_layout([(g0.group_id, g0.region.slot_bytes), (g1.group_id, g1.region.slot_bytes),
                                           (7, g2.region.slot_bytes)])),
        ("the groups in descending id (no layout)", ",".join(reversed(layout.split(",")))),
        ("spaces after the commas", layout.replace(",", ", ")),
        ("a leading zero", "0" + layout),
        ("';' between the groups", layout.replace(",", ";")),
        ("an empty layout", ""),
        ("an int", 64),
        ("the layout as bytes", layout.encode()),
        ("None", None),
    ]
    out = [(f"'blocks' {what} ({value!r})", view, value) for what, value in values]
    names = [g.names if g.names is not None else np.zeros((g.rows, 16), np.uint8) for g in view.groups]

    def regroup(gi: int, **change: object) -> View:
        g = view.groups[gi]
        fields = {"group_id": g.group_id, "kind": g.kind, "region": g.region, "slots": g.slots,
                  "tokens": g.tokens, "names": g.names, **change}
        groups = list(view.groups)
        groups[gi] = LayerGroupRows(**fields)  # type: ignore[arg-type]
        return View(tuple(groups))

    renamed = names[1].copy()
    renamed[2, -1] ^= 0x01
    wider = np.zeros((names[2].shape[0], names[2].shape[1] + 1), dtype=np.uint8)
    wider[:, :-1] = names[2]
    shorter = view.groups[2]
    for what, bad in (("a group without names", regroup(1, names=None)),
                      ("groups of different lengths (one block fewer in one group)",
                       regroup(2, slots=shorter.slots[:-1], tokens=TokenRange(0, BLOCK_TOKENS * (shorter.rows - 1)),
                               names=names[2][:-1])),
                      ("a group of no rows and no names beside groups of blocks",
                       regroup(2, slots=shorter.slots[:0], tokens=TokenRange(0, 0), names=None)),
                      ("block 2 named one byte apart in one group", regroup(1, names=renamed)),
                      ("one group's names a trailing zero byte longer", regroup(2, names=wider)),
                      ("a view of one block, named one byte apart in one group", _one_block(view, renamed))):
        out.append((what, bad, block_layout(bad)))
    return out


def _one_block(view: View, renamed: np.ndarray) -> View:
    """The view's block 2 alone, group 1 naming it ``renamed[2]``."""
    groups = []
    for gi, g in enumerate(view.groups):
        names = renamed if gi == 1 else g.names
        assert names is not None
        groups.append(LayerGroupRows(g.group_id, g.kind, g.region, g.slots[2:3], TokenRange(0, BLOCK_TOKENS),
                                     names[2:3]))
    return View(tuple(groups))


def _refused_wakes(call: Callable[[Wakes], object], what: str) -> Wakes:
    wakes = Wakes()
    refused(functools.partial(call, wakes), what)
    return wakes


@checks("K1.3", "S3.4", "S3.5", "S3.7", also=("K1.2",))
def test_K1_a_view_that_does_not_fit_block_objects_is_refused_before_anything_escapes(
        kvwire_harness: Harness) -> None:
    """K1.3 / S3.4 / S3.5 / S3.7: a publish and a fetch whose ``blocks`` is not the view's block
    layout (another row size, a group left out or added, another group id, the groups in
    descending id, spaces, a leading zero, ';', empty, an int, bytes, None), or whose view it
    cannot describe (a group without names, groups of different lengths, a group of no rows and
    no names beside groups of blocks, block 2 named apart in one group, also in a view of that
    block alone, names of another width in one group), are refused with ``InvalidSubmission``:
    no wake, memory untouched, nothing stored (neither block nor per-group objects), and a
    refused fetch writes nothing of the blocks the store holds. A view whose groups are not in
    ascending id, with its own layout, fits."""
    plan = _plan([64, 32, 7], 4, 1201, ids=[5, 0, 2])  # view order is not ascending id order
    with _blocks_exchange(kvwire_harness, plan) as (ex, bench):
        source, sink = ex.ends.source, ex.ends.sink
        wakes: list[tuple[str, Wakes]] = []
        for what, view, value in _misfits(bench, bench.source_view()):
            hint = with_field(ex.ends.publish_hint, BLOCKS_FIELD, value)
            wakes.append((what, _refused_wakes(functools.partial(source.publish, view, hint),
                                               f"K1.3: a publish with {what}")))
        bench.verify("S3.5: after publishes refused for not fitting block objects")
        _fetch(ex, bench, want=np.zeros(4, bool), what="a fetch after refused publishes only (S3.4: nothing stored)",
               clause="K1.3/S3.4")
        out = _per_group_fetch(ex, bench)
        assert not any(m.any() for m in out.masks), (
            f"K1.3/S3.4: only refused publishes were made, yet a fetch of per-group objects found rows: {out!r}")
        bench.write_sink(None, 0x5A)  # the misses above left the sink rows undefined; know them again
        published, held = _publish(ex, bench)
        assert published.is_delivered and held.all(), (
            f"K1.3/K1.2: a publish whose view lists groups {[g.group_id for g in plan.groups]} (not in ascending id), "
            f"with its own block layout, fits and must deliver every block: {published!r}")
        for what, view, value in _misfits(bench, bench.sink_view()):
            hint = with_field(ex.ends.fetch_hint, BLOCKS_FIELD, value)
            wakes.append((what, _refused_wakes(functools.partial(sink.fetch, view, hint),
                                               f"K1.3: a fetch with {what}")))
        # A refused fetch that escaped would write the sink rows of blocks the store now holds:
        # a fetch of block 0 alone, behind it, leaves blocks 1-3 known, and checks them.
        _fetch(ex, bench, [0], want=np.ones(1, bool), what="a fetch of block 0 after refused fetches")
        bench.verify("S3.5: after fetches refused for not fitting block objects")
        for what, w in wakes:
            assert w.count == 0, f"S3.7: the wake of a submission refused for {what} was called {w.count} time(s)"


@checks("K1.3", "S3.6", "S3.9", also=("K1.8", "K1.4"))
def test_K1_refused_block_submissions_take_no_queue_slot(kvwire_harness: Harness) -> None:
    """K1.3 / S3.6 / S3.9: many more misfit block submissions than the queue holds, refused,
    take no slot: with the store held, the declared bound of block fetches is then taken, one
    more is rejected (a block submission takes one slot, K1.8), and all taken deliver once the
    store lets go."""
    caps = kvwire_harness.capabilities()
    needs.block_objects(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    with needs.open_exchange(kvwire_harness, max_in_flight=2, hold=True) as ex:
        store_only(ex, "block objects")
        bound = ex.caps.max_in_flight
        if bound > 64:
            pytest.skip(f"backend declares a queue bound of {bound}, too large to fill here")
        assert ex.ends.hold is not None
        plan = _plan([48, 16], bound + 1, 1301)
        with Bench(kvwire_harness, ex.ends.source, ex.ends.sink, plan, kind) as bench:
            _, held = _publish(ex, bench)
            assert held.all(), "K1.4: a publish to a store with room to spare must hold every block"
            wrong = with_field(ex.ends.fetch_hint, BLOCKS_FIELD, "0:48")
            for i in range(2 * bound + 1):
                refused(lambda: ex.publish(bench.source_view(), with_field(ex.ends.publish_hint, BLOCKS_FIELD, "0:48")),
                        f"K1.3: misfit publish {i + 1} (a group left out of 'blocks')")
                refused(lambda: ex.fetch(bench.sink_view(), wrong), f"K1.3: misfit fetch {i + 1} (a group left out)")
            bench.verify("S3.5: after refused block submissions")
            hold = ex.ends.hold()
            subs: list[Submission] = []
            try:
                for row in range(bound):
                    view = bench.sink_view(_select(bench, [row]))
                    try:
                        subs.append(ex.fetch(view, _blocks_hint(ex.ends.fetch_hint, view)))
                    except SubmissionRejected as exc:
                        raise AssertionError(
                            f"K1.3/S3.6: after {2 * (2 * bound + 1)} refused block submissions, block fetch {row + 1} "
                            f"of the declared bound {bound} was rejected ({exc}); a refused submission takes no "
                            "queue slot") from exc
                view = bench.sink_view(_select(bench, [bound]))
                refused(lambda: ex.fetch(view, _blocks_hint(ex.ends.fetch_hint, view)),
                        f"K1.8/S3.9: block fetch {bound + 1} with {bound} in flight (declared bound {bound})",
                        SubmissionRejected)
            finally:
                hold.release()
            bench.forget_sink(_select(bench, range(bound)))
            for row, sub in enumerate(subs):
                out = ex.settle(sub)
                bits = _whole(out, sub.view, f"block fetch {row + 1} of a full queue", "K1.5")
                assert out.is_delivered and bits.all(), (
                    f"S3.10/K1.5: a block fetch taken below the bound must find its block once the store lets go: "
                    f"{out!r}")
                bench.apply_fetch(out, _select(bench, [row]))


# -- K1.4 and K1.5: what a publish keeps and a fetch finds -------------------------------------------

@checks("K1.4", "K1.5", "A7.1")
def test_K1_a_publish_keeps_one_object_per_block_and_a_fetch_reads_it_whole(kvwire_harness: Harness) -> None:
    """K1.4 / K1.5 / A7.1: over drawn views (1 to 5 groups of any ids and row sizes from one
    byte, blocks named alike in every group): a publish of drawn blocks, its groups in a drawn
    order, holds each whole; a fetch of drawn blocks in a drawn order, its groups in another
    drawn order, finds exactly the published ones, every group's row of each with the bytes
    that row of the publish held."""
    caps = kvwire_harness.capabilities()
    needs.block_objects(caps)
    p = profiles.active()

    @profiles.examples()
    @given(plan=view_plans(max_groups=max(5, p.max_groups), max_rows=p.max_rows, shared_names=True),
           data=st.data())
    def run(plan: ViewPlan, data: st.DataObject) -> None:
        rows = plan.groups[0].rows
        count = len(plan.groups)
        with _blocks_exchange(kvwire_harness, plan) as (ex, bench):
            offered = data.draw(st.lists(st.integers(0, rows - 1), unique=True, min_size=1), label="published blocks")
            published, held = _publish(ex, bench, offered, data.draw(st.permutations(range(count)), label="order"))
            assert published.is_delivered and held.all(), (
                f"K1.4/A5.6: a publish of blocks {offered} to a store with room to spare must hold each: {published!r}")
            taken = data.draw(st.lists(st.integers(0, rows - 1), unique=True, min_size=1), label="fetched blocks")
            _fetch(ex, bench, taken, data.draw(st.permutations(range(count)), label="fetch order"),
                   want=np.isin(taken, offered))

    run()


@checks("K1.5", "K1.2", also=("K1.4",))
def test_K1_a_fetch_finds_a_block_only_under_the_layout_it_was_published_with(kvwire_harness: Harness) -> None:
    """K1.5 / K1.2: blocks published with groups 0, 1, 2 of 64, 100 and 7 bytes are a miss in
    every group of a fetch of the same names under other group ids, one other row size, a subset
    of the groups, or one group more (each delivered, every bit false: a fetch never reads a
    part of a block); the same layout with the groups in another view order and the blocks in
    another order finds exactly the published ones, byte for byte."""
    plan = _plan([64, 100, 7], 5, 1401)
    with _blocks_exchange(kvwire_harness, plan) as (ex, bench):
        _, held = _publish(ex, bench, [0, 1, 3])
        assert held.all(), "K1.4: a publish to a store with room to spare must hold every block"
        names = bench.names[0]
        others = {
            "other group ids (0, 1, 3)": _plan([64, 100, 7], 5, 1402, ids=[0, 1, 3]),
            "one other row size (group 1 of 101 bytes)": _plan([64, 101, 7], 5, 1403),
            "a subset of the groups (0, 1)": _plan([64, 100], 5, 1404),
            "one group more (0, 1, 2, 3)": _plan([64, 100, 7, 64], 5, 1405),
        }
        for what, other in others.items():
            with _sink_bench(kvwire_harness, ex, other, names) as alt:
                _fetch(ex, alt, want=np.zeros(5, bool), what=f"a fetch of the published names with {what}")
        _fetch(ex, bench, [3, 2, 1, 0, 4], order=[2, 0, 1], want=np.array([True, False, True, True, False]),
               what="a fetch of the published layout, its groups in the view order 2, 0, 1")


@checks("K1.4", "K1.5", "A9.6", also=("V1.6", "K1.6"))
def test_K1_blocks_of_many_groups_many_rows_and_odd_sizes_move_whole(kvwire_harness: Harness) -> None:
    """K1.4 / K1.5 / A9.6: a view's size changes nothing: 80 groups (a model's layers) of rows
    from 1 byte to 4097 bytes, 3 groups of 1000 blocks each, one block of two PAGED groups
    and a STATE group (V1.6: no row is keyed by its tokens), and blocks of large parts of three
    sizes (96, 200 and 64 KiB: a store's copy of a block's parts from rows apart, at sizes where
    it may merge copies), publish blocks held whole and fetch exactly the published ones, byte
    for byte; a fetch of the same rows without ``blocks`` finds none (K1.6)."""
    sizes = (1, 7, 64, 100, 257, 4097)
    shapes = (([sizes[g % len(sizes)] for g in range(80)], 6, [0, 2, 3, 5]),
              ([3, 33, 1], 1000, [b for b in range(1000) if b % 3 != 1]),
              ([64, 48, 256], 1, [0]),
              ([96 << 10, 200 << 10, 64 << 10], 3, [0, 2]))

    for seed, (group_sizes, rows, offered) in enumerate(shapes, start=1501):
        plan = _plan(group_sizes, rows, seed)
        if rows == 1:  # the last group stands for the request's state (V1.4)
            last = plan.groups[-1]
            plan = ViewPlan(plan.groups[:-1] + (GroupPlan(last.group_id, CacheKind.STATE, last.slot_bytes, 1,
                                                          last.source_slots, last.sink_slots, last.region_slots),),
                            plan.seed, True)
        with _blocks_exchange(kvwire_harness, plan) as (ex, bench):
            what = f"{len(group_sizes)} groups of {rows} blocks"
            published, held = _publish(ex, bench, offered)
            assert published.is_delivered and held.all(), (
                f"K1.4/A9.6: a publish of {len(offered)} blocks of {what} must hold each: {published!r}")
            _fetch(ex, bench, want=np.isin(np.arange(rows), offered), what=f"a fetch of every block of {what}")
            out = _per_group_fetch(ex, bench)
            assert not any(m.any() for m in out.masks), (
                f"K1.6: blocks of {what} were published as block objects only, yet a fetch without {BLOCKS_FIELD!r} "
                f"found rows: {out!r}")


@checks("K1.4", "A5.11", "K1.5")
def test_K1_a_block_the_store_declines_for_space_is_a_false_bit_in_every_group(kvwire_harness: Harness) -> None:
    """K1.4 / A5.11 / K1.5: when the store declines for space the first object of a publish's
    first store call, the publish still delivers, the block it belongs to is a false bit in every
    group (the others held), a fetch finds exactly the blocks marked held and no part of the
    declined one, and once the store has room a publish of it holds it."""
    plan = _plan([64, 100, 1], 4, 1601)
    faults = FaultPlan(schedule=(Decline(call=1, start=0, stop=1),))
    with _blocks_exchange(kvwire_harness, plan, faults=faults) as (ex, bench):
        published, held = _publish(ex, bench)
        assert published.is_delivered, (
            f"K1.4/A5.11: a block declined for space is a false bit, never a failure: {published!r}")
        assert not held.all(), (
            "K1.4/A5.11: the store declined the first object of the publish's first call, yet every block is marked held")
        _fetch(ex, bench, want=held, what="a fetch of every block after a publish the store declined in part")
        again, now = _publish(ex, bench)
        assert again.is_delivered and now.all(), (
            f"K1.4/A5.11: with room in the store, a publish of the declined block must hold it: {again!r}")
        _fetch(ex, bench, want=np.ones(4, bool), what="a fetch of every block once all are held")


@checks("K1.4", "A5.11", also=("S1.3",))
def test_K1_a_full_store_declines_whole_blocks(kvwire_harness: Harness) -> None:
    """K1.4 / A5.11: with the store itself full (``Ends.fill``: it takes no object of a block's
    size more), a block publish of a block it holds and two it has no room for delivers: the
    held block true, the others false bits in every group, never a failure; a fetch finds
    exactly the held block and no part of the others. Once the store has room again, a publish
    delivers and every block it marks held is found whole."""
    sizes = [64, 100, 1]
    plan = _plan(sizes, 3, 1611)
    with _blocks_exchange(kvwire_harness, plan) as (ex, bench):
        fill = getattr(ex.ends, "fill", None)
        if fill is None:
            pytest.skip("harness cannot fill its store (Ends.fill)")
        _, held = _publish(ex, bench, [0])
        assert held.all(), "K1.4: a publish to a store with room to spare must hold every block"
        try:
            free = fill(sum(sizes))
        except Unavailable as exc:
            pytest.skip(f"harness cannot provide it: {exc}")
        try:
            full, held = _publish(ex, bench)
            assert full.is_delivered, (
                f"K1.4/A5.11: a block publish to a full store delivers, the blocks it has no room for false bits; a "
                f"full store is no fault: {full!r}")
            assert held.tolist() == [True, False, False], (
                f"K1.4/A5.11: the full store held block 0 and takes no object of a block's size ({sum(sizes)} bytes) "
                f"more, so blocks 1 and 2 are false bits in every group; the publish marks {held.astype(int).tolist()}")
            _fetch(ex, bench, want=held, what="a block fetch from a full store")
        finally:
            free()
        # The store may still decline a block it has room for (A5.11 promises nothing else), but
        # what it marks held is held whole.
        again, now = _publish(ex, bench)
        assert again.is_delivered and now[0], (
            f"K1.4/A5.11: a block publish once the store has room again delivers, block 0 (held all along) "
            f"true: {again!r}")
        _, found = _fetch(ex, bench, what="a block fetch once the store had room again")
        lost = np.flatnonzero(now & ~found)
        assert lost.size == 0, f"S1.3/K1.4: block(s) {lost.tolist()} the publish marked held were not found"


@checks("K1.5", "A5.7", also=("K1.4", "A5.8"))
def test_K1_a_block_evicted_in_part_is_a_miss_in_every_group(kvwire_harness: Harness) -> None:
    """K1.5 / A5.7: when the store loses the first object of a fetch's first store call behind
    the backend's back (evicted just before the call), the fetch still delivers, and each block
    is found or missed in every group alike (never read in part, whatever objects the backend
    keeps a block in); a later fetch finds the same blocks. (A store whose objects are leased
    for a while after a put, as Mooncake's are, may refuse the eviction: then every block is
    found.)"""
    from kvwire.testing.faults import Evict

    plan = _plan([64, 100, 1], 4, 1651)
    with _blocks_exchange(kvwire_harness, plan, faults=FaultPlan(schedule=(Evict(op="get", call=1, stop=1),))) as (
            ex, bench):
        _, held = _publish(ex, bench)
        assert held.all(), "K1.4: a publish to a store with room to spare must hold every block"
        fetched, found = _fetch(ex, bench, what="a block fetch after the store lost the first object it asks for")
        assert fetched.is_delivered, f"K1.5/A5.8: an evicted block is a miss, and a miss no failure: {fetched!r}"
        _fetch(ex, bench, want=found, what="a second block fetch after part of the store was lost")

# -- K1.6 ------------------------------------------------------------------------------------------

@checks("K1.6", also=("K1.4", "S1.3"))
@pytest.mark.parametrize("sizes", [[64], [64, 48]], ids=["one group", "two groups"])
def test_K1_block_objects_and_per_group_objects_never_meet(kvwire_harness: Harness, sizes: list[int]) -> None:
    """K1.6: a fetch without ``blocks`` never finds a block object, and a fetch with it never a
    per-group object, also when a block has one group (its object holds one row, as a per-group
    object does): blocks published only as block objects are a miss to a per-group fetch, and
    rows published only per group a miss to a block fetch; with both kinds stored under the same
    names with different bytes, each fetch reads its own kind's bytes."""
    plan = _plan(sizes, 4, 1701)
    with _blocks_exchange(kvwire_harness, plan) as (ex, bench):
        _, held = _publish(ex, bench)
        assert held.all(), "K1.4: a publish to a store with room to spare must hold every block"
        out = _per_group_fetch(ex, bench)
        assert out.is_delivered and not any(m.any() for m in out.masks), (
            f"K1.6: the blocks were published as block objects only, yet a fetch without {BLOCKS_FIELD!r} found "
            f"rows of them: {out!r}")
        kind = needs.usable_kind(kvwire_harness, ex.caps)
        with _renamed(Bench(kvwire_harness, ex.ends.source, ex.ends.sink, _plan(sizes, 4, 1702), kind),
                      bench.names[0]) as twin, Bench(kvwire_harness, ex.ends.source, ex.ends.sink,
                                                     _plan(sizes, 4, 1703), kind) as loose:
            for per_group in (twin, loose):
                put = ex.settle(ex.publish(per_group.source_view()))
                assert put.is_delivered and all(m.all() for m in put.masks), f"S1: a per-group publish: {put!r}"
            _fetch(ex, loose, want=np.zeros(4, bool),
                   what="a block fetch of names published only as per-group objects")
            _fetch(ex, bench, want=np.ones(4, bool),
                   what="a block fetch of names stored both as block objects and (other bytes) per group")
            out = _per_group_fetch(ex, twin)  # A7: the per-group bytes, never the block objects'
            assert out.is_delivered and all(m.all() for m in out.masks), (
                f"S1.3/K1.6: a per-group fetch of rows published per group must find them beside block objects of "
                f"the same names: {out!r}")


# -- K1.7 ------------------------------------------------------------------------------------------

def _lookup(ex: Exchange, groups: list[int], names: np.ndarray, hint: Hint, clause: str) -> np.ndarray:
    """A lookup on the fetching end, bounded, checked for the shape of its answer (L1.2)."""
    asker = ex.ends.sink
    assert isinstance(asker, Lookup), f"B4.6/L1.1: the backend declares {LOOKUP!r} but is no kvwire.contract.Lookup"
    answer = call_briefly(lambda: asker.lookup(groups, names, hint), f"{clause}: lookup()",
                          limit_s=profiles.active().patience_s)
    assert type(answer) is np.ndarray and answer.dtype == np.bool_ and answer.shape == (names.shape[0],), (
        f"L1.2: lookup() of {names.shape[0]} names answered {answer!r}; it answers one bool per name")
    return answer


@checks("K1.7", "L1.3", "L1.9", also=("K1.4",))
def test_K1_a_lookup_with_blocks_answers_for_block_objects_of_that_layout(kvwire_harness: Harness) -> None:
    """K1.7 / L1.3 / L1.9: a lookup whose hint has ``blocks`` is true exactly for the names held
    as block objects of that layout (its groups listed in any order); false for another row size,
    a subset of the groups, another namespace, and for names held only per group; a lookup without
    it finds no block object. Groups other than the layout's, and a value that is no block
    layout, raise ``InvalidSubmission``."""
    caps = kvwire_harness.capabilities()
    needs.block_objects(caps)
    if LOOKUP not in caps.protocols:
        pytest.skip(f"backend does not declare the {LOOKUP} protocol")
    plan = _plan([64, 32, 7], 5, 1801, ids=[0, 2, 5])
    with _blocks_exchange(kvwire_harness, plan) as (ex, bench):
        _, held = _publish(ex, bench, [0, 2, 3])
        assert held.all(), "K1.4: a publish to a store with room to spare must hold every block"
        names = bench.names[0]
        hint = ex.ends.fetch_hint
        layout = block_layout(bench.sink_view())
        want = np.array([True, False, True, True, False])

        def ask(groups: list[int], value: object, what: str, expected: np.ndarray, base: Hint = hint) -> None:
            asked = base if value is None else with_field(base, BLOCKS_FIELD, value)
            answer = _lookup(ex, groups, names, asked, "K1.7")
            assert np.array_equal(answer, expected), (
                f"K1.7: a lookup of 5 names {what} answered {answer.astype(int).tolist()}; the store holds "
                f"{expected.astype(int).tolist()} of them that way")

        ask([5, 0, 2], layout, "with the published layout (groups listed 5, 0, 2)", want)
        ask([0, 2, 5], "0:64,2:33,5:7", "with another row size for group 2", np.zeros(5, bool))
        ask([0, 2], "0:64,2:32", "with a subset of the layout's groups", np.zeros(5, bool))
        for gid in (0, 5):
            ask([gid], None, f"in group {gid} without {BLOCKS_FIELD!r} (held only as block objects, K1.6)",
                np.zeros(5, bool))
        namespace = hint.get("namespace")
        if isinstance(namespace, str):
            other = with_field(hint, "namespace", f"{namespace}-other")
            ask([0, 2, 5], layout, "with the published layout in another namespace (L1.11)", np.zeros(5, bool), other)
        put = ex.settle(ex.publish(bench.source_view(_select(bench, [1]))))
        assert put.is_delivered and all(m.all() for m in put.masks), f"S1: a per-group publish of block 1: {put!r}"
        ask([2, 5, 0], layout, "with the layout, after block 1 was published per group only (K1.6)", want)
        ask([0], None, "in group 0 without 'blocks', after block 1 was published per group",
            np.array([False, True, False, False, False]))
        asker = ex.ends.sink
        assert isinstance(asker, Lookup)
        bad: list[tuple[str, list[int], object]] = [
            ("a group of the layout not listed", [0, 2], layout),
            ("a group listed beyond the layout", [0, 2, 5, 7], layout),
            ("another group listed in place of one of the layout's", [0, 2, 6], layout),
            ("'blocks' with ';' between the groups (no layout)", [0, 2, 5], layout.replace(",", ";")),
            ("'blocks' an int", [0, 2, 5], 64),
            ("'blocks' empty", [0, 2, 5], ""),
        ]
        for what, groups, value in bad:
            ask_bad = functools.partial(asker.lookup, groups, names, with_field(hint, BLOCKS_FIELD, value))
            refused(functools.partial(call_briefly, ask_bad, f"K1.7: lookup() with {what}",
                                      limit_s=profiles.active().patience_s), f"K1.7: a lookup with {what}")


# -- K1.8 ------------------------------------------------------------------------------------------

@checks("K1.8", "V1.7")
def test_K1_block_views_without_rows_conclude_like_any_other(kvwire_harness: Harness) -> None:
    """K1.8 / V1.7: a block publish and a block fetch of a view with no groups (``blocks`` the
    empty layout) and of groups with no rows are taken and deliver with zero-length masks,
    touching no memory."""
    plan = _plan([64, 16], 2, 2301)
    with _blocks_exchange(kvwire_harness, plan) as (ex, bench):
        empty: dict[int, list[int]] = {gi: [] for gi in range(len(plan.groups))}
        for what, source, sink in (("no groups", View(()), View(())),
                                   ("groups of no rows", bench.source_view(empty), bench.sink_view(empty))):
            for op, view in (("publish", source), ("fetch", sink)):
                end, hint = (ex.ends.source, ex.ends.publish_hint) if op == "publish" else (ex.ends.sink,
                                                                                              ex.ends.fetch_hint)
                out = ex.settle(_taken(functools.partial(submit, end, op, view, _blocks_hint(hint, view)), op, view))
                assert out.is_delivered and [m.size for m in out.masks] == [0] * len(view.groups), (
                    f"K1.8/V1.7: a block {op} of a view with {what} concludes like any other, delivered with "
                    f"{len(view.groups)} zero-length mask(s); got {out!r}")
        bench.verify("V1.7: after block submissions of views without rows")

@checks("K1.8", "A8.2", "A4.3", "B3.2", also=("A5.12", "K1.4"))
@pytest.mark.parametrize("op", ["fetch", "publish"])
@pytest.mark.parametrize("end", ["deadline", "cancel", "shutdown"])
def test_K1_a_held_block_submission_ends_by_its_deadline_cancel_or_shutdown(kvwire_harness: Harness, end: str,
                                                                           op: str) -> None:
    """K1.8 / A8.2 / A4.3 / B3.2: a block fetch or publish the held store does not answer
    concludes by its hint's 0.5 s deadline (cause ``DEADLINE``), at ``cancel()`` (``CANCELLED``,
    cause ``HOLDER_CANCELLED``) or at ``shutdown()`` (not delivered, cause ``SHUTDOWN``) without
    waiting for the store, quiesces once the store lets go, and its bits hold each block whole;
    every block a publish marked held is found whole afterwards."""
    caps = kvwire_harness.capabilities()
    if end == "cancel":
        needs.cancellation(caps)
    deadline_s = 0.5
    plan = _plan([64, 32, 7], 3, 1901)
    with _blocks_exchange(kvwire_harness, plan, hold=True) as (ex, bench):
        assert ex.ends.hold is not None
        if op == "fetch":
            _, held = _publish(ex, bench)
            assert held.all(), "K1.4: a publish to a store with room to spare must hold every block"
        backend = ex.ends.sink if op == "fetch" else ex.ends.source
        view = bench.sink_view() if op == "fetch" else bench.source_view()
        hint = _blocks_hint(ex.ends.fetch_hint if op == "fetch" else ex.ends.publish_hint, view)
        if end == "deadline":
            hint = Hint(hint.kind, hint.fields, deadline_s)
        hold = ex.ends.hold()
        try:
            sub = submit(backend, op, view, hint)
            wait_for(lambda: hold.waiting() > 0 or sub.wakes.count > 0, profiles.active().patience_s,
                     f"A3: the held store receiving the block {op}")
            assert sub.poll() is None, f"the block {op} concluded while the store was held"
            if end == "cancel":
                call_briefly(sub.attempt.cancel, "A4.1: cancel()", on_block=hold.release)
            elif end == "shutdown":
                call_briefly(backend.shutdown, "B3: shutdown()", on_block=hold.release)
            out = settle(sub, deadline_s + profiles.active().patience_s, quiesce=False,
                         purpose=f"K1.8: a held block {op} must conclude by its {end} without the store")
        finally:
            hold.release()
        assert not out.is_delivered, f"K1.8: a block {op} the store never answered cannot deliver: {out!r}"
        expected = {"deadline": (out.is_failed, Cause.DEADLINE), "cancel": (out.is_cancelled, Cause.HOLDER_CANCELLED),
                    "shutdown": (True, Cause.SHUTDOWN)}[end]
        assert expected[0], f"K1.8: a held block {op} ended by its {end} gave {out!r}"
        if speaks_causes(backend):
            assert out.cause is expected[1], f"K1.8/A10: a held block {op} ended by its {end} has cause {expected[1]}"
        ex.settle(sub, purpose=f"K1.8/A2.5: a block {op} ended by its {end} still quiesces once the store lets go")
        bits = _whole(out, view, f"a block {op} ended by its {end}", "K1.4" if op == "publish" else "K1.5")
        if op == "fetch":
            bench.forget_sink()
            bench.apply_fetch(out)
            return
        bench.verify(f"S2.5: a block publish ended by its {end}")
        _, found = _fetch(ex, bench, what=f"a fetch after a block publish ended by its {end}")
        missing = np.flatnonzero(bits & ~found)
        assert missing.size == 0, (
            f"A5.12/K1.4: block(s) {missing.tolist()} the publish ended by its {end} marked held were not found")


@checks("K1.8", "V4.5", also=("A5.10",))
def test_K1_a_block_named_on_two_rows_is_one_object_read_into_both(kvwire_harness: Harness) -> None:
    """K1.8 / V4.5: a block publish naming one block on two rows (equal bytes) keeps one object
    and marks both rows held; a block fetch naming one block on two rows (into distinct slots)
    fills both with its bytes and marks both true, in every group."""
    plan = _plan([64, 40, 3], 4, 2001, spare=3)
    with _blocks_exchange(kvwire_harness, plan) as (ex, bench):
        for gi in range(len(plan.groups)):  # block 3 repeats block 0: same name, same bytes
            bench.names[gi][3] = bench.names[gi][0]
            bench.data[gi][3] = bench.data[gi][0]
            slot = bench.source.slots[gi][[3]]
            bench.source.memories[gi].write(slot, bench.data[gi][[0]])
            bench.source.model[gi][slot] = bench.data[gi][0]
        published, held = _publish(ex, bench, [0, 1, 3])
        assert published.is_delivered and held.all(), (
            f"K1.8/V4.5: a block publish naming block 0 on two rows must mark both held: {published!r}")
        asked = [0, 1, 0, 2, 1]  # which published block each fetched row names
        used = [set(bench.sink.slots[gi].tolist()) for gi in range(len(plan.groups))]
        slots = [np.array([s for s in range(g.region_slots) if s not in used[gi]][: len(asked)], dtype=np.int64)
                 for gi, g in enumerate(plan.groups)]
        view = View(tuple(LayerGroupRows(g.group_id, CacheKind.PAGED, bench.sink.memories[gi].region, slots[gi],
                                         TokenRange(0, len(asked) * BLOCK_TOKENS), bench.names[gi][asked])
                          for gi, g in enumerate(plan.groups)))
        out = ex.settle(ex.fetch(view, _blocks_hint(ex.ends.fetch_hint, view)))
        bits = _whole(out, view, "a block fetch naming blocks 0 and 1 twice", "K1.5")
        want = np.array([True, True, True, False, True])
        assert out.is_delivered and np.array_equal(bits, want), (
            f"K1.8/V4.5/A5.10: a block fetch of blocks {asked} (0 and 1 twice, 2 never published) must mark "
            f"{want.astype(int).tolist()} in every group, got {out!r}")
        for gi, g in enumerate(plan.groups):
            rows = np.array(asked)[want]
            got = bench.sink.memories[gi].read(slots[gi][want])
            wrong = np.flatnonzero((got != bench.data[gi][rows]).any(axis=1))
            assert wrong.size == 0, (
                f"K1.8/A7.1: group {g.group_id}: fetched row(s) {np.flatnonzero(want)[wrong].tolist()} do not hold the "
                "bytes published under their block's name")
            bench.sink.model[gi][slots[gi][want]] = bench.data[gi][rows]
            bench.sink.known[gi][slots[gi][~want]] = False
        bench.verify("S2: after a block fetch naming some blocks twice")


@checks("K1.8", "K1.5", "H1.10", also=("K1.4",))
def test_K1_block_objects_of_one_namespace_are_never_read_in_another(kvwire_harness: Harness) -> None:
    """K1.8 / K1.5 / H1.10: blocks published under one namespace are a miss under another (and
    under the backend's configured one, when the harness names it); the same names published in
    a second namespace with other bytes are read back from each namespace with its own bytes."""
    plan = _plan([64, 16], 3, 2101)
    with _blocks_exchange(kvwire_harness, plan) as (ex, bench):
        namespace = ex.ends.publish_hint.get("namespace")
        if not isinstance(namespace, str):
            pytest.skip("the harness's store hints name no namespace")
        other = f"{namespace}-tenant-b"
        _, held = _publish(ex, bench)
        assert held.all(), "K1.4: a publish to a store with room to spare must hold every block"
        fetch_other = with_field(ex.ends.fetch_hint, "namespace", other)
        _fetch(ex, bench, hint=fetch_other, want=np.zeros(3, bool),
               what=f"a block fetch under namespace {other!r} of blocks published under {namespace!r}",
               clause="K1.5/H1.10")
        configured = ex.ends.extra.get("namespace")
        if isinstance(configured, str) and configured != namespace:
            unnamed = Hint(ex.ends.fetch_hint.kind, (), ex.ends.fetch_hint.timeout_s)
            _fetch(ex, bench, hint=unnamed, want=np.zeros(3, bool),
                   what=f"a block fetch under the configured namespace {configured!r} of blocks published under "
                        f"{namespace!r}", clause="K1.5/H1.10")
        kind = needs.usable_kind(kvwire_harness, ex.caps)
        with _renamed(Bench(kvwire_harness, ex.ends.source, ex.ends.sink, _plan([64, 16], 3, 2102), kind),
                      bench.names[0]) as tenant:
            _, held = _publish(ex, tenant, hint=with_field(ex.ends.publish_hint, "namespace", other))
            assert held.all(), f"K1.4: a publish of the same names under {other!r} must hold every block"
            _fetch(ex, tenant, hint=fetch_other, want=np.ones(3, bool),
                   what=f"a block fetch under {other!r} (its own bytes)", clause="K1.5/H1.10")
            _fetch(ex, bench, want=np.ones(3, bool), what=f"a block fetch under {namespace!r} (its own bytes)",
                   clause="K1.5/H1.10")


@checks("K1.8", "A5.9", "K1.4", "K1.5", also=("A5.6", "A5.5", "S1.4", "S1.3"))
def test_K1_a_fault_on_one_block_fails_the_attempt_and_splits_no_block(kvwire_harness: Harness) -> None:
    """K1.8 / A5.9 / K1.4 / K1.5: a fault at the store on one block's name fails a block publish
    and a block fetch (cause ``FAULT``), never passes as a miss or a decline; the faulted block is
    a false bit in every group and no bit splits a block; a fetch finds every block the publish
    marked held and never the block whose publish faulted."""
    plan = _plan([64, 24], 4, 2201)
    with Bench(kvwire_harness, None, None, plan) as probe:
        names = probe.names[0]
    faults = FaultPlan(publish=frozenset({names[1].tobytes()}), fetch=frozenset({names[2].tobytes()}))
    with _blocks_exchange(kvwire_harness, plan, faults=faults) as (ex, bench):
        published, held = _publish(ex, bench)
        assert published.is_failed, f"K1.8/A5.9: a block publish that met a fault at the store must fail: {published!r}"
        if speaks_causes(ex.ends.source):
            assert published.cause is Cause.FAULT, f"A10.9: a store fault has cause FAULT: {published!r}"
        assert not held[1], f"K1.8/A5.6: block 1 faulted at the store, yet the publish marks it held: {published!r}"
        fetched, found = _fetch(ex, bench, what="a block fetch that meets a fault on block 2")
        assert fetched.is_failed, f"K1.8/A5.9: a block fetch that met a fault at the store must fail: {fetched!r}"
        assert not found[2], f"K1.8/A5.5: block 2 faulted at the store, yet the fetch marks it found: {fetched!r}"
        _, found = _fetch(ex, bench, [0, 1, 3], what="a block fetch of the blocks no fetch fault names")
        assert not found[1], "S1.4/K1.4: block 1's publish faulted, yet a fetch found it"
        lost = [b for b, f in zip((0, 3), found[[0, 2]], strict=True) if held[b] and not f]
        assert not lost, f"S1.3/K1.4: block(s) {lost} the failed publish marked held were not found"
