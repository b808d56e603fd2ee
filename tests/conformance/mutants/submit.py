"""Mutants that each break one submitting clause (S1-S5: where rows go, refusals, the queue bound,
errors). Every harness below is registered once, in ``tests/conformance/mutant_table.py``, with the
clause it breaks and the ``-k`` selection of the suite's tests that must catch it. A mutant either
wraps a correct backend through :mod:`kit` (the memory backend, or the reference peer for the
serving protocol) and breaks the clause from outside, or subclasses a reference backend
(:mod:`kvwire.testing.reference`) and overrides the one method where the bug lives.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants/submit.py:NAME``."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from typing import Any

import numpy as np
from kit import (  # beside this file; on sys.path when loaded as a harness
    HoleHarness,
    Mutant,
    MutantHarness,
    PeerMutantHarness,
    StoreMutantHarness,
    Wrapped,
    _Bounded,
    _outcome_like,
    _WideInner,
)

from kvwire.contract import (
    Attempt,
    Capabilities,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Outcome,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.contract.errors import SubmissionError
from kvwire.testing.reference.core import ReferenceAttempt, Runner, read_rows, write_rows
from kvwire.testing.reference.peer import PullMessage, ReferencePeer
from kvwire.testing.reference.store import ReferenceStoreBackend, _Work


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


class _TouchesTheNextSlot(Wrapped):
    touched = False

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "fetch" and not self.touched and self.inner.quiesced():
            self.touched = True
            lent = {int(a) for group in self.view.groups for a in group.addresses().tolist()}
            for group in self.view.groups:
                region = group.region
                for slot in group.slots.tolist():
                    after = region.base + (slot + 1) * region.slot_bytes
                    if slot + 1 < region.slot_count and after not in lent:
                        ctypes.memset(after, 0, region.slot_bytes)
        return out


class TouchesTheNextSlot(Mutant):
    """S2.4: a fetch also clears the slot after each of its rows (as if it read ahead into
    whole pages of the region): bytes of the region the view never lent change."""

    attempt_type = _TouchesTheNextSlot


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


# -- S3.5: a fetch rejected for a full queue clears its rows first ----------------------------

class RejectedFetchClearsRows(Mutant):
    """S3.5: a fetch rejected for a full queue has already zeroed its rows (destination prepared
    before the queue slot was asked for)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        try:
            return super().make(op, view, hint, wake)
        except SubmissionRejected:
            if op == "fetch" and not self.__dict__.get("down"):
                for g in view.groups:
                    for address in g.addresses().tolist():
                        ctypes.memset(int(address), 0, g.region.slot_bytes)
            raise

    def shutdown(self) -> frozenset[Attempt]:
        self.__dict__["down"] = True
        return super().shutdown()


# -- S3.7: the wake of a fetch refused for overlapping rows is called later -----------------------

class OverlapRefusalWakesLater(Mutant):
    """S3.7: a fetch refused for overlapping rows (V4) had its wake put in the instance's wake list
    before the check: it is called along with the wake of the next attempt that concludes."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        try:
            stray = self.__dict__.setdefault("stray", [])

            def both() -> None:
                for stray_wake in list(stray):
                    stray_wake()
                wake()

            return super().make(op, view, hint, both)
        except InvalidSubmission:
            if op == "fetch" and view.overlapping_rows() is not None:
                self.__dict__["stray"].append(wake)
            raise


# -- S1.3: the fifth publish of an instance loses its last row ------------------------------------

class _ClaimsDropped(Wrapped):
    """Hands the outcome of the view less one row, with that row's bit set as if it was stored."""

    dropped: int = 0

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        masks = [np.asarray(m) for m in out.masks]
        masks[self.dropped] = np.append(masks[self.dropped], out.is_delivered)
        return _outcome_like(out, masks)


class FifthPublishDropsItsLastRow(Mutant):
    """S1.3: the fifth publish on an instance stores all its rows but the last, and marks that one
    held too (a batch counter that wraps, losing the tail of one batch)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        count = self.__dict__["publishes"] = self.__dict__.get("publishes", 0) + (op == "publish")
        rows = [i for i, g in enumerate(view.groups) if g.rows]
        if op != "publish" or count != 5 or not rows:
            return super().make(op, view, hint, wake)
        gi = rows[-1]
        g = view.groups[gi]
        short = LayerGroupRows(g.group_id, g.kind, g.region, g.slots[:-1], g.tokens,
                               None if g.names is None else g.names[:-1])
        attempt = _ClaimsDropped(self.inner.publish(View(view.groups[:gi] + (short,) + view.groups[gi + 1:]), hint,
                                                    wake), view, op, self)
        attempt.dropped = gi
        return attempt


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


# -- S3.9: one queue bound per direction --------------------------------------------------------------

class QueuesPerDirection(_Bounded):
    """S3.9: the queue bound is kept per direction: ``max_in_flight`` publishes and as many fetches
    may be in flight together."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if sum(1 for a in self._attempts() if a.op == op and self.live(a)) >= self.BOUND:
            raise SubmissionRejected(f"{op} queue full ({self.BOUND} in flight); submit again once one has concluded "
                                     "and quiesced")
        return Mutant.submit(self, op, view, hint, wake)


# -- S4.1: a view that is no View ------------------------------------------------------------------

class NoViewTypeError(Mutant):
    """S4.1: a submission whose view is not a ``View`` (a tuple of groups, one group) raises
    ``TypeError`` instead of ``InvalidSubmission``."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if not isinstance(view, View):
            raise TypeError(f"{op}() takes a View, not {type(view).__name__}")
        return super().submit(op, view, hint, wake)


# -- S4.1: a hint that is no Hint -------------------------------------------------------------------

class HintReadBeforeChecked(Mutant):
    """S4.1 / H1.5: reads ``hint.kind`` and ``hint.fields`` before checking that the hint is a
    ``Hint``, so a hint that is ``None``, bytes or a dict raises ``AttributeError`` (a wrong
    submission must raise ``InvalidSubmission``)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        route: Any = (hint.kind, dict(hint.fields))  # the author's routing table, keyed by kind
        del route
        return super().make(op, view, hint, wake)


# -- S3.6: a fetch refused for overlapping rows keeps a queue slot ------------------------------------------

class OverlapRefusalKeepsASlot(Mutant):
    """S3.6: a fetch refused for overlapping rows (V4) has already counted itself in the queue,
    and that slot is never given back."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        bound = self.inner.capabilities().max_in_flight
        kept = self.__dict__.get("kept", 0)
        live = sum(1 for a in self._attempts() if not (a.inner.poll() is not None and a.inner.quiesced()))
        if live + kept >= bound:
            raise SubmissionRejected(f"{bound} attempts are in flight")
        if op == "fetch" and isinstance(view, View) and view.overlapping_rows() is not None:
            self.__dict__["kept"] = kept + 1
        return super().submit(op, view, hint, wake)


#: How long StoresBeforeValidating waits for its wrongful put before refusing the view.
STORE_WAIT_S = 2.0


class StoresBeforeValidating(ReferenceStoreBackend):
    """S3: a publish checks and stores its groups one by one, so a view refused for its last
    group has already stored the rows of the first ones."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        if op == "publish":
            namespace = self._namespace_of(hint)
            for i, group in enumerate(view.groups):
                located = self._table.locate(group, i)
                if group.rows and group.names is not None:
                    rows = read_rows(located, group.region.slot_bytes)
                    # stored before the refusal, not queued for a worker: a queued put could land
                    # after the suite's check and let the mutant pass by timing alone. On a thread
                    # waited for, and at most STORE_WAIT_S: where the suite holds the store (its
                    # full-queue tests), a put on this thread would block the submission for good.
                    put = threading.Thread(target=self._store.put, args=(namespace, group.group_id, group.names, rows),
                                           daemon=True)
                    put.start()
                    put.join(STORE_WAIT_S)
        return super()._check(op, view, hint, wake)


class RejectedStillWakes(ReferenceStoreBackend):
    """S3: a submission refused for a full queue still has its wake called later (the wake was
    scheduled before the check)."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        try:
            return super()._submit(op, view, hint, wake)
        except Exception:
            with self._runner.lock:
                self._runner.later_locked(wake)
            raise


class _LeakyRunner(Runner):
    def admit_locked(self, attempt: ReferenceAttempt, what: str) -> None:
        if not self.closed and len(self.live) >= self.max_in_flight:
            self.live.add(attempt)  # counted before the bound is checked
        super().admit_locked(attempt, what)


class RejectionConsumesSlot(ReferenceStoreBackend):
    """S3: a full-queue rejection still takes a queue slot, never given back."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._runner.__class__ = _LeakyRunner


class _OffByOneRunner(Runner):
    def admit_locked(self, attempt: ReferenceAttempt, what: str) -> None:
        self.max_in_flight += 1
        try:
            super().admit_locked(attempt, what)
        finally:
            self.max_in_flight -= 1


class AdmitsOneBeyondBound(ReferenceStoreBackend):
    """S3/B4: the queue takes one attempt more than the bound it declares."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._runner.__class__ = _OffByOneRunner


class PeerRequestsBeforeAdmission(ReferencePeer):
    """S3: a pull sends its request to the server before it checks the queue bound, so a
    rejected fetch has already asked the server."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        with self._runner.lock:
            full = len(self._runner.live) >= self._runner.max_in_flight and not self._runner.closed
        if full and view.groups and view.groups[0].names is not None:
            server, _ = self._peer_of(hint)
            ticket = next(self._fabric.tickets)
            self._send(server, PullMessage(ticket, self.address(), tuple(g.group_id for g in view.groups),
                                       tuple(g.region.slot_bytes for g in view.groups), view.groups[0].names))
        return super().fetch(view, hint, wake)


class InvalidSubmissionWithoutMessage(ReferenceStoreBackend):
    """S3: an invalid submission is refused with an ``InvalidSubmission`` that says nothing."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        try:
            return super()._submit(op, view, hint, wake)
        except InvalidSubmission:
            raise InvalidSubmission() from None


class RejectionWithoutMessage(ReferenceStoreBackend):
    """S3: a rejected submission (queue full, shut down) raises ``SubmissionRejected`` with an
    empty message."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        try:
            return super()._submit(op, view, hint, wake)
        except SubmissionRejected:
            raise SubmissionRejected("") from None


faithful = _WideInner("faithful-bounded-wrapper", FaithfulBounded)
publishes_nowhere = MutantHarness("publishes-nowhere", PublishesNowhere)
scrubs_published_rows = MutantHarness("scrubs-published-rows", ScrubsPublishedRows)
touches_the_next_slot = MutantHarness("touches-the-next-slot", TouchesTheNextSlot)


# the escaped publish must outlive the hold, or it expires unseen in the queue
escapes_on_rejection = MutantHarness("escapes-on-rejection", EscapesOnRejection, inner_timeout_s=120.0)
raises_plain_errors = MutantHarness("raises-plain-errors", RaisesPlainErrors)
raises_faults = MutantHarness("raises-faults", RaisesFaults)
slot_freed_at_conclusion = _WideInner("slot-freed-at-conclusion", SlotFreedAtConclusion)
slot_freed_only_when_asked = _WideInner("slot-freed-only-when-asked", SlotFreedOnlyWhenAsked)
declares_huge_bound = MutantHarness("declares-huge-bound", DeclaresHugeBound)
silent_refusals = MutantHarness("silent-refusals", SilentRefusals)
overlap_refusal_keeps_a_slot = HoleHarness("overlap-refusal-keeps-a-slot", OverlapRefusalKeepsASlot)
rejected_fetch_clears_rows = MutantHarness("rejected-fetch-clears-rows", RejectedFetchClearsRows)
overlap_refusal_wakes_later = MutantHarness("overlap-refusal-wakes-later", OverlapRefusalWakesLater)
fifth_publish_drops_its_last_row = MutantHarness("fifth-publish-drops-its-last-row", FifthPublishDropsItsLastRow)
group_ids_wrap_at_256 = MutantHarness("group-ids-wrap-at-256", GroupIdsWrapAt256)
queues_per_direction = _WideInner("queues-per-direction", QueuesPerDirection)
no_view_type_error = MutantHarness("no-view-type-error", NoViewTypeError)
hint_read_before_checked = MutantHarness("hint-read-before-checked", HintReadBeforeChecked)
stores_before_validating = StoreMutantHarness("stores-before-validating", StoresBeforeValidating)
rejected_still_wakes = StoreMutantHarness("rejected-still-wakes", RejectedStillWakes)
rejection_consumes_slot = StoreMutantHarness("rejection-consumes-slot", RejectionConsumesSlot)
admits_one_beyond_bound = StoreMutantHarness("admits-one-beyond-bound", AdmitsOneBeyondBound)
peer_requests_before_admission = PeerMutantHarness("peer-requests-before-admission", PeerRequestsBeforeAdmission)
invalid_submission_without_message = StoreMutantHarness("invalid-submission-without-message",
                                                        InvalidSubmissionWithoutMessage)
rejection_without_message = StoreMutantHarness("rejection-without-message", RejectionWithoutMessage)


# -- issue 36, second batch: single-clause subclasses of the reference store ----------------------

class PublishOffersTheFirstGroupOnly(ReferenceStoreBackend):
    """S1: a publish offers only the first group's rows to the store; the other groups' rows
    are never offered and come back as false bits of a delivered publish."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        work = super()._check(op, view, hint, wake)
        if op == "publish" and len(work.calls) > 1:
            work = dataclasses.replace(work, calls=work.calls[:1])
        return work


class PublishWipesRowsAfterCopy(ReferenceStoreBackend):
    """S2: a publish zeroes each group's rows in the holder's memory once the store has copied
    them (so lent KV does not linger), though it may only read them."""

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        if attempt.op == "publish":
            store = self._store

            class Wiping:
                def put(self, ns: str, space: Any, names: np.ndarray, rows: np.ndarray) -> Any:
                    reply = store.put(ns, space, names, rows)
                    for call in work.calls:
                        if call.names is names:
                            for gi in call.groups:
                                located = work.located[gi]
                                size = attempt.view.groups[gi].region.slot_bytes
                                n = located.offsets.size
                                write_rows(located, size, np.arange(n), np.zeros((n, size), dtype=np.uint8))
                    return reply

                def get(self, *args: Any) -> Any:
                    return store.get(*args)

                def contains(self, *args: Any) -> Any:
                    return store.contains(*args)

            self._store = Wiping()  # type: ignore[assignment]
            try:
                super()._move(attempt, work)
            finally:
                self._store = store
            return
        super()._move(attempt, work)


class RefusesARejectedSubmissionAgain(ReferenceStoreBackend):
    """S3: a submission rejected for a full queue is remembered (by its names) and rejected
    again, full queue or not: a "not now" that never ends."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        key = (op, tuple(g.names.tobytes() for g in view.groups if g.names is not None))
        rejected: set[tuple[Any, ...]] = self.__dict__.setdefault("rejected", set())
        if key in rejected:
            raise SubmissionRejected("this submission was rejected for a full queue; retry later")
        try:
            return super()._submit(op, view, hint, wake)
        except SubmissionRejected:
            if not self._runner.closed:
                rejected.add(key)
            raise


#: How long a submission waits for its attempt to conclude within the call (the "fast path").
FAST_PATH_S = 0.2


class FetchRaisesAQuickFault(ReferenceStoreBackend):
    """S5: a submission waits briefly within the call for its attempt, and raises the store's
    fault as an exception when the attempt failed that fast, though its calls already reached
    the store."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        with self._runner.lock:
            self._runner.lock.wait_for(lambda: attempt.outcome is not None, FAST_PATH_S)
            out = attempt.outcome
        if out is not None and out.is_failed:
            raise RuntimeError(f"the {op} failed: {out.reason}")
        return attempt


class _StoreErrorEscapes(ReferenceAttempt):
    def poll(self) -> Outcome | None:
        out = super().poll()
        if out is not None and out.is_failed and out.reason and "store call for" in out.reason:
            raise RuntimeError(out.reason)  # the client's error handed to the holder as it came
        return out


class StoreCallErrorsEscape(ReferenceStoreBackend):
    """S5.3: a store call that raised reaches the holder as an exception out of ``poll()``;
    every other failure (a store's failed status, the deadline) still arrives in the outcome."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _StoreErrorEscapes
        return attempt


class _QuiescedRaises(ReferenceAttempt):
    def quiesced(self) -> bool:
        done = super().quiesced()
        if done and self.outcome is not None and self.outcome.is_failed:
            raise RuntimeError(self.outcome.reason)  # like Future.result(): the failure, raised
        return done


class QuiescedRaisesTheFault(ReferenceStoreBackend):
    """S5: quiesced() of a failed attempt raises its failure, once the access has ended."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        with self._runner.lock:
            attempt = super()._submit(op, view, hint, wake)
            attempt.__class__ = _QuiescedRaises
        return attempt


publish_offers_the_first_group_only = StoreMutantHarness("publish-offers-the-first-group-only",
                                                         PublishOffersTheFirstGroupOnly)
publish_wipes_rows_after_copy = StoreMutantHarness("publish-wipes-rows-after-copy", PublishWipesRowsAfterCopy)
refuses_a_rejected_submission_again = StoreMutantHarness("refuses-a-rejected-submission-again",
                                                         RefusesARejectedSubmissionAgain)
fetch_raises_a_quick_fault = StoreMutantHarness("fetch-raises-a-quick-fault", FetchRaisesAQuickFault)
quiesced_raises_the_fault = StoreMutantHarness("quiesced-raises-the-fault", QuiescedRaisesTheFault)
store_call_errors_escape = StoreMutantHarness("store-call-errors-escape", StoreCallErrorsEscape)
