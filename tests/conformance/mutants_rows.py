"""Mutants of how rows are recognized, compared and keyed: each wraps the memory backend (through
:mod:`mutants`) and breaks one clause that the suite once let through (M4.3, M4.1/M4.4,
V4.1/V4.2, N1.4/S1.4, V1.6).

``test_mutants.py`` reads its entries in ``mutant_table.py`` (without importing this file) and runs the suite's
tests of each rule against each harness here: each must fail on a test named after the rule."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence

import numpy as np
from mutants import (  # beside this file; on sys.path as a harness
    Mutant,
    MutantHarness,
    Wrapped,
    _outcome_like,
    _Padded,
)

from kvwire.contract import (
    Attempt,
    CacheKind,
    Capabilities,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Outcome,
    SlotRegion,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration

# -- helpers --------------------------------------------------------------------------------------

class _Accepted(Attempt):
    """An attempt for a submission the inner backend refused but the mutant took: it concludes
    DELIVERED with every bit false (a fetch that missed everything; a publish the store declined)
    ~20 ms later, woken from a thread of its own."""

    def __init__(self, view: View, wake: WakeFn) -> None:
        self.view = view
        self.done = threading.Event()
        self.out: Outcome | None = None

        def finish() -> None:
            self.done.set()
            wake()

        threading.Timer(0.02, finish).start()

    def poll(self) -> Outcome | None:
        if not self.done.is_set():
            return None
        if self.out is None:
            self.out = Outcome.delivered(self.view.row_masks())
        return self.out

    def quiesced(self) -> bool:
        return self.done.is_set()

    def cancel(self) -> None:
        pass


class _TrackedRegistration(Registration):
    def __init__(self, inner: Registration, owner: list[_TrackedRegistration]) -> None:
        self.inner = inner
        self.owner = owner
        owner.append(self)

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self.inner.regions

    def close(self) -> None:
        if self in self.owner:
            self.owner.remove(self)
        self.inner.close()


class _Lenient(Mutant):
    """Remembers its open registrations; a submission the inner backend refuses is taken anyway
    when :meth:`lenient` says its rows are fine (each mutant's own wrong recognition)."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        return _TrackedRegistration(self.inner.register_regions(regions), self.__dict__.setdefault("open", []))

    def _regions(self) -> list[SlotRegion]:
        return [r for reg in self.__dict__.get("open", []) for r in reg.regions]

    def lenient(self, view: View) -> bool:
        raise NotImplementedError

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        try:
            return super().make(op, view, hint, wake)
        except InvalidSubmission:
            if self.lenient(view):
                return _Accepted(view, wake)  # type: ignore[return-value]
            raise


def _containing(regions: list[SlotRegion], group: LayerGroupRows, start: int, end: int) -> SlotRegion | None:
    for r in regions:
        if (r.memory_kind is group.region.memory_kind and r.device == group.region.device
                and r.base <= start and end <= r.base + r.slot_bytes * r.slot_count):
            return r
    return None


# -- M4 ---------------------------------------------------------------------------------------------

class GroupSpansTwoRegions(_Lenient):
    """M4.3: checks rows one by one, so a group whose rows lie in two registered regions (two
    touching regions, described by one SlotRegion that covers both) is taken, not refused."""

    def lenient(self, view: View) -> bool:
        regions = self._regions()
        spread = False
        for g in view.groups:
            homes = set()
            for a in g.addresses().tolist():
                home = _containing(regions, g, int(a), int(a) + g.region.slot_bytes)
                if home is None:
                    return False
                homes.add(home.region_id)
            spread |= len(homes) > 1
        return spread


class RowMayStickOut(_Lenient):
    """M4.1 / M4.4: recognizes a row by its first byte only, so a row that starts inside a
    registered region and runs past its end is taken."""

    def lenient(self, view: View) -> bool:
        regions = self._regions()
        sticks_out = False
        for g in view.groups:
            for a in g.addresses().tolist():
                if _containing(regions, g, int(a), int(a) + 1) is None:
                    return False
                sticks_out |= _containing(regions, g, int(a), int(a) + g.region.slot_bytes) is None
        return sticks_out


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


# -- N1.4 / S1.4 ------------------------------------------------------------------------------------

def _padded(names: np.ndarray) -> np.ndarray:
    out = np.zeros((names.shape[0], 64), dtype=np.uint8)
    out[:, : names.shape[1]] = names
    return out


class PadsNamesTo64NoLookup(Mutant):
    """N1.4 / S1.4: keys names in fixed 64-byte key slots, zero-padded, so a name and the same
    name with trailing zero bytes (a wider name in the same group) are one key; it does not
    declare the lookup protocol, so only fetches can show it."""

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:  # type: ignore[override]
        return dataclasses.replace(caps, protocols=frozenset(p for p in caps.protocols if p != "lookup"))

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        padded = View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens,
                                           None if g.names is None else _padded(g.names)) for g in view.groups))
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        return self.attempt_type(call(padded, hint, wake), view, op, self)

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        raise InvalidSubmission("this backend does not declare the lookup protocol")


group_spans_two_regions = MutantHarness("group-spans-two-regions", GroupSpansTwoRegions)
row_may_stick_out = MutantHarness("row-may-stick-out", RowMayStickOut)
overlap_by_later_row_size = MutantHarness("overlap-by-later-row-size", OverlapByLaterRowSize)
pads_names_to_64_no_lookup = MutantHarness("pads-names-to-64-no-lookup", PadsNamesTo64NoLookup)
rows_from_tokens = MutantHarness("rows-from-tokens", RowsFromTokens)
