"""What the reference store and the reference peer share: what they declare
(:func:`reference_capabilities`), an attempt's two states (its outcome and its access to memory),
the backend's threads (:class:`Runner`), and moving rows between registered memory and plain
arrays.

Every rule about *when* an attempt changes is here, once:

- A1: the outcome is set once, under the backend's lock, and ``poll()`` only reads it.
- A2: access to the view's memory goes ``WAITING -> TOUCHING -> WAITING ... -> ENDED``; it ends
  only when no thread of the backend is inside the view's memory, and never comes back.
- A3: workers and the clock thread move every attempt forward; nothing waits for ``poll()``.
- A8: each attempt's deadline is fixed at submission; the clock thread concludes it then.
- W1: a change is made under the lock, and its wake is called after the lock is released, from a
  backend thread (never from inside a holder's call into the backend).
- S3/B4: an attempt takes one slot of the bounded queue from submission until it has both
  concluded and ended its access.

Independent on purpose: this lifecycle does not use :class:`kvwire.attempts.AttemptTable`, which
the blob family and kvwire-ucx share. The reference backends are the second implementation the
conformance suite is checked against, so a fault in the shared table cannot hide in both."""

from __future__ import annotations

import ctypes
import enum
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from kvwire import waiting
from kvwire.contract import (
    BLOCK_OBJECTS,
    LOOKUP,
    SERVE_PULLS,
    Attempt,
    Capabilities,
    Cause,
    MemoryKind,
    OtherEnd,
    Outcome,
    OutcomeStatus,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.contract.regions import Located

__all__ = ["Access", "ReferenceAttempt", "Runner", "read_rows", "reference_capabilities", "write_rows"]


#: The contract version the reference backends implement, a literal (docs/contract.md, Versions),
#: as a backend author writes it. They are kvwire's own second implementation of the contract,
#: kept beside the suite so that every suite test is checked against a backend written directly
#: on the text: each new version's clauses are implemented here before this is raised.
CONTRACT = (1, 3)


def reference_capabilities(other_end: OtherEnd, max_in_flight: int) -> Capabilities:
    """What a reference backend declares: fetch and publish of named blocks in host memory, with
    cancellation; a peer also serves pulls (N2); a store also answers lookups (L1) and keeps block
    objects (K1)."""
    return Capabilities(
        contract_version=CONTRACT,
        fetch=True,
        publish=True,
        memory_kinds=frozenset({MemoryKind.HOST}),
        other_end=other_end,
        content_addressed=True,
        max_in_flight=max_in_flight,
        cancellation=True,
        protocols=frozenset({SERVE_PULLS}) if other_end is OtherEnd.PEER else frozenset({LOOKUP, BLOCK_OBJECTS}),
    )

log = logging.getLogger(__name__)


class Access(enum.Enum):
    """Whether the backend may touch the attempt's memory (A2)."""

    #: Submitted; no backend thread is inside the view's memory now.
    WAITING = "waiting"
    #: A backend thread is reading or writing the view's memory.
    TOUCHING = "touching"
    #: The backend will never touch the view's memory again: ``quiesced()`` is true.
    ENDED = "ended"


class ReferenceAttempt(Attempt):
    """One submission. Its state changes only under ``runner.lock``; its methods never block
    beyond taking that lock, which no thread holds across a call to the other end."""

    def __init__(self, runner: Runner, op: str, view: View, wake: WakeFn, timeout_s: float) -> None:
        self.runner = runner
        self.op = op
        self.view = view
        self.wake = wake
        self.timeout_s = timeout_s
        # A8: the deadline counts from submission, also for an attempt queued behind others.
        self.deadline = time.monotonic() + timeout_s
        #: Rows known to have moved so far, one writable mask per group (handed over as copies).
        self.moved = view.row_masks()
        self.outcome: Outcome | None = None
        self.access = Access.WAITING

    # -- the holder's calls (A1-A4) ------------------------------------------------------------

    def poll(self) -> Outcome | None:
        return self.outcome  # set once, never reset (A1)

    def quiesced(self) -> bool:
        return self.access is Access.ENDED

    def cancel(self) -> None:
        with self.runner.lock:
            self.conclude_locked(OutcomeStatus.CANCELLED, Cause.HOLDER_CANCELLED, "cancelled by the holder")

    # -- the backend's transitions, each under runner.lock --------------------------------------

    @property
    def concluded(self) -> bool:
        return self.outcome is not None

    def masks_locked(self) -> tuple[np.ndarray, ...]:
        """Read-only copies of the moved masks: a mask handed over never changes (A6)."""
        out = []
        for mask in self.moved:
            copy = mask.copy()
            copy.setflags(write=False)
            out.append(copy)
        return tuple(out)

    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        """Set the outcome unless one is set (A1, A4); a wake follows (W1). An attempt whose
        memory no thread is touching ends its access with it. Whether this call concluded."""
        if self.outcome is not None:
            return False
        if status is OutcomeStatus.DELIVERED:
            outcome = Outcome.delivered(self.masks_locked())
        elif status is OutcomeStatus.FAILED:
            outcome = Outcome.failed(reason or "failed", self.masks_locked(), cause=cause)
        else:
            # A cancelled attempt's masks are all false: what moved before the cancel is not
            # promised to the lender.
            outcome = Outcome.cancelled(self.view.row_masks(), by_peer=by_peer, reason=reason, cause=cause)
        self.outcome = outcome
        if self.access is Access.WAITING:
            self.access = Access.ENDED
        self.runner.changed_locked(self)
        return True

    def expire_locked(self) -> None:
        """The deadline passed (A8, A10)."""
        self.conclude_locked(OutcomeStatus.FAILED, Cause.DEADLINE,
                             f"deadline passed: the {self.op} did not conclude within {self.timeout_s:g} s")

    def touch_locked(self) -> bool:
        """A thread is about to touch the view's memory; false (touch nothing) once concluded."""
        if self.outcome is not None or self.access is not Access.WAITING:
            return False
        self.access = Access.TOUCHING
        return True

    def untouch_locked(self) -> None:
        """The thread that touched the memory is out of it."""
        if self.access is Access.TOUCHING:
            self.access = Access.ENDED if self.outcome is not None else Access.WAITING
            if self.access is Access.ENDED:
                self.runner.changed_locked(self)

    def end_access_locked(self) -> None:
        """The backend is done with the view's memory even though the attempt has not concluded
        (a publish whose bytes are copied out, waiting for the other end to confirm)."""
        if self.access is not Access.ENDED:
            self.access = Access.ENDED
            self.runner.changed_locked(self)

    @property
    def settled(self) -> bool:
        return self.outcome is not None and self.access is Access.ENDED

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.op} {self.outcome!r} access={self.access.value}>"


class Runner:
    """The threads of one backend instance (B1: never shared): ``workers`` threads that run jobs
    in submission order, and one clock thread that concludes attempts whose deadline passed and
    calls the wakes of changes made on a holder's thread (``cancel()``, ``shutdown()``)."""

    def __init__(self, name: str, max_in_flight: int, workers: int = 1) -> None:
        self.lock = threading.Condition()
        self.max_in_flight = max_in_flight
        self.live: set[ReferenceAttempt] = set()
        self.closed = False
        self._jobs: deque[Callable[[], None]] = deque()
        self._deadlines: list[tuple[float, int, ReferenceAttempt]] = []
        self._order = itertools.count()
        self._wakes: list[WakeFn] = []
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-worker-{i}", daemon=True)
                         for i in range(workers)]
        self._threads.append(threading.Thread(target=self._clock, name=f"{name}-clock", daemon=True))
        for thread in self._threads:
            thread.start()

    # -- admission (S3) ------------------------------------------------------------------------

    def admit_locked(self, attempt: ReferenceAttempt, what: str) -> None:
        """Take a queue slot for ``attempt`` or raise ``SubmissionRejected``, leaving nothing
        behind. Call last in a submission, after every check that can refuse it."""
        if self.closed:
            raise SubmissionRejected(f"this backend is shut down; it takes no {what}")
        if len(self.live) >= self.max_in_flight:
            raise SubmissionRejected(f"the queue is full ({self.max_in_flight} attempts in flight); retry once one "
                                     "has concluded and quiesced")
        self.live.add(attempt)
        heapq.heappush(self._deadlines, (attempt.deadline, next(self._order), attempt))
        self.lock.notify_all()

    # -- changes and wakes (W1) ----------------------------------------------------------------

    def changed_locked(self, attempt: ReferenceAttempt) -> None:
        """``attempt`` changed what poll() or quiesced() answers: wake its holder once the lock
        is released, and free its queue slot once it has concluded and quiesced."""
        if attempt.settled:
            self.live.discard(attempt)
        self._wakes.append(attempt.wake)
        self.lock.notify_all()

    def later_locked(self, wake: WakeFn) -> None:
        """Call ``wake`` from the clock thread once the lock is released (a change that an
        optional protocol names, such as a request made visible through ``incoming()``)."""
        self._wakes.append(wake)
        self.lock.notify_all()

    def run(self, job: Callable[[], None]) -> None:
        """Queue ``job`` for a worker."""
        with self.lock:
            self._jobs.append(job)
            self.lock.notify_all()

    # -- the threads ---------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self._jobs or self._stopping)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            try:
                job()
            except Exception:  # a job concludes its attempts itself; this is a bug in the job
                log.exception("a reference backend job failed")

    def _clock(self) -> None:
        while True:
            with self.lock:
                while True:
                    now = time.monotonic()
                    while self._deadlines and (self._deadlines[0][0] <= now or self._deadlines[0][2].settled):
                        _, _, attempt = heapq.heappop(self._deadlines)
                        if attempt.outcome is None:
                            attempt.expire_locked()
                    if self._wakes or self._stopping:
                        break
                    timeout = self._deadlines[0][0] - now if self._deadlines else None
                    self.lock.wait(waiting.piece(timeout))
                wakes, self._wakes = self._wakes, []
                stop = self._stopping and not self._wakes
            for wake in wakes:
                try:
                    wake()
                except Exception:  # a holder's wake must not stop the clock
                    log.exception("a holder's wake raised")
            if stop:
                return

    def stop(self, *, wait_workers: bool = True) -> None:
        """Stop the threads (after every attempt settled); idempotent. Jobs still queued are
        dropped: they belong to attempts that have already concluded and quiesced. Without
        ``wait_workers`` only the clock thread (the last wakes) is waited for: a worker may be
        parked in a job that touches no attempt's memory any more, and ends when it returns."""
        with self.lock:
            self._stopping = True
            self._jobs.clear()
            self.lock.notify_all()
        me = threading.current_thread()
        for thread in self._threads if wait_workers else self._threads[-1:]:
            if thread is not me:
                thread.join(timeout=10.0)


def _memory(located: Located) -> np.ndarray:
    """The bytes of the registered region holding a group's rows, as a flat uint8 array over the
    holder's memory (HOST memory: plain addresses)."""
    region = located.region
    assert region is not None
    # numpy's stubs accept any buffer only for Python >= 3.12 (before: a closed list of types, without
    # ctypes arrays); a ctypes array has the buffer protocol on every version.
    return np.frombuffer((ctypes.c_uint8 * region.nbytes).from_address(region.base),  # type: ignore[call-overload]
                         dtype=np.uint8)


def _windows(located: Located, slot_bytes: int) -> np.ndarray:
    """Every ``slot_bytes``-long window of the region, one per start offset: row ``i`` of the
    group is ``windows[offsets[i]]``, so a gather or scatter over all rows is one numpy call."""
    flat = _memory(located)
    return np.lib.stride_tricks.as_strided(flat, shape=(flat.size - slot_bytes + 1, slot_bytes), strides=(1, 1))


def read_rows(located: Located, slot_bytes: int, rows: np.ndarray | None = None) -> np.ndarray:
    """A private copy of a group's rows (or of ``rows``, indices into the group), shape
    ``(rows, slot_bytes)``."""
    if located.region is None:
        return np.zeros((0 if rows is None else rows.size, slot_bytes), dtype=np.uint8)
    return _windows(located, slot_bytes)[located.offsets if rows is None else located.offsets[rows]]


def write_rows(located: Located, slot_bytes: int, rows: np.ndarray, data: np.ndarray) -> None:
    """Write ``data[k]`` into row ``rows[k]`` of a group (``rows``: indices into the group)."""
    if located.region is None or rows.size == 0:
        return
    _windows(located, slot_bytes)[located.offsets[rows]] = data
