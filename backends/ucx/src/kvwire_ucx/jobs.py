"""The engine's record of one pull at each end: the protocol machine, the attempt, the
connection and the row mover it uses (:class:`FetchJob`, :class:`ReplyJob`), and the holder's
ticket for answering a pull (:class:`Ticket`). Data only; the engine drives them."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from kvwire.contract.serving import PullRequest
from kvwire_ucx.address import PeerAddress
from kvwire_ucx.attempt import UcxAttempt
from kvwire_ucx.nixl_reads import RangeReads
from kvwire_ucx.protocol.requester import PullRequester, RequesterState
from kvwire_ucx.protocol.server import PullServer, ServerState
from kvwire_ucx.regions import GroupRows
from kvwire_ucx.tag_rows import TagReceives, TagSends

if TYPE_CHECKING:
    from kvwire_ucx.connection import Connection

__all__ = ["FetchJob", "ReplyJob", "Ticket"]


class FetchJob:
    """The requesting end of one pull."""

    __slots__ = ("attempt", "machine", "address", "deadline", "groups", "conn", "receives", "reads", "cancel_fed")

    def __init__(self, attempt: UcxAttempt, machine: PullRequester, address: PeerAddress, deadline: float,
                 groups: tuple[GroupRows, ...]) -> None:
        self.attempt = attempt
        self.machine = machine
        self.address = address
        self.deadline = deadline  # monotonic
        self.groups = groups
        self.conn: Connection | None = None
        self.receives: TagReceives | None = None
        self.reads: RangeReads | None = None
        self.cancel_fed = False

    @property
    def finished(self) -> bool:
        return self.machine.state is RequesterState.DONE

    @property
    def transfer(self) -> int:
        return self.machine.spec.transfer


class Ticket(enum.Enum):
    """Whether the holder may still answer a pull (its ``PullRequest.ticket``)."""

    OPEN = "open"        #: waiting for the holder's answer
    CLAIMED = "claimed"  #: answered (publish or decline); the answer is on its way to the engine
    EXPIRED = "expired"  #: the pull ended unanswered; one late answer still learns why


class ReplyJob:
    """The serving end of one pull."""

    __slots__ = ("pull_id", "conn", "machine", "request", "expires_at", "tag_base", "ticket", "claimed_from",
                 "surfaced", "attempt", "groups", "sends", "deadline", "read_offer", "cancel_fed")

    def __init__(self, pull_id: int, conn: Connection, machine: PullServer, request: PullRequest,
                 expires_at: float, tag_base: int) -> None:
        self.pull_id = pull_id
        self.conn = conn
        self.machine = machine
        self.request = request
        self.expires_at = expires_at  # monotonic: the requester's deadline
        self.tag_base = tag_base
        self.ticket = Ticket.OPEN  # guarded by the engine's lock
        self.claimed_from = Ticket.OPEN
        self.surfaced = False      # taken by the holder through incoming(); guarded by the lock
        self.attempt: UcxAttempt | None = None
        self.groups: tuple[GroupRows, ...] = ()
        self.sends: TagSends | None = None
        self.deadline = expires_at
        self.read_offer: tuple[int, bytes, bytes] | None = None  # generation, metadata, agent
        self.cancel_fed = False

    @property
    def finished(self) -> bool:
        return self.machine.state is ServerState.DONE

    @property
    def transfer(self) -> int:
        return self.machine.spec.transfer

    def __repr__(self) -> str:
        return f"ReplyJob({self.pull_id}, {self.machine.state.name}, {self.ticket.name})"


Job = FetchJob | ReplyJob
_ = Any
