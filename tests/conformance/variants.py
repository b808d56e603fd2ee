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
- :data:`queue_of_one`: a memory backend that declares and keeps ``max_in_flight = 1`` (S3.9);
  :data:`queue_of_one_peer` the reference serving peer with a queue of one whatever a test asks.
- :data:`speaks_1_0`: the memory backend as a plugin written against contract 1.0 would be: it
  declares ``(1, 0)``, no optional protocol of 1.1 (``lookup``), and no cause on a failed outcome
  (A10.5).
- :data:`without_cancellation` (and ``_peer``): declares no cancellation; ``cancel()`` does
  nothing and the attempt ends on its own (B4.5).
- :data:`wakes_from_many_threads` (and ``_peer``): each wake comes four times at once, from four
  threads (W1.5, W1.8).
- :data:`forgets_moved_rows` (and ``_peer``): a failed or cancelled outcome marks no row, whatever
  moved (A5.12, A4.7 and A8.6 bound its true bits from above only).
- :data:`fetch_only`, :data:`publish_only`: declare one direction and refuse the other (B4.4).
- :data:`device_only`: declares DEVICE memory only; without a CUDA device every test that needs
  memory must skip (M1, B4.8).
- :data:`gives_up` (and ``_peer``): fails with cause ``FAULT`` an attempt the other end leaves
  unanswered for a second, before a longer deadline (A5.9, A10.9).
- :data:`keeps_its_own_bound`: a queue bound of 3, whatever bound a test asks the harness for.
- :data:`replacing_store`: a store that keeps the last bytes published under a name (A5.11,
  N1.1).
- :data:`splits_views`: each view moved as three inner submissions, rows and groups reordered,
  checked whole first so refusals still let nothing escape (A9.1-A9.4, S3.3).
- :data:`slow_to_stop`: an attempt that did not deliver quiesces a while after it concluded, within
  a grace its harness documents (A2.6, A4.5, A8.3); :data:`slower_than_patience` takes longer than
  the short patience ``test_variants.py`` runs it with, still within its documented grace.

Not a variant: a store that declines rows for space within the 32 MiB the harness API asks a
store to take (``Harness.open``); the suite's exchanges rely on it, as a miss must be the suite's
doing.

Point the suite at one with ``--kvwire-harness tests/conformance/variants.py:NAME``.

Why one file of this size: as for the mutants, the suite is pointed at each variant by
``path:object``, and each is a short subclass beside the wrappers the others share."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kvwire_memory import MemoryDriver
from kvwire_memory.harness import MemoryHarness
from loopback_peer import LoopbackHarness  # beside this file; on sys.path when loaded as a harness
from mutants.kit import Mutant, MutantHarness, PeerMutant, Wrapped  # the mutants' kit, beside this file

from kvwire.blob import BatchResult, StoreDriver
from kvwire.contract import (
    OFFER_PULLS,
    Attempt,
    Backend,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    SlotRegion,
    SubmissionRejected,
    View,
    WakeFn,
    block_layout,
)
from kvwire.contract.backend import Registration
from kvwire.contract.blocks import BLOCKS_FIELD
from kvwire.contract.lookup import LOOKUP
from kvwire.contract.regions import RegionTable, TableRegistration
from kvwire.testing.harness import Ends, FaultPlan

__all__ = ["late_reports", "late_reports_peer", "threaded_chunks", "queue_of_one", "queue_of_one_peer", "speaks_1_0",
           "without_cancellation", "without_cancellation_peer", "wakes_from_many_threads",
           "wakes_from_many_threads_peer", "forgets_moved_rows", "forgets_moved_rows_peer", "fetch_only",
           "publish_only", "device_only", "gives_up", "gives_up_peer", "keeps_its_own_bound",
           "replacing_store", "splits_views", "slow_to_stop", "slower_than_patience"]

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


class _QueueOfOnePeer(LoopbackHarness):
    """The reference serving peer with a queue of one, whatever bound a test asks for (a harness
    may keep a smaller bound than asked, S3.9): tests that need two pulls in flight skip."""

    name = "reference-peer-queue-of-one"
    max_in_flight = 1

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        return super().open(timeout_s=timeout_s, max_in_flight=1, faults=faults, hold=hold)


late_reports = MutantHarness("late-reports", LateReports)
late_reports_peer = MutantHarness("late-reports-peer", LateReportsPeer, inner=LoopbackHarness())
threaded_chunks = _ThreadedChunks()
queue_of_one = _QueueOfOne()
queue_of_one_peer = _QueueOfOnePeer()
speaks_1_0 = MutantHarness("speaks-1-0", Speaks1_0)


# -- round two: more freedoms ----------------------------------------------------------------------

class _CancelIgnored(Wrapped):
    """The correct attempt, whose ``cancel()`` returns at once and does nothing."""

    def cancel(self) -> None:
        pass  # nothing to stop: the attempt runs to its own conclusion (B4.5)


class WithoutCancellation(Mutant):
    """Declares no cancellation; ``cancel()`` returns at once, does nothing, and the attempt
    concludes and quiesces on its own (B4.5 allows a backend without cancellation)."""

    attempt_type = _CancelIgnored

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:
        return dataclasses.replace(caps, cancellation=False)

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())


class WithoutCancellationPeer(WithoutCancellation, PeerMutant):
    """:class:`WithoutCancellation` for a serving peer. It cannot declare standing offers (O1.1
    asks for cancellation), so it refuses ``offer()`` as an undeclared protocol (B4.7)."""

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:
        return dataclasses.replace(caps, cancellation=False, protocols=caps.protocols - {OFFER_PULLS})

    def offer(self, view: View, wake: WakeFn, timeout_s: float | None = None) -> Attempt:
        raise InvalidSubmission("this backend does not declare offer-pulls (it has no cancellation)")


class _WakePool:
    """Four daemon threads; :meth:`fan` has each of them call a wake, so one change is reported
    by four wakes at once from four threads."""

    THREADS = 4

    def __init__(self) -> None:
        self._queues: list[queue.SimpleQueue[WakeFn]] = []
        for i in range(self.THREADS):
            q: queue.SimpleQueue[WakeFn] = queue.SimpleQueue()
            self._queues.append(q)
            threading.Thread(target=self._run, args=(q,), name=f"kvwire-variant-wake{i}", daemon=True).start()

    def fan(self, wake: WakeFn) -> None:
        for q in self._queues:
            q.put(wake)

    @staticmethod
    def _run(q: queue.SimpleQueue[WakeFn]) -> None:
        while True:
            wake = q.get()
            try:
                wake()
            except Exception:  # a raising wake never stops the backend (W1.7)
                log.exception("a holder's wake raised")


_wake_pool = _WakePool()


class WakesFromManyThreads(Mutant):
    """Each wake of the correct backend becomes four, called at once from four threads of a pool
    (W1.5: any of its threads; W1.8: wakes that report nothing new), never inside the holder's
    call, since the inner wake never is (W1.6)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        return self.attempt_type(call(view, hint, lambda: _wake_pool.fan(wake)), view, op, self)


class WakesFromManyThreadsPeer(WakesFromManyThreads, PeerMutant):
    """:class:`WakesFromManyThreads` for a serving peer, the serve wake included."""

    def serve(self, wake: WakeFn) -> None:
        self.serving.serve(lambda: _wake_pool.fan(wake))


class _ForgetsMovedRows(Wrapped):
    """A failed or cancelled outcome with every bit false; a delivered one as it is."""

    def poll(self) -> Outcome | None:
        shown = self.__dict__.get("shown")
        if shown is not None:
            return shown
        out = self.inner.poll()
        if out is None or out.is_delivered:
            return out
        masks = self.view.row_masks()
        shown = self.__dict__["shown"] = Outcome(out.status, masks, out.reason, out.by_peer, out.cause)
        return shown


class ForgetsMovedRows(Mutant):
    """A backend that does not track which rows moved before an attempt failed or was cancelled:
    it reports none of them (A5.12, A4.7, A8.6: such an outcome's true bits are rows that moved
    whole, which need not be every row that did; a delivered outcome stays exact, A5.10)."""

    attempt_type = _ForgetsMovedRows


class ForgetsMovedRowsPeer(ForgetsMovedRows, PeerMutant):
    """:class:`ForgetsMovedRows` for a serving peer, answers included."""


class OneDirection(Mutant):
    """Declares only the direction :attr:`KEEPS` and refuses the other with ``InvalidSubmission``
    before anything escapes (B4.1 lets a backend declare either direction; B4.4, S3.2)."""

    KEEPS = "fetch"

    @classmethod
    def declare(cls, caps: Capabilities) -> Capabilities:  # type: ignore[override]
        return dataclasses.replace(caps, fetch=cls.KEEPS == "fetch", publish=cls.KEEPS == "publish")

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if op != self.KEEPS:
            raise InvalidSubmission(f"this backend does not {op}: it declares only {self.KEEPS}")
        return super().submit(op, view, hint, wake)


class FetchOnly(OneDirection):
    """Fetches only (a reader of a store another system fills)."""


class PublishOnly(OneDirection):
    """Publishes only (a writer that never reads back, and asks with ``lookup`` what the store
    holds already: L1 needs no fetch)."""

    KEEPS = "publish"


class DeviceOnly(Mutant):
    """Declares DEVICE memory only, and refuses HOST regions and rows as undeclared memory. It
    moves nothing itself: on a machine without a CUDA device every test that needs memory must
    skip, which is what it checks (the inner memory store reaches HOST memory only). M1.3 lets a
    backend list any memory kinds; M1.4 and M3.3 refuse the others."""

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:
        return dataclasses.replace(caps, memory_kinds=frozenset({MemoryKind.DEVICE}))

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        for region in regions:
            if region.memory_kind is not MemoryKind.DEVICE:
                kind = region.memory_kind.value
                raise InvalidSubmission(f"region {region.region_id} is {kind} memory; this backend reaches "
                                        "DEVICE memory only")
        return super().register_regions(regions)

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        for group in view.groups:
            if group.region.memory_kind is not MemoryKind.DEVICE:
                kind = group.region.memory_kind.value
                raise InvalidSubmission(f"group {group.group_id} lends {kind} memory; this backend reaches "
                                        "DEVICE memory only")
        return super().submit(op, view, hint, wake)


class _GivesUp(Wrapped):
    """The correct attempt, failed with cause ``FAULT`` (no rows marked) when it has not
    concluded :attr:`LIMIT_S` after the submission, as a client with its own request timeout
    fails a call the other end never answers; the inner attempt is cancelled then, and this
    quiesces when it does."""

    LIMIT_S = 1.0

    def __init__(self, inner: Attempt, view: View, op: str, backend: Mutant) -> None:
        super().__init__(inner, view, op, backend)
        # The timer thread and the holder both call the inner attempt; it takes one caller at a time (B2.1).
        self.lock = threading.Lock()
        self.given_up: Outcome | None = None
        self.wake: WakeFn = lambda: None

    def start(self, wake: WakeFn) -> None:
        self.wake = wake
        _timers.at(self.LIMIT_S, self._give_up)

    def _give_up(self) -> None:
        with self.lock:
            if self.given_up is not None or self.inner.poll() is not None:
                return
            reason = f"the other end did not answer within {self.LIMIT_S:g} s; the client gave up"
            self.given_up = Outcome.failed(reason, self.view.row_masks(), cause=Cause.FAULT)
            self.inner.cancel()  # its quiescence, and a wake after it, are the inner attempt's
        try:
            self.wake()
        except Exception:  # a raising wake never stops the backend (W1.7)
            log.exception("a holder's wake raised")

    def poll(self) -> Outcome | None:
        with self.lock:
            return self.given_up if self.given_up is not None else self.inner.poll()

    def quiesced(self) -> bool:
        with self.lock:
            return self.inner.quiesced()

    def cancel(self) -> None:
        with self.lock:
            if self.given_up is None:
                self.inner.cancel()


class GivesUp(Mutant):
    """Fails an attempt the other end leaves unanswered for a second, before a longer deadline,
    instead of waiting for it: a store client's own request timeout, a fault (A5.9, A10.9); the
    deadline only bounds when an attempt concludes (A8.2). In the quick suite it gives up on the
    held fetch of ``test_A8_a_held_attempt_concludes_at_its_deadline_not_later`` (deadline 2 s)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        attempt = super().make(op, view, hint, wake)
        assert isinstance(attempt, _GivesUp)
        attempt.start(wake)
        return attempt

    attempt_type = _GivesUp


class GivesUpPeer(GivesUp, PeerMutant):
    """:class:`GivesUp` for a serving peer: a pull the serving holder leaves unanswered fails."""


class _KeepsItsOwnBound(MemoryHarness):
    """The memory store behind a blob backend whose queue bound is always :attr:`BOUND`, whatever
    bound a test asks the harness for (the harness API lets ``open`` ignore ``max_in_flight``; the
    suite reads the bound from ``capabilities()``, S3.9, B4.3)."""

    name = "memory-own-bound"
    BOUND = 3
    blob_options: dict[str, Any] = {"max_in_flight": BOUND}

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        return super().open(timeout_s=timeout_s, max_in_flight=None, faults=faults, hold=hold)

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float,
                   max_in_flight: int | None) -> Backend | None:
        return None


class _ReplacingDriver(StoreDriver):
    """A memory driver whose put under a name already stored replaces the object's bytes with the
    new ones (removed, then stored again) instead of keeping the first. The replacement is atomic
    to readers (one lock around it and around reads): a name stored before a read began is never
    seen missing in the middle of a replacement, which would be a miss the suite rightly fails
    (A5; seen once in a CI run, under load, by the stateful holder model)."""

    def __init__(self, inner: MemoryDriver) -> None:
        self.inner = inner
        self.memory_kinds = inner.memory_kinds
        self.inline_bytes = inner.inline_bytes
        self._replacing = threading.Lock()

    def register(self, regions: Sequence[SlotRegion]) -> None:
        self.inner.register(regions)

    def unregister(self, regions: Sequence[SlotRegion]) -> None:
        self.inner.unregister(regions)

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        with self._replacing:
            there = [k for k, held in zip(keys, self.inner.exists(keys).tolist(), strict=True) if held]
            if there:
                self.inner.remove(there)
            return self.inner.put(keys, addresses, sizes)

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        with self._replacing:
            return self.inner.get_into(keys, addresses, sizes)

    def exists(self, keys: Sequence[str]) -> np.ndarray:
        with self._replacing:
            return self.inner.exists(keys)

    def contains(self, keys: Sequence[str]) -> BatchResult:
        with self._replacing:
            return self.inner.contains(keys)


    def remove(self, keys: Sequence[str]) -> BatchResult:
        return self.inner.remove(keys)

    def close(self) -> None:
        self.inner.close()


class _ReplacingStore(MemoryHarness):
    """The memory store behind a blob backend whose driver keeps the last bytes published under a
    name, not the first (A5.11: the store *may* keep the bytes it has; N1.1: equal names mean
    interchangeable bytes). A row it held counts as held either way."""

    name = "memory-replacing-store"

    def driver(self, store: Any) -> StoreDriver:
        inner = super().driver(store)
        assert isinstance(inner, MemoryDriver)
        return _ReplacingDriver(inner)

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float,
                   max_in_flight: int | None) -> Backend | None:
        return None


class _Parts(Attempt):
    """One view moved as :attr:`SplitsViews.PARTS` inner attempts: part ``k`` holds rows
    ``k, k + 3, ...`` of each group, those rows in reverse order and the groups in reverse order.
    It concludes when every part has, and quiesces when every part has."""

    def __init__(self, view: View, parts: list[Attempt], rows: list[list[tuple[int, np.ndarray]]]) -> None:
        self.view = view
        self.parts = parts
        #: Per part: (view group index, that group's rows in the part, in the part's order) per part group.
        self.rows = rows
        self.cancelled = False
        self.shown: Outcome | None = None

    def poll(self) -> Outcome | None:
        if self.shown is not None:
            return self.shown
        outs = [part.poll() for part in self.parts]
        if any(out is None for out in outs):
            return None
        masks = self.view.row_masks()
        for out, rows in zip(outs, self.rows, strict=True):
            assert out is not None
            for mask, (gi, idx) in zip(out.masks, rows, strict=True):
                masks[gi][idx] = mask
        failed = [o for o in outs if o is not None and o.is_failed]
        stopped = [o for o in outs if o is not None and o.is_cancelled]
        by_shutdown = [o for o in failed + stopped if o.cause is Cause.SHUTDOWN]
        if self.cancelled:  # the holder cancelled before every part had concluded (A4.3)
            shown = Outcome.cancelled(masks, reason="cancelled by the holder", cause=Cause.HOLDER_CANCELLED)
        elif failed:
            first = failed[0]
            cause = Cause.SHUTDOWN if by_shutdown else first.cause
            shown = Outcome.failed(first.reason or "a part failed", masks, cause=cause)
        elif stopped:
            first = by_shutdown[0] if by_shutdown else stopped[0]
            shown = Outcome.cancelled(masks, by_peer=first.by_peer, reason=first.reason, cause=first.cause)
        else:
            shown = Outcome.delivered(masks)
        self.shown = shown
        return shown

    def quiesced(self) -> bool:
        return all(part.quiesced() for part in self.parts)

    def cancel(self) -> None:
        if self.poll() is None:
            self.cancelled = True
        for part in self.parts:
            part.cancel()


class _Mirrored(Registration):
    """The inner backend's registration and the same batch in the splitter's own table."""

    def __init__(self, inner: Registration, entry: TableRegistration) -> None:
        self.inner = inner
        self.entry = entry

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self.inner.regions

    def close(self) -> None:
        self.entry.close()
        self.inner.close()


def _fits_block_objects(view: View, hint: Hint) -> None:
    """K1.3 for a whole view with the store hint field ``blocks``, before any part of it escapes
    (each part, a subset of the blocks in every group, fits when the whole does)."""
    fields = dict(hint.fields) if isinstance(hint, Hint) else {}
    if BLOCKS_FIELD not in fields:
        return
    names = [g.names for g in view.groups if g.rows]
    if fields[BLOCKS_FIELD] != block_layout(view) or len({g.rows for g in view.groups}) > 1 or any(
            n is None or n.shape != names[0].shape or (n != names[0]).any() for n in names):  # type: ignore[union-attr]
        raise InvalidSubmission(f"this view does not fit block objects (K1.3): {BLOCKS_FIELD} must be its layout "
                                f"{block_layout(view)!r}, its groups of one length and named alike")


class SplitsViews(Mutant):
    """Moves each view of a store as three inner submissions, rows and groups reordered (A9.1-A9.4:
    batching, splitting and order are the backend's), and checks the whole view (its own region
    table, overlap, queue bound) before the first, so a refusal still lets nothing escape (S3.3).
    It declares a third of the inner queue bound, so its bound holds (S3.9, S3.10)."""

    PARTS = 3

    def __init__(self, inner: Backend, harness: MutantHarness) -> None:
        super().__init__(inner, harness)
        self.table = RegionTable(inner.capabilities().memory_kinds)
        self.made: list[_Parts] = []
        #: Parts of a view whose later part was refused after the first was taken.
        self.stray: list[Attempt] = []
        self.shut = False

    @classmethod
    def declare(cls, caps: Capabilities) -> Capabilities:  # type: ignore[override]
        return dataclasses.replace(caps, max_in_flight=max(1, caps.max_in_flight // cls.PARTS))

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        inner = self.inner.register_regions(regions)
        return _Mirrored(inner, self.table.register(regions))

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if self.shut:
            raise SubmissionRejected("the backend is shut down")
        bound = self.capabilities().max_in_flight
        self.made = [a for a in self.made if not (a.poll() is not None and a.quiesced())]
        if len(self.made) >= bound:
            raise SubmissionRejected(f"{bound} attempts in flight, the declared bound; retry once one has "
                                     "concluded and quiesced")
        if not isinstance(view, View):
            raise InvalidSubmission(f"a submission takes a View, got {type(view).__name__}")
        self.table.locate_view(view)  # every row recognized (M4), before any part escapes
        if op == "fetch" and view.overlapping_rows() is not None:
            raise InvalidSubmission("rows of this fetch overlap; a fetch writes each byte once (V4)")
        _fits_block_objects(view, hint)
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        parts: list[Attempt] = []
        rows: list[list[tuple[int, np.ndarray]]] = []
        for k in range(self.PARTS):
            groups, where = [], []
            for gi in reversed(range(len(view.groups))):
                g = view.groups[gi]
                idx = np.arange(k, g.rows, self.PARTS)[::-1]
                if k and not idx.size:
                    continue  # the first part carries every group, so its checks cover the whole view
                groups.append(LayerGroupRows(g.group_id, g.kind, g.region, g.slots[idx], g.tokens,
                                             None if g.names is None else g.names[idx]))
                where.append((gi, idx))
            if k and not groups:
                continue
            try:
                parts.append(call(View(tuple(groups)), hint, wake))
            except Exception:
                if parts:  # the first part was taken: shutdown() accounts for it until it quiesces (S4.3)
                    for part in parts:
                        part.cancel()
                    self.stray.extend(parts)
                    raise RuntimeError("a later part of a split view was refused after the first was "
                                       "taken; the parts taken are cancelled") from None
                raise
            rows.append(where)
        attempt = _Parts(view, parts, rows)
        self.made.append(attempt)
        return attempt

    def shutdown(self) -> frozenset[Attempt]:
        self.shut = True
        self.inner.shutdown()
        return frozenset(a for a in [*self.made, *self.stray] if not a.quiesced())


class _SplitHarness(MutantHarness):
    """:class:`SplitsViews` over the memory store, whose inner queue takes three times the bound a
    test asks for."""

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        inner_bound = None if max_in_flight is None else max_in_flight * SplitsViews.PARTS
        return super().open(timeout_s=timeout_s, max_in_flight=inner_bound, faults=faults, hold=hold)


class _SlowToStop(Wrapped):
    """The correct attempt, except that one which did not deliver shows its quiescence
    its backend's :attr:`SlowToStop.STOP_S` after the inner attempt quiesced, as a NIC that finishes its queue
    after a cancel or a fault; a wake follows from the timer thread."""

    def __init__(self, inner: Attempt, view: View, op: str, backend: Mutant) -> None:
        super().__init__(inner, view, op, backend)
        self.lock = threading.Lock()  # the timer thread and the holder both call the inner attempt (B2.1)
        self.stopped = False
        self.timing = False
        self.wake: WakeFn = lambda: None

    def inner_changed(self) -> None:
        """The inner attempt's wake: start the stop timer if it is due, and pass the wake on."""
        self.check()
        self.wake()

    def check(self) -> None:
        """Start the stop timer once the inner attempt has quiesced without delivering."""
        with self.lock:
            out = self.inner.poll()
            start = out is not None and not out.is_delivered and self.inner.quiesced() and not self.timing
            self.timing = self.timing or start
        if start:
            _timers.at(type(self.backend).STOP_S, self._stop)

    def _stop(self) -> None:
        with self.lock:
            self.stopped = True
        self.wake()

    def poll(self) -> Outcome | None:
        with self.lock:
            return self.inner.poll()

    def quiesced(self) -> bool:
        with self.lock:
            if not self.inner.quiesced():
                return False
            out = self.inner.poll()
            return self.stopped or (out is not None and out.is_delivered)

    def cancel(self) -> None:
        with self.lock:
            self.inner.cancel()


class SlowToStop(Mutant):
    """An attempt that failed or was cancelled quiesces :attr:`STOP_S` after its inner one did
    (A2.6: a failure may conclude before every writer stopped; A4.5, A8.3: within the documented
    grace, which its harness states that much longer). Its queue counts attempts until they show
    both ends (S3.9)."""

    STOP_S = 0.05

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        # The queue bound counts attempts until they show both ends (S3.9), which here is later
        # than the inner backend frees their slots.
        live = [a for a in self._attempts() if not (a.poll() is not None and a.quiesced())]
        self.__dict__["_made"] = live
        bound = self.inner.capabilities().max_in_flight
        if len(live) >= bound:
            raise SubmissionRejected(f"{bound} attempts in flight, the declared bound; retry once one has "
                                     "concluded and quiesced")
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        attempt = _SlowToStop.__new__(_SlowToStop)
        holder_wake = wake
        # The inner attempt may wake before make() returns; it sees the attempt once it exists.
        made: list[_SlowToStop] = []
        inner = call(view, hint, lambda: made[0].inner_changed() if made else holder_wake())
        _SlowToStop.__init__(attempt, inner, view, op, self)
        attempt.wake = holder_wake
        made.append(attempt)
        attempt.check()  # the inner attempt may have ended inside the call; no wake in here (W1.6)
        return attempt

    def shutdown(self) -> frozenset[Attempt]:
        self.inner.shutdown()
        return frozenset(a for a in self._attempts() if not a.quiesced())


class SlowerThanPatience(SlowToStop):
    """:class:`SlowToStop` with a stop longer than a short patience the suite is run with
    (``--kvwire-patience``): the documented grace, not the patience, bounds the wait for
    quiescence (A8.3)."""

    STOP_S = 3.0


class _SlowToStopHarness(MutantHarness):
    """:class:`SlowToStop` (or a subclass) over the memory store, with the grace it needs
    documented."""

    def __init__(self, name: str = "slow-to-stop", backend: type[SlowToStop] = SlowToStop) -> None:
        super().__init__(name, backend)
        self.quiesce_grace_s = self.inner.quiesce_grace_s + backend.STOP_S

without_cancellation = MutantHarness("without-cancellation", WithoutCancellation)
without_cancellation_peer = MutantHarness("without-cancellation-peer", WithoutCancellationPeer,
                                          inner=LoopbackHarness())
wakes_from_many_threads = MutantHarness("wakes-from-many-threads", WakesFromManyThreads)
wakes_from_many_threads_peer = MutantHarness("wakes-from-many-threads-peer", WakesFromManyThreadsPeer,
                                             inner=LoopbackHarness())
forgets_moved_rows = MutantHarness("forgets-moved-rows", ForgetsMovedRows)
forgets_moved_rows_peer = MutantHarness("forgets-moved-rows-peer", ForgetsMovedRowsPeer,
                                        inner=LoopbackHarness())

fetch_only = MutantHarness("fetch-only", FetchOnly)
publish_only = MutantHarness("publish-only", PublishOnly)
device_only = MutantHarness("device-only", DeviceOnly)
gives_up = MutantHarness("gives-up", GivesUp)
gives_up_peer = MutantHarness("gives-up-peer", GivesUpPeer, inner=LoopbackHarness())

keeps_its_own_bound = _KeepsItsOwnBound()
replacing_store = _ReplacingStore()
splits_views = _SplitHarness("splits-views", SplitsViews)
slow_to_stop = _SlowToStopHarness()
slower_than_patience = _SlowToStopHarness("slower-than-patience", SlowerThanPatience)
