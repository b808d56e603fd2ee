"""Conformance harnesses of the reference backends, usable as
``--kvwire-harness kvwire.testing.reference.harness:store_harness`` (or ``:peer_harness``).

Both support holds and fault plans through :mod:`kvwire.testing.gate`, the way any harness of a
backend not built on :class:`kvwire.blob.BlobBackend` can: the store harness puts a
:class:`ControlledStore` between each backend and the shared :class:`ReferenceStore`; the peer
harness gives the fabric a :class:`ControlledLink`. Neither backend is registered as a plugin,
so each harness answers :meth:`~kvwire.testing.harness.Harness.capabilities` itself."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

import numpy as np

from kvwire.contract import Capabilities, Hint
from kvwire.testing.gate import CallFaults, Gate, faulted_rows
from kvwire.testing.harness import Ends, FaultPlan, Harness, Unavailable
from kvwire.testing.reference.peer import (
    Fabric,
    Fault,
    Link,
    Message,
    PullMessage,
    ReferencePeer,
    Rows,
    peer_capabilities,
)
from kvwire.testing.reference.store import (
    ReferenceStore,
    ReferenceStoreBackend,
    RowStatus,
    Space,
    StoreReply,
    store_capabilities,
)
from kvwire.testing.stores import FILL_CHUNK, fill_until_full

__all__ = ["ReferenceStoreHarness", "ReferencePeerHarness", "ControlledStore", "ControlledLink", "store_harness",
           "peer_harness"]

NAMESPACE = "conformance"
#: The namespace the reference store backends are configured with: a hint without one uses it.
CONFIGURED_NAMESPACE = "default"
#: The bytes of objects a pair's store holds: twice what the harness API asks a store to take
#: (32 MiB) without declining, and small enough to fill (Ends.fill).
STORE_CAPACITY_BYTES = 64 << 20
#: The namespace a fill stores its objects under (never one the suite uses).
FILL_NAMESPACE = "kvwire-fill"

#: Numbers the peer pairs the peer harness opens, so every peer's address is unique in the process.
_pairs = itertools.count(1)


class ControlledStore:
    """A :class:`~kvwire.testing.reference.store.StoreEnd` in front of ``store``: each call waits
    at ``gate`` while it is held; rows a :class:`FaultPlan` names, and the calls its ``schedule``
    hits, answer ``FAILED`` (or raise) at the store."""

    def __init__(self, store: ReferenceStore, gate: Gate, plan: FaultPlan | None, schedule: CallFaults) -> None:
        self.store = store
        self.gate = gate
        self.plan = plan
        self.schedule = schedule

    def put(self, namespace: str, space: Space, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        with self.gate.passage():
            verdict = self.schedule.arrive("put", len(names), self._evict(namespace, space, names))
            if verdict.raises:
                raise RuntimeError(verdict.raises)
            failed = verdict.failed | faulted_rows(self.plan, "publish", names)
            go = ~(failed | verdict.declined)
            status = np.full(len(names), RowStatus.FAILED, dtype=np.uint8)
            status[verdict.declined & ~failed] = RowStatus.DECLINED
            status[go] = self.store.put(namespace, space, names[go], rows[go]).status
            return StoreReply(status, None, verdict.reason if failed.any() else "")

    def get(self, namespace: str, space: Space, names: np.ndarray, row_bytes: int) -> StoreReply:
        with self.gate.passage():
            verdict = self.schedule.arrive("get", len(names), self._evict(namespace, space, names))
            if verdict.raises:
                raise RuntimeError(verdict.raises)
            failed = verdict.failed | faulted_rows(self.plan, "fetch", names)
            reply = self.store.get(namespace, space, names[~failed], row_bytes)
            status = np.full(len(names), RowStatus.FAILED, dtype=np.uint8)
            data = np.zeros((len(names), row_bytes), dtype=np.uint8)
            status[~failed] = reply.status
            assert reply.data is not None
            data[~failed] = reply.data
            return StoreReply(status, data, verdict.reason if failed.any() else reply.reason)

    def contains(self, namespace: str, space: Space, names: np.ndarray) -> StoreReply:
        """A lookup's call (L1): held like every other; the names the plan lists for lookups
        answer ``FAILED``, and a schedule's ``exists`` records apply to it."""
        with self.gate.passage():
            verdict = self.schedule.arrive("exists", len(names))
            if verdict.raises:
                raise RuntimeError(verdict.raises)
            failed = verdict.failed | (np.array([n.tobytes() in self.plan.lookup for n in names], dtype=bool)
                                       if self.plan is not None else np.zeros(len(names), dtype=bool))
            status = self.store.contains(namespace, space, names).status.copy()
            status[failed] = RowStatus.FAILED
            return StoreReply(status, None, verdict.reason if failed.any() else "")

    def _evict(self, namespace: str, space: Space, names: np.ndarray) -> Callable[[np.ndarray], None]:
        return lambda rows: self.store.remove(namespace, space, names[rows])


class ReferenceStoreHarness(Harness):
    name = "reference-store"
    #: A deadline concludes at once; the attempt quiesces when the store call in progress for it
    #: returns (one copy of a group's rows in this process).
    quiesce_grace_s = 2.0
    max_in_flight = 64
    #: :class:`ControlledStore` fails the names of :attr:`FaultPlan.lookup` (L1.8).
    lookup_faults = True

    def capabilities(self) -> Capabilities:
        return store_capabilities(self.max_in_flight)

    def distribution(self) -> str:
        return "kvwire.testing.reference.store (the reference store backend shipped with kvwire)"

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        store = ReferenceStore(capacity_bytes=STORE_CAPACITY_BYTES)
        gate = Gate()
        schedule = CallFaults(faults.schedule if faults is not None else ())
        end = ControlledStore(store, gate, faults, schedule)

        def another() -> ReferenceStoreBackend:
            return self.make_backend(end, timeout_s=timeout_s, max_in_flight=max_in_flight or self.max_in_flight)

        source, sink = another(), another()
        hint = Hint.of("store", namespace=NAMESPACE)
        return Ends(source, sink, hint, hint, hold=gate.hold,
                    extra={"store": store, "gate": gate, "schedule": schedule, "namespace": CONFIGURED_NAMESPACE},
                    fill=lambda row_bytes: fill_reference_store(store, row_bytes), another_sink=another)

    def make_backend(self, end: ControlledStore, *, timeout_s: float, max_in_flight: int) -> ReferenceStoreBackend:
        """One end. Mutants of the reference backend override this."""
        return ReferenceStoreBackend(end, namespace=CONFIGURED_NAMESPACE, timeout_s=timeout_s,
                                     max_in_flight=max_in_flight)

    def close(self, ends: Ends) -> None:
        _release(ends)
        super().close(ends)


class ControlledLink(Link):
    """The fabric's link under a harness: messages handled by the serving peer wait at ``gate``
    while it is held (it answers nothing), and so do the rows it sends a requester (an answer on
    the wire: published, its rows copied out, not yet received); the rows of names a
    :class:`FaultPlan` lists reach the requester as a fault instead. A pull waits in
    :meth:`answering`, after the serving peer has looked for a standing offer that covers it
    (O1): a pull an offer answers is held with the offer claimed, before it reads the offer's
    rows."""

    def send(self, fabric: Fabric, to: bytes, message: Message) -> bool:
        if isinstance(message, Rows) and message.reply_to == self.serving:
            with self.gate.passage():
                return super().send(fabric, to, message)
        return super().send(fabric, to, message)

    def __init__(self, gate: Gate, plan: FaultPlan | None, serving: bytes) -> None:
        self.gate = gate
        self.plan = plan
        self.serving = serving
        self.names: dict[int, np.ndarray] = {}

    def handle(self, at: bytes, message: Message, handler: Callable[[Message], None]) -> None:
        if isinstance(message, PullMessage) and self.plan:
            self.names[message.ticket] = message.names
        if isinstance(message, Rows) and self.plan and message.ticket in self.names:
            count = message.data[0].shape[0] if message.data else 0
            names = self.names.pop(message.ticket)[:count]
            hit = faulted_rows(self.plan, "fetch", names) | faulted_rows(self.plan, "publish", names)
            if hit.any():
                message = Fault(message.ticket, f"injected fault: the server failed block {int(np.argmax(hit))}")
        if at == self.serving and not isinstance(message, PullMessage):
            with self.gate.passage():
                handler(message)
        else:
            handler(message)

    @contextlib.contextmanager
    def answering(self, at: bytes, ticket: int) -> Iterator[None]:
        if at == self.serving:
            with self.gate.passage():
                yield
        else:
            yield


class ReferencePeerHarness(Harness):
    name = "reference-peer"
    #: A fetch quiesces with its conclusion unless its rows are being written (one copy).
    quiesce_grace_s = 2.0
    max_in_flight = 16

    def capabilities(self) -> Capabilities:
        return peer_capabilities(self.max_in_flight)

    def distribution(self) -> str:
        return "kvwire.testing.reference.peer (the reference peer backend shipped with kvwire)"

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        if faults is not None and faults.schedule:
            raise Unavailable("fault schedules are store-driver records; the reference peer injects faults by name")
        gate = Gate()
        fabric = Fabric()
        bound = max_in_flight or self.max_in_flight
        # Names unique in the process: two pairs open at once are two networks, and a ticket names
        # the peer that handed it out by its address (H1.13), as distinct instances' addresses differ.
        pair = next(_pairs)
        source = self.make_peer(fabric, f"serving-{pair}", timeout_s=timeout_s, max_in_flight=bound)
        sink = self.make_peer(fabric, f"pulling-{pair}", timeout_s=timeout_s, max_in_flight=bound)
        fabric.link = ControlledLink(gate, faults, source.address())
        more = itertools.count(2)

        def another() -> ReferencePeer:
            return self.make_peer(fabric, f"pulling-{pair}-{next(more)}", timeout_s=timeout_s, max_in_flight=bound)

        return Ends(source, sink, Hint.of("ticket", id=0), Hint.of("peer", address=source.address()),
                    hold=gate.hold, extra={"gate": gate, "fabric": fabric}, another_sink=another)

    def make_peer(self, fabric: Fabric, name: str, *, timeout_s: float, max_in_flight: int) -> ReferencePeer:
        """One end. Mutants of the reference peer override this."""
        return ReferencePeer(fabric, name, timeout_s=timeout_s, max_in_flight=max_in_flight)

    def close(self, ends: Ends) -> None:
        _release(ends)
        super().close(ends)


def fill_reference_store(store: ReferenceStore, row_bytes: int) -> Callable[[], None]:
    """:attr:`Ends.fill` for a :class:`ReferenceStore` with a capacity: objects of the harness's
    own, under a namespace no test uses, until it takes no object of ``row_bytes`` more."""
    names: list[np.ndarray] = []
    junk = np.zeros((1, FILL_CHUNK), dtype=np.uint8)

    def put(size: int) -> bool:
        name = np.frombuffer(len(names).to_bytes(8, "little"), dtype=np.uint8)[None, :]
        stored = store.put(FILL_NAMESPACE, 0, name, junk[:, :size]).status[0] == RowStatus.HELD
        if stored:
            names.append(name)
        return bool(stored)

    def free() -> None:
        if names:
            store.remove(FILL_NAMESPACE, 0, np.concatenate(names))
        names.clear()

    fill_until_full(put, row_bytes, 2 * STORE_CAPACITY_BYTES)
    return free


def _release(ends: Ends) -> None:
    gate = ends.extra.get("gate")
    if isinstance(gate, Gate):
        gate.release()
    schedule = ends.extra.get("schedule")
    if isinstance(schedule, CallFaults):
        schedule.release_all()


store_harness = ReferenceStoreHarness()
peer_harness = ReferencePeerHarness()
