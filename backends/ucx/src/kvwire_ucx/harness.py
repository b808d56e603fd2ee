"""The conformance harness of kvwire-ucx: a connected pair of backends on loopback.

``source`` serves pulls (the suite plays its holder) and ``sink`` fetches from it with
``Hint.of("peer", address=source.address())``. Run the suite with::

    pytest --pyargs kvwire.testing.suite --kvwire-backend ucx

The opt-in one-sided mode (both ends ``mode="one-sided"``, rows read through NIXL) has its own
harness object::

    pytest --pyargs kvwire.testing.suite --kvwire-harness kvwire_ucx.harness:one_sided

Holds and faults go through the engine's own fault seam (:mod:`kvwire_ucx.faults`), on the real
wire: the hold (``Ends.hold``) keeps back what the serving end says to a requester about an
answer (its ``Offer`` or ``ReadOffer``, a ``Decline``), so an answer stands published and not yet
received; a :class:`~kvwire.testing.harness.FaultPlan` makes the serving end stop each answer to a
pull that names a listed block right after offering it (a ``Decline`` behind the ``Offer``: the
requester's fetch fails). The serving end declines pulls as busy beyond ``max_pending_pulls``,
which the harness sets to the queue bound a test asks for and says in ``extra["pending_pulls"]``."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvwire.contract import Hint
from kvwire.testing.gate import faulted_rows
from kvwire.testing.harness import Ends, FaultPlan, Harness, Hold, Unavailable

__all__ = ["UcxHarness", "harness", "one_sided"]

#: The grace each backend of the pair gets after a deadline or cancel (its ``grace_s`` option).
GRACE_S = 0.5
#: How long a hold waits for the progress thread to take it up or let go.
_SYNC_S = 10.0


def _sync(engine: Any) -> bool:
    """Wait until the engine's progress thread ran everything submitted before this call."""
    done = threading.Event()
    engine.submit(done.set)
    return done.wait(_SYNC_S)


class ServingHold(Hold):
    """The serving end's words about its answers (``Offer``, ``ReadOffer``, ``Decline``) held
    on the wire from the moment this returns until :meth:`release`; everything else flows (rows
    already named on credit included: they land, unconfirmed, as on a slow control channel).
    In the one-sided mode a pull that an offer the serving end pushed covers is answered at the
    requesting end (``sink``), without a word on the wire: that answer is held there, before
    its read starts."""

    def __init__(self, engine: Any, sink: Any = None) -> None:
        from kvwire_ucx import wire
        from kvwire_ucx.faults import FrameFlow
        from kvwire_ucx.requesting import PushedAnswer

        self._engine = engine
        self._sink = sink
        answers = (wire.Offer, wire.ReadOffer, wire.Decline)
        self._hold = engine.faults.hold(FrameFlow.OUTGOING, lambda m: isinstance(m, answers))
        self._pushed = None if sink is None else sink.faults.hold(FrameFlow.INCOMING,
                                                                  lambda m: isinstance(m, PushedAnswer))
        self._released = False
        _sync(engine)
        if sink is not None:
            _sync(sink)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._hold.release()
            if self._pushed is not None:
                self._pushed.release()
                _sync(self._sink)
            _sync(self._engine)

    def waiting(self) -> int:
        if self._released:
            return 0
        return len(self._hold.held) + (len(self._pushed.held) if self._pushed is not None else 0)

    def wait_idle(self, timeout_s: float) -> bool:
        return self._released and _sync(self._engine) and (self._sink is None or _sync(self._sink))


class PlanFaults:
    """An engine's fault seam with a :class:`FaultPlan` on top: the answer to every pull naming a
    block the plan lists (for a fetch or a publish) fails at the serving end as it is offered: the
    requester hears a ``Decline`` instead of its ``Offer`` (its fetch fails; rows already sent on
    credit are its to drain), and the serving end hears the requester stop (its answer ends
    cancelled by the peer). Holds taken through it work as before."""

    def __init__(self, engine: Any, plan: FaultPlan) -> None:
        self._inner = engine.faults
        self._engine = engine
        self._plan = plan
        self._doomed: set[tuple[Any, int]] = set()  # (connection, transfer), on the progress thread

    @property
    def active(self) -> bool:
        return True

    def hold(self, direction: Any, matches: Any) -> Any:
        return self._inner.hold(direction, matches)

    def held(self, direction: Any, conn: Any, message: Any) -> bool:
        from kvwire_ucx import wire
        from kvwire_ucx.faults import FrameFlow

        if direction is FrameFlow.INCOMING and isinstance(message, wire.Pull):
            names = np.frombuffer(message.names, dtype=np.uint8).reshape(message.count, message.width)
            if (faulted_rows(self._plan, "fetch", names) | faulted_rows(self._plan, "publish", names)).any():
                self._doomed.add((conn, message.transfer))
        elif (direction is FrameFlow.OUTGOING and isinstance(message, (wire.Offer, wire.ReadOffer))
              and (conn, message.transfer) in self._doomed):
            self._doomed.discard((conn, message.transfer))
            reason = "injected fault: the serving end failed a block of this pull"
            self._inner.inject(FrameFlow.OUTGOING, conn, wire.Decline(message.transfer, reason))
            self._inner.inject(FrameFlow.INCOMING, conn, wire.Cancel(message.transfer, reason))
            if isinstance(message, wire.ReadOffer) and message.metadata:
                # The serving end counts its NIXL metadata as sent on this connection once it sent
                # it; it never went out, so the next ReadOffer must carry it again.
                self._engine.submit(setattr, conn, "nixl_sent", -1)
            return True  # the Offer never goes out
        return bool(self._inner.active and self._inner.held(direction, conn, message))


class UcxHarness(Harness):
    name = "ucx"
    mode = "two-sided"
    #: grace_s, plus time for a forced close to complete the receives and sends still posted
    quiesce_grace_s = GRACE_S + 1.5

    def open(self, *, timeout_s: float, max_in_flight: int | None = None,
             faults: FaultPlan | None = None, hold: bool = False) -> Ends:
        if faults is not None and faults.schedule:
            raise Unavailable("fault schedules are store-driver records; the kvwire-ucx harness faults blocks by name")
        try:
            from kvwire_ucx.backend import UcxBackend
        except ImportError as exc:
            raise Unavailable(f"ucxx cannot be imported here: {exc}") from None
        if self.mode == "one-sided":
            from kvwire_ucx.nixl import nixl_problem

            problem = nixl_problem()
            if problem is not None:
                raise Unavailable(problem)
        options: dict[str, object] = {"timeout_s": timeout_s, "grace_s": GRACE_S, "mode": self.mode}
        if max_in_flight is not None:
            options["max_in_flight"] = max_in_flight
        # The serving end keeps as many pulls waiting for its holder as one requester may have in
        # flight, and declines more as busy: a second requester reaches that bound.
        serving = dict(options)
        if max_in_flight is not None:
            serving["max_pending_pulls"] = max_in_flight
        source = UcxBackend(**serving)  # type: ignore[arg-type]
        try:
            sink = UcxBackend(**options)  # type: ignore[arg-type]
        except BaseException:
            source.shutdown()
            source.close()
            raise
        if faults:
            source.engine.faults = PlanFaults(source.engine, faults)  # type: ignore[assignment]  # the same seam, duck-typed
        # The suite answers pulls with each request's own ticket; this one stands for "a ticket
        # of the source" where a test publishes without a request (it names no pull).
        publish_hint = Hint.of("ticket", backend=source.engine.instance, pull=0)
        return Ends(source, sink, publish_hint, Hint.of("peer", address=source.address()),
                    hold=lambda: ServingHold(source.engine, sink.engine),
                    extra={"pending_pulls": source.engine.settings.max_pending_pulls},
                    another_sink=lambda: UcxBackend(**options))  # type: ignore[arg-type]


class OneSidedUcxHarness(UcxHarness):
    """Both ends in the one-sided mode: the requester reads the served rows through NIXL."""

    mode = "one-sided"


harness = UcxHarness()
one_sided = OneSidedUcxHarness()
