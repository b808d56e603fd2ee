"""Deliberately broken backends of the third probing round: each wraps the memory backend (as
``mutants.py`` does) and breaks one clause the earlier rounds did not probe. ``test_mutants.py``
reads its entries in ``mutant_table.py`` and checks that the suite fails each one on a test named after the rule it
breaks.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants_round3.py:NAME``."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence

import numpy as np
from mutants import (  # beside this file; on sys.path when loaded as a harness
    HandsOverViews,
    LimitsBatches,
    Mutant,
    MutantHarness,
    NeedsPolling,
    Wrapped,
    _Lazy,
    _outcome_like,
)

from kvwire.contract import (
    Attempt,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    Outcome,
    SlotRegion,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.testing.harness import Ends, FaultPlan

# -- A2.2: quiesced() answers false once more after its first true -------------------------------

class _Flickers(Wrapped):
    said = 0

    def quiesced(self) -> bool:
        if not self.inner.quiesced():
            return False
        self.said += 1
        return self.said != 2


class QuiescedFlickers(Mutant):
    """A2.2: quiesced() answers True, then False once (a status bit re-read while a worker tidies
    up), then True for good."""

    attempt_type = _Flickers


# -- A2.3: a large fetch says quiesced while a worker writes its last row again ------------------

BIG_BYTES = 1 << 20


class _LateRewrite(Wrapped):
    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.rewrote = False


class _TrackedRegistration(Registration):
    def __init__(self, inner: Registration, spans: list[tuple[int, int]]) -> None:
        self.inner = inner
        self.spans = spans
        self.mine = [(r.base, r.base + r.slot_bytes * r.slot_count) for r in inner.regions]

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self.inner.regions

    def close(self) -> None:
        with _LOCK:
            for span in self.mine:
                if span in self.spans:
                    self.spans.remove(span)
            self.mine = []
        self.inner.close()


_LOCK = threading.Lock()


class QuiescesBeforeLastRowOfBigFetch(Mutant):
    """A2.3: for a fetch of at least 1 MiB, the worker copies the last delivered row out of its
    bounce buffer again and again for ~0.3 s after the attempt quiesced (a trailing chunk retried),
    overwriting what the holder wrote there since. (It writes only while the memory is still
    registered, so the broken backend does not crash the suite's process.)"""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        registration = _TrackedRegistration(self.inner.register_regions(regions), self.__dict__.setdefault("spans", []))
        with _LOCK:
            registration.spans.extend(registration.mine)
        return registration

    def rewrite(self, address: int, saved: bytes) -> None:
        for _ in range(150):  # the trailing chunk, retried every 2 ms for ~0.3 s
            time.sleep(0.002)
            with _LOCK:
                if any(lo <= address and address + len(saved) <= hi for lo, hi in self.__dict__.get("spans", [])):
                    ctypes.memmove(address, saved, len(saved))

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        total = sum(g.rows * g.region.slot_bytes for g in view.groups)
        if op != "fetch" or total < BIG_BYTES:
            return super().make(op, view, hint, wake)
        holder: list[_LateRewrite] = []

        def late() -> None:
            attempt = holder[0]
            out = attempt.inner.poll()
            if out is not None and out.is_delivered and not attempt.rewrote:
                attempt.rewrote = True
                for group, mask in zip(reversed(view.groups), reversed(out.masks), strict=True):
                    rows = np.flatnonzero(mask)
                    if rows.size:
                        address = int(group.addresses()[rows[-1]])
                        saved = ctypes.string_at(address, group.region.slot_bytes)
                        threading.Thread(target=self.rewrite, args=(address, saved), daemon=True).start()
                        break
            wake()

        attempt = _LateRewrite.__new__(_LateRewrite)
        holder.append(attempt)
        _LateRewrite.__init__(attempt, self.inner.fetch(view, hint, late), view, op, self)
        return attempt


# -- A3.1: a publish (only) makes progress only when polled --------------------------------------

class PublishNeedsPolling(Mutant):
    """A3.1 / A3.3: a publish hands its rows to the store only when the holder first asks poll()
    or quiesced(); fetches progress on their own."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op != "publish":
            return super().make(op, view, hint, wake)
        return _Lazy(lambda: self.inner.publish(view, hint, wake), view, op, self)

    def shutdown(self) -> frozenset[Attempt]:
        return self.inner.shutdown()


class BigViewsNeedPolling(NeedsPolling):
    """A3.1: a submission of more than 16 rows (a multi-chunk transfer) starts only when the
    holder first asks poll() or quiesced(); small ones progress on their own."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if sum(g.rows for g in view.groups) <= 16:
            return Mutant.make(self, op, view, hint, wake)
        return super().make(op, view, hint, wake)


# -- A5.9: a fault after some rows moved passes for misses ---------------------------------------

class _PartialFaultDelivers(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and out.is_failed and out.cause is Cause.FAULT and any(m.any() for m in out.masks):
            return Outcome.delivered(out.masks)
        return out


class PartialFaultAsMiss(Mutant):
    """A5.9: an attempt that faulted after some rows moved (one chunk of several failed) is
    reported DELIVERED, its faulted rows passed off as misses. A fault before anything moved still
    fails."""

    attempt_type = _PartialFaultDelivers


# -- A5.4: masks of a view of three or more groups are shifted by one group ----------------------

class _Rotated(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None or len(out.masks) < 3:
            return out
        masks = list(self.view.row_masks())
        for i, mask in enumerate(out.masks):
            j = (i + 1) % len(masks)
            n = min(mask.size, masks[j].size)
            masks[j][:n] = mask[:n]
        return _outcome_like(out, masks)


class ShiftsGroupMasks(Mutant):
    """A5.4: with three or more groups, mask i is group i-1's bits (cut or padded to fit): an off
    by one in the gather of per-group results."""

    attempt_type = _Rotated


# -- A6.4: masks handed over as an ndarray subclass ----------------------------------------------

class _Tagged(np.ndarray):
    """A mask subclass that carries a tag (the backend's own bookkeeping)."""


class _SubclassMasks(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        cached = self.__dict__.get("handed")
        if cached is None:
            masks = []
            for mask in out.masks:
                tagged = np.array(mask, dtype=bool).view(_Tagged)
                tagged.setflags(write=False)
                masks.append(tagged)
            cached = _outcome_like(out, out.masks)
            object.__setattr__(cached, "masks", tuple(masks))  # past Outcome's copy (A6.4)
            self.__dict__["handed"] = cached
        return cached


class SubclassMasks(Mutant):
    """A6.4: hands over masks of an ndarray subclass (read-only), set past Outcome's copy."""

    attempt_type = _SubclassMasks


# -- A7.1 / M2.4: the last byte of some rows is not written --------------------------------------

class _DropsLastByte(Wrapped):
    done = False

    def hits(self, slot_bytes: int) -> bool:
        raise NotImplementedError

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "fetch" and not self.done:
            self.done = True
            for group, mask in zip(self.view.groups, out.masks, strict=True):
                if self.hits(group.region.slot_bytes):
                    for row in np.flatnonzero(mask).tolist():
                        address = int(group.addresses()[row]) + group.region.slot_bytes - 1
                        ctypes.memset(address, ctypes.c_ubyte.from_address(address).value ^ 0xFF, 1)
        return out


class _DropsLastByteOfBigRows(_DropsLastByte):
    def hits(self, slot_bytes: int) -> bool:
        return slot_bytes >= BIG_BYTES


class _DropsLastByteOfOddRows(_DropsLastByte):
    def hits(self, slot_bytes: int) -> bool:
        return slot_bytes % 8 != 0 and slot_bytes > 1


class LastByteOfBigRows(Mutant):
    """A7.1 / A9.6: rows of 1 MiB or more arrive without their last byte (an off by one in the
    last chunk of a large row), and are still marked."""

    attempt_type = _DropsLastByteOfBigRows


class LastByteOfOddRows(Mutant):
    """M2.4 / A7.1: rows whose size is no multiple of 8 (and more than one byte) arrive without
    their last byte (copied in 8-byte words, the tail left out), and are still marked."""

    attempt_type = _DropsLastByteOfOddRows


# -- A9.6: rows past the 64th of a group pass for misses -----------------------------------------

class MissesBeyond64Rows(LimitsBatches):
    """A9.6: a fetch moves at most 64 rows per group (one batch); the rest pass for misses."""

    ROWS = 64


# -- A10.7: a deadline failure's cause ------------------------------------------------------------------

class _DeadlineAsFault(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and out.cause is Cause.DEADLINE:
            return Outcome.failed(out.reason or "the store did not answer in time", out.masks, cause=Cause.FAULT)
        return out


class DeadlineCauseFault(Mutant):
    """A10.7: an attempt whose deadline passed fails with cause FAULT (its reason still says the
    deadline passed)."""

    attempt_type = _DeadlineAsFault


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


# -- B4.1: capabilities() is not frozen -----------------------------------------------------------

class _LooseCapabilities(Capabilities):
    """A Capabilities whose fields can be assigned."""

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Capabilities):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in Capabilities.__dataclass_fields__)

    __hash__ = None  # type: ignore[assignment]


class MutableCapabilities(Mutant):
    """B4.1: capabilities() returns a Capabilities whose fields a caller can assign (equal in
    value to the declaration, but not frozen), one shared object for the instance's life."""

    def capabilities(self) -> Capabilities:
        caps = self.__dict__.get("caps")
        if caps is None:
            inner = self.inner.capabilities()
            caps = _LooseCapabilities(**{f: getattr(inner, f) for f in Capabilities.__dataclass_fields__})
            self.__dict__["caps"] = caps
        return caps


# -- A8.4 / H1.6: a hint's timeout_s only ever shortens the deadline -----------------------------

class HintTimeoutOnlyShortens(Mutant):
    """A8.4 / H1.6: the deadline is the shorter of the hint's ``timeout_s`` and the backend's
    deadline option, so a hint that asks for more time than the option still fails at the
    option's deadline."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        option = self.__dict__.get("option_timeout_s")
        if hint.timeout_s is not None and option is not None and hint.timeout_s > option:
            hint = Hint(hint.kind, hint.fields, option)
        return super().make(op, view, hint, wake)


class _RecordsTimeout(MutantHarness):
    """Tells each end the deadline option it was built with."""

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        ends = super().open(timeout_s=timeout_s, max_in_flight=max_in_flight, faults=faults, hold=hold)
        for end in (ends.source, ends.sink):
            if end is not None:
                end.__dict__["option_timeout_s"] = timeout_s
        return ends


# -- L1.3: lookup answers from a cache of earlier answers -----------------------------------------

class LookupCachesAnswers(Mutant):
    """L1.3: lookup() remembers each answer by (groups, names, hint) and gives it again, so a
    name published after the first lookup is still reported not held (and one evicted, held)."""

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        cache = self.__dict__.setdefault("answers", {})
        try:
            key = (tuple(int(g) for g in groups), np.asarray(names).tobytes(), np.asarray(names).shape, hint)
        except (TypeError, ValueError):
            return super().lookup(groups, names, hint, timeout_s)
        if key not in cache:
            cache[key] = super().lookup(groups, names, hint, timeout_s)
        return cache[key].copy()


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


# -- A6.5: a late chunk flips a bit of a mask already handed over -------------------------------------

class _LateBit(HandsOverViews):
    def handed_over(self, out: Outcome, buffers: list[np.ndarray]) -> None:
        if out.is_delivered and self.op == "fetch":
            def late() -> None:  # the "late chunk" of a miss is counted as arrived
                time.sleep(0.002)
                for b in buffers:
                    b[:] = ~b
            threading.Thread(target=late, daemon=True).start()


class MaskChangesAfterPoll(Mutant):
    """A6.3 / A6.5: hands over read-only views of mask buffers it keeps, and ~2 ms after a fetch's
    outcome was first answered a late bookkeeping pass inverts them."""

    attempt_type = _LateBit


# -- A9.4: masks follow ascending group ids, not the view's order ----------------------------------

class _ById(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None or len(out.masks) < 2:
            return out
        order = sorted(range(len(self.view.groups)), key=lambda i: self.view.groups[i].group_id)
        masks = list(self.view.row_masks())
        for slot, i in enumerate(order):
            n = min(masks[slot].size, out.masks[i].size)
            masks[slot][:n] = out.masks[i][:n]
        return _outcome_like(out, masks)


class MasksInGroupIdOrder(Mutant):
    """A9.4 / A5.4: collects per-group results in a dict keyed by group id and hands the masks
    back in ascending group-id order, whatever the view's order (cut or padded to fit)."""

    attempt_type = _ById


# -- A5.11: a publish marks rows the store declined for space ---------------------------------------

class _ClaimsAll(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "publish" and out.is_delivered:
            return Outcome.delivered([np.ones(m.size, dtype=bool) for m in out.masks])
        return out


class PublishClaimsDeclinedRows(Mutant):
    """A5.11 / A5.6: a delivered publish marks every row held, also rows the store declined for
    lack of space."""

    attempt_type = _ClaimsAll


# -- A7.2: rows that cross a 64 KiB address boundary arrive torn -------------------------------------

CHUNK = 64 << 10


class _TornAtBoundary(Wrapped):
    done = False

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "fetch" and not self.done:
            self.done = True
            for group, mask in zip(self.view.groups, out.masks, strict=True):
                size = group.region.slot_bytes
                for row in np.flatnonzero(mask).tolist():
                    start = int(group.addresses()[row])
                    boundary = (start // CHUNK + 1) * CHUNK
                    if start < boundary < start + size:
                        ctypes.memset(boundary, ctypes.c_ubyte.from_address(boundary).value ^ 0xFF, 1)
        return out


class TornAtChunkBoundary(Mutant):
    """A7.1 / A7.2: a row whose bytes cross a 64 KiB address boundary gets the first byte past the
    boundary wrong (the second chunk copied from one byte off), and is still marked."""

    attempt_type = _TornAtBoundary


# -- the harnesses the suite is pointed at --------------------------------------------------------

quiesced_flickers = MutantHarness("quiesced-flickers", QuiescedFlickers)
quiesces_before_last_row = MutantHarness("quiesces-before-last-row", QuiescesBeforeLastRowOfBigFetch)
publish_needs_polling = MutantHarness("publish-needs-polling", PublishNeedsPolling)
big_views_need_polling = MutantHarness("big-views-need-polling", BigViewsNeedPolling)
partial_fault_as_miss = MutantHarness("partial-fault-as-miss", PartialFaultAsMiss)
shifts_group_masks = MutantHarness("shifts-group-masks", ShiftsGroupMasks)
subclass_masks = MutantHarness("subclass-masks", SubclassMasks)
last_byte_of_big_rows = MutantHarness("last-byte-of-big-rows", LastByteOfBigRows)
last_byte_of_odd_rows = MutantHarness("last-byte-of-odd-rows", LastByteOfOddRows)
misses_beyond_64_rows = MutantHarness("misses-beyond-64-rows", MissesBeyond64Rows)
deadline_cause_fault = MutantHarness("deadline-cause-fault", DeadlineCauseFault)
old_close_revokes_same_span = MutantHarness("old-close-revokes-same-span", OldCloseRevokesSameSpan)
mutable_capabilities = MutantHarness("mutable-capabilities", MutableCapabilities)
hint_timeout_only_shortens = _RecordsTimeout("hint-timeout-only-shortens", HintTimeoutOnlyShortens)
lookup_caches_answers = MutantHarness("lookup-caches-answers", LookupCachesAnswers)
accepts_same_span_twice = MutantHarness("accepts-same-span-twice", AcceptsSameSpanTwice)
mask_changes_after_poll = MutantHarness("mask-changes-after-poll", MaskChangesAfterPoll)
masks_in_group_id_order = MutantHarness("masks-in-group-id-order", MasksInGroupIdOrder)
publish_claims_declined_rows = MutantHarness("publish-claims-declined-rows", PublishClaimsDeclinedRows)
torn_at_chunk_boundary = MutantHarness("torn-at-chunk-boundary", TornAtChunkBoundary)
