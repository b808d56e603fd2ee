"""Deliberately broken backends of the eighth probing round, on the attempt's life after the
submission: what ``shutdown()`` does to a fetch in flight (B3.2, W1.2), a name asked twice in one
fetch (A5.10), a hint that is no ``Hint`` (S4.1), ``cancel()`` of an attempt that concluded but
has not quiesced (A4.6, A4.2), a lookup of thousands of names (L1.3), and a pull made before the
serving end called ``serve()`` (N2.7). Each wraps the memory backend or the reference peer
(``loopback_peer.py``), as ``mutants.py`` does, and breaks one clause. ``test_mutants.py`` reads
its entries in ``mutant_table.py`` and checks that the suite fails each one on a test named after the rule it breaks.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants_round8.py:NAME``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from loopback_peer import LoopbackHarness  # beside this file; on sys.path when loaded as a harness
from mutants import Mutant, MutantHarness, PeerMutant, Wrapped, _outcome_like

from kvwire.contract import (
    Attempt,
    Cause,
    Hint,
    LayerGroupRows,
    Outcome,
    SlotRegion,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.contract.errors import LookupFailed
from kvwire.contract.outcome import OutcomeStatus
from kvwire.testing.reference.peer import Declined, Fabric, PullMessage, ReferencePeer

# -- B3.2: shutdown() lets a fetch in flight run to its end -------------------------------------------

class _Closing(Mutant):
    """Keeps its own shut-down state, so its ``shutdown()`` may hold back the inner one's: once
    shut down it refuses submissions, registrations and lookups as the inner backend would."""

    def closed(self) -> bool:
        return bool(self.__dict__.get("shut", False))

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if self.closed():
            raise SubmissionRejected("this backend is shut down; it takes no submission")
        return super().submit(op, view, hint, wake)

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        if self.closed():
            raise SubmissionRejected("this backend is shut down; it registers nothing")
        return super().register_regions(regions)

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        if self.closed():
            raise SubmissionRejected("this backend is shut down; it answers no lookup")
        return super().lookup(groups, names, hint, timeout_s)


class _ShutdownCause(Wrapped):
    """A publish ``shutdown()`` cancelled answers cause ``SHUTDOWN`` (A10.8)."""

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.__dict__.get("by_shutdown") and out.is_cancelled:
            return Outcome(OutcomeStatus.CANCELLED, out.masks, out.reason, False, Cause.SHUTDOWN)
        return out


class ShutdownLetsFetchesFinish(_Closing):
    """B3.2: ``shutdown()`` cancels the publishes in flight, but lets each fetch in flight run to
    its end ("its rows are already being written into the holder's memory"): a fetch its other
    end holds concludes only when the other end answers, or at its deadline, never by the
    shutdown. The set it returns is right (every attempt not quiesced)."""

    attempt_type = _ShutdownCause

    def shutdown(self) -> frozenset[Attempt]:
        self.__dict__["shut"] = True
        made = self._attempts()
        if any(a.op == "fetch" and a.inner.poll() is None for a in made):
            for a in made:
                if a.op == "publish" and a.inner.poll() is None:
                    a.__dict__["by_shutdown"] = True
                    a.inner.cancel()
            return frozenset(a for a in made if not a.inner.quiesced())
        return super().shutdown()


# -- B3.2 / W1.2: shutdown() concludes a fetch without waking its holder ------------------------------

class ShutdownConcludesFetchesUnwoken(Mutant):
    """B3.2 / W1.2: ``shutdown()`` concludes every fetch in flight, but calls no wake for that
    conclusion ("the holder called shutdown(), so it knows"): the holder of a fetch its other end
    holds hears of it only at its quiescence, once the other end lets go."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        box: dict[str, Wrapped] = {}

        def relay() -> None:
            attempt = box.get("attempt")
            if attempt is not None and attempt.__dict__.get("muted") and not attempt.inner.quiesced():
                return
            wake()

        call = self.inner.fetch if op == "fetch" else self.inner.publish
        attempt = self.attempt_type(call(view, hint, relay), view, op, self)
        box["attempt"] = attempt
        return attempt

    def shutdown(self) -> frozenset[Attempt]:
        for a in self._attempts():
            if a.op == "fetch" and a.inner.poll() is None:
                a.__dict__["muted"] = True
        return super().shutdown()


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


# -- S4.1: a hint that is no Hint -------------------------------------------------------------------

class HintReadBeforeChecked(Mutant):
    """S4.1 / H1.5: reads ``hint.kind`` and ``hint.fields`` before checking that the hint is a
    ``Hint``, so a hint that is ``None``, bytes or a dict raises ``AttributeError`` (a wrong
    submission must raise ``InvalidSubmission``)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        route: Any = (hint.kind, dict(hint.fields))  # the author's routing table, keyed by kind
        del route
        return super().make(op, view, hint, wake)


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


# -- L1.3: a lookup of thousands of names -------------------------------------------------------------

class LookupAnswersTheFirstThousand(Mutant):
    """L1.3: the store client checks at most 1000 keys per call; a lookup sends the first 1000
    names only, and every name after them answers false."""

    LIMIT = 1000

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        if isinstance(names, np.ndarray) and names.ndim == 2 and names.shape[0] > self.LIMIT:
            head = super().lookup(groups, names[: self.LIMIT], hint, timeout_s)
            answer = np.zeros(names.shape[0], dtype=bool)
            answer[: self.LIMIT] = head
            answer.setflags(write=False)
            return answer
        return super().lookup(groups, names, hint, timeout_s)


# -- N2.7: a pull made before serve() is declined, and still queued ------------------------------------

def _unset() -> None:
    pass


class _QueuesUnservedPulls(ReferencePeer):
    """A reference peer that puts every arriving pull in its queue; before ``serve()`` it also
    declines it, and leaves it there."""

    def _on_request(self, message: PullMessage) -> None:
        with self._runner.lock:
            unserved = self._serving_wake is None
            if unserved:
                self._serving_wake = _unset  # queue it as a served pull is queued
        if not unserved:
            super()._on_request(message)
            return
        try:
            super()._on_request(message)
        finally:
            with self._runner.lock:
                if self._serving_wake is _unset:
                    self._serving_wake = None
        self._send(message.reply_to, Declined(message.ticket, "the peer is not serving pulls"))


class _UnservedQueueHarness(LoopbackHarness):
    def make_peer(self, fabric: Fabric, name: str, *, timeout_s: float, max_in_flight: int) -> ReferencePeer:
        return _QueuesUnservedPulls(fabric, name, timeout_s=timeout_s, max_in_flight=max_in_flight)


class DeclinedBeforeServeStillQueued(PeerMutant):
    """N2.7 / N2.5: a pull made before the serving end called ``serve()`` is declined (the
    requester's fetch fails, cause ``DECLINED``), but stays in the serving end's queue:
    ``incoming()`` hands it over once ``serve()`` is called, ahead of the pulls made since."""


# -- L1.8: a store fault during a lookup ----------------------------------------------------------------

class LookupFaultAsNotHeld(Mutant):
    """L1.8: a lookup whose store call fails answers every name "not held" (a client that reads
    an error code as absence)."""

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        try:
            return super().lookup(groups, names, hint, timeout_s)
        except LookupFailed:
            answer = np.zeros(len(names), dtype=bool)
            answer.setflags(write=False)
            return answer


class LookupFaultRaisedPlainly(Mutant):
    """L1.8: a lookup whose store call fails lets the store's error out as ``RuntimeError``."""

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        try:
            return super().lookup(groups, names, hint, timeout_s)
        except LookupFailed as exc:
            raise RuntimeError(f"store error: {exc}") from None


shutdown_lets_fetches_finish = MutantHarness("shutdown-lets-fetches-finish", ShutdownLetsFetchesFinish)
shutdown_concludes_fetches_unwoken = MutantHarness("shutdown-concludes-fetches-unwoken",
                                                   ShutdownConcludesFetchesUnwoken)
fetch_dedupes_repeated_names = MutantHarness("fetch-dedupes-repeated-names", FetchDedupesRepeatedNames)
hint_read_before_checked = MutantHarness("hint-read-before-checked", HintReadBeforeChecked)
cancel_rewrites_a_failed_outcome = MutantHarness("cancel-rewrites-a-failed-outcome", CancelRewritesAFailedOutcome)
second_cancel_forces_quiescence = MutantHarness("second-cancel-forces-quiescence", SecondCancelForcesQuiescence)
lookup_answers_the_first_thousand = MutantHarness("lookup-answers-the-first-thousand", LookupAnswersTheFirstThousand)
declined_before_serve_still_queued = MutantHarness("declined-before-serve-still-queued", DeclinedBeforeServeStillQueued,
                                                   inner=_UnservedQueueHarness())
lookup_fault_as_not_held = MutantHarness("lookup-fault-as-not-held-by-the-store", LookupFaultAsNotHeld)
lookup_fault_raised_plainly = MutantHarness("lookup-fault-raised-plainly", LookupFaultRaisedPlainly)
