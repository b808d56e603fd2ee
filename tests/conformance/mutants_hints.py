"""Deliberately broken store namespaces (H1.5, H1.7, H1.8) and lookups (L1.5, L1.7, L1.9, L1.12):
each wraps the memory backend and breaks exactly one clause, leaving the rest as it is.

``test_mutants.py`` reads its entries in ``mutant_table.py`` and points the suite at each harness here with
``--kvwire-harness tests/conformance/mutants_hints.py:NAME``: each run must fail on a test named
after the rule. :data:`faithful` (which breaks nothing; :class:`mutants.MutantHarness` passes
the configured namespace on in ``Ends.extra["namespace"]``) must pass."""

from __future__ import annotations

import re
import time

import numpy as np
from mutants import Mutant, MutantHarness, Wrapped  # beside this file; on sys.path when loaded as a harness

from kvwire.contract import Hint, SubmissionRejected, View, WakeFn
from kvwire.contract.errors import LookupFailed


def _with_namespace(hint: Hint, namespace: object) -> Hint:
    fields = {**dict(hint.fields), "namespace": namespace}
    return Hint(hint.kind, tuple(sorted(fields.items())), hint.timeout_s)  # type: ignore[arg-type]


class _HintMutant(Mutant):
    """Changes each store hint (of a submission and of a lookup) with :meth:`rewrite`."""

    def rewrite(self, hint: Hint) -> Hint:
        return hint

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if isinstance(hint, Hint) and hint.kind == "store":
            hint = self.rewrite(hint)
        return super().make(op, view, hint, wake)

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        if isinstance(hint, Hint) and hint.kind == "store":
            hint = self.rewrite(hint)
        return super().lookup(groups, names, hint, timeout_s)


class MissingNamespaceToDefault(_HintMutant):
    """H1.7: a store hint without a namespace goes to "default", not to the namespace the
    backend was configured with."""

    def rewrite(self, hint: Hint) -> Hint:
        return _with_namespace(hint, "default") if hint.get("namespace") is None else hint


_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9._:@+=\-/]")


class AcceptsBadNamespace(_HintMutant):
    """H1.8: a namespace outside the allowed form (a leading '/', a space, non-ASCII, too long,
    empty) is sanitized and used instead of refused."""

    def rewrite(self, hint: Hint) -> Hint:
        namespace = hint.get("namespace")
        if isinstance(namespace, str):
            fixed = _NOT_ALLOWED.sub("_", namespace).lstrip("/")[:128] or "default"
            if fixed != namespace:
                return _with_namespace(hint, fixed)
        return hint


class CoercesNamespaceType(_HintMutant):
    """H1.5: a namespace that is no str (an int, bytes, a float) is converted with str() or
    decode() instead of refused as an ill-typed field."""

    def rewrite(self, hint: Hint) -> Hint:
        namespace = hint.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            text = namespace.decode("ascii", "replace") if isinstance(namespace, bytes) else str(namespace)
            return _with_namespace(hint, text)
        return hint


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


faithful = MutantHarness("hints-faithful", Mutant)
missing_namespace_to_default = MutantHarness("missing-namespace-to-default", MissingNamespaceToDefault)
accepts_bad_namespace = MutantHarness("accepts-bad-namespace", AcceptsBadNamespace)
coerces_namespace_type = MutantHarness("coerces-namespace-type", CoercesNamespaceType)
slow_lookup_failure = MutantHarness("slow-lookup-failure", SlowLookupFailure)
lookup_refused_when_queue_full = MutantHarness("lookup-refused-when-queue-full", LookupRefusedWhenQueueFull)
lookup_wakes_in_flight = MutantHarness("lookup-wakes-in-flight", LookupWakesInFlight)
lenient_lookup_args = MutantHarness("lenient-lookup-args", LenientLookupArgs)
