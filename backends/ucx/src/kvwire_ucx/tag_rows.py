"""The two-sided row mover: one UCX tag message per run of one group's rows adjacent at both
ends (a "message", :func:`messages`), received straight into the lent rows on the requesting end
(:class:`TagReceives`) and sent straight from the lent rows on the serving end
(:class:`TagSends`). A message's tag is ``tag_base << 24 | block-major number of its first row``.
Both ends cut the same messages out of each window of rows (the credit, then each ``Go``): at
the rows where either end's slots stop being adjacent (the Pull carries the requester's breaks,
the Offer the serving end's) and at the window's ends. The credit's receives are posted before
the Offer, so the credit goes one row per message.

The Python API cannot cancel one request, and closing endpoints does not reliably cancel
unmatched receives (nor is it safe when the peer just died). A receive no peer will match is
completed by a zero-byte message with the same tag sent to this worker itself ("drain",
:class:`SelfDrain`); the row is not written. A receive the peer's data already matched is not
affected (it finishes, or fails with the peer); the zero-byte message then stays unexpected,
harmlessly, since its tag is never used again."""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwire_ucx import wire
from kvwire_ucx._ucx import Array, UCXError, ucx_api
from kvwire_ucx.connection import Endpoints
from kvwire_ucx.protocol.events import RowsCompleted, SendsCompleted, message_cuts
from kvwire_ucx.protocol.events import messages as _messages
from kvwire_ucx.regions import GroupRows

__all__ = ["TagReceives", "TagSends", "SelfDrain", "PostError", "NotAdjacent", "messages", "message_cuts", "own_breaks"]

log = logging.getLogger(__name__)


class PostError(Exception):
    """Posting stopped at the message whose first row is block-major number ``reached``
    (``posted`` rows went out before it); ``unposted``: the group index of every row of the
    window that did not (``None``: those from ``reached`` on)."""

    def __init__(self, reason: str, reached: int, posted: int, unposted: np.ndarray | None = None,
                 unposted_receives: int | None = None) -> None:
        super().__init__(reason)
        self.reached = reached
        self.posted = posted
        self.unposted = unposted
        self.unposted_receives = unposted_receives


class NotAdjacent(Exception):
    """A message would span rows not adjacent in this end's memory (the cuts forbid it; never
    posted)."""


class SelfDrain:
    """The endpoint to this backend's own worker, for zero-byte drain messages."""

    def __init__(self, worker: Any, endpoints: Endpoints) -> None:
        self._worker = worker
        self._endpoints = endpoints
        self.ep: Any = None

    def send(self, tags: Sequence[int]) -> None:
        if not tags:
            return
        if self.ep is None:
            try:
                own = ucx_api.UCXAddress.create_from_buffer(bytes(self._worker.address))
                self.ep = ucx_api.UCXEndpoint.create_from_worker_address(self._worker, own, True)
            except UCXError as exc:
                log.error("kvwire-ucx cannot reach its own worker to drain receives: %s", exc)
                return
        for tag in tags:
            try:
                self._endpoints.send_empty(self.ep, tag)
            except UCXError as exc:
                log.error("kvwire-ucx could not complete a receive no peer will match: %s", exc)
                return

    def close(self) -> None:
        """Close the endpoint and let go of the worker (a worker kept alive keeps its peers'
        endpoints to it alive too)."""
        if self.ep is not None:
            try:
                self.ep.close_blocking()
            except Exception:
                pass
            self.ep = None
        self._worker = None


Breaks = tuple[tuple[int, ...] | None, ...]


def own_breaks(groups: tuple[GroupRows, ...], counts: Sequence[int] | None = None) -> Breaks:
    """Where each group's rows (its first ``counts``, else all) stop being adjacent in this
    end's memory: the rows whose slot does not follow the row before's."""
    out = []
    for gi, group in enumerate(groups):
        offsets = group.offsets if counts is None else group.offsets[: counts[gi]]
        out.append(tuple(wire.run_breaks(offsets, group.slot_bytes).tolist()))
    return tuple(out)


def messages(groups: tuple[GroupRows, ...], start: int, end: int, counts: Sequence[int] | None,
             cuts: Sequence[np.ndarray | None] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`kvwire_ucx.protocol.events.messages` of these groups' rows."""
    return _messages(start, end, tuple(len(g.offsets) for g in groups), counts, cuts)


def _buffer(group: GroupRows, row: int, rows: int) -> Any:
    """A buffer over ``rows`` slots of ``group`` from ``row`` on (adjacent: the message's cuts
    saw to it)."""
    assert group.span is not None
    offset = int(group.offsets[row])
    if rows > 1 and bool((np.diff(group.offsets[row : row + rows]) != np.uint64(group.slot_bytes)).any()):
        raise NotAdjacent(f"rows {row}..{row + rows - 1} of group {group.group_id} are not adjacent in this end's "
                          "memory, so no one message can carry them")
    return Array(group.span[offset : offset + rows * group.slot_bytes])


class TagReceives:
    """The receives one fetch posted, in posting order: one per message (see :func:`messages`);
    the receives posted on credit, before the answer, one per row. ``breaks`` are this end's as
    its Pull named them; :meth:`learn` takes the serving end's from its Offer."""

    def __init__(self, groups: tuple[GroupRows, ...], tag_base: int, breaks: Breaks | None = None) -> None:
        self._groups = groups
        self._tag_high = tag_base << wire.TAG_ROW_BITS
        self._breaks: Breaks = breaks if breaks is not None else (None,) * len(groups)
        self._cuts: tuple[np.ndarray | None, ...] | None = None  # until the Offer: every row on its own
        self.posted: collections.deque[tuple[Any, Any, int, int, int]] = collections.deque()

    def learn(self, there: Breaks) -> None:
        """The serving end's breaks (its Offer's): later windows go as messages."""
        if len(there) == len(self._groups):
            self._cuts = message_cuts(self._breaks, there)

    def post(self, worker: Any, start: int, end: int, counts: tuple[int, ...] | None) -> None:
        """One receive per message among block-major numbers ``[start, end)`` (offered rows
        only, given ``counts``; without, before the answer, one per row) on ``worker``; raises
        :class:`PostError` if UCX refuses one (its ``unposted`` rows' group indices)."""
        tag_recv, make_tag, append = worker.tag_recv, ucx_api.UCXXTag, self.posted.append
        tag_high = self._tag_high
        seqs, gis, firsts, lengths = messages(self._groups, start, end, counts,
                                              None if counts is None else self._cuts)
        index = 0
        try:
            for index in range(len(seqs)):
                gi, ri, n = int(gis[index]), int(firsts[index]), int(lengths[index])
                buffer = _buffer(self._groups[gi], ri, n)
                append((tag_recv(buffer, make_tag(tag_high | int(seqs[index]))), buffer, gi, ri, n))
        except (UCXError, NotAdjacent) as exc:
            unposted = np.repeat(gis[index:], lengths[index:])
            raise PostError(str(exc), int(seqs[index]), int(lengths[:index].sum()), unposted,
                            len(seqs) - index) from None

    def reap(self) -> RowsCompleted | None:
        """The receives completed since the last call (in order), or ``None``; each row of a
        message listed."""
        posted = self.posted
        if not posted or not posted[0][0].completed:
            return None
        groups: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        failures: list[tuple[int, int, str, bool]] = []
        receives = 0
        while posted and posted[0][0].completed:
            request, _buffer, gi, ri, n = posted.popleft()
            receives += 1
            try:
                request.check_error()
            except UCXError as exc:
                name = type(exc).__name__
                failures.extend((gi, ri + k, f"{name}: {exc}", "Truncat" not in name) for k in range(n))
            else:
                groups.append(np.full(n, gi, dtype=np.int64))
                rows.append(np.arange(ri, ri + n, dtype=np.int64))
        empty = np.zeros(0, dtype=np.int64)
        return RowsCompleted(np.concatenate(groups) if groups else empty, np.concatenate(rows) if rows else empty,
                             tuple(failures), receives)

    def drain_tags(self, counts: tuple[int, ...] | None) -> list[int]:
        """Tags of the posted receives not yet complete that no peer will match: those of rows
        not offered (given ``counts``), or all."""
        width = len(self._groups)
        return [self._tag_high | (ri * width + gi) for request, _b, gi, ri, _n in self.posted
                if not request.completed and (counts is None or ri >= counts[gi])]


class TagSends:
    """The sends one reply posted, in posting order: one per message (see :func:`messages`);
    the rows of the credit (block-major numbers below ``credit``) one per row, as the requester
    posted them before it knew this end's breaks. ``there`` are the requester's breaks (its
    Pull's); :meth:`offer_breaks` gives this end's for the Offer."""

    def __init__(self, groups: tuple[GroupRows, ...], tag_base: int, credit: int = 0, there: Breaks | None = None
                 ) -> None:
        self._groups = groups
        self._tag_high = tag_base << wire.TAG_ROW_BITS
        self._credit = credit
        self._there: Breaks = there if there is not None and len(there) == len(groups) else (None,) * len(groups)
        self._cuts: tuple[np.ndarray | None, ...] = (None,) * len(groups)
        self.posted: collections.deque[tuple[Any, Any, int, int, int]] = collections.deque()

    def offer_breaks(self, counts: tuple[int, ...]) -> Breaks:
        """This end's breaks among the offered rows, as the Offer carries them (fitted to a
        frame), which from now on cut the messages too."""
        breaks = wire.fit_breaks(own_breaks(self._groups, counts), wire.offer_breaks_room(len(counts)))
        self._cuts = message_cuts(breaks, self._there)
        return breaks

    def post(self, ep: Any, start: int, end: int, counts: tuple[int, ...], limit: int) -> int:
        """Send the offered rows among block-major numbers ``[start, min(end, limit))``; how
        many rows. Raises :class:`PostError` if UCX refuses one."""
        tag_high = self._tag_high
        if start >= min(end, limit):
            return 0
        if ep is None:
            raise PostError("the endpoint is closed", start, 0)
        tag_send, make_tag, append = ep.tag_send, ucx_api.UCXXTag, self.posted.append
        seqs, gis, firsts, lengths = messages(self._groups, start, min(end, limit), counts,
                                              None if end <= self._credit else self._cuts)
        index = 0
        try:
            for index in range(len(seqs)):
                gi, ri, n = int(gis[index]), int(firsts[index]), int(lengths[index])
                buffer = _buffer(self._groups[gi], ri, n)
                append((tag_send(buffer, make_tag(tag_high | int(seqs[index]))), buffer, gi, ri, n))
        except (UCXError, NotAdjacent) as exc:
            raise PostError(str(exc), int(seqs[index]), int(lengths[:index].sum())) from None
        return int(lengths.sum())

    def reap(self) -> SendsCompleted | None:
        posted = self.posted
        if not posted or not posted[0][0].completed:
            return None
        ok = 0
        failures: list[tuple[int, int, str]] = []
        while posted and posted[0][0].completed:
            request, _buffer, gi, ri, n = posted.popleft()
            try:
                request.check_error()
            except UCXError as exc:
                failures.extend((gi, ri + k, f"{type(exc).__name__}: {exc}") for k in range(n))
            else:
                ok += n
        return SendsCompleted(ok, tuple(failures))
