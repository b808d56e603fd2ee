"""The optional protocol ``serve-pulls`` (:data:`~kvwire.contract.capabilities.SERVE_PULLS`):
a peer backend that lets other ends pull blocks by name from this end's reuse tree (N2).

A backend that declares it also implements :class:`ServesPulls`. The flow on the serving end:
the holder calls ``serve(wake)`` once; the backend calls ``wake`` after new requests are visible
through ``incoming()`` (W1); for each request the holder looks the names up in its reuse tree,
pins the longest held prefix under a lease, and answers with ``publish(view, request.ticket,
wake)``, where the view holds, for each requested group in order, the rows of that prefix (zero
rows when nothing is held); it releases the lease once that attempt quiesces. Or it refuses with
``decline(request, reason)``. The requesting end's fetch marks the rows that were served: a
partial prefix is a delivered attempt, a decline a failed one.

A backend that also declares ``offer-pulls`` implements :class:`OffersPulls`: the holder pins
blocks in advance and the backend answers pulls of them alone, with no request in ``incoming()``
(O1)."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from kvwire.contract.backend import Attempt, WakeFn
from kvwire.contract.hint import Hint
from kvwire.contract.view import View, frozen_array

__all__ = ["OffersPulls", "PullRequest", "ServesPulls"]


@dataclass(frozen=True, slots=True)
class PullRequest:
    """Another end asks for blocks by name. ``names`` (shape ``(n, width)``, read-only uint8) are
    in prefix order and stand for the same blocks in every group of ``groups``; ``slot_bytes``
    is the row size the requester expects per group. Answer with ``ticket`` as the hint.
    ``credentials`` carries, unread by the backend, the bytes of the requester's hint field
    ``credentials`` (the holders' authentication); ``peer`` says who asks, as the backend knows it."""

    ticket: Hint
    groups: tuple[int, ...]
    slot_bytes: tuple[int, ...]
    names: np.ndarray
    peer: str = ""
    credentials: bytes = b""

    def __post_init__(self) -> None:
        if self.ticket.kind != "ticket":
            raise ValueError(f"a PullRequest's ticket is a Hint of kind 'ticket', got {self.ticket.kind!r}")
        object.__setattr__(self, "groups", tuple(int(g) for g in self.groups))
        object.__setattr__(self, "slot_bytes", tuple(int(s) for s in self.slot_bytes))
        if len(self.groups) != len(self.slot_bytes):
            raise ValueError("a PullRequest gives one slot size per group")
        object.__setattr__(self, "names", frozen_array(self.names, np.uint8, "PullRequest names", 2))

    @property
    def blocks(self) -> int:
        return int(self.names.shape[0])


class ServesPulls(abc.ABC):
    """What a backend that declares ``serve-pulls`` offers besides :class:`Backend`."""

    @abc.abstractmethod
    def address(self) -> bytes:
        """What another end needs to reach this one (opaque, at most 4 KiB). A requester's fetch
        names it in its hint: ``Hint.of("peer", address=...)``."""

    @abc.abstractmethod
    def serve(self, wake: WakeFn) -> None:
        """Start answering pulls; ``wake`` is called after new requests are visible. Until
        this is called, pulls from other ends are declined as 'not serving'."""

    @abc.abstractmethod
    def incoming(self) -> tuple[PullRequest, ...]:
        """Requests that arrived since the last call, each returned once. Never blocks."""

    @abc.abstractmethod
    def decline(self, request: PullRequest, reason: str) -> None:
        """Refuse ``request``; the requester's fetch fails with ``reason``. Never blocks."""


class OffersPulls(abc.ABC):
    """What a backend that declares ``offer-pulls`` offers besides :class:`ServesPulls` (O1)."""

    @abc.abstractmethod
    def offer(self, view: View, wake: WakeFn, timeout_s: float | None = None) -> Attempt:
        """Stand ready to answer pulls of the view's named rows without the holder, until
        ``timeout_s`` (else the backend's deadline) passes or the offer is cancelled. A pull is
        answered from one offer only when it names, in every group it asks for, blocks that
        offer holds with the slot size it expects; any other pull goes to ``incoming()``. The
        holder keeps the rows pinned and unwritten until the returned attempt quiesces."""
