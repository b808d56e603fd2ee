"""Mutants that each break one view clause (V1-V4: what a view names, that it is never changed, masks,
overlap). Every harness below is registered once, in ``tests/conformance/mutant_table.py``, with the
clause it breaks and the ``-k`` selection of the suite's tests that must catch it. A mutant either
wraps a correct backend through :mod:`kit` (the memory backend, or the reference peer for the
serving protocol) and breaks the clause from outside, or subclasses a reference backend
(:mod:`kvwire.testing.reference`) and overrides the one method where the bug lives.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants/view.py:NAME``."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable

import numpy as np
from kit import (  # beside this file; on sys.path when loaded as a harness
    HoleHarness,
    Mutant,
    MutantHarness,
    PeerMutant,
    StoreMutantHarness,
    Wrapped,
    _outcome_like,
    _Padded,
)

from kvwire.contract import (
    Attempt,
    CacheKind,
    Cause,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Outcome,
    View,
    WakeFn,
)
from kvwire.testing.reference.core import write_rows
from kvwire.testing.reference.harness import ReferencePeerHarness as LoopbackHarness
from kvwire.testing.reference.store import ReferenceStoreBackend, _Work


class DropsOverlappingFetchRows(Mutant):
    """V4: fetches an overlapping view by dropping the repeated rows, instead of refusing it."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op == "fetch" and view.overlapping_rows() is not None:
            seen: set[tuple[int, int]] = set()
            groups = []
            for g in view.groups:
                keep = []
                for row, address in enumerate(g.addresses().tolist()):
                    key = (id(g.region.memory_kind), address)
                    if key not in seen:
                        seen.add(key)
                        keep.append(row)
                groups.append(LayerGroupRows(g.group_id, g.kind, g.region, g.slots[keep], g.tokens,
                                             None if g.names is None else g.names[keep]))
            view = View(tuple(groups))
        return super().make(op, view, hint, wake)


class ChangesTheView(Mutant):
    """V2: reorders a view's slots in place after it is submitted."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        attempt = super().make(op, view, hint, wake)
        for group in view.groups:
            group.slots.setflags(write=True)
            group.slots[:] = group.slots[::-1].copy()
        return attempt


def _cached_row_masks() -> Callable[[], None]:
    """Make View.row_masks hand out the same arrays on every call (a broken contract type)."""
    original = View.row_masks
    cache: dict[int, tuple[np.ndarray, ...]] = {}

    def row_masks(self: View) -> tuple[np.ndarray, ...]:
        key = id(self)
        if key not in cache:
            cache[key] = original(self)
        return cache[key]

    View.row_masks = row_masks  # type: ignore[method-assign]

    def undo() -> None:
        View.row_masks = original  # type: ignore[method-assign]

    return undo


class _Reversed(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None or len(out.masks) < 2:
            return out
        return _outcome_like(out, out.masks[::-1])


class ReversesGroups(Mutant):
    """V1: hands the masks back in reverse group order."""

    attempt_type = _Reversed


# -- V2.2: a later submission rewrites an earlier view in place -------------------------------

class MutatesAnEarlierView(Mutant):
    """V2.2: on each submission the backend reverses, in place, the slots and names of the view
    it was given before (a staging index array reused for the next submission)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        attempt = super().make(op, view, hint, wake)
        previous = self.__dict__.get("previous")
        if previous is not None and previous is not view:
            for g in previous.groups:
                if g.rows > 1:
                    g.slots.setflags(write=True)
                    g.slots[:] = g.slots[::-1].copy()
                    g.slots.setflags(write=False)
                    if g.names is not None:
                        g.names.setflags(write=True)
                        g.names[:] = g.names[::-1].copy()
                        g.names.setflags(write=False)
        self.__dict__["previous"] = view
        return attempt


# -- V2.2: the slots of an overlapping fetch sorted in place before it is refused -------------------

class SortsSlotsToFindOverlap(Mutant):
    """V2.2: a fetch is checked for overlapping rows by sorting each group's slots in place; a
    fetch refused for overlap leaves its view with sorted slots."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op == "fetch" and view.overlapping_rows() is not None:
            for g in view.groups:
                g.slots.setflags(write=True)
                g.slots.sort()
                g.slots.setflags(write=False)
        return super().make(op, view, hint, wake)


# -- V1.8: a group id the wire cannot carry is taken, then fails ---------------------------------

class _FailedAtOnce(Attempt):
    """Concluded failed at once (nothing moved), woken from a timer thread."""

    def __init__(self, view: View, wake: WakeFn, reason: str) -> None:
        self.outcome = Outcome.failed(reason, view.row_masks(), cause=Cause.FAULT)
        threading.Timer(0.01, wake).start()

    def poll(self) -> Outcome | None:
        return self.outcome

    def quiesced(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


class LargeGroupIdsFailLater(PeerMutant):
    """V1.8: a fetch naming a group id of 2**32 or more (more than its wire carries) is taken and
    fails at once with ``FAULT``, where the contract refuses it when submitted."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(view, View) and any(g.group_id >= 1 << 32 for g in view.groups):
            return _FailedAtOnce(view, wake, "a group id does not fit the wire's 32 bits")
        return super().fetch(view, hint, wake)


# -- V1.6: a STATE row keyed by its checkpoint as well as its name -----------------------------------

def _checkpointed(view: View) -> View:
    groups = []
    for g in view.groups:
        names = g.names
        if g.kind is CacheKind.STATE and names is not None and names.shape[0]:
            names = names.copy()
            stamp = np.frombuffer(int(g.tokens.end).to_bytes(8, "little"), dtype=np.uint8)
            width = names.shape[1]
            names[:, -min(width, 8):] ^= stamp[:min(width, 8)][::-1]
        groups.append(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens, names))
    return View(tuple(groups))


class StateRowsKeyedByCheckpoint(Mutant):
    """V1.6: a STATE row is stored and found under its name and its token end (the exact checkpoint
    it stands for, V1.4), so a fetch of the same name under another token range misses."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if isinstance(view, View):
            attempt = super().make(op, _checkpointed(view), hint, wake)
            attempt.view = view
            return attempt
        return super().make(op, view, hint, wake)


# -- V4.4: a publish whose rows overlap across groups is refused --------------------------------------

class PublishOverlapAcrossGroupsRefused(Mutant):
    """V4.4: a publish is checked for overlapping rows across groups as a fetch is (only repeats
    within one group are let through), so a publish of two groups over one slot is refused."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op == "publish" and isinstance(view, View):
            seen: dict[int, int] = {}
            for gi, g in enumerate(view.groups):
                for address in g.addresses().tolist():
                    if seen.setdefault(int(address), gi) != gi:
                        raise InvalidSubmission(f"publish rows of two groups overlap at {address:#x}")
        return super().make(op, view, hint, wake)


# -- V1.8: a group-id limit tighter than the one the refusal states ------------------------------------

class GroupIdsTighterThanStated(Mutant):
    """V1.8: refuses a view with a group id of 2**31 or more, saying its wire carries ids below
    2**32 (a signed 32-bit field where the message says unsigned): ids it promises are refused."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(view, View):
            for group in view.groups:
                if group.group_id >= 1 << 31:
                    raise InvalidSubmission(f"group id {group.group_id} does not fit the wire, which carries group "
                                            "ids below 2**32 (contract V1.8)")
        return super().submit(op, view, hint, wake)


# -- V4 ---------------------------------------------------------------------------------------------

class _Composite(Wrapped):
    """One attempt made of several inner attempts, each over some of the view's groups."""

    def __init__(self, parts: list[tuple[list[int], Attempt]], view: View, op: str, backend: Mutant) -> None:
        super().__init__(parts[0][1], view, op, backend)
        self.parts = parts
        self.out: Outcome | None = None

    def poll(self) -> Outcome | None:
        if self.out is not None:
            return self.out
        outs = [a.poll() for _, a in self.parts]
        if any(o is None for o in outs):
            return None
        masks = list(self.view.row_masks())
        for (idx, _), o in zip(self.parts, outs, strict=True):
            assert o is not None
            for i, m in zip(idx, o.masks, strict=True):
                masks[i] = m
        bad = next((o for o in outs if o is not None and not o.is_delivered), None)
        self.out = Outcome.delivered(masks) if bad is None else _outcome_like(bad, masks)
        return self.out

    def quiesced(self) -> bool:
        return all(a.quiesced() for _, a in self.parts)

    def cancel(self) -> None:
        for _, a in self.parts:
            a.cancel()


def _overlap_by_later_size(view: View) -> bool:
    """Sorted by address, a row overlaps the one before it when it starts before the earlier row's
    start plus *its own* (the later row's) size: the bug."""
    rows = sorted((int(a), g.region.slot_bytes, id(g.region.memory_kind), g.region.device)
                  for g in view.groups for a in g.addresses().tolist())
    for (a0, _, k0, d0), (a1, s1, k1, d1) in zip(rows, rows[1:], strict=False):
        if (k0, d0) == (k1, d1) and a1 < a0 + s1:
            return True
    return False


class OverlapByLaterRowSize(Mutant):
    """V4.1 / V4.2: its overlap check sorts rows by address and compares each with the one before
    using the later row's size, so a small row lying inside a larger one past the small row's own
    size (rows of different slot sizes through two regions over the same memory) is taken: each
    group goes to the inner backend as its own attempt."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op != "fetch" or view.overlapping_rows() is None or _overlap_by_later_size(view):
            return super().make(op, view, hint, wake)
        parts = [([i], self.inner.fetch(View((g,)), hint, wake)) for i, g in enumerate(view.groups)]
        return _Composite(parts, view, op, self)


# -- V1.6 -------------------------------------------------------------------------------------------

class RowsFromTokens(Mutant):
    """V1.6: decides how many rows of a PAGED group move from its token range (16 tokens a block,
    vLLM's default): rows past ceil(len(tokens) / 16) are left out (false bits)."""

    BLOCK = 16

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        groups = []
        for g in view.groups:
            n = g.rows
            if g.kind is CacheKind.PAGED:
                n = min(n, math.ceil(len(g.tokens) / self.BLOCK))
            groups.append(LayerGroupRows(g.group_id, g.kind, g.region, g.slots[:n], g.tokens,
                                         None if g.names is None else g.names[:n]))
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        return _Padded(call(View(tuple(groups)), hint, wake), view, op, self)


class OverlapBySlotIndex(ReferenceStoreBackend):
    """V4: overlap is checked as equal (region, slot) pairs, so rows that alias through a second
    region describing the same memory pass."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        if op == "fetch":
            pairs = np.concatenate([np.stack([np.full(g.rows, g.region.region_id), g.slots], axis=1)
                                    for g in view.groups]) if view.groups else np.zeros((0, 2))
            if len(np.unique(pairs, axis=0)) != len(pairs):
                raise InvalidSubmission("fetch rows overlap: two rows name the same slot")
            return super()._check("publish", view, hint, wake)
        return super()._check(op, view, hint, wake)


class OverlapWithinGroupOnly(ReferenceStoreBackend):
    """V4: overlap is checked within each group, never across groups."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        if op == "fetch":
            for group in view.groups:
                if View((group,)).overlapping_rows() is not None:
                    raise InvalidSubmission(f"fetch rows of group {group.group_id} overlap")
            return super()._check("publish", view, hint, wake)
        return super()._check(op, view, hint, wake)


reverses_groups = MutantHarness("reverses-groups", ReversesGroups)
changes_the_view = MutantHarness("changes-the-view", ChangesTheView)
shared_row_masks = MutantHarness("shared-row-masks", Mutant, setup=_cached_row_masks)
drops_overlapping_fetch_rows = MutantHarness("drops-overlapping-fetch-rows", DropsOverlappingFetchRows)
group_ids_tighter_than_stated = HoleHarness("group-ids-tighter-than-stated", GroupIdsTighterThanStated)
mutates_an_earlier_view = MutantHarness("mutates-an-earlier-view", MutatesAnEarlierView)
sorts_slots_to_find_overlap = MutantHarness("sorts-slots-to-find-overlap", SortsSlotsToFindOverlap)


large_group_ids_fail_later = MutantHarness("large-group-ids-fail-later", LargeGroupIdsFailLater,
                                           inner=LoopbackHarness())
state_rows_keyed_by_checkpoint = MutantHarness("state-rows-keyed-by-checkpoint", StateRowsKeyedByCheckpoint)


publish_overlap_across_groups_refused = MutantHarness("publish-overlap-across-groups-refused",
                                                      PublishOverlapAcrossGroupsRefused)
overlap_by_later_row_size = MutantHarness("overlap-by-later-row-size", OverlapByLaterRowSize)
rows_from_tokens = MutantHarness("rows-from-tokens", RowsFromTokens)
overlap_by_slot_index = StoreMutantHarness("overlap-by-slot-index", OverlapBySlotIndex)
overlap_within_group_only = StoreMutantHarness("overlap-within-group-only", OverlapWithinGroupOnly)


# -- V4.2 / V4.3: overlap judged per region, an overlapping fetch that writes before it is refused ----

class OverlapWithinOneRegion(ReferenceStoreBackend):
    """V4.2: a fetch's rows are checked for overlap only against rows of the same region id, so
    rows of two regions that describe the same memory (the same span under another id, or shifted
    by half a slot) are taken as distinct."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        if op == "fetch":
            by_region: dict[int, list[LayerGroupRows]] = {}
            for group in view.groups:
                by_region.setdefault(group.region.region_id, []).append(group)
            for region_id, groups in by_region.items():
                if View(tuple(groups)).overlapping_rows() is not None:
                    raise InvalidSubmission(f"fetch rows overlap within region {region_id}")
            return super()._check("publish", view, hint, wake)
        return super()._check(op, view, hint, wake)


class OverlapRefusedAfterScrubbing(ReferenceStoreBackend):
    """V4.3: a fetch whose rows overlap is refused with ``InvalidSubmission``, but only after the
    backend cleared the first row of each group (its landing buffers zeroed before the check)."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        if op == "fetch" and isinstance(view, View) and view.overlapping_rows() is not None:
            with contextlib.suppress(Exception):
                for group, located in zip(view.groups, self._table.locate_view(view), strict=True):
                    if group.rows:
                        size = group.region.slot_bytes
                        write_rows(located, size, np.array([0]), np.zeros((1, size), dtype=np.uint8))
        return super()._check(op, view, hint, wake)


overlap_within_one_region = StoreMutantHarness("overlap-within-one-region", OverlapWithinOneRegion)
overlap_refused_after_scrubbing = StoreMutantHarness("overlap-refused-after-scrubbing", OverlapRefusedAfterScrubbing)


# -- V4.5: names that repeat refused ----------------------------------------------------------------

class RefusesRepeatedNames(ReferenceStoreBackend):
    """V4.5: a view that names one block on two rows of a group is refused with
    ``InvalidSubmission`` ("names must be unique"), a publish and a fetch alike."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        if isinstance(view, View):
            for group in view.groups:
                if group.names is not None and len(np.unique(group.names, axis=0)) < group.rows:
                    raise InvalidSubmission(f"group {group.group_id} names a block on two rows; names must be unique")
        return super()._check(op, view, hint, wake)


refuses_repeated_names = StoreMutantHarness("refuses-repeated-names", RefusesRepeatedNames)
