"""The conformance harness of kvwire-ucx: a connected pair of backends on loopback.

``source`` serves pulls (the suite plays its holder) and ``sink`` fetches from it with
``Hint.of("peer", address=source.address())``. Run the suite with::

    pytest --pyargs kvwire.testing.suite --kvwire-backend ucx

The opt-in one-sided mode (both ends ``mode="one-sided"``, rows read through NIXL) has its own
harness object::

    pytest --pyargs kvwire.testing.suite --kvwire-harness kvwire_ucx.harness:one_sided"""

from __future__ import annotations

from kvwire.contract import Hint
from kvwire.testing.harness import Ends, FaultPlan, Harness, Unavailable

__all__ = ["UcxHarness", "harness"]

#: The grace each backend of the pair gets after a deadline or cancel (its ``grace_s`` option).
GRACE_S = 0.5


class UcxHarness(Harness):
    name = "ucx"
    mode = "two-sided"
    #: grace_s, plus time for a forced close to complete the receives and sends still posted
    quiesce_grace_s = GRACE_S + 1.5

    def open(self, *, timeout_s: float, max_in_flight: int | None = None,
             faults: FaultPlan | None = None, hold: bool = False) -> Ends:
        if faults:
            raise Unavailable("the kvwire-ucx harness injects no faults at the serving end")
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
        source = UcxBackend(**options)  # type: ignore[arg-type]
        try:
            sink = UcxBackend(**options)  # type: ignore[arg-type]
        except BaseException:
            source.shutdown()
            source.close()
            raise
        # The suite answers pulls with each request's own ticket; this one stands for "a ticket
        # of the source" where a test publishes without a request (it names no pull).
        publish_hint = Hint.of("ticket", backend=source.engine.instance, pull=0)
        return Ends(source, sink, publish_hint, Hint.of("peer", address=source.address()))


class OneSidedUcxHarness(UcxHarness):
    """Both ends in the one-sided mode: the requester reads the served rows through NIXL."""

    mode = "one-sided"


harness = UcxHarness()
one_sided = OneSidedUcxHarness()
