"""The suite as the serving holder of a peer backend that declares ``serve-pulls`` (N2).

:class:`NameTable` stands in for the holder's reuse tree: a dict from block name to the row that
holds it in each layer group, with a pin count per name. :class:`SuiteServer` answers pull
requests from it as ``kvwire.contract.serving`` says a holder does: look the names up, pin the
longest held prefix, publish it with the request's ticket, and unpin once that publish quiesced,
whether it delivered, failed or was cancelled.

For a backend that also declares ``offer-pulls`` (O1), :meth:`SuiteServer.offer` makes a standing
offer of rows the holder pins for the offer's whole life, and :meth:`SuiteServer.withdraw`
unpins them once the offer has concluded and quiesced."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from kvwire.contract import Attempt, CacheKind, Hint, LayerGroupRows, SlotRegion, TokenRange, View
from kvwire.contract.backend import Backend
from kvwire.contract.serving import OffersPulls, PullRequest, ServesPulls
from kvwire.holding import Direction
from kvwire.testing.harness import Hold
from kvwire.testing.holder import Submission, Wakes, declares, holder_call, settle, submit

__all__ = ["NameTable", "SuiteServer", "Answer", "Offered", "PullHold"]


class NameTable:
    """Block name -> ``{group_id: (region, slot)}``, plus pins. Each group's rows lie in one
    region (the suite's benches allocate one region per group and side)."""

    def __init__(self) -> None:
        self.rows: dict[bytes, dict[int, tuple[SlotRegion, int]]] = {}
        self.regions: dict[int, SlotRegion] = {}
        self.kinds: dict[int, CacheKind] = {}
        self.pins: Counter[bytes] = Counter()

    def add(self, name: bytes, group_id: int, region: SlotRegion, slot: int) -> None:
        self.rows.setdefault(bytes(name), {})[group_id] = (region, int(slot))
        self.regions.setdefault(group_id, region)

    def add_view(self, view: View) -> None:
        """Hold every named row of ``view`` (and remember each group's cache kind)."""
        for g in view.groups:
            self.regions.setdefault(g.group_id, g.region)
            self.kinds[g.group_id] = g.kind
            for row in range(g.rows):
                self.add(g.name(row), g.group_id, g.region, int(g.slots[row]))

    def held_prefix(self, request: PullRequest) -> int:
        """How many leading names of ``request`` are held in every requested group, at the
        requested row size, each group's rows in one region (a view's group lies in one)."""
        first: dict[int, SlotRegion] = {}
        for i in range(request.blocks):
            entry = self.rows.get(request.names[i].tobytes())
            if entry is None:
                return i
            for gid, size in zip(request.groups, request.slot_bytes, strict=True):
                if gid not in entry or entry[gid][0].slot_bytes != size:
                    return i
                if first.setdefault(gid, entry[gid][0]) is not entry[gid][0]:
                    return i
        return request.blocks

    def view_for(self, request: PullRequest, count: int) -> View:
        """The first ``count`` requested blocks, one group per requested group, in order."""
        names = request.names[:count]
        groups = []
        for gid in request.groups:
            region = self.rows[names[0].tobytes()][gid][0] if count else self.regions[gid]
            slots = [self.rows[n.tobytes()][gid][1] for n in names]
            # A STATE group's answer is its one row; an answer holding none of it is an empty
            # group, which only PAGED may be (V1.4).
            kind = self.kinds.get(gid, CacheKind.PAGED) if count == 1 else CacheKind.PAGED
            groups.append(LayerGroupRows(gid, kind, region, np.asarray(slots, dtype=np.int64),
                                         TokenRange(0, count * 16), names))
        return View(tuple(groups))

    @property
    def pinned(self) -> int:
        """How many pins are held now."""
        return sum(self.pins.values())


@dataclass(eq=False)
class Answer:
    """A request and how the suite answered it: the publish, or ``None`` if declined."""

    request: PullRequest
    publish: Submission | None
    pinned: tuple[bytes, ...] = ()
    released: bool = field(default=False)


@dataclass(eq=False)
class Offered:
    """A standing offer the suite made as the serving holder (O1): the offer, tracked like a
    publish, and the names it pinned for the offer's life (O1.6)."""

    offer: Submission
    pinned: tuple[bytes, ...]
    released: bool = field(default=False)


class SuiteServer:
    """Plays the holder of the serving end."""

    def __init__(self, backend: Backend, tree: NameTable, patience_s: float, wakes: Wakes | None = None) -> None:
        if not isinstance(backend, ServesPulls):
            raise TypeError("the serving end must implement kvwire.contract.serving.ServesPulls")
        self.backend = backend
        self.serving: ServesPulls = backend
        self.tree = tree
        self.patience_s = patience_s
        self.wakes = Wakes() if wakes is None else wakes
        self.started = False
        self.answers: list[Answer] = []
        self.offers: list[Offered] = []
        self._pending: list[PullRequest] = []
        self._seen: set[bytes] = set()
        self._looked = 0

    def start(self) -> None:
        if not self.started:
            with holder_call("serve()"):
                self.serving.serve(self.wakes)
            self.started = True

    def incoming(self) -> tuple[PullRequest, ...]:
        """``incoming()``, as a call of the holder's: a serve wake from inside it fails (W1.6)."""
        with holder_call("incoming()"):
            fresh = self.serving.incoming()
        self.check_no_wake_inside()
        return fresh

    def check_no_wake_inside(self) -> None:
        """Fail if the serve wake was ever called from inside ``serve()``, ``incoming()`` or
        ``decline()`` (W1.6: the holder may call them holding a lock its wake takes)."""
        assert not self.wakes.inside or not declares(self.serving, "W1.6"), (  # type: ignore[arg-type]
            f"W1.6: the backend called the serve wake from inside {self.wakes.inside[0]}, a call the serving holder "
            "made to it; a holder may hold a lock its wake takes while it calls the backend")

    def take(self, count: int = 1) -> list[PullRequest]:
        """Wait until ``count`` requests arrived, looking at ``incoming()`` only after a wake, as
        a holder that sleeps until woken does (W1); return them."""
        deadline = time.monotonic() + self.patience_s
        while len(self._pending) < count:
            if not self.wakes.wait_beyond(self._looked, deadline):
                if self.incoming():
                    raise AssertionError(
                        "W1/N2: a pull request became visible through incoming() but no wake followed it")
                raise AssertionError(f"N2: no pull request arrived within {self.patience_s:g} s")
            self._looked = self.wakes.count
            fresh = self.incoming()
            assert isinstance(fresh, tuple), f"N2: incoming() must answer a tuple, got {type(fresh).__name__}"
            for request in fresh:
                assert isinstance(request, PullRequest), f"N2: incoming() gave a {type(request).__name__}"
                key = request.ticket.to_bytes()
                assert key not in self._seen, "N2.5: incoming() handed over a request it had handed over before"
                self._seen.add(key)
            self._pending.extend(fresh)
        taken, self._pending = self._pending[:count], self._pending[count:]
        return taken

    def answer(self, request: PullRequest, limit: int | None = None, ticket: Hint | None = None) -> Answer:
        """Pin the held prefix (at most ``limit`` blocks) and publish it with the request's
        ticket (or with ``ticket``, an equal one the holder made from its bytes)."""
        count = self.tree.held_prefix(request)
        if limit is not None:
            count = min(count, limit)
        unknown = [gid for gid in request.groups if gid not in self.tree.regions]
        if not count and unknown:  # no region to answer an empty group in: a decline says why
            return self.decline(request, f"the serving end holds no rows of group(s) {unknown}")
        names = tuple(request.names[i].tobytes() for i in range(count))
        self.tree.pins.update(names)
        try:
            sub = submit(self.backend, "publish", self.tree.view_for(request, count),
                         request.ticket if ticket is None else ticket)
        except BaseException:
            self.tree.pins.subtract(names)
            raise
        answer = Answer(request, sub, names)
        self.answers.append(answer)
        return answer

    def offer(self, view: View, timeout_s: float | None = None, wakes: Wakes | None = None) -> Offered:
        """Pin the named rows of ``view`` and make a standing offer of them (O1). Whatever
        ``offer()`` raises propagates, the pins given back; what it returns must be an Attempt."""
        backend = self.backend
        assert isinstance(backend, OffersPulls), (
            "O1.1: a backend that declares offer-pulls implements kvwire.contract.OffersPulls (offer())")
        groups = view.groups if isinstance(view, View) else ()  # anything else is for offer() to refuse
        names = tuple(sorted({g.name(row) for g in groups for row in range(g.rows) if g.names is not None}))
        self.tree.pins.update(names)
        wakes = Wakes() if wakes is None else wakes
        try:
            with holder_call("offer()"):
                attempt = backend.offer(view, wakes, timeout_s)
        except BaseException:
            self._unpin(names)
            raise
        assert isinstance(attempt, Attempt), f"O1.1: offer() must return an Attempt, got {type(attempt).__name__}"
        offered = Offered(Submission(Direction.PUBLISH, self.backend, view, attempt, wakes), names)
        self.offers.append(offered)
        return offered

    def withdraw(self, offered: Offered) -> None:
        """Wait until the offer concluded and quiesced, then unpin its rows (O1.6)."""
        if not offered.released:
            settle(offered.offer, self.patience_s, purpose="O1.8: the offer concluding and quiescing")
            self._unpin(offered.pinned)
            offered.released = True

    def _unpin(self, names: tuple[bytes, ...]) -> None:
        self.tree.pins.subtract(names)
        self.tree.pins += Counter()  # drop zero counts

    def decline_waiting(self, reason: str) -> int:
        """Decline every request that arrived and was not taken, those ``incoming()`` has not
        handed over yet included; how many."""
        waiting = list(self._pending) + list(self.incoming())
        self._pending = []
        for request in waiting:
            self.decline(request, reason)
        return len(waiting)

    def decline(self, request: PullRequest, reason: str) -> Answer:
        with holder_call("decline()"):
            self.serving.decline(request, reason)
        self.check_no_wake_inside()
        answer = Answer(request, None, (), True)
        self.answers.append(answer)
        return answer

    def finish(self, answer: Answer) -> None:
        """Wait until the answer's publish quiesced, then unpin (on every outcome alike)."""
        if answer.publish is not None and not answer.released:
            settle(answer.publish, self.patience_s)
            self.tree.pins.subtract(answer.pinned)
            self.tree.pins += Counter()  # drop zero counts
            answer.released = True


class PullHold(Hold):
    """Holds a pull by leaving its request unanswered: the serving peer's way of not answering.
    :meth:`release` answers it from the reuse tree; :meth:`wait_idle` waits until that answer
    quiesced and its pins are back."""

    def __init__(self, holder: SuiteServer, request: PullRequest) -> None:
        self.holder = holder
        self.request = request
        self.answer: Answer | None = None

    def release(self) -> None:
        if self.answer is None:
            self.answer = self.holder.answer(self.request)

    def waiting(self) -> int:
        return 0 if self.answer is not None else 1

    def wait_idle(self, timeout_s: float) -> bool:
        if self.answer is not None:
            self.holder.finish(self.answer)
        return True
