"""Mutants that each break one names and serve-pulls clause (N1-N2: row names, and pulls served by a
serving peer). Every harness below is registered once, in ``tests/conformance/mutant_table.py``,
with the clause it breaks and the ``-k`` selection of the suite's tests that must catch it. A mutant
either wraps a correct backend through :mod:`kit` (the memory backend, or the reference peer for the
serving protocol) and breaks the clause from outside, or subclasses a reference backend
(:mod:`kvwire.testing.reference`) and overrides the one method where the bug lives.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants/pulls.py:NAME``."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kit import (  # beside this file; on sys.path when loaded as a harness
    HoleHarness,
    Mutant,
    MutantHarness,
    PeerMutant,
    PeerMutantHarness,
    StoreMutantHarness,
    Wrapped,
    _Done,
    _outcome_like,
    _peer_harness,
    _PeerTracking,
    _Recaused,
)

from kvwire.contract import (
    Attempt,
    Backend,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Outcome,
    OutcomeStatus,
    PullRequest,
    RegionTable,
    SlotRegion,
    SubmissionRejected,
    TableRegistration,
    View,
    WakeFn,
)
from kvwire.contract.capabilities import OtherEnd
from kvwire.testing.harness import Ends, FaultPlan, Harness, Unavailable
from kvwire.testing.reference.core import (
    Access,
    ReferenceAttempt,
    Runner,
    read_rows,
    reference_capabilities,
    write_rows,
)
from kvwire.testing.reference.harness import ControlledStore
from kvwire.testing.reference.harness import ReferencePeerHarness as LoopbackHarness
from kvwire.testing.reference.peer import Declined, Fabric, Message, PullMessage, ReferencePeer, _Pull
from kvwire.testing.reference.store import ReferenceStoreBackend, StoreReply


class _PartialFails(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "fetch" and out.is_delivered and not all(m.all() for m in out.masks):
            return Outcome.failed("the peer served only part of the blocks", out.masks)
        return out


class PartialPrefixFails(PeerMutant):
    """N2: a pull answered with a partial prefix fails instead of delivering that prefix."""

    attempt_type = _PartialFails


class ServesWithoutWake(PeerMutant):
    """N2/W1: new pull requests show in incoming() but never wake the serving holder."""

    def serve(self, wake: WakeFn) -> None:
        self.serving.serve(lambda: None)


class _DeclineDelivers(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "fetch" and out.is_failed and "declines" in (out.reason or ""):
            return Outcome.delivered(out.masks)
        return out


class DeclineDelivers(PeerMutant):
    """N2: a declined pull passes for a delivered one that missed every block."""

    attempt_type = _DeclineDelivers


class TrimsOversizedAnswer(_PeerTracking):
    """N2.12: an answer with more rows than its pull asked for is cut to the pull's blocks and
    sent, instead of failing."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        if request is not None and any(g.rows > request.blocks for g in view.groups):
            n = request.blocks
            view = View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots[:n], g.tokens,
                                             None if g.names is None else g.names[:n]) for g in view.groups))
        return super().make(op, view, hint, wake)


class AnswerNamesUnchecked(_PeerTracking):
    """N2.12: an answer whose rows are named other than the pull's prefix is sent as the prefix
    (the names of the answer are never compared with the request's)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        if request is not None and all(g.rows <= request.blocks for g in view.groups):
            view = View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens,
                                             request.names[: g.rows] if g.rows else g.names) for g in view.groups))
        return super().make(op, view, hint, wake)


class PullNamesFromFirstGroup(PeerMutant):
    """N2.3: a pull whose groups name different blocks is taken, every group named as the first
    one is (the other groups' names are never compared)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op == "fetch" and view.groups and all(g.names is not None for g in view.groups):
            first = view.groups[0]
            if all(g.rows == first.rows for g in view.groups):
                view = View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens, first.names)
                                  for g in view.groups))
        return super().make(op, view, hint, wake)


def _renamed(view: View, rename: Callable[[np.ndarray], np.ndarray]) -> View:
    """``view`` with each group's names (where it has any) replaced by ``rename(names)``."""
    return View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens,
                                     None if g.names is None else rename(g.names)) for g in view.groups))


# -- N1.3: names keyed by the text they decode to ------------------------------------------------

def _text_key(name: bytes) -> bytes:
    """The key a name is stored under: a digest of its UTF-8 reading (bytes that are no text
    all read as U+FFFD), as wide as the name."""
    digest = hashlib.sha256(name.decode("utf-8", errors="replace").encode()).digest()
    return digest[: len(name)].ljust(len(name), b"\0")


def _text_keys(names: np.ndarray) -> np.ndarray:
    return np.array([np.frombuffer(_text_key(bytes(row)), dtype=np.uint8) for row in names],
                    dtype=np.uint8).reshape(names.shape)


class NamesReadAsText(Mutant):
    """N1.3: names are decoded as UTF-8 text (bytes that are no text replaced) and rows keyed by
    that text, so two names apart only in such a byte name one row."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        attempt = super().make(op, _renamed(view, _text_keys), hint, wake)
        attempt.view = view
        return attempt


class _TextKeyedHarness(MutantHarness):
    """Faults by name meet the rows under the keys the mutant stores them by."""

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        if faults is not None:
            faults = dataclasses.replace(faults, fetch=frozenset(map(_text_key, faults.fetch)),
                                         publish=frozenset(map(_text_key, faults.publish)))
        return super().open(timeout_s=timeout_s, max_in_flight=max_in_flight, faults=faults, hold=hold)


# -- N1.5: a view without names passes for rows nobody holds ------------------------------------

class UnnamedViewsAsMisses(Mutant):
    """N1.5: a content-addressed backend takes a publish or fetch whose groups carry no names and
    concludes it delivered, every row a false bit, instead of refusing it."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        unnamed = view.groups and all(g.names is None for g in view.groups)
        if unnamed and not self.__dict__.get("down") and self.inner.capabilities().content_addressed:
            return _Done(view, wake, held=False)
        return super().submit(op, view, hint, wake)

    def shutdown(self) -> frozenset[Attempt]:
        self.__dict__["down"] = True
        return super().shutdown()


_PADDING = b"\0kvwire-round5" * 300  # 4200 bytes


class OversizedAddress(PeerMutant):
    """N2.2: ``address()`` returns more than 4 KiB (the address followed by padding the peer
    strips again when a pull names it)."""

    def address(self) -> bytes:
        return self.serving.address() + _PADDING

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        address = hint.get("address") if op == "fetch" and isinstance(hint, Hint) else None
        if isinstance(address, bytes) and address.endswith(_PADDING):
            fields = dict(hint.fields)
            fields["address"] = address[: -len(_PADDING)]
            hint = Hint.of(hint.kind, timeout_s=hint.timeout_s, **fields)
        return super().make(op, view, hint, wake)


class IncomingWaitsForAPull(PeerMutant):
    """N2.5: ``incoming()`` with no request waiting waits up to 3 s for one before it answers."""

    def incoming(self) -> tuple[PullRequest, ...]:
        until = time.monotonic() + 3.0
        while True:
            got = self.serving.incoming()
            if got or time.monotonic() >= until:
                return got
            time.sleep(0.01)


class AnswerSlotSizeUnchecked(_PeerTracking):
    """N2.12: an answer whose rows are a multiple of the requested size is sent as rows of the
    requested size (the first part of each), instead of failing."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        if request is not None and len(request.groups) == len(view.groups):
            groups = []
            for g, want in zip(view.groups, request.slot_bytes, strict=True):
                r = g.region
                if r.slot_bytes != want and r.slot_bytes % want == 0:
                    k = r.slot_bytes // want
                    region = SlotRegion(r.region_id + 60_000, r.base, want, r.slot_count * k, r.memory_kind, r.device)
                    g = LayerGroupRows(g.group_id, g.kind, region, g.slots * k, g.tokens, g.names)
                groups.append(g)
            view = View(tuple(groups))
        return super().make(op, view, hint, wake)


class AnswerGroupsUnchecked(_PeerTracking):
    """N2.12: an answer naming other groups than its pull is sent as the pull's groups, in order,
    instead of failing."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        if request is not None and len(request.groups) == len(view.groups):
            view = View(tuple(LayerGroupRows(gid, g.kind, g.region, g.slots, g.tokens, g.names)
                              for gid, g in zip(request.groups, view.groups, strict=True)))
        return super().make(op, view, hint, wake)


class _UnservedAsGone(_Recaused):
    def matches(self, out: Outcome) -> bool:
        return "not serving" in (out.reason or "")


class UnservedPullFailsAsGone(PeerMutant):
    """N2.7 / A10.10: a pull made before the serving end called ``serve()`` fails at once, but
    with cause ``PEER_GONE`` instead of ``DECLINED``."""

    attempt_type = _UnservedAsGone


# -- N2.12: answers with the pull's groups missing or in another order --------------------------

class _NothingSent(Wrapped):
    """The outcome of the answer actually sent, with one all-false mask per group of the view
    the holder gave (nothing of it was sent)."""

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        return _outcome_like(out, [np.zeros(g.rows, dtype=bool) for g in self.view.groups])


class AnswerMissingGroupsAsEmpty(_PeerTracking):
    """N2.12: an answer naming only some of the pull's groups (in order) is sent as an empty
    answer of all of them (the missing groups hold nothing, so the prefix is empty), and
    delivers nothing, instead of failing."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        given = tuple(g.group_id for g in view.groups)
        if request is not None and view.groups and len(given) < len(request.groups) \
                and request.groups[: len(given)] == given:
            g0, r = view.groups[0], view.groups[0].region
            span = r.slot_bytes * r.slot_count
            empty = View(tuple(LayerGroupRows(gid, g0.kind, SlotRegion(r.region_id + 70_000 + i, r.base, size,
                                                                      span // size, r.memory_kind, r.device),
                                             np.zeros(0, np.int64), g0.tokens,
                                             np.zeros((0, request.names.shape[1]), np.uint8))
                              for i, (gid, size) in enumerate(zip(request.groups, request.slot_bytes, strict=True))))
            return _NothingSent(self.inner.publish(empty, hint, wake), view, op, self)
        return super().make(op, view, hint, wake)


class AnswerGroupsInAnyOrder(_PeerTracking):
    """N2.12: an answer holding the pull's groups in another order is put back in the pull's
    order and delivers, instead of failing."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        given = [g.group_id for g in view.groups]
        if request is not None and sorted(given) == sorted(request.groups) and tuple(given) != request.groups:
            by_id = {g.group_id: g for g in view.groups}
            view = View(tuple(by_id[gid] for gid in request.groups))
        return super().make(op, view, hint, wake)


class MisfitKeepsTheTicket(_PeerTracking):
    """N2.12: after an answer that did not fit its pull failed, the ticket is still taken: a
    second answer with it concludes delivered at once (touching nothing), instead of raising
    ``InvalidSubmission`` (the request is used up)."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        key = hint.to_bytes() if isinstance(hint, Hint) else b""
        if op == "publish" and key in self.__dict__.get("misfits", set()):
            return _Done(view, wake)
        attempt = super().submit(op, view, hint, wake)
        # The reference peer fails a misfit answer inside publish(): concluded before it returns.
        concluded = attempt.inner.poll() if op == "publish" and isinstance(attempt, Wrapped) else None
        if concluded is not None and concluded.is_failed:
            self.__dict__.setdefault("misfits", set()).add(key)
        return attempt


# -- N1.3: pull names cut to 32 bytes ----------------------------------------------------------

class PullNamesCutTo32Bytes(PeerMutant):
    """N1.3 / N2.6: a pull request carries only the first 32 bytes of names wider than that (a
    wire format sized for the common widths), so blocks named by 64 bytes are never found."""

    def incoming(self) -> tuple[PullRequest, ...]:
        return tuple(PullRequest(r.ticket, r.groups, r.slot_bytes, r.names[:, :32], r.peer, r.credentials)
                     for r in self.serving.incoming())


# -- N2.7: a pull made before serve() is declined, and still queued ------------------------------------

def _unset() -> None:
    pass


class _QueuesUnservedPulls(ReferencePeer):
    """A reference peer that puts every arriving pull in its queue; before ``serve()`` it also
    declines it, and leaves it there."""

    def _on_request(self, message: PullMessage) -> None:
        with self._runner.lock:
            unserved = self._serving_wake is None
            if unserved:
                self._serving_wake = _unset  # queue it as a served pull is queued
        if not unserved:
            super()._on_request(message)
            return
        try:
            super()._on_request(message)
        finally:
            with self._runner.lock:
                if self._serving_wake is _unset:
                    self._serving_wake = None
        self._send(message.reply_to, Declined(message.ticket, "the peer is not serving pulls"))


class _UnservedQueueHarness(LoopbackHarness):
    def make_peer(self, fabric: Fabric, name: str, *, timeout_s: float, max_in_flight: int) -> ReferencePeer:
        return _QueuesUnservedPulls(fabric, name, timeout_s=timeout_s, max_in_flight=max_in_flight)


class DeclinedBeforeServeStillQueued(PeerMutant):
    """N2.7 / N2.5: a pull made before the serving end called ``serve()`` is declined (the
    requester's fetch fails, cause ``DECLINED``), but stays in the serving end's queue:
    ``incoming()`` hands it over once ``serve()`` is called, ahead of the pulls made since."""


# -- N2.13: an answer whose rows went out ignores the requester's cancel ----------------------------------

class _IgnoresLateCancel(ReferencePeer):
    """Once an answer's rows are out (copied and sent), a ``Cancel`` from its requester is
    ignored: the answer waits for an ``Ack`` that never comes."""

    def _on_cancel(self, message: Message) -> None:
        with self._runner.lock:
            answer = self._answers.get(message.ticket)  # type: ignore[union-attr]
            if answer is not None and answer.access is Access.ENDED:
                return
        super()._on_cancel(message)  # type: ignore[arg-type]


class AnswerIgnoresALateCancel(PeerMutant):
    """N2.13: a requester's cancel that crosses the answer on the wire (the rows already sent) is
    dropped at the serving end: the answer never concludes CANCELLED by the peer; it waits for the
    requester's confirmation until its own deadline."""


# -- N2.4: a serving end counts every pull it ever handed over as waiting --------------------------------

#: The waiting pulls the busy mutant keeps before it declines more.
BUSY_BOUND = 4


class _BusyCountLeaks(ReferencePeer):
    """Declines a pull as busy once ``BUSY_BOUND`` pulls wait for its holder, counting every pull
    it ever handed over (answered or not)."""

    def _to_holder(self, message: PullMessage) -> None:
        with self._runner.lock:
            handed = self.__dict__.setdefault("handed", 0)
            busy = self._serving_wake is not None and handed >= BUSY_BOUND
            if not busy:
                self.__dict__["handed"] = handed + 1
        if busy:
            self._send(message.reply_to, Declined(message.ticket, f"busy: {BUSY_BOUND} pulls wait for the holder"))
            return
        super()._to_holder(message)


class BusyCountNeverDrops(PeerMutant):
    """N2.4: the serving end declines pulls as busy beyond a bound of waiting pulls, but its count
    of waiting pulls never drops when the holder answers them: after the first burst every pull is
    declined, though none waits."""


# -- N1.4 / S1.4 ------------------------------------------------------------------------------------

def _padded(names: np.ndarray) -> np.ndarray:
    out = np.zeros((names.shape[0], 64), dtype=np.uint8)
    out[:, : names.shape[1]] = names
    return out


class PadsNamesTo64NoLookup(Mutant):
    """N1.4 / S1.4: keys names in fixed 64-byte key slots, zero-padded, so a name and the same
    name with trailing zero bytes (a wider name in the same group) are one key; it does not
    declare the lookup protocol, so only fetches can show it."""

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:  # type: ignore[override]
        return dataclasses.replace(caps, protocols=frozenset(p for p in caps.protocols if p != "lookup"))

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        padded = View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens,
                                           None if g.names is None else _padded(g.names)) for g in view.groups))
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        return self.attempt_type(call(padded, hint, wake), view, op, self)

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        raise InvalidSubmission("this backend does not declare the lookup protocol")


# -- N2.13: the answer to a pull the requester cancelled ----------------------------------------

class _AnswerDelivers(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "publish" and out.is_cancelled and out.by_peer:
            cached = self.__dict__.get("out")
            if cached is None:
                cached = self.__dict__["out"] = Outcome.delivered(out.masks)
            return cached
        return out


class CancelledPullAnswerDelivers(PeerMutant):
    """N2.13: the serving end's answer to a pull the requester cancelled concludes DELIVERED (as if
    the requester had taken it), not CANCELLED with by_peer true."""

    attempt_type = _AnswerDelivers


class _AnswerHolderCancelled(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "publish" and out.is_cancelled and out.by_peer:
            cached = self.__dict__.get("out")
            if cached is None:
                cached = self.__dict__["out"] = Outcome.cancelled(out.masks, by_peer=False)
            return cached
        return out


class CancelledPullAnswerNotByPeer(PeerMutant):
    """N2.13 / A5.3: the answer to a pull the requester cancelled concludes CANCELLED with by_peer
    false (cause HOLDER_CANCELLED), as if the serving holder had cancelled it."""

    attempt_type = _AnswerHolderCancelled


class _GroupBlindStore:
    def __init__(self, end: ControlledStore) -> None:
        self.end = end

    def put(self, namespace: str, group_id: int, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        return self.end.put(namespace, 0, names, rows)

    def get(self, namespace: str, group_id: int, names: np.ndarray, slot_bytes: int) -> StoreReply:
        return self.end.get(namespace, 0, names, slot_bytes)


class KeysByNameOnly(ReferenceStoreBackend):
    """N1/A7: rows are keyed by (namespace, name), not (namespace, group, name): groups that name
    a block alike share one object."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(_GroupBlindStore(store), **options)


class CancelNotTold(ReferencePeer):
    """N2: a pull that ends early (cancel, deadline) is forgotten locally but the server is not
    told, so the server's answer (and its holder's pins) waits for its own deadline."""

    def _pull_ended_locked(self, pull: _Pull) -> None:
        self._pulls.pop(pull.ticket, None)


class _GreedyPull(_Pull):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if self.outcome is None and status is OutcomeStatus.DELIVERED:
            for mask in self.moved:
                served = int(mask.sum())
                mask[: served + 1] = True  # "up to and including" the last block served
        return super().conclude_locked(status, cause, reason, by_peer=by_peer)


class MarksBeyondServed(ReferencePeer):
    """N2/A7: the requester marks one block beyond the prefix the server sent."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        pull = super().fetch(view, hint, wake)
        pull.__class__ = _GreedyPull
        return pull


class IncomingRepeats(ReferencePeer):
    """N2: incoming() answers a request again on the next call if it has not been answered yet
    (the list is cleared on answer, not on hand-over)."""

    def incoming(self) -> tuple[PullRequest, ...]:
        with self._runner.lock:
            again = tuple(getattr(self, "_handed", {}).get(t) for t in self._taken if t in getattr(self, "_handed", {}))
        fresh = super().incoming()
        handed = self.__dict__.setdefault("_handed", {})
        for r in fresh:
            handed[int(r.ticket["id"])] = r  # type: ignore[arg-type]
        return tuple(r for r in again if r is not None) + fresh


partial_prefix_fails = MutantHarness("partial-prefix-fails", PartialPrefixFails, inner=LoopbackHarness())
serves_without_wake = MutantHarness("serves-without-wake", ServesWithoutWake, inner=LoopbackHarness())
decline_delivers = MutantHarness("decline-delivers", DeclineDelivers, inner=LoopbackHarness())


answer_ignores_a_late_cancel = HoleHarness("answer-ignores-a-late-cancel", AnswerIgnoresALateCancel,
                                           inner=_peer_harness(_IgnoresLateCancel))


busy_count_never_drops = HoleHarness("busy-count-never-drops", BusyCountNeverDrops,
                                     inner=_peer_harness(_BusyCountLeaks, pending_pulls=BUSY_BOUND))


pull_names_from_first_group = MutantHarness("pull-names-from-first-group", PullNamesFromFirstGroup,
                                            inner=LoopbackHarness())
trims_oversized_answer = MutantHarness("trims-oversized-answer", TrimsOversizedAnswer, inner=LoopbackHarness())
answer_names_unchecked = MutantHarness("answer-names-unchecked", AnswerNamesUnchecked, inner=LoopbackHarness())
names_read_as_text = _TextKeyedHarness("names-read-as-text", NamesReadAsText)
unnamed_views_as_misses = MutantHarness("unnamed-views-as-misses", UnnamedViewsAsMisses)
oversized_address = MutantHarness("oversized-address", OversizedAddress, inner=LoopbackHarness())
incoming_waits_for_a_pull = MutantHarness("incoming-waits-for-a-pull", IncomingWaitsForAPull, inner=LoopbackHarness())


answer_slot_size_unchecked = MutantHarness("answer-slot-size-unchecked", AnswerSlotSizeUnchecked,
                                           inner=LoopbackHarness())
answer_groups_unchecked = MutantHarness("answer-groups-unchecked", AnswerGroupsUnchecked, inner=LoopbackHarness())


unserved_pull_fails_as_gone = MutantHarness("unserved-pull-fails-as-gone", UnservedPullFailsAsGone,
                                            inner=LoopbackHarness())


answer_missing_groups_as_empty = MutantHarness("answer-missing-groups-as-empty", AnswerMissingGroupsAsEmpty,
                                               inner=LoopbackHarness())


answer_groups_in_any_order = MutantHarness("answer-groups-in-any-order", AnswerGroupsInAnyOrder,
                                           inner=LoopbackHarness())
misfit_keeps_the_ticket = MutantHarness("misfit-keeps-the-ticket", MisfitKeepsTheTicket, inner=LoopbackHarness())


pull_names_cut_to_32_bytes = MutantHarness("pull-names-cut-to-32-bytes", PullNamesCutTo32Bytes,
                                           inner=LoopbackHarness())


declined_before_serve_still_queued = MutantHarness("declined-before-serve-still-queued", DeclinedBeforeServeStillQueued,
                                                   inner=_UnservedQueueHarness())
pads_names_to_64_no_lookup = MutantHarness("pads-names-to-64-no-lookup", PadsNamesTo64NoLookup)


cancelled_pull_answer_delivers = MutantHarness("cancelled-pull-answer-delivers", CancelledPullAnswerDelivers,
                                               inner=LoopbackHarness())


cancelled_pull_answer_not_by_peer = MutantHarness("cancelled-pull-answer-not-by-peer", CancelledPullAnswerNotByPeer,
                                                  inner=LoopbackHarness())
keys_by_name_only = StoreMutantHarness("keys-by-name-only", KeysByNameOnly)
cancel_not_told = PeerMutantHarness("cancel-not-told", CancelNotTold)
marks_beyond_served = PeerMutantHarness("marks-beyond-served", MarksBeyondServed)
incoming_repeats = PeerMutantHarness("incoming-repeats", IncomingRepeats)


# -- N1.2: rows keyed by row size and name --------------------------------------------------------

class _RowSizeKeyedStore:
    """Keys objects by (namespace, row size, name): groups of one slot size share a key space."""

    def __init__(self, end: ControlledStore) -> None:
        self.end = end

    def put(self, namespace: str, space: Any, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        return self.end.put(namespace, int(np.asarray(rows).shape[1]), names, rows)

    def get(self, namespace: str, space: Any, names: np.ndarray, row_bytes: int) -> StoreReply:
        return self.end.get(namespace, int(row_bytes), names, row_bytes)


class KeysByRowSizeAndName(ReferenceStoreBackend):
    """N1.2: rows are keyed by (namespace, row size, name) instead of (namespace, group, name): two
    groups of one slot size that name a block alike share one object."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(_RowSizeKeyedStore(store), **options)


# -- N1.7: an answer without names taken as a misfit -----------------------------------------------

class NamelessAnswerAsMisfit(PeerMutant):
    """N1.7: an answer whose groups carry no names is not refused: it is sent on with names of
    zero bytes, so it fails as a misfit and uses up the request."""

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(view, View) and isinstance(hint, Hint) and hint.kind == "ticket" and any(
                g.rows and g.names is None for g in view.groups):
            view = View(tuple(g if g.names is not None or not g.rows else LayerGroupRows(
                g.group_id, g.kind, g.region, g.slots, g.tokens, np.zeros((g.rows, 16), dtype=np.uint8))
                for g in view.groups))
        return super().publish(view, hint, wake)


# -- N2.1: serve-pulls declared, ServesPulls not implemented ---------------------------------------

class ServesPullsUndeclaredByType(Mutant):
    """N2.1: names ``serve-pulls`` in its protocols (it forwards the reference peer's declaration)
    but is no ``ServesPulls``: it has no ``address()``, ``serve()``, ``incoming()`` or
    ``decline()``."""


# -- N2.6: a request that names fewer blocks than the fetch ---------------------------------------

class RequestDropsTheLastBlock(PeerMutant):
    """N2.6: the ``PullRequest`` handed to the holder leaves out the last block the fetch named
    (an off-by-one in the name count it decodes)."""

    def incoming(self) -> tuple[PullRequest, ...]:
        return tuple(dataclasses.replace(r, names=r.names[:-1]) if r.blocks > 1 else r
                     for r in self.serving.incoming())


# -- N2.10: the served prefix marked in the first group only --------------------------------------

class _FirstGroupMarked(Wrapped):
    def poll(self) -> Outcome | None:
        kept = self.__dict__.get("kept")
        if kept is not None:
            return kept
        out = self.inner.poll()
        if out is not None and self.op == "fetch" and out.is_delivered and len(out.masks) > 1:
            out = _outcome_like(out, [out.masks[0], *(np.zeros_like(m) for m in out.masks[1:])])
        if out is not None:
            self.__dict__["kept"] = out
        return out


class MarksServedPrefixInFirstGroup(PeerMutant):
    """N2.10: a requester marks the served prefix true in the first group only; the rows of the
    other groups arrive, but their bits stay false."""

    attempt_type = _FirstGroupMarked


# -- N2.15: a misfit of groups refused instead of failed -------------------------------------------

class RefusesMisfitGroups(_PeerTracking):
    """N2.15: an answer with fewer groups than its request, or its groups in another order, is
    refused with ``InvalidSubmission`` (the request stays open) instead of failing as a misfit."""

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        request = self.request_of(hint)
        if request is not None and isinstance(view, View):
            groups = tuple(g.group_id for g in view.groups)
            if groups != request.groups and set(groups) <= set(request.groups):
                raise InvalidSubmission(f"the answer names groups {list(groups)}, the pull asked for "
                                        f"{list(request.groups)}")
        return super().publish(view, hint, wake)


keys_by_row_size_and_name = StoreMutantHarness("keys-by-row-size-and-name", KeysByRowSizeAndName)
nameless_answer_as_misfit = MutantHarness("nameless-answer-as-misfit", NamelessAnswerAsMisfit, inner=LoopbackHarness())
serves_pulls_undeclared_by_type = MutantHarness("serves-pulls-undeclared-by-type", ServesPullsUndeclaredByType,
                                                inner=LoopbackHarness())
request_drops_the_last_block = MutantHarness("request-drops-the-last-block", RequestDropsTheLastBlock,
                                             inner=LoopbackHarness())
marks_served_prefix_in_first_group = MutantHarness("marks-served-prefix-in-first-group", MarksServedPrefixInFirstGroup,
                                                   inner=LoopbackHarness())
refuses_misfit_groups = MutantHarness("refuses-misfit-groups", RefusesMisfitGroups, inner=LoopbackHarness())


# -- N2.14: a pull that restates the blocks pulled before ------------------------------------------

class RequestRestatesItsEarlierPulls(ReferencePeer):
    """N2.14: a requester asks each server again for the blocks it pulled from it before, ahead of
    the ones its fetch names (so the server's lookup starts at the root of the prefix): the
    request names blocks the requester already holds."""

    def _send(self, to: bytes, message: Message) -> bool:
        if isinstance(message, PullMessage):
            before: dict[bytes, np.ndarray] = self.__dict__.setdefault("pulled", {})
            earlier = before.get(to)
            names = message.names
            if earlier is not None:
                fresh = {n.tobytes() for n in names}
                kept = np.array([n for n in earlier if n.tobytes() not in fresh], dtype=np.uint8).reshape(
                    -1, names.shape[1])
                message = dataclasses.replace(message, names=np.concatenate([kept, names]))
            before[to] = message.names
        return super()._send(to, message)


request_restates_its_earlier_pulls = PeerMutantHarness("request-restates-its-earlier-pulls",
                                                       RequestRestatesItsEarlierPulls)


# -- N1.6: a plain peer, without content addressing, that moves rows by position ----------------------

class _Group:
    """One group of rows a publish copied out for a fetch at another peer."""

    def __init__(self, group_id: int, slot_bytes: int, rows: np.ndarray, names: np.ndarray | None) -> None:
        self.group_id = group_id
        self.slot_bytes = slot_bytes
        self.rows = rows
        self.names = names


class _Push:
    """The rows of one publish, and how to tell it which of them a fetch took (per group id, a
    bool per pushed row)."""

    def __init__(self, groups: tuple[_Group, ...], taken: Callable[[dict[int, np.ndarray]], None]) -> None:
        self.groups = groups
        self.taken = taken


class PlainPeer(Backend):
    """A peer without content addressing and without ``serve-pulls`` (N1.6), on the reference
    backends' core (:mod:`kvwire.testing.reference.core`): a publish (``Hint.of("peer",
    address=...)`` naming the fetching peer) copies its rows out and hands them to that peer; a
    fetch there (its hint naming the publishing peer) meets the oldest such publish, and row ``j``
    of each group lands in row ``j`` of the group of the same id and slot size, whatever the names
    (a group the publish lacks, or rows beyond its count, are misses). The publish delivers,
    marking the rows the fetch took. Not a mutant: the plain peer that mutants of N1.6 change
    (see :func:`plain_peer`)."""

    def __init__(self, fabric: Fabric, name: str, *, timeout_s: float = 30.0, max_in_flight: int = 16) -> None:
        self._fabric = fabric
        self._where = f"plain/{name}".encode()
        self._timeout_s = float(timeout_s)
        caps = reference_capabilities(OtherEnd.PEER, max_in_flight)
        self._capabilities = dataclasses.replace(caps, content_addressed=False, protocols=frozenset())
        self._table = RegionTable(self._capabilities.memory_kinds)
        self._runner = Runner(f"kvwire-plain-peer-{name}", max_in_flight)
        self._waiting: dict[bytes, list[tuple[ReferenceAttempt, tuple[Any, ...]]]] = {}
        self._mailbox: dict[bytes, list[_Push]] = {}
        with fabric.lock:
            fabric.peers[self._where] = self  # type: ignore[assignment]

    @property
    def where(self) -> bytes:
        return self._where

    def capabilities(self) -> Capabilities:
        return self._capabilities

    def register_regions(self, regions: Sequence[SlotRegion]) -> TableRegistration:
        return self._table.register(regions)

    def _other_end(self, op: str, view: View, hint: Hint, wake: WakeFn) -> tuple[bytes, tuple[Any, ...]]:
        """Check a submission (S3: before anything escapes); the other peer's address and where
        the view's rows lie."""
        if self._runner.closed:
            raise SubmissionRejected(f"this peer is shut down; it takes no {op}")
        if not isinstance(view, View):
            raise InvalidSubmission(f"a {op} takes a kvwire View, got {type(view).__name__}")
        if not callable(wake):
            raise InvalidSubmission(f"wake must be callable, got {type(wake).__name__}")
        if not isinstance(hint, Hint) or hint.kind != "peer" or {k for k, _ in hint.fields} != {"address"}:
            raise InvalidSubmission(f"a {op} takes Hint.of('peer', address=BYTES) naming the other peer, got {hint!r}")
        address = hint.get("address")
        if not isinstance(address, bytes) or not address:
            raise InvalidSubmission(f"peer hint field 'address' must be non-empty bytes, got {address!r}")
        located = self._table.locate_view(view)
        if op == "fetch" and view.overlapping_rows() is not None:
            raise InvalidSubmission("fetch rows overlap: two rows locate the same memory (V4)")
        return address, located

    def _deadline(self, hint: Hint) -> float:
        return self._timeout_s if hint.timeout_s is None else hint.timeout_s

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        to, located = self._other_end("publish", view, hint, wake)
        attempt = ReferenceAttempt(self._runner, "publish", view, wake, self._deadline(hint))
        with self._runner.lock:
            self._runner.admit_locked(attempt, "publish")
        self._runner.run(lambda: self._push(attempt, to, located))
        return attempt

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        frm, located = self._other_end("fetch", view, hint, wake)
        attempt = ReferenceAttempt(self._runner, "fetch", view, wake, self._deadline(hint))
        with self._runner.lock:
            self._runner.admit_locked(attempt, "fetch")
            self._waiting.setdefault(frm, []).append((attempt, located))
        self._runner.run(lambda: self._meet(frm))
        return attempt

    def _push(self, attempt: ReferenceAttempt, to: bytes, located: tuple[Any, ...]) -> None:
        """Worker: copy the publish's rows out (it quiesces), and hand them to the peer at ``to``."""
        with self._runner.lock:
            if not attempt.touch_locked():
                return
        groups = tuple(_Group(g.group_id, g.region.slot_bytes, read_rows(at, g.region.slot_bytes), g.names)
                       for g, at in zip(attempt.view.groups, located, strict=True))
        with self._runner.lock:
            attempt.untouch_locked()
            attempt.end_access_locked()

        def taken(rows: dict[int, np.ndarray]) -> None:
            with self._runner.lock:
                for g, mask in zip(attempt.view.groups, attempt.moved, strict=True):
                    if g.group_id in rows:
                        mask[:] = rows[g.group_id]
                attempt.conclude_locked(OutcomeStatus.DELIVERED)

        with self._fabric.lock:
            peer = self._fabric.peers.get(to)
        if not isinstance(peer, PlainPeer) or not peer._receive(self._where, _Push(groups, taken)):
            with self._runner.lock:
                attempt.conclude_locked(OutcomeStatus.FAILED, Cause.PEER_GONE, f"no peer answers at {to!r}")

    def _receive(self, frm: bytes, push: _Push) -> bool:
        with self._runner.lock:
            if self._runner.closed:
                return False
            self._mailbox.setdefault(frm, []).append(push)
        self._runner.run(lambda: self._meet(frm))
        return True

    def _meet(self, frm: bytes) -> None:
        """Worker: pair the oldest waiting fetch from ``frm`` with the oldest rows ``frm`` pushed."""
        while True:
            with self._runner.lock:
                waiting, mailbox = self._waiting.get(frm, []), self._mailbox.get(frm, [])
                while waiting and waiting[0][0].concluded:
                    waiting.pop(0)  # cancelled or expired while it waited: it takes no rows
                if not (waiting and mailbox):
                    return
                attempt, located = waiting.pop(0)
                push = mailbox.pop(0)
                touched = attempt.touch_locked()
            if not touched:
                push.taken({})
                continue
            landed = self._land(attempt, located, push)
            with self._runner.lock:
                attempt.untouch_locked()
                delivered = attempt.outcome is None
                if delivered:
                    for g, mask in zip(attempt.view.groups, attempt.moved, strict=True):
                        mask[:] = landed[g.group_id][0]
                    attempt.conclude_locked(OutcomeStatus.DELIVERED)
            push.taken({gid: took for gid, (_, took) in landed.items()} if delivered else {})

    def _pairs(self, group: LayerGroupRows, pushed: _Group) -> np.ndarray:
        """For each row of the fetch's group, the pushed row it takes (-1: none): by position."""
        count = min(group.rows, pushed.rows.shape[0])
        return np.where(np.arange(group.rows) < count, np.arange(group.rows), -1)

    def _land(self, attempt: ReferenceAttempt, located: tuple[Any, ...],
              push: _Push) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Write the pushed rows into the fetch's rows of the group of the same id and slot size;
        per group id, which fetch rows landed and which pushed rows were taken."""
        pushed = {g.group_id: g for g in push.groups}
        landed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for g, at in zip(attempt.view.groups, located, strict=True):
            hit = np.zeros(g.rows, dtype=bool)
            source = pushed.get(g.group_id)
            took = np.zeros(0 if source is None else source.rows.shape[0], dtype=bool)
            if source is not None and source.slot_bytes == g.region.slot_bytes:
                pairs = self._pairs(g, source)
                hit = pairs >= 0
                write_rows(at, g.region.slot_bytes, np.flatnonzero(hit), source.rows[pairs[hit]])
                took[pairs[hit]] = True
            landed[g.group_id] = (hit, took)
        return landed

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        runner = self._runner
        with runner.lock:
            runner.closed = True
            self._table.close()
            for attempt in list(runner.live):
                attempt.conclude_locked(OutcomeStatus.CANCELLED, Cause.SHUTDOWN, "the peer shut down")
            self._waiting.clear()
            self._mailbox.clear()
            pending = frozenset(a for a in runner.live if not a.quiesced())
        if not pending:
            with self._fabric.lock:
                if self._fabric.peers.get(self._where) is self:  # type: ignore[comparison-overlap]
                    del self._fabric.peers[self._where]
            runner.stop()
        return pending

    def close(self) -> None:
        if not self.shutdown():
            self._runner.stop()


class _PlainPeerHarness(PeerMutantHarness):
    """A pair of plain peers (:class:`PlainPeer` or a mutant of it) on one fabric: the source
    publishes to the sink, the sink fetches from the source."""

    def capabilities(self) -> Capabilities:
        caps = reference_capabilities(OtherEnd.PEER, self.max_in_flight)
        return dataclasses.replace(caps, content_addressed=False, protocols=frozenset())

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        if faults is not None:
            raise Unavailable("a plain reference peer injects no faults")
        fabric = Fabric()
        bound = max_in_flight or self.max_in_flight
        pair = next(_plain_pairs)
        source = self.peer(fabric, f"publishing-{pair}", timeout_s=timeout_s, max_in_flight=bound)
        sink = self.peer(fabric, f"fetching-{pair}", timeout_s=timeout_s, max_in_flight=bound)
        assert isinstance(source, PlainPeer) and isinstance(sink, PlainPeer)
        return Ends(source, sink, Hint.of("peer", address=sink.where), Hint.of("peer", address=source.where),
                    extra={"fabric": fabric})

    def close(self, ends: Ends) -> None:
        Harness.close(self, ends)


_plain_pairs = itertools.count(1)


def plain_peer() -> _PlainPeerHarness:
    """The unbroken plain peer, for ``--kvwire-harness tests/conformance/mutants/pulls.py:plain_peer``
    (a function, so that the mutant modules' listing does not take it for a mutant). It passes the
    N1 tests; it is not a full conformance baseline: a fetch here waits for a publish to meet until
    its deadline, and several suite tests submit a plain peer's fetch (or publish) alone and expect
    it to conclude within the patience."""
    return _PlainPeerHarness("reference-plain-peer", PlainPeer)  # type: ignore[arg-type]


class PlainPeerMatchesNames(PlainPeer):
    """N1: a peer without content addressing that pairs rows by name: row ``j`` of a fetch takes
    the pushed row of the same name (a miss where none has it, and where the fetch or the
    publish names no rows), not row ``j``."""

    def _pairs(self, group: LayerGroupRows, pushed: _Group) -> np.ndarray:
        if group.names is None or pushed.names is None:
            return np.full(group.rows, -1, dtype=np.int64)
        where = {n.tobytes(): j for j, n in enumerate(pushed.names)}
        return np.array([where.get(n.tobytes(), -1) for n in group.names], dtype=np.int64)


plain_peer_matches_names = _PlainPeerHarness("plain-peer-matches-names", PlainPeerMatchesNames)  # type: ignore[arg-type]
