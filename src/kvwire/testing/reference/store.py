"""The reference store backend: :class:`ReferenceStoreBackend`, written directly on
``kvwire.contract`` (no :mod:`kvwire.blob`), over :class:`ReferenceStore`, an in-process object
store that the two backends of one harness pair share.

Read it as a template. Where each clause is met:

- M3/M4: :class:`~kvwire.contract.RegionTable` (``register_regions``, and ``locate_view`` in
  :meth:`ReferenceStoreBackend._check`).
- H1, V4, S3: :meth:`ReferenceStoreBackend._check` refuses a submission before anything escapes;
  the queue slot is taken last (:meth:`~kvwire.testing.reference.core.Reactor.admit_locked`).
- A5/A7: :meth:`ReferenceStoreBackend._move`: one store call per group; a row's bit is true
  only for the rows the store answered ``HELD``; ``MISSING`` is a miss, ``FAILED`` a fault.
- A1-A4, A8, W1: :mod:`kvwire.testing.reference.core`.
- N1: objects are keyed by (namespace, group, name), never by name alone.
- B1: all state lives in the instance (its table, its reactor); nothing at module level.
- B3: :meth:`ReferenceStoreBackend.shutdown`.

The grace after a deadline (A8): a deadline concludes an attempt at once; it quiesces when the
store call in progress for it returns, which for this in-process store is one copy of a group's
rows."""

from __future__ import annotations

import enum
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvwire.contract import (
    Backend,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    OtherEnd,
    OutcomeStatus,
    RegionTable,
    SlotRegion,
    SubmissionRejected,
    TableRegistration,
    View,
    WakeFn,
)
from kvwire.contract.regions import Located
from kvwire.testing.reference.core import (
    Reactor,
    ReferenceAttempt,
    read_rows,
    reference_capabilities,
    write_rows,
)

__all__ = ["ReferenceStore", "ReferenceStoreBackend", "RowStatus", "StoreReply", "StoreEnd", "STORE_HINT_KIND"]

#: The hint a store backend takes: ``Hint.of("store", namespace=...)``, the namespace optional.
STORE_HINT_KIND = "store"
_HINT_FIELDS = frozenset({"namespace"})
_NAMESPACE = re.compile(r"^[A-Za-z0-9._:@+=-][A-Za-z0-9._:@+=/-]{0,127}$")


class RowStatus(enum.IntEnum):
    """What the store answers for one row of a call."""

    #: get: found, bytes returned; put: the store holds the row now (stored, or already there).
    HELD = 0
    #: get: the store does not hold it (a miss, A5).
    MISSING = 1
    #: The store failed this row (a fault, A5).
    FAILED = 2
    #: put: refused for space; not stored, and no fault.
    DECLINED = 3


@dataclass(frozen=True, slots=True)
class StoreReply:
    """The store's answer to one call: a status per row; for a get, the rows' bytes (shape
    ``(rows, slot_bytes)``, meaningful where ``HELD``); ``reason`` says why rows failed."""

    status: np.ndarray
    data: np.ndarray | None = None
    reason: str = ""


class StoreEnd(Protocol):
    """The calls a backend makes to its store. :class:`ReferenceStore` is one; a harness may put
    another between them (to hold calls or inject faults)."""

    def put(self, namespace: str, group_id: int, names: np.ndarray, rows: np.ndarray) -> StoreReply: ...

    def get(self, namespace: str, group_id: int, names: np.ndarray, slot_bytes: int) -> StoreReply: ...


class ReferenceStore:
    """Named, immutable objects keyed by (namespace, group, name), in this process. Thread-safe.
    An object, once stored, keeps its bytes: a second put of the same key is already held."""

    def __init__(self) -> None:
        self._objects: dict[tuple[str, int, bytes], bytes] = {}
        self._lock = threading.Lock()

    def put(self, namespace: str, group_id: int, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        rows = np.ascontiguousarray(rows, dtype=np.uint8)
        with self._lock:
            for name, row in zip(names, rows, strict=True):
                self._objects.setdefault((namespace, group_id, name.tobytes()), row.tobytes())
        return StoreReply(np.full(len(names), RowStatus.HELD, dtype=np.uint8))

    def get(self, namespace: str, group_id: int, names: np.ndarray, slot_bytes: int) -> StoreReply:
        status = np.full(len(names), RowStatus.MISSING, dtype=np.uint8)
        data = np.zeros((len(names), slot_bytes), dtype=np.uint8)
        reason = ""
        with self._lock:
            found = [self._objects.get((namespace, group_id, name.tobytes())) for name in names]
        for i, blob in enumerate(found):
            if blob is None:
                continue
            if len(blob) != slot_bytes:
                # Equal names in one group mean interchangeable bytes (N1); a size that differs
                # is a broken store, not a miss.
                status[i] = RowStatus.FAILED
                reason = f"the stored object is {len(blob)} bytes, the row {slot_bytes}"
                continue
            data[i] = np.frombuffer(blob, dtype=np.uint8)
            status[i] = RowStatus.HELD
        return StoreReply(status, data, reason)

    def remove(self, namespace: str, group_id: int, names: np.ndarray) -> None:
        with self._lock:
            for name in names:
                self._objects.pop((namespace, group_id, name.tobytes()), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)


def store_capabilities(max_in_flight: int) -> Capabilities:
    return reference_capabilities(OtherEnd.STORE, max_in_flight)


@dataclass(frozen=True, slots=True)
class _Work:
    """A checked submission: its namespace and where each group's rows lie."""

    namespace: str
    located: tuple[Located, ...]


class ReferenceStoreBackend(Backend):
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
        self._reactor = Reactor("kvwire-reference-store", max_in_flight, workers)

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
        if self._reactor.closed:
            raise SubmissionRejected(f"this backend is shut down; it takes no {op}")
        work = self._check(op, view, hint, wake)
        timeout_s = self._timeout_s if hint.timeout_s is None else hint.timeout_s
        attempt = ReferenceAttempt(self._reactor, op, view, wake, timeout_s)
        with self._reactor.lock:
            self._reactor.admit_locked(attempt, op)
        # Only now does anything escape: the job reaches the store from a worker thread.
        self._reactor.run(lambda: self._move(attempt, work))
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
        return _Work(namespace, located)

    def _namespace_of(self, hint: Hint) -> str:
        """H1: a store hint names the namespace and nothing else this backend would ignore."""
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

    # -- moving (a worker thread) -------------------------------------------------------------

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        """One store call per group, in view order. Between calls a cancel or the deadline stops
        the attempt; a call in progress runs to its end and only then does the attempt quiesce."""
        fault: str | None = None
        for gi, (group, located) in enumerate(zip(attempt.view.groups, work.located, strict=True)):
            if group.rows == 0:
                continue
            with self._reactor.lock:
                if not attempt.touch_locked():
                    return  # concluded meanwhile (cancel, deadline, shutdown): touch nothing more
            held: np.ndarray | None = None
            try:
                names = group.names
                assert names is not None
                size = group.region.slot_bytes
                if attempt.op == "publish":
                    # The store copies the bytes before put() returns: after it, this group's
                    # memory is no longer read.
                    reply = self._store.put(work.namespace, group.group_id, names, read_rows(located, size))
                    held = reply.status == RowStatus.HELD
                else:
                    reply = self._store.get(work.namespace, group.group_id, names, size)
                    held = reply.status == RowStatus.HELD
                    assert reply.data is not None
                    write_rows(located, size, np.flatnonzero(held), reply.data[held])
                failed = reply.status == RowStatus.FAILED
                if failed.any() and fault is None:
                    row = int(np.argmax(failed))
                    fault = f"the store failed row {row} of group {group.group_id}: {reply.reason or 'no reason given'}"
            except Exception as exc:  # a store call that raises is a fault of the whole call (S5)
                held = None
                fault = fault or f"the store call for group {group.group_id} raised {type(exc).__name__}: {exc}"
            with self._reactor.lock:
                if held is not None and attempt.outcome is None:
                    attempt.moved[gi][:] = held
                attempt.untouch_locked()
        with self._reactor.lock:
            if fault is None:
                attempt.conclude_locked(OutcomeStatus.DELIVERED)
            else:
                attempt.conclude_locked(OutcomeStatus.FAILED, Cause.FAULT, fault)

    # -- lifecycle (B3) -----------------------------------------------------------------------

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        """Refuse later submissions, cancel what has not concluded, and return the attempts a
        worker is still touching. Once none is left the threads stop. Idempotent."""
        reactor = self._reactor
        with reactor.lock:
            reactor.closed = True
            self._table.close()
            for attempt in list(reactor.live):
                attempt.conclude_locked(OutcomeStatus.CANCELLED, Cause.SHUTDOWN, "the backend shut down")
            pending = frozenset(a for a in reactor.live if not a.quiesced())
        if not pending:
            reactor.stop()
        return pending

    def close(self) -> None:
        """Stop the threads if :meth:`shutdown` has not (idempotent)."""
        if not self.shutdown():
            self._reactor.stop()

    def __repr__(self) -> str:
        return f"ReferenceStoreBackend(namespace={self._namespace!r}, {len(self._reactor.live)} in flight)"
