"""Mutants of queue capacity, registration edges, deadlines, refusal messages and outcome fields:
each wraps the memory backend (through :mod:`mutants`) and breaks one clause that the suite
once let through (S3.3, S3.9, S3.10, S3.11, M3.4/M3.5, M3.6, A8.2, A5.2, A10.2).

``test_mutants.py`` reads its entries in ``mutant_table.py`` (without importing this file) and runs the suite's
tests of each rule against each harness here: each must fail on a test named after the rule.
:data:`faithful` keeps a queue bound in the wrapper correctly (the control for the bound
mutants); it is not in ``mutant_table.py``, and the suite must pass it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mutants import Mutant, MutantHarness, Wrapped  # beside this file; on sys.path when loaded as a harness

from kvwire.contract import (
    Attempt,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    Outcome,
    SlotRegion,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.contract.errors import SubmissionError
from kvwire.testing.harness import Ends, FaultPlan

# -- S3.9-S3.11: a queue bound kept by the wrapper --------------------------------------------------

class _Bounded(Mutant):
    """Keeps a queue bound of its own, :attr:`BOUND`, over an inner backend whose queue is wider
    (see :class:`_WideInner`), so the wrapper's accounting is what the suite tests."""

    BOUND = 3

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:  # type: ignore[override]
        return dataclasses.replace(caps, max_in_flight=_Bounded.BOUND)

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())

    def live(self, attempt: Wrapped) -> bool:
        """Whether ``attempt`` holds a queue slot: it has not both concluded and quiesced (S3.9)."""
        return not (attempt.inner.poll() is not None and attempt.inner.quiesced())

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if sum(1 for a in self._attempts() if self.live(a)) >= self.BOUND:
            raise SubmissionRejected(f"queue full ({self.BOUND} in flight); submit again once one has concluded "
                                     "and quiesced")
        return super().submit(op, view, hint, wake)


class _WideInner(MutantHarness):
    """The inner memory backend gets its default queue (64), whatever bound the suite asks for:
    with the inner held to the same bound, the inner's correct accounting would hide the
    wrapper's."""

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        return super().open(timeout_s=timeout_s, max_in_flight=None, faults=faults, hold=hold)


class FaithfulBounded(_Bounded):
    """Control: the wrapper's own bound, kept correctly."""


class SlotFreedAtConclusion(_Bounded):
    """S3.9: a slot is free once the attempt concluded, though it has not quiesced (a cancelled
    fetch the store still writes)."""

    def live(self, attempt: Wrapped) -> bool:
        return attempt.inner.poll() is None


class _AskedQuiesced(Wrapped):
    seen_quiesced = False

    def quiesced(self) -> bool:
        q = self.inner.quiesced()
        if q:
            self.seen_quiesced = True
        return q


class SlotFreedOnlyWhenAsked(_Bounded):
    """S3.11: a slot frees only once the holder itself asked ``quiesced()`` and heard True."""

    attempt_type = _AskedQuiesced

    def live(self, attempt: Wrapped) -> bool:
        return not (attempt.inner.poll() is not None and attempt.seen_quiesced)  # type: ignore[attr-defined]


class DeclaresHugeBound(Mutant):
    """S3.10: declares a queue bound of 1000; the queue underneath holds what the options asked
    (or its default of 64), so submissions below the declared bound are rejected."""

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:  # type: ignore[override]
        return dataclasses.replace(caps, max_in_flight=1000)

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())


# -- S3.3: refusals without a message ------------------------------------------------------------

class SilentRefusals(Mutant):
    """S3.3: every refusal of a submission carries an empty message."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        try:
            return super().submit(op, view, hint, wake)
        except SubmissionError as exc:
            raise type(exc)() from None


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


# -- the harnesses the suite is pointed at --------------------------------------------------------

faithful = _WideInner("faithful-bounded-wrapper", FaithfulBounded)
slot_freed_at_conclusion = _WideInner("slot-freed-at-conclusion", SlotFreedAtConclusion)
slot_freed_only_when_asked = _WideInner("slot-freed-only-when-asked", SlotFreedOnlyWhenAsked)
declares_huge_bound = MutantHarness("declares-huge-bound", DeclaresHugeBound)
silent_refusals = MutantHarness("silent-refusals", SilentRefusals)
refuses_adjacent_regions = MutantHarness("refuses-adjacent-regions", RefusesAdjacentRegions)
refused_batch_revokes_earlier = MutantHarness("refused-batch-revokes-earlier", RefusedBatchRevokesEarlier)
late_deadline = _Doubling("late-deadline", LateDeadline)
delivered_carries_reason = MutantHarness("delivered-carries-reason", DeliveredCarriesReason)
delivered_carries_cause = MutantHarness("delivered-carries-cause", DeliveredCarriesCause)
