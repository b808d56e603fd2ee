"""The engine's record of one pull at each end: the protocol machine, the attempt, the
connection and the row mover it uses (:class:`FetchJob`, :class:`ReplyJob`), the holder's
ticket for answering a pull (:class:`Ticket`), what the two sides of the engine
(:mod:`kvwire_ucx.requesting`, :mod:`kvwire_ucx.serving`) ask of the engine that routes their
events (:class:`Router`) and what each works with (:class:`EngineContext`). Data only; the engine
drives them."""

from __future__ import annotations

import enum
import threading
from typing import Any, Protocol

import numpy as np

from kvwire.contract import Cause
from kvwire.contract.serving import PullRequest
from kvwire_ucx import wire
from kvwire_ucx.address import PeerAddress
from kvwire_ucx.attempt import UcxAttempt
from kvwire_ucx.connection import Connection
from kvwire_ucx.nixl import NixlAgent
from kvwire_ucx.nixl_reads import RangeReads
from kvwire_ucx.offers import PushedOffer, StandingOffer
from kvwire_ucx.protocol.requester import PullRequester, RequesterState
from kvwire_ucx.protocol.server import PullServer, ServerState
from kvwire_ucx.reactor import Reactor
from kvwire_ucx.regions import GroupRows
from kvwire_ucx.settings import UcxSettings
from kvwire_ucx.tag_rows import TagReceives, TagSends

__all__ = ["EngineContext", "FetchJob", "Job", "ReplyJob", "Router", "Ticket"]


class FetchJob:
    """The requesting end of one pull."""

    __slots__ = ("attempt", "machine", "address", "deadline", "groups", "conn", "receives", "reads", "cancel_fed",
                 "pushed")

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
        #: the offer the serving end pushed that answers this fetch (no Pull went out)
        self.pushed: PushedOffer | None = None

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
                 "surfaced", "attempt", "groups", "sends", "deadline", "read_offer", "cancel_fed", "offer", "peer_breaks")

    def __init__(self, pull_id: int, conn: Connection, machine: PullServer, request: PullRequest | None,
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
        #: the requester's breaks, from its Pull (two-sided): where its lent rows stop being adjacent
        self.peer_breaks: tuple[tuple[int, ...] | None, ...] = ()
        self.deadline = expires_at
        #: one-sided: generation, metadata, agent, the rows answered per group and their runs
        self.read_offer: tuple[int, bytes, bytes, tuple[int, ...], tuple[np.ndarray, ...]] | None = None
        self.cancel_fed = False
        #: the standing offer (O1) this answer reads from (``request`` is then ``None``: the
        #: pull never reached the holder)
        self.offer: StandingOffer | None = None

    @property
    def finished(self) -> bool:
        return self.machine.state is ServerState.DONE

    @property
    def transfer(self) -> int:
        return self.machine.spec.transfer

    def __repr__(self) -> str:
        return f"ReplyJob({self.pull_id}, {self.machine.state.name}, {self.ticket.name})"


Job = FetchJob | ReplyJob


class Router(Protocol):
    """What a side of the engine asks of the engine (:class:`kvwire_ucx.engine.Engine`), on the
    progress thread: hand a job an event, send a frame, end a connection, count."""

    def feed(self, job: Job, event: Any) -> None: ...
    def send(self, conn: Connection, message: wire.Message) -> None: ...
    def arrived(self, conn: Connection, message: Any) -> None: ...  # routed as a frame that arrived
    def drop(self, conn: Connection, reason: str) -> None: ...    # the peer broke the protocol
    def close_connection(self, conn: Connection, reason: str, *, lost: bool = False,
                         cause: Cause | None = None) -> None: ...
    def count(self, key: str, n: int = 1) -> None: ...
    def conclude(self, attempt: UcxAttempt, outcome: Any) -> None: ...  # unless it concluded already; wakes
    def quiesce(self, attempt: UcxAttempt) -> None: ...                 # unless it quiesced already; wakes


class EngineContext:
    """What the engine gives each of its two sides (:class:`~kvwire_ucx.requesting.Requesting`,
    :class:`~kvwire_ucx.serving.Serving`) to work with: the engine (as its :class:`Router`), the
    engine's lock (for what holder threads touch), the settings, the NIXL agent (one-sided mode
    only) and the reactor (for timers and wakes)."""

    def __init__(self, router: Router, lock: threading.Lock, settings: UcxSettings, nixl: NixlAgent | None,
                 reactor: Reactor) -> None:
        self._router = router
        self._lock = lock
        self._settings = settings
        self._nixl = nixl
        self._reactor = reactor
