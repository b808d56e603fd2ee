"""The UCX peer backend: request-free pulls between two ends, bytes moved as two-sided UCX tag
messages straight from the serving end's lent rows into the requesting end's lent rows."""

from __future__ import annotations

import atexit
import logging
import math
import numbers
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwire.contract import (
    Attempt,
    Backend,
    Capabilities,
    Hint,
    InvalidSubmission,
    Outcome,
    SlotRegion,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.contract.serving import OffersPulls, PullRequest, ServesPulls
from kvwire_ucx import wire
from kvwire_ucx.address import AddressError, PeerAddress
from kvwire_ucx.affinity import widened
from kvwire_ucx.attempt import AttemptKind, WireStats
from kvwire_ucx.engine import Engine
from kvwire_ucx.nixl import NixlAgent, NixlError
from kvwire_ucx.offers import offered_groups
from kvwire_ucx.regions import RegisteredRegions
from kvwire_ucx.settings import UcxSettings, capabilities_for

__all__ = ["UcxBackend", "capabilities_for"]

log = logging.getLogger(__name__)

class UcxBackend(Backend, ServesPulls, OffersPulls):
    """A peer backend over UCX. ``fetch`` pulls named blocks from the peer whose
    :meth:`address` the hint carries (``Hint.of("peer", address=...)``); ``publish`` only
    answers a pull this end received (its hint is the :class:`PullRequest`'s ticket); ``offer``
    lets the progress thread answer pulls of the offered blocks without the holder (O1).

    Its progress thread starts at construction and stops once :meth:`shutdown` finds nothing in
    flight. The control listener is bound at construction, so :meth:`address` is ready at once."""

    def __init__(self, settings: UcxSettings | None = None, **options: Any) -> None:
        if settings is None:
            settings = UcxSettings.from_options(options)
        elif options:
            raise TypeError("pass either settings or options, not both")
        self._settings = settings
        with widened():  # its threads (and UCX's, NIXL's) must not inherit an engine's one-core pin
            self._engine = Engine(settings)
        self._capabilities = capabilities_for(settings, self._engine.memory_kinds)
        self._regions = RegisteredRegions(self._engine.memory_kinds)
        self._closed = False
        log.debug("kvwire-ucx backend listening on %s", self._engine.address)

    # ------------------------------------------------------------------ Backend

    def capabilities(self) -> Capabilities:
        return self._capabilities

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        registration = self._regions.register(regions)
        if self._regions.device is not None:
            self._engine.use_device(self._regions.device)
        nixl = self._engine.nixl
        if nixl is None or not registration.regions:
            return registration
        # one-sided mode: peers read these regions through NIXL, so NIXL must know them too
        try:
            handle = nixl.register(registration.regions)
        except NixlError as exc:
            registration.close()  # a refused batch leaves nothing registered (M3)
            raise InvalidSubmission(str(exc)) from None
        return _NixlRegistration(registration, nixl, handle)

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        """Pull the view's named blocks from the peer the hint names; every group carries the
        same names in prefix order. Delivered with the served prefix marked; failed on decline,
        deadline or peer loss; cancelled on cancel."""
        if self._closed:
            raise SubmissionRejected("this kvwire-ucx backend is shut down")
        if not isinstance(hint, Hint) or hint.kind != "peer":
            kind = hint.kind if isinstance(hint, Hint) else type(hint).__name__
            raise InvalidSubmission(
                f"kvwire-ucx fetches from a peer: the hint must be Hint.of('peer', address=<the peer's "
                f"address()>), got kind {kind!r}"
            )
        raw = hint.get("address")
        if not isinstance(raw, bytes):
            raise InvalidSubmission("the peer hint carries no 'address' bytes (the serving backend's address())")
        try:
            address = PeerAddress.from_bytes(raw)
        except AddressError as exc:
            raise InvalidSubmission(f"the peer hint's address is unusable: {exc}") from None
        credentials = hint.get("credentials", b"")
        if not isinstance(credentials, bytes) or len(credentials) > wire.MAX_CREDENTIAL_BYTES:
            raise InvalidSubmission(
                f"the peer hint's 'credentials' must be at most {wire.MAX_CREDENTIAL_BYTES} bytes, "
                f"got {type(credentials).__name__} of {len(credentials) if isinstance(credentials, bytes) else '?'}"
            )
        _check_view_shape(view)
        width, names = _pull_names(view)
        if view.overlapping_rows() is not None:
            (ga, ra), (gb, rb) = view.overlapping_rows()  # type: ignore[misc]
            raise InvalidSubmission(
                f"fetch rows overlap: row {ra} of group {ga} and row {rb} of group {gb} locate overlapping memory (V4)"
            )
        groups = self._regions.locate(view, writable=True)
        timeout_s = hint.timeout_s if hint.timeout_s is not None else self._settings.timeout_s
        if view.rows == 0 or not view.groups:
            return self._engine.concluded_at_once(view, AttemptKind.FETCH, wake, Outcome.delivered(view.row_masks()))
        return self._engine.fetch(view, wake, address, timeout_s, groups, width, names, credentials)

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        """Answer a pull: ``hint`` is the request's ticket and the view holds, per requested group
        in order, the rows of the held prefix, named. Rows that do not fit the request (slot
        size, group, count, names) refuse the pull; the attempt then fails saying why. Rows
        without names raise ``InvalidSubmission`` (N1.5) and leave the request open."""
        if self._closed:
            raise SubmissionRejected("this kvwire-ucx backend is shut down")
        if not isinstance(hint, Hint) or hint.kind != "ticket":
            kind = hint.kind if isinstance(hint, Hint) else type(hint).__name__
            raise InvalidSubmission(
                "kvwire-ucx publishes only in answer to a pull: the hint must be the PullRequest's ticket "
                f"(kind 'ticket'), got kind {kind!r}"
            )
        backend, pull_id = hint.get("backend"), hint.get("pull")
        if not isinstance(backend, int) or not isinstance(pull_id, int):
            raise InvalidSubmission("the ticket lacks its 'backend' and 'pull' fields; pass request.ticket unchanged")
        if backend != self._engine.instance:
            raise SubmissionRejected("the ticket belongs to another kvwire-ucx backend; answer it there")
        _check_view_shape(view)
        _require_names(view, "an answer names the blocks it serves (the pull's prefix)")  # N1.5, before the request
        groups = self._regions.locate(view, writable=False)
        return self._engine.publish(view, wake, pull_id, groups, _refusal, hint.timeout_s)

    def shutdown(self) -> frozenset[Attempt]:
        """Stop taking submissions, cancel what is in flight (peers are told), and return the
        attempts that may still touch memory. Waits at most the grace for them; once none is
        left the progress thread is joined."""
        if not self._closed:
            self._closed = True
            self._regions.table.close()
            self._engine.begin_shutdown()
        deadline = time.monotonic() + self._settings.grace_s + 0.5
        self._engine.wait_idle(max(0.0, deadline - time.monotonic()))
        remaining = self._engine.not_quiesced()
        if not remaining:
            self._engine.join(max(0.1, deadline - time.monotonic()))
        return remaining

    def close(self) -> None:
        """Release the listener, the connections and the progress thread. Call it after
        :meth:`shutdown` returned an empty set; idempotent. Closing earlier shuts down first and
        gives up on attempts still in flight after the grace."""
        if not self._closed:
            self._closed = True
            self._regions.table.close()
        self._engine.force_close()
        if not self._engine.join(self._settings.grace_s + 5.0):
            log.warning("kvwire-ucx progress thread on %s did not stop", self._engine.address)

    # ------------------------------------------------------------------ ServesPulls

    def address(self) -> bytes:
        """``PeerAddress`` bytes: this backend's control listener and instance id."""
        return self._engine.address.to_bytes()

    def serve(self, wake: WakeFn) -> None:
        if self._closed:
            raise SubmissionRejected("this kvwire-ucx backend is shut down")
        self._engine.start_serving(wake)

    def incoming(self) -> tuple[PullRequest, ...]:
        return self._engine.take_incoming()

    def decline(self, request: PullRequest, reason: str) -> None:
        if not isinstance(request, PullRequest):
            raise TypeError(f"decline takes a PullRequest, got {type(request).__name__}")
        pull_id = request.ticket.get("pull")
        if request.ticket.get("backend") != self._engine.instance or not isinstance(pull_id, int):
            raise InvalidSubmission("this request belongs to another kvwire-ucx backend")
        if not self._engine.decline(pull_id, wire.clip_reason(reason or "declined")):
            log.debug("decline of pull %d ignored: unknown or already answered", pull_id)

    # ------------------------------------------------------------------ OffersPulls

    def offer(self, view: View, wake: WakeFn, timeout_s: float | None = None) -> Attempt:
        """Answer pulls of the view's named rows on the progress thread until ``timeout_s``
        (else the option ``timeout_s``) passes or the offer is cancelled: a pull that one offer
        covers whole never reaches :meth:`incoming`. Keep the rows pinned and unwritten until the
        attempt quiesces; it concludes delivered at its deadline, cancelled on cancel."""
        if self._closed:
            raise SubmissionRejected("this kvwire-ucx backend is shut down")
        timeout = self._settings.timeout_s if timeout_s is None else _offer_timeout(timeout_s)
        _check_view_shape(view)
        _require_names(view, "an offer names every row it offers (contract O1.2)")  # before the rows are looked at
        located = self._regions.locate(view, writable=False)
        return self._engine.offer(view, wake, offered_groups(view, located), timeout)

    # ------------------------------------------------------------------ extras

    def stats(self) -> WireStats:
        """Counters of the control channel (connections opened, lost, dropped for garbage...)."""
        return self._engine.stats()

    @property
    def settings(self) -> UcxSettings:
        return self._settings

    @property
    def engine(self) -> Engine:
        """The progress thread's engine, for tests and tools: its fault-injection seam
        (``engine.faults``, :mod:`kvwire_ucx.faults`), its NIXL agent, its instance id. A holder
        never needs it."""
        return self._engine

    def __repr__(self) -> str:
        return f"UcxBackend({self._engine.address}, {'shut down' if self._closed else 'open'})"

    # ------------------------------------------------------------------ helpers


class _NixlRegistration(Registration):
    """A registration of the one-sided mode: the region table's, plus the same regions in NIXL.
    Closing it (once; later closes do nothing) removes both."""

    def __init__(self, inner: Registration, nixl: NixlAgent, handle: Any) -> None:
        self._inner = inner
        self._nixl = nixl
        self._handle = handle
        self._lock = threading.Lock()

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self._inner.regions

    def close(self) -> None:
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is None:
            return
        self._inner.close()
        try:
            self._nixl.deregister(handle)
        except Exception as exc:
            log.warning("kvwire-ucx: NIXL could not deregister regions %s: %s",
                        [r.region_id for r in self._inner.regions], exc)


def _check_view_shape(view: View) -> None:
    if not isinstance(view, View):
        raise InvalidSubmission(f"expected a View, got {type(view).__name__}")
    if len(view.groups) > wire.MAX_GROUPS:
        raise InvalidSubmission(f"a view moves at most {wire.MAX_GROUPS} groups here, got {len(view.groups)}")
    for group in view.groups:
        if group.group_id > wire.MAX_GROUP_ID:
            raise InvalidSubmission(
                f"group id {group.group_id} does not fit kvwire-ucx's wire, which carries group ids below 2**32 "
                "(contract V1.8)")


def _offer_timeout(timeout_s: object) -> float:
    """An offer's ``timeout_s`` as seconds: a real number, not a bool, finite and > 0 (O1.2)."""
    problem = f"an offer's timeout_s must be a finite real number > 0 (not a bool), got {timeout_s!r} (contract O1.2)"
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise InvalidSubmission(problem)
    try:
        seconds = float(timeout_s)
    except (OverflowError, ValueError):  # an int beyond any float: no finite number of seconds
        raise InvalidSubmission(problem) from None
    if not 0 < seconds < math.inf:
        raise InvalidSubmission(problem)
    return seconds


def _require_names(view: View, why: str) -> None:
    """``InvalidSubmission`` for a group with rows and no names (N1.5), saying ``why``."""
    for index, group in enumerate(view.groups):
        if group.rows and group.names is None:
            raise InvalidSubmission(f"group {index} (id {group.group_id}) carries no block names; {why}")


def _pull_names(view: View) -> tuple[int, bytes]:
    """The names every group of a fetch view carries (identical across groups)."""
    if not view.groups:
        return 1, b""
    first: np.ndarray | None = None
    for index, group in enumerate(view.groups):
        if group.names is None:
            raise InvalidSubmission(
                f"group {index} (id {group.group_id}) carries no block names; a pull names the blocks it wants"
            )
        if first is None:
            first = group.names
        elif group.names is not first and (group.names.shape != first.shape  # the same array: one view's groups
                                           or not np.array_equal(group.names, first)):
            raise InvalidSubmission(
                f"group {index} (id {group.group_id}) names other blocks than group 0; every group of a pull "
                "carries the same names in prefix order"
            )
    assert first is not None
    if len(first) > wire.MAX_BLOCKS:
        raise InvalidSubmission(f"a pull names at most {wire.MAX_BLOCKS} blocks, got {len(first)}; split it")
    return int(first.shape[1]), first.tobytes()


def _refusal(view: View, request: PullRequest) -> str | None:
    """Why the rows of ``view`` cannot answer ``request``, or ``None`` if they can."""
    if len(view.groups) != len(request.groups):
        return (f"the serving end offered {len(view.groups)} groups for a pull of {len(request.groups)} "
                f"(groups {list(request.groups)})")
    for index, (group, gid, slot) in enumerate(zip(view.groups, request.groups, request.slot_bytes, strict=True)):
        if group.group_id != gid:
            return f"the serving end's group {index} is group {group.group_id}, the pull asked for group {gid}"
        if group.region.slot_bytes != slot:
            return (f"slot size differs in group {gid}: the serving end holds {group.region.slot_bytes}-byte rows, "
                    f"the requester expects {slot}")
        if group.rows > request.blocks:
            return f"the serving end offered {group.rows} rows of group {gid} for a pull of {request.blocks} blocks"
        if group.names is not None and group.rows:
            if group.names.shape[1] != request.names.shape[1] or not np.array_equal(
                group.names, request.names[: group.rows]
            ):
                return f"the serving end's rows of group {gid} carry other names than the pull's prefix"
    return None


atexit.register(Engine.stop_all)
