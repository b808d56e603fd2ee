"""The reference peer backend: :class:`ReferencePeer`, written directly on ``kvwire.contract``
(no :mod:`kvwire.attempts`, no kvwire-ucx: independent on purpose, the second implementation the
conformance suite is checked against), that pulls blocks by name from another peer, serves such
pulls (``serve-pulls``, N2) and answers pulls of blocks its holder offered in advance on its own
(``offer-pulls``, O1), over an in-process network (:class:`Fabric`).

The wire protocol, one message per arrow, each message handled on the receiving peer's worker
thread (nothing shares an attempt across peers; they learn of each other only by messages)::

    requester                                   server
    fetch(view, Hint.of("peer", address=...))
        -- PullMessage(ticket, groups, names) -->  incoming() after a wake; the holder pins
                                                   the held prefix and answers publish(view,
                                                   ticket), or decline(request, reason)
        <--- Rows(ticket, bytes of the prefix) --  the answer has copied its rows out: it
                                                   quiesces, and waits for the Ack
    writes the rows, concludes delivered
        ---- Ack(ticket) ----------------------->  the answer concludes delivered
        <--- Declined(ticket, reason) ---------    (instead of Rows) the fetch fails, DECLINED
    cancel() or deadline: concludes at once
        ---- Cancel(ticket) -------------------->  drops the request if not yet taken, or ends
                                                   the answer: cancelled by the peer, so its
                                                   holder unpins (N2)

An offered pull (O1), answered without the holder: ``offer(view, wake)`` made the holder's named
rows stand, and one standing offer holds every requested group, at the expected slot size, with
every requested name::

    requester                                   server
        -- PullMessage(ticket, groups, names) -->  covered whole by one standing offer: the
                                                   answer claims the offer, copies the rows of
                                                   those names (the offer quiesces only once no
                                                   claim is left), and nothing reaches
                                                   incoming() or wakes the holder
        <--- Rows(ticket, bytes of the rows) ---
    writes the rows, concludes delivered
        ---- Ack(ticket) ----------------------->  nothing left to do: the answer ended with
                                                   its copy
        <--- Fault(ticket, reason) -------------   (instead of Rows) the offer concluded (its
                                                   deadline, cancel(), shutdown()) before the
                                                   answer read its rows: the fetch fails

Where each clause is met: M3/M4 in :class:`~kvwire.contract.RegionTable`; H1, V4 and S3 in
:meth:`ReferencePeer.fetch` and :meth:`ReferencePeer.publish` (every check before the queue slot,
the slot before any message); A1-A4, A8, W1 in :mod:`kvwire.testing.reference.core`; N2 in the
message handlers below; O1 in :meth:`ReferencePeer.offer`, :meth:`ReferencePeer._answer_from_offer`
and :mod:`kvwire.testing.reference.offers` (the offer as an attempt, its checks, the index that
finds the one offer covering a pull). A requester marks exactly the rows the server sent (a prefix, possibly
empty: a partial prefix delivers).

The grace after a deadline (A8): a requester's fetch quiesces with its conclusion unless its
worker is writing the answer's rows at that moment (one copy); an answer quiesces once its rows
are copied out; an offer quiesces with its conclusion unless an answer is copying its rows then
(it ends every answer that has not started copying).

Why one file of this size: a peer author reads it top to bottom, as a worked example of a peer
written directly on the contract; its messages, its serving side and its requesting side refer
to one another."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvwire.contract import (
    OFFER_PULLS,
    Backend,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    OffersPulls,
    OtherEnd,
    OutcomeStatus,
    PullRequest,
    RegionTable,
    ServesPulls,
    SlotRegion,
    SubmissionRejected,
    TableRegistration,
    View,
    WakeFn,
)
from kvwire.contract.regions import Located
from kvwire.testing.reference.core import (
    ReferenceAttempt,
    Runner,
    read_rows,
    reference_capabilities,
    write_rows,
)
from kvwire.testing.reference.offers import OfferedAnswer, OfferIndex, StandingOffer, check_offer

__all__ = ["ReferencePeer", "Fabric", "Link", "PullMessage", "Rows", "Ack", "Cancel", "Declined", "Fault",
           "peer_capabilities"]

#: Numbers every peer made in this process: a ticket names the instance that handed it out (H1.13),
#: which two peers of one name on two fabrics are not.
_instances = itertools.count(1)

_PEER_FIELDS = frozenset({"address", "credentials"})


def peer_capabilities(max_in_flight: int = 16) -> Capabilities:
    """A store's declaration, as a peer that serves pulls (N2) and standing offers (O1)."""
    caps = reference_capabilities(OtherEnd.PEER, max_in_flight)
    return dataclasses.replace(caps, protocols=caps.protocols | {OFFER_PULLS})


# -- messages ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PullMessage:
    """A requester's pull: the rows of ``names`` in ``groups``, to be answered to ``reply_to``."""

    ticket: int
    reply_to: bytes
    groups: tuple[int, ...]
    slot_bytes: tuple[int, ...]
    names: np.ndarray
    credentials: bytes = b""


@dataclass(frozen=True, slots=True)
class Rows:
    """The served prefix: ``data[g]`` holds the rows of requested group ``g`` (shape ``(count,
    slot_bytes)``)."""

    ticket: int
    reply_to: bytes
    data: tuple[np.ndarray, ...]


@dataclass(frozen=True, slots=True)
class Ack:
    ticket: int


@dataclass(frozen=True, slots=True)
class Cancel:
    ticket: int


@dataclass(frozen=True, slots=True)
class Declined:
    ticket: int
    reason: str


@dataclass(frozen=True, slots=True)
class Fault:
    """The server failed the answer (a fault at the other end: the fetch fails with FAULT)."""

    ticket: int
    reason: str


Message = PullMessage | Rows | Ack | Cancel | Declined | Fault


class Link:
    """How a message reaches a peer. The plain link hands it over; a harness replaces it to hold
    or fault messages (:mod:`kvwire.testing.reference.harness`)."""

    def send(self, fabric: Fabric, to: bytes, message: Message) -> bool:
        """Deliver ``message`` to the peer at ``to``; false when nobody answers there."""
        with fabric.lock:
            peer = fabric.peers.get(to)
        if peer is None:
            return False
        return peer.receive(message)

    def handle(self, at: bytes, message: Message, handler: Callable[[Message], None]) -> None:
        """Called on the receiving peer's worker thread: let the peer at ``at`` act on
        ``message`` (``handler``). A harness's link may wait here, or hand over another message."""
        handler(message)

    @contextlib.contextmanager
    def answering(self, at: bytes, ticket: int) -> Iterator[None]:
        """Wraps the serving peer's answer to the pull ``ticket`` (on its worker thread): handing
        it to the holder, or reading an offer's rows once the answer has claimed the offer. A
        harness's link may wait here (the serving peer answers nothing)."""
        yield


@dataclass
class Fabric:
    """The in-process network: peers by address."""

    peers: dict[bytes, ReferencePeer] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    link: Link = field(default_factory=Link)
    tickets: itertools.count = field(default_factory=lambda: itertools.count(1))  # type: ignore[type-arg]


class _Pull(ReferenceAttempt):
    """A requester's fetch: where its rows go, and the server it asked."""

    def __init__(self, runner: Runner, view: View, wake: WakeFn, timeout_s: float, located: tuple[Located, ...],
                 server: bytes, ticket: int) -> None:
        super().__init__(runner, "fetch", view, wake, timeout_s)
        self.located = located
        self.server = server
        self.ticket = ticket
        self.peer: ReferencePeer | None = None

    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        concluded = super().conclude_locked(status, cause, reason, by_peer=by_peer)
        if concluded and self.peer is not None:
            self.peer._pull_ended_locked(self)
        return concluded


class _Answer(ReferenceAttempt):
    """A server's publish answering a pull."""

    def __init__(self, runner: Runner, view: View, wake: WakeFn, timeout_s: float, located: tuple[Located, ...],
                 ticket: int, reply_to: bytes) -> None:
        super().__init__(runner, "publish", view, wake, timeout_s)
        self.located = located
        self.ticket = ticket
        self.reply_to = reply_to


class ReferencePeer(Backend, ServesPulls, OffersPulls):
    """One peer on a :class:`Fabric`, reachable at ``address()``. Fetches pull from the peer a
    ``Hint.of("peer", address=...)`` names; publishes answer pulls (``Hint`` of kind ``ticket``
    from a :class:`~kvwire.contract.PullRequest`); offers answer pulls of their blocks alone."""

    def __init__(self, fabric: Fabric, name: str, *, timeout_s: float = 30.0, max_in_flight: int = 16) -> None:
        self._fabric = fabric
        self._name = name
        self._timeout_s = float(timeout_s)
        self._capabilities = peer_capabilities(max_in_flight)
        self._table = RegionTable(self._capabilities.memory_kinds)
        self._runner = Runner(f"kvwire-reference-peer-{name}", max_in_flight)
        # requester side: pulls waiting for the server's answer, and messages to send
        self._pulls: dict[int, _Pull] = {}
        self._outbox: list[tuple[bytes, Message]] = []
        # server side, by ticket: requests not yet taken through incoming(), requests taken and
        # not yet answered, where each request's answer goes, and answers waiting for an Ack
        self._requests: dict[int, PullRequest] = {}
        self._taken: dict[int, PullRequest] = {}
        self._withdrawn: set[int] = set()  # taken, then cancelled by the requester before the answer
        self._replies: dict[int, bytes] = {}
        self._answers: dict[int, _Answer] = {}
        self._serving_wake: WakeFn | None = None
        # standing offers (O1), and the answers given from them that still hold a claim
        self._offers = OfferIndex()
        self._offered: dict[int, OfferedAnswer] = {}
        self._ticket_at = f"{self.address().decode()}#{next(_instances)}".encode()
        with fabric.lock:
            if self.address() in fabric.peers:
                raise ValueError(f"a peer named {name!r} is already on this fabric")
            fabric.peers[self.address()] = self

    # -- declared and registered ---------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return self._capabilities

    def address(self) -> bytes:
        return f"reference/{self._name}".encode()

    def register_regions(self, regions: Sequence[SlotRegion]) -> TableRegistration:
        return self._table.register(regions)

    def _send(self, to: bytes, message: Message) -> bool:
        return self._fabric.link.send(self._fabric, to, message)

    # -- requesting: fetch --------------------------------------------------------------------

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        """Pull the view's blocks by name from the peer the hint names."""
        runner = self._runner
        if runner.closed:
            raise SubmissionRejected("this peer is shut down; it takes no fetch")
        server, credentials = self._peer_of(hint)
        located = self._table.locate_view(view)
        if view.overlapping_rows() is not None:
            raise InvalidSubmission("fetch rows overlap: two rows locate the same memory (V4)")
        if not view.groups:  # V1.7: a view without groups concludes like any other; there is nothing to ask
            pull = _Pull(runner, view, wake, self._timeout_s, located, server, next(self._fabric.tickets))
            with runner.lock:
                runner.admit_locked(pull, "fetch")
                pull.conclude_locked(OutcomeStatus.DELIVERED)
            return pull
        first = view.groups[0].names
        for group in view.groups:
            if group.names is None:
                raise InvalidSubmission(f"group {group.group_id} carries no names; a pull names its blocks")
            if first is None or not np.array_equal(group.names, first):
                raise InvalidSubmission("a pull names each block once for every group: the groups' names must agree")
        assert first is not None
        ticket = next(self._fabric.tickets)
        timeout_s = self._timeout_s if hint.timeout_s is None else hint.timeout_s
        pull = _Pull(runner, view, wake, timeout_s, located, server, ticket)
        pull.peer = self
        with runner.lock:
            runner.admit_locked(pull, "fetch")
            self._pulls[ticket] = pull
        request = PullMessage(ticket, self.address(), tuple(g.group_id for g in view.groups),
                          tuple(g.region.slot_bytes for g in view.groups), first, credentials)
        if not self._send(server, request):
            with runner.lock:
                self._pulls.pop(ticket, None)
                pull.conclude_locked(OutcomeStatus.FAILED, Cause.PEER_GONE,
                                     f"no peer answers at {server!r}")
        return pull

    def _peer_of(self, hint: Hint) -> tuple[bytes, bytes]:
        """H1: ``Hint.of("peer", address=bytes[, credentials=bytes])``, nothing else."""
        if not isinstance(hint, Hint) or hint.kind != "peer":
            raise InvalidSubmission(f"a fetch takes a hint of kind 'peer' naming the serving peer, got {hint!r}")
        unknown = sorted(k for k, _ in hint.fields if k not in _PEER_FIELDS)
        if unknown:
            raise InvalidSubmission(f"peer hint field(s) {', '.join(map(repr, unknown))} are not understood; a peer "
                                    f"hint carries: {', '.join(sorted(_PEER_FIELDS))}")
        address, credentials = hint.get("address"), hint.get("credentials", b"")
        if not isinstance(address, bytes) or not address:
            raise InvalidSubmission(f"peer hint field 'address' must be non-empty bytes, got {address!r}")
        if not isinstance(credentials, bytes):
            raise InvalidSubmission(f"peer hint field 'credentials' must be bytes, got {type(credentials).__name__}")
        return address, credentials

    # -- serving (N2) ---------------------------------------------------------------------------

    def serve(self, wake: WakeFn) -> None:
        with self._runner.lock:
            self._serving_wake = wake

    def incoming(self) -> tuple[PullRequest, ...]:
        with self._runner.lock:
            taken = tuple(self._requests.values())
            self._taken.update(self._requests)
            self._requests.clear()
        return taken

    def decline(self, request: PullRequest, reason: str) -> None:
        ticket = _ticket_of(request.ticket)
        with self._runner.lock:
            reply_to = self._replies.pop(ticket, None) if ticket in self._taken else None
            self._taken.pop(ticket, None)
            self._withdrawn.discard(ticket)
        if reply_to is not None:
            self._send(reply_to, Declined(ticket, str(reason) or "declined"))

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        """Answer a pull: send the view's rows (the held prefix, in the request's group order)."""
        runner = self._runner
        if runner.closed:
            raise SubmissionRejected("this peer is shut down; it takes no publish")
        if not isinstance(hint, Hint) or hint.kind != "ticket" or not isinstance(hint.get("id"), int):
            raise InvalidSubmission(f"a peer publishes only to answer a pull, with the request's ticket; got {hint!r}")
        if {k for k, _ in hint.fields} != {"id", "at"}:
            raise InvalidSubmission(f"a ticket hint carries 'id' and 'at', as the PullRequest gave it; got {hint!r}")
        if hint.get("at") != self._ticket_at:
            # H1.13: a ticket handed out by another peer instance (another domain).
            raise SubmissionRejected(f"ticket {hint!r} was handed out by another peer, not by {self.address()!r}")
        ticket = _ticket_of(hint)
        located = self._table.locate_view(view)
        for group in view.groups:
            if group.rows and group.names is None:  # N1.5, before the request is looked at
                raise InvalidSubmission(f"group {group.group_id} carries no names; an answer names the blocks it serves")
        counts = {g.rows for g in view.groups}
        if len(counts) > 1:
            raise InvalidSubmission(f"an answer sends the same prefix in every group, got row counts {sorted(counts)}")
        timeout_s = self._timeout_s if hint.timeout_s is None else hint.timeout_s
        with runner.lock:
            if ticket in self._withdrawn:
                # The requester cancelled after the holder took its request: the answer ends at
                # once, cancelled by the peer, and touches nothing.
                answer = _Answer(runner, view, wake, timeout_s, located, ticket, b"")
                runner.admit_locked(answer, "publish")
                self._withdrawn.discard(ticket)
                answer.conclude_locked(OutcomeStatus.CANCELLED, Cause.PEER_CANCELLED,
                                       "the requesting peer cancelled the pull", by_peer=True)
                return answer
            request = self._taken.get(ticket)
            if request is None:
                raise InvalidSubmission(f"ticket {ticket} names no pull this peer has taken through incoming() "
                                        "and not yet answered")
            answer = _Answer(runner, view, wake, timeout_s, located, ticket, self._replies[ticket])
            runner.admit_locked(answer, "publish")
            del self._taken[ticket]
            del self._replies[ticket]
            misfit = _misfit(view, request)
            if misfit is not None:
                # N2.12: the answer fails, and so does the requester's fetch, saying why.
                answer.conclude_locked(OutcomeStatus.FAILED, Cause.FAULT, f"the answer does not fit its pull: {misfit}")
                self._outbox.append((answer.reply_to, Fault(ticket, f"the server's answer does not fit: {misfit}")))
                runner.run(self._flush)
                return answer
            self._answers[ticket] = answer
        runner.run(lambda: self._send_rows(answer))
        return answer

    def _send_rows(self, answer: _Answer) -> None:
        """Worker: copy the answer's rows out, quiesce, send them; conclude on the Ack."""
        with self._runner.lock:
            if not answer.touch_locked():
                return
        data = tuple(read_rows(loc, g.region.slot_bytes) for g, loc in zip(answer.view.groups, answer.located,
                                                                           strict=True))
        with self._runner.lock:
            answer.untouch_locked()
            answer.end_access_locked()  # A2: quiesced before concluded; the Ack concludes it
        if not self._send(answer.reply_to, Rows(answer.ticket, self.address(), data)):
            with self._runner.lock:
                self._answers.pop(answer.ticket, None)
                answer.conclude_locked(OutcomeStatus.FAILED, Cause.PEER_GONE, "the requesting peer is gone")

    # -- standing offers (O1) -------------------------------------------------------------------

    def offer(self, view: View, wake: WakeFn, timeout_s: float | None = None) -> StandingOffer:
        """Stand ready to answer pulls of the view's named rows without the holder (O1)."""
        runner = self._runner
        if runner.closed:
            raise SubmissionRejected("this peer is shut down; it takes no offer")
        located = self._table.locate_view(view)  # M1, M4, V1: as a publish is checked
        deadline_s = self._offer_deadline(view, timeout_s)
        offer = self._offer_type(runner, view, wake, deadline_s, located, self._offer_ended_locked)
        with runner.lock:
            runner.admit_locked(offer, "offer")  # O1.3: one queue slot, taken last
            self._offers.add(offer)
        return offer

    #: The attempt an offer is (a mutant of the reference peer swaps it).
    _offer_type = StandingOffer

    def _offer_deadline(self, view: View, timeout_s: object) -> float:
        """O1.2: refuse what an offer may not be; the offer's deadline in seconds from now."""
        return check_offer(view, timeout_s, self._timeout_s)

    def _offer_ended_locked(self, offer: StandingOffer) -> None:
        """``offer`` concluded: it answers no later pull (O1.7), and the answers it gave that have
        not started copying its rows end now, their requesters' fetches failing (O1.8)."""
        self._offers.remove(offer)
        for answer in list(offer.claims):
            if not answer.reading:
                answer.ended = True
                self._offered.pop(answer.ticket, None)
                offer.release_locked(answer)
                self._outbox.append((answer.reply_to, Fault(answer.ticket, "the offer answering this pull ended "
                                                                           "before its rows were sent")))
        if self._outbox:
            self._runner.run(self._flush)

    def _claim_locked(self, message: PullMessage) -> OfferedAnswer | None:
        """The answer to ``message`` from the one standing offer that covers it whole, which it
        claims (O1.4); ``None`` when none does (O1.5)."""
        found = self._offers.cover(message.groups, message.slot_bytes, message.names)
        if found is None:
            return None
        offer, rows = found
        answer = OfferedAnswer(message.ticket, message.reply_to, offer, rows)
        offer.claim_locked(answer)
        self._offered[message.ticket] = answer
        return answer

    def _answer_from_offer(self, answer: OfferedAnswer) -> None:
        """Worker: copy the offered rows the pull names, let go of the offer, send them. No wake
        of the holder's: neither the offer's nor the serve wake (O1.10)."""
        offer = answer.offer
        with self._runner.lock:
            if answer.ended:
                return  # the offer concluded while this answer waited; its requester was told
            answer.reading = True
        data = offer.read(answer)  # outside the lock: the claim keeps the offer from quiescing
        with self._runner.lock:
            answer.reading = False
            self._offered.pop(answer.ticket, None)
            offer.release_locked(answer)
            # O1.8: an offer that concluded while its rows were copied sends nothing more
            ended = offer.concluded
        if ended:
            self._send(answer.reply_to, Fault(answer.ticket, "the offer answering this pull ended while its rows were "
                                                             "copied"))
        else:
            self._send(answer.reply_to, Rows(answer.ticket, self.address(), data))

    # -- receiving ----------------------------------------------------------------------------

    def receive(self, message: Message) -> bool:
        """Called by the fabric from the sender's thread: queue ``message`` for our worker."""
        with self._runner.lock:
            if self._runner.closed and not isinstance(message, (Cancel, Ack)):
                closed = True
            else:
                closed = False
        if closed:
            if isinstance(message, PullMessage):
                self._send(message.reply_to, Declined(message.ticket, "the serving peer shut down"))
            return True
        self._runner.run(lambda: self._fabric.link.handle(self.address(), message, self._handle))
        return True

    def _handle(self, message: Message) -> None:
        """Worker: act on one message (through the fabric's link, which may hold or fault it)."""
        if isinstance(message, PullMessage):
            self._on_request(message)
        elif isinstance(message, Rows):
            self._on_rows(message)
        elif isinstance(message, Ack):
            with self._runner.lock:
                answer = self._answers.pop(message.ticket, None)
                if answer is not None:
                    # The requester holds the served prefix now (A5: the rows the other end holds).
                    for mask, group in zip(answer.moved, answer.view.groups, strict=True):
                        mask[: group.rows] = True
                    answer.conclude_locked(OutcomeStatus.DELIVERED)
        elif isinstance(message, Cancel):
            self._on_cancel(message)
        else:
            with self._runner.lock:
                pull = self._pulls.get(message.ticket)
                if pull is not None:
                    if isinstance(message, Declined):
                        # The server holds nothing for a declined pull: nothing to tell it.
                        del self._pulls[message.ticket]
                        pull.conclude_locked(OutcomeStatus.FAILED, Cause.DECLINED, message.reason)
                    else:
                        # A fault: the pull ends, and the Cancel it sends ends the server's answer.
                        pull.conclude_locked(OutcomeStatus.FAILED, Cause.FAULT, message.reason)

    def _on_request(self, message: PullMessage) -> None:
        with self._runner.lock:
            offered = self._claim_locked(message) if self._serving_wake is not None else None
        with self._fabric.link.answering(self.address(), message.ticket):
            if offered is not None:
                self._answer_from_offer(offered)
            else:
                self._to_holder(message)

    def _to_holder(self, message: PullMessage) -> None:
        """N2.4: the pull becomes visible through incoming(), and the serve wake follows."""
        with self._runner.lock:
            wake = self._serving_wake
            if wake is not None:
                request = PullRequest(Hint.of("ticket", id=message.ticket, at=self._ticket_at), message.groups, message.slot_bytes,
                                      message.names, peer=message.reply_to.decode(errors="replace"),
                                      credentials=message.credentials)
                self._requests[message.ticket] = request
                self._replies[message.ticket] = message.reply_to
                self._runner.later_locked(wake)  # W1: after the request is visible
        if wake is None:
            self._send(message.reply_to, Declined(message.ticket, "the peer is not serving pulls"))

    def _on_rows(self, message: Rows) -> None:
        with self._runner.lock:
            pull = self._pulls.pop(message.ticket, None)
            # A pull that ended (cancel, deadline) already told the server with a Cancel.
            if pull is None or not pull.touch_locked():
                return
        count = message.data[0].shape[0] if message.data else 0
        fits = len(message.data) == len(pull.view.groups) and all(
            d.shape == (count, g.region.slot_bytes) and count <= g.rows
            for d, g in zip(message.data, pull.view.groups, strict=False))
        if fits:
            for group, located, data in zip(pull.view.groups, pull.located, message.data, strict=True):
                write_rows(located, group.region.slot_bytes, np.arange(count), data)
        delivered = False
        with self._runner.lock:
            pull.untouch_locked()
            if not fits:
                pull.conclude_locked(OutcomeStatus.FAILED, Cause.FAULT, "the server's answer does not fit the pull")
            elif pull.outcome is None:
                for mask in pull.moved:
                    mask[:count] = True  # N2: the served prefix, nothing beyond
                delivered = pull.conclude_locked(OutcomeStatus.DELIVERED)
        # The server's answer ends either way: held by us (Ack), or not (Cancel: cancelled while
        # its rows were being written, or they did not fit).
        self._send(message.reply_to, Ack(message.ticket) if delivered else Cancel(message.ticket))

    def _on_cancel(self, message: Cancel) -> None:
        with self._runner.lock:
            self._requests.pop(message.ticket, None)
            if self._taken.pop(message.ticket, None) is not None:
                self._withdrawn.add(message.ticket)
            self._replies.pop(message.ticket, None)
            answer = self._answers.pop(message.ticket, None)
            if answer is not None:
                answer.conclude_locked(OutcomeStatus.CANCELLED, Cause.PEER_CANCELLED,
                                       "the requesting peer cancelled the pull", by_peer=True)

    # -- a pull that ends before its answer tells the server (N2) -----------------------------

    def _pull_ended_locked(self, pull: _Pull) -> None:
        """``pull`` concluded. If no answer ended it (a cancel, the deadline, shutdown), tell the
        server, so that its holder's pins do not wait for the answer's own deadline."""
        if self._pulls.pop(pull.ticket, None) is not None:
            self._outbox.append((pull.server, Cancel(pull.ticket)))
            self._runner.run(self._flush)

    def _flush(self) -> None:
        """Send what the outbox holds, outside the lock (a peer never sends while holding it)."""
        with self._runner.lock:
            out, self._outbox = self._outbox, []
        for to, message in out:
            self._send(to, message)

    # -- lifecycle (B3) -----------------------------------------------------------------------

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        runner = self._runner
        with runner.lock:
            runner.closed = True
            self._table.close()
            for attempt in list(runner.live):
                attempt.conclude_locked(OutcomeStatus.CANCELLED, Cause.SHUTDOWN, "the peer shut down")
            pending_requests = [(t, self._replies.get(t)) for t in (*self._requests, *self._taken)]
            self._requests.clear()
            self._taken.clear()
            self._withdrawn.clear()
            self._replies.clear()
            pending = frozenset(a for a in runner.live if not a.quiesced())
        self._flush()
        for ticket, reply_to in pending_requests:
            if reply_to is not None:
                self._send(reply_to, Declined(ticket, "the serving peer shut down"))
        if not pending:
            with self._fabric.lock:
                if self._fabric.peers.get(self.address()) is self:
                    del self._fabric.peers[self.address()]
            # A worker may be parked in the link (a harness's hold) with an answer from an offer
            # that this shutdown ended: it reads nothing when it goes on, so it is not waited for.
            runner.stop(wait_workers=False)
        return pending

    def __repr__(self) -> str:
        return f"ReferencePeer({self._name!r}, {len(self._runner.live)} in flight)"


def _misfit(view: View, request: PullRequest) -> str | None:
    """Why ``view`` does not answer ``request`` (N2.12), or ``None``: the request's groups in
    order, its slot sizes, at most its blocks, named as the prefix of its names."""
    groups = tuple(g.group_id for g in view.groups)
    if groups != request.groups:
        return f"groups {list(groups)}, the pull asked for {list(request.groups)}"
    for group, size in zip(view.groups, request.slot_bytes, strict=True):
        if group.region.slot_bytes != size:
            return f"group {group.group_id} rows are {group.region.slot_bytes} bytes, the pull expects {size}"
        if group.rows > request.blocks:
            return f"group {group.group_id} sends {group.rows} blocks, the pull asked for {request.blocks}"
        if group.rows and (group.names is None or not np.array_equal(group.names, request.names[: group.rows])):
            return f"group {group.group_id} does not name the prefix of the pull's blocks"
    return None


def _ticket_of(hint: Hint) -> int:
    ticket = hint.get("id")
    if not isinstance(ticket, int) or isinstance(ticket, bool):
        raise InvalidSubmission(f"a ticket hint carries an int 'id', got {hint!r}")
    return ticket
