"""Holds and faults for a harness whose backend is not built on :class:`kvwire.blob.BlobBackend`.

:class:`kvwire.testing.stores.StoreHarness` gives blob backends holds and fault plans by wrapping
their :class:`~kvwire.blob.StoreDriver`. A backend written directly on the contract has no
driver, but it has some call to its other end (a store's put and get, a message to a peer). Its
harness wraps that call:

- :class:`Gate` is a :class:`~kvwire.testing.harness.Hold`. The harness runs each call to the
  other end inside ``with gate.passage(): ...``; while the gate is held every such call waits, and
  the gate counts the calls waiting and running, which is what ``waiting()`` and ``wait_idle()``
  report to the suite.
- :func:`faults_name` and :func:`faulted_rows` answer "does this :class:`FaultPlan` fault this
  name" for a fetch or a publish, so the harness can make the other end fail exactly those rows.
- :class:`CallFaults` applies a plan's ``schedule`` (the :mod:`kvwire.testing.faults` records,
  written in terms of store calls ``"put"``, ``"get"``, ``"exists"``, ``"remove"``) to any store
  whose calls take a batch of keys: each call asks :meth:`CallFaults.arrive` what to do.

Example, a store harness::

    gate = Gate()
    faults = CallFaults(plan.schedule)

    def get(names):
        with gate.passage():
            verdict = faults.arrive("get", len(names), evict=lambda rows: store.remove(names[rows]))
            if verdict.raises:
                raise RuntimeError(verdict.raises)
            reply = store.get(names)
            failed = verdict.failed | faulted_rows(plan, "fetch", names)
            ...

    Ends(..., hold=gate.hold)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvwire.testing.faults import Block, Decline, Evict, FailCall, FailKeys, Fault, Slow
from kvwire.testing.harness import FaultPlan, Hold

__all__ = ["Gate", "faults_name", "faulted_rows", "CallFaults", "CallVerdict"]

FetchOrPublish = Literal["fetch", "publish"]


class Gate(Hold):
    """A hold on every call that passes through :meth:`passage`. Not held when made; a harness
    hands :meth:`hold` to :attr:`kvwire.testing.harness.Ends.hold`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._waiting = 0
        self._running = 0

    def hold(self) -> Gate:
        """Start holding: calls that enter :meth:`passage` from now on wait until :meth:`release`."""
        with self._cond:
            self._held = True
        return self

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    @property
    def held(self) -> bool:
        with self._cond:
            return self._held

    def waiting(self) -> int:
        with self._cond:
            return self._waiting

    def running(self) -> int:
        """How many calls are past the gate and not yet out of it."""
        with self._cond:
            return self._running

    def wait_idle(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting == 0 and self._running == 0, timeout=timeout_s)

    @contextlib.contextmanager
    def passage(self) -> Iterator[None]:
        """Wrap one call to the other end: wait while held, then count the call as running until
        the block ends (however it ends)."""
        with self._cond:
            if self._held:
                self._waiting += 1
                self._cond.notify_all()
                try:
                    self._cond.wait_for(lambda: not self._held)
                finally:
                    self._waiting -= 1
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def __repr__(self) -> str:
        state = "held" if self._held else "open"
        return f"<Gate {state}, {self._waiting} waiting, {self._running} running>"


def faults_name(plan: FaultPlan | None, op: FetchOrPublish, name: bytes) -> bool:
    """Whether ``plan`` makes the other end fail a ``op`` ("fetch" or "publish") of the row
    named ``name``."""
    if plan is None:
        return False
    if op not in ("fetch", "publish"):
        raise ValueError(f"a FaultPlan faults 'fetch' or 'publish', got {op!r}")
    return bytes(name) in (plan.fetch if op == "fetch" else plan.publish)


def faulted_rows(plan: FaultPlan | None, op: FetchOrPublish, names: np.ndarray | None) -> np.ndarray:
    """One bool per row of ``names`` (shape ``(rows, width)`` uint8): whether ``plan`` fails a
    ``op`` of that row. All false for no plan, or for rows without names (``None``: zero rows)."""
    if names is None:
        return np.zeros(0, dtype=bool)
    names = np.ascontiguousarray(names, dtype=np.uint8)
    if names.ndim != 2:
        raise ValueError(f"names must have shape (rows, width), got {names.shape}")
    if op not in ("fetch", "publish"):
        raise ValueError(f"a FaultPlan faults 'fetch' or 'publish', got {op!r}")
    listed = sorted(n for n in (() if plan is None else (plan.fetch if op == "fetch" else plan.publish))
                    if len(n) == names.shape[1])
    if not listed or names.shape[0] == 0:
        return np.zeros(names.shape[0], dtype=bool)
    # Compare whole names at once: each row as one opaque item of `width` bytes.
    as_items = names.view(np.dtype((np.void, names.shape[1]))).ravel()
    wanted = np.frombuffer(b"".join(listed), dtype=np.uint8).reshape(len(listed), -1)
    return np.isin(as_items, wanted.view(np.dtype((np.void, names.shape[1]))).ravel())


@dataclass(frozen=True, slots=True)
class CallVerdict:
    """What a fault schedule does to one call of ``rows`` keys: ``raises`` (the call raises, with
    this text), else the rows ``failed`` (the other end answers a fault for them, ``reason``) and
    ``declined`` (a put refused for space: not stored, no fault). Rows in neither proceed."""

    raises: str | None
    failed: np.ndarray
    declined: np.ndarray
    reason: str = ""

    @property
    def proceed(self) -> np.ndarray:
        """The rows the call should really perform."""
        return ~(self.failed | self.declined)


class CallFaults:
    """Applies a :class:`FaultPlan` ``schedule`` to a store's calls, counted per operation from 1
    in arrival order, as :class:`~kvwire.testing.faults.FaultyDriver` does for a driver. ``Slow``
    sleeps and ``Block`` waits inside :meth:`arrive` (that is the fault: a slow or stuck store);
    ``Evict`` calls ``evict`` with the rows to remove before the call proceeds."""

    def __init__(self, schedule: Sequence[Fault] = ()) -> None:
        self.schedule: tuple[Fault, ...] = tuple(schedule)
        for fault in self.schedule:
            if not isinstance(fault, (FailCall, FailKeys, Decline, Evict, Block, Slow)):
                raise TypeError(f"not a kvwire.testing.faults record: {fault!r}")
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()

    def __bool__(self) -> bool:
        return bool(self.schedule)

    def calls(self, op: str) -> int:
        """How many calls of ``op`` have arrived."""
        with self._lock:
            return self._calls[op]

    def release_all(self) -> None:
        """Let every :class:`Block` of the schedule go (a harness calls this when it closes)."""
        for fault in self.schedule:
            if isinstance(fault, Block):
                fault.release.set()

    def arrive(self, op: str, rows: int, evict: Callable[[np.ndarray], None] | None = None) -> CallVerdict:
        """Count a call of ``op`` on ``rows`` keys and say what the schedule does to it."""
        with self._lock:
            self._calls[op] += 1
            number = self._calls[op]
        hits = [f for f in self.schedule if f.op == op and (f.call is None or f.call == number)]
        for fault in hits:
            if isinstance(fault, Slow) and fault.delay_s:
                time.sleep(fault.delay_s)
        for fault in hits:
            if isinstance(fault, Block):
                fault.release.wait()
        for fault in hits:
            if isinstance(fault, Evict) and evict is not None:
                doomed = np.arange(rows)[fault.start:fault.stop]
                if doomed.size:
                    evict(doomed)
        failed = np.zeros(rows, dtype=bool)
        declined = np.zeros(rows, dtype=bool)
        whole = next((f for f in hits if isinstance(f, FailCall)), None)
        if whole is not None:
            if whole.raises:
                return CallVerdict(whole.reason, failed, declined, whole.reason)
            failed[:] = True
            return CallVerdict(None, failed, declined, whole.reason)
        reason = ""
        for fault in hits:
            if isinstance(fault, FailKeys):
                hit = np.zeros(rows, dtype=bool)
                hit[fault.start:fault.stop] = True
                failed |= hit & ~declined
                reason = reason or fault.reason
            elif isinstance(fault, Decline):
                hit = np.zeros(rows, dtype=bool)
                hit[fault.start:fault.stop] = True
                declined |= hit & ~failed
        return CallVerdict(None, failed, declined, reason or "injected fault")
