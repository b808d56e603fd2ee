"""The engine's fault-injection seam, for tests: hold back chosen control frames at one end, so
that a test makes two events cross (a ``Cancel`` and an ``Offer`` on the wire, rows before their
offer, a slow ``Ack``) through the real engine instead of by patching it.

    hold = backend.engine.faults.hold(FrameFlow.OUTGOING, lambda m: isinstance(m, wire.Cancel))
    ...                      # the Cancel is held at this end, everything else flows
    hold.release()           # it goes out now, as if it had been slow

A hold is taken up on the progress thread in order with the submissions before and after it, so
a hold taken before a ``fetch`` catches that fetch's frames. Nothing is held while no hold is
active: the engine's cost is one truth test per frame."""

from __future__ import annotations

import enum
from collections.abc import Callable

from kvwire_ucx import wire
from kvwire_ucx.connection import Connection
from kvwire_ucx.reactor import Reactor

__all__ = ["Faults", "FrameFlow", "FrameHold"]


class FrameFlow(enum.Enum):
    """Which way a frame goes at this end."""

    OUTGOING = "outgoing"  #: frames this end sends, held before they reach the socket
    INCOMING = "incoming"  #: frames this end received, held before they are routed


class FrameHold:
    """Frames of one direction that ``matches`` picks, held back from the moment the progress
    thread takes the hold up until :meth:`release`."""

    def __init__(self, faults: Faults, direction: FrameFlow, matches: Callable[[wire.Message], bool]) -> None:
        self._faults = faults
        self.direction = direction
        self.matches = matches
        #: the frames held so far, with their connections, in order (appended on the thread)
        self.held: list[tuple[Connection, wire.Message]] = []

    @property
    def messages(self) -> list[wire.Message]:
        return [message for _, message in self.held]

    def release(self, after_s: float = 0.0) -> None:
        """Stop holding, and (``after_s`` seconds from now) send or route what was held, in
        order; frames of a connection closed meanwhile are dropped. From any thread."""
        self._faults._reactor.submit(self._faults._release, self, after_s)


class Faults:
    """The holds of one engine. ``send`` and ``route`` are the engine's own paths for a frame
    going out and a frame that arrived."""

    def __init__(self, reactor: Reactor, send: Callable[[Connection, wire.Message], None],
                 route: Callable[[Connection, wire.Message], None]) -> None:
        self._reactor = reactor
        self._send = send
        self._route = route
        self._holds: list[FrameHold] = []  # touched only on the progress thread

    def hold(self, direction: FrameFlow, matches: Callable[[wire.Message], bool]) -> FrameHold:
        """Hold back the frames of ``direction`` that ``matches`` picks, until released."""
        hold = FrameHold(self, direction, matches)
        self._reactor.submit(self._holds.append, hold)
        return hold

    @property
    def active(self) -> bool:
        return bool(self._holds)

    def held(self, direction: FrameFlow, conn: Connection, message: wire.Message) -> bool:
        """Whether a hold took ``message`` (the engine then does nothing more with it)."""
        for hold in self._holds:
            if hold.direction is direction and hold.matches(message):
                hold.held.append((conn, message))
                return True
        return False

    def inject(self, direction: FrameFlow, conn: Connection, message: wire.Message) -> None:
        """A frame a test makes up, from the progress thread after what it is doing now: sent on
        ``conn`` (OUTGOING), or routed as if it had arrived on ``conn`` (INCOMING), by the engine's
        own paths (a hold of that direction may take it). Nothing happens on a closed connection."""
        go = self._send if direction is FrameFlow.OUTGOING else self._route
        self._reactor.submit(lambda: None if conn.closed else go(conn, message))

    def _release(self, hold: FrameHold, after_s: float) -> None:
        if hold in self._holds:
            self._holds.remove(hold)
        if after_s > 0:
            self._reactor.call_later(after_s, lambda: self._let_go(hold))
        else:
            self._let_go(hold)

    def _let_go(self, hold: FrameHold) -> None:
        go = self._send if hold.direction is FrameFlow.OUTGOING else self._route
        for conn, message in hold.held:
            if not conn.closed:
                go(conn, message)
