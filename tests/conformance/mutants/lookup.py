"""Mutants that each break one lookup clause (L1: the optional lookup protocol). Every harness below is
registered once, in ``tests/conformance/mutant_table.py``, with the clause it breaks and the ``-k``
selection of the suite's tests that must catch it. A mutant either wraps a correct backend through
:mod:`kit` (the memory backend, or the reference peer for the serving protocol) and breaks the
clause from outside, or subclasses a reference backend (:mod:`kvwire.testing.reference`) and
overrides the one method where the bug lives.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants/lookup.py:NAME``."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from kit import (  # beside this file; on sys.path when loaded as a harness
    Mutant,
    MutantHarness,
    StoreMutantHarness,
    Wrapped,
)

from kvwire.contract import Hint, InvalidSubmission, LookupFailed, SubmissionRejected, View, WakeFn
from kvwire.testing.reference.store import ReferenceStoreBackend, RowStatus, StoreReply


class LookupMutant(Mutant):
    """Forwards everything, lookup included; subclasses change :meth:`lookup` only (or how it
    meets the rest)."""

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        return self.inner.lookup(groups, names, hint, timeout_s)  # type: ignore[attr-defined,no-any-return]


def _frozen(mask: np.ndarray) -> np.ndarray:
    mask = np.array(mask, dtype=bool)
    mask.setflags(write=False)
    return mask


class AnswersTrue(LookupMutant):
    """Says every name is held (a lookup that only checks the store is reachable)."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        answer = super().lookup(groups, names, hint, timeout_s)
        return _frozen(np.ones_like(answer))


class IgnoresTheGroup(LookupMutant):
    """Asks about the first group only, as if rows were keyed by name alone (N1)."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        return super().lookup(list(groups)[:1], names, hint, timeout_s)


class AnyGroup(LookupMutant):
    """Answers true where a name is held in any listed group, not in every one."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        answers = [super(AnyGroup, self).lookup([g], names, hint, timeout_s) for g in list(groups)]
        return _frozen(np.logical_or.reduce(answers)) if answers else super().lookup(groups, names, hint, timeout_s)


class IgnoresTheNamespace(LookupMutant):
    """Always asks the backend's default namespace, whatever the hint names."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        if isinstance(hint, Hint) and hint.kind == "store":
            hint = Hint(hint.kind, (), hint.timeout_s)
        return super().lookup(groups, names, hint, timeout_s)


class WritableMask(LookupMutant):
    """Hands over a writable answer."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        return np.array(super().lookup(groups, names, hint, timeout_s))


class NonBoolMask(LookupMutant):
    """Hands over a uint8 answer."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        answer = super().lookup(groups, names, hint, timeout_s).astype(np.uint8)
        answer.setflags(write=False)
        return answer


class ReusesTheAnswer(LookupMutant):
    """Writes every answer into one buffer it keeps, so an earlier answer changes later."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        answer = super().lookup(groups, names, hint, timeout_s)
        buffer = self.__dict__.get("buffer")
        if buffer is None or buffer.size != answer.size:
            buffer = self.__dict__["buffer"] = np.zeros(answer.size, dtype=bool)
        buffer.setflags(write=True)
        buffer[:] = answer
        buffer.setflags(write=False)
        return buffer


class IgnoresTheDeadline(LookupMutant):
    """Waits as long as the store takes: drops the lookup's deadline."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        if isinstance(hint, Hint):
            hint = Hint(hint.kind, hint.fields)
        return super().lookup(groups, names, hint, 3600.0)


class FaultAsNotHeld(LookupMutant):
    """Reads a fault or a passed deadline as "nothing held" instead of raising LookupFailed."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        try:
            return super().lookup(groups, names, hint, timeout_s)
        except LookupFailed:
            return _frozen(np.zeros(len(names), dtype=bool))


class AnswersAfterShutdown(LookupMutant):
    """After shutdown answers "nothing held" instead of rejecting."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        try:
            return super().lookup(groups, names, hint, timeout_s)
        except SubmissionRejected:
            return _frozen(np.zeros(len(names), dtype=bool))


class PlainErrors(LookupMutant):
    """Refuses bad arguments with ``ValueError`` instead of ``InvalidSubmission``."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        try:
            return super().lookup(groups, names, hint, timeout_s)
        except InvalidSubmission as exc:
            raise ValueError(str(exc)) from None


class AcceptsAnyNames(LookupMutant):
    """Takes names of any width or dtype (cast to uint8, empty ones answered false)."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        names = np.atleast_2d(np.asarray(names)).astype(np.uint8)
        if names.shape[1] == 0:
            return _frozen(np.zeros(names.shape[0], dtype=bool))
        return super().lookup(groups, names[:, :64], hint, timeout_s)


class TruncatesNames(LookupMutant):
    """Keeps its own index of published names, keyed by all but their last byte (a short
    key), and answers lookups from it."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        attempt = super().make(op, view, hint, wake)
        if op == "publish":
            index = self.harness.__dict__.setdefault("index", set())  # shared by both ends of a pair
            for group in view.groups:
                if group.names is not None:
                    index.update((group.group_id, bytes(n[:-1])) for n in group.names)
        return attempt

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        real = super().lookup(groups, names, hint, timeout_s)  # for its refusals and deadline
        index = self.harness.__dict__.get("index", set())
        rows = np.asarray(names)
        answer = np.array([all((g, bytes(n[:-1])) in index for g in groups) for n in rows], dtype=bool)
        return _frozen(answer if rows.shape[1] > 1 else real)


class TreatsZeroAsNoName(LookupMutant):
    """Takes an all-zero name for "no name" and answers it false."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        answer = super().lookup(groups, names, hint, timeout_s)
        return _frozen(answer & np.asarray(names).any(axis=1))


class HoldsAQueueSlot(LookupMutant):
    """Counts each lookup as an attempt in flight and never frees it: after as many lookups as
    the queue bound, submissions are rejected as if the queue were full."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        answer = super().lookup(groups, names, hint, timeout_s)
        self.__dict__["open"] = self.__dict__.get("open", 0) + 1
        return answer

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn):  # type: ignore[no-untyped-def]
        if self.__dict__.get("open", 0) >= self.capabilities().max_in_flight:
            raise SubmissionRejected("the queue is full (lookups in flight)")
        return super().submit(op, view, hint, wake)


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


# -- L1.3 / L1.7: lookups ------------------------------------------------------------------------

class LookupFirstAndLastGroup(LookupMutant):
    """L1.3: a lookup over three or more groups asks only about the first and the last listed
    group (a shortcut for layer groups that are stored together)."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        listed = list(groups) if isinstance(groups, (list, tuple)) else groups
        if isinstance(listed, list) and len(listed) > 2 and all(isinstance(g, int) for g in listed):
            listed = [listed[0], listed[-1]]
        return super().lookup(listed, names, hint, timeout_s)


class LookupHintDeadlineFirst(LookupMutant):
    """L1.7: a lookup's deadline is the hint's ``timeout_s`` when it has one, even when the call
    gives its own ``timeout_s``."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        if isinstance(hint, Hint) and hint.timeout_s is not None:
            timeout_s = hint.timeout_s
        return super().lookup(groups, names, hint, timeout_s)


class LookupReadsNamesContiguously(LookupMutant):
    """L1.3: names that are not one C-contiguous block (a slice of every other row, a column
    slice) are read from their first byte as if they were, so the wrong names are asked about."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        if isinstance(names, np.ndarray) and names.ndim == 2 and names.dtype == np.uint8 \
                and not names.flags.c_contiguous and names.size and min(names.strides) > 0:
            names = np.lib.stride_tricks.as_strided(names, strides=(names.shape[1], 1)).copy()
        return super().lookup(groups, names, hint, timeout_s)


class LookupRepeatedNameOnce(LookupMutant):
    """L1.3: a name asked several times in one lookup answers only at its first place; its
    repeats answer false (the keys asked are deduplicated, and the answer spread back wrongly)."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        answer = super().lookup(groups, names, hint, timeout_s)
        seen: set[bytes] = set()
        out = np.array(answer, dtype=bool)
        for i, row in enumerate(np.asarray(names)):
            key = row.tobytes()
            out[i] &= key not in seen
            seen.add(key)
        out.setflags(write=False)
        return out


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


class SlowLookupFailure(Mutant):
    """L1.7: a lookup of an other end that does not answer raises LookupFailed, but 3 s after
    its deadline (one more silent try)."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        try:
            return super().lookup(groups, names, hint, timeout_s)
        except LookupFailed:
            time.sleep(3.0)
            raise


def _in_flight(backend: Mutant) -> list[Wrapped]:
    return [a for a in backend._attempts() if not (a.inner.poll() is not None and a.inner.quiesced())]


class LookupRefusedWhenQueueFull(Mutant):
    """L1.5: a lookup passes the submission queue's admission: with max_in_flight attempts in
    flight it raises SubmissionRejected."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        live = len(_in_flight(self))
        if live >= self.capabilities().max_in_flight:
            raise SubmissionRejected(f"the queue is full ({live} attempts in flight)")
        return super().lookup(groups, names, hint, timeout_s)


class LookupWakesInFlight(Mutant):
    """L1.12 / W1.6: lookup() drives the backend's progress on the caller's thread and calls the
    wake of every attempt still in flight from inside the call."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        attempt = super().make(op, view, hint, wake)
        attempt.wake = wake  # type: ignore[attr-defined]
        return attempt

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        for attempt in _in_flight(self):
            attempt.wake()  # type: ignore[attr-defined]
        return super().lookup(groups, names, hint, timeout_s)


class LenientLookupArgs(Mutant):
    """L1.9: group ids that are no ints (floats, strs) are converted with int(), and uint8 names
    of more than two dimensions are reshaped to (n, width)."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        try:
            groups = [int(g) for g in groups]
        except (TypeError, ValueError):
            pass  # left for the backend to refuse
        if isinstance(names, np.ndarray) and names.ndim > 2 and names.dtype == np.uint8:
            names = names.reshape(names.shape[0], -1)
        return super().lookup(groups, names, hint, timeout_s)


class LookupTakesBoolGroupIds(ReferenceStoreBackend):
    """L1: a bool in a lookup's groups is taken as the group id 0 or 1 instead of refused."""

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        return super().lookup([int(g) if isinstance(g, bool) else g for g in groups], names, hint, timeout_s)


class _FailsWhatWasLookedUp:
    """A store end that remembers each object a lookup found held, and answers a get that then
    misses one of them ``FAILED`` (the store "lost" an object it vouched for) instead of a miss."""

    def __init__(self, end: Any) -> None:
        self.end = end
        self.vouched: set[tuple[str, Any, bytes]] = set()
        self.lock = threading.Lock()

    def put(self, *args: Any) -> StoreReply:
        return self.end.put(*args)

    def contains(self, namespace: str, space: Any, names: np.ndarray) -> StoreReply:
        reply = self.end.contains(namespace, space, names)
        with self.lock:
            for name, status in zip(names, reply.status, strict=True):
                if status == RowStatus.HELD:
                    self.vouched.add((namespace, space, name.tobytes()))
        return reply

    def get(self, namespace: str, space: Any, names: np.ndarray, row_bytes: int) -> StoreReply:
        reply = self.end.get(namespace, space, names, row_bytes)
        with self.lock:
            lost = [i for i, (name, status) in enumerate(zip(names, reply.status, strict=True))
                    if status == RowStatus.MISSING and (namespace, space, name.tobytes()) in self.vouched]
        if not lost:
            return reply
        status = reply.status.copy()
        status[lost] = RowStatus.FAILED
        return StoreReply(status, reply.data, reply.reason or "an object a lookup reported held is gone")


class LookedUpMissIsAFault(ReferenceStoreBackend):
    """L1.6: a fetch that misses a name its lookup reported held reports a fault, not a miss:
    the lookup is taken as a promise."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(_FailsWhatWasLookedUp(store), **options)


faithful_lookup = MutantHarness("faithful-lookup-wrapper", LookupMutant)
slow_lookup_failure = MutantHarness("slow-lookup-failure", SlowLookupFailure)
lookup_refused_when_queue_full = MutantHarness("lookup-refused-when-queue-full", LookupRefusedWhenQueueFull)
lookup_wakes_in_flight = MutantHarness("lookup-wakes-in-flight", LookupWakesInFlight)
lenient_lookup_args = MutantHarness("lenient-lookup-args", LenientLookupArgs)
lookup_caches_answers = MutantHarness("lookup-caches-answers", LookupCachesAnswers)
lookup_first_and_last_group = MutantHarness("lookup-first-and-last-group", LookupFirstAndLastGroup)
lookup_hint_deadline_first = MutantHarness("lookup-hint-deadline-first", LookupHintDeadlineFirst)
lookup_reads_names_contiguously = MutantHarness("lookup-reads-names-contiguously", LookupReadsNamesContiguously)
lookup_repeated_name_once = MutantHarness("lookup-repeated-name-once", LookupRepeatedNameOnce)
lookup_answers_the_first_thousand = MutantHarness("lookup-answers-the-first-thousand", LookupAnswersTheFirstThousand)
lookup_fault_as_not_held = MutantHarness("lookup-fault-as-not-held-by-the-store", LookupFaultAsNotHeld)
lookup_fault_raised_plainly = MutantHarness("lookup-fault-raised-plainly", LookupFaultRaisedPlainly)
answers_true = MutantHarness("lookup-answers-true", AnswersTrue)
ignores_the_group = MutantHarness("lookup-ignores-the-group", IgnoresTheGroup)
any_group = MutantHarness("lookup-any-group", AnyGroup)
ignores_the_namespace = MutantHarness("lookup-ignores-the-namespace", IgnoresTheNamespace)
writable_mask = MutantHarness("lookup-writable-mask", WritableMask)
non_bool_mask = MutantHarness("lookup-non-bool-mask", NonBoolMask)
reuses_the_answer = MutantHarness("lookup-reuses-the-answer", ReusesTheAnswer)
ignores_the_deadline = MutantHarness("lookup-ignores-the-deadline", IgnoresTheDeadline)
fault_as_not_held = MutantHarness("lookup-fault-as-not-held", FaultAsNotHeld)
answers_after_shutdown = MutantHarness("lookup-answers-after-shutdown", AnswersAfterShutdown)
plain_errors = MutantHarness("lookup-plain-errors", PlainErrors)
accepts_any_names = MutantHarness("lookup-accepts-any-names", AcceptsAnyNames)
truncates_names = MutantHarness("lookup-truncates-names", TruncatesNames)
treats_zero_as_no_name = MutantHarness("lookup-treats-zero-as-no-name", TreatsZeroAsNoName)
holds_a_queue_slot = MutantHarness("lookup-holds-a-queue-slot", HoldsAQueueSlot)
lookup_takes_bool_group_ids = StoreMutantHarness("lookup-takes-bool-group-ids", LookupTakesBoolGroupIds)
looked_up_miss_is_a_fault = StoreMutantHarness("looked-up-miss-is-a-fault", LookedUpMissIsAFault)
