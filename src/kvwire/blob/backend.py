"""The blob backend: moves rows to and from a store of named, immutable objects through a
:class:`~kvwire.blob.driver.StoreDriver`. Written once, under every store plugin.

How it keeps the contract:

- **Progress (A3).** ``workers`` threads take chunks from one queue and call the driver; a
  deadline thread concludes attempts whose deadline passed. Nobody needs to poll. A chunk is
  handed to the worker that went idle last, so back-to-back submissions are served by one
  thread while the others stay parked (a store call made from a thread that alternates with
  another ran slower on a busy machine).
- **Chunks.** A submission's rows are cut into chunks of about ``chunk_bytes`` (the rows whose
  bytes start within one ``chunk_bytes`` window, so at most ``chunk_bytes`` plus one row), and
  of at most the driver's ``max_batch_keys`` rows when it sets one. One chunk is one driver
  call. Cancellation and the deadline are checked between chunks; a chunk already inside the
  driver runs to its end. A submission's chunks all go to the queue at once, so several workers
  may move them side by side, unless the driver's ``chunks_at_once`` bounds that: then that
  many are queued, and each one that ends queues the next (behind what other submissions
  queued meanwhile), until the attempt concludes.
- **Masks (A5, A7).** A fetched row's bit is true when the driver answered ``OK``; ``MISSING``
  is a miss (false bit, still delivered). A published row's bit is true when the store holds it
  (``OK`` or ``ALREADY_THERE``); ``DECLINED`` (no space) is a false bit, not a fault. Any other
  answer, or a driver that raises, is a fault: the attempt fails with the first faulty row's
  reason, and the remaining chunks still run, so the masks say exactly which rows moved.
- **Deadline and grace (A8).** Each attempt's deadline is ``hint.timeout_s`` or the backend's
  ``timeout_s``. At the deadline the attempt concludes ``FAILED`` with a reason that says the
  deadline passed, even while a worker is inside a driver call. It quiesces as soon as the
  driver calls in flight for it return: the grace is one driver call per worker, which for the
  in-memory driver is the time to copy one chunk and for a networked driver is bounded by that
  driver's own request timeout.
- **Small submissions move inside the call.** A submission of at most ``inline_bytes`` (the
  driver's :attr:`~kvwire.blob.driver.StoreDriver.inline_bytes`: 1 MiB for the in-memory
  driver, 0 for a store that may block; for a fetch, ``inline_get_bytes`` when the driver sets
  it: 256 KiB for the files store, whose reads take no lock) is one chunk that
  ``fetch``/``publish`` hands to the driver itself, so it has concluded and quiesced when the
  call returns: no hand-off to a worker and back. A fetch asks the driver's ``get_into_now``,
  which may answer ``None`` instead of waiting (the files store on a disk, for pages not in
  memory); then a worker moves the chunk, as for a larger submission. The contract allows it:
  nothing needs the holder's help (A3), conclusion and quiescence may come in any order and at
  any time after the submission call began (A2.6), and a driver that only copies memory cannot
  hold the call past the deadline (A8.5); the deadline is still checked before the copy (A8.1).
  What the text forbids is a wake inside the holder's call (W1.6), so the call does not wake: it
  concludes, then asks the deadline thread for the wake (W1.2 wants one after each conclusion,
  W1.1 after the change is visible, which it is). A holder that looks before it sleeps (the
  runtime's holder loop does) sees the attempt done at once.
- **Waking (W1).** ``wake`` is called after the outcome or the quiescence it reports is set, from
  a worker thread or the deadline thread; never from inside a backend or attempt method, so a
  holder may call ``cancel()`` while holding the lock its ``wake`` takes. Wakes the holder's own
  calls made due (an inline submission, cancel, shutdown) are batched: the deadline thread is
  signalled only when none was due yet, and it calls each distinct wake callable once for all
  its attempts due together (the W1.8 note).
- **The attempt lifecycle** (admission under ``max_in_flight``, conclude once, quiesce once, the
  wakes owed, the deadline clock, the waits of ``close``) is kvwire's one
  :class:`~kvwire.attempts.AttemptTable`, sharing the backend's lock.
- **Keys.** Rows are addressed by content name: ``kvw1/{namespace}/g{group_id}/{name.hex()}``
  (:func:`~kvwire.blob.keys.store_keys`). A hint of kind ``"store"`` may carry ``namespace``.
- **Block objects (K1).** A store hint with ``blocks`` (the view's block layout) stores one
  object per row index instead of one per group and row: row ``j`` of every group, in ascending
  group id, under ``kvw1/{namespace}/b{layout digest}/{name.hex()}``
  (:func:`~kvwire.blob.keys.block_keys`), moved by the driver's ``put_parts`` /
  ``get_parts_into`` with one address per group and block. The view is checked before anything
  escapes (K1.3); chunks hold whole blocks; one bit per block is the bit of every group's mask
  (K1.4, K1.5). Every driver of host memory keeps it (the default parts calls go through a
  bounce buffer, :mod:`kvwire.blob.parts`), so the backend declares ``block-objects`` from
  contract 1.3 on.
- **Lookup (L1).** When the driver offers ``contains`` the backend declares the ``lookup``
  protocol and answers it from those same keys (:mod:`kvwire.blob.lookups`); otherwise it does
  not declare it, and :meth:`BlobBackend.lookup` refuses.

The backend does not own its driver unless built with ``owns_driver=True``; then :meth:`close`
closes it.

Why one file of this size: the attempt, the chunk workers and the deadline thread share one lock
and one set of invariants (a chunk inside the driver keeps its attempt unquiesced); split apart,
each part would reach into the others' fields."""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, overload

import numpy as np

from kvwire import waiting
from kvwire.attempts import AttemptTable, OwedWakes, TableAttempt, call_wakes, clock
from kvwire.blob.driver import BatchResult, KeyStatus, StoreDriver, _call
from kvwire.blob.driver import all_ok as _all_ok
from kvwire.blob.keys import block_keys, check_namespace, store_keys
from kvwire.blob.lookups import LookupRunner, check_timeout
from kvwire.blob.options import MAX_IN_FLIGHT, NAMESPACE, TIMEOUT_S
from kvwire.contract import (
    CONTRACT_VERSION,
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
)
from kvwire.contract.backend import Attempt, Backend, Registration
from kvwire.contract.blocks import BLOCK_OBJECTS, BLOCKS_FIELD, block_layout, parse_block_layout
from kvwire.contract.capabilities import OtherEnd
from kvwire.contract.hint import HintValue
from kvwire.contract.lookup import LOOKUP, Lookup
from kvwire.contract.regions import RegionTable, TableRegistration

__all__ = ["BlobBackend", "BlobRegistration", "STORE_HINT_KIND", "blob_capabilities"]

log = logging.getLogger(__name__)

#: The hint kind a blob backend takes. Its optional fields are ``namespace`` and, from contract
#: 1.3 on (``block-objects``), ``blocks``.
STORE_HINT_KIND = "store"
_HINT_FIELDS = ("namespace",)
_BLOCK_HINT_FIELDS = ("namespace", BLOCKS_FIELD)
#: The first contract version whose backends name ``block-objects`` (K1).
_BLOCKS_SINCE = (1, 3)

_PUT = "publish"
_GET = "fetch"
_OK, _THERE, _DECLINED, _MISSING = (int(s) for s in (KeyStatus.OK, KeyStatus.ALREADY_THERE,
                                                     KeyStatus.DECLINED, KeyStatus.MISSING))
_backend_ids = itertools.count(1)


def blob_capabilities(memory_kinds: Iterable[MemoryKind], max_in_flight: int, *,
                      lookup: bool = False, contract_version: tuple[int, int] = CONTRACT_VERSION,
                      block_objects: bool = True) -> Capabilities:
    """What every blob backend declares: a store at the other end, fetch and publish by content
    name, cancellation, and the driver's memory kinds; with ``lookup`` (a driver that offers
    ``contains``) the ``lookup`` protocol too, and from contract 1.3 on ``block-objects`` (K1)
    unless ``block_objects`` is false (a driver whose
    :attr:`~kvwire.blob.driver.StoreDriver.offers_parts` is false: it reaches device memory and
    does not override the parts calls). Plugins use it for their static declaration so it
    equals what their backends return, passing the same literal ``contract_version`` here and to
    :class:`BlobBackend` (the blob backend keeps every clause of every version up to this
    kvwire's, so any version up to it is true of it)."""
    declared = _declared_version(contract_version)
    protocols = {LOOKUP} if lookup else set()
    if block_objects and declared >= _BLOCKS_SINCE:
        protocols.add(BLOCK_OBJECTS)
    return Capabilities(
        contract_version=declared,
        fetch=True,
        publish=True,
        memory_kinds=frozenset(memory_kinds),
        other_end=OtherEnd.STORE,
        content_addressed=True,
        max_in_flight=max_in_flight,
        cancellation=True,
        protocols=frozenset(protocols),
    )


def _declared_version(version: tuple[int, int]) -> tuple[int, int]:
    declared = tuple(version)
    if (len(declared) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in declared)
            or declared[0] != CONTRACT_VERSION[0] or not (0 <= declared[1] <= CONTRACT_VERSION[1])):
        raise ValueError(f"contract_version must be (major, minor) of contract {CONTRACT_VERSION[0]}.0 to "
                         f"{CONTRACT_VERSION[0]}.{CONTRACT_VERSION[1]}, got {version!r}")
    return declared  # type: ignore[return-value]


class _Core:
    """The state a backend shares with its attempts, registrations and threads, all guarded by
    ``cond``. Threads hold only this, so a backend dropped without ``shutdown()`` can still be
    collected (its finalizer stops them)."""

    def __init__(self, driver: StoreDriver, max_in_flight: int) -> None:
        self.driver = driver
        lock = threading.Lock()
        #: The lock of the backend's state (``with core.cond``); the attempt table shares it.
        self.cond = threading.Condition(lock)
        #: Attempts not yet both concluded and quiesced: kvwire's one attempt lifecycle
        #: (admission under ``max_in_flight``, conclude once, quiesce once; ``close`` waits on it).
        self.attempts: AttemptTable[_BlobAttempt] = AttemptTable(max_in_flight, lock=lock, name="the blob backend")
        #: The deadline thread's own condition on the same lock, signalled only when it has
        #: something to do: an earlier deadline, a wake due, or stopping. Attempts that end
        #: before the deadline it sleeps towards do not wake it, so it costs the hot path nothing.
        self.watch = threading.Condition(lock)
        self.queue = _Dispatch()
        self.closed = False
        self.stopping = False
        self.watch_until = math.inf
        self.threads: list[threading.Thread] = []
        #: The regions registered with this backend: the contract's one reading of M3/M4.
        self.table = RegionTable(driver.memory_kinds)
        #: Open registrations by their table token (closed with the backend).
        self.registered: dict[int, BlobRegistration] = {}
        #: Regions, by id (the value is the region itself, which also keeps its id from being
        #: reused), whose whole span the table found inside one open registration: a group in
        #: one of them is recognized without asking the table again, since its slots lie in
        #: the region (V1.2). Only ever a subset of what the table recognizes: cleared whenever
        #: a registration closes (M3.7, M4.5). Read on the holder's call sequence (B2).
        self.recognized: dict[int, SlotRegion] = {}
        #: Wakes of changes the holder's own call made (cancel, shutdown, an inline chunk): the
        #: deadline thread calls them, so wake never runs inside a backend method (W1.6).
        self.wakes = OwedWakes()

    def recognize(self, group: LayerGroupRows, index: int) -> None:
        """M4 for one group, by the table (raises ``InvalidSubmission``); remembers the group's
        region when its whole span lies inside the registered region that holds the rows."""
        held = self.table.locate(group, index).region
        region = group.region
        if held is not None and held.base <= region.base and region.end <= held.end:
            if len(self.recognized) >= 1024:
                self.recognized.clear()
            self.recognized[id(region)] = region

    def wake_later(self, attempt: _BlobAttempt) -> None:
        """Under ``cond``: have the deadline thread call ``attempt``'s wake. Wakes are batched:
        the thread is signalled only when no wake was already due, and it calls each distinct
        wake callable once for all its attempts due together (the W1.8 note, :class:`~kvwire.attempts.OwedWakes`)."""
        if self.wakes.add(attempt.wake):
            self.watch.notify()

    def stop(self) -> None:
        """Tell the threads to exit once the chunks queued before now are done. Idempotent."""
        with self.cond:
            if self.stopping:
                return
            self.closed = True
            self.stopping = True
            self.attempts.notify_locked()
            self.watch.notify()
        for _ in self.threads:
            self.queue.put(None)


_Chunk = tuple["_BlobAttempt", int, int] | None


class _Dispatch:
    """Chunks in submission order, each handed to the worker that went idle most recently (a
    stack of idle workers, each parked on its own lock). ``None`` tells one worker to exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks: collections.deque[_Chunk] = collections.deque()
        self._idle: list[threading.Lock] = []

    def put(self, chunk: _Chunk, first: bool = False) -> None:
        """Queue ``chunk`` last, or with ``first`` ahead of everything queued (a chunk queued
        once the backend is stopping must still come before the workers' exit marks)."""
        with self._lock:
            if first:
                self._chunks.appendleft(chunk)
            else:
                self._chunks.append(chunk)
            if not self._idle:
                return  # every worker is busy; the first to finish takes it
            parked = self._idle.pop()
        parked.release()

    def get(self, parking: threading.Lock) -> _Chunk:
        """The next chunk; waits on ``parking`` (a lock held by the caller) while there is none."""
        while True:
            with self._lock:
                if self._chunks:
                    return self._chunks.popleft()
                self._idle.append(parking)
            parking.acquire()  # released exactly once, by the put that took it off the stack


class BlobRegistration(Registration):
    """Regions registered with a blob backend (its :class:`~kvwire.contract.RegionTable`) and
    its driver in one batch."""

    def __init__(self, core: _Core, entry: TableRegistration) -> None:
        self._core = core
        self._entry = entry

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self._entry.regions

    @property
    def closed(self) -> bool:
        """Whether this registration no longer covers its regions."""
        return self._entry.closed

    def close(self) -> None:
        """Unregister this batch from the backend and its driver. Idempotent; another
        registration of the same spans, made later, stays (M3)."""
        core = self._core
        with core.cond:
            if core.registered.pop(self._entry.token, None) is None:
                return
            core.recognized.clear()
            self._entry.close()
        core.driver.unregister(self._entry.regions)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"BlobRegistration({len(self.regions)} regions, {state})"


class _BlobAttempt(TableAttempt):
    """One fetch or publish. Workers fill ``_delivered`` chunk by chunk; the outcome's masks are
    cut from it once, when the attempt concludes, and never written again.

    Per group (``parts`` is ``None``): one key, address and size per row, group after group
    (``offsets``), or block by block across groups (``unorder`` maps back). Block objects
    (``parts``, K1): one key per block, ``addresses`` of shape ``(blocks, groups)`` in ascending
    group id and ``parts`` the groups' row sizes in that order; a block's bit is its bit in
    every group's mask.

    ``later``: the row ranges of chunks not queued yet (the driver's ``chunks_at_once``); each
    chunk that ends queues the next while the attempt has not concluded."""

    def __init__(self, core: _Core, op: str, view: View, wake: WakeFn, keys: list[str],
                 addresses: np.ndarray, sizes: np.ndarray, offsets: list[int], chunks: int,
                 timeout_s: float, unorder: np.ndarray | None = None, parts: np.ndarray | None = None,
                 later: collections.deque[tuple[int, int]] | None = None) -> None:
        # TableAttempt.__init__, written out: a call less on every submission
        self.wake = wake
        self.deadline = clock() + timeout_s
        self._outcome: Outcome | None = None
        self._quiesced = False
        self._core = core
        self._later = later
        self._parts = parts
        self._op = op
        self._view = view
        self._keys = keys
        self._addresses = addresses
        self._sizes = sizes
        self._offsets = offsets
        self._unorder = unorder  # issue order -> group-major order, when they differ
        #: One bit per row in issue order, made when a chunk first needs it: an attempt whose
        #: one chunk delivers every row never writes or reads it.
        self._delivered: np.ndarray | None = None
        #: How many rows have a true bit (so "all delivered" costs no pass over the bits).
        self._held = 0
        self._fault: tuple[int, str] | None = None
        self._timeout_s = timeout_s
        self._remaining = chunks
        self._running = 0

    # -- the holder's side (A1, A2, A4; poll and quiesced are the table's) -------------------

    def cancel(self) -> None:
        core = self._core
        with core.cond:
            if self._outcome is not None:
                return
            self._conclude_locked(Outcome.cancelled(self._masks_locked(), reason="cancelled by the holder",
                                                    cause=Cause.HOLDER_CANCELLED))
            core.wake_later(self)

    def __repr__(self) -> str:
        state = repr(self._outcome) if self._outcome is not None else "in flight"
        what = "block objects" if self._parts is not None else "rows"
        return (f"<blob {self._op} of {len(self._keys)} {what}: {state}"
                f"{', quiesced' if self._quiesced else ''}>")

    # -- the backend's side (all *_locked methods run under core.cond) ----------------------

    def _masks_locked(self) -> tuple[np.ndarray, ...]:
        """Read-only masks, one per group, cut from ``_delivered`` as it stands (a mask of all
        true bits is a shared read-only array, which no one can write: A6.3, A6.5)."""
        offsets = self._offsets
        n = len(self._keys)
        if self._parts is not None:  # K1.4, K1.5: one bit per block, the same in every group
            if self._held == n:
                block_mask = _all_true(n)
            else:
                block_mask = self._delivered_bits().copy()
                block_mask.setflags(write=False)
            return (block_mask,) * len(self._view.groups)
        if len(offsets) == 2 and self._held == n:
            return (_all_true(n),)
        delivered = self._delivered_bits()
        if self._unorder is not None:
            delivered = delivered[self._unorder]
        masks = []
        for i in range(len(offsets) - 1):
            mask = delivered[offsets[i]:offsets[i + 1]].copy()
            mask.setflags(write=False)
            masks.append(mask)
        return tuple(masks)

    def _delivered_bits(self) -> np.ndarray:
        delivered = self._delivered
        if delivered is None:
            delivered = self._delivered = np.zeros(len(self._keys), dtype=bool)
            if self._held:  # only a chunk of every row counts without the bits
                delivered[:] = True
        return delivered

    def _conclude_locked(self, outcome: Outcome) -> None:
        if self._running == 0:
            # No chunk is inside the driver and none will start: memory access has ended.
            self._core.attempts.settle_locked(self, outcome)
        else:
            self._core.attempts.conclude_locked(self, outcome)

    def _quiesce_locked(self) -> None:
        self._core.attempts.quiesce_locked(self)

    def _expire_locked(self) -> None:
        self._conclude_locked(Outcome.failed(
            f"deadline passed: the {self._op} did not conclude within {self._timeout_s:g} s",
            self._masks_locked(), Cause.DEADLINE,
        ))

    def _begin_chunk(self, inline: bool) -> tuple[bool, bool]:
        """Whether the next chunk may run, and whether a wake is owed (the attempt concluded
        because its deadline passed). ``inline``: the holder's own call runs the chunk, so the
        deadline thread owes that wake (W1.6)."""
        with self._core.cond:
            return self._begin_chunk_locked(inline)

    def _begin_chunk_locked(self, inline: bool) -> tuple[bool, bool]:
        expired = False
        if self._outcome is None and clock() >= self.deadline:
            self._expire_locked()
            expired = True
            if inline:
                self._core.wake_later(self)
        if self._outcome is not None:
            self._remaining -= 1
            go = False
        else:
            self._running += 1
            go = True
        return go, expired and not inline

    def _hand_off(self) -> bool:
        """Undo the start of the inline chunk (the driver would have waited): whether a worker
        should run it now. If the attempt concluded meanwhile (its deadline), nothing is left
        inside the driver, so it quiesces, and the deadline thread owes the wake (W1.6)."""
        with self._core.cond:
            self._running -= 1
            if self._outcome is None:
                return True
            self._remaining -= 1
            if self._running == 0 and not self._quiesced:
                self._quiesce_locked()
                self._core.wake_later(self)
            return False

    def _end_chunk(self, lo: int, hi: int, result: BatchResult, inline: bool) -> bool:
        """Record a chunk's answers; whether a wake is owed by the caller (never when
        ``inline``: then the deadline thread is asked for it, W1.6)."""
        changed = False
        with self._core.cond:
            self._running -= 1
            self._remaining -= 1
            if self._outcome is None:
                self._record_locked(lo, hi, result)
                if self._later:
                    # The next chunk, queued under the lock: either before stop() queues the
                    # workers' exit marks, or after it set ``stopping``, then ahead of them.
                    core = self._core
                    core.queue.put((self, *self._later.popleft()), first=core.stopping)
                if self._remaining == 0:
                    masks = self._masks_locked()
                    if self._fault is None:
                        self._conclude_locked(Outcome.delivered(masks))
                    else:
                        self._conclude_locked(Outcome.failed(self._fault[1], masks, Cause.FAULT))
                    changed = True
            elif self._running == 0 and not self._quiesced:
                self._quiesce_locked()
                changed = True
            if changed and inline:
                self._core.wake_later(self)
        return changed and not inline

    def _record_locked(self, lo: int, hi: int, result: BatchResult) -> None:
        status = result.status
        if status.shape != (hi - lo,):
            self._fault_at(lo, f"the store driver answered {status.size} statuses for {hi - lo} keys")
            return
        if _all_ok(status):  # every key OK (code 0): the common case
            if hi - lo == len(self._keys):
                self._held = hi - lo  # the one chunk of every row: no bits to write
            else:
                self._delivered_bits()[lo:hi] = True
                self._held += hi - lo
            return
        if self._op == _PUT:
            ok = (status == _OK) | (status == _THERE)
            fine = ok | (status == _DECLINED)
        else:
            ok = status == _OK
            fine = ok | (status == _MISSING)
        self._delivered_bits()[lo:hi] = ok
        self._held += int(np.count_nonzero(ok))
        bad = np.flatnonzero(~fine)
        if bad.size:
            i = int(bad[0])
            why = result.reasons.get(i) or f"the store answered {KeyStatus(int(status[i])).name}"
            self._fault_at(lo + i, f"{self._op} of {self._keys[lo + i]!r} failed: {why}")

    def _fault_at(self, row: int, reason: str) -> None:
        # The lowest faulty row's reason wins, so the reason does not depend on chunk order.
        if self._fault is None or row < self._fault[0]:
            self._fault = (row, reason)


_NO_KEYS = BatchResult(np.zeros(0, dtype=np.uint8))
_NO_ROWS = np.zeros(0, dtype=np.uint64)
_NO_ROWS.setflags(write=False)
_ADDRESS_LIMIT = 1 << 64


def _row_addresses(region: SlotRegion, slots: np.ndarray) -> np.ndarray:
    """``region.addresses(slots)``; a few rows in Python ints, which costs less than numpy's
    fixed price per call (the same values: a region that ends past 2**64 takes numpy's path)."""
    if slots.size > 4 or region.end >= _ADDRESS_LIMIT:
        return region.addresses(slots)
    base, step = region.base, region.slot_bytes
    return np.array([base + slot * step for slot in slots.tolist()], dtype=np.uint64)


@functools.lru_cache(maxsize=256)
def _row_sizes(rows: int, slot_bytes: int) -> np.ndarray:
    """``rows`` copies of ``slot_bytes`` (uint64, read-only, shared)."""
    sizes = np.full(rows, slot_bytes, dtype=np.uint64)
    sizes.setflags(write=False)
    return sizes


@functools.lru_cache(maxsize=64)
def _all_true(n: int) -> np.ndarray:
    """A read-only mask of ``n`` true bits; shared, since nobody can write it."""
    mask = np.ones(n, dtype=bool)
    mask.setflags(write=False)
    return mask


def _serve(core: _Core) -> None:
    """A worker: run chunks until told to stop."""
    parking = threading.Lock()
    parking.acquire()
    while True:
        item = core.queue.get(parking)
        if item is None:
            return
        attempt, lo, hi = item
        if _run_chunk(core.driver, attempt, lo, hi, inline=False):
            call_wakes((attempt.wake,))


def _run_chunk(driver: StoreDriver, attempt: _BlobAttempt, lo: int, hi: int, *, inline: bool) -> bool:
    """One driver call for rows ``lo:hi`` of ``attempt``, on a worker or (``inline``) inside the
    holder's submission call; whether the caller owes a wake."""
    go, owed = attempt._begin_chunk(inline)
    if not go:
        return owed
    return _finish_chunk(attempt, lo, hi, _call_driver(driver, attempt, lo, hi), inline=inline)


@overload
def _call_driver(driver: StoreDriver, attempt: _BlobAttempt, lo: int, hi: int,
                 now: Literal[False] = False) -> BatchResult: ...
@overload
def _call_driver(driver: StoreDriver, attempt: _BlobAttempt, lo: int, hi: int, now: bool) -> BatchResult | None: ...
def _call_driver(driver: StoreDriver, attempt: _BlobAttempt, lo: int, hi: int, now: bool = False) -> BatchResult | None:
    """The driver's answer for rows ``lo:hi`` of a chunk that has begun; a driver that raises or
    answers something else is a fault of every row (S5.3). ``now`` (inside the holder's call): a
    fetch asks :meth:`~StoreDriver.get_into_now`, and ``None`` says it would have waited."""
    if hi == lo:
        return _NO_KEYS
    call: Callable[[Sequence[str], np.ndarray, np.ndarray], BatchResult | None]
    parts = attempt._parts
    if parts is not None:  # block objects: each key's parts, one per group (K1)
        if attempt._op == _PUT:
            call = driver.put_parts
        else:
            call = driver.get_parts_into_now if now else driver.get_parts_into
    elif attempt._op == _PUT:
        call = driver.put
    else:
        call = driver.get_into_now if now else driver.get_into
    _call.deadline = attempt.deadline  # what call_deadline() answers inside the driver
    try:
        sizes = attempt._sizes[lo:hi] if parts is None else parts
        result = call(attempt._keys[lo:hi], attempt._addresses[lo:hi], sizes)
        if result is None and now and attempt._op == _GET:
            return None
        if not isinstance(result, BatchResult):
            raise TypeError(f"returned {type(result).__name__}, not a BatchResult")
    except Exception as exc:
        log.warning("store driver %s raised during a %s: %s", type(driver).__name__, attempt._op, exc)
        result = BatchResult.uniform(
            hi - lo, KeyStatus.FAILED, f"the store driver raised {type(exc).__name__}: {exc}")
    finally:
        _call.deadline = None
    return result


def _finish_chunk(attempt: _BlobAttempt, lo: int, hi: int, result: BatchResult, *, inline: bool) -> bool:
    try:
        return attempt._end_chunk(lo, hi, result, inline)
    except Exception:  # never lose a worker; the attempt will still hit its deadline
        log.exception("recording a chunk of %r failed", attempt)
        return False


def _watch(core: _Core) -> None:
    """The deadline thread: conclude attempts whose deadline passed, even while every worker is
    stuck inside the driver (A8)."""
    with core.cond:
        while True:
            now = clock()
            overdue, nearest = core.attempts.overdue_locked(now)
            for attempt in overdue:
                attempt._expire_locked()  # may quiesce it, which takes it out of the table
                core.wakes.add(attempt.wake)
            core.watch_until = nearest
            if core.wakes:
                due = core.wakes.take()  # one call per distinct wake callable (the W1.8 note)
                core.cond.release()
                try:
                    call_wakes(due)
                finally:
                    core.cond.acquire()
                continue
            if core.stopping:
                return
            core.watch.wait(None if nearest == math.inf else waiting.piece(nearest - now))


class BlobBackend(Backend, Lookup):
    """A backend whose other end is a store of named, immutable objects reached through
    ``driver``. Rows are addressed by content name in ``namespace`` (a store hint may name
    another). At most ``max_in_flight`` attempts are neither concluded nor quiesced at once;
    each has ``timeout_s`` (or the hint's) to conclude. ``workers`` threads move chunks of about
    ``chunk_bytes``. A submission of at most ``inline_bytes`` (default: the driver's
    :attr:`~kvwire.blob.driver.StoreDriver.inline_bytes`, 0 for a driver that may block) moves
    inside the ``fetch``/``publish`` call and has concluded and quiesced when it returns (a fetch:
    the driver's :attr:`~kvwire.blob.driver.StoreDriver.inline_get_bytes` when it sets one).
    ``owns_driver``: whether :meth:`close` also closes the driver. ``contract_version``: the
    literal version the plugin declares (docs/contract.md, Versions), the same one it passes to
    :func:`blob_capabilities`."""

    def __init__(
        self,
        driver: StoreDriver,
        *,
        namespace: str = NAMESPACE.default,
        timeout_s: float = TIMEOUT_S.default,
        max_in_flight: int = MAX_IN_FLIGHT.default,
        workers: int = 2,
        chunk_bytes: int = 64 << 20,
        inline_bytes: int | None = None,
        owns_driver: bool = False,
        contract_version: tuple[int, int] = CONTRACT_VERSION,
    ) -> None:
        if not isinstance(driver, StoreDriver):
            raise TypeError(f"driver must be a kvwire.blob.StoreDriver, got {type(driver).__name__}")
        self._namespace = check_namespace(namespace)
        # The bounds every store plugin declares for them (kvwire.blob.options): one declaration.
        timeout_s = TIMEOUT_S.check(timeout_s, "blob")
        max_in_flight = MAX_IN_FLIGHT.check(max_in_flight, "blob")
        for label, value in (("workers", workers), ("chunk_bytes", chunk_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{label} must be an int >= 1, got {value!r}")
        if inline_bytes is None:
            get_bytes = driver.inline_bytes if driver.inline_get_bytes is None else driver.inline_get_bytes
            limits = {_PUT: driver.inline_bytes, _GET: get_bytes}
        else:
            limits = {_PUT: inline_bytes, _GET: inline_bytes}
        for value in limits.values():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"inline_bytes must be an int >= 0, got {value!r}")
        self._inline_bytes = {op: min(value, chunk_bytes) for op, value in limits.items()}
        self._timeout_s = float(timeout_s)
        self._chunk_bytes = chunk_bytes
        rows = driver.max_batch_keys
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(f"the driver's max_batch_keys must be None or an int >= 1, got {rows!r}")
        self._chunk_rows = rows
        at_once = driver.chunks_at_once
        if at_once is not None and (isinstance(at_once, bool) or not isinstance(at_once, int) or at_once < 1):
            raise ValueError(f"the driver's chunks_at_once must be None or an int >= 1, got {at_once!r}")
        self._chunks_at_once = at_once
        self._owns_driver = owns_driver
        self._id = next(_backend_ids)
        self._lookups = LookupRunner(driver, f"kvwire-blob{self._id}-lookup") if driver.offers_contains else None
        self._capabilities = blob_capabilities(driver.memory_kinds, max_in_flight, lookup=self._lookups is not None,
                                               contract_version=contract_version,
                                               block_objects=driver.offers_parts)
        #: Whether the store hint takes ``blocks`` (K1.1); a backend that does not name the
        #: protocol refuses the field as it refuses any other it does not understand (H1.9).
        self._blocks = BLOCK_OBJECTS in self._capabilities.protocols
        self._core = core = _Core(driver, max_in_flight)
        names = [f"kvwire-blob{self._id}-worker{i}" for i in range(workers)]
        core.threads = [threading.Thread(target=_serve, args=(core,), name=n, daemon=True) for n in names]
        core.threads.append(threading.Thread(target=_watch, args=(core,), name=f"kvwire-blob{self._id}-deadline",
                                             daemon=True))
        for thread in core.threads:
            thread.start()
        self._finalizer = weakref.finalize(self, core.stop)
        if self._lookups is not None:
            weakref.finalize(self, self._lookups.stop)
        self._driver_closed = False

    # -- declared ----------------------------------------------------------------------------

    @property
    def driver(self) -> StoreDriver:
        return self._core.driver

    @property
    def namespace(self) -> str:
        """The namespace used when a hint names none."""
        return self._namespace

    def capabilities(self) -> Capabilities:
        return self._capabilities

    # -- regions (M3, M4) ---------------------------------------------------------------------

    def register_regions(self, regions: Sequence[SlotRegion]) -> BlobRegistration:
        """Register a batch with the backend's region table and its driver (M3). Refuses the
        whole batch with ``InvalidSubmission`` for a memory kind the driver cannot reach or an
        overlap (within the batch or with a registered region); a driver refusal
        (``RuntimeError``) also registers nothing; after shutdown, ``SubmissionRejected``."""
        core = self._core
        if core.closed:
            raise SubmissionRejected("this blob backend is shut down; it registers no regions")
        entry = core.table.register(regions)
        try:
            core.driver.register(entry.regions)
        except BaseException:
            core.recognized.clear()
            entry.close()
            raise
        registration = BlobRegistration(core, entry)
        with core.cond:
            core.registered[entry.token] = registration
        return registration

    # -- submissions (S1-S5) ------------------------------------------------------------------

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        """Read the rows' objects from the store into their memory. A missing object is a miss
        (false bit); the attempt still delivers."""
        return self._submit(_GET, view, hint, wake)

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        """Store each row's bytes under its name. An existing object keeps its bytes and counts
        as held; a store without space declines the row (false bit), which is no fault."""
        return self._submit(_PUT, view, hint, wake)

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        core = self._core
        if core.closed:
            raise SubmissionRejected(f"this blob backend is shut down; it takes no {op}")
        if not isinstance(view, View):
            raise InvalidSubmission(f"a {op} takes a kvwire View, got {type(view).__name__}")
        if not callable(wake):
            raise InvalidSubmission(f"wake must be callable, got {type(wake).__name__}")
        namespace, blocks = self._read_hint(hint)
        timeout_s = self._timeout_s if hint.timeout_s is None else hint.timeout_s
        groups = view.groups
        unorder = None
        parts = None
        if blocks is not _NOT_BLOCKS:  # one object per block across groups (K1)
            keys, flat_addresses, parts = self._blocks_of(op, view, namespace, blocks)
            flat_sizes = _row_sizes(len(keys), int(parts.sum())) if len(keys) else _NO_ROWS
            total_bytes = len(keys) * int(parts.sum())
            offsets = [0, len(keys)]
        elif len(groups) == 1:  # the usual view: one group, no lists to build and join
            group = groups[0]
            rows = group.slots.size
            offsets = [0, rows]
            if rows:
                keys, flat_addresses, flat_sizes, total_bytes = self._rows_of(namespace, group, 0)
                if op == _GET and rows > 1:
                    self._refuse_overlap(view)  # increasing slots pass without address arrays
            else:
                keys, flat_addresses, flat_sizes, total_bytes = [], _NO_ROWS, _NO_ROWS, 0
        else:
            keys = []
            addresses, sizes = [], []
            offsets = [0]
            total_bytes = 0
            for index, group in enumerate(groups):
                rows = group.slots.size
                offsets.append(offsets[-1] + rows)
                if rows == 0:
                    continue
                group_keys, group_addresses, group_sizes, group_bytes = self._rows_of(namespace, group, index)
                keys += group_keys
                addresses.append(group_addresses)
                sizes.append(group_sizes)
                total_bytes += group_bytes
            if op == _GET:
                self._refuse_overlap(view)
            if len(addresses) == 1:
                flat_addresses, flat_sizes = addresses[0], sizes[0]
            elif addresses:
                flat_addresses, flat_sizes = np.concatenate(addresses), np.concatenate(sizes)
                # Issue rows block by block across groups (row 0 of every group, then row 1, ...),
                # so a store that fills up or a batch whose later part fails still holds whole
                # blocks of a prefix in every group, which is what a resuming request can use.
                within = np.concatenate([np.arange(offsets[i + 1] - offsets[i]) for i in range(len(offsets) - 1)])
                order = np.argsort(within, kind="stable")
                flat_addresses, flat_sizes = flat_addresses[order], flat_sizes[order]
                keys = [keys[i] for i in order.tolist()]
                unorder = np.argsort(order)
            else:
                flat_addresses = flat_sizes = _NO_ROWS
        most = self._chunk_rows
        if most is not None and parts is not None:  # the driver's bound counts each part (a span)
            most = max(1, most // max(1, parts.size))
        if total_bytes <= self._chunk_bytes and (most is None or len(keys) <= most):
            bounds = [0, len(keys)]  # one chunk; an empty submission still concludes on a worker
        else:
            bounds = self._chunk_bounds(flat_sizes, most).tolist()
        inline = total_bytes <= self._inline_bytes[op] and len(bounds) == 2  # one chunk, moved in the call
        ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
        later = None
        at_once = self._chunks_at_once
        if at_once is not None and len(ranges) > at_once:  # the rest is queued as chunks end
            later = collections.deque(ranges[at_once:])
            ranges = ranges[:at_once]
        with core.cond:
            if core.closed:
                raise SubmissionRejected(f"this blob backend is shut down; it takes no {op}")
            attempt = _BlobAttempt(core, op, view, wake, keys, flat_addresses, flat_sizes, offsets,
                                   len(bounds) - 1, timeout_s, unorder, parts, later)
            core.attempts.admit_locked(attempt)  # SubmissionRejected when every slot is held (S3.9)
            if inline:
                # The chunk's start, under the same hold of the lock (A8.1: the deadline is
                # still checked before the copy).
                go = attempt._begin_chunk_locked(inline=True)[0]
            elif attempt.deadline < core.watch_until:
                core.watch_until = attempt.deadline
                core.watch.notify()
        if inline:
            # One chunk, moved here: the attempt has concluded and quiesced when this returns
            # (A3 asks nothing of the holder; A2.6 lets both come before the return), and the
            # deadline thread owes its wakes, since no wake runs inside this call (W1.1, W1.6).
            if go:
                try:
                    result = _call_driver(core.driver, attempt, 0, len(keys), now=True)
                    if result is None:  # the driver would have waited: a worker moves the chunk
                        if attempt._hand_off():
                            core.queue.put((attempt, 0, len(keys)))
                    else:
                        _finish_chunk(attempt, 0, len(keys), result, inline=True)
                finally:
                    if attempt._outcome is None:  # handed off, or recording failed: the deadline thread watches it
                        with core.cond:
                            if attempt.deadline < core.watch_until:
                                core.watch_until = attempt.deadline
                                core.watch.notify()
            return attempt
        put = core.queue.put
        for lo, hi in ranges:
            put((attempt, lo, hi))
        return attempt

    def _rows_of(self, namespace: str, group: LayerGroupRows, index: int
                 ) -> tuple[list[str], np.ndarray, np.ndarray, int]:
        """A group's keys, row addresses, row sizes and bytes, once it is known that the
        backend may move them: a memory kind the driver reaches (M1.4), rows inside one open
        registration (M4) and a name on every row (N1.5); else ``InvalidSubmission``. ``index``
        is the group's place in the view. Only for a group with rows."""
        names = self._check_rows(group, index)
        region = group.region
        rows = group.slots.size
        return (store_keys(namespace, group.group_id, names), _row_addresses(region, group.slots),
                _row_sizes(rows, region.slot_bytes), rows * region.slot_bytes)

    def _check_rows(self, group: LayerGroupRows, index: int) -> np.ndarray:
        """A group's names, once it is known that the backend may move its rows: a memory kind
        the driver reaches (M1.4), rows inside one open registration (M4) and a name on every row
        (N1.5); else ``InvalidSubmission``. ``index`` is the group's place in the view. Only for
        a group with rows."""
        region = group.region
        if region.memory_kind not in self._capabilities.memory_kinds:
            raise InvalidSubmission(
                f"group {group.group_id} lies in {region.memory_kind.value} memory, which this store "
                f"driver cannot reach (it reaches: {_kinds(self._capabilities.memory_kinds)})")
        core = self._core
        if core.recognized.get(id(region)) is not region:
            core.recognize(group, index)  # M4: every row inside one registered region
        if group.names is None:
            raise InvalidSubmission(
                f"group {group.group_id} carries no content names; a blob backend addresses rows by name")
        return group.names

    def _blocks_of(self, op: str, view: View, namespace: str, blocks: object
                   ) -> tuple[list[str], np.ndarray, np.ndarray]:
        """The block objects of a view (K1): one key per row index, the rows' addresses as a
        ``(blocks, groups)`` array in ascending group id, and the groups' row sizes in that
        order. Raises ``InvalidSubmission`` before anything escapes when the view does not fit
        (K1.3): ``blocks`` is not its block layout, groups of different lengths, a group without
        names, a row named differently in two groups, or any refusal of a per-group submission
        (M1.4, M4, V4)."""
        layout = block_layout(view)
        if blocks != layout:
            try:
                parse_block_layout(blocks)
            except ValueError as exc:
                raise InvalidSubmission(f"store hint field {BLOCKS_FIELD!r}: {exc}") from None
            raise InvalidSubmission(
                f"store hint field {BLOCKS_FIELD!r} is {_clip(blocks)!r}, not this view's block layout "
                f"{_clip(layout)!r}; send blocks=kvwire.contract.block_layout(view) (K1.2, K1.3)")
        groups = sorted(view.groups, key=lambda g: g.group_id)
        if not groups:
            return [], np.zeros((0, 0), dtype=np.uint64), np.zeros(0, dtype=np.uint64)
        rows = groups[0].slots.size
        for group in groups[1:]:
            if group.slots.size != rows:
                raise InvalidSubmission(
                    f"a block object holds row j of every group, but group {groups[0].group_id} has {rows} rows and "
                    f"group {group.group_id} {group.slots.size}; block objects need groups of one length (K1.3)")
        parts = np.fromiter((g.region.slot_bytes for g in groups), dtype=np.uint64, count=len(groups))
        if rows == 0:  # a view without rows concludes like any other (V1.7)
            return [], np.zeros((0, len(groups)), dtype=np.uint64), parts
        index_of = {id(g): i for i, g in enumerate(view.groups)}
        every = [self._check_rows(group, index_of[id(group)]) for group in groups]
        names = every[0]
        for group, other in zip(groups[1:], every[1:], strict=True):
            if other.shape != names.shape:
                raise InvalidSubmission(
                    f"group {groups[0].group_id} names its rows with {names.shape[1]} bytes and group "
                    f"{group.group_id} with {other.shape[1]}: a block object is stored under one name for every "
                    "group (K1.3)")
            differs = np.flatnonzero((other != names).any(axis=1))
            if differs.size:
                j = int(differs[0])
                raise InvalidSubmission(
                    f"row {j} is named {bytes(names[j]).hex()} in group {groups[0].group_id} but "
                    f"{bytes(other[j]).hex()} in group {group.group_id}: a block object holds row j of every "
                    "group under one name (K1.3)")
        if op == _GET:
            self._refuse_overlap(view)
        try:
            keys = block_keys(namespace, layout, names)
        except ValueError as exc:  # not reached: the namespace and layout were checked
            raise InvalidSubmission(str(exc)) from None
        addresses = np.empty((rows, len(groups)), dtype=np.uint64)
        for column, group in enumerate(groups):
            addresses[:, column] = _row_addresses(group.region, group.slots)
        return keys, addresses, parts

    @staticmethod
    def _refuse_overlap(view: View) -> None:
        """V4: a fetch whose rows overlap raises ``InvalidSubmission`` naming two of them."""
        clash = view.overlapping_rows()
        if clash is not None:
            (ga, ra), (gb, rb) = clash
            raise InvalidSubmission(
                f"fetch rows overlap: row {ra} of group {view.groups[ga].group_id} and row {rb} of "
                f"group {view.groups[gb].group_id} locate the same memory (V4)")

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        """L1: which of ``names`` the store holds now in every group of ``groups``, under the
        hint's namespace (one ``contains`` call; no pins, nothing changed); with ``blocks`` in
        the hint, which block objects of that layout it holds, for ``groups`` that are the
        layout's group ids (K1.7). Waits at most ``timeout_s``, else the hint's, else the
        backend's ``timeout_s``. Refuses with ``InvalidSubmission`` when the driver offers no
        ``contains`` (``lookup`` undeclared)."""
        if self._core.closed:
            raise SubmissionRejected("this blob backend is shut down; it answers no lookup")
        if self._lookups is None:
            raise InvalidSubmission(
                f"this blob backend does not declare {LOOKUP!r}: its store driver "
                f"{type(self._core.driver).__name__} offers no contains()")
        namespace, blocks = self._read_hint(hint)
        if timeout_s is None:
            timeout_s = self._timeout_s if hint.timeout_s is None else hint.timeout_s
        layout = None
        if blocks is not _NOT_BLOCKS:
            try:
                parse_block_layout(blocks)
            except ValueError as exc:
                raise InvalidSubmission(f"store hint field {BLOCKS_FIELD!r}: {exc}") from None
            layout = str(blocks)  # a str, since it parsed
        return self._lookups.lookup(namespace, groups, names, check_timeout(timeout_s), layout=layout)

    def _read_hint(self, hint: Hint) -> tuple[str, HintValue | object]:
        """The namespace a store hint names (else the configured one) and its ``blocks`` value
        (:data:`_NOT_BLOCKS` when it has none); ``InvalidSubmission`` for a hint of another
        kind, a field not understood (``blocks`` too, unless the backend names
        ``block-objects``) or a namespace not allowed (H1.5, H1.8, H1.9)."""
        if not isinstance(hint, Hint):
            raise InvalidSubmission(f"the hint must be a kvwire Hint, got {type(hint).__name__}")
        if hint.kind != STORE_HINT_KIND:
            raise InvalidSubmission(
                f"a blob backend takes a hint of kind {STORE_HINT_KIND!r}, got kind {hint.kind!r}")
        if not hint.fields:
            return self._namespace, _NOT_BLOCKS
        allowed = _BLOCK_HINT_FIELDS if self._blocks else _HINT_FIELDS
        blocks: HintValue | object = _NOT_BLOCKS
        namespace = None
        for key, value in hint.fields:
            if key == "namespace":
                namespace = value
            elif key == BLOCKS_FIELD and self._blocks:
                blocks = value
            else:
                unknown = [k for k, _ in hint.fields if k not in allowed]
                raise InvalidSubmission(
                    f"store hint field(s) {', '.join(map(repr, unknown))} are not understood; a store "
                    f"hint to this backend may carry: {', '.join(allowed)}")
        if namespace is None:
            return self._namespace, blocks
        try:
            return check_namespace(namespace), blocks
        except ValueError as exc:
            raise InvalidSubmission(f"store hint field 'namespace': {exc}") from None

    def _chunk_bounds(self, sizes: np.ndarray, most: int | None) -> np.ndarray:
        """Row indices where chunks start, plus the end: a row belongs to the chunk of the
        ``chunk_bytes`` window its first byte falls in, and a chunk holds at most ``most`` rows."""
        n = sizes.size
        starts = np.cumsum(sizes, dtype=np.int64) - sizes.astype(np.int64)
        window = starts // self._chunk_bytes
        cuts = np.flatnonzero(window[1:] != window[:-1]) + 1
        bounds = np.concatenate(([0], cuts, [n])).astype(np.int64)
        if most is not None and n and int(np.diff(bounds).max()) > most:
            # and at most the driver's max_batch_keys rows each: cut long chunks every that many rows
            bounds = np.unique(np.concatenate([np.arange(a, b, most) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
                                              + [np.array([n])]))
        return bounds

    # -- lifecycle (B3) ------------------------------------------------------------------------

    def shutdown(self) -> frozenset[Attempt]:
        """Stop taking submissions, cancel every attempt not yet concluded, and return those
        whose memory access has not ended (a worker is still inside the driver for them). Once
        that set is empty the worker threads are stopped and joined. Idempotent."""
        core = self._core
        if self._lookups is not None:
            self._lookups.stop()
        with core.cond:
            core.closed = True
            for attempt in core.attempts.live_locked():
                if attempt._outcome is None:
                    attempt._conclude_locked(
                        Outcome.cancelled(attempt._masks_locked(), reason="the backend shut down",
                                          cause=Cause.SHUTDOWN))
                    core.wake_later(attempt)
            pending = frozenset(a for a in core.attempts.live_locked() if not a._quiesced)
        if not pending:
            self._stop_threads()
        return pending  # type: ignore[return-value]

    def _stop_threads(self) -> None:
        core = self._core
        core.stop()
        me = threading.current_thread()
        for thread in core.threads:
            if thread is not me and thread.is_alive():
                thread.join(timeout=10.0)
                if thread.is_alive():
                    log.warning("blob backend thread %s did not stop within 10 s", thread.name)

    def close(self, timeout_s: float | None = 10.0) -> None:
        """Shut down, wait up to ``timeout_s`` (``None``: forever) until every attempt has
        quiesced, close the registrations still open, and close the driver if this backend owns
        it. Raises ``TimeoutError``, leaving registrations and driver open, if an attempt has not
        quiesced by then. Idempotent."""
        core = self._core
        deadline = None if timeout_s is None else clock() + timeout_s
        while True:
            pending = self.shutdown()
            if not pending:
                break
            left = None if deadline is None else deadline - clock()
            quiet = (left is None or left > 0) and core.attempts.wait_quiesced(pending, left)
            if not quiet:
                raise TimeoutError(
                    f"{len(pending)} blob attempt(s) still inside the store driver after "
                    f"{timeout_s} s; their memory may still be in use")
        with core.cond:
            registrations = list(core.registered.values())
        for registration in registrations:
            registration.close()
        if self._owns_driver and not self._driver_closed:
            self._driver_closed = True
            core.driver.close()

    def __enter__(self) -> BlobBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"BlobBackend({type(self._core.driver).__name__}, namespace={self._namespace!r}, "
                f"{len(self._core.attempts)} in flight{', shut down' if self._core.closed else ''})")


#: ``_read_hint``'s answer for a hint without ``blocks`` (a hint's value may be ``None``).
_NOT_BLOCKS = object()


def _clip(text: object, most: int = 200) -> str:
    """``text`` as a str of at most about ``most`` characters, for a message."""
    shown = str(text)
    return shown if len(shown) <= most else shown[:most] + "..."


def _kinds(kinds: frozenset[MemoryKind]) -> str:
    return ", ".join(sorted(k.value for k in kinds))
