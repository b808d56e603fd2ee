"""Mutants that each break one attempt clause (A1-A10: polling, quiescence, cancel, outcomes, masks,
torn rows, deadlines, batches, causes). Every harness below is registered once, in
``tests/conformance/mutant_table.py``, with the clause it breaks and the ``-k`` selection of the
suite's tests that must catch it. A mutant either wraps a correct backend through :mod:`kit` (the
memory backend, or the reference peer for the serving protocol) and breaks the clause from outside,
or subclasses a reference backend (:mod:`kvwire.testing.reference`) and overrides the one method
where the bug lives.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants/attempt.py:NAME``."""

from __future__ import annotations

import ctypes
import dataclasses
import heapq
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kit import (  # beside this file; on sys.path when loaded as a harness
    HoleHarness,
    Mutant,
    MutantHarness,
    PeerMutant,
    PeerMutantHarness,
    StoreMutantHarness,
    Wrapped,
    _Down,
    _outcome_like,
    _Padded,
    _peer_harness,
    _Recaused,
)
from kvwire_files import FilesDriver, FileStore
from kvwire_files.harness import FilesHarness
from kvwire_memory import MemoryDriver, named_store
from kvwire_memory.harness import MemoryHarness

from kvwire.blob import BatchResult, KeyStatus, StoreDriver
from kvwire.blob.keys import store_keys
from kvwire.contract import (
    Attempt,
    Backend,
    Cause,
    Hint,
    LayerGroupRows,
    Outcome,
    OutcomeStatus,
    SlotRegion,
    SubmissionRejected,
    TableRegistration,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.testing.harness import Ends, FaultPlan
from kvwire.testing.reference.core import Access, ReferenceAttempt, read_rows, write_rows
from kvwire.testing.reference.harness import ReferencePeerHarness as LoopbackHarness
from kvwire.testing.reference.peer import ReferencePeer, Rows
from kvwire.testing.reference.store import ReferenceStoreBackend, RowStatus, StoreReply, _Work


class HandsOverViews(Wrapped):
    """Answers ``poll()`` with the inner outcome, its masks read-only views of writable buffers
    it keeps (set past Outcome's copy, which trusts a read-only plain array, A6.3): a mutant that
    writes the buffers later changes masks it already handed over. ``handed_over`` runs once,
    when the outcome is first answered."""

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        handed = self.__dict__.get("handed")
        if handed is None:
            buffers = [np.array(m, dtype=bool) for m in out.masks]
            views = []
            for b in buffers:
                v = b.view()
                v.setflags(write=False)
                views.append(v)
            handed = _outcome_like(out, out.masks)
            object.__setattr__(handed, "masks", tuple(views))
            self.__dict__["handed"] = handed
            self.handed_over(out, buffers)
        return handed

    def handed_over(self, out: Outcome, buffers: list[np.ndarray]) -> None:
        pass


class _TearsLastRow(Wrapped):
    torn = False

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "fetch" and not self.torn:
            self.torn = True
            for group, mask in zip(self.view.groups, out.masks, strict=True):
                rows = np.flatnonzero(mask)
                if rows.size and group.region.slot_bytes > 1:
                    half = group.region.slot_bytes // 2
                    address = int(group.addresses()[rows[-1]]) + half
                    ctypes.memset(address, 0xEE, group.region.slot_bytes - half)
        return out


class MarksTornRows(Mutant):
    """A7: leaves the second half of a delivered row unwritten, and still marks the row."""

    attempt_type = _TearsLastRow


class _MissFails(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and out.is_delivered and self.op == "fetch" and not all(m.all() for m in out.masks):
            return Outcome.failed("some objects were not found", out.masks)
        return out


class MissAsFailure(Mutant):
    """A5: reports a fetch that missed rows as failed."""

    attempt_type = _MissFails


class _FaultMisses(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and out.is_failed:
            return Outcome.delivered(out.masks)
        return out


class FaultAsMiss(Mutant):
    """A5: reports a failed attempt as delivered, so faults pass for misses."""

    attempt_type = _FaultMisses


class _BlockingPoll(Wrapped):
    def poll(self) -> Outcome | None:
        deadline = time.monotonic() + 30.0
        while (out := self.inner.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return out


class BlocksInPoll(Mutant):
    """A1: poll() waits for the conclusion."""

    attempt_type = _BlockingPoll


class _Lazy(Wrapped):
    def __init__(self, start: Callable[[], Attempt], view: View, op: str, backend: Mutant) -> None:
        self.start = start
        self.started: Attempt | None = None
        self.view, self.op, self.backend = view, op, backend

    @property
    def inner(self) -> Attempt:  # type: ignore[override]
        if self.started is None:
            self.started = self.start()
        return self.started

    @inner.setter
    def inner(self, value: Attempt) -> None:
        self.started = value


class NeedsPolling(Mutant):
    """A3: starts the work only when the holder first polls."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        return _Lazy(lambda: call(view, hint, wake), view, op, self)

    def shutdown(self) -> frozenset[Attempt]:
        return self.inner.shutdown()


class _ReusesMasks(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        cached = self.__dict__.get("handed")
        if cached is None:
            buffers = self.backend.__dict__.setdefault("buffers", {})
            masks = []
            for i, mask in enumerate(out.masks):
                buf = buffers.get(i)
                if buf is None or buf.size < mask.size:
                    buf = buffers[i] = np.zeros(max(mask.size, 64), dtype=bool)
                buf[:] = False
                buf[: mask.size] = mask
                view = buf[: mask.size]
                view.setflags(write=False)
                masks.append(view)
            cached = self.__dict__["handed"] = _outcome_like(out, masks)
        return cached


class MutatesMaskAfterHandover(Mutant):
    """A6: hands over read-only views of mask buffers it reuses for the next attempt."""

    attempt_type = _ReusesMasks


class _AlwaysQuiesced(Wrapped):
    def quiesced(self) -> bool:
        return True


class QuiescesEarly(Mutant):
    """A2: says it quiesced while its worker may still write."""

    attempt_type = _AlwaysQuiesced


class _NonBool(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        odd = Outcome(out.status, out.masks, out.reason, out.by_peer)
        object.__setattr__(odd, "masks", tuple(m.astype(np.uint8) for m in out.masks))
        return odd


class KeepsNonBoolMask(Mutant):
    """A6: hands over uint8 masks."""

    attempt_type = _NonBool


class _ChangesItsMind(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        polls = self.__dict__["polls"] = self.__dict__.get("polls", 0) + 1
        if polls > 1 and out.is_delivered:
            return Outcome(OutcomeStatus.DELIVERED, tuple(np.zeros_like(m) for m in out.masks))
        return out


class UnstableOutcome(Mutant):
    """A1: a later poll gives another outcome."""

    attempt_type = _ChangesItsMind


class IgnoresDeadline(Mutant):
    """A8: drops the hint's deadline (and the harness sets no deadline through options)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        return super().make(op, view, Hint(hint.kind, hint.fields, None), wake)


class _IgnoresCancel(Wrapped):
    def cancel(self) -> None:
        pass


class IgnoresCancel(Mutant):
    """A4: declares cancellation, but cancel() does nothing."""

    attempt_type = _IgnoresCancel


class LimitsBatches(Mutant):
    """A9: a fetch of one view moves at most :attr:`ROWS` rows per group; the rest pass for misses."""

    ROWS = 4

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op != "fetch":
            return super().make(op, view, hint, wake)
        n = self.ROWS
        short = View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots[:n], g.tokens,
                                          None if g.names is None else g.names[:n]) for g in view.groups))
        return _Padded(self.inner.fetch(short, hint, wake), view, op, self)


# -- A8.2: every deadline doubled ------------------------------------------------------------------

class LateDeadline(Mutant):
    """A8.2: every deadline is doubled (the hint's, and through :class:`_Doubling` the
    option's): an attempt the other end never answers fails at twice its deadline."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if hint.timeout_s is not None:
            hint = Hint(hint.kind, hint.fields, hint.timeout_s * 2)
        return super().make(op, view, hint, wake)


class _Doubling(MutantHarness):
    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        self.inner_timeout_s = timeout_s * 2
        return super().open(timeout_s=timeout_s, max_in_flight=max_in_flight, faults=faults, hold=hold)


# -- A5.2 / A10.2: a delivered outcome with a reason or a cause ------------------------------------

class _DeliveredReason(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and out.is_delivered:
            odd = Outcome.delivered(out.masks)
            object.__setattr__(odd, "reason", f"{sum(int(m.sum()) for m in out.masks)} rows moved")
            return odd
        return out


class DeliveredCarriesReason(Mutant):
    """A5.2: a delivered outcome carries a reason (set past ``Outcome``'s checks)."""

    attempt_type = _DeliveredReason


class _DeliveredCause(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and out.is_delivered and any(not m.all() for m in out.masks):
            odd = Outcome.delivered(out.masks)
            object.__setattr__(odd, "cause", Cause.FAULT)  # "some rows missing"
            return odd
        return out


class DeliveredCarriesCause(Mutant):
    """A10.2: a delivered outcome with misses carries cause FAULT (set past ``Outcome``'s
    checks)."""

    attempt_type = _DeliveredCause


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


# -- A9.5: a fetch of names another fetch in flight is fetching passes them as misses ---------

class _Dedup(Wrapped):
    keys: list[tuple[int, bytes]]
    keep: list[list[int]] | None = None
    seen = False

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        if not self.seen:
            self.seen = True
            inflight = self.backend.__dict__.setdefault("inflight", set())
            for k in self.keys:
                inflight.discard(k)
        if self.keep is None:
            return out
        masks = list(self.view.row_masks())
        for gi, rows in enumerate(self.keep):
            if rows:
                masks[gi][rows] = out.masks[gi]
        return _outcome_like(out, masks)


class DedupesNamesInFlight(Mutant):
    """A9.5: a fetch naming (group, name) rows that another fetch of this instance is still
    fetching (not yet concluded for the holder) leaves them out and passes them for misses."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op != "fetch" or any(g.names is None for g in view.groups):
            return super().make(op, view, hint, wake)
        inflight = self.__dict__.setdefault("inflight", set())
        keep: list[list[int]] = []
        keys: list[tuple[int, bytes]] = []
        groups = []
        for g in view.groups:
            rows = [r for r in range(g.rows) if (g.group_id, g.name(r)) not in inflight]
            keep.append(rows)
            keys += [(g.group_id, g.name(r)) for r in rows]
            groups.append(LayerGroupRows(g.group_id, g.kind, g.region, g.slots[rows], g.tokens, g.names[rows]))
        dup = any(len(k) != g.rows for k, g in zip(keep, view.groups, strict=True))
        inner = self.inner.fetch(View(tuple(groups)) if dup else view, hint, wake)
        inflight.update(keys)
        attempt = _Dedup(inner, view, op, self)
        attempt.keys = keys
        if dup:
            attempt.keep = keep
        return attempt


# -- A6.5: the masks of a failed fetch are cleared after hand-over ----------------------------

class _RollsBack(HandsOverViews):
    def handed_over(self, out: Outcome, buffers: list[np.ndarray]) -> None:
        if not out.is_delivered:
            self.backend.__dict__.setdefault("rollback", []).extend(buffers)


class FailedMasksClearedLater(Mutant):
    """A6.5: the masks of a failed or cancelled outcome are views of buffers the backend keeps;
    when the next submission comes in, a rollback pass over the attempts that did not deliver
    clears them."""

    attempt_type = _RollsBack

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        for b in self.__dict__.pop("rollback", []):
            b[:] = False
        return super().submit(op, view, hint, wake)


# -- A8.4 / H1.6: a publish's deadline ---------------------------------------------------------------

class PublishIgnoresHintTimeout(Mutant):
    """A8.4 / H1.6: a publish takes the deadline option whatever the hint's ``timeout_s`` says (the
    hint's deadline is read on the fetch path only)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op == "publish" and isinstance(hint, Hint) and hint.timeout_s is not None:
            hint = Hint(hint.kind, hint.fields, None)
        return super().make(op, view, hint, wake)


class PublishesWithoutDeadline(Mutant):
    """A8.4: a publish whose hint gives no ``timeout_s`` has no deadline (an hour), instead of the
    deadline option."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op == "publish" and isinstance(hint, Hint) and hint.timeout_s is None:
            hint = Hint(hint.kind, hint.fields, 3600.0)
        return super().make(op, view, hint, wake)


# -- A4.1: cancel() that raises --------------------------------------------------------------------------

class _CancelRaisesAfterFailure(Wrapped):
    def cancel(self) -> None:
        out = self.inner.poll()
        if out is not None and out.is_failed:
            raise RuntimeError(f"cannot cancel: the attempt already failed ({out.reason})")
        self.inner.cancel()


class CancelRaisesAfterFailure(Mutant):
    """A4.1 / S5.2: ``cancel()`` of an attempt that failed raises the failure again."""

    attempt_type = _CancelRaisesAfterFailure


class _CancelRaisesAfterShutdown(Wrapped):
    def cancel(self) -> None:
        if self.backend.__dict__.get("down"):
            raise SubmissionRejected("this backend is shut down; it cancels nothing")
        self.inner.cancel()


class CancelRaisesAfterShutdown(_Down):
    """A4.1: ``cancel()`` raises ``SubmissionRejected`` once the instance was shut down."""

    attempt_type = _CancelRaisesAfterShutdown


# -- A1.1 / A2.1: a publish's poll() and quiesced() wait on the store -------------------------------

#: How long the blocking calls below wait at most (then answer as the inner attempt stands).
BLOCK_S = 30.0


def _wait_until(done: Callable[[], bool]) -> None:
    until = time.monotonic() + BLOCK_S
    while not done() and time.monotonic() < until:
        time.sleep(0.005)


class _PollWaitsForStore(Wrapped):
    def poll(self) -> Outcome | None:
        if self.op == "publish":
            _wait_until(self.inner.quiesced)  # the attempt's lock, held by the worker inside the store call
        return self.inner.poll()


class PublishPollWaitsForTheStore(Mutant):
    """A1.1: ``poll()`` of a publish waits while the store holds its put (it takes a lock the worker
    holds around the store call); a fetch's ``poll()`` is right."""

    attempt_type = _PollWaitsForStore


class _QuiescedWaitsForStore(Wrapped):
    def quiesced(self) -> bool:
        if self.op == "publish":
            _wait_until(self.inner.quiesced)
        return self.inner.quiesced()


class PublishQuiescedWaitsForTheStore(Mutant):
    """A2.1: ``quiesced()`` of a publish waits while the store holds its put; a fetch's is right."""

    attempt_type = _QuiescedWaitsForStore


# -- A10.11: a pull from a peer that is gone fails as a fault -----------------------------------

class _GoneAsFault(_Recaused):
    old = Cause.PEER_GONE
    new = Cause.FAULT


class GonePeerAsFault(PeerMutant):
    """A10.11: a pull from a serving end that is gone (nobody answers at its address) fails at
    once with cause ``FAULT`` instead of ``PEER_GONE``."""

    attempt_type = _GoneAsFault


# -- A5.10: a name asked twice in one group of a fetch ------------------------------------------------

class _Scatter(Wrapped):
    """The inner outcome of a view without the repeated rows, with masks of the whole view: the
    rows left out are false bits."""

    keep: list[np.ndarray]

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        cached = self.__dict__.get("answered")
        if cached is None:
            masks = list(self.view.row_masks())
            for mask, keep, got in zip(masks, self.keep, out.masks, strict=True):
                mask[keep] = got
            cached = self.__dict__["answered"] = _outcome_like(out, masks)
        return cached


class FetchDedupesRepeatedNames(Mutant):
    """A5.10: a fetch gathers its gets by key (a dict from object key to slot), so a name asked on
    two rows of one group is fetched into the first row only; the other passes for a miss."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op != "fetch" or not isinstance(view, View) or all(g.names is None for g in view.groups) \
                or view.overlapping_rows() is not None:  # checked whole first: a refusal stays one
            return super().make(op, view, hint, wake)
        keeps, groups = [], []
        for g in view.groups:
            if g.names is None or not g.rows:
                keep = np.arange(g.rows)
            else:
                _, first = np.unique(g.names, axis=0, return_index=True)
                keep = np.sort(first)
            keeps.append(keep)
            groups.append(LayerGroupRows(g.group_id, g.kind, g.region, g.slots[keep], g.tokens,
                                         None if g.names is None else g.names[keep]))
        attempt = _Scatter(self.inner.fetch(View(tuple(groups)), hint, wake), view, op, self)
        attempt.keep = keeps
        return attempt


# -- A4.6: cancel() judges "still running" by quiescence ----------------------------------------------

class _CancelByQuiescence(Wrapped):
    def cancel(self) -> None:
        if self.inner.quiesced():
            return  # "already over": nothing to cancel
        before = self.inner.poll()
        self.inner.cancel()
        if before is not None and not before.is_cancelled and "rewritten" not in self.__dict__:
            masks = [np.zeros(g.rows, dtype=bool) for g in self.view.groups]
            self.__dict__["rewritten"] = Outcome.cancelled(masks, cause=Cause.HOLDER_CANCELLED)

    def poll(self) -> Outcome | None:
        rewritten = self.__dict__.get("rewritten")
        return rewritten if rewritten is not None else self.inner.poll()


class CancelRewritesAFailedOutcome(Mutant):
    """A4.6 / A1.3: ``cancel()`` asks whether the attempt is still running by its quiescence, not
    by its conclusion: cancelling a fetch that already failed by its deadline while its store
    call still runs writes a ``CANCELLED`` outcome over the failure."""

    attempt_type = _CancelByQuiescence


# -- A4.2: a second cancel() forces the attempt quiesced ----------------------------------------------

class _ForcedQuiet(Wrapped):
    def cancel(self) -> None:
        if self.__dict__.get("cancelled") and self.inner.poll() is not None:
            self.__dict__["forced"] = True  # "cancelled twice: give up waiting for the store"
        self.__dict__["cancelled"] = True
        self.inner.cancel()

    def quiesced(self) -> bool:
        return True if self.__dict__.get("forced") else self.inner.quiesced()


class SecondCancelForcesQuiescence(Mutant):
    """A4.2 / A2.3: a second ``cancel()`` of an attempt it already concluded cancelled gives up
    waiting for the other end and reports the attempt quiesced, while the store call it left
    running still writes the fetch's rows once the store answers."""

    attempt_type = _ForcedQuiet


# -- A5.10: a stopped answer passed off as a shorter prefix -----------------------------------------------

class _StopsShort(ReferencePeer):
    """An answer held on the wire that its holder cancels meanwhile sends only the first block it
    had "already sent", and the requester takes that as the served prefix."""

    def _send_rows(self, answer: Any) -> None:
        with self._runner.lock:
            if not answer.touch_locked():
                return
        data = tuple(read_rows(loc, g.region.slot_bytes) for g, loc in zip(answer.view.groups, answer.located,
                                                                           strict=True))
        with self._runner.lock:
            answer.untouch_locked()
            answer.end_access_locked()
        gate = getattr(self._fabric.link, "gate", None)
        if gate is not None:
            with gate.passage():  # the wire, held by the harness
                pass
        with self._runner.lock:
            stopped = answer.outcome is not None and answer.outcome.status is OutcomeStatus.CANCELLED
        if stopped:
            data = tuple(d[:1] for d in data)
        self._send(answer.reply_to, Rows(answer.ticket, self.address(), data))


class StoppedAnswerAsShortPrefix(PeerMutant):
    """A5.10: an answer its holder stops while it is on the wire reaches the requester cut to the
    blocks already sent, and the requester delivers them as a shorter prefix: rows the serving end
    held throughout are false bits of a delivered fetch."""


# -- A1.1: a poll that waits a little for the outcome ------------------------------------------------------

class _PollWaits(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            time.sleep(0.02)  # "give the outcome a moment to arrive"
            out = self.inner.poll()
        return out


class PollWaitsBriefly(Mutant):
    """A1.1: ``poll()`` of an attempt that has not concluded waits 20 ms for the outcome before it
    answers ``None``: it returns, but a holder polling many attempts stalls."""

    attempt_type = _PollWaits


# -- A2.3: an attempt in the backend's own queue says it quiesced -------------------------------------------

class _Queued(Wrapped):
    """A submission the mutant keeps in its own queue until the one before it is done."""

    def __init__(self, op: str, view: View, hint: Hint, wake: WakeFn, backend: Mutant) -> None:
        self.inner: Attempt | None = None  # type: ignore[assignment]
        self.view = view
        self.op = op
        self.hint = hint
        self.wake = wake
        self.backend = backend
        self.cancelled = False

    def poll(self) -> Outcome | None:
        return None if self.inner is None else self.inner.poll()

    def quiesced(self) -> bool:
        return True if self.inner is None else self.inner.quiesced()  # "nothing touches its rows yet"

    def cancel(self) -> None:
        self.cancelled = True
        if self.inner is not None:
            self.inner.cancel()


class QuiescedWhileQueued(Mutant):
    """A2.3: submissions run one at a time from the mutant's own queue; one still waiting there
    says ``quiesced()`` (nothing touches its rows yet), though it will write them once it runs."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        attempt = _Queued(op, view, hint, wake, self)
        with self._cond():
            self.__dict__.setdefault("queue", []).append(attempt)
            if "thread" not in self.__dict__:
                self.__dict__["thread"] = threading.Thread(target=self._run, daemon=True)
                self.__dict__["thread"].start()
            self._cond().notify_all()
        self.remember(attempt)
        return attempt

    def _cond(self) -> threading.Condition:
        return self.__dict__.setdefault("cond", threading.Condition())  # type: ignore[no-any-return]

    def _run(self) -> None:
        cond = self._cond()
        while True:
            with cond:
                cond.wait_for(lambda: self.__dict__["queue"] or self.__dict__.get("stopped"))
                if self.__dict__.get("stopped"):
                    return
                attempt: _Queued = self.__dict__["queue"].pop(0)
            call = self.inner.fetch if attempt.op == "fetch" else self.inner.publish
            attempt.inner = call(attempt.view, attempt.hint, attempt.wake)
            if attempt.cancelled:
                attempt.inner.cancel()
            while not (attempt.inner.poll() is not None and attempt.inner.quiesced()):
                with cond:
                    if cond.wait_for(lambda: self.__dict__.get("stopped"), timeout=0.005):
                        return

    def shutdown(self) -> frozenset[Attempt]:
        with self._cond():
            self.__dict__["stopped"] = True
            self._cond().notify_all()
        return super().shutdown()


# -- A5.11: a full store fails the publish -------------------------------------------------------------

class _FullIsAFault(MemoryDriver):
    """A client whose store answers "out of memory" as an error: a put the store declines for
    space is reported ``FAILED`` (the third-party Redis plugin's bug)."""

    def put(self, keys: Any, addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        result = super().put(keys, addresses, sizes)
        declined = np.asarray(result.status) == int(KeyStatus.DECLINED)
        if not declined.any():
            return result
        status = np.array(result.status, dtype=np.uint8)
        status[declined] = int(KeyStatus.FAILED)
        reasons = dict(result.reasons)
        reasons.update({int(i): "OOM command not allowed when used memory > 'maxmemory'"
                        for i in np.flatnonzero(declined)})
        return BatchResult(status, reasons)


class _FullIsAFaultHarness(MemoryHarness):
    def driver(self, store: Any) -> StoreDriver:
        from kvwire_memory.harness import CAPACITY_BYTES

        return _FullIsAFault(named_store(store, capacity_bytes=CAPACITY_BYTES, eviction=False))

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float,
                   max_in_flight: int | None) -> Backend | None:
        return None  # every end on the broken client


# -- A5.6: a publish answered from this process's memory of what the store held ----------------------

class _RemembersWhatItStored(FilesDriver):
    """Remembers, for this process, every key the store held when one of its drivers of that
    store stored or read it, and answers a put of one ``ALREADY_THERE`` from that memory without
    asking the store, which another process may have removed it from since."""

    #: store root -> keys this process saw held there
    seen: dict[str, set[str]] = {}

    def __init__(self, store: FileStore, **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        self.stored = self.seen.setdefault(str(store.root), set())

    def put(self, keys: Any, addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        known = np.array([k in self.stored for k in keys], dtype=bool)
        status = np.full(len(keys), int(KeyStatus.ALREADY_THERE), dtype=np.uint8)
        reasons: dict[int, str] = {}
        rest = np.flatnonzero(~known)
        if rest.size:
            result = super().put([keys[i] for i in rest.tolist()], np.asarray(addresses)[rest], np.asarray(sizes)[rest])
            status[rest] = result.status
            reasons = {int(rest[j]): text for j, text in result.reasons.items()}
        self.stored.update(k for k, s in zip(keys, status.tolist(), strict=True)
                           if s in (int(KeyStatus.OK), int(KeyStatus.ALREADY_THERE)))
        return BatchResult(status, reasons)

    def get_into(self, keys: Any, addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        result = super().get_into(keys, addresses, sizes)
        self.stored.update(k for k, s in zip(keys, np.asarray(result.status).tolist(), strict=True)
                           if s == int(KeyStatus.OK))
        return result


class _StaleFilesHarness(FilesHarness):
    def driver(self, store: Any) -> StoreDriver:
        from kvwire_files.harness import CAPACITY_BYTES

        return _RemembersWhatItStored(FileStore(store, capacity_bytes=CAPACITY_BYTES, eviction=False), owns_store=True)

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float,
                   max_in_flight: int | None) -> Backend | None:
        return None  # every end on the remembering driver; the other process runs the real one


# -- A1.3 / A1.5: shutdown() writes over an outcome already answered ------------------------------

class _Overwritable(Wrapped):
    overwritten: Outcome | None = None

    def poll(self) -> Outcome | None:
        if self.overwritten is not None:
            return self.overwritten
        return self.inner.poll()


class ShutdownOverwritesConcluded(Mutant):
    """A1.3 / A1.5: shutdown() cancels every attempt that has not quiesced, writing cancelled
    (cause SHUTDOWN) over the outcome of one that had already concluded (cancelled or failed,
    its access not yet ended)."""

    attempt_type = _Overwritable

    def shutdown(self) -> frozenset[Attempt]:
        for a in self._attempts():
            if a.overwritten is None and not a.inner.quiesced() and a.inner.poll() is not None:  # type: ignore[attr-defined]
                masks = a.view.row_masks()
                for mask in masks:
                    mask.setflags(write=False)
                a.overwritten = Outcome.cancelled(masks, reason="the backend shut down",  # type: ignore[attr-defined]
                                                  cause=Cause.SHUTDOWN)
        return super().shutdown()


# -- A4.3 / A10.6: a publish the holder cancelled reports a fault ---------------------------------

class _CancelledPublishFails(Wrapped):
    cancelled_early = False

    def cancel(self) -> None:
        if self.inner.poll() is None:
            self.cancelled_early = True
        self.inner.cancel()

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "publish" and out.is_cancelled and self.cancelled_early:
            return Outcome.failed("publish aborted", out.masks, cause=Cause.FAULT)
        return out


class CancelledPublishFails(Mutant):
    """A4.3 / A10.6: a publish the holder cancelled before it concluded reports FAILED (cause
    FAULT, "publish aborted") instead of CANCELLED with cause HOLDER_CANCELLED. Fetches are
    right."""

    attempt_type = _CancelledPublishFails


# -- A4.6: cancel() after a delivered publish takes back what it stored ----------------------------

class _CancelRollsBack(Wrapped):
    def cancel(self) -> None:
        self.inner.cancel()
        out = self.inner.poll()
        if out is not None and out.is_delivered and self.op == "publish" and not self.__dict__.get("rolled"):
            self.__dict__["rolled"] = True
            self.backend.rollback(self)  # type: ignore[attr-defined]


class CancelRollsBackPublish(Mutant):
    """A4.6: cancel() after a publish delivered removes the objects it stored (an "abort" that
    should have been a no-op)."""

    attempt_type = _CancelRollsBack

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        attempt = super().make(op, view, hint, wake)
        attempt.__dict__["namespace"] = hint.get("namespace")
        return attempt

    def rollback(self, attempt: Wrapped) -> None:
        inner = self.inner  # the memory backend: a BlobBackend over its store driver
        namespace = attempt.__dict__.get("namespace") or inner.namespace  # type: ignore[attr-defined]
        keys: list[str] = []
        for group in attempt.view.groups:
            if group.names is not None and group.rows:
                keys += store_keys(namespace, group.group_id, group.names)
        if keys:
            inner.driver.remove(keys)  # type: ignore[attr-defined]


class DeadlineFromStart(ReferenceStoreBackend):
    """A8: the deadline is counted from when the worker starts the attempt, not from submission
    (an attempt queued behind a slow one gets extra time)."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        with self._runner.lock:
            attempt.deadline = float("inf")
            self._runner._deadlines = [e for e in self._runner._deadlines if e[2] is not attempt]
            heapq.heapify(self._runner._deadlines)
        return attempt

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        with self._runner.lock:
            attempt.deadline = time.monotonic() + attempt.timeout_s
            heapq.heappush(self._runner._deadlines, (attempt.deadline, -id(attempt), attempt))
            self._runner.lock.notify_all()
        super()._move(attempt, work)


class IgnoresHintTimeout(ReferenceStoreBackend):
    """A8: the hint's ``timeout_s`` is ignored; the option's deadline always applies."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        return super()._submit(op, view, Hint(hint.kind, hint.fields), wake)


class _NoCauseAttempt(ReferenceAttempt):
    def expire_locked(self) -> None:
        self.conclude_locked(OutcomeStatus.FAILED, None, f"deadline passed after {self.timeout_s:g} s")


class DeadlineWithoutCause(ReferenceStoreBackend):
    """A10: a deadline failure carries no cause, though the backend speaks contract 1.1."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _NoCauseAttempt
        return attempt


class _PollOnce(ReferenceAttempt):
    def poll(self) -> Any:
        out = self.outcome
        if out is not None:
            if getattr(self, "_answered", False):
                return None
            self._answered = True
        return out


class PollsOnce(ReferenceStoreBackend):
    """A1: poll() hands the outcome over once (a queue popped), then answers None."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _PollOnce
        return attempt


class _QuiescedWhenConcluded(ReferenceAttempt):
    def quiesced(self) -> bool:
        return self.outcome is not None


class QuiescesAtConclusion(ReferenceStoreBackend):
    """A2: quiesced() answers "concluded": a cancelled or expired fetch whose get is still in
    progress at the store says quiesced, and its rows are written after."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _QuiescedWhenConcluded
        return attempt


class _QuiescedWhileIdle(ReferenceAttempt):
    def quiesced(self) -> bool:
        # "quiet" meant: this attempt is done and no worker is busy.
        return self.access is Access.ENDED and self.runner._jobs.__len__() == 0 and not getattr(
            self.runner, "busy", False)


class QuiescedFlipsBack(ReferenceStoreBackend):
    """A2: quiesced() also asks whether the backend is idle, so it turns false again while later
    work runs."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _QuiescedWhileIdle
        return attempt

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        self._runner.busy = True  # type: ignore[attr-defined]
        try:
            super()._move(attempt, work)
        finally:
            self._runner.busy = False  # type: ignore[attr-defined]


class _SortedMasks(ReferenceAttempt):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if self.outcome is None and self.op == "fetch":
            # the store was asked in ascending slot order; the bits are left in that order
            self.moved = [m[np.argsort(g.slots, kind="stable")] for g, m in zip(self.view.groups, self.moved,
                                                                              strict=True)]
        return super().conclude_locked(status, cause, reason, by_peer=by_peer)


class MasksInSlotOrder(ReferenceStoreBackend):
    """A9: a fetch's bytes land right, but its masks are handed over in ascending slot order
    instead of the view's row order."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _SortedMasks
        return attempt


class MissesBeyondThousandRows(ReferenceStoreBackend):
    """A9: a store call takes at most 1000 rows; rows beyond the first 1000 of a group are
    silently left out (misses on fetch, not held on publish)."""

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        store = self._store

        class Capped:
            def put(self, ns: str, gid: int, names: np.ndarray, rows: np.ndarray) -> StoreReply:
                reply = store.put(ns, gid, names[:1000], rows[:1000])
                status = np.full(len(names), RowStatus.DECLINED, dtype=np.uint8)
                status[:1000] = reply.status
                return StoreReply(status, None, reply.reason)

            def get(self, ns: str, gid: int, names: np.ndarray, size: int) -> StoreReply:
                reply = store.get(ns, gid, names[:1000], size)
                status = np.full(len(names), RowStatus.MISSING, dtype=np.uint8)
                status[:1000] = reply.status
                data = np.zeros((len(names), size), dtype=np.uint8)
                assert reply.data is not None
                data[:1000] = reply.data
                return StoreReply(status, data, reply.reason)

        self._store = Capped()
        try:
            super()._move(attempt, work)
        finally:
            self._store = store


class _NewOnlyStore:
    """Says HELD only for rows this put stored; rows already there answer MISSING (the store's
    "not stored by this call")."""

    def __init__(self, end: Any) -> None:
        self.end = end

    def put(self, namespace: str, group_id: int, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        before = self.end.get(namespace, group_id, names, rows.shape[1]).status == RowStatus.HELD
        reply = self.end.put(namespace, group_id, names, rows)
        status = reply.status.copy()
        status[before] = RowStatus.DECLINED
        return StoreReply(status, None, reply.reason)

    def get(self, namespace: str, group_id: int, names: np.ndarray, slot_bytes: int) -> StoreReply:
        return self.end.get(namespace, group_id, names, slot_bytes)


class PublishMaskFalseForHeldRows(ReferenceStoreBackend):
    """A5: a publish's mask says False for rows the store already held (only rows stored by this
    call count)."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(_NewOnlyStore(store), **options)


class _AllMissFails(ReferenceAttempt):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if status is OutcomeStatus.DELIVERED and self.op == "fetch" and self.view.rows and not any(
                m.any() for m in self.moved):
            status, cause, reason = OutcomeStatus.FAILED, Cause.FAULT, "the store holds none of the rows"
        return super().conclude_locked(status, cause, reason, by_peer=by_peer)


class AllMissIsFailure(ReferenceStoreBackend):
    """A5: a fetch in which every row misses is reported FAILED ("nothing found")."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _AllMissFails
        return attempt


class FaultAsMissAfterFirst(ReferenceStoreBackend):
    """A5: only a fault in the first group fails the attempt; a fault in a later group passes as
    a miss."""

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        store = self._store
        first = [True]

        class Forgiving:
            def put(self, *args: Any) -> StoreReply:
                return store.put(*args)

            def get(self, ns: str, gid: int, names: np.ndarray, size: int) -> StoreReply:
                reply = store.get(ns, gid, names, size)
                if not first[0]:
                    status = reply.status.copy()
                    status[status == RowStatus.FAILED] = RowStatus.MISSING
                    reply = StoreReply(status, reply.data, "")
                first[0] = False
                return reply

        self._store = Forgiving()
        try:
            super()._move(attempt, work)
        finally:
            self._store = store


class CutsLargeRows(ReferencePeer):
    """A7: the server sends at most 64 KiB of each row (one frame), and the requester marks the
    row delivered all the same."""

    def _send(self, to: bytes, message: Any) -> bool:
        if isinstance(message, Rows):
            data = []
            for d in message.data:
                d = d.copy()
                d[:, 65536:] = 0
                data.append(d)
            message = Rows(message.ticket, message.reply_to, tuple(data))
        return super()._send(to, message)


class DeclineAsFault(ReferencePeer):
    """A10: a declined pull fails with cause FAULT instead of DECLINED."""

    def _handle(self, message: Any) -> None:
        from kvwire.testing.reference.peer import Declined, Fault
        if isinstance(message, Declined):
            with self._runner.lock:
                pull = self._pulls.pop(message.ticket, None)
                if pull is not None:
                    pull.conclude_locked(OutcomeStatus.FAILED, Cause.FAULT, message.reason)
            return
        super()._handle(message)
        _ = Fault


class PeerIgnoresHintTimeout(ReferencePeer):
    """A8: a pull's deadline ignores the hint's ``timeout_s``."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        return super().fetch(view, Hint(hint.kind, hint.fields), wake)


class AnswerQuiescesBeforeCopy(ReferencePeer):
    """A2: an answer says quiesced as soon as it is queued, before its worker has copied the
    served rows out of memory (so its holder unpins and may reuse them while they are read)."""

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        answer = super().publish(view, hint, wake)
        answer.__class__ = _EarlyAnswer
        return answer


class _EarlyAnswer(ReferenceAttempt):
    def quiesced(self) -> bool:
        return True


class _AttemptsOf(ReferenceStoreBackend):
    """A reference store whose attempts are of :attr:`attempt_class` (each mutant below changes
    the attempt only)."""

    attempt_class: type[ReferenceAttempt] = ReferenceAttempt

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        # Under the lock, so no worker moves the attempt before its class is changed.
        with self._runner.lock:
            attempt = super()._submit(op, view, hint, wake)
            attempt.__class__ = self.attempt_class
        return attempt


class _QuiescesWhenAsked(ReferenceAttempt):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        access = self.access
        if access is Access.WAITING:
            self.access = Access.TOUCHING  # so the base does not end the access with the conclusion
        try:
            return super().conclude_locked(status, cause, reason, by_peer=by_peer)
        finally:
            self.access = access

    def untouch_locked(self) -> None:
        if self.access is Access.TOUCHING:
            self.access = Access.WAITING

    def quiesced(self) -> bool:
        with self.runner.lock:
            if self.outcome is not None and self.access is Access.WAITING:
                self.access = Access.ENDED
                self.runner.changed_locked(self)
        return self.access is Access.ENDED


class QuiescesOnlyWhenAsked(_AttemptsOf):
    """A3: an attempt's access ends only inside quiesced(): a concluded attempt the holder never
    asks keeps its queue slot."""

    attempt_class = _QuiescesWhenAsked

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        # The base's, over a copy of the live set: asking quiesced() here frees slots.
        runner = self._runner
        with runner.lock:
            runner.closed = True
            self._table.close()
            for attempt in list(runner.live):
                attempt.conclude_locked(OutcomeStatus.CANCELLED, Cause.SHUTDOWN, "the backend shut down")
            pending = frozenset(a for a in list(runner.live) if not a.quiesced())
        if not pending:
            runner.stop()
        return pending


class _CancelWaitsForTheCall(ReferenceAttempt):
    cancel_asked = False

    def cancel(self) -> None:
        with self.runner.lock:
            if self.access is Access.TOUCHING:
                self.cancel_asked = True  # concluded once the store call in progress returns
                return
        super().cancel()

    def untouch_locked(self) -> None:
        if self.cancel_asked:
            self.conclude_locked(OutcomeStatus.CANCELLED, Cause.HOLDER_CANCELLED, "cancelled by the holder")
        super().untouch_locked()


class CancelWaitsForTheCallInProgress(_AttemptsOf):
    """A4: cancel() of an attempt whose store call is in progress concludes it only when that
    call returns."""

    attempt_class = _CancelWaitsForTheCall


class _CancelMarksEveryRow(ReferenceAttempt):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        done = super().conclude_locked(status, cause, reason, by_peer=by_peer)
        if done and status is OutcomeStatus.CANCELLED:
            assert self.outcome is not None
            ones = tuple(np.ones(mask.size, dtype=bool) for mask in self.outcome.masks)
            for mask in ones:
                mask.setflags(write=False)
            object.__setattr__(self.outcome, "masks", ones)  # Outcome is frozen; the bug is the backend's
        return done


class CancelMarksEveryRow(_AttemptsOf):
    """A4: a cancelled fetch marks every row true, moved or not."""

    attempt_class = _CancelMarksEveryRow


class _DeadlineMarksEveryRow(ReferenceAttempt):
    def expire_locked(self) -> None:
        for mask in self.moved:
            mask[:] = True
        super().expire_locked()


class DeadlineMarksEveryRow(_AttemptsOf):
    """A8: a fetch failed by its deadline marks every row true, moved or not."""

    attempt_class = _DeadlineMarksEveryRow


class _OutcomeRewritten(ReferenceAttempt):
    """Concludes as the base does, then :meth:`rewrite` changes what the outcome says (Outcome is
    frozen and refuses these values; the bug is the backend's)."""

    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        done = super().conclude_locked(status, cause, reason, by_peer=by_peer)
        if done:
            assert self.outcome is not None
            for field, value in self.rewrite(self.outcome).items():
                object.__setattr__(self.outcome, field, value)
        return done

    def rewrite(self, outcome: Outcome) -> dict[str, Any]:
        return {}


class _BlankFailureReason(_OutcomeRewritten):
    def rewrite(self, outcome: Outcome) -> dict[str, Any]:
        return {"reason": " "} if outcome.is_failed else {}


class FailsWithABlankReason(_AttemptsOf):
    """A5: a failed outcome's reason is blank."""

    attempt_class = _BlankFailureReason


class _ReasonOnDelivery(_OutcomeRewritten):
    def rewrite(self, outcome: Outcome) -> dict[str, Any]:
        return {"reason": "delivered"} if outcome.is_delivered else {}


class DeliversWithAReason(_AttemptsOf):
    """A5: a delivered outcome carries a reason ("delivered")."""

    attempt_class = _ReasonOnDelivery


class _CauseOnDelivery(_OutcomeRewritten):
    def rewrite(self, outcome: Outcome) -> dict[str, Any]:
        return {"cause": Cause.FAULT} if outcome.is_delivered else {}


class DeliversWithACause(_AttemptsOf):
    """A10: a delivered outcome carries cause FAULT."""

    attempt_class = _CauseOnDelivery


class _FailsAsHolderCancelled(_OutcomeRewritten):
    def rewrite(self, outcome: Outcome) -> dict[str, Any]:
        return {"cause": Cause.HOLDER_CANCELLED} if outcome.is_failed else {}


class FailsAsHolderCancelled(_AttemptsOf):
    """A10: a failed outcome carries HOLDER_CANCELLED, a cancel's cause."""

    attempt_class = _FailsAsHolderCancelled


class _FailsWithoutACause(_OutcomeRewritten):
    def rewrite(self, outcome: Outcome) -> dict[str, Any]:
        return {"cause": None} if outcome.is_failed else {}


class FailsWithoutACause(_AttemptsOf):
    """A10: every failed outcome carries no cause, though the backend declares contract 1.3."""

    attempt_class = _FailsWithoutACause


class _CancelledAsAFault(_OutcomeRewritten):
    def rewrite(self, outcome: Outcome) -> dict[str, Any]:
        return {"cause": Cause.FAULT} if outcome.is_cancelled else {}


class CancelledAsAFault(_AttemptsOf):
    """A10: a cancelled outcome (the holder's cancel, shutdown) carries cause FAULT."""

    attempt_class = _CancelledAsAFault


class _FaultAsDeadline(_OutcomeRewritten):
    def rewrite(self, outcome: Outcome) -> dict[str, Any]:
        return {"cause": Cause.DEADLINE} if outcome.cause is Cause.FAULT else {}


class FaultCauseDeadline(_AttemptsOf):
    """A10: a fetch the store failed carries cause DEADLINE instead of FAULT."""

    attempt_class = _FaultAsDeadline


class _FlipsBits:
    """A store end that keeps each row put with the lowest bit of every byte flipped, and answers
    HELD all the same."""

    def __init__(self, end: Any) -> None:
        self.end = end

    def put(self, namespace: str, space: Any, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        return self.end.put(namespace, space, names, np.asarray(rows, dtype=np.uint8) ^ np.uint8(1))

    def get(self, namespace: str, space: Any, names: np.ndarray, row_bytes: int) -> StoreReply:
        return self.end.get(namespace, space, names, row_bytes)

    def contains(self, namespace: str, space: Any, names: np.ndarray) -> StoreReply:
        return self.end.contains(namespace, space, names)


class PublishStoresOtherBytes(ReferenceStoreBackend):
    """A7: a publish marks rows held whose object at the store has other bytes than the row had."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(_FlipsBits(store), **options)


blocks_in_poll = MutantHarness("blocks-in-poll", BlocksInPoll)
unstable_outcome = MutantHarness("unstable-outcome", UnstableOutcome)
quiesces_early = MutantHarness("quiesces-early", QuiescesEarly)
needs_polling = MutantHarness("needs-polling", NeedsPolling)
ignores_cancel = MutantHarness("ignores-cancel", IgnoresCancel)
miss_as_failure = MutantHarness("miss-as-failure", MissAsFailure)
fault_as_miss = MutantHarness("fault-as-miss", FaultAsMiss)
keeps_non_bool_mask = MutantHarness("keeps-non-bool-mask", KeepsNonBoolMask)
mutates_mask_after_handover = MutantHarness("mutates-mask-after-handover", MutatesMaskAfterHandover)
marks_torn_rows = MutantHarness("marks-torn-rows", MarksTornRows)
ignores_deadline = MutantHarness("ignores-deadline", IgnoresDeadline, inner_timeout_s=3600.0)
limits_batches = MutantHarness("limits-batches", LimitsBatches)
late_deadline = _Doubling("late-deadline", LateDeadline)
delivered_carries_reason = MutantHarness("delivered-carries-reason", DeliveredCarriesReason)
delivered_carries_cause = MutantHarness("delivered-carries-cause", DeliveredCarriesCause)


stopped_answer_as_short_prefix = HoleHarness("stopped-answer-as-short-prefix", StoppedAnswerAsShortPrefix,
                                             inner=_peer_harness(_StopsShort))
poll_waits_briefly = HoleHarness("poll-waits-briefly", PollWaitsBriefly)
quiesced_while_queued = HoleHarness("quiesced-while-queued", QuiescedWhileQueued)
full_store_fails_the_publish = HoleHarness("full-store-fails-the-publish", Mutant, inner=_FullIsAFaultHarness())
publish_trusts_a_stale_index = HoleHarness("publish-trusts-a-stale-index", Mutant, inner=_StaleFilesHarness())
quiesced_flickers = MutantHarness("quiesced-flickers", QuiescedFlickers)
quiesces_before_last_row = MutantHarness("quiesces-before-last-row", QuiescesBeforeLastRowOfBigFetch)
publish_needs_polling = MutantHarness("publish-needs-polling", PublishNeedsPolling)
big_views_need_polling = MutantHarness("big-views-need-polling", BigViewsNeedPolling)
partial_fault_as_miss = MutantHarness("partial-fault-as-miss", PartialFaultAsMiss)
shifts_group_masks = MutantHarness("shifts-group-masks", ShiftsGroupMasks)
publish_claims_declined_rows = MutantHarness("publish-claims-declined-rows", PublishClaimsDeclinedRows)
subclass_masks = MutantHarness("subclass-masks", SubclassMasks)
mask_changes_after_poll = MutantHarness("mask-changes-after-poll", MaskChangesAfterPoll)
last_byte_of_big_rows = MutantHarness("last-byte-of-big-rows", LastByteOfBigRows)
last_byte_of_odd_rows = MutantHarness("last-byte-of-odd-rows", LastByteOfOddRows)
torn_at_chunk_boundary = MutantHarness("torn-at-chunk-boundary", TornAtChunkBoundary)
hint_timeout_only_shortens = _RecordsTimeout("hint-timeout-only-shortens", HintTimeoutOnlyShortens)
deadline_cause_fault = MutantHarness("deadline-cause-fault", DeadlineCauseFault)
misses_beyond_64_rows = MutantHarness("misses-beyond-64-rows", MissesBeyond64Rows)
masks_in_group_id_order = MutantHarness("masks-in-group-id-order", MasksInGroupIdOrder)
failed_masks_cleared_later = MutantHarness("failed-masks-cleared-later", FailedMasksClearedLater)
dedupes_names_in_flight = MutantHarness("dedupes-names-in-flight", DedupesNamesInFlight)
publish_ignores_hint_timeout = MutantHarness("publish-ignores-hint-timeout", PublishIgnoresHintTimeout)
publishes_without_deadline = MutantHarness("publishes-without-deadline", PublishesWithoutDeadline)
cancel_raises_after_failure = MutantHarness("cancel-raises-after-failure", CancelRaisesAfterFailure)
cancel_raises_after_shutdown = MutantHarness("cancel-raises-after-shutdown", CancelRaisesAfterShutdown)
publish_poll_waits_for_the_store = MutantHarness("publish-poll-waits-for-the-store", PublishPollWaitsForTheStore)


publish_quiesced_waits_for_the_store = MutantHarness("publish-quiesced-waits-for-the-store",
                                                    PublishQuiescedWaitsForTheStore)
gone_peer_as_fault = MutantHarness("gone-peer-as-fault", GonePeerAsFault, inner=LoopbackHarness())
fetch_dedupes_repeated_names = MutantHarness("fetch-dedupes-repeated-names", FetchDedupesRepeatedNames)
cancel_rewrites_a_failed_outcome = MutantHarness("cancel-rewrites-a-failed-outcome", CancelRewritesAFailedOutcome)
second_cancel_forces_quiescence = MutantHarness("second-cancel-forces-quiescence", SecondCancelForcesQuiescence)
shutdown_overwrites_concluded = MutantHarness("shutdown-overwrites-concluded", ShutdownOverwritesConcluded)
cancelled_publish_fails = MutantHarness("cancelled-publish-fails", CancelledPublishFails)
cancel_rolls_back_publish = MutantHarness("cancel-rolls-back-publish", CancelRollsBackPublish)
deadline_from_start = StoreMutantHarness("deadline-from-start", DeadlineFromStart)
ignores_hint_timeout = StoreMutantHarness("ignores-hint-timeout", IgnoresHintTimeout)
deadline_without_cause = StoreMutantHarness("deadline-without-cause", DeadlineWithoutCause)
polls_once = StoreMutantHarness("polls-once", PollsOnce)
quiesces_at_conclusion = StoreMutantHarness("quiesces-at-conclusion", QuiescesAtConclusion)
quiesced_flips_back = StoreMutantHarness("quiesced-flips-back", QuiescedFlipsBack)
masks_in_slot_order = StoreMutantHarness("masks-in-slot-order", MasksInSlotOrder)
misses_beyond_thousand_rows = StoreMutantHarness("misses-beyond-1000-rows", MissesBeyondThousandRows)
publish_mask_false_for_held_rows = StoreMutantHarness("publish-mask-false-for-held", PublishMaskFalseForHeldRows)
all_miss_is_failure = StoreMutantHarness("all-miss-is-failure", AllMissIsFailure)
fault_as_miss_after_first = StoreMutantHarness("fault-as-miss-after-first", FaultAsMissAfterFirst)
cuts_large_rows = PeerMutantHarness("cuts-large-rows", CutsLargeRows)
decline_as_fault = PeerMutantHarness("decline-as-fault", DeclineAsFault)
peer_ignores_hint_timeout = PeerMutantHarness("peer-ignores-hint-timeout", PeerIgnoresHintTimeout)
answer_quiesces_before_copy = PeerMutantHarness("answer-quiesces-before-copy", AnswerQuiescesBeforeCopy)
quiesces_only_when_asked = StoreMutantHarness("quiesces-only-when-asked", QuiescesOnlyWhenAsked)
cancel_waits_for_the_call_in_progress = StoreMutantHarness("cancel-waits-for-the-call-in-progress",
                                                           CancelWaitsForTheCallInProgress)
cancel_marks_every_row = StoreMutantHarness("cancel-marks-every-row", CancelMarksEveryRow)
fails_with_a_blank_reason = StoreMutantHarness("fails-with-a-blank-reason", FailsWithABlankReason)
delivers_with_a_reason = StoreMutantHarness("delivers-with-a-reason", DeliversWithAReason)
publish_stores_other_bytes = StoreMutantHarness("publish-stores-other-bytes", PublishStoresOtherBytes)
deadline_marks_every_row = StoreMutantHarness("deadline-marks-every-row", DeadlineMarksEveryRow)
delivers_with_a_cause = StoreMutantHarness("delivers-with-a-cause", DeliversWithACause)
fails_as_holder_cancelled = StoreMutantHarness("fails-as-holder-cancelled", FailsAsHolderCancelled)
fails_without_a_cause = StoreMutantHarness("fails-without-a-cause", FailsWithoutACause)
cancelled_as_a_fault = StoreMutantHarness("cancelled-as-a-fault", CancelledAsAFault)
fault_cause_deadline = StoreMutantHarness("fault-cause-deadline", FaultCauseDeadline)


# -- issue 36, second batch: single-clause subclasses of the reference store ----------------------

class _ProgressPoll(ReferenceAttempt):
    def poll(self) -> Outcome | None:
        with self.runner.lock:
            if self.outcome is None:
                # "No failure so far": the rows moved up to now, handed over as a delivery.
                return Outcome.delivered(self.masks_locked())
            return self.outcome


class PollReportsProgress(_AttemptsOf):
    """A1: poll() of an attempt in flight answers a DELIVERED outcome of the rows moved so far,
    instead of ``None`` until the attempt concludes."""

    attempt_class = _ProgressPoll


class _ForgetsOnceSettled(ReferenceAttempt):
    seen = False

    def poll(self) -> Outcome | None:
        with self.runner.lock:
            if self.outcome is not None and self.settled:
                if self.seen:
                    return None  # dropped from the table once handed over and settled
                self.seen = True
            return self.outcome


class ForgetsASeenOutcome(_AttemptsOf):
    """A1: an attempt that has concluded and quiesced forgets its outcome once poll() has
    answered it: a later poll() answers ``None`` again."""

    attempt_class = _ForgetsOnceSettled


class _ClearingRegistration(TableRegistration):
    """Closing the registration also resets the delivery masks the backend keeps for the rows in
    it: the attempts whose rows lay there answer a new outcome, every bit false."""

    backend: ClosedRegistrationClearsMasks

    def close(self) -> None:
        super().close()
        spans = [(r.base, r.base + r.slot_bytes * r.slot_count) for r in self.regions]
        for attempt in self.backend.made:
            out = attempt.outcome
            if out is None or not any(any(lo <= g.region.base < hi for lo, hi in spans) for g in attempt.view.groups):
                continue
            # A new outcome with the masks reset; the one handed over earlier stays as it was.
            with attempt.runner.lock:
                attempt.outcome = _outcome_like(out, [np.zeros(mask.size, dtype=bool) for mask in out.masks])


class ClosedRegistrationClearsMasks(ReferenceStoreBackend):
    """A1: closing a registration clears the masks of the outcomes of attempts whose rows lay in
    it, outcomes the holder has already read."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self.made: list[ReferenceAttempt] = []

    def register_regions(self, regions: Sequence[SlotRegion]) -> TableRegistration:
        registration = super().register_regions(regions)
        registration.__class__ = _ClearingRegistration
        registration.backend = self  # type: ignore[attr-defined]
        return registration

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        self.made.append(attempt)
        return attempt


class _CancelEndsAccess(ReferenceAttempt):
    def cancel(self) -> None:
        with self.runner.lock:
            self.conclude_locked(OutcomeStatus.CANCELLED, Cause.HOLDER_CANCELLED, "cancelled by the holder")
            if self.access is Access.TOUCHING:
                # Treats the cancel as the end of access, though the store call in progress will
                # still write the rows when it returns.
                self.access = Access.ENDED
                self.runner.changed_locked(self)


class CancelEndsAccessAtOnce(_AttemptsOf):
    """A4: a cancelled fetch says quiesced() at once, while its store call is still in progress
    and will write the rows when it returns."""

    attempt_class = _CancelEndsAccess


class _FailureByThePeer(_OutcomeRewritten):
    def rewrite(self, outcome: Outcome) -> dict[str, Any]:
        return {"by_peer": True} if outcome.is_failed and outcome.cause is Cause.FAULT else {}


class FailureByThePeer(_AttemptsOf):
    """A5: an attempt the store failed with an error says ``by_peer`` (the other end ended it)."""

    attempt_class = _FailureByThePeer


class FaultedRowsMarkedMoved(ReferenceStoreBackend):
    """A5: in a fetch the store failed, the rows that faulted are marked true (a fetch's bits
    are "every row not missing"), though their bytes never came; the attempt still fails."""

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        fault: str | None = None
        groups = attempt.view.groups
        for call in work.calls:
            with self._runner.lock:
                if not attempt.touch_locked():
                    return
            held: np.ndarray | None = None
            sizes = [groups[gi].region.slot_bytes for gi in call.groups]
            try:
                if attempt.op == "publish":
                    rows = np.concatenate([read_rows(work.located[gi], size)
                                           for gi, size in zip(call.groups, sizes, strict=True)], axis=1)
                    reply = self._store.put(work.namespace, call.space, call.names, rows)
                    held = reply.status == RowStatus.HELD
                else:
                    reply = self._store.get(work.namespace, call.space, call.names, sum(sizes))
                    held = reply.status != RowStatus.MISSING  # the bug: a failed row counts as moved
                    assert reply.data is not None
                    found, start = np.flatnonzero(reply.status == RowStatus.HELD), 0
                    for gi, size in zip(call.groups, sizes, strict=True):
                        write_rows(work.located[gi], size, found, reply.data[found, start:start + size])
                        start += size
                if (reply.status == RowStatus.FAILED).any() and fault is None:
                    fault = f"the store failed rows of group {groups[call.groups[0]].group_id}: {reply.reason}"
            except Exception as exc:
                held = None
                fault = fault or f"the store call raised {type(exc).__name__}: {exc}"
            with self._runner.lock:
                if held is not None and attempt.outcome is None:
                    for gi in call.groups:
                        attempt.moved[gi][:] = held
                attempt.untouch_locked()
        with self._runner.lock:
            if fault is None:
                attempt.conclude_locked(OutcomeStatus.DELIVERED)
            else:
                attempt.conclude_locked(OutcomeStatus.FAILED, Cause.FAULT, fault)


class _ExpiresBetweenCalls(ReferenceAttempt):
    late = False

    def expire_locked(self) -> None:
        if self.access is Access.TOUCHING:
            self.late = True  # the deadline is looked at again when the store call returns
            return
        super().expire_locked()

    def untouch_locked(self) -> None:
        if self.late:
            super().expire_locked()
        super().untouch_locked()


class DeadlineAfterTheCallReturns(_AttemptsOf):
    """A8: a deadline that passes while a store call is in progress concludes the attempt only
    once that call returns: a store that holds the call holds the conclusion."""

    attempt_class = _ExpiresBetweenCalls


class _ExpiresOnceStarted(ReferenceAttempt):
    started = False
    late = False

    def touch_locked(self) -> bool:
        self.started = True
        if self.late:
            super().expire_locked()
        return super().touch_locked()

    def expire_locked(self) -> None:
        if not self.started:
            self.late = True  # the worker looks at the deadline when it starts the attempt
            return
        super().expire_locked()


class QueuedAttemptsExpireWhenStarted(_AttemptsOf):
    """A8: the clock concludes only attempts a worker has started; one waiting in the queue
    whose deadline passed concludes when the worker reaches it."""

    attempt_class = _ExpiresOnceStarted


#: How long an attempt failed by its deadline keeps its access after its store call returned.
RETRY_BACKOFF_S = 6.0


class _BacksOffAfterDeadline(ReferenceAttempt):
    def untouch_locked(self) -> None:
        if self.access is Access.TOUCHING and self.outcome is not None and self.outcome.cause is Cause.DEADLINE:
            # Keeps the rows through a retry back-off before it lets go.
            def let_go() -> None:
                with self.runner.lock:
                    ReferenceAttempt.untouch_locked(self)

            timer = threading.Timer(RETRY_BACKOFF_S, let_go)
            timer.daemon = True
            timer.start()
            return
        super().untouch_locked()


class DeadlineKeepsAccess(_AttemptsOf):
    """A8: an attempt failed by its deadline keeps its access for a retry back-off of 6 s after
    its store call returned, well past the documented grace of 2 s."""

    attempt_class = _BacksOffAfterDeadline


class _CancelAsShutdown(ReferenceAttempt):
    def cancel(self) -> None:
        with self.runner.lock:
            self.conclude_locked(OutcomeStatus.CANCELLED, Cause.SHUTDOWN, "cancelled")


class CancelCauseShutdown(_AttemptsOf):
    """A10: an attempt the holder's cancel() concluded carries cause SHUTDOWN (one cancel path
    for both)."""

    attempt_class = _CancelAsShutdown


class ShutdownAsHolderCancel(ReferenceStoreBackend):
    """A10: shutdown() ends each attempt in flight by calling its cancel(): cause
    HOLDER_CANCELLED instead of SHUTDOWN."""

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        runner = self._runner
        with runner.lock:
            live = list(runner.live)
        for attempt in live:
            attempt.cancel()
        return super().shutdown()


class MissIsAFault(ReferenceStoreBackend):
    """A5: a fetch's get treats every row not HELD as failed: a fetch with misses concludes
    FAILED (cause FAULT), its bits right."""

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        store = self._store

        class Strict:
            def put(self, *args: Any) -> StoreReply:
                return store.put(*args)

            def get(self, *args: Any) -> StoreReply:
                reply = store.get(*args)
                status = reply.status.copy()
                status[status == RowStatus.MISSING] = RowStatus.FAILED
                return StoreReply(status, reply.data, reply.reason or "object not found")

            def contains(self, *args: Any) -> StoreReply:
                return store.contains(*args)

        self._store = Strict()  # type: ignore[assignment]
        try:
            super()._move(attempt, work)
        finally:
            self._store = store


poll_reports_progress = StoreMutantHarness("poll-reports-progress", PollReportsProgress)
forgets_a_seen_outcome = StoreMutantHarness("forgets-a-seen-outcome", ForgetsASeenOutcome)
closed_registration_clears_masks = StoreMutantHarness("closed-registration-clears-masks",
                                                      ClosedRegistrationClearsMasks)
cancel_ends_access_at_once = StoreMutantHarness("cancel-ends-access-at-once", CancelEndsAccessAtOnce)
failure_by_the_peer = StoreMutantHarness("failure-by-the-peer", FailureByThePeer)
faulted_rows_marked_moved = StoreMutantHarness("faulted-rows-marked-moved", FaultedRowsMarkedMoved)
deadline_after_the_call_returns = StoreMutantHarness("deadline-after-the-call-returns", DeadlineAfterTheCallReturns)
queued_attempts_expire_when_started = StoreMutantHarness("queued-attempts-expire-when-started",
                                                         QueuedAttemptsExpireWhenStarted)
deadline_keeps_access = StoreMutantHarness("deadline-keeps-access", DeadlineKeepsAccess)
cancel_cause_shutdown = StoreMutantHarness("cancel-cause-shutdown", CancelCauseShutdown)
shutdown_as_holder_cancel = StoreMutantHarness("shutdown-as-holder-cancel", ShutdownAsHolderCancel)
miss_is_a_fault = StoreMutantHarness("miss-is-a-fault", MissIsAFault)


class _FailedKeepsTheRows(ReferenceAttempt):
    stuck = False

    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if status is OutcomeStatus.FAILED and cause is Cause.FAULT and self.access is not Access.ENDED:
            self.stuck = True  # the error path never releases the rows it had taken
            self.access = Access.TOUCHING
        return super().conclude_locked(status, cause, reason, by_peer=by_peer)

    def untouch_locked(self) -> None:
        if not self.stuck:
            super().untouch_locked()


class FailedFetchNeverQuiesces(_AttemptsOf):
    """A2: an attempt the store failed keeps its access until shutdown() releases it: it
    concludes FAILED and does not quiesce on its own."""

    attempt_class = _FailedKeepsTheRows

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        with self._runner.lock:
            for attempt in list(self._runner.live):
                if isinstance(attempt, _FailedKeepsTheRows) and attempt.stuck:
                    attempt.stuck = False
                    attempt.untouch_locked()
        return super().shutdown()


class RaisingGetMarksItsRows(ReferenceStoreBackend):
    """A5: a get that raises marks the rows it was asked for moved (the client was handed the
    rows' buffer before it raised), though no byte of them arrived; the fetch still fails."""

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        store, runner = self._store, self._runner

        class Marking:
            def put(self, *args: Any) -> StoreReply:
                return store.put(*args)

            def get(self, namespace: str, space: Any, names: np.ndarray, row_bytes: int) -> StoreReply:
                try:
                    return store.get(namespace, space, names, row_bytes)
                except Exception:
                    with runner.lock:
                        for gi, group in enumerate(attempt.view.groups):
                            if group.names is names:
                                attempt.moved[gi][:] = True
                    raise

            def contains(self, *args: Any) -> StoreReply:
                return store.contains(*args)

        self._store = Marking()  # type: ignore[assignment]
        try:
            super()._move(attempt, work)
        finally:
            self._store = store


class CoalescesSlotsInOrder(ReferenceStoreBackend):
    """A9: a fetch coalesces its rows into runs of ascending slots and writes the objects, taken
    in the view's row order, into the slots in ascending order: a group whose rows are not in
    slot order gets each object in another row, its bit on the row it was asked for."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        work = super()._check(op, view, hint, wake)
        if op != "fetch":
            return work
        located = tuple(dataclasses.replace(at, offsets=np.sort(at.offsets)) for at in work.located)
        return dataclasses.replace(work, located=located)


failed_fetch_never_quiesces = StoreMutantHarness("failed-fetch-never-quiesces", FailedFetchNeverQuiesces)
raising_get_marks_its_rows = StoreMutantHarness("raising-get-marks-its-rows", RaisingGetMarksItsRows)
coalesces_slots_in_order = StoreMutantHarness("coalesces-slots-in-order", CoalescesSlotsInOrder)


#: Where :class:`OneRowViewsKeptApart` keeps the objects of one-row views: their group id plus this.
SMALL_OBJECTS = 1 << 40


class OneRowViewsKeptApart(ReferenceStoreBackend):
    """A9: a view with one row in every group takes a fast path whose objects live in a table of
    their own (their space is the group id plus 2**40): one-row publishes are found only by
    one-row fetches, and the rows of larger views only by larger ones, so the same rows give
    other bits split into one-row views than whole."""

    @staticmethod
    def _calls(view: View, layout: str | None) -> tuple[Any, ...]:
        calls = ReferenceStoreBackend._calls(view, layout)
        if layout is None and view.groups and all(g.rows == 1 for g in view.groups):
            calls = tuple(dataclasses.replace(call, space=int(call.space) + SMALL_OBJECTS) for call in calls)
        return calls


one_row_views_kept_apart = StoreMutantHarness("one-row-views-kept-apart", OneRowViewsKeptApart)


class _ReadsInTwoHalves:
    """A store end whose get reads each row in two ranged reads (the first half of every row's
    bytes, then the second half, one call each), and answers the status of the first read: a
    row the store lost between the reads comes back torn and HELD."""

    def __init__(self, end: Any) -> None:
        self.end = end

    def put(self, *args: Any) -> StoreReply:
        return self.end.put(*args)

    def get(self, namespace: str, space: Any, names: np.ndarray, row_bytes: int) -> StoreReply:
        first = self.end.get(namespace, space, names, row_bytes)
        if row_bytes < 2:
            return first
        second = self.end.get(namespace, space, names, row_bytes)
        assert first.data is not None and second.data is not None
        half = row_bytes // 2
        data = np.concatenate([first.data[:, :half], second.data[:, half:]], axis=1)
        return StoreReply(first.status, data, first.reason or second.reason)

    def contains(self, *args: Any) -> StoreReply:
        return self.end.contains(*args)


class ReadsRowsInTwoHalves(ReferenceStoreBackend):
    """A7: a fetch reads each row in two halves, with a store call each, and keeps the bit of
    the first: a row the store lost between the two reads arrives in part, marked true."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(_ReadsInTwoHalves(store), **options)


reads_rows_in_two_halves = StoreMutantHarness("reads-rows-in-two-halves", ReadsRowsInTwoHalves)


class _LandsWhenAsked(ReferenceAttempt):
    """A fetch whose store reads keep the bytes aside (``pending``) and write them into the lent
    rows only inside the holder's next call of poll() or quiesced(), before that call answers."""

    pending: list[tuple[Any, int, np.ndarray, np.ndarray]]

    def land(self) -> None:
        with self.runner.lock:
            pending, self.pending = self.__dict__.get("pending", []), []
            for located, size, rows, data in pending:
                write_rows(located, size, rows, data)

    def poll(self) -> Outcome | None:
        self.land()
        return super().poll()

    def quiesced(self) -> bool:
        self.land()
        return super().quiesced()


class LandsFetchedBytesWhenAsked(_AttemptsOf):
    """A3.3: a fetch concludes, quiesces and wakes on its own, but the bytes its store reads
    returned reach the lent rows only inside the holder's next poll() or quiesced(): a holder
    that only waits for the wake has no bytes in its rows. (To a holder that reads its rows only
    once quiesced() is true, as S2.3 asks, nothing differs.)"""

    attempt_class = _LandsWhenAsked

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        """The reference ``_move``, with a fetch's writes kept aside on the attempt."""
        if attempt.op != "fetch":
            super()._move(attempt, work)
            return
        fault: str | None = None
        groups = attempt.view.groups
        for call in work.calls:
            with self._runner.lock:
                if not attempt.touch_locked():
                    return
            held: np.ndarray | None = None
            sizes = [groups[gi].region.slot_bytes for gi in call.groups]
            try:
                reply = self._store.get(work.namespace, call.space, call.names, sum(sizes))
                held = reply.status == RowStatus.HELD
                assert reply.data is not None
                found, start = np.flatnonzero(held), 0
                with self._runner.lock:
                    pending = attempt.__dict__.setdefault("pending", [])
                    for gi, size in zip(call.groups, sizes, strict=True):
                        pending.append((work.located[gi], size, found, reply.data[found, start:start + size].copy()))
                        start += size
                failed = reply.status == RowStatus.FAILED
                if failed.any() and fault is None:
                    fault = f"the store failed a row of group space {call.space!r}: {reply.reason or 'no reason'}"
            except Exception as exc:
                held = None
                fault = fault or f"a store call raised {type(exc).__name__}: {exc}"
            with self._runner.lock:
                if held is not None and attempt.outcome is None:
                    for gi in call.groups:
                        attempt.moved[gi][:] = held
                attempt.untouch_locked()
        with self._runner.lock:
            if fault is None:
                attempt.conclude_locked(OutcomeStatus.DELIVERED)
            else:
                attempt.conclude_locked(OutcomeStatus.FAILED, Cause.FAULT, fault)


lands_fetched_bytes_when_asked = StoreMutantHarness("lands-fetched-bytes-when-asked", LandsFetchedBytesWhenAsked)
