"""What a suite test needs from the backend, as declared in its capabilities (B4). When a need is
not met the test is skipped with a reason that names the capability, never the backend."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from kvwire.contract import BLOCK_OBJECTS, Capabilities, MemoryKind
from kvwire.contract.capabilities import OFFER_PULLS, SERVE_PULLS, OtherEnd
from kvwire.testing import profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Ends, FaultPlan, Harness, Unavailable
from kvwire.testing.regions import cuda_devices

__all__ = ["transfer", "fetch", "publish", "cancellation", "names", "serve_pulls", "offer_pulls", "block_objects",
           "usable_kind", "usable_kinds", "shares_names", "open_exchange", "misses", "in_flight", "LONG_TIMEOUT_S"]

#: The deadline set through options when a test is not about deadlines: long enough never to
#: interfere, since the suite's patience fails a stuck attempt first.
LONG_TIMEOUT_S = 120.0


def fetch(caps: Capabilities) -> None:
    if not caps.fetch:
        pytest.skip("backend does not declare fetch")


def publish(caps: Capabilities) -> None:
    if not caps.publish:
        pytest.skip("backend does not declare publish")


def transfer(caps: Capabilities) -> None:
    """Rows can move from ``source`` to ``sink``: fetch, and publish (to the store, to the peer,
    or to answer a pull)."""
    fetch(caps)
    publish(caps)


def cancellation(caps: Capabilities) -> None:
    if not caps.cancellation:
        pytest.skip("backend does not declare cancellation")


def names(caps: Capabilities) -> None:
    if not caps.content_addressed:
        pytest.skip("backend does not declare content addressing by name")


def serve_pulls(caps: Capabilities) -> None:
    if caps.other_end is not OtherEnd.PEER or SERVE_PULLS not in caps.protocols:
        pytest.skip(f"backend does not declare the {SERVE_PULLS} protocol")


def offer_pulls(caps: Capabilities) -> None:
    """The backend declares standing offers (O1). Whether it also serves pulls and implements
    ``OffersPulls`` is what the O1.1 test checks, so this asks only for the declaration."""
    if caps.other_end is not OtherEnd.PEER or OFFER_PULLS not in caps.protocols:
        pytest.skip(f"backend does not declare the {OFFER_PULLS} protocol")


def block_objects(caps: Capabilities) -> None:
    """The backend declares block objects (K1). Whether it is a content-addressed store, as the
    protocol asks, is what the K1.1 test checks, so this asks only for the declaration."""
    if BLOCK_OBJECTS not in caps.protocols:
        pytest.skip(f"backend does not declare the {BLOCK_OBJECTS} protocol")


def misses(caps: Capabilities) -> None:
    """The fetching end can ask for rows the other end does not hold: a store, or a peer that
    serves pulls by name."""
    if caps.other_end is OtherEnd.STORE:
        names(caps)
        return
    if SERVE_PULLS not in caps.protocols:
        pytest.skip(f"backend's other end is a peer without the {SERVE_PULLS} protocol, so a fetch cannot name "
                    "rows the peer lacks")


def in_flight(caps: Capabilities, count: int) -> None:
    """The backend takes ``count`` attempts in flight at once (S3.9): open the ends with
    ``max_in_flight=count`` (a harness may keep a smaller bound) and ask their capabilities."""
    if caps.max_in_flight < count:
        pytest.skip(f"backend takes at most {caps.max_in_flight} attempts in flight (max_in_flight); "
                    f"this test needs {count} together")


def shares_names(caps: Capabilities) -> bool:
    """Whether views must name their rows alike in every group: a request-free pull names each
    block once for all layer groups."""
    return caps.other_end is OtherEnd.PEER and SERVE_PULLS in caps.protocols


def usable_kinds(harness: Harness, caps: Capabilities) -> list[MemoryKind]:
    """The declared memory kinds this machine can allocate (DEVICE needs a CUDA device)."""
    kinds = [k for k in (MemoryKind.HOST, MemoryKind.DEVICE) if k in caps.memory_kinds]
    if MemoryKind.DEVICE in kinds and not cuda_devices():
        kinds.remove(MemoryKind.DEVICE)
    return kinds


def usable_kind(harness: Harness, caps: Capabilities) -> MemoryKind:
    """HOST if declared, else DEVICE when a CUDA device is present; else skip."""
    kinds = usable_kinds(harness, caps)
    if not kinds:
        pytest.skip("backend declares only DEVICE memory and no CUDA device is present")
    return kinds[0]


def open_ends(harness: Harness, *, timeout_s: float = LONG_TIMEOUT_S, max_in_flight: int | None = None,
              faults: FaultPlan | None = None, hold: bool = False) -> Ends:
    """``harness.open(...)``; what the harness cannot provide here skips the test with the
    harness's reason (:class:`Unavailable`)."""
    try:
        return harness.open(timeout_s=timeout_s, max_in_flight=max_in_flight, faults=faults, hold=hold)
    except Unavailable as exc:
        pytest.skip(f"harness cannot provide it: {exc}")


@contextlib.contextmanager
def open_exchange(harness: Harness, *, timeout_s: float = LONG_TIMEOUT_S, max_in_flight: int | None = None,
                  faults: FaultPlan | None = None, hold: bool = False) -> Iterator[Exchange]:
    """A fresh pair of ends from the harness, as an :class:`Exchange`; closed afterwards. What
    the harness cannot provide skips the test with the harness's reason. With ``hold``, the
    other end must be holdable: a store through :attr:`Ends.hold`, a serving peer by the suite
    not answering its pulls."""
    ends = open_ends(harness, timeout_s=timeout_s, max_in_flight=max_in_flight, faults=faults, hold=hold)
    exchange = Exchange(ends, profiles.active().patience_s, harness.quiesce_grace_s)
    if hold and ends.hold is None and not exchange.serves_pulls:
        harness.close(ends)
        pytest.skip("harness cannot hold the backend's other end")
    try:
        yield exchange
    except Unavailable as exc:
        pytest.skip(f"harness cannot provide it: {exc}")
    finally:
        harness.close(ends)
