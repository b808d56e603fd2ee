"""A small, correct peer backend that serves pulls, over an in-process "network": it lets the
suite's peer paths and N2 tests run (and be caught failing) before a real peer backend exists.

A fetch sends a :class:`PullRequest` to the peer named by its hint; the serving end's holder
answers with ``publish(view, ticket)``, which copies the rows straight into the requester's
memory under the pull's lock, so a cancel or a deadline either happens before the copy or after
it, never during it. No worker threads: the only thread is a timer per pull for its deadline."""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvwire.contract import (
    CONTRACT_VERSION,
    Attempt,
    Backend,
    Capabilities,
    Hint,
    InvalidSubmission,
    MemoryKind,
    Outcome,
    SlotRegion,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.contract.capabilities import SERVE_PULLS, OtherEnd
from kvwire.contract.serving import PullRequest, ServesPulls
from kvwire.testing.harness import Ends, FaultPlan, Harness, Unavailable

CAPABILITIES = Capabilities(
    contract_version=CONTRACT_VERSION,
    fetch=True,
    publish=True,
    memory_kinds=frozenset({MemoryKind.HOST}),
    other_end=OtherEnd.PEER,
    content_addressed=True,
    max_in_flight=16,
    cancellation=True,
    protocols=frozenset({SERVE_PULLS}),
)

_tickets = itertools.count(1)


@dataclass
class Fabric:
    """The in-process network: peers by address, pulls by ticket."""

    peers: dict[bytes, LoopPeer] = field(default_factory=dict)
    pulls: dict[int, _Pull] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Attempt(Attempt):
    def __init__(self, view: View, wake: WakeFn) -> None:
        self.view = view
        self.wake = wake
        self.lock = threading.Lock()
        self.outcome: Outcome | None = None
        self.done = False

    def poll(self) -> Outcome | None:
        return self.outcome

    def quiesced(self) -> bool:
        return self.done

    def masks(self, count: int | None = None) -> tuple[np.ndarray, ...]:
        masks = self.view.row_masks()
        for mask in masks:
            if count:
                mask[:count] = True
            mask.setflags(write=False)
        return masks

    def conclude(self, outcome: Outcome) -> bool:
        """Under ``lock``: set the outcome once; nothing copies outside the lock, so quiesce too."""
        if self.outcome is not None:
            return False
        self.outcome = outcome
        self.done = True
        return True

    def cancel(self) -> None:
        with self.lock:
            changed = self.conclude(Outcome.cancelled(self.masks(), reason="cancelled by the holder"))
        if changed:
            self.wake()


class _Pull(_Attempt):
    def __init__(self, view: View, wake: WakeFn, timeout_s: float) -> None:
        super().__init__(view, wake)
        self.timer = threading.Timer(timeout_s, self.expire, args=(timeout_s,))
        self.timer.daemon = True
        self.timer.start()

    def expire(self, timeout_s: float) -> None:
        with self.lock:
            changed = self.conclude(Outcome.failed(f"deadline passed: the pull did not conclude within {timeout_s:g} s",
                                                   self.masks()))
        if changed:
            self.wake()

    def finish(self, outcome: Outcome) -> None:
        with self.lock:
            changed = self.conclude(outcome)
        if changed:
            self.timer.cancel()
            self.wake()

    def cancel(self) -> None:
        super().cancel()
        self.timer.cancel()


class _Registration(Registration):
    def __init__(self, peer: LoopPeer, regions: tuple[SlotRegion, ...]) -> None:
        self.peer = peer
        self._regions = regions

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self._regions

    def close(self) -> None:
        self.peer.registered.pop(id(self), None)


class LoopPeer(Backend, ServesPulls):
    def __init__(self, fabric: Fabric, name: str, timeout_s: float, max_in_flight: int = 16) -> None:
        self.fabric = fabric
        self.name = name
        self.timeout_s = timeout_s
        self.caps = CAPABILITIES if max_in_flight == CAPABILITIES.max_in_flight else Capabilities(
            **{**{f: getattr(CAPABILITIES, f) for f in CAPABILITIES.__dataclass_fields__},
               "max_in_flight": max_in_flight})
        self.registered: dict[int, tuple[SlotRegion, ...]] = {}
        self.attempts: list[_Attempt] = []
        self.requests: list[PullRequest] = []
        self.serving_wake: WakeFn | None = None
        self.closed = False
        self.lock = threading.Lock()
        with fabric.lock:
            fabric.peers[self.address()] = self

    # -- declared and registered ---------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return self.caps

    def address(self) -> bytes:
        return f"loopback/{self.name}".encode()

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        batch = tuple(regions)
        live = [r for regs in self.registered.values() for r in regs]
        for i, region in enumerate(batch):
            if region.memory_kind not in self.caps.memory_kinds:
                raise InvalidSubmission(f"region {region.region_id}: {region.memory_kind.value} memory is not reachable")
            if any(region.overlaps(other) for other in (*batch[:i], *live)):
                raise InvalidSubmission(f"region {region.region_id} overlaps a registered region")
        registration = _Registration(self, batch)
        self.registered[id(registration)] = batch
        return registration

    def _check_rows(self, view: View) -> None:
        live = [r for regs in self.registered.values() for r in regs]
        for g in view.groups:
            if g.rows and not any(r.base <= g.region.base and g.region.end <= r.end and
                                  r.memory_kind is g.region.memory_kind for r in live):
                raise InvalidSubmission(f"group {g.group_id} has rows in a region not registered here")

    def _admit(self) -> None:
        if self.closed:
            raise SubmissionRejected("this loopback peer is shut down")
        live = [a for a in self.attempts if not (a.outcome is not None and a.done)]
        if len(live) >= self.caps.max_in_flight:
            raise SubmissionRejected(f"queue full ({len(live)} in flight)")

    # -- fetch: pull from a serving peer ---------------------------------------------------------

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if self.closed:
            raise SubmissionRejected("this loopback peer is shut down")
        if hint.kind != "peer" or not isinstance(hint.get("address"), bytes):
            raise InvalidSubmission(f"a pull takes a hint of kind 'peer' with bytes field 'address', got {hint!r}")
        self._check_rows(view)
        if view.overlapping_rows() is not None:
            raise InvalidSubmission("fetch rows overlap (V4)")
        if not view.groups or any(g.names is None for g in view.groups):
            raise InvalidSubmission("a pull names its blocks: every group needs names")
        first = view.groups[0].names
        assert first is not None
        if any(g.names is None or not np.array_equal(g.names, first) for g in view.groups):
            raise InvalidSubmission("a pull names each block once for every group: the groups' names must agree")
        self._admit()
        pull = _Pull(view, wake, hint.timeout_s or self.timeout_s)
        self.attempts.append(pull)
        with self.fabric.lock:
            target = self.fabric.peers.get(hint["address"])  # type: ignore[arg-type]
        if target is None or target.closed:
            pull.finish(Outcome.failed("no peer answers at that address", pull.masks()))
            return pull
        ticket = next(_tickets)
        request = PullRequest(Hint.of("ticket", id=ticket), tuple(g.group_id for g in view.groups),
                              tuple(g.region.slot_bytes for g in view.groups), first, peer=self.name)
        with self.fabric.lock:
            self.fabric.pulls[ticket] = pull
        if not target.take_request(request):
            pull.finish(Outcome.failed("the peer is not serving pulls", pull.masks()))
        return pull

    # -- serving --------------------------------------------------------------------------------

    def serve(self, wake: WakeFn) -> None:
        self.serving_wake = wake

    def take_request(self, request: PullRequest) -> bool:
        with self.lock:
            if self.serving_wake is None or self.closed:
                return False
            self.requests.append(request)
            wake = self.serving_wake
        wake()
        return True

    def incoming(self) -> tuple[PullRequest, ...]:
        with self.lock:
            taken, self.requests = tuple(self.requests), []
        return taken

    def decline(self, request: PullRequest, reason: str) -> None:
        with self.fabric.lock:
            pull = self.fabric.pulls.pop(int(request.ticket["id"]), None)  # type: ignore[arg-type]
        if pull is not None:
            pull.finish(Outcome.failed(reason, pull.masks()))

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if self.closed:
            raise SubmissionRejected("this loopback peer is shut down")
        if hint.kind != "ticket" or not isinstance(hint.get("id"), int):
            raise InvalidSubmission(f"a loopback peer publishes only to answer a pull (a 'ticket' hint), got {hint!r}")
        self._check_rows(view)
        self._admit()
        answer = _Attempt(view, wake)
        self.attempts.append(answer)
        with self.fabric.lock:
            pull = self.fabric.pulls.pop(int(hint["id"]), None)  # type: ignore[arg-type]
        count = view.groups[0].rows if view.groups else 0
        delivered = False
        if pull is not None:
            with pull.lock:
                if pull.outcome is None:
                    for src, dst in zip(view.groups, pull.view.groups, strict=True):
                        if src.region.slot_bytes != dst.region.slot_bytes or src.rows > dst.rows:
                            raise InvalidSubmission("the answer's rows do not fit the pull")
                        for a, b in zip(src.addresses()[:count].tolist(), dst.addresses()[:count].tolist(),
                                        strict=True):
                            ctypes.memmove(b, a, src.region.slot_bytes)
                    delivered = pull.conclude(Outcome.delivered(pull.masks(count)))
            if delivered:
                pull.timer.cancel()
                pull.wake()
        with answer.lock:
            if delivered:
                answer.conclude(Outcome.delivered(answer.masks(count)))
            else:
                answer.conclude(Outcome.cancelled(answer.masks(), by_peer=True, reason="the pull ended first"))
        answer.wake()
        return answer

    def shutdown(self) -> frozenset[Attempt]:
        self.closed = True
        for attempt in self.attempts:
            attempt.cancel()
        with self.lock:
            pending, self.requests = self.requests, []
        for request in pending:
            self.decline(request, "the serving peer shut down")
        return frozenset(a for a in self.attempts if not a.done)


class LoopbackHarness(Harness):
    name = "loopback-peer"
    quiesce_grace_s = 1.0

    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def distribution(self) -> str:
        return "tests/conformance/loopback_peer.py (a test backend)"

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        if faults:
            raise Unavailable("the loopback peer injects no faults")
        fabric = Fabric()
        bound = max_in_flight or CAPABILITIES.max_in_flight
        source = LoopPeer(fabric, "serving", timeout_s, bound)
        sink = LoopPeer(fabric, "pulling", timeout_s, bound)
        return Ends(source, sink, Hint.of("ticket", id=0), Hint.of("peer", address=source.address()))


harness = LoopbackHarness()
