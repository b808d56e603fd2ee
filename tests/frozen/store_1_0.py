"""A third party's store backend, written against contract 1.0 from the 1.0 clauses alone, directly
on ``kvwire.contract``, and FROZEN: this file is never edited after it was added (2026-12-04).

It stands for a plugin written years ago that kvwire must keep accepting. It declares the literal
version ``(1, 0)`` and keeps every 1.0 clause, and it knows nothing of what later versions added,
so it breaks some of their clauses the way such a plugin would: its failed outcomes carry no cause
(A10), it takes any namespace string (H1.8), it registers after ``shutdown()`` (M3.10), it lets a
group's rows lie in two registered regions (M4.3), and its ``cancel()`` wakes the holder from
inside the call (W1.6). ``tests/frozen/test_frozen.py`` runs the conformance suite against it and
expects it to pass, and checks that each of those clauses is really broken (so the suite passes it
because the clauses are gated by version, not because nobody looks).

The harness at the bottom is what its author ships under ``kvwire.harnesses``."""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Sequence

import numpy as np

from kvwire.contract import (
    Attempt,
    Backend,
    Capabilities,
    Hint,
    InvalidSubmission,
    MemoryKind,
    OtherEnd,
    Outcome,
    Registration,
    SlotRegion,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.testing.gate import Gate, faulted_rows
from kvwire.testing.harness import Ends, FaultPlan, Harness, Unavailable

VERSION = (1, 0)


class SharedStore:
    """Objects by (namespace, group, name): immutable once stored."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, int, bytes], bytes] = {}
        self.lock = threading.Lock()


class StoreEnd:
    """The backend's way to its store. A harness may hold its calls and fault names."""

    def __init__(self, store: SharedStore, gate: Gate | None = None, plan: FaultPlan | None = None) -> None:
        self.store, self.gate, self.plan = store, gate or Gate(), plan

    def put(self, namespace: str, group: int, names: np.ndarray, rows: list[bytes]) -> np.ndarray:
        """True where the store holds the row afterwards; ``None`` entries of a fault raise."""
        with self.gate.passage():
            failed = faulted_rows(self.plan, "publish", names)
            if failed.any():
                raise OSError(f"store refused {int(failed.sum())} object(s)")
            with self.store.lock:
                for name, data in zip(names, rows, strict=True):
                    self.store.objects.setdefault((namespace, group, name.tobytes()), data)
            return np.ones(len(names), dtype=bool)

    def get(self, namespace: str, group: int, names: np.ndarray) -> list[bytes | None]:
        with self.gate.passage():
            failed = faulted_rows(self.plan, "fetch", names)
            if failed.any():
                raise OSError(f"store failed to read {int(failed.sum())} object(s)")
            with self.store.lock:
                return [self.store.objects.get((namespace, group, name.tobytes())) for name in names]


class FrozenAttempt(Attempt):
    def __init__(self, backend: FrozenBackend, op: str, view: View, namespace: str, wake: WakeFn,
                 deadline: float) -> None:
        self.backend, self.op, self.view, self.namespace = backend, op, view, namespace
        self.wake, self.deadline = wake, deadline
        self.moved = [np.zeros(g.rows, dtype=bool) for g in view.groups]
        self.outcome: Outcome | None = None
        self.done = False  # the worker will not touch the view's memory again
        self.stop = False

    def poll(self) -> Outcome | None:
        with self.backend.cond:
            return self.outcome

    def quiesced(self) -> bool:
        with self.backend.cond:
            return self.done

    def cancel(self) -> None:
        with self.backend.cond:
            if self.outcome is not None:
                return
            self.stop = True
            self._conclude(Outcome.cancelled(self._masks()))
        self._wake()  # contract 1.0 lets the backend wake from any thread (W1.6 came in 1.1)

    # -- called with backend.cond held --------------------------------------------------------

    def _masks(self) -> list[np.ndarray]:
        return [m.copy() for m in self.moved]

    def _conclude(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.backend.cond.notify_all()

    def _wake(self) -> None:
        try:
            self.wake()
        except Exception:  # a holder's raising wake must not stop us
            pass


class FrozenRegistration(Registration):
    def __init__(self, backend: FrozenBackend, regions: tuple[SlotRegion, ...]) -> None:
        self.backend, self._regions, self.open = backend, regions, True

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self._regions

    def close(self) -> None:
        with self.backend.cond:
            self.open = False
            if self in self.backend.registrations:
                self.backend.registrations.remove(self)


class FrozenBackend(Backend):
    """One worker thread moves attempts in order; a clock thread ends them at their deadlines."""

    def __init__(self, end: StoreEnd, *, namespace: str = "default", timeout_s: float = 30.0,
                 max_in_flight: int = 16) -> None:
        self.end, self.namespace, self.timeout_s, self.max_in_flight = end, namespace, timeout_s, max_in_flight
        self.cond = threading.Condition()
        self.registrations: list[FrozenRegistration] = []
        self.queue: list[FrozenAttempt] = []
        self.live: list[FrozenAttempt] = []  # not both concluded and quiesced
        self.is_shut = False
        self.closed = False
        self.threads = [threading.Thread(target=self._work, daemon=True),
                        threading.Thread(target=self._clock, daemon=True)]
        for thread in self.threads:
            thread.start()

    def capabilities(self) -> Capabilities:
        return Capabilities(VERSION, True, True, frozenset({MemoryKind.HOST}), OtherEnd.STORE, True,
                            self.max_in_flight, True)

    # -- registration ----------------------------------------------------------------------------

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        batch = tuple(regions)
        with self.cond:
            known = [r for reg in self.registrations for r in reg.regions]
            for i, region in enumerate(batch):
                if region.memory_kind is not MemoryKind.HOST:
                    raise InvalidSubmission(f"region {region.region_id} is {region.memory_kind}; this store "
                                            "moves host memory only")
                for other in list(batch[:i]) + known:
                    if region.base < other.end and other.base < region.end:
                        raise InvalidSubmission(f"region {region.region_id} overlaps region {other.region_id}")
            registration = FrozenRegistration(self, batch)
            self.registrations.append(registration)
            return registration

    # -- submitting ------------------------------------------------------------------------------

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self._submit("fetch", view, hint, wake)

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self._submit("publish", view, hint, wake)

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        start = time.monotonic()
        if not isinstance(view, View) or not isinstance(hint, Hint):
            raise InvalidSubmission(f"{op} takes a View and a Hint, got {type(view).__name__}, {type(hint).__name__}")
        if hint.kind != "store" or any(key != "namespace" for key, _ in hint.fields):
            raise InvalidSubmission(f"this store takes Hint.of('store', namespace=...), got {hint!r}")
        namespace = hint.get("namespace", self.namespace)
        if not isinstance(namespace, str) or not namespace:
            raise InvalidSubmission(f"a namespace is a non-empty str, got {namespace!r}")
        timeout = hint.timeout_s if hint.timeout_s is not None else self.timeout_s
        with self.cond:
            if self.is_shut:
                raise SubmissionRejected("the backend is shut down")
            self._check_rows(op, view)
            if len(self.live) >= self.max_in_flight:
                raise SubmissionRejected(f"{self.max_in_flight} attempts are in flight; submit again later")
            attempt = self._new_attempt(op, view, namespace, wake, start + timeout)
            self.live.append(attempt)
            self.queue.append(attempt)
            self.cond.notify_all()
            return attempt

    def _new_attempt(self, op: str, view: View, namespace: str, wake: WakeFn, deadline: float) -> FrozenAttempt:
        return FrozenAttempt(self, op, view, namespace, wake, deadline)

    def _failed(self, reason: str, masks: list[np.ndarray], *, deadline: bool) -> Outcome:
        return Outcome.failed(reason, masks)

    def _shut_outcome(self, masks: list[np.ndarray]) -> Outcome:
        return Outcome.cancelled(masks)

    def _check_rows(self, op: str, view: View) -> None:
        spans = [(r.base, r.end) for reg in self.registrations for r in reg.regions]
        starts, ends = [], []
        for g in view.groups:
            if g.region.memory_kind is not MemoryKind.HOST:
                raise InvalidSubmission(f"group {g.group_id} is in {g.region.memory_kind} memory; host only")
            if g.names is None and g.rows:
                raise InvalidSubmission(f"group {g.group_id} has no names; this store keys rows by name")
            lo = g.region.base + np.asarray(g.slots, dtype=np.int64) * g.region.slot_bytes
            hi = lo + g.region.slot_bytes
            inside = np.zeros(len(lo), dtype=bool)
            for base, end in spans:
                inside |= (lo >= base) & (hi <= end)
            if not inside.all():
                raise InvalidSubmission(f"group {g.group_id}: row {int(np.flatnonzero(~inside)[0])} lies in no "
                                        "registered region")
            starts.append(lo)
            ends.append(hi)
        if op == "fetch" and starts:
            lo, hi = np.concatenate(starts), np.concatenate(ends)
            order = np.argsort(lo, kind="stable")
            if (lo[order][1:] < hi[order][:-1]).any():
                raise InvalidSubmission("two rows of this fetch share memory")

    # -- progress --------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if self.closed and not self.queue:
                    return
                attempt = self.queue.pop(0)
            self._move(attempt)

    def _move(self, attempt: FrozenAttempt) -> None:
        failure = ""
        for i, g in enumerate(attempt.view.groups):
            with self.cond:
                if attempt.stop or attempt.outcome is not None:
                    break
            if not g.rows:
                continue
            names = np.asarray(g.names)
            addresses = [g.region.base + int(s) * g.region.slot_bytes for s in g.slots]
            size = g.region.slot_bytes
            try:
                if attempt.op == "publish":
                    rows = [ctypes.string_at(a, size) for a in addresses]
                    held = self.end.put(attempt.namespace, g.group_id, names, rows)
                else:
                    found = self.end.get(attempt.namespace, g.group_id, names)
                    held = np.zeros(len(found), dtype=bool)
                    for j, data in enumerate(found):
                        if data is not None and len(data) == size:
                            ctypes.memmove(addresses[j], data, size)
                            held[j] = True
            except Exception as exc:
                failure = f"the store failed: {exc}"
                break
            with self.cond:
                attempt.moved[i][:] = held
        with self.cond:
            if attempt.outcome is None:
                masks = attempt._masks()
                attempt._conclude(self._failed(failure, masks, deadline=False) if failure else Outcome.delivered(masks))
            attempt.done = True
            self.live.remove(attempt)
            self.cond.notify_all()
        attempt._wake()

    def _clock(self) -> None:
        while True:
            due: list[FrozenAttempt] = []
            with self.cond:
                if self.closed:
                    return
                now = time.monotonic()
                for attempt in self.live:
                    if attempt.outcome is None and attempt.deadline <= now:
                        attempt.stop = True
                        attempt._conclude(self._failed("the deadline passed", attempt._masks(), deadline=True))
                        due.append(attempt)
                        if attempt in self.queue:  # never started: nothing of its memory is touched
                            self.queue.remove(attempt)
                            attempt.done = True
                            self.live.remove(attempt)
                pending = [a.deadline for a in self.live if a.outcome is None]
                if not due:
                    self.cond.wait(min(max(0.0, min(pending) - now), 60.0) if pending else None)
            for attempt in due:
                attempt._wake()

    # -- lifecycle -------------------------------------------------------------------------------

    def shutdown(self) -> frozenset[Attempt]:
        due = []
        with self.cond:
            self.is_shut = True
            for attempt in list(self.live):
                if attempt.outcome is None:
                    attempt.stop = True
                    attempt._conclude(self._shut_outcome(attempt._masks()))
                    due.append(attempt)
                if attempt in self.queue:
                    self.queue.remove(attempt)
                    attempt.done = True
                    self.live.remove(attempt)
            pending = frozenset[Attempt](self.live)
        for attempt in due:
            threading.Thread(target=attempt._wake, daemon=True).start()
        return pending

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


# -- the harness its author ships ------------------------------------------------------------------

_stores = itertools.count(1)


class FrozenHarness(Harness):
    name = "frozen-1.0"
    #: An attempt quiesces when the store call in progress for it returns: one copy here.
    quiesce_grace_s = 2.0
    backend_class: type[FrozenBackend] = FrozenBackend
    end_class: type[StoreEnd] = StoreEnd

    def capabilities(self) -> Capabilities:
        return Capabilities(VERSION, True, True, frozenset({MemoryKind.HOST}), OtherEnd.STORE, True, 16, True)

    def distribution(self) -> str:
        return f"{self.name} (a frozen third-party store, tests/frozen)"

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        if faults is not None and faults.schedule:
            raise Unavailable("this store injects faults by name only")
        store, gate = SharedStore(), Gate()
        source, sink = (self.backend_class(self.end_class(store, gate, faults), timeout_s=timeout_s,
                                           max_in_flight=max_in_flight or 16) for _ in range(2))
        hint = Hint.of("store", namespace=f"ns{next(_stores)}")
        return Ends(source, sink, hint, hint, hold=gate.hold, extra={"namespace": "default"})


harness = FrozenHarness()
