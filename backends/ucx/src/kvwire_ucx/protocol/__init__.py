"""The pull protocol without I/O: the requesting side (:mod:`.requester`) and the serving side
(:mod:`.server`) of one pull as state machines, and the events and actions they take and give
(:mod:`.events`). Nothing in this package owns a socket, a thread, a lock or a clock; the engine
(:mod:`kvwire_ucx.engine`) feeds the events and carries the actions out."""

from kvwire_ucx.protocol.events import ProtocolError
from kvwire_ucx.protocol.requester import PullRequester, PullSpec, RequesterState
from kvwire_ucx.protocol.server import PullServer, ReplySpec, ServerState

__all__ = ["ProtocolError", "PullRequester", "PullSpec", "RequesterState", "PullServer", "ReplySpec", "ServerState"]
