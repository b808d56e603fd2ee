"""Deliberately broken ``lookup`` (L1): each wraps the memory backend (whose store driver offers
``contains``) and breaks exactly one promise of the protocol, leaving fetch and publish as they
are. ``test_lookup_mutants.py`` points the suite's L1 tests at each with
``--kvwire-harness tests/conformance/lookup_mutants.py:NAME``: each must fail a ``test_L1_`` test,
and :data:`faithful_lookup`, which breaks nothing, must pass."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mutants import Mutant, MutantHarness, Wrapped  # beside this file; on sys.path when loaded as a harness

from kvwire.contract import Hint, InvalidSubmission, LookupFailed, SubmissionRejected, View, WakeFn


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


faithful_lookup = MutantHarness("faithful-lookup-wrapper", LookupMutant)
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
