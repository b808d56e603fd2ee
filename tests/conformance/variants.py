"""Correct backends that use the freedoms the contract gives, the duals of the mutants: the suite
must pass every one, or it asks more than ``docs/contract.md`` does, and a third party's correct
backend that happens to behave this way would fail it. ``test_variants.py`` runs the whole suite
against each.

- :data:`late_reports`: shows each change a few milliseconds after it happened, conclusion and
  quiescence at different times and in either order (A2.6), from a timer thread (W1.5), each
  followed by a wake, plus wakes that report nothing (W1.8); ``shutdown()`` names the attempts
  that have not shown quiescence yet (B3.3). :data:`late_reports_peer` does the same for the
  serving peer, answers included.
- :data:`threaded_chunks`: the memory store's rows moved one small chunk per driver call on three
  worker threads, none inside the holder's call (A9: batching and order are the backend's).
- :data:`queue_of_one`: a memory backend that declares and keeps ``max_in_flight = 1`` (S3.9).
- :data:`speaks_1_0`: the memory backend as a plugin written against contract 1.0 would be: it
  declares ``(1, 0)``, no optional protocol of 1.1 (``lookup``), and no cause on a failed outcome
  (A10.5).

Point the suite at one with ``--kvwire-harness tests/conformance/variants.py:NAME``."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from kvwire_memory.harness import MemoryHarness
from loopback_peer import LoopbackHarness  # beside this file; on sys.path when loaded as a harness
from mutants import Mutant, MutantHarness, PeerMutant, Wrapped

from kvwire.contract import (
    Attempt,
    Backend,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    Outcome,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.contract.lookup import LOOKUP

__all__ = ["late_reports", "late_reports_peer", "threaded_chunks", "queue_of_one", "speaks_1_0"]

log = logging.getLogger(__name__)


class _Timers:
    """One daemon thread that runs callbacks at their times (a heap), for every late attempt."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="kvwire-variant-timers", daemon=True).start()

    def at(self, delay_s: float, fn: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._order), fn))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:  # one attempt's trouble never stops the others' timers
                log.exception("a late-reports timer raised")


_timers = _Timers()


class _Late(Wrapped):
    """Shows the inner attempt's conclusion and quiescence each 0.2-3 ms after the inner attempt
    reports it, on the timer thread, then wakes the holder; a cancel before the conclusion shows
    concludes it cancelled, keeping the rows that had moved whole (A4.3, A4.7)."""

    def __init__(self, view: View, op: str, backend: Mutant, wake: WakeFn, rng: random.Random) -> None:
        self.view, self.op, self.backend = view, op, backend
        self.wake = wake
        self.rng = rng
        self.lock = threading.Lock()
        self.shown: Outcome | None = None
        self.shown_quiesced = False
        self.cancelled = False

    def start(self, inner: Attempt) -> None:
        self.inner = inner
        _timers.at(self.rng.uniform(0.0002, 0.001), self._quiet_wake)  # a wake that reports nothing (W1.8)
        self.inner_changed()  # an inner attempt may have moved inside the call (its wake comes later)

    def inner_changed(self) -> None:
        """The inner attempt's wake: catch up with it later, conclusion and quiescence apart."""
        _timers.at(self.rng.uniform(0.0002, 0.003), self._show_conclusion)
        _timers.at(self.rng.uniform(0.0002, 0.003), self._show_quiescence)

    def _show_conclusion(self) -> None:
        with self.lock:
            if self.shown is not None or (out := self.inner.poll()) is None:
                return
            self.shown = self._cancelled_if_asked(out)
        self._wake_twice()

    def _show_quiescence(self) -> None:
        with self.lock:
            if self.shown_quiesced or not self.inner.quiesced():
                return
            self.shown_quiesced = True
        self._wake_twice()

    def _cancelled_if_asked(self, out: Outcome) -> Outcome:
        if not self.cancelled or out.is_cancelled:
            return out
        return Outcome.cancelled(out.masks, reason="cancelled by the holder", cause=Cause.HOLDER_CANCELLED)

    def _wake_twice(self) -> None:
        self._quiet_wake()
        _timers.at(self.rng.uniform(0.0002, 0.002), self._quiet_wake)  # one more, reporting nothing (W1.8)

    def _quiet_wake(self) -> None:
        try:
            self.wake()
        except Exception:  # a raising wake never stops the backend (W1.7)
            pass

    def poll(self) -> Outcome | None:
        return self.shown

    def quiesced(self) -> bool:
        return self.shown_quiesced

    def cancel(self) -> None:
        with self.lock:
            if self.shown is not None or self.cancelled:
                return
            self.cancelled = True
        self.inner.cancel()
        # The cancelled conclusion does not wait for the other end (A4.4): it shows at once, and
        # its wake comes from the timer thread, never from inside this call (W1.6).
        with self.lock:
            out = self.inner.poll()
            if self.shown is None and out is not None:
                self.shown = self._cancelled_if_asked(out)
        _timers.at(0.0, self._wake_after_cancel)

    def _wake_after_cancel(self) -> None:
        self._show_conclusion()  # if the inner attempt concluded only now
        self._quiet_wake()


class LateReports(Mutant):
    """Every change shows a little late, from the timer thread, and wakes come also with nothing
    new; the attempts themselves are the correct backend's."""

    def __init__(self, inner: Backend, harness: MutantHarness) -> None:
        super().__init__(inner, harness)
        self.rng = random.Random(id(self))
        self.made: list[_Late] = []
        self.made_lock = threading.Lock()

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        with self.made_lock:
            # The queue bound counts attempts until they show both ends (S3.9), which here is
            # later than the inner backend frees their slots.
            self.made = [a for a in self.made if not (a.shown is not None and a.shown_quiesced)]
            bound = self.inner.capabilities().max_in_flight
            if len(self.made) >= bound:
                raise SubmissionRejected(f"{bound} attempts in flight, the declared bound; retry once one has "
                                         "concluded and quiesced")
        attempt = _Late(view, op, self, wake, random.Random(self.rng.random()))
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        attempt.start(call(view, hint, attempt.inner_changed))  # a refusal raises before any wake is set
        with self.made_lock:
            self.made.append(attempt)
        return attempt

    def shutdown(self) -> frozenset[Attempt]:
        self.inner.shutdown()
        with self.made_lock:
            return frozenset(a for a in self.made if not a.shown_quiesced)


class LateReportsPeer(LateReports, PeerMutant):
    """:class:`LateReports` for a serving peer: pulls and the answers to them alike."""


class _ThreadedChunks(MemoryHarness):
    """The memory store behind a blob backend that moves each row of a few KiB as its own chunk
    on one of three worker threads, none inside the holder's call."""

    name = "memory-threaded-chunks"
    blob_options: dict[str, Any] = {"workers": 3, "chunk_bytes": 4096, "inline_bytes": 0}

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float,
                   max_in_flight: int | None) -> Backend | None:
        return None  # every end built with blob_options


class _QueueOfOne(MemoryHarness):
    """The memory store behind a blob backend that takes one attempt at a time, unless a test
    asks for another bound."""

    name = "memory-queue-of-one"
    blob_options: dict[str, Any] = {"max_in_flight": 1}

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float,
                   max_in_flight: int | None) -> Backend | None:
        return None


class _Without1_1(Wrapped):
    """The correct attempt's outcomes, a failed one without its cause (a 1.0 backend has none;
    ``Outcome`` fills a cancelled one's from ``by_peer``)."""

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None or not out.is_failed:
            return out
        return Outcome(out.status, out.masks, out.reason, out.by_peer, None)


class Speaks1_0(Mutant):
    """Declares contract 1.0 and none of 1.1's additions: no ``lookup``, no causes."""

    attempt_type = _Without1_1

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:
        return dataclasses.replace(caps, contract_version=(1, 0), protocols=caps.protocols - {LOOKUP})

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())

    def lookup(self, groups: object, names: object, hint: Hint, timeout_s: float | None = None) -> Any:
        raise InvalidSubmission("this backend speaks contract 1.0: it does not declare the lookup protocol")


late_reports = MutantHarness("late-reports", LateReports)
late_reports_peer = MutantHarness("late-reports-peer", LateReportsPeer, inner=LoopbackHarness())
threaded_chunks = _ThreadedChunks()
queue_of_one = _QueueOfOne()
speaks_1_0 = MutantHarness("speaks-1-0", Speaks1_0)
