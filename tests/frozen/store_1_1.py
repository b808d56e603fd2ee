"""The same third party's store, moved up to contract 1.1 by its author from the 1.1 clauses, and
FROZEN: this file is never edited after it was added (2026-12-04).

What 1.1 asked of the 1.0 store (``store_1_0``), and this adds: a cause on every outcome that did
not deliver (A10), the optional ``lookup`` protocol (L1), the namespace form (H1.8), registration
refused after ``shutdown()`` (M3.10), a group whose rows lie in two registered regions refused
(M4.3), and no wake from inside a holder's call (W1.6). It knows nothing of 1.2: its lookup takes
a bool as a group id (``True`` is group 1 to Python), which L1.13 refuses from 1.2 on."""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

import numpy as np
from store_1_0 import FrozenAttempt, FrozenBackend, FrozenHarness, StoreEnd

from kvwire.contract import (
    Attempt,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    LookupFailed,
    MemoryKind,
    OtherEnd,
    Outcome,
    Registration,
    SlotRegion,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.contract.lookup import LOOKUP, Lookup
from kvwire.testing.gate import faulted_rows

VERSION = (1, 1)
NAMESPACE = re.compile(r"^[A-Za-z0-9._:@+=-][A-Za-z0-9._:@+=/-]{0,127}$")


class StoreEnd11(StoreEnd):
    def contains(self, namespace: str, groups: Sequence[int], names: np.ndarray) -> np.ndarray:
        with self.gate.passage():
            if faulted_rows(self.plan, "fetch", names).any() and self.plan is not None and self.plan.lookup:
                raise OSError("the store failed to answer")
            with self.store.lock:
                return np.array([all((namespace, int(g), n.tobytes()) in self.store.objects for g in groups)
                                 for n in names], dtype=bool)


class FrozenAttempt11(FrozenAttempt):
    def cancel(self) -> None:
        with self.backend.cond:
            if self.outcome is not None:
                return
            self.stop = True
            self._conclude(Outcome.cancelled(self._masks()))
        threading.Thread(target=self._wake, daemon=True).start()  # never from inside the call (W1.6)


class FrozenBackend11(FrozenBackend, Lookup):
    def capabilities(self) -> Capabilities:
        return Capabilities(VERSION, True, True, frozenset({MemoryKind.HOST}), OtherEnd.STORE, True,
                            self.max_in_flight, True, frozenset({LOOKUP}))

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        with self.cond:
            if self.is_shut:
                raise SubmissionRejected("the backend is shut down")
        return super().register_regions(regions)

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(hint, Hint) and hint.kind == "store":
            namespace = hint.get("namespace", self.namespace)
            if not isinstance(namespace, str) or not NAMESPACE.match(namespace):
                raise InvalidSubmission(f"namespace {namespace!r} is not 1-128 ASCII letters, digits or '._:@+=-/', "
                                        "not starting with '/'")
        return super()._submit(op, view, hint, wake)

    def _check_rows(self, op: str, view: View) -> None:
        super()._check_rows(op, view)
        spans = [(r.base, r.end) for reg in self.registrations for r in reg.regions]
        for g in view.groups:
            if not g.rows:
                continue
            lo = g.region.base + np.asarray(g.slots, dtype=np.int64) * g.region.slot_bytes
            hi = lo + g.region.slot_bytes
            if not any(((lo >= base) & (hi <= end)).all() for base, end in spans):
                raise InvalidSubmission(f"group {g.group_id}: its rows lie in more than one registered region")

    def _new_attempt(self, op: str, view: View, namespace: str, wake: WakeFn, deadline: float) -> FrozenAttempt:
        return FrozenAttempt11(self, op, view, namespace, wake, deadline)

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        if not isinstance(hint, Hint) or hint.kind != "store" or any(k != "namespace" for k, _ in hint.fields):
            raise InvalidSubmission(f"this store takes Hint.of('store', namespace=...), got {hint!r}")
        namespace = hint.get("namespace", self.namespace)
        if not isinstance(namespace, str) or not NAMESPACE.match(namespace):
            raise InvalidSubmission(f"namespace {namespace!r} is not allowed")
        groups = list(groups)
        if not groups or not all(isinstance(g, int) and g >= 0 for g in groups):
            raise InvalidSubmission(f"groups must be one or more ints >= 0, got {groups!r}")
        if (not isinstance(names, np.ndarray) or names.dtype != np.uint8 or names.ndim != 2
                or not 1 <= names.shape[1] <= 64):
            raise InvalidSubmission("names must be a 2-D uint8 array of width 1 to 64")
        wait = timeout_s if timeout_s is not None else hint.timeout_s if hint.timeout_s is not None else self.timeout_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait < 1e9:
            raise InvalidSubmission(f"timeout_s must be a number of seconds > 0, got {wait!r}")
        with self.cond:
            if self.is_shut:
                raise SubmissionRejected("the backend is shut down")
        answer: list[object] = []
        done = threading.Event()

        def ask() -> None:
            try:
                answer.append(self.end.contains(namespace, groups, names))  # type: ignore[attr-defined]
            except Exception as exc:
                answer.append(exc)
            done.set()

        threading.Thread(target=ask, daemon=True).start()
        if not done.wait(wait):
            raise LookupFailed(f"the store did not answer within {wait:g} s")
        if isinstance(answer[0], Exception):
            raise LookupFailed(f"the store failed: {answer[0]}")
        held = np.array(answer[0], dtype=bool)
        held.setflags(write=False)
        return held

    def _failed(self, reason: str, masks: list[np.ndarray], *, deadline: bool) -> Outcome:
        return Outcome.failed(reason, masks, cause=Cause.DEADLINE if deadline else Cause.FAULT)

    def _shut_outcome(self, masks: list[np.ndarray]) -> Outcome:
        return Outcome.cancelled(masks, cause=Cause.SHUTDOWN)


class FrozenHarness11(FrozenHarness):
    name = "frozen-1.1"
    backend_class = FrozenBackend11
    end_class = StoreEnd11

    def capabilities(self) -> Capabilities:
        return Capabilities(VERSION, True, True, frozenset({MemoryKind.HOST}), OtherEnd.STORE, True, 16, True,
                            frozenset({LOOKUP}))


harness = FrozenHarness11()
