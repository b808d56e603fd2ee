"""Deliberately broken backends: each wraps a correct one (the memory backend, or for the
serving protocol the loopback peer of ``loopback_peer.py``) and breaks exactly one rule.

Every module-level :class:`MutantHarness` here is a harness the suite can be pointed at with
``--kvwire-harness tests/conformance/mutants.py:NAME``; ``test_mutants.py`` checks that the suite
fails each one on the rule it breaks, and passes :data:`faithful` and :data:`faithful_peer`, the
wrappers that break nothing.

Why one file of this size: the suite is pointed at each mutant by ``path:object``, and each
mutant is a short subclass beside the wrapper whose one rule it breaks."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kvwire_memory.harness import MemoryHarness
from loopback_peer import LoopbackHarness  # beside this file; on sys.path when loaded as a harness

from kvwire.contract import (
    Attempt,
    Backend,
    Capabilities,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Outcome,
    SlotRegion,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.contract.lookup import LOOKUP, Lookup
from kvwire.contract.outcome import OutcomeStatus
from kvwire.contract.serving import OffersPulls, PullRequest, ServesPulls
from kvwire.testing.harness import Ends, FaultPlan, Harness

# -- the wrappers ------------------------------------------------------------------------------

class Wrapped(Attempt):
    """An attempt that forwards everything to the correct one."""

    def __init__(self, inner: Attempt, view: View, op: str, backend: Mutant) -> None:
        self.inner = inner
        self.view = view
        self.op = op
        self.backend = backend

    def poll(self) -> Outcome | None:
        return self.inner.poll()

    def quiesced(self) -> bool:
        return self.inner.quiesced()

    def cancel(self) -> None:
        self.inner.cancel()


class Mutant(Backend, Lookup):
    """A backend that forwards everything to a correct one; subclasses break one rule. It
    offers ``lookup`` (L1) by forwarding it, used only where the inner backend declares it."""

    attempt_type: type[Wrapped] = Wrapped

    def __init__(self, inner: Backend, harness: MutantHarness) -> None:
        self.inner = inner
        self.harness = harness

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        return self.inner.register_regions(regions)

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self.submit("fetch", view, hint, wake)

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self.submit("publish", view, hint, wake)

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        if not isinstance(self.inner, Lookup) or LOOKUP not in self.inner.capabilities().protocols:
            raise InvalidSubmission("this backend does not declare the lookup protocol")  # B4.7
        return self.inner.lookup(groups, names, hint, timeout_s)

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self.remember(self.make(op, view, hint, wake))

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        return self.attempt_type(call(view, hint, wake), view, op, self)

    def shutdown(self) -> frozenset[Attempt]:
        pending = self.inner.shutdown()
        wrapped = {id(a.inner): a for a in self._attempts()}
        return frozenset(wrapped.get(id(a), a) for a in pending)

    def close(self) -> None:
        self.inner.close()

    # Attempts are remembered so shutdown() can answer with the wrapped ones.
    def _attempts(self) -> list[Wrapped]:
        return self.__dict__.setdefault("_made", [])

    def remember(self, attempt: Wrapped) -> Wrapped:
        self._attempts().append(attempt)
        return attempt


class MutantHarness(Harness):
    """A correct backend's harness (the memory backend's unless ``inner`` is given), with every
    end wrapped in ``mutant``."""

    def __init__(self, name: str, mutant: type[Mutant], *, inner_timeout_s: float | None = None,
                 setup: Callable[[], Callable[[], None]] | None = None, inner: Harness | None = None) -> None:
        self.name = name
        self.mutant = mutant
        self.inner = inner if inner is not None else MemoryHarness()
        self.quiesce_grace_s = self.inner.quiesce_grace_s
        self.lookup_faults = self.inner.lookup_faults
        self.inner_timeout_s = inner_timeout_s
        self.setup = setup

    def capabilities(self) -> Capabilities:
        return self.mutant.declare(self.inner.capabilities())  # type: ignore[attr-defined]

    def distribution(self) -> str:
        return "tests/conformance/mutants.py (a deliberately broken backend)"

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        undo = self.setup() if self.setup is not None else None
        inner = self.inner.open(timeout_s=self.inner_timeout_s or timeout_s, max_in_flight=max_in_flight,
                                faults=faults, hold=hold)
        source = self.mutant(inner.source, self)
        sink = self.mutant(inner.sink, self)
        extra: dict[str, Any] = {"inner": inner, "undo": undo}
        if "namespace" in inner.extra:  # the store namespace the suite reads (H1.7)
            extra["namespace"] = inner.extra["namespace"]
        return Ends(source, sink, inner.publish_hint, inner.fetch_hint, inner.hold, extra=extra)

    def close(self, ends: Ends) -> None:
        try:
            self.inner.close(ends.extra["inner"])  # type: ignore[arg-type]
        finally:
            undo = ends.extra.get("undo")
            if callable(undo):
                undo()


def _declare_as_is(caps: Capabilities) -> Capabilities:
    return caps


Mutant.declare = staticmethod(_declare_as_is)  # type: ignore[attr-defined]


def _outcome_like(out: Outcome, masks: Sequence[np.ndarray]) -> Outcome:
    return Outcome(out.status, tuple(masks), out.reason, out.by_peer, out.cause)


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


# -- the broken ones -----------------------------------------------------------------------------

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


class _EarlyWake(Wrapped):
    DELAY_S = 0.3

    def visible(self) -> bool:
        changed = self.__dict__.get("changed_at")
        return changed is not None and time.monotonic() - changed >= self.DELAY_S

    def poll(self) -> Outcome | None:
        return self.inner.poll() if self.visible() else None

    def quiesced(self) -> bool:
        return self.inner.quiesced() if self.visible() else False


class WakesEarly(Mutant):
    """W1: calls wake() as soon as a change happens, but shows the change only 0.3 s later."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        holder: list[_EarlyWake] = []

        def early() -> None:
            holder[0].changed_at = time.monotonic()  # type: ignore[attr-defined]
            wake()

        call = self.inner.fetch if op == "fetch" else self.inner.publish
        attempt = _EarlyWake.__new__(_EarlyWake)
        holder.append(attempt)
        Wrapped.__init__(attempt, call(view, hint, early), view, op, self)
        return attempt


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


class AcceptsAfterShutdown(Mutant):
    """B3: shutdown() says done but keeps taking submissions."""

    def shutdown(self) -> frozenset[Attempt]:
        return frozenset()


class EscapesOnRejection(Mutant):
    """S3: when its queue of two is full it rejects the submission only after passing it on."""

    BOUND = 2

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:  # type: ignore[override]
        return dataclasses.replace(caps, max_in_flight=EscapesOnRejection.BOUND)

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        live = [a for a in self._attempts() if not (a.inner.poll() is not None and a.inner.quiesced())]
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        if len(live) >= self.BOUND:
            call(view, hint, wake)
            raise SubmissionRejected(f"queue full ({self.BOUND} in flight)")
        return self.remember(Wrapped(call(view, hint, wake), view, op, self))


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


_everyone: list[Mutant] = []


class SharesShutdown(Mutant):
    """B1: one instance's shutdown() shuts every instance down."""

    def __init__(self, inner: Backend, harness: MutantHarness) -> None:
        super().__init__(inner, harness)
        _everyone.append(self)

    def shutdown(self) -> frozenset[Attempt]:
        pending: set[Attempt] = set()
        for mutant in list(_everyone):
            pending |= mutant.inner.shutdown()
        return frozenset(pending)


class AcceptsAnyHint(Mutant):
    """H1: takes a hint of any kind as if it were its own."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if hint.kind != "store":
            hint = Hint.of("store", namespace="conformance")
        return super().make(op, view, hint, wake)


class _RaisesFault(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and out.is_failed:
            raise RuntimeError(out.reason)
        return out


class RaisesFaults(Mutant):
    """S5: a failure escapes poll() as an exception instead of arriving in the outcome."""

    attempt_type = _RaisesFault


class RaisesPlainErrors(Mutant):
    """S4: refuses wrong submissions with ValueError instead of InvalidSubmission."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        try:
            return super().make(op, view, hint, wake)
        except InvalidSubmission as exc:
            raise ValueError(str(exc)) from None


class _Padded(Wrapped):
    """Answers the inner outcome of a shortened view with masks of the full view (the rows left
    out are false bits)."""

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        masks = list(self.view.row_masks())
        for mask, got in zip(masks, out.masks, strict=True):
            mask[: got.size] = got
        return _outcome_like(out, masks)


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


class ChangesTheView(Mutant):
    """V2: reorders a view's slots in place after it is submitted."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        attempt = super().make(op, view, hint, wake)
        for group in view.groups:
            group.slots.setflags(write=True)
            group.slots[:] = group.slots[::-1].copy()
        return attempt


class DriftingCapabilities(Mutant):
    """B4: capabilities() answers differently on every call."""

    def capabilities(self) -> Capabilities:
        count = self.__dict__["asked"] = self.__dict__.get("asked", 0) + 1
        caps = self.inner.capabilities()
        return dataclasses.replace(caps, max_in_flight=caps.max_in_flight + count)


class _ThreadBound(Wrapped):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.owner = threading.current_thread()  # thread idents are reused; thread objects are not

    def poll(self) -> Outcome | None:
        return self.inner.poll() if threading.current_thread() is self.owner else None

    def quiesced(self) -> bool:
        return self.inner.quiesced() if threading.current_thread() is self.owner else False


class ThreadBoundAttempts(Mutant):
    """B2: an attempt answers only the thread that submitted it."""

    attempt_type = _ThreadBound


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


class _DoesNotWakeOnCancel(Wrapped):
    def cancel(self) -> None:
        self.inner.cancel()
        self.__dict__["cancelled_at"] = time.monotonic()

    def poll(self) -> Outcome | None:
        # The cancelled outcome shows only after a delay, and nothing wakes the holder then.
        at = self.__dict__.get("cancelled_at")
        if at is not None and time.monotonic() - at < 0.3:
            return None
        return self.inner.poll()


class SilentCancel(Mutant):
    """W1/A4: a cancelled outcome becomes visible later, with no wake after it."""

    attempt_type = _DoesNotWakeOnCancel


class AcceptsUndeclaredMemory(Mutant):
    """M1: registers a region of a kind it does not declare by leaving it out quietly."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        kinds = self.inner.capabilities().memory_kinds
        return self.inner.register_regions([r for r in regions if r.memory_kind in kinds])


class PublishesNowhere(Mutant):
    """S1: a publish reports every row held but offers them to another namespace."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op == "publish" and hint.kind == "store":
            hint = Hint.of("store", namespace="nowhere")
        return super().make(op, view, hint, wake)


class _Scrubs(Wrapped):
    scrubbed = False

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "publish" and not self.scrubbed and self.inner.quiesced():
            self.scrubbed = True
            for group in self.view.groups:
                for address in group.addresses().tolist():
                    ctypes.memset(int(address), 0, group.region.slot_bytes)
        return out


class ScrubsPublishedRows(Mutant):
    """S2: zeroes the rows it published once done with them (it may only read them)."""

    attempt_type = _Scrubs


class _Reversed(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None or len(out.masks) < 2:
            return out
        return _outcome_like(out, out.masks[::-1])


class ReversesGroups(Mutant):
    """V1: hands the masks back in reverse group order."""

    attempt_type = _Reversed


class PeerMutant(Mutant, ServesPulls, OffersPulls):
    """A serving peer that forwards everything, the serving protocol and standing offers (O1)
    included."""

    @property
    def serving(self) -> ServesPulls:
        assert isinstance(self.inner, ServesPulls)
        return self.inner

    def address(self) -> bytes:
        return self.serving.address()

    def serve(self, wake: WakeFn) -> None:
        self.serving.serve(wake)

    def incoming(self) -> tuple[PullRequest, ...]:
        return self.serving.incoming()

    def decline(self, request: PullRequest, reason: str) -> None:
        self.serving.decline(request, reason)

    def offer(self, view: View, wake: WakeFn, timeout_s: float | None = None) -> Attempt:
        if not isinstance(self.inner, OffersPulls):
            raise InvalidSubmission("this backend does not declare the offer-pulls protocol")  # B4.7
        return self.remember(self.attempt_type(self.inner.offer(view, wake, timeout_s), view, "offer", self))


class _PartialFails(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "fetch" and out.is_delivered and not all(m.all() for m in out.masks):
            return Outcome.failed("the peer served only part of the blocks", out.masks)
        return out


class PartialPrefixFails(PeerMutant):
    """N2: a pull answered with a partial prefix fails instead of delivering that prefix."""

    attempt_type = _PartialFails


class ServesWithoutWake(PeerMutant):
    """N2/W1: new pull requests show in incoming() but never wake the serving holder."""

    def serve(self, wake: WakeFn) -> None:
        self.serving.serve(lambda: None)


class _DeclineDelivers(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "fetch" and out.is_failed and "declines" in (out.reason or ""):
            return Outcome.delivered(out.masks)
        return out


class DeclineDelivers(PeerMutant):
    """N2: a declined pull passes for a delivered one that missed every block."""

    attempt_type = _DeclineDelivers


# -- the harnesses the suite is pointed at --------------------------------------------------------

faithful = MutantHarness("faithful-wrapper", Mutant)
skips_unrecognized_rows = MutantHarness("skips-unrecognized-rows", SkipsUnrecognizedRows)
marks_torn_rows = MutantHarness("marks-torn-rows", MarksTornRows)
miss_as_failure = MutantHarness("miss-as-failure", MissAsFailure)
fault_as_miss = MutantHarness("fault-as-miss", FaultAsMiss)
blocks_in_poll = MutantHarness("blocks-in-poll", BlocksInPoll)
wakes_early = MutantHarness("wakes-early", WakesEarly)
needs_polling = MutantHarness("needs-polling", NeedsPolling)
mutates_mask_after_handover = MutantHarness("mutates-mask-after-handover", MutatesMaskAfterHandover)
quiesces_early = MutantHarness("quiesces-early", QuiescesEarly)
accepts_after_shutdown = MutantHarness("accepts-after-shutdown", AcceptsAfterShutdown)
# the escaped publish must outlive the hold, or it expires unseen in the queue
escapes_on_rejection = MutantHarness("escapes-on-rejection", EscapesOnRejection, inner_timeout_s=120.0)
keeps_non_bool_mask = MutantHarness("keeps-non-bool-mask", KeepsNonBoolMask)
unstable_outcome = MutantHarness("unstable-outcome", UnstableOutcome)
ignores_deadline = MutantHarness("ignores-deadline", IgnoresDeadline, inner_timeout_s=3600.0)
ignores_cancel = MutantHarness("ignores-cancel", IgnoresCancel)
registers_part_of_a_batch = MutantHarness("registers-part-of-a-batch", RegistersPartOfABatch)
drops_overlapping_fetch_rows = MutantHarness("drops-overlapping-fetch-rows", DropsOverlappingFetchRows)
shares_shutdown = MutantHarness("shares-shutdown", SharesShutdown)
accepts_any_hint = MutantHarness("accepts-any-hint", AcceptsAnyHint)
raises_faults = MutantHarness("raises-faults", RaisesFaults)
raises_plain_errors = MutantHarness("raises-plain-errors", RaisesPlainErrors)
limits_batches = MutantHarness("limits-batches", LimitsBatches)
writes_past_the_slot = MutantHarness("writes-past-the-slot", WritesPastTheSlot)
changes_the_view = MutantHarness("changes-the-view", ChangesTheView)
drifting_capabilities = MutantHarness("drifting-capabilities", DriftingCapabilities)
thread_bound_attempts = MutantHarness("thread-bound-attempts", ThreadBoundAttempts)
shared_row_masks = MutantHarness("shared-row-masks", Mutant, setup=_cached_row_masks)
silent_cancel = MutantHarness("silent-cancel", SilentCancel)
accepts_undeclared_memory = MutantHarness("accepts-undeclared-memory", AcceptsUndeclaredMemory)
publishes_nowhere = MutantHarness("publishes-nowhere", PublishesNowhere)
scrubs_published_rows = MutantHarness("scrubs-published-rows", ScrubsPublishedRows)
reverses_groups = MutantHarness("reverses-groups", ReversesGroups)

faithful_peer = MutantHarness("faithful-peer-wrapper", PeerMutant, inner=LoopbackHarness())
partial_prefix_fails = MutantHarness("partial-prefix-fails", PartialPrefixFails, inner=LoopbackHarness())
serves_without_wake = MutantHarness("serves-without-wake", ServesWithoutWake, inner=LoopbackHarness())
decline_delivers = MutantHarness("decline-delivers", DeclineDelivers, inner=LoopbackHarness())
