"""Deliberately broken backends of the seventh probing round, on values at the edges of what the
contract allows: a group id the wire cannot carry (V1.8), a view naming another memory kind over
registered memory (M1.4), rows seen through a sub-span after their registration closed (M4.5), a
STATE row under another token range (V1.6), a publish whose groups share a slot (V4.4), one queue
for the instances on a store (B1.5), and peer hints without an address or with credentials that
are no bytes (H1.5). Each wraps the reference peer (``loopback_peer.py``) or the memory backend,
as ``mutants.py`` does, and breaks one clause. ``test_mutants.py`` reads
its entries in ``mutant_table.py`` and checks that the suite fails each one on a test named after the rule it breaks.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants_round7.py:NAME``."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np
from loopback_peer import LoopbackHarness  # beside this file; on sys.path when loaded as a harness
from mutants import Mutant, MutantHarness, PeerMutant, Wrapped
from mutants_capacity import _Bounded, _WideInner

from kvwire.contract import (
    Attempt,
    CacheKind,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    SlotRegion,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.testing.harness import Ends, FaultPlan

# -- V1.8: a group id the wire cannot carry is taken, then fails ---------------------------------

class _FailedAtOnce(Attempt):
    """Concluded failed at once (nothing moved), woken from a timer thread."""

    def __init__(self, view: View, wake: WakeFn, reason: str) -> None:
        self.outcome = Outcome.failed(reason, view.row_masks(), cause=Cause.FAULT)
        threading.Timer(0.01, wake).start()

    def poll(self) -> Outcome | None:
        return self.outcome

    def quiesced(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


class LargeGroupIdsFailLater(PeerMutant):
    """V1.8: a fetch naming a group id of 2**32 or more (more than its wire carries) is taken and
    fails at once with ``FAULT``, where the contract refuses it when submitted."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(view, View) and any(g.group_id >= 1 << 32 for g in view.groups):
            return _FailedAtOnce(view, wake, "a group id does not fit the wire's 32 bits")
        return super().fetch(view, hint, wake)


large_group_ids_fail_later = MutantHarness("large-group-ids-fail-later", LargeGroupIdsFailLater,
                                           inner=LoopbackHarness())



class _Registers(Mutant):
    """Keeps the regions it registered, open or closed, to judge views as a broken backend does."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        registration = self.inner.register_regions(regions)
        self.__dict__.setdefault("registered", []).extend(regions)
        return registration

    def holding(self, region: SlotRegion) -> SlotRegion | None:
        """The registered region whose addresses hold ``region``'s, whatever its memory kind."""
        for r in self.__dict__.get("registered", []):
            if r.base <= region.base and region.base + region.slot_bytes * region.slot_count <= r.base + r.slot_bytes * r.slot_count:
                return r
        return None


# -- M1.4 / M4.1: rows recognized by address, whatever memory kind the view names ------------------

class DeviceLabelOverHostMemory(_Registers):
    """M1.4 / M4.1: rows are recognized by their addresses alone: a view whose region says DEVICE
    memory (device 0), which the backend does not declare, over addresses of a registered HOST
    region is taken and moved as the host memory it lies in."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if isinstance(view, View) and any(g.region.memory_kind is not MemoryKind.HOST for g in view.groups):
            groups = []
            for g in view.groups:
                r = g.region
                if r.memory_kind is not MemoryKind.HOST and self.holding(r) is not None:
                    r = SlotRegion(r.region_id, r.base, r.slot_bytes, r.slot_count, MemoryKind.HOST, None)
                groups.append(LayerGroupRows(g.group_id, g.kind, r, g.slots, g.tokens, g.names))
            attempt = super().make(op, View(tuple(groups)), hint, wake)
            attempt.view = view
            return attempt
        return super().make(op, view, hint, wake)


# -- M4.5: a registration used through a sub-span view is never unregistered ------------------------

class _Pinned(Registration):
    def __init__(self, inner: Registration, backend: SubSpanPinsRegistration) -> None:
        self.inner = inner
        self.backend = backend

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self.inner.regions

    def close(self) -> None:
        if not any(r in self.backend.__dict__.get("pinned", set()) for r in self.inner.regions):
            self.inner.close()


class SubSpanPinsRegistration(_Registers):
    """M4.5 / M3.7: a registered region seen through a view of another ``SlotRegion`` (a sub-span)
    gets a reference that is never dropped, so closing its registration leaves its rows
    recognized."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        return _Pinned(super().register_regions(regions), self)

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if isinstance(view, View):
            for g in view.groups:
                held = self.holding(g.region)
                if held is not None and held != g.region:
                    self.__dict__.setdefault("pinned", set()).add(held)
        return super().make(op, view, hint, wake)


# -- V1.6: a STATE row keyed by its checkpoint as well as its name -----------------------------------

def _checkpointed(view: View) -> View:
    groups = []
    for g in view.groups:
        names = g.names
        if g.kind is CacheKind.STATE and names is not None and names.shape[0]:
            names = names.copy()
            stamp = np.frombuffer(int(g.tokens.end).to_bytes(8, "little"), dtype=np.uint8)
            width = names.shape[1]
            names[:, -min(width, 8):] ^= stamp[:min(width, 8)][::-1]
        groups.append(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens, names))
    return View(tuple(groups))


class StateRowsKeyedByCheckpoint(Mutant):
    """V1.6: a STATE row is stored and found under its name and its token end (the exact checkpoint
    it stands for, V1.4), so a fetch of the same name under another token range misses."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if isinstance(view, View):
            attempt = super().make(op, _checkpointed(view), hint, wake)
            attempt.view = view
            return attempt
        return super().make(op, view, hint, wake)


# -- B1.5: one queue bound for every instance on one store -------------------------------------------

class QueueSharedOnAStore(_Bounded):
    """B1.5: the queue bound is kept by the store connection the instances on one store share, so
    attempts in flight on one instance count towards another's ``max_in_flight``."""


class _SharedQueueHarness(_WideInner):
    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        ends = super().open(timeout_s=timeout_s, max_in_flight=max_in_flight, faults=faults, hold=hold)
        shared: list[Wrapped] = []
        for backend in ends.backends:
            backend.__dict__["_made"] = shared
        return ends

    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities(), max_in_flight=_Bounded.BOUND)


# -- V4.4: a publish whose rows overlap across groups is refused --------------------------------------

class PublishOverlapAcrossGroupsRefused(Mutant):
    """V4.4: a publish is checked for overlapping rows across groups as a fetch is (only repeats
    within one group are let through), so a publish of two groups over one slot is refused."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op == "publish" and isinstance(view, View):
            seen: dict[int, int] = {}
            for gi, g in enumerate(view.groups):
                for address in g.addresses().tolist():
                    if seen.setdefault(int(address), gi) != gi:
                        raise InvalidSubmission(f"publish rows of two groups overlap at {address:#x}")
        return super().make(op, view, hint, wake)


# -- H1.5 / H1.11: a peer hint without an address goes to the last peer -----------------------------

class MissingAddressMeansLastPeer(PeerMutant):
    """H1.5 / H1.11: a peer hint without an ``address`` pulls from the peer this instance pulled
    from last (a cached connection), instead of being refused."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(hint, Hint) and hint.kind == "peer":
            fields = dict(hint.fields)
            last = self.__dict__.get("last_address")
            if "address" not in fields and last is not None:
                fields["address"] = last
                hint = Hint.of("peer", timeout_s=hint.timeout_s, **fields)  # type: ignore[arg-type]
            attempt = super().fetch(view, hint, wake)
            self.__dict__["last_address"] = hint.get("address")
            return attempt
        return super().fetch(view, hint, wake)


# -- H1.5 / H1.12: credentials that are no bytes are encoded ------------------------------------------

class StrCredentialsEncoded(PeerMutant):
    """H1.5 / H1.12: a peer hint whose ``credentials`` are a ``str`` (or an int) is taken, the
    value sent as its UTF-8 (or decimal) bytes, instead of being refused."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(hint, Hint) and hint.kind == "peer":
            credentials = hint.get("credentials")
            if credentials is not None and not isinstance(credentials, bytes):
                fields = dict(hint.fields)
                fields["credentials"] = str(credentials).encode()
                hint = Hint.of("peer", timeout_s=hint.timeout_s, **fields)  # type: ignore[arg-type]
        return super().fetch(view, hint, wake)


device_label_over_host_memory = MutantHarness("device-label-over-host-memory", DeviceLabelOverHostMemory)
sub_span_pins_registration = MutantHarness("sub-span-pins-registration", SubSpanPinsRegistration)
state_rows_keyed_by_checkpoint = MutantHarness("state-rows-keyed-by-checkpoint", StateRowsKeyedByCheckpoint)
queue_shared_on_a_store = _SharedQueueHarness("queue-shared-on-a-store", QueueSharedOnAStore)
publish_overlap_across_groups_refused = MutantHarness("publish-overlap-across-groups-refused",
                                                      PublishOverlapAcrossGroupsRefused)
missing_address_means_last_peer = MutantHarness("missing-address-means-last-peer", MissingAddressMeansLastPeer,
                                                inner=LoopbackHarness())
str_credentials_encoded = MutantHarness("str-credentials-encoded", StrCredentialsEncoded, inner=LoopbackHarness())

