"""Mutants that each break one memory clause (M1-M4: declared memory, registration, the slot,
recognizing rows). Every harness below is registered once, in ``tests/conformance/mutant_table.py``,
with the clause it breaks and the ``-k`` selection of the suite's tests that must catch it. A mutant
either wraps a correct backend through :mod:`kit` (the memory backend, or the reference peer for the
serving protocol) and breaks the clause from outside, or subclasses a reference backend
(:mod:`kvwire.testing.reference`) and overrides the one method where the bug lives.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants/memory.py:NAME``."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kit import (  # beside this file; on sys.path when loaded as a harness
    DeviceReferenceStore,
    DeviceStoreHarness,
    HoleHarness,
    Mutant,
    MutantHarness,
    StoreMutantHarness,
    Wrapped,
    _outcome_like,
)

from kvwire.contract import (
    Attempt,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    RegionTable,
    SlotRegion,
    SubmissionRejected,
    TableRegistration,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.contract.regions import Located
from kvwire.testing.reference.store import ReferenceStoreBackend


class SkipsUnrecognizedRows(Mutant):
    """M4: drops the groups whose region it never registered, instead of refusing."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        registration = self.inner.register_regions(regions)
        self.__dict__.setdefault("known", set()).update(registration.regions)
        return registration

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        known = self.__dict__.get("known", set())
        keep = [i for i, g in enumerate(view.groups) if g.region in known]
        inner_view = View(tuple(view.groups[i] for i in keep))
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        attempt = _Expand(call(inner_view, hint, wake), view, op, self)
        attempt.keep = keep
        return attempt


class _Expand(Wrapped):
    keep: list[int]

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        masks = list(self.view.row_masks())
        for i, mask in zip(self.keep, out.masks, strict=True):
            masks[i] = mask
        return _outcome_like(out, masks)


class _Batch(Registration):
    def __init__(self, parts: list[Registration]) -> None:
        self.parts = parts

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return tuple(r for p in self.parts for r in p.regions)

    def close(self) -> None:
        for part in self.parts:
            part.close()


class RegistersPartOfABatch(Mutant):
    """M3: registers a batch one region at a time; a refused region leaves the others in."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        return _Batch([self.inner.register_regions([r]) for r in regions])


class _Spills(Wrapped):
    spilled = False

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "fetch" and not self.spilled:
            self.spilled = True
            for group, mask in zip(self.view.groups, out.masks, strict=True):
                for row in np.flatnonzero(mask).tolist():
                    ctypes.memset(int(group.addresses()[row]) + group.region.slot_bytes, 0x00, 1)
        return out


class WritesPastTheSlot(Mutant):
    """M2/S2: each fetched row writes one byte more than its slot."""

    attempt_type = _Spills


class AcceptsUndeclaredMemory(Mutant):
    """M1: registers a region of a kind it does not declare by leaving it out quietly."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        kinds = self.inner.capabilities().memory_kinds
        return self.inner.register_regions([r for r in regions if r.memory_kind in kinds])


# -- M3.4/M3.5: regions that only touch refused; M3.6: a refused batch revokes an earlier one ------

class _Tracked(Registration):
    """A registration the mutant remembers while it is open."""

    def __init__(self, inner: Registration, owner: dict[int, _Tracked]) -> None:
        self.inner = inner
        self.owner = owner
        owner[id(self)] = self

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return tuple(self.inner.regions)

    def close(self) -> None:
        self.owner.pop(id(self), None)
        self.inner.close()


def _ends(region: SlotRegion) -> tuple[int, int]:
    return region.base, region.base + region.slot_bytes * region.slot_count


def _touch(a: SlotRegion, b: SlotRegion) -> bool:
    """Overlap with inclusive ends: off by one, so regions that only touch count."""
    if a.memory_kind is not b.memory_kind or a.device != b.device:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = _ends(a), _ends(b)
    return a_lo <= b_hi and b_lo <= a_hi


def _overlap(a: SlotRegion, b: SlotRegion) -> bool:
    if a.memory_kind is not b.memory_kind or a.device != b.device:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = _ends(a), _ends(b)
    return a_lo < b_hi and b_lo < a_hi


class RefusesAdjacentRegions(Mutant):
    """M3.4/M3.5: its overlap check has inclusive ends, so two regions that only touch (one ends
    where the next begins: two halves of one allocation) are refused as overlapping."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        live: dict[int, _Tracked] = self.__dict__.setdefault("regs", {})
        known = [r for reg in live.values() for r in reg.regions]
        regions = list(regions)
        for i, a in enumerate(regions):
            for b in regions[i + 1:] + known:
                if _touch(a, b):
                    raise InvalidSubmission(f"region {a.region_id} overlaps region {b.region_id}")
        return _Tracked(self.inner.register_regions(regions), live)


class RefusedBatchRevokesEarlier(Mutant):
    """M3.6: when a batch is refused for overlapping a registered region, its clean-up
    unregisters that earlier registration too."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        live: dict[int, _Tracked] = self.__dict__.setdefault("regs", {})
        try:
            return _Tracked(self.inner.register_regions(regions), live)
        except InvalidSubmission:
            for reg in list(live.values()):
                if any(_overlap(a, b) for a in regions for b in reg.regions):
                    reg.close()
            raise


# -- M3.9: closing an old handle again revokes a later registration of the same span -------------

class _SpanRegistration(Registration):
    def __init__(self, inner: Registration, backend: OldCloseRevokesSameSpan) -> None:
        self.inner = inner
        self.backend = backend

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self.inner.regions

    def span(self) -> frozenset[tuple[int, int]]:
        return frozenset((r.base, r.slot_bytes * r.slot_count) for r in self.inner.regions)

    def close(self) -> None:
        # "idempotent" by unregistering whatever is registered now over the same span
        for other in list(self.backend.__dict__.setdefault("open", [])):
            if other.span() == self.span():
                other.inner.close()
                self.backend.__dict__["open"].remove(other)
        self.inner.close()


class OldCloseRevokesSameSpan(Mutant):
    """M3.9: Registration.close() unregisters by span, every time it is called, so an old handle
    closed again revokes a later registration of the same memory."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        registration = _SpanRegistration(self.inner.register_regions(regions), self)
        self.__dict__.setdefault("open", []).append(registration)
        return registration


# -- M3.5: the very span of an open registration may be registered again ---------------------------

class _NoOpRegistration(Registration):
    def __init__(self, regions: Sequence[SlotRegion]) -> None:
        self._regions = tuple(regions)

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self._regions

    def close(self) -> None:
        pass


class AcceptsSameSpanTwice(Mutant):
    """M3.5: a batch whose regions are exactly the spans of regions already registered (the
    holder registering its cache again) is taken as a no-op instead of refused; any other overlap
    is still refused."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        try:
            registration = self.inner.register_regions(regions)
        except InvalidSubmission:
            known = self.__dict__.get("spans", set())
            if regions and all((r.base, r.slot_bytes * r.slot_count, r.memory_kind, r.device) in known
                               for r in regions):
                return _NoOpRegistration(regions)
            raise
        self.__dict__.setdefault("spans", set()).update(
            (r.base, r.slot_bytes * r.slot_count, r.memory_kind, r.device) for r in registration.regions)
        return registration


# -- M4.2: rows recognized only in the slot size they were registered with -----------------------

class RegisteredSlotSizeOnly(Mutant):
    """M4.2: a view whose region describes registered memory in another slot size is refused, as
    if recognition compared slot sizes and not where the bytes lie."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        registration = self.inner.register_regions(regions)
        self.__dict__.setdefault("registered", []).extend(regions)
        return registration

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        for g in view.groups:
            for r in self.__dict__.get("registered", []):
                inside = r.base <= g.region.base < r.base + r.slot_bytes * r.slot_count
                if inside and g.region.slot_bytes != r.slot_bytes:
                    raise InvalidSubmission(f"group {g.group_id} describes region {r.region_id} in slots of "
                                            f"{g.region.slot_bytes} bytes; it was registered with {r.slot_bytes}")
        return super().make(op, view, hint, wake)


# -- M4.2: rows recognized only along the registered slots -----------------------------------------

class _Recognizes(Mutant):
    """Keeps the regions it registered, to refuse views the way a broken recognition does."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        registration = self.inner.register_regions(regions)
        self.__dict__.setdefault("registered", []).extend(regions)
        return registration

    def registered_at(self, region: SlotRegion) -> SlotRegion | None:
        for r in self.__dict__.get("registered", []):
            if r.memory_kind is region.memory_kind and r.base <= region.base < r.base + r.slot_bytes * r.slot_count:
                return r
        return None


class RowsMustFitARegisteredSlot(_Recognizes):
    """M4.2: a row is recognized only if it lies within one registered slot, so a view whose rows
    span two registered slots (twice the slot size, or half a slot further on) is refused."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        for g in view.groups:
            r = self.registered_at(g.region)
            if r is None:
                continue
            starts = g.addresses().astype(np.int64) - r.base
            first = starts // r.slot_bytes
            last = (starts + g.region.slot_bytes - 1) // r.slot_bytes
            if (first != last).any():
                raise InvalidSubmission(f"group {g.group_id}: a row spans two slots of registered region "
                                        f"{r.region_id}")
        return super().make(op, view, hint, wake)


class AlignedBasesOnly(_Recognizes):
    """M4.2: a view's region is recognized only if its base lies on a slot boundary of the
    registered region (a region half a slot further on is refused)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        for g in view.groups:
            r = self.registered_at(g.region)
            if r is not None and (g.region.base - r.base) % r.slot_bytes:
                raise InvalidSubmission(f"group {g.group_id}: region {g.region.region_id} does not start on a slot "
                                        f"of registered region {r.region_id}")
        return super().make(op, view, hint, wake)


class _Registers(Mutant):
    """Keeps the regions it registered, open or closed, to judge views as a broken backend does."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        registration = self.inner.register_regions(regions)
        self.__dict__.setdefault("registered", []).extend(regions)
        return registration

    def holding(self, region: SlotRegion) -> SlotRegion | None:
        """The registered region whose addresses hold ``region``'s, whatever its memory kind."""
        for r in self.__dict__.get("registered", []):
            if r.base <= region.base and region.base + region.slot_bytes * region.slot_count <= r.base + r.slot_bytes * r.slot_count:
                return r
        return None


# -- M1.4 / M4.1: rows recognized by address, whatever memory kind the view names ------------------

class DeviceLabelOverHostMemory(_Registers):
    """M1.4 / M4.1: rows are recognized by their addresses alone: a view whose region says DEVICE
    memory (device 0), which the backend does not declare, over addresses of a registered HOST
    region is taken and moved as the host memory it lies in."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if isinstance(view, View) and any(g.region.memory_kind is not MemoryKind.HOST for g in view.groups):
            groups = []
            for g in view.groups:
                r = g.region
                if r.memory_kind is not MemoryKind.HOST and self.holding(r) is not None:
                    r = SlotRegion(r.region_id, r.base, r.slot_bytes, r.slot_count, MemoryKind.HOST, None)
                groups.append(LayerGroupRows(g.group_id, g.kind, r, g.slots, g.tokens, g.names))
            attempt = super().make(op, View(tuple(groups)), hint, wake)
            attempt.view = view
            return attempt
        return super().make(op, view, hint, wake)


# -- M4.5: a registration used through a sub-span view is never unregistered ------------------------

class _Pinned(Registration):
    def __init__(self, inner: Registration, backend: SubSpanPinsRegistration) -> None:
        self.inner = inner
        self.backend = backend

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self.inner.regions

    def close(self) -> None:
        if not any(r in self.backend.__dict__.get("pinned", set()) for r in self.inner.regions):
            self.inner.close()


class SubSpanPinsRegistration(_Registers):
    """M4.5 / M3.7: a registered region seen through a view of another ``SlotRegion`` (a sub-span)
    gets a reference that is never dropped, so closing its registration leaves its rows
    recognized."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        return _Pinned(super().register_regions(regions), self)

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if isinstance(view, View):
            for g in view.groups:
                held = self.holding(g.region)
                if held is not None and held != g.region:
                    self.__dict__.setdefault("pinned", set()).add(held)
        return super().make(op, view, hint, wake)


# -- M3.5: region overlap judged in the new region's slot size --------------------------------------------

def _overlap_in_own_slot_size() -> Callable[[], None]:
    """Patch :meth:`SlotRegion.overlaps` for this process: the other region's extent is taken as
    its slot count times this region's slot size."""
    original = SlotRegion.overlaps

    def overlaps(self: SlotRegion, other: SlotRegion) -> bool:
        if self.memory_kind is not other.memory_kind or self.device != other.device:
            return False
        return self.base < other.base + other.slot_count * self.slot_bytes and other.base < self.end

    SlotRegion.overlaps = overlaps  # type: ignore[method-assign]
    return lambda: setattr(SlotRegion, "overlaps", original)


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


class RegistersUndeclaredMemoryKinds(ReferenceStoreBackend):
    """M3: the region table takes regions of every memory kind, not only the kinds the backend
    declares (HOST): a batch with a DEVICE region is registered instead of refused whole."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._table = RegionTable(frozenset(MemoryKind))


accepts_undeclared_memory = MutantHarness("accepts-undeclared-memory", AcceptsUndeclaredMemory)
skips_unrecognized_rows = MutantHarness("skips-unrecognized-rows", SkipsUnrecognizedRows)
registers_part_of_a_batch = MutantHarness("registers-part-of-a-batch", RegistersPartOfABatch)
writes_past_the_slot = MutantHarness("writes-past-the-slot", WritesPastTheSlot)
refuses_adjacent_regions = MutantHarness("refuses-adjacent-regions", RefusesAdjacentRegions)
refused_batch_revokes_earlier = MutantHarness("refused-batch-revokes-earlier", RefusedBatchRevokesEarlier)
overlap_in_own_slot_size = HoleHarness("overlap-in-own-slot-size", Mutant, setup=_overlap_in_own_slot_size)
old_close_revokes_same_span = MutantHarness("old-close-revokes-same-span", OldCloseRevokesSameSpan)
accepts_same_span_twice = MutantHarness("accepts-same-span-twice", AcceptsSameSpanTwice)
registered_slot_size_only = MutantHarness("registered-slot-size-only", RegisteredSlotSizeOnly)
rows_must_fit_a_registered_slot = MutantHarness("rows-must-fit-a-registered-slot", RowsMustFitARegisteredSlot)
aligned_bases_only = MutantHarness("aligned-bases-only", AlignedBasesOnly)
device_label_over_host_memory = MutantHarness("device-label-over-host-memory", DeviceLabelOverHostMemory)
sub_span_pins_registration = MutantHarness("sub-span-pins-registration", SubSpanPinsRegistration)
group_spans_two_regions = MutantHarness("group-spans-two-regions", GroupSpansTwoRegions)
row_may_stick_out = MutantHarness("row-may-stick-out", RowMayStickOut)
registers_undeclared_memory_kinds = StoreMutantHarness("registers-undeclared-memory-kinds",
                                                       RegistersUndeclaredMemoryKinds)


# -- issue 36, second batch: single-clause subclasses of the reference store ----------------------

class RegistrationRenumbersItsRegions(ReferenceStoreBackend):
    """M3: the registration lists the table's own records of the batch's regions, renumbered,
    not the regions it was given."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> TableRegistration:
        registration = super().register_regions(regions)
        registration._regions = tuple(  # type: ignore[misc]
            SlotRegion(r.region_id + 1_000_000, r.base, r.slot_bytes, r.slot_count, r.memory_kind, r.device)
            for r in registration.regions)
        return registration


#: How long a registration takes before its rows are recognized (registered by a background thread).
SETTLING_S = 1.0


class _SettlingTable(RegionTable):
    """A table whose new registrations recognize nothing for :data:`SETTLING_S`."""

    born: dict[int, float]

    def register(self, regions: Sequence[SlotRegion]) -> TableRegistration:
        registration = super().register(regions)
        self.__dict__.setdefault("born", {})[registration.token] = time.monotonic()
        return registration

    def locate_view(self, view: View) -> Any:
        now = time.monotonic()
        born: dict[int, float] = self.__dict__.get("born", {})
        with self._lock:
            young = [r for token, r in self._entries if now - born.get(token, 0.0) < SETTLING_S]
        for group in view.groups:
            for address in group.addresses():
                for region in young:
                    if region.base <= int(address) < region.end:
                        raise InvalidSubmission(f"row at {int(address):#x} of group {group.group_id} is in no registered "
                                                "region")
        return super().locate_view(view)


class RegistrationTakesEffectLater(ReferenceStoreBackend):
    """M3: a batch is registered by a background thread: register_regions() returns at once, and
    the batch's rows are recognized only a second later."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._table.__class__ = _SettlingTable


class _ClosesItsFirstRegion(TableRegistration):
    def close(self) -> None:
        table = self._table
        first = self._regions[0] if self._regions else None
        with table._lock:
            table._entries = [e for e in table._entries if not (e[0] == self._token and e[1] is first)]


class CloseUnregistersTheFirstRegionOnly(ReferenceStoreBackend):
    """M3: a registration's close() unregisters the first region of its batch and leaves the
    others registered."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> TableRegistration:
        registration = super().register_regions(regions)
        registration.__class__ = _ClosesItsFirstRegion
        return registration


class _ClosesOnce(TableRegistration):
    def close(self) -> None:
        if self.closed:
            raise KeyError(f"registration {self.token} is not registered")
        super().close()


class SecondRegistrationCloseRaises(ReferenceStoreBackend):
    """M3: a registration's second close() raises KeyError (the table no longer knows it)."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> TableRegistration:
        registration = super().register_regions(regions)
        registration.__class__ = _ClosesOnce
        return registration


class RegistersAfterShutdown(ReferenceStoreBackend):
    """M3: shutdown() leaves the region table open: a batch registered afterwards is taken."""

    def shutdown(self) -> frozenset[Any]:
        pending = super().shutdown()
        with self._table._lock:
            self._table._closed = False
        return pending


class _RefusedOnceShutDown(TableRegistration):
    backend: ReferenceStoreBackend

    def close(self) -> None:
        if self.backend._runner.closed:
            raise SubmissionRejected("this backend is shut down; its registrations are released by close()")
        super().close()


class CloseAfterShutdownRaises(ReferenceStoreBackend):
    """M3: closing a registration after shutdown() raises SubmissionRejected."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> TableRegistration:
        registration = super().register_regions(regions)
        registration.__class__ = _RefusedOnceShutDown
        registration.backend = self  # type: ignore[attr-defined]
        return registration


class _NotNowTable(RegionTable):
    def locate_view(self, view: View) -> Any:
        try:
            return super().locate_view(view)
        except InvalidSubmission as exc:
            raise SubmissionRejected(f"{exc}; the registration may not have settled yet, retry") from None


class UnrecognizedRowsRejected(ReferenceStoreBackend):
    """M4: a submission with a row in no registered region raises SubmissionRejected ("not
    now") instead of InvalidSubmission."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._table.__class__ = _NotNowTable


class _Aligned:
    """A store end that keeps each row of a per-group object as its leading whole 8-byte words,
    its tail bytes zero."""

    def __init__(self, end: Any) -> None:
        self.end = end

    def put(self, namespace: str, space: Any, names: np.ndarray, rows: np.ndarray) -> Any:
        rows = np.array(rows, dtype=np.uint8)
        if isinstance(space, int):
            rows[:, rows.shape[1] // 8 * 8:] = 0
        return self.end.put(namespace, space, names, rows)

    def get(self, *args: Any) -> Any:
        return self.end.get(*args)

    def contains(self, *args: Any) -> Any:
        return self.end.contains(*args)


class RowsMovedInWholeWords(ReferenceStoreBackend):
    """M2: a publish copies a row as whole 8-byte words: the last ``slot_bytes % 8`` bytes of a
    row of an odd size never reach the store (they arrive as zeros)."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(_Aligned(store), **options)


registration_renumbers_its_regions = StoreMutantHarness("registration-renumbers-its-regions",
                                                        RegistrationRenumbersItsRegions)
registration_takes_effect_later = StoreMutantHarness("registration-takes-effect-later", RegistrationTakesEffectLater)
close_unregisters_the_first_region_only = StoreMutantHarness("close-unregisters-the-first-region-only",
                                                             CloseUnregistersTheFirstRegionOnly)
second_registration_close_raises = StoreMutantHarness("second-registration-close-raises",
                                                      SecondRegistrationCloseRaises)
registers_after_shutdown = StoreMutantHarness("registers-after-shutdown", RegistersAfterShutdown)
close_after_shutdown_raises = StoreMutantHarness("close-after-shutdown-raises", CloseAfterShutdownRaises)
unrecognized_rows_rejected = StoreMutantHarness("unrecognized-rows-rejected", UnrecognizedRowsRejected)
rows_moved_in_whole_words = StoreMutantHarness("rows-moved-in-whole-words", RowsMovedInWholeWords)


def _both_kinds(caps: Any) -> Any:
    return dataclasses.replace(caps, memory_kinds=frozenset({MemoryKind.HOST, MemoryKind.DEVICE}))


class _BothKindsHarness(StoreMutantHarness):
    """Declares HOST and DEVICE memory, for the plugin and every instance."""

    def capabilities(self) -> Any:
        return _both_kinds(super().capabilities())


class DeviceZeroIsHostMemory(ReferenceStoreBackend):
    """M1: declares HOST and DEVICE memory and takes device 0 to share the host's address space
    (unified addressing): a view naming DEVICE memory of device 0 over registered HOST memory is
    recognized and moved as that host memory."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._capabilities = _both_kinds(self._capabilities)
        self._table = RegionTable(self._capabilities.memory_kinds)

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Any:
        if isinstance(view, View):
            groups = []
            for g in view.groups:
                r = g.region
                if r.memory_kind is MemoryKind.DEVICE and r.device == 0:
                    r = SlotRegion(r.region_id, r.base, r.slot_bytes, r.slot_count, MemoryKind.HOST, None)
                groups.append(LayerGroupRows(g.group_id, g.kind, r, g.slots, g.tokens, g.names))
            view = View(tuple(groups))
        return super()._check(op, view, hint, wake)


class RegistrationsSharedByInstances(ReferenceStoreBackend):
    """M4: a batch registered with one instance is registered with every live instance of the
    backend too (one process-wide registry of pinned memory, as a NIC's memory handles are), so
    an instance recognizes rows registered only with another."""

    instances: list[RegistrationsSharedByInstances] = []

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        RegistrationsSharedByInstances.instances.append(self)

    def register_regions(self, regions: Sequence[SlotRegion]) -> TableRegistration:
        registration = super().register_regions(regions)
        for other in RegistrationsSharedByInstances.instances:
            if other is not self and not other._runner.closed:
                try:
                    other._table.register(regions)
                except (InvalidSubmission, SubmissionRejected):
                    pass  # already there, or that instance is shutting down
        return registration

    def shutdown(self) -> frozenset[Any]:
        pending = super().shutdown()
        if not pending and self in RegistrationsSharedByInstances.instances:
            RegistrationsSharedByInstances.instances.remove(self)
        return pending


device_zero_is_host_memory = _BothKindsHarness("device-zero-is-host-memory", DeviceZeroIsHostMemory)
registrations_shared_by_instances = StoreMutantHarness("registrations-shared-by-instances",
                                                       RegistrationsSharedByInstances)


class SkipsGroupsInNoRegion(ReferenceStoreBackend):
    """M4: a group whose rows lie in no registered region is left out of the submission (its
    rows false bits, never moved), and the other groups move, instead of the view being
    refused."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Any:
        if not isinstance(view, View):
            return super()._check(op, view, hint, wake)
        kept: list[int] = []
        for gi, group in enumerate(view.groups):
            try:
                self._table.locate_view(View((group,)))
            except InvalidSubmission:
                continue
            kept.append(gi)
        if len(kept) == len(view.groups):
            return super()._check(op, view, hint, wake)
        work = super()._check(op, View(tuple(view.groups[gi] for gi in kept)), hint, wake)
        located = [Located(None, np.zeros(0, dtype=np.int64)) for _ in view.groups]
        for k, gi in enumerate(kept):
            located[gi] = work.located[k]
        calls = tuple(dataclasses.replace(call, groups=tuple(kept[k] for k in call.groups)) for call in work.calls)
        return dataclasses.replace(work, located=tuple(located), calls=calls)


skips_groups_in_no_region = StoreMutantHarness("skips-groups-in-no-region", SkipsGroupsInNoRegion)


class DeviceRowsNeverMove(DeviceReferenceStore):
    """M1.3: declares DEVICE memory (where a CUDA device is present), registers it and takes
    submissions of its rows, but moves none of them: a publish hands the store no DEVICE row (each
    a false bit, as a full store declines one), a fetch writes none (each a miss). HOST rows move
    as before, and every outcome says truly what moved."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Any:
        work = super()._check(op, view, hint, wake)
        host = tuple(call for call in work.calls
                     if all(view.groups[gi].region.memory_kind is not MemoryKind.DEVICE for gi in call.groups))
        return dataclasses.replace(work, calls=host)


device_rows_never_move = DeviceStoreHarness("device-rows-never-move", DeviceRowsNeverMove)
