"""Standing offers (contract O1, protocol ``offer-pulls``): rows the serving holder pinned in
advance (:class:`StandingOffer`), and the index the progress thread answers pulls from without
handing them to the holder (:class:`OfferIndex`).

An offer is built, and put in the index, on the holder's thread (its names indexed once, its
rows located), so it stands from the ``offer()`` call; the progress thread looks pulls up in the
index and takes offers out of it. A pull is answered from an offer only when that one offer covers
it whole: every group it asks for, with the slot size it expects and every name it names (O1.4);
anything less goes to the holder, who may hold more (O1.5)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvwire.contract import InvalidSubmission, View
from kvwire_ucx import wire
from kvwire_ucx.regions import GroupRows, RowRuns

if TYPE_CHECKING:
    from kvwire_ucx.attempt import UcxAttempt

__all__ = ["Covered", "OfferedGroup", "PushedOffer", "StandingOffer", "OfferIndex", "cover", "offered_groups",
           "push_groups"]

#: What answers a pull from an offer: each group's rows, and where they lie as runs (per group
#: an ``(n, 2)`` uint64 array of (address, rows), as a one-sided answer names them).
Covered = tuple[tuple[GroupRows, ...], tuple[np.ndarray, ...]]


@dataclass(frozen=True, slots=True, eq=False)
class OfferedGroup:
    """One group of an offer: its located rows, the names of all of them (concatenated, for the
    common pull of a prefix in order), each name's row, and where the rows lie as runs (made
    once, so that an answer naming a prefix of them takes no step per row)."""

    rows: GroupRows
    width: int
    names: bytes
    index: dict[bytes, int]
    runs: RowRuns

    def pick(self, names: bytes, count: int) -> tuple[GroupRows, np.ndarray] | None:
        """The rows named by ``names`` (``count`` names of this group's width), in their order,
        and their runs (as :class:`~kvwire_ucx.regions.RowRuns` gives them); ``None`` unless
        every one is offered."""
        if self.names.startswith(names):  # the offered rows' first names, in order
            if count == len(self.rows.offsets):  # all of them (the usual pull of an offered prompt)
                return self.rows, self.runs.runs
            offsets = self.rows.offsets[:count]
            runs = self.runs.prefix(count)
        else:
            width, index = self.width, self.index
            if count > len(index):
                return None
            found = []
            for i in range(count):  # stops at the first name not offered
                row = index.get(names[i * width:(i + 1) * width])
                if row is None:
                    return None
                found.append(row)
            offsets = self.rows.offsets[np.asarray(found, dtype=np.intp)]
            offsets.flags.writeable = False
            runs = RowRuns(offsets + np.uint64(self.rows.base), self.rows.slot_bytes).runs
        rows = self.rows
        return GroupRows(rows.group_id, rows.slot_bytes, rows.span, offsets, rows.base, rows.memory), runs


def offered_groups(view: View, located: tuple[GroupRows, ...]) -> dict[int, OfferedGroup]:
    """The view's groups as an offer holds them (every group with rows named: the backend checked
    that first); ``InvalidSubmission`` for a name twice in a group (O1.2)."""
    out: dict[int, OfferedGroup] = {}
    for position, (group, rows) in enumerate(zip(view.groups, located, strict=True)):
        if group.names is None:  # a group without rows
            width, raw = 1, b""
        else:
            width, raw = int(group.names.shape[1]), group.names.tobytes()
        index = {raw[i * width:(i + 1) * width]: i for i in range(group.rows)}
        if len(index) != group.rows:
            raise InvalidSubmission(
                f"group {position} (id {group.group_id}) names a block on two rows; an offer names each block once "
                "per group (contract O1.2)")
        out[group.group_id] = OfferedGroup(rows, width, raw, index, RowRuns.of(rows, group.rows))
    return out


def cover(offered: dict[int, OfferedGroup], groups: tuple[tuple[int, int], ...], width: int, names: bytes,
          count: int) -> Covered | None:
    """The rows of ``offered`` (an offer's groups by id) answering a pull of ``names`` in
    ``groups`` ((id, slot size) each), and their runs, or ``None`` unless they cover it whole:
    every group asked for, with the slot size expected, and every name (O1.4, O1.5)."""
    rows, runs = [], []
    for group_id, slot_bytes in groups:
        group = offered.get(group_id)
        if group is None or group.rows.slot_bytes != slot_bytes or (count and group.width != width):
            return None
        picked = group.pick(names, count)
        if picked is None:
            return None
        rows.append(picked[0])
        runs.append(picked[1])
    return tuple(rows), tuple(runs)


class StandingOffer:
    """One offer: the holder's attempt, its groups by id, its deadline (monotonic), the
    answers given from it that have not finished (each still may read its rows), its id on the
    wire and the connections it was pushed to that have not answered its withdrawal (each may
    still read its rows)."""

    __slots__ = ("attempt", "groups", "deadline", "answers", "standing", "offer_id", "pushed_to", "push",
                 "__weakref__")

    def __init__(self, attempt: UcxAttempt, groups: dict[int, OfferedGroup], deadline: float,
                 offer_id: int = 0) -> None:
        self.attempt = attempt
        self.groups = groups
        self.deadline = deadline
        # The ReplyJobs (kvwire_ucx.jobs) reading from it: typed loosely, since jobs imports this module.
        self.answers: set[Any] = set()
        self.standing = True  # until it concludes: it answers pulls only while standing
        self.offer_id = offer_id
        #: the connections (kvwire_ucx.connection) it was pushed to, until each answered its
        #: withdrawal or closed: the offer quiesces only once none is left (O1.8)
        self.pushed_to: set[Any] = set()
        #: its groups as a push carries them, made once (``()``: not yet; ``None``: beyond the bounds)
        self.push: tuple[wire.PushedGroup, ...] | None = ()

    def cover(self, groups: tuple[tuple[int, int], ...], width: int, names: bytes,
              count: int) -> Covered | None:
        """The rows answering a pull of ``names`` in ``groups`` ((id, slot size) each), and
        their runs, or ``None`` unless this offer covers it whole."""
        return cover(self.groups, groups, width, names, count)

    def __repr__(self) -> str:
        return f"StandingOffer({len(self.groups)} groups, {'standing' if self.standing else 'ended'}, " \
               f"{len(self.answers)} answers)"


class OfferIndex:
    """The standing offers of one engine, newest last. ``offer()`` adds to it on the holder's
    thread, so a pull that arrives once ``offer()`` returned finds the offer (O1.4: it stands
    from the call); the progress thread reads and removes. One lock guards the list."""

    def __init__(self) -> None:
        self._offers: list[StandingOffer] = []
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._offers)

    def __iter__(self):  # type: ignore[no-untyped-def]
        with self._lock:
            return iter(list(self._offers))

    def add(self, offer: StandingOffer) -> None:
        with self._lock:
            self._offers.append(offer)

    def remove(self, offer: StandingOffer) -> None:
        with self._lock:
            if offer in self._offers:
                self._offers.remove(offer)

    def cover(self, groups: tuple[tuple[int, int], ...], width: int, names: bytes, count: int,
              stands_until: float) -> tuple[StandingOffer, Covered] | None:
        """The newest offer that still stands at ``stands_until`` (monotonic), has not concluded
        (a holder's ``cancel()`` concludes it before the progress thread takes it out) and covers
        the pull whole, with its answering rows and their runs."""
        with self._lock:
            offers = list(self._offers)
        for offer in reversed(offers):
            if offer.deadline < stands_until or offer.attempt.poll() is not None:
                continue
            rows = offer.cover(groups, width, names, count)
            if rows is not None:
                return offer, rows
        return None

    def answers(self) -> int:
        """The answers from offers that have not finished."""
        with self._lock:
            return sum(len(offer.answers) for offer in self._offers)


def push_groups(offer: StandingOffer) -> tuple[wire.PushedGroup, ...] | None:
    """The offer's groups as a ``PushOffer`` carries them (made once), or ``None`` when the offer
    is beyond a push's bounds (wire.MAX_PUSH_ROWS rows a group, one frame): then it is not pushed
    and pulls of it go the old way (O1.12)."""
    if offer.push == ():
        out: list[wire.PushedGroup] | None = []
        for group_id, group in offer.groups.items():
            rows = len(group.index)
            if rows > wire.MAX_PUSH_ROWS or len(offer.groups) > wire.MAX_GROUPS:
                out = None
                break
            out.append(wire.PushedGroup(group_id, group.rows.slot_bytes, group.rows.memory, group.width, group.names,
                                        group.runs.runs))
        offer.push = None if out is None else tuple(out)
    return offer.push


class PushedOffer:
    """A standing offer a serving end pushed on one connection, as the requester keeps it: its
    groups (``OfferedGroup`` over the serving end's addresses: ``rows.offsets`` are absolute
    addresses there, ``base`` 0), its agent and generation, its local deadline (monotonic) and
    the fetches reading from it. ``withdrawn``: the serving end withdrew it; this end answers
    once no fetch of it is left."""

    __slots__ = ("offer_id", "groups", "memories", "agent", "generation", "deadline", "fetches", "withdrawn")

    def __init__(self, message: wire.PushOffer, deadline: float) -> None:
        self.offer_id = message.offer
        self.agent = message.agent
        self.generation = message.generation
        self.deadline = deadline
        self.groups: dict[int, OfferedGroup] = {}
        self.memories: dict[int, int] = {}
        for pushed in message.groups:
            raw, width, rows = pushed.names, pushed.width, pushed.rows
            index = {raw[i * width:(i + 1) * width]: i for i in range(rows)}
            if len(index) != rows:
                raise wire.WireError(f"PushOffer group {pushed.group_id} names a block on two rows")
            runs = pushed.runs
            if len(runs):
                lengths = runs[:, 1].astype(np.int64)
                first = np.repeat(np.cumsum(lengths) - lengths, lengths)
                addresses = np.repeat(runs[:, 0], lengths) + (
                    (np.arange(rows, dtype=np.int64) - first).astype(np.uint64) * np.uint64(pushed.slot_bytes))
            else:
                addresses = np.zeros(0, dtype=np.uint64)
            addresses.flags.writeable = False
            there = GroupRows(pushed.group_id, pushed.slot_bytes, None, addresses, 0, pushed.memory)
            self.groups[pushed.group_id] = OfferedGroup(there, width, raw, index,
                                                        RowRuns(addresses, pushed.slot_bytes))
            self.memories[pushed.group_id] = pushed.memory
        self.fetches: set[Any] = set()  # the FetchJobs (kvwire_ucx.jobs) reading from it
        self.withdrawn = False

    def cover(self, groups: tuple[tuple[int, int], ...], width: int, names: bytes,
              count: int) -> Covered | None:
        return cover(self.groups, groups, width, names, count)
