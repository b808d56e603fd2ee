"""The two-sided row mover: one UCX tag message per row, received straight into the lent row on
the requesting end (:class:`TagReceives`) and sent straight from the lent row on the serving end
(:class:`TagSends`). A row's tag is ``tag_base << 24 | block-major number``.

The Python API cannot cancel one request, and closing endpoints does not reliably cancel
unmatched receives (nor is it safe when the peer just died). A receive no peer will match is
completed by a zero-byte message with the same tag sent to this worker itself ("drain",
:class:`SelfDrain`); the row is not written. A receive the peer's data already matched is not
affected (it finishes, or fails with the peer); the zero-byte message then stays unexpected,
harmlessly, since its tag is never used again."""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvwire_ucx import wire
from kvwire_ucx._ucx import Array, UCXError, ucx_api
from kvwire_ucx.connection import Endpoints
from kvwire_ucx.protocol.events import RowsCompleted, SendsCompleted
from kvwire_ucx.regions import GroupRows

__all__ = ["TagReceives", "TagSends", "SelfDrain", "PostError"]

log = logging.getLogger(__name__)


class PostError(Exception):
    """Posting stopped at block-major number ``reached`` (``posted`` requests went out)."""

    def __init__(self, reason: str, reached: int, posted: int) -> None:
        super().__init__(reason)
        self.reached = reached
        self.posted = posted


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


def _row_buffers(groups: tuple[GroupRows, ...], start: int, end: int,
                 counts: tuple[int, ...] | None) -> Iterator[tuple[int, int, int, Any]]:
    """``(number, group index, row, buffer over its slot)`` of each row among block-major
    numbers ``[start, end)``, the offered ones only given ``counts``."""
    width = len(groups)
    for seq in range(start, end):
        ri, gi = divmod(seq, width)
        if counts is not None and ri >= counts[gi]:
            continue
        group = groups[gi]
        assert group.span is not None
        offset = int(group.offsets[ri])
        yield seq, gi, ri, Array(group.span[offset : offset + group.slot_bytes])


class TagReceives:
    """The receives one fetch posted, in posting order."""

    def __init__(self, groups: tuple[GroupRows, ...], tag_base: int) -> None:
        self._groups = groups
        self._tag_high = tag_base << wire.TAG_ROW_BITS
        self.posted: collections.deque[tuple[Any, Any, int, int]] = collections.deque()

    def post(self, worker: Any, start: int, end: int, counts: tuple[int, ...] | None) -> None:
        """One receive per row among block-major numbers ``[start, end)`` (offered ones only,
        given ``counts``) on ``worker``; raises :class:`PostError` if UCX refuses one."""
        tag_recv, make_tag, append = worker.tag_recv, ucx_api.UCXXTag, self.posted.append
        tag_high = self._tag_high
        seq = start
        posted = 0
        try:
            for seq, gi, ri, buffer in _row_buffers(self._groups, start, end, counts):
                append((tag_recv(buffer, make_tag(tag_high | seq)), buffer, gi, ri))
                posted += 1
        except UCXError as exc:
            raise PostError(str(exc), seq, posted) from None

    def reap(self) -> RowsCompleted | None:
        """The receives completed since the last call (in order), or ``None``."""
        posted = self.posted
        if not posted or not posted[0][0].completed:
            return None
        groups: list[int] = []
        rows: list[int] = []
        failures: list[tuple[int, int, str, bool]] = []
        while posted and posted[0][0].completed:
            request, _buffer, gi, ri = posted.popleft()
            try:
                request.check_error()
            except UCXError as exc:
                name = type(exc).__name__
                failures.append((gi, ri, f"{name}: {exc}", "Truncat" not in name))
            else:
                groups.append(gi)
                rows.append(ri)
        return RowsCompleted(np.asarray(groups, dtype=np.int64), np.asarray(rows, dtype=np.int64), tuple(failures))

    def drain_tags(self, counts: tuple[int, ...] | None) -> list[int]:
        """Tags of the posted receives not yet complete that no peer will match: those of rows
        not offered (given ``counts``), or all."""
        width = len(self._groups)
        return [self._tag_high | (ri * width + gi) for request, _b, gi, ri in self.posted
                if not request.completed and (counts is None or ri >= counts[gi])]


class TagSends:
    """The sends one reply posted, in posting order."""

    def __init__(self, groups: tuple[GroupRows, ...], tag_base: int) -> None:
        self._groups = groups
        self._tag_high = tag_base << wire.TAG_ROW_BITS
        self.posted: collections.deque[tuple[Any, Any, int, int]] = collections.deque()

    def post(self, ep: Any, start: int, end: int, counts: tuple[int, ...], limit: int) -> int:
        """Send the offered rows among block-major numbers ``[start, min(end, limit))``; how
        many. Raises :class:`PostError` if UCX refuses one."""
        tag_high = self._tag_high
        posted = 0
        if start >= min(end, limit):
            return 0
        if ep is None:
            raise PostError("the endpoint is closed", start, 0)
        tag_send, make_tag, append = ep.tag_send, ucx_api.UCXXTag, self.posted.append
        seq = start
        try:
            for seq, gi, ri, buffer in _row_buffers(self._groups, start, min(end, limit), counts):
                append((tag_send(buffer, make_tag(tag_high | seq)), buffer, gi, ri))
                posted += 1
        except UCXError as exc:
            raise PostError(str(exc), seq, posted) from None
        return posted

    def reap(self) -> SendsCompleted | None:
        posted = self.posted
        if not posted or not posted[0][0].completed:
            return None
        ok = 0
        failures: list[tuple[int, int, str]] = []
        while posted and posted[0][0].completed:
            request, _buffer, gi, ri = posted.popleft()
            try:
                request.check_error()
            except UCXError as exc:
                failures.append((gi, ri, f"{type(exc).__name__}: {exc}"))
            else:
                ok += 1
        return SendsCompleted(ok, tuple(failures))
