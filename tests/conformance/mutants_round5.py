"""Deliberately broken backends of the fifth probing round: each wraps the memory backend, or for
the serving protocol the reference peer (``loopback_peer.py``), as ``mutants.py`` does, and breaks
one clause the earlier rounds touched least: names read as text and views without names (N1.3,
N1.5), rows described in another slot size (M4.2), a shutdown set that lists finished attempts
(B3.3), a run of publishes that loses a row (S1.3), and the serving end's address, ``incoming()``,
serve wakes and misfit answers (N2.2, N2.5, W1.4, W1.7, N2.12). ``test_mutants.py`` reads
its entries in ``mutant_table.py`` and checks that the suite fails each one on a test named after the rule it breaks.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants_round5.py:NAME``."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Sequence

import numpy as np
from loopback_peer import LoopbackHarness  # beside this file; on sys.path when loaded as a harness
from mutants import Mutant, MutantHarness, PeerMutant, Wrapped, _outcome_like
from mutants_round4 import _Done, _PeerTracking

from kvwire.contract import (
    Attempt,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Outcome,
    SlotRegion,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.contract.serving import PullRequest
from kvwire.testing.harness import Ends, FaultPlan


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


# -- M4.2: rows recognized only in the slot size they were registered with -----------------------

class RegisteredSlotSizeOnly(Mutant):
    """M4.2: a view whose region describes registered memory in another slot size is refused, as
    if recognition compared slot sizes and not where the bytes lie."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        registration = self.inner.register_regions(regions)
        self.__dict__.setdefault("registered", []).extend(regions)
        return registration

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        for g in view.groups:
            for r in self.__dict__.get("registered", []):
                inside = r.base <= g.region.base < r.base + r.slot_bytes * r.slot_count
                if inside and g.region.slot_bytes != r.slot_bytes:
                    raise InvalidSubmission(f"group {g.group_id} describes region {r.region_id} in slots of "
                                            f"{g.region.slot_bytes} bytes; it was registered with {r.slot_bytes}")
        return super().make(op, view, hint, wake)


# -- B3.3: the first shutdown() lists every attempt ever made -----------------------------------

class ShutdownListsQuiescedOnce(Mutant):
    """B3.3: the first ``shutdown()`` returns every attempt the instance ever made, those that
    concluded and quiesced long before included; later calls are right."""

    def shutdown(self) -> frozenset[Attempt]:
        pending = super().shutdown()
        if self.__dict__.get("listed"):
            return pending
        self.__dict__["listed"] = True
        return pending | frozenset(self._attempts())


# -- S1.3: the fifth publish of an instance loses its last row ------------------------------------

class _ClaimsDropped(Wrapped):
    """Hands the outcome of the view less one row, with that row's bit set as if it was stored."""

    dropped: int = 0

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        masks = [np.asarray(m) for m in out.masks]
        masks[self.dropped] = np.append(masks[self.dropped], out.is_delivered)
        return _outcome_like(out, masks)


class FifthPublishDropsItsLastRow(Mutant):
    """S1.3: the fifth publish on an instance stores all its rows but the last, and marks that one
    held too (a batch counter that wraps, losing the tail of one batch)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        count = self.__dict__["publishes"] = self.__dict__.get("publishes", 0) + (op == "publish")
        rows = [i for i, g in enumerate(view.groups) if g.rows]
        if op != "publish" or count != 5 or not rows:
            return super().make(op, view, hint, wake)
        gi = rows[-1]
        g = view.groups[gi]
        short = LayerGroupRows(g.group_id, g.kind, g.region, g.slots[:-1], g.tokens,
                               None if g.names is None else g.names[:-1])
        attempt = _ClaimsDropped(self.inner.publish(View(view.groups[:gi] + (short,) + view.groups[gi + 1:]), hint,
                                                    wake), view, op, self)
        attempt.dropped = gi
        return attempt


# -- serving mutants (reference peer) -------------------------------------------------------------

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


class ServeWakeOnlyWhenDrained(PeerMutant):
    """W1.4: the serve wake is called only for a pull that finds nothing untaken in
    ``incoming()`` (edge-triggered): a pull arriving beside an untaken one gets no wake."""

    def serve(self, wake: WakeFn) -> None:
        def on_request() -> None:
            if not self.__dict__.get("untaken"):
                self.__dict__["untaken"] = True
                wake()

        self.serving.serve(on_request)

    def incoming(self) -> tuple[PullRequest, ...]:
        self.__dict__["untaken"] = False
        return self.serving.incoming()


class RaisingServeWakeStopsServing(PeerMutant):
    """W1.7: once the serve wake raised, it is never called again (the thread that called it
    gave up on it)."""

    def serve(self, wake: WakeFn) -> None:
        def guarded() -> None:
            if self.__dict__.get("gave up"):
                return
            try:
                wake()
            except Exception:
                self.__dict__["gave up"] = True

        self.serving.serve(guarded)


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


# -- the harnesses the suite is pointed at --------------------------------------------------------

names_read_as_text = _TextKeyedHarness("names-read-as-text", NamesReadAsText)
unnamed_views_as_misses = MutantHarness("unnamed-views-as-misses", UnnamedViewsAsMisses)
registered_slot_size_only = MutantHarness("registered-slot-size-only", RegisteredSlotSizeOnly)
shutdown_lists_quiesced_once = MutantHarness("shutdown-lists-quiesced-once", ShutdownListsQuiescedOnce)
fifth_publish_drops_its_last_row = MutantHarness("fifth-publish-drops-its-last-row", FifthPublishDropsItsLastRow)
oversized_address = MutantHarness("oversized-address", OversizedAddress, inner=LoopbackHarness())
incoming_waits_for_a_pull = MutantHarness("incoming-waits-for-a-pull", IncomingWaitsForAPull, inner=LoopbackHarness())
serve_wake_only_when_drained = MutantHarness("serve-wake-only-when-drained", ServeWakeOnlyWhenDrained,
                                             inner=LoopbackHarness())
raising_serve_wake_stops_serving = MutantHarness("raising-serve-wake-stops-serving", RaisingServeWakeStopsServing,
                                                 inner=LoopbackHarness())
answer_slot_size_unchecked = MutantHarness("answer-slot-size-unchecked", AnswerSlotSizeUnchecked,
                                           inner=LoopbackHarness())
answer_groups_unchecked = MutantHarness("answer-groups-unchecked", AnswerGroupsUnchecked, inner=LoopbackHarness())
