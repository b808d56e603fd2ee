"""Single-clause mutants of the reference backends (:mod:`kvwire.testing.reference`): each is the
kind of bug a third-party author writing directly on the contract could plausibly make, and
breaks exactly one clause. Unlike ``mutants.py`` (wrappers that break a rule from outside),
these change the backend's own code: a subclass overrides the one method where the bug lives.

Every module-level harness here can be run as ``--kvwire-harness
tests/conformance/reference_mutants.py:NAME``; ``test_reference_mutants.py`` runs each and
checks that the suite fails it on a test of the clause it breaks. :data:`reference_store` and
:data:`reference_peer` are the unbroken backends, which must pass.

Why one file of this size: the suite is pointed at each mutant by ``path:object``, and each
mutant is a short subclass of the reference backend it breaks in one clause."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvwire.contract import (
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    OutcomeStatus,
    PullRequest,
    View,
    WakeFn,
)
from kvwire.testing.reference.core import Access, ReferenceAttempt, Runner, read_rows
from kvwire.testing.reference.harness import ControlledStore, ReferencePeerHarness, ReferenceStoreHarness
from kvwire.testing.reference.peer import Ack, Cancel, Fabric, PullMessage, ReferencePeer, Rows, _Pull
from kvwire.testing.reference.store import (
    ReferenceStoreBackend,
    RowStatus,
    StoreReply,
    _Work,
    store_capabilities,
)

# -- how a mutant becomes a harness ---------------------------------------------------------------


class StoreMutantHarness(ReferenceStoreHarness):
    def __init__(self, name: str, backend: type[ReferenceStoreBackend], **options: Any) -> None:
        self.name = name
        self.backend = backend
        self.options = options

    def make_backend(self, end: ControlledStore, *, timeout_s: float, max_in_flight: int) -> ReferenceStoreBackend:
        return self.backend(end, namespace="default", timeout_s=timeout_s, max_in_flight=max_in_flight,
                            **self.options)

    def distribution(self) -> str:
        return f"tests/conformance/reference_mutants.py ({self.backend.__name__}, a deliberately broken backend)"


class PeerMutantHarness(ReferencePeerHarness):
    def __init__(self, name: str, peer: type[ReferencePeer]) -> None:
        self.name = name
        self.peer = peer

    def make_peer(self, fabric: Fabric, name: str, *, timeout_s: float, max_in_flight: int) -> ReferencePeer:
        return self.peer(fabric, name, timeout_s=timeout_s, max_in_flight=max_in_flight)

    def distribution(self) -> str:
        return f"tests/conformance/reference_mutants.py ({self.peer.__name__}, a deliberately broken backend)"


# -- store mutants -------------------------------------------------------------------------------


class DeadlineFromStart(ReferenceStoreBackend):
    """A8: the deadline is counted from when the worker starts the attempt, not from submission
    (an attempt queued behind a slow one gets extra time)."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        with self._runner.lock:
            attempt.deadline = float("inf")
            self._runner._deadlines = [e for e in self._runner._deadlines if e[2] is not attempt]
            heapq.heapify(self._runner._deadlines)
        return attempt

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        with self._runner.lock:
            attempt.deadline = time.monotonic() + attempt.timeout_s
            heapq.heappush(self._runner._deadlines, (attempt.deadline, -id(attempt), attempt))
            self._runner.lock.notify_all()
        super()._move(attempt, work)


class IgnoresHintTimeout(ReferenceStoreBackend):
    """A8: the hint's ``timeout_s`` is ignored; the option's deadline always applies."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        return super()._submit(op, view, Hint(hint.kind, hint.fields), wake)


class _NoCauseAttempt(ReferenceAttempt):
    def expire_locked(self) -> None:
        self.conclude_locked(OutcomeStatus.FAILED, None, f"deadline passed after {self.timeout_s:g} s")


class DeadlineWithoutCause(ReferenceStoreBackend):
    """A10: a deadline failure carries no cause, though the backend speaks contract 1.1."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _NoCauseAttempt
        return attempt


class _PollOnce(ReferenceAttempt):
    def poll(self) -> Any:
        out = self.outcome
        if out is not None:
            if getattr(self, "_answered", False):
                return None
            self._answered = True
        return out


class PollsOnce(ReferenceStoreBackend):
    """A1: poll() hands the outcome over once (a queue popped), then answers None."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _PollOnce
        return attempt


class _QuiescedWhenConcluded(ReferenceAttempt):
    def quiesced(self) -> bool:
        return self.outcome is not None


class QuiescesAtConclusion(ReferenceStoreBackend):
    """A2: quiesced() answers "concluded": a cancelled or expired fetch whose get is still in
    progress at the store says quiesced, and its rows are written after."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _QuiescedWhenConcluded
        return attempt


class _QuiescedWhileIdle(ReferenceAttempt):
    def quiesced(self) -> bool:
        # "quiet" meant: this attempt is done and no worker is busy.
        return self.access is Access.ENDED and self.runner._jobs.__len__() == 0 and not getattr(
            self.runner, "busy", False)


class QuiescedFlipsBack(ReferenceStoreBackend):
    """A2: quiesced() also asks whether the backend is idle, so it turns false again while later
    work runs."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _QuiescedWhileIdle
        return attempt

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        self._runner.busy = True  # type: ignore[attr-defined]
        try:
            super()._move(attempt, work)
        finally:
            self._runner.busy = False  # type: ignore[attr-defined]


class _SilentQuiescence(ReferenceAttempt):
    def untouch_locked(self) -> None:
        if self.access is Access.TOUCHING:
            self.access = Access.ENDED if self.outcome is not None else Access.WAITING
            if self.settled:
                self.runner.live.discard(self)  # frees the slot, but no wake


class NoWakeForLateQuiescence(ReferenceStoreBackend):
    """W1: quiescence that comes after the conclusion (a cancel or deadline while a store call
    runs) is not followed by a wake."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _SilentQuiescence
        return attempt


class _WakeFirst(ReferenceAttempt):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if self.outcome is None:
            self.wake()  # tell the holder at once, from this thread, instead of after the change
            time.sleep(0.001)  # (the store's bookkeeping between the two)
        concluded = super().conclude_locked(status, cause, reason, by_peer=by_peer)
        if concluded and self.wake in self.runner._wakes:
            self.runner._wakes.remove(self.wake)  # already woken above
        return concluded


class WakesBeforeOutcome(ReferenceStoreBackend):
    """W1: wake() is called before the outcome is stored."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _WakeFirst
        return attempt


class _GroupBlindStore:
    def __init__(self, end: ControlledStore) -> None:
        self.end = end

    def put(self, namespace: str, group_id: int, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        return self.end.put(namespace, 0, names, rows)

    def get(self, namespace: str, group_id: int, names: np.ndarray, slot_bytes: int) -> StoreReply:
        return self.end.get(namespace, 0, names, slot_bytes)


class KeysByNameOnly(ReferenceStoreBackend):
    """N1/A7: rows are keyed by (namespace, name), not (namespace, group, name): groups that name
    a block alike share one object."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(_GroupBlindStore(store), **options)


class _FallbackStore:
    def __init__(self, end: Any, own: str) -> None:
        self.end = end
        self.own = own

    def put(self, namespace: str, group_id: int, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        return self.end.put(namespace, group_id, names, rows)

    def get(self, namespace: str, group_id: int, names: np.ndarray, slot_bytes: int) -> StoreReply:
        reply = self.end.get(namespace, group_id, names, slot_bytes)
        missed = np.flatnonzero(reply.status == RowStatus.MISSING)
        if namespace == self.own or not missed.size:
            return reply
        again = self.end.get(self.own, group_id, names[missed], slot_bytes)
        status, data = reply.status.copy(), reply.data.copy() if reply.data is not None else None
        status[missed] = again.status
        assert data is not None and again.data is not None
        data[missed] = again.data
        return StoreReply(status, data, reply.reason or again.reason)


class FetchFallsBackToOwnNamespace(ReferenceStoreBackend):
    """H1/A7: a fetch that misses in the hint's namespace tries the backend's own default
    namespace too, and marks what it finds there."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._store = _FallbackStore(store, self._namespace)


class IgnoresHintNamespace(ReferenceStoreBackend):
    """H1: the hint's namespace is ignored; every row goes to the backend's own namespace."""

    def _namespace_of(self, hint: Hint) -> str:
        super()._namespace_of(hint)
        return self._namespace


class AcceptsUnknownHintFields(ReferenceStoreBackend):
    """H1: a store hint's fields other than ``namespace`` are silently ignored."""

    def _namespace_of(self, hint: Hint) -> str:
        if not isinstance(hint, Hint) or hint.kind != "store":
            raise InvalidSubmission(f"this store takes a hint of kind 'store', got {hint!r}")
        namespace = hint.get("namespace")
        return namespace if isinstance(namespace, str) else self._namespace


class StoresBeforeValidating(ReferenceStoreBackend):
    """S3: a publish checks and stores its groups one by one, so a view refused for its last
    group has already stored the rows of the first ones."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        if op == "publish":
            namespace = self._namespace_of(hint)
            for i, group in enumerate(view.groups):
                located = self._table.locate(group, i)
                if group.rows and group.names is not None:
                    rows = read_rows(located, group.region.slot_bytes)
                    self._runner.run(lambda g=group, r=rows: self._store.put(namespace, g.group_id, g.names, r))
        return super()._check(op, view, hint, wake)


class RejectedStillWakes(ReferenceStoreBackend):
    """S3: a submission refused for a full queue still has its wake called later (the wake was
    scheduled before the check)."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        try:
            return super()._submit(op, view, hint, wake)
        except Exception:
            with self._runner.lock:
                self._runner.later_locked(wake)
            raise


class _LeakyRunner(Runner):
    def admit_locked(self, attempt: ReferenceAttempt, what: str) -> None:
        if not self.closed and len(self.live) >= self.max_in_flight:
            self.live.add(attempt)  # counted before the bound is checked
        super().admit_locked(attempt, what)


class RejectionConsumesSlot(ReferenceStoreBackend):
    """S3: a full-queue rejection still takes a queue slot, never given back."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._runner.__class__ = _LeakyRunner


class _SharedLive:
    live: set[ReferenceAttempt] = set()


class SharesQueueBetweenInstances(ReferenceStoreBackend):
    """B1: the in-flight set (the queue bound, what shutdown cancels) is a class attribute,
    shared by every instance in the process."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._runner.live = _SharedLive.live


_module_tables: dict[int, Any] = {}


class RegionsAtModuleLevel(ReferenceStoreBackend):
    """B1: registered regions live in one module-level table for all instances."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._table = _module_tables.setdefault(0, self._table)

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        with self._runner.lock:
            self._runner.closed = True
        pending = frozenset(a for a in self._runner.live if not a.quiesced())
        for a in list(self._runner.live):
            with self._runner.lock:
                a.conclude_locked(OutcomeStatus.CANCELLED, Cause.SHUTDOWN, "the backend shut down")
        pending = frozenset(a for a in self._runner.live if not a.quiesced())
        if not pending:
            self._runner.stop()
        return pending


class DriftingBound(ReferenceStoreBackend):
    """B4: capabilities() builds a fresh declaration each call, its queue bound the room left."""

    def capabilities(self) -> Capabilities:
        return store_capabilities(max(1, self._capabilities.max_in_flight - len(self._runner.live)))


class _OffByOneRunner(Runner):
    def admit_locked(self, attempt: ReferenceAttempt, what: str) -> None:
        self.max_in_flight += 1
        try:
            super().admit_locked(attempt, what)
        finally:
            self.max_in_flight -= 1


class AdmitsOneBeyondBound(ReferenceStoreBackend):
    """S3/B4: the queue takes one attempt more than the bound it declares."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._runner.__class__ = _OffByOneRunner


class OverlapBySlotIndex(ReferenceStoreBackend):
    """V4: overlap is checked as equal (region, slot) pairs, so rows that alias through a second
    region describing the same memory pass."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        if op == "fetch":
            pairs = np.concatenate([np.stack([np.full(g.rows, g.region.region_id), g.slots], axis=1)
                                    for g in view.groups]) if view.groups else np.zeros((0, 2))
            if len(np.unique(pairs, axis=0)) != len(pairs):
                raise InvalidSubmission("fetch rows overlap: two rows name the same slot")
            return super()._check("publish", view, hint, wake)
        return super()._check(op, view, hint, wake)


class OverlapWithinGroupOnly(ReferenceStoreBackend):
    """V4: overlap is checked within each group, never across groups."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        if op == "fetch":
            for group in view.groups:
                if View((group,)).overlapping_rows() is not None:
                    raise InvalidSubmission(f"fetch rows of group {group.group_id} overlap")
            return super()._check("publish", view, hint, wake)
        return super()._check(op, view, hint, wake)


class _SortedMasks(ReferenceAttempt):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if self.outcome is None and self.op == "fetch":
            # the store was asked in ascending slot order; the bits are left in that order
            self.moved = [m[np.argsort(g.slots, kind="stable")] for g, m in zip(self.view.groups, self.moved,
                                                                              strict=True)]
        return super().conclude_locked(status, cause, reason, by_peer=by_peer)


class MasksInSlotOrder(ReferenceStoreBackend):
    """A9: a fetch's bytes land right, but its masks are handed over in ascending slot order
    instead of the view's row order."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _SortedMasks
        return attempt


class MissesBeyondThousandRows(ReferenceStoreBackend):
    """A9: a store call takes at most 1000 rows; rows beyond the first 1000 of a group are
    silently left out (misses on fetch, not held on publish)."""

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        store = self._store

        class Capped:
            def put(self, ns: str, gid: int, names: np.ndarray, rows: np.ndarray) -> StoreReply:
                reply = store.put(ns, gid, names[:1000], rows[:1000])
                status = np.full(len(names), RowStatus.DECLINED, dtype=np.uint8)
                status[:1000] = reply.status
                return StoreReply(status, None, reply.reason)

            def get(self, ns: str, gid: int, names: np.ndarray, size: int) -> StoreReply:
                reply = store.get(ns, gid, names[:1000], size)
                status = np.full(len(names), RowStatus.MISSING, dtype=np.uint8)
                status[:1000] = reply.status
                data = np.zeros((len(names), size), dtype=np.uint8)
                assert reply.data is not None
                data[:1000] = reply.data
                return StoreReply(status, data, reply.reason)

        self._store = Capped()
        try:
            super()._move(attempt, work)
        finally:
            self._store = store


class _NewOnlyStore:
    """Says HELD only for rows this put stored; rows already there answer MISSING (the store's
    "not stored by this call")."""

    def __init__(self, end: Any) -> None:
        self.end = end

    def put(self, namespace: str, group_id: int, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        before = self.end.get(namespace, group_id, names, rows.shape[1]).status == RowStatus.HELD
        reply = self.end.put(namespace, group_id, names, rows)
        status = reply.status.copy()
        status[before] = RowStatus.DECLINED
        return StoreReply(status, None, reply.reason)

    def get(self, namespace: str, group_id: int, names: np.ndarray, slot_bytes: int) -> StoreReply:
        return self.end.get(namespace, group_id, names, slot_bytes)


class PublishMaskFalseForHeldRows(ReferenceStoreBackend):
    """A5: a publish's mask says False for rows the store already held (only rows stored by this
    call count)."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(_NewOnlyStore(store), **options)


class _AllMissFails(ReferenceAttempt):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if status is OutcomeStatus.DELIVERED and self.op == "fetch" and self.view.rows and not any(
                m.any() for m in self.moved):
            status, cause, reason = OutcomeStatus.FAILED, Cause.FAULT, "the store holds none of the rows"
        return super().conclude_locked(status, cause, reason, by_peer=by_peer)


class AllMissIsFailure(ReferenceStoreBackend):
    """A5: a fetch in which every row misses is reported FAILED ("nothing found")."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _AllMissFails
        return attempt


class FaultAsMissAfterFirst(ReferenceStoreBackend):
    """A5: only a fault in the first group fails the attempt; a fault in a later group passes as
    a miss."""

    def _move(self, attempt: ReferenceAttempt, work: _Work) -> None:
        store = self._store
        first = [True]

        class Forgiving:
            def put(self, *args: Any) -> StoreReply:
                return store.put(*args)

            def get(self, ns: str, gid: int, names: np.ndarray, size: int) -> StoreReply:
                reply = store.get(ns, gid, names, size)
                if not first[0]:
                    status = reply.status.copy()
                    status[status == RowStatus.FAILED] = RowStatus.MISSING
                    reply = StoreReply(status, reply.data, "")
                first[0] = False
                return reply

        self._store = Forgiving()
        try:
            super()._move(attempt, work)
        finally:
            self._store = store


# -- peer mutants --------------------------------------------------------------------------------


class CutsLargeRows(ReferencePeer):
    """A7: the server sends at most 64 KiB of each row (one frame), and the requester marks the
    row delivered all the same."""

    def _send(self, to: bytes, message: Any) -> bool:
        if isinstance(message, Rows):
            data = []
            for d in message.data:
                d = d.copy()
                d[:, 65536:] = 0
                data.append(d)
            message = Rows(message.ticket, message.reply_to, tuple(data))
        return super()._send(to, message)


class CancelNotTold(ReferencePeer):
    """N2: a pull that ends early (cancel, deadline) is forgotten locally but the server is not
    told, so the server's answer (and its holder's pins) waits for its own deadline."""

    def _pull_ended_locked(self, pull: _Pull) -> None:
        self._pulls.pop(pull.ticket, None)


class _GreedyPull(_Pull):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if self.outcome is None and status is OutcomeStatus.DELIVERED:
            for mask in self.moved:
                served = int(mask.sum())
                mask[: served + 1] = True  # "up to and including" the last block served
        return super().conclude_locked(status, cause, reason, by_peer=by_peer)


class MarksBeyondServed(ReferencePeer):
    """N2/A7: the requester marks one block beyond the prefix the server sent."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        pull = super().fetch(view, hint, wake)
        pull.__class__ = _GreedyPull
        return pull


class IncomingRepeats(ReferencePeer):
    """N2: incoming() answers a request again on the next call if it has not been answered yet
    (the list is cleared on answer, not on hand-over)."""

    def incoming(self) -> tuple[PullRequest, ...]:
        with self._runner.lock:
            again = tuple(getattr(self, "_handed", {}).get(t) for t in self._taken if t in getattr(self, "_handed", {}))
        fresh = super().incoming()
        handed = self.__dict__.setdefault("_handed", {})
        for r in fresh:
            handed[int(r.ticket["id"])] = r  # type: ignore[arg-type]
        return tuple(r for r in again if r is not None) + fresh


class WakesBeforeRequestVisible(ReferencePeer):
    """W1: the serving wake is called as a request arrives, just before it is put where
    incoming() finds it."""

    def _on_request(self, message: PullMessage) -> None:
        with self._runner.lock:
            wake = self._serving_wake
        if wake is None:
            super()._on_request(message)
            return
        wake()
        time.sleep(0.001)  # (building the PullRequest)
        with self._runner.lock:
            self._serving_wake = lambda: None  # woken above already
            try:
                super()._on_request(message)
            finally:
                self._serving_wake = wake


class DeclineAsFault(ReferencePeer):
    """A10: a declined pull fails with cause FAULT instead of DECLINED."""

    def _handle(self, message: Any) -> None:
        from kvwire.testing.reference.peer import Declined, Fault
        if isinstance(message, Declined):
            with self._runner.lock:
                pull = self._pulls.pop(message.ticket, None)
                if pull is not None:
                    pull.conclude_locked(OutcomeStatus.FAILED, Cause.FAULT, message.reason)
            return
        super()._handle(message)
        _ = Fault


class PeerIgnoresHintTimeout(ReferencePeer):
    """A8: a pull's deadline ignores the hint's ``timeout_s``."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        return super().fetch(view, Hint(hint.kind, hint.fields), wake)


class DropsCredentials(ReferencePeer):
    """H1: a peer hint's ``credentials`` are checked but not passed on: the serving end's
    PullRequest carries none (H1.12)."""

    def _send(self, to: bytes, message: Any) -> bool:
        if isinstance(message, PullMessage) and message.credentials:
            message = PullMessage(message.ticket, message.reply_to, message.groups, message.slot_bytes, message.names)
        return super()._send(to, message)


class PeerRequestsBeforeAdmission(ReferencePeer):
    """S3: a pull sends its request to the server before it checks the queue bound, so a
    rejected fetch has already asked the server."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        with self._runner.lock:
            full = len(self._runner.live) >= self._runner.max_in_flight and not self._runner.closed
        if full and view.groups and view.groups[0].names is not None:
            server, _ = self._peer_of(hint)
            ticket = next(self._fabric.tickets)
            self._send(server, PullMessage(ticket, self.address(), tuple(g.group_id for g in view.groups),
                                       tuple(g.region.slot_bytes for g in view.groups), view.groups[0].names))
        return super().fetch(view, hint, wake)


class AnswerQuiescesBeforeCopy(ReferencePeer):
    """A2: an answer says quiesced as soon as it is queued, before its worker has copied the
    served rows out of memory (so its holder unpins and may reuse them while they are read)."""

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        answer = super().publish(view, hint, wake)
        answer.__class__ = _EarlyAnswer
        return answer


class _EarlyAnswer(ReferenceAttempt):
    def quiesced(self) -> bool:
        return True


class ShutdownKeepsPulls(ReferencePeer):
    """B3: shutdown() leaves pulls waiting for an answer in flight and reports them quiesced."""

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        with self._runner.lock:
            waiting = {t: p for t, p in self._pulls.items()}
            for pull in waiting.values():
                self._runner.live.discard(pull)
            self._pulls.clear()
        pending = super().shutdown()
        with self._runner.lock:
            self._pulls.update(waiting)
        return pending


_ = (threading, Callable, Ack, Cancel)

# -- the harnesses -------------------------------------------------------------------------------

reference_store = StoreMutantHarness("reference-store-unbroken", ReferenceStoreBackend)
reference_peer = PeerMutantHarness("reference-peer-unbroken", ReferencePeer)

deadline_from_start = StoreMutantHarness("deadline-from-start", DeadlineFromStart)
ignores_hint_timeout = StoreMutantHarness("ignores-hint-timeout", IgnoresHintTimeout)
deadline_without_cause = StoreMutantHarness("deadline-without-cause", DeadlineWithoutCause)
polls_once = StoreMutantHarness("polls-once", PollsOnce)
quiesces_at_conclusion = StoreMutantHarness("quiesces-at-conclusion", QuiescesAtConclusion)
quiesced_flips_back = StoreMutantHarness("quiesced-flips-back", QuiescedFlipsBack)
no_wake_for_late_quiescence = StoreMutantHarness("no-wake-for-late-quiescence", NoWakeForLateQuiescence)
wakes_before_outcome = StoreMutantHarness("wakes-before-outcome", WakesBeforeOutcome)
keys_by_name_only = StoreMutantHarness("keys-by-name-only", KeysByNameOnly)
fetch_falls_back_to_own_namespace = StoreMutantHarness("fetch-falls-back", FetchFallsBackToOwnNamespace)
ignores_hint_namespace = StoreMutantHarness("ignores-hint-namespace", IgnoresHintNamespace)
accepts_unknown_hint_fields = StoreMutantHarness("accepts-unknown-hint-fields", AcceptsUnknownHintFields)
stores_before_validating = StoreMutantHarness("stores-before-validating", StoresBeforeValidating)
rejected_still_wakes = StoreMutantHarness("rejected-still-wakes", RejectedStillWakes)
rejection_consumes_slot = StoreMutantHarness("rejection-consumes-slot", RejectionConsumesSlot)
shares_queue_between_instances = StoreMutantHarness("shares-queue", SharesQueueBetweenInstances)
regions_at_module_level = StoreMutantHarness("regions-at-module-level", RegionsAtModuleLevel)
drifting_bound = StoreMutantHarness("drifting-bound", DriftingBound)
admits_one_beyond_bound = StoreMutantHarness("admits-one-beyond-bound", AdmitsOneBeyondBound)
overlap_by_slot_index = StoreMutantHarness("overlap-by-slot-index", OverlapBySlotIndex)
overlap_within_group_only = StoreMutantHarness("overlap-within-group-only", OverlapWithinGroupOnly)
masks_in_slot_order = StoreMutantHarness("masks-in-slot-order", MasksInSlotOrder)
misses_beyond_thousand_rows = StoreMutantHarness("misses-beyond-1000-rows", MissesBeyondThousandRows)
publish_mask_false_for_held_rows = StoreMutantHarness("publish-mask-false-for-held", PublishMaskFalseForHeldRows)
all_miss_is_failure = StoreMutantHarness("all-miss-is-failure", AllMissIsFailure)
fault_as_miss_after_first = StoreMutantHarness("fault-as-miss-after-first", FaultAsMissAfterFirst)

cuts_large_rows = PeerMutantHarness("cuts-large-rows", CutsLargeRows)
cancel_not_told = PeerMutantHarness("cancel-not-told", CancelNotTold)
marks_beyond_served = PeerMutantHarness("marks-beyond-served", MarksBeyondServed)
incoming_repeats = PeerMutantHarness("incoming-repeats", IncomingRepeats)
wakes_before_request_visible = PeerMutantHarness("wakes-before-request-visible", WakesBeforeRequestVisible)
decline_as_fault = PeerMutantHarness("decline-as-fault", DeclineAsFault)
peer_ignores_hint_timeout = PeerMutantHarness("peer-ignores-hint-timeout", PeerIgnoresHintTimeout)
drops_credentials = PeerMutantHarness("drops-credentials", DropsCredentials)
peer_requests_before_admission = PeerMutantHarness("peer-requests-before-admission", PeerRequestsBeforeAdmission)
answer_quiesces_before_copy = PeerMutantHarness("answer-quiesces-before-copy", AnswerQuiescesBeforeCopy)
shutdown_keeps_pulls = PeerMutantHarness("shutdown-keeps-pulls", ShutdownKeepsPulls)
