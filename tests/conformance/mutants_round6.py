"""Deliberately broken backends of the sixth probing round, on the core clauses: each wraps the
memory backend, as ``mutants.py`` does, and breaks one clause of memory, views, submitting,
attempts, wakes or lifecycle that the earlier rounds touched least: group ids past one byte
(S1.4), a view changed by its refusal (V2.2), rows that cross registered slot boundaries (M4.2),
a publish's deadline (A8.4), a queue bound kept per direction (S3.9), shutdown and a held publish
(B3.2, A10.8) or another instance's attempts (B1.4, B3.3), an empty view that never wakes
(W1.2), wakes from inside ``close()`` (W1.6), a raising wake dropped (W1.7), ``cancel()`` that
raises (A4.1), and a publish's ``poll()`` or ``quiesced()`` that waits on its store (A1.1, A2.1).
``test_mutants.py`` reads its entries in ``mutant_table.py`` and checks that the suite fails each one on a test
named after the rule it breaks.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants_round6.py:NAME``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from mutants import Mutant, MutantHarness, Wrapped  # beside this file; on sys.path as a harness
from mutants_capacity import _Bounded, _WideInner

from kvwire.contract import (
    Attempt,
    Cause,
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


class _Down(Mutant):
    """Remembers that ``shutdown()`` was called, for mutants that change only the instance's
    working life (a refusal after shutdown stays the inner backend's)."""

    @property
    def down(self) -> bool:
        return bool(self.__dict__.get("down"))

    def shutdown(self) -> frozenset[Attempt]:
        self.__dict__["down"] = True
        return super().shutdown()


class _Concluded(Attempt):
    """An attempt concluded and quiesced at once with ``outcome``, whose wake is never called."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome

    def poll(self) -> Outcome | None:
        return self.outcome

    def quiesced(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


# -- S1.4: group ids kept in one byte --------------------------------------------------------------

class GroupIdsWrapAt256(Mutant):
    """S1.4: rows are keyed by their group id modulo 256 (a uint8 in the key), so rows published
    under group 300 are found by a fetch of group 44 with the same names."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        wrapped = [g.group_id % 256 for g in view.groups]
        if len(set(wrapped)) == len(wrapped):  # a view whose ids collide once wrapped goes as it is
            inner = View(tuple(LayerGroupRows(gid, g.kind, g.region, g.slots, g.tokens, g.names)
                               for gid, g in zip(wrapped, view.groups, strict=True)))
            attempt = super().make(op, inner, hint, wake)
            attempt.view = view
            return attempt
        return super().make(op, view, hint, wake)


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


# -- S3.9: one queue bound per direction --------------------------------------------------------------

class QueuesPerDirection(_Bounded):
    """S3.9: the queue bound is kept per direction: ``max_in_flight`` publishes and as many fetches
    may be in flight together."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if sum(1 for a in self._attempts() if a.op == op and self.live(a)) >= self.BOUND:
            raise SubmissionRejected(f"{op} queue full ({self.BOUND} in flight); submit again once one has concluded "
                                     "and quiesced")
        return Mutant.submit(self, op, view, hint, wake)


# -- B3.2 / A10.8: shutdown and a held publish -------------------------------------------------------

def _shut(out: Outcome | None) -> bool:
    return out is not None and out.cause is Cause.SHUTDOWN


class _PublishOutlivesShutdown(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if self.op == "publish" and _shut(out) and not self.inner.quiesced():
            return None  # still waiting on the store, as if shutdown() had not touched it
        return out


class ShutdownSparesPublishes(Mutant):
    """B3.2: ``shutdown()`` concludes the fetches in flight but leaves a publish waiting on its
    store: it concludes only once the store answers."""

    attempt_type = _PublishOutlivesShutdown


class _PublishShutdownFaults(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if self.op == "publish" and _shut(out):
            assert out is not None
            return Outcome.failed("the store connection was closed under the publish", out.masks, cause=Cause.FAULT)
        return out


class ShutdownPublishCauseFault(Mutant):
    """A10.8 / B3.2: a publish that ``shutdown()`` concluded fails with cause ``FAULT`` (its store
    connection was closed under it), not ``SHUTDOWN``."""

    attempt_type = _PublishShutdownFaults


class ShutdownHidesPublishes(Mutant):
    """B3.3: ``shutdown()`` leaves publishes out of the set it returns, also one its store still
    holds (found by a review after the round: the B3 publish test checked only that the set held
    nothing foreign)."""

    def shutdown(self) -> frozenset[Attempt]:
        return frozenset(a for a in super().shutdown() if getattr(a, "op", None) != "publish")


# -- W1.6: close() wakes every attempt it ever made ---------------------------------------------------

class WakesInsideClose(Mutant):
    """W1.6: ``close()`` calls the wake of every attempt the instance made, from inside the call
    (a final "notify all waiters" on the holder's thread)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        self.__dict__.setdefault("wakes", []).append(wake)
        return super().make(op, view, hint, wake)

    def close(self) -> None:
        for wake in self.__dict__.pop("wakes", []):
            try:
                wake()
            except Exception:  # W1.7: a raising wake is survived
                pass
        super().close()


# -- W1.7: a raising wake dropped ----------------------------------------------------------------------

class RaisingWakeDropped(Mutant):
    """W1.7 / W1.3: once an attempt's wake raised, the backend drops it: the attempt's later
    changes (a quiescence after the conclusion) come without a wake."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        dropped: list[bool] = []

        def guarded() -> None:
            if dropped:
                return
            try:
                wake()
            except Exception:
                dropped.append(True)
                raise

        return super().make(op, view, hint, guarded)


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


# -- W1.2: an empty view concludes without a wake ---------------------------------------------------

class EmptyViewsNeverWake(_Down):
    """W1.2: a view with no groups concludes delivered inside the call, and nothing wakes the
    holder for it (there was nothing to wait for)."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if not view.groups and not self.down:
            return _Concluded(Outcome.delivered(()))
        return super().submit(op, view, hint, wake)


# -- B1.4 / B3.3: instances on one store that share their shutdown ----------------------------------

_instances: list[Mutant] = []


class _Shared(Mutant):
    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        _instances.append(self)

    def others(self) -> list[Mutant]:
        return [m for m in _instances if m is not self]


class ShutdownCancelsOtherInstances(_Shared):
    """B1.4: ``shutdown()`` of one instance cancels the attempts in flight on every other
    instance of the process (one shared connection pool closed)."""

    def shutdown(self) -> frozenset[Attempt]:
        for other in self.others():
            for attempt in other._attempts():
                if attempt.inner.poll() is None:
                    attempt.inner.cancel()
        return super().shutdown()


class ShutdownListsOtherInstances(_Shared):
    """B3.3: ``shutdown()`` returns the attempts not quiesced of every instance of the process, not
    only its own."""

    def shutdown(self) -> frozenset[Attempt]:
        pending = set(super().shutdown())
        for other in self.others():
            pending |= {a for a in other._attempts() if not a.inner.quiesced()}
        return frozenset(pending)


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



# -- S4.1: a view that is no View ------------------------------------------------------------------

class NoViewTypeError(Mutant):
    """S4.1: a submission whose view is not a ``View`` (a tuple of groups, one group) raises
    ``TypeError`` instead of ``InvalidSubmission``."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if not isinstance(view, View):
            raise TypeError(f"{op}() takes a View, not {type(view).__name__}")
        return super().submit(op, view, hint, wake)


# -- the harnesses the suite is pointed at --------------------------------------------------------

group_ids_wrap_at_256 = MutantHarness("group-ids-wrap-at-256", GroupIdsWrapAt256)
sorts_slots_to_find_overlap = MutantHarness("sorts-slots-to-find-overlap", SortsSlotsToFindOverlap)
rows_must_fit_a_registered_slot = MutantHarness("rows-must-fit-a-registered-slot", RowsMustFitARegisteredSlot)
aligned_bases_only = MutantHarness("aligned-bases-only", AlignedBasesOnly)
publish_ignores_hint_timeout = MutantHarness("publish-ignores-hint-timeout", PublishIgnoresHintTimeout)
publishes_without_deadline = MutantHarness("publishes-without-deadline", PublishesWithoutDeadline)
queues_per_direction = _WideInner("queues-per-direction", QueuesPerDirection)
shutdown_spares_publishes = MutantHarness("shutdown-spares-publishes", ShutdownSparesPublishes)
shutdown_publish_cause_fault = MutantHarness("shutdown-publish-cause-fault", ShutdownPublishCauseFault)
wakes_inside_close = MutantHarness("wakes-inside-close", WakesInsideClose)
raising_wake_dropped = MutantHarness("raising-wake-dropped", RaisingWakeDropped)
cancel_raises_after_failure = MutantHarness("cancel-raises-after-failure", CancelRaisesAfterFailure)
cancel_raises_after_shutdown = MutantHarness("cancel-raises-after-shutdown", CancelRaisesAfterShutdown)
empty_views_never_wake = MutantHarness("empty-views-never-wake", EmptyViewsNeverWake)
shutdown_cancels_other_instances = MutantHarness("shutdown-cancels-other-instances", ShutdownCancelsOtherInstances)
shutdown_lists_other_instances = MutantHarness("shutdown-lists-other-instances", ShutdownListsOtherInstances)
publish_poll_waits_for_the_store = MutantHarness("publish-poll-waits-for-the-store", PublishPollWaitsForTheStore)
publish_quiesced_waits_for_the_store = MutantHarness("publish-quiesced-waits-for-the-store",
                                                    PublishQuiescedWaitsForTheStore)
no_view_type_error = MutantHarness("no-view-type-error", NoViewTypeError)
shutdown_hides_publishes = MutantHarness("shutdown-hides-publishes", ShutdownHidesPublishes)
