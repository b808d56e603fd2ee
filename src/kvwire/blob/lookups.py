"""The ``lookup`` protocol (L1) of a blob backend: which content names the store holds now.

A lookup is one :meth:`~kvwire.blob.driver.StoreDriver.contains` call over the keys of every
(group, name) pair, built with the blob key layout (:func:`~kvwire.blob.keys.store_keys`), so it
asks about exactly the objects a fetch of those rows would read; a lookup of block objects (K1.7)
asks about one key per name (:func:`~kvwire.blob.keys.block_keys`). The call runs on a thread of
the backend's own (started on first use), so the caller waits at most its deadline even when the
store stops answering (a driver that sets ``inline_contains`` is first asked on the caller's
thread, with ``contains_now``, which answers only what waits for nothing but memory); a call
still inside the driver at the deadline runs to its end and its answer is dropped. Lookups queue
behind one another on that thread: behind a store call that hangs, later lookups fail by their
own deadlines too, and no thread piles up per lookup."""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Sequence

import numpy as np

from kvwire import waiting
from kvwire.blob.driver import BatchResult, KeyStatus, StoreDriver
from kvwire.blob.keys import block_keys, store_keys
from kvwire.contract.blocks import parse_block_layout
from kvwire.contract.errors import InvalidSubmission, LookupFailed, SubmissionRejected
from kvwire.contract.lookup import lookup_arguments

__all__ = ["LookupRunner", "check_timeout"]

log = logging.getLogger(__name__)

_OK, _MISSING = int(KeyStatus.OK), int(KeyStatus.MISSING)


def check_timeout(timeout_s: object) -> float:
    """``timeout_s`` as a float of seconds, or ``InvalidSubmission`` unless finite and > 0."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            math.isfinite(timeout_s) and timeout_s > 0):
        raise InvalidSubmission(f"a lookup's timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


class _Job:
    __slots__ = ("keys", "done", "result", "error", "abandoned")

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.done = threading.Event()
        self.result: BatchResult | None = None
        self.error: BaseException | None = None
        self.abandoned = False


class LookupRunner:
    """Runs a driver's ``contains`` calls on one thread of its own, so that each lookup waits at
    most its deadline. Thread-safe; :meth:`stop` refuses later lookups."""

    def __init__(self, driver: StoreDriver, thread_name: str) -> None:
        self._driver = driver
        self._thread_name = thread_name
        self._cond = threading.Condition()
        self._jobs: collections.deque[_Job] = collections.deque()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def lookup(self, namespace: str, groups: Sequence[int], names: object, timeout_s: float,
               layout: str | None = None) -> np.ndarray:
        """The L1 answer for ``names`` in every group of ``groups`` under ``namespace``: a new
        read-only bool array; with ``layout`` (a block layout, K1.2), for the block objects of
        that layout, whose group ids ``groups`` must be (K1.7). Raises ``InvalidSubmission`` for
        bad arguments, ``LookupFailed`` for a fault or a passed deadline, ``SubmissionRejected``
        once stopped."""
        ids, frozen = lookup_arguments(groups, names)
        timeout_s = check_timeout(timeout_s)
        if layout is not None:
            try:
                laid = [g for g, _ in parse_block_layout(layout)]
            except ValueError as exc:
                raise InvalidSubmission(f"store hint field 'blocks': {exc}") from None
            if len(ids) != len(groups) or sorted(ids) != laid:
                raise InvalidSubmission(
                    f"a lookup of block objects names the groups of its block layout, each once, in any order "
                    f"(K1.7): the layout has groups {_clip_ids(laid)}, the lookup {_clip_ids(list(groups))}")
        n = frozen.shape[0]
        if n == 0:
            return _frozen(np.zeros(0, dtype=bool))
        keys: list[str] = []
        if layout is not None:
            keys = block_keys(namespace, layout, frozen)  # one object per name for every group
        else:
            for group in ids:
                keys += store_keys(namespace, group, frozen)
        result = self._ask(keys, timeout_s)
        status = result.status
        if status.shape != (len(keys),):
            raise LookupFailed(f"the store driver answered {status.size} statuses for a lookup of {len(keys)} keys")
        bad = np.flatnonzero((status != _OK) & (status != _MISSING))
        if bad.size:
            i = int(bad[0])
            why = result.reasons.get(i) or f"the store answered {KeyStatus(int(status[i])).name}"
            raise LookupFailed(f"lookup of {keys[i]!r} failed: {why}")
        held = (status == _OK).reshape(len(keys) // n, n).all(axis=0)
        return _frozen(held)

    def _ask(self, keys: list[str], timeout_s: float) -> BatchResult:
        job = _Job(keys)
        began = time.monotonic()
        if self._driver.inline_contains:
            # First on the caller's thread, where the driver answers only what waits for nothing
            # but memory (no hand-off to the thread and back); else to the thread, as below.
            with self._cond:
                if self._stopped:
                    raise SubmissionRejected("this blob backend is shut down; it answers no lookup")
            self._answer(job, now=True)
        if job.done.is_set():
            answered = time.monotonic() - began <= timeout_s  # L1.7: an answer past it is none
        else:
            with self._cond:
                if self._stopped:
                    raise SubmissionRejected("this blob backend is shut down; it answers no lookup")
                self._jobs.append(job)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
                    self._thread.start()
                self._cond.notify()
            answered = waiting.wait_event(job.done, max(0.0, timeout_s - (time.monotonic() - began)))
        if not answered:
            job.abandoned = True
            raise LookupFailed(
                f"deadline passed: the store did not answer a lookup of {len(keys)} keys within {timeout_s:g} s")
        if job.error is not None:
            exc = job.error
            raise LookupFailed(f"the store driver raised {type(exc).__name__} during a lookup: {exc}") from exc
        result = job.result
        if not isinstance(result, BatchResult):
            raise LookupFailed(f"the store driver's contains() returned {type(result).__name__}, not a BatchResult")
        return result

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopped:
                    self._cond.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            if not job.abandoned:
                self._answer(job)

    def _answer(self, job: _Job, now: bool = False) -> None:
        """Answer ``job`` with the driver's ``contains``; with ``now``, its ``contains_now``,
        leaving the job undone when that would wait."""
        driver = self._driver
        try:
            if now:
                result = driver.contains_now(job.keys)
                if result is None:
                    return
                job.result = result
            else:
                job.result = driver.contains(job.keys)
        except BaseException as exc:  # handed to the caller as LookupFailed
            log.warning("store driver %s raised during a lookup: %s", type(driver).__name__, exc)
            job.error = exc
        job.done.set()

    def stop(self) -> None:
        """Refuse later lookups; the thread ends once the calls queued before now are done.
        Idempotent."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


def _clip_ids(ids: list[int]) -> str:
    """Group ids for a message, at most 16 of them shown."""
    shown = ", ".join(map(str, ids[:16]))
    return f"[{shown}{', ...' if len(ids) > 16 else ''}]"


def _frozen(mask: np.ndarray) -> np.ndarray:
    mask.setflags(write=False)
    return mask
