"""The reference store backend: :class:`ReferenceStoreBackend`, written directly on
``kvwire.contract`` (no :mod:`kvwire.blob`, no :mod:`kvwire.attempts`: independent on purpose,
the second implementation the conformance suite is checked against), over
:class:`ReferenceStore`, an in-process object store that the two backends of one harness pair
share.

Read it as a worked example of a store written directly on the contract. Where each clause is met:

- M1: it declares HOST memory; every byte of the holder's memory it reads or writes goes through
  :meth:`ReferenceStoreBackend._read_rows` and :meth:`ReferenceStoreBackend._write_rows`, so a
  subclass that declares another kind overrides those two.
- M3/M4: :class:`~kvwire.contract.RegionTable` (``register_regions``, and ``locate_view`` in
  :meth:`ReferenceStoreBackend._check`).
- H1, V4, S3: :meth:`ReferenceStoreBackend._check` refuses a submission before anything escapes;
  the queue slot is taken last (:meth:`~kvwire.testing.reference.core.Runner.admit_locked`).
- A5/A7: :meth:`ReferenceStoreBackend._move`: one store call per :class:`_Call`; a row's bit is
  true only for the rows the store answered ``HELD``; ``MISSING`` is a miss, ``FAILED`` a fault.
- A1-A4, A8, W1: :mod:`kvwire.testing.reference.core`.
- N1: objects are keyed by (namespace, group, name), never by name alone.
- K1 (``block-objects``): with the store hint field ``blocks`` a submission keeps one object per
  row index, the rows of every group side by side in ascending group id, keyed by (namespace,
  block layout, name) (:meth:`ReferenceStoreBackend._calls`). A group id is an int and a layout a
  str, so per-group objects and block objects never meet (K1.6). :meth:`_check_blocks` refuses a
  view that does not fit (K1.3).
- L1 (``lookup``): :meth:`ReferenceStoreBackend.lookup`, asked on a thread of its own so the
  caller waits at most its deadline.
- B1: all state lives in the instance (its table, its runner); nothing at module level.
- B3: :meth:`ReferenceStoreBackend.shutdown`.

The grace after a deadline (A8): a deadline concludes an attempt at once; it quiesces when the
store call in progress for it returns, which for this in-process store is one copy of a group's
rows (of a submission's blocks, with ``blocks``)."""

from __future__ import annotations

import enum
import math
import numbers
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvwire import waiting
from kvwire.contract import (
    Backend,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    LookupFailed,
    OtherEnd,
    OutcomeStatus,
    RegionTable,
    SlotRegion,
    SubmissionRejected,
    TableRegistration,
    View,
    WakeFn,
    block_layout,
)
from kvwire.contract.blocks import BLOCKS_FIELD, parse_block_layout
from kvwire.contract.lookup import Lookup, lookup_arguments
from kvwire.contract.regions import Located
from kvwire.testing.reference.core import (
    ReferenceAttempt,
    Runner,
    read_rows,
    reference_capabilities,
    write_rows,
)

__all__ = ["ReferenceStore", "ReferenceStoreBackend", "RowStatus", "StoreReply", "StoreEnd", "Space",
           "STORE_HINT_KIND"]

#: The hint a store backend takes: ``Hint.of("store", namespace=..., blocks=...)``, both optional.
STORE_HINT_KIND = "store"
_HINT_FIELDS = frozenset({"namespace", BLOCKS_FIELD})
_NAMESPACE = re.compile(r"^[A-Za-z0-9._:@+=-][A-Za-z0-9._:@+=/-]{0,127}$")

#: Where an object lives in a namespace: a group id (an object holds one row of that group) or a
#: block layout (K1: an object holds one row of every group of the layout, side by side).
Space = int | str


class RowStatus(enum.IntEnum):
    """What the store answers for one row of a call."""

    #: get: found, bytes returned; put: the store holds the row now (stored, or already there);
    #: contains: held.
    HELD = 0
    #: get, contains: the store does not hold it (a miss, A5).
    MISSING = 1
    #: The store failed this row (a fault, A5).
    FAILED = 2
    #: put: refused for space; not stored, and no fault.
    DECLINED = 3


@dataclass(frozen=True, slots=True)
class StoreReply:
    """The store's answer to one call: a status per row; for a get, the rows' bytes (shape
    ``(rows, row_bytes)``, meaningful where ``HELD``); ``reason`` says why rows failed."""

    status: np.ndarray
    data: np.ndarray | None = None
    reason: str = ""


class StoreEnd(Protocol):
    """The calls a backend makes to its store. :class:`ReferenceStore` is one; a harness may put
    another between them (to hold calls or inject faults)."""

    def put(self, namespace: str, space: Space, names: np.ndarray, rows: np.ndarray) -> StoreReply: ...

    def get(self, namespace: str, space: Space, names: np.ndarray, row_bytes: int) -> StoreReply: ...

    def contains(self, namespace: str, space: Space, names: np.ndarray) -> StoreReply: ...


class ReferenceStore:
    """Named, immutable objects keyed by (namespace, space, name), in this process. Thread-safe.
    An object, once stored, keeps its bytes: a second put of the same key is already held. With
    ``capacity_bytes`` it holds at most that many bytes of objects and declines a row that does
    not fit (``DECLINED``: not stored, no fault); it never evicts."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self._objects: dict[tuple[str, Space, bytes], bytes] = {}
        self._lock = threading.Lock()
        self.capacity_bytes = capacity_bytes
        self._used = 0

    def put(self, namespace: str, space: Space, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        status = np.full(len(names), RowStatus.HELD, dtype=np.uint8)
        with self._lock:
            for i, (name, row) in enumerate(zip(names, rows, strict=True)):
                key = (namespace, space, name.tobytes())
                if key in self._objects:
                    continue
                if self.capacity_bytes is not None and self._used + row.nbytes > self.capacity_bytes:
                    status[i] = RowStatus.DECLINED
                    continue
                self._objects[key] = row.tobytes()
                self._used += row.nbytes
        return StoreReply(status)

    def get(self, namespace: str, space: Space, names: np.ndarray, row_bytes: int) -> StoreReply:
        status = np.full(len(names), RowStatus.MISSING, dtype=np.uint8)
        data = np.zeros((len(names), row_bytes), dtype=np.uint8)
        reason = ""
        with self._lock:
            found = [self._objects.get((namespace, space, name.tobytes())) for name in names]
        for i, blob in enumerate(found):
            if blob is None:
                continue
            if len(blob) != row_bytes:
                # Equal names in one group (one layout) mean interchangeable bytes (N1); a size
                # that differs is a broken store, not a miss.
                status[i] = RowStatus.FAILED
                reason = f"the stored object is {len(blob)} bytes, the row {row_bytes}"
                continue
            data[i] = np.frombuffer(blob, dtype=np.uint8)
            status[i] = RowStatus.HELD
        return StoreReply(status, data, reason)

    def contains(self, namespace: str, space: Space, names: np.ndarray) -> StoreReply:
        """Which of ``names`` are held, reading and changing nothing (L1.4)."""
        with self._lock:
            held = [(namespace, space, name.tobytes()) in self._objects for name in names]
        return StoreReply(np.where(np.array(held, dtype=bool), RowStatus.HELD, RowStatus.MISSING).astype(np.uint8))

    def remove(self, namespace: str, space: Space, names: np.ndarray) -> None:
        with self._lock:
            for name in names:
                gone = self._objects.pop((namespace, space, name.tobytes()), None)
                if gone is not None:
                    self._used -= len(gone)

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)


def store_capabilities(max_in_flight: int) -> Capabilities:
    return reference_capabilities(OtherEnd.STORE, max_in_flight)


@dataclass(frozen=True, slots=True)
class _Call:
    """One store call of a submission: the objects named ``names`` in ``space``, each holding
    row ``j`` of every group in ``groups`` (indices into the view) side by side, in that order."""

    space: Space
    names: np.ndarray
    groups: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Work:
    """A checked submission: its namespace, where each group's rows lie, and its store calls."""

    namespace: str
    located: tuple[Located, ...]
    calls: tuple[_Call, ...]


class ReferenceStoreBackend(Backend, Lookup):
    """Moves rows to and from a :class:`StoreEnd`. ``namespace`` is used when a hint names none;
    each submission has ``timeout_s`` (or the hint's ``timeout_s``) from its submission to
    conclude; at most ``max_in_flight`` attempts are in flight; ``workers`` threads call the
    store."""

    def __init__(self, store: StoreEnd, *, namespace: str = "default", timeout_s: float = 30.0,
                 max_in_flight: int = 64, workers: int = 1) -> None:
        if not _NAMESPACE.match(namespace):
            raise ValueError(f"store namespace {namespace!r} is not allowed: use 1-128 ASCII letters, digits or "
                             "'._:@+=-/', not starting with '/'")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self._store = store
        self._namespace = namespace
        self._timeout_s = float(timeout_s)
        self._capabilities = store_capabilities(max_in_flight)  # one frozen object for the instance's life (B4)
        self._table = RegionTable(self._capabilities.memory_kinds)
        self._runner = Runner("kvwire-reference-store", max_in_flight, workers)

    def capabilities(self) -> Capabilities:
        return self._capabilities

    def register_regions(self, regions: Sequence[SlotRegion]) -> TableRegistration:
        return self._table.register(regions)

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        """Fill the view's rows with the objects stored under their names."""
        return self._submit("fetch", view, hint, wake)

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        """Store each row under its name; an object already stored keeps its bytes and counts as
        held."""
        return self._submit("publish", view, hint, wake)

    # -- submitting (S3: refuse before anything escapes) -----------------------------------------

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        if self._runner.closed:
            raise SubmissionRejected(f"this backend is shut down; it takes no {op}")
        work = self._check(op, view, hint, wake)
        timeout_s = self._timeout_s if hint.timeout_s is None else hint.timeout_s
        attempt = ReferenceAttempt(self._runner, op, view, wake, timeout_s)
        with self._runner.lock:
            self._runner.admit_locked(attempt, op)
        # Only now does anything escape: the job reaches the store from a worker thread.
        self._runner.run(lambda: self._move(attempt, work))
        return attempt

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        if not isinstance(view, View):
            raise InvalidSubmission(f"a {op} takes a kvwire View, got {type(view).__name__}")
        if not callable(wake):
            raise InvalidSubmission(f"wake must be callable, got {type(wake).__name__}")
        namespace = self._namespace_of(hint)
        for group in view.groups:
            if group.rows and group.names is None:
                raise InvalidSubmission(f"group {group.group_id} carries no content names; this store addresses "
                                        "rows by (namespace, group, name)")
        located = self._table.locate_view(view)  # M4: every row in a registered region, or refuse
        if op == "fetch":
            clash = view.overlapping_rows()
            if clash is not None:  # V4
                (ga, ra), (gb, rb) = clash
                raise InvalidSubmission(
                    f"fetch rows overlap: row {ra} of group {view.groups[ga].group_id} and row {rb} of group "
                    f"{view.groups[gb].group_id} locate the same memory")
        blocks = dict(hint.fields).get(BLOCKS_FIELD, _ABSENT)
        if blocks is not _ABSENT:
            self._check_blocks(view, blocks)
        return _Work(namespace, located, self._calls(view, None if blocks is _ABSENT else block_layout(view)))

    def _namespace_of(self, hint: Hint) -> str:
        """H1: a store hint names the namespace (and K1's ``blocks``) and nothing else this
        backend would ignore."""
        if not isinstance(hint, Hint):
            raise InvalidSubmission(f"the hint must be a kvwire Hint, got {type(hint).__name__}")
        if hint.kind != STORE_HINT_KIND:
            raise InvalidSubmission(f"this store takes a hint of kind {STORE_HINT_KIND!r}, got {hint.kind!r}")
        unknown = sorted(k for k, _ in hint.fields if k not in _HINT_FIELDS)
        if unknown:
            raise InvalidSubmission(f"store hint field(s) {', '.join(map(repr, unknown))} are not understood; a "
                                    f"store hint may carry: {', '.join(sorted(_HINT_FIELDS))}")
        namespace = hint.get("namespace")
        if namespace is None:
            return self._namespace
        if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
            raise InvalidSubmission(f"store hint field 'namespace' must be 1-128 ASCII letters, digits or "
                                    f"'._:@+=-/', got {namespace!r}")
        return namespace

    @staticmethod
    def _check_blocks(view: View, blocks: object) -> None:
        """K1.3: a view fits block objects when ``blocks`` is its block layout, every group names
        its rows, the groups are of one length, and row ``j`` has one name in every group."""
        layout = block_layout(view)
        if blocks != layout:
            raise InvalidSubmission(f"store hint field {BLOCKS_FIELD!r} must be this view's block layout "
                                    f"{layout[:200]!r} (kvwire.contract.block_layout(view)), got {blocks!r:.200}")
        lengths = sorted({group.rows for group in view.groups})
        if len(lengths) > 1:
            raise InvalidSubmission(f"block objects need groups of one length; this view's groups have {lengths} rows")
        if not lengths or lengths[0] == 0:
            return
        first = view.groups[0]
        assert first.names is not None  # checked with N1.5 above
        for group in view.groups[1:]:
            assert group.names is not None
            if group.names.shape != first.names.shape:
                raise InvalidSubmission(f"block objects need one name per block: group {group.group_id} names its "
                                        f"rows with {group.names.shape[1]} bytes, group {first.group_id} with "
                                        f"{first.names.shape[1]}")
            differs = np.flatnonzero((group.names != first.names).any(axis=1))
            if differs.size:
                raise InvalidSubmission(f"block objects need one name per block: row {int(differs[0])} is named "
                                        f"differently in group {group.group_id} than in group {first.group_id}")

    @staticmethod
    def _calls(view: View, layout: str | None) -> tuple[_Call, ...]:
        """The store calls of a checked view: one per group (an object per row of it), or, with a
        block layout, one for all groups in ascending id (an object per block, K1.4)."""
        if layout is None:
            return tuple(_Call(group.group_id, group.names, (gi,))
                         for gi, group in enumerate(view.groups) if group.rows and group.names is not None)
        order = tuple(sorted(range(len(view.groups)), key=lambda gi: view.groups[gi].group_id))
        names = view.groups[order[0]].names if order else None
        if names is None or not len(names):
            return ()
        return (_Call(layout, names, order),)

    # -- moving (a worker thread) -------------------------------------------------------------

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        """One store call per :class:`_Call`, in order. Between calls a cancel or the deadline
        stops the attempt; a call in progress runs to its end and only then does the attempt
        quiesce. A call's answer sets the bits of its rows in every group it holds."""
        fault: str | None = None
        groups = attempt.view.groups
        for call in work.calls:
            with self._runner.lock:
                if not attempt.touch_locked():
                    return  # concluded meanwhile (cancel, deadline, shutdown): touch nothing more
            held: np.ndarray | None = None
            sizes = [groups[gi].region.slot_bytes for gi in call.groups]
            try:
                if attempt.op == "publish":
                    # The store copies the bytes before put() returns: after it, this call's
                    # memory is no longer read.
                    rows = np.concatenate([self._read_rows(work.located[gi], size)
                                           for gi, size in zip(call.groups, sizes, strict=True)], axis=1)
                    reply = self._store.put(work.namespace, call.space, call.names, rows)
                    held = reply.status == RowStatus.HELD
                else:
                    reply = self._store.get(work.namespace, call.space, call.names, sum(sizes))
                    held = reply.status == RowStatus.HELD
                    assert reply.data is not None
                    found, start = np.flatnonzero(held), 0
                    for gi, size in zip(call.groups, sizes, strict=True):
                        self._write_rows(work.located[gi], size, found, reply.data[found, start:start + size])
                        start += size
                failed = reply.status == RowStatus.FAILED
                if failed.any() and fault is None:
                    fault = (f"the store failed {_what(call, groups, int(np.argmax(failed)))}: "
                             f"{reply.reason or 'no reason given'}")
            except Exception as exc:  # a store call that raises is a fault of the whole call (S5)
                held = None
                fault = fault or f"the store call for {_what(call, groups)} raised {type(exc).__name__}: {exc}"
            with self._runner.lock:
                if held is not None and attempt.outcome is None:
                    for gi in call.groups:
                        attempt.moved[gi][:] = held
                attempt.untouch_locked()
        with self._runner.lock:
            if fault is None:
                attempt.conclude_locked(OutcomeStatus.DELIVERED)
            else:
                attempt.conclude_locked(OutcomeStatus.FAILED, Cause.FAULT, fault)

    # -- row copies: the only code that touches the holder's memory ----------------------------

    def _read_rows(self, located: Located, slot_bytes: int) -> np.ndarray:
        """A private copy, in host memory, of the rows of one group a publish hands the store,
        shape ``(rows, slot_bytes)``. This store reaches HOST memory, the one kind it declares; a
        subclass that declares another kind overrides this and :meth:`_write_rows`."""
        return read_rows(located, slot_bytes)

    def _write_rows(self, located: Located, slot_bytes: int, rows: np.ndarray, data: np.ndarray) -> None:
        """Write ``data[k]`` into row ``rows[k]`` of one group (indices into the group), the
        rows a fetch found; the bytes are in place when it returns."""
        write_rows(located, slot_bytes, rows, data)

    # -- lookup (L1, K1.7) --------------------------------------------------------------------

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        """L1: which of ``names`` the store holds now in every group of ``groups``, under the
        hint's namespace; with ``blocks`` in the hint, which block objects of that layout it
        holds (K1.7). Reads no bytes and changes nothing. Waits at most ``timeout_s``, else the
        hint's, else the backend's ``timeout_s``; a store that does not answer by then, or that
        fails a name, raises ``LookupFailed``."""
        if self._runner.closed:
            raise SubmissionRejected("this backend is shut down; it answers no lookup")
        ids, frozen = lookup_arguments(groups, names)
        namespace = self._namespace_of(hint)
        spaces = self._lookup_spaces(ids, hint)
        seconds = _lookup_timeout(timeout_s if timeout_s is not None else
                                  self._timeout_s if hint.timeout_s is None else hint.timeout_s)
        replies = _ask(lambda: [self._store.contains(namespace, space, frozen) for space in spaces], seconds)
        held = np.ones(frozen.shape[0], dtype=bool)
        for space, reply in zip(spaces, replies, strict=True):
            failed = np.flatnonzero(reply.status == RowStatus.FAILED)
            if failed.size:
                where = f"block layout {space!r}" if isinstance(space, str) else f"group {space}"
                raise LookupFailed(f"the store failed name {int(failed[0])} in {where}: "
                                   f"{reply.reason or 'no reason given'}")
            held &= reply.status == RowStatus.HELD
        held.setflags(write=False)
        return held

    @staticmethod
    def _lookup_spaces(ids: tuple[int, ...], hint: Hint) -> tuple[Space, ...]:
        """Where a lookup asks: each group listed, or with ``blocks`` the one layout, whose group
        ids must be exactly the groups listed (K1.7)."""
        blocks = dict(hint.fields).get(BLOCKS_FIELD, _ABSENT)
        if blocks is _ABSENT:
            return ids
        try:
            pairs = parse_block_layout(blocks)
        except ValueError as exc:
            raise InvalidSubmission(f"store hint field {BLOCKS_FIELD!r}: {exc}") from None
        if sorted(ids) != [group for group, _ in pairs]:
            raise InvalidSubmission(f"a lookup with {BLOCKS_FIELD!r} lists exactly the layout's group ids "
                                    f"{[group for group, _ in pairs]}, in any order; got {list(ids)}")
        assert isinstance(blocks, str)
        return (blocks,)

    # -- lifecycle (B3) -----------------------------------------------------------------------

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        """Refuse later submissions, cancel what has not concluded, and return the attempts a
        worker is still touching. Once none is left the threads stop. Idempotent."""
        runner = self._runner
        with runner.lock:
            runner.closed = True
            self._table.close()
            for attempt in list(runner.live):
                attempt.conclude_locked(OutcomeStatus.CANCELLED, Cause.SHUTDOWN, "the backend shut down")
            pending = frozenset(a for a in runner.live if not a.quiesced())
        if not pending:
            runner.stop()
        return pending

    def close(self) -> None:
        """Stop the threads if :meth:`shutdown` has not (idempotent)."""
        if not self.shutdown():
            self._runner.stop()

    def __repr__(self) -> str:
        return f"ReferenceStoreBackend(namespace={self._namespace!r}, {len(self._runner.live)} in flight)"


#: A hint field that is not there (``None`` is a value a hint may hold).
_ABSENT = object()


def _what(call: _Call, groups: Sequence[LayerGroupRows], row: int | None = None) -> str:
    """A call's rows in words, for a fault's reason."""
    if isinstance(call.space, str):
        return f"block {row} (layout {call.space!r})" if row is not None else f"blocks of layout {call.space!r}"
    gid = groups[call.groups[0]].group_id
    return f"row {row} of group {gid}" if row is not None else f"group {gid}"


def _lookup_timeout(timeout_s: object) -> float:
    """L1.9: a lookup's deadline is a real number of seconds, finite and > 0."""
    seconds = math.nan
    if isinstance(timeout_s, numbers.Real) and not isinstance(timeout_s, bool):
        try:
            seconds = float(timeout_s)
        except OverflowError:  # an int beyond any float (10**400): no finite deadline
            pass
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidSubmission(f"a lookup's timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    return seconds


def _ask(call: Callable[[], list[StoreReply]], timeout_s: float) -> list[StoreReply]:
    """Run ``call`` on a thread of its own and wait at most ``timeout_s`` for it (L1.7): a store
    that does not answer fails the lookup, and its call is left to end on its own (its answer is
    dropped). One thread per lookup keeps this short; a backend that expects a store to hang
    often queues lookups on one thread instead."""
    done = threading.Event()
    answer: list[list[StoreReply] | BaseException] = []

    def run() -> None:
        try:
            answer.append(call())
        except Exception as exc:  # the caller raises it as LookupFailed
            answer.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="kvwire-reference-store-lookup", daemon=True).start()
    if not waiting.wait_event(done, timeout_s):
        raise LookupFailed(f"the store did not answer the lookup within its deadline of {timeout_s:g} s")
    result = answer[0]
    if isinstance(result, BaseException):
        raise LookupFailed(f"the store's contains call raised {type(result).__name__}: {result}") from result
    return result
