"""What the mutants of this folder are built on, and the helpers mutants of several rule
families share. :class:`Mutant` forwards everything to a correct backend (the memory backend, or
for the serving protocol the reference peer through :class:`PeerMutant`), :class:`Wrapped` is its
attempt, and :class:`MutantHarness` makes one a harness the suite can be pointed at;
:class:`StoreMutantHarness` and :class:`PeerMutantHarness` do the same for a subclass of a
reference backend (:mod:`kvwire.testing.reference`) that changes the backend's own code.

The mutants live in one file per rule family beside this one (``memory.py``, ``view.py``,
``hints.py``, ``submit.py``, ``attempt.py``, ``wake.py``, ``lifecycle.py``, ``pulls.py``,
``lookup.py``, ``offers.py``, ``blocks.py``: the families of ``kvwire.testing.suite``'s files),
each registered once in ``tests/conformance/mutant_table.py``. They import this module as ``kit``
(the folder is on ``sys.path`` while a harness file loads). The harnesses here break nothing and the
suite must pass them: :data:`faithful` and :data:`faithful_peer` (the wrappers),
:data:`reference_store` and :data:`reference_peer` (the unbroken reference backends), and
:data:`reference_device_store`: :class:`DeviceReferenceStore`, the reference store that also
declares and moves DEVICE memory where a CUDA device is present (the backend M1.3's mutant breaks;
without a CUDA device it is the reference store, so the runners skip it and its mutants there:
:attr:`DeviceStoreHarness.needs_cuda`)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kvwire_memory.harness import MemoryHarness

from kvwire.contract import (
    Attempt,
    Backend,
    Capabilities,
    Cause,
    Hint,
    InvalidSubmission,
    MemoryKind,
    Outcome,
    PullRequest,
    RegionTable,
    SlotRegion,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.contract.lookup import LOOKUP, Lookup
from kvwire.contract.regions import Located
from kvwire.contract.serving import OffersPulls, ServesPulls
from kvwire.testing.harness import Ends, FaultPlan, Harness, close_spawned
from kvwire.testing.reference.harness import ControlledStore, ReferencePeerHarness, ReferenceStoreHarness
from kvwire.testing.reference.harness import ReferencePeerHarness as LoopbackHarness
from kvwire.testing.reference.peer import Fabric, ReferencePeer
from kvwire.testing.reference.store import ReferenceStoreBackend
from kvwire.testing.regions import cuda_devices


class Wrapped(Attempt):
    """An attempt that forwards everything to the correct one."""

    def __init__(self, inner: Attempt, view: View, op: str, backend: Mutant) -> None:
        self.inner = inner
        self.view = view
        self.op = op
        self.backend = backend

    def poll(self) -> Outcome | None:
        return self.inner.poll()

    def quiesced(self) -> bool:
        return self.inner.quiesced()

    def cancel(self) -> None:
        self.inner.cancel()


class Mutant(Backend, Lookup):
    """A backend that forwards everything to a correct one; subclasses break one rule. It
    offers ``lookup`` (L1) by forwarding it, used only where the inner backend declares it."""

    attempt_type: type[Wrapped] = Wrapped

    def __init__(self, inner: Backend, harness: MutantHarness) -> None:
        self.inner = inner
        self.harness = harness

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        return self.inner.register_regions(regions)

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self.submit("fetch", view, hint, wake)

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self.submit("publish", view, hint, wake)

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        if not isinstance(self.inner, Lookup) or LOOKUP not in self.inner.capabilities().protocols:
            raise InvalidSubmission("this backend does not declare the lookup protocol")  # B4.7
        return self.inner.lookup(groups, names, hint, timeout_s)

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self.remember(self.make(op, view, hint, wake))

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        call = self.inner.fetch if op == "fetch" else self.inner.publish
        return self.attempt_type(call(view, hint, wake), view, op, self)

    def shutdown(self) -> frozenset[Attempt]:
        pending = self.inner.shutdown()
        wrapped = {id(a.inner): a for a in self._attempts()}
        return frozenset(wrapped.get(id(a), a) for a in pending)

    def close(self) -> None:
        self.inner.close()

    # Attempts are remembered so shutdown() can answer with the wrapped ones.
    def _attempts(self) -> list[Wrapped]:
        return self.__dict__.setdefault("_made", [])

    def remember(self, attempt: Wrapped) -> Wrapped:
        self._attempts().append(attempt)
        return attempt


class MutantHarness(Harness):
    """A correct backend's harness (the memory backend's unless ``inner`` is given), with every
    end wrapped in ``mutant``."""

    def __init__(self, name: str, mutant: type[Mutant], *, inner_timeout_s: float | None = None,
                 setup: Callable[[], Callable[[], None]] | None = None, inner: Harness | None = None) -> None:
        self.name = name
        self.mutant = mutant
        self.inner = inner if inner is not None else MemoryHarness()
        self.quiesce_grace_s = self.inner.quiesce_grace_s
        self.lookup_faults = self.inner.lookup_faults
        self.inner_timeout_s = inner_timeout_s
        self.setup = setup

    def capabilities(self) -> Capabilities:
        return self.mutant.declare(self.inner.capabilities())  # type: ignore[attr-defined]

    def distribution(self) -> str:
        return "tests/conformance/mutants (a deliberately broken backend)"

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        undo = self.setup() if self.setup is not None else None
        inner = self.inner.open(timeout_s=self.inner_timeout_s or timeout_s, max_in_flight=max_in_flight,
                                faults=faults, hold=hold)
        source = self.mutant(inner.source, self)
        sink = self.mutant(inner.sink, self)
        extra: dict[str, Any] = {"inner": inner, "undo": undo}
        if "namespace" in inner.extra:  # the store namespace the suite reads (H1.7)
            extra["namespace"] = inner.extra["namespace"]
        return Ends(source, sink, inner.publish_hint, inner.fetch_hint, inner.hold, extra=extra)

    def close(self, ends: Ends) -> None:
        try:
            self.inner.close(ends.extra["inner"])  # type: ignore[arg-type]
        finally:
            undo = ends.extra.get("undo")
            if callable(undo):
                undo()


def _declare_as_is(caps: Capabilities) -> Capabilities:
    return caps


Mutant.declare = staticmethod(_declare_as_is)  # type: ignore[attr-defined]


def _outcome_like(out: Outcome, masks: Sequence[np.ndarray]) -> Outcome:
    return Outcome(out.status, tuple(masks), out.reason, out.by_peer, out.cause)


class _Padded(Wrapped):
    """Answers the inner outcome of a shortened view with masks of the full view (the rows left
    out are false bits)."""

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        masks = list(self.view.row_masks())
        for mask, got in zip(masks, out.masks, strict=True):
            mask[: got.size] = got
        return _outcome_like(out, masks)


class PeerMutant(Mutant, ServesPulls, OffersPulls):
    """A serving peer that forwards everything, the serving protocol and standing offers (O1)
    included."""

    @property
    def serving(self) -> ServesPulls:
        assert isinstance(self.inner, ServesPulls)
        return self.inner

    def address(self) -> bytes:
        return self.serving.address()

    def serve(self, wake: WakeFn) -> None:
        self.serving.serve(wake)

    def incoming(self) -> tuple[PullRequest, ...]:
        return self.serving.incoming()

    def decline(self, request: PullRequest, reason: str) -> None:
        self.serving.decline(request, reason)

    def offer(self, view: View, wake: WakeFn, timeout_s: float | None = None) -> Attempt:
        if not isinstance(self.inner, OffersPulls):
            raise InvalidSubmission("this backend does not declare the offer-pulls protocol")  # B4.7
        return self.remember(self.attempt_type(self.inner.offer(view, wake, timeout_s), view, "offer", self))


# -- S3.9-S3.11: a queue bound kept by the wrapper --------------------------------------------------

class _Bounded(Mutant):
    """Keeps a queue bound of its own, :attr:`BOUND`, over an inner backend whose queue is wider
    (see :class:`_WideInner`), so the wrapper's accounting is what the suite tests."""

    BOUND = 3

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:  # type: ignore[override]
        return dataclasses.replace(caps, max_in_flight=_Bounded.BOUND)

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())

    def live(self, attempt: Wrapped) -> bool:
        """Whether ``attempt`` holds a queue slot: it has not both concluded and quiesced (S3.9)."""
        return not (attempt.inner.poll() is not None and attempt.inner.quiesced())

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if sum(1 for a in self._attempts() if self.live(a)) >= self.BOUND:
            raise SubmissionRejected(f"queue full ({self.BOUND} in flight); submit again once one has concluded "
                                     "and quiesced")
        return super().submit(op, view, hint, wake)


class _WideInner(MutantHarness):
    """The inner memory backend gets its default queue (64), whatever bound the suite asks for:
    with the inner held to the same bound, the inner's correct accounting would hide the
    wrapper's."""

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        return super().open(timeout_s=timeout_s, max_in_flight=None, faults=faults, hold=hold)


class _PeerTracking(PeerMutant):
    def incoming(self) -> tuple[PullRequest, ...]:
        got = self.serving.incoming()
        reqs = self.__dict__.setdefault("requests", {})
        for request in got:
            reqs[request.ticket.to_bytes()] = request
        return got

    def request_of(self, hint: Hint) -> PullRequest | None:
        requests: dict[bytes, PullRequest] = self.__dict__.get("requests", {})
        return requests.get(hint.to_bytes()) if isinstance(hint, Hint) else None


class _Done(Attempt):
    """Concluded delivered at once: every row held (``held``), or none; woken from a timer thread."""

    def __init__(self, view: View, wake: WakeFn, held: bool = True) -> None:
        self.outcome = Outcome.delivered([np.full(g.rows, held, dtype=bool) for g in view.groups])
        threading.Timer(0.01, wake).start()

    def poll(self) -> Outcome | None:
        return self.outcome

    def quiesced(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


class _Down(Mutant):
    """Remembers that ``shutdown()`` was called, for mutants that change only the instance's
    working life (a refusal after shutdown stays the inner backend's)."""

    @property
    def down(self) -> bool:
        return bool(self.__dict__.get("down"))

    def shutdown(self) -> frozenset[Attempt]:
        self.__dict__["down"] = True
        return super().shutdown()


# -- N2.7 / A10.10: a pull before serve() fails, but not as declined ----------------------------

class _Recaused(Wrapped):
    """A failed fetch whose cause was ``old`` is handed over with cause ``new`` (the same
    outcome on every poll)."""

    old: Cause = Cause.DECLINED
    new: Cause = Cause.PEER_GONE

    def poll(self) -> Outcome | None:
        kept = self.__dict__.get("kept")
        if kept is not None:
            return kept
        out = self.inner.poll()
        if out is not None and out.is_failed and out.cause is self.old and self.matches(out):
            out = Outcome(out.status, out.masks, out.reason, out.by_peer, self.new)
        if out is not None:
            self.__dict__["kept"] = out
        return out

    def matches(self, out: Outcome) -> bool:
        return True


class HoleHarness(MutantHarness):
    """A :class:`MutantHarness` that also hands the suite the inner harness's optional hooks:
    ``fill``, ``another_sink`` (its backends wrapped in the mutant too) and
    ``extra["pending_pulls"]``."""

    def open(self, *, timeout_s: float, max_in_flight: int | None = None, faults: FaultPlan | None = None,
             hold: bool = False) -> Ends:
        ends = super().open(timeout_s=timeout_s, max_in_flight=max_in_flight, faults=faults, hold=hold)
        inner: Ends = ends.extra["inner"]  # type: ignore[assignment]
        ends.fill = inner.fill
        ends.other_process = inner.other_process
        make = inner.another_sink
        if make is not None:
            ends.another_sink = lambda: self.mutant(make(), self)
        if "pending_pulls" in inner.extra:
            ends.extra["pending_pulls"] = inner.extra["pending_pulls"]
        return ends

    def close(self, ends: Ends) -> None:
        try:
            close_spawned(ends, max(10.0, self.quiesce_grace_s))
        finally:
            super().close(ends)


def _peer_harness(peer: type[ReferencePeer], **extra: object) -> LoopbackHarness:
    """The reference peer's harness, building ``peer`` instead (with ``extra`` in its ends)."""

    class Harness(LoopbackHarness):
        def make_peer(self, fabric: Fabric, name: str, *, timeout_s: float, max_in_flight: int) -> ReferencePeer:
            return peer(fabric, name, timeout_s=timeout_s, max_in_flight=max_in_flight)

        def open(self, **kwargs: Any) -> Ends:
            ends = super().open(**kwargs)
            ends.extra.update(extra)
            return ends

    return Harness()


class StoreMutantHarness(ReferenceStoreHarness):
    def __init__(self, name: str, backend: type[ReferenceStoreBackend], **options: Any) -> None:
        self.name = name
        self.backend = backend
        self.options = options

    def make_backend(self, end: ControlledStore, *, timeout_s: float, max_in_flight: int) -> ReferenceStoreBackend:
        return self.backend(end, namespace="default", timeout_s=timeout_s, max_in_flight=max_in_flight,
                            **self.options)

    def distribution(self) -> str:
        return f"tests/conformance/mutants ({self.backend.__name__}, a deliberately broken backend)"


class PeerMutantHarness(ReferencePeerHarness):
    def __init__(self, name: str, peer: type[ReferencePeer]) -> None:
        self.name = name
        self.peer = peer

    def make_peer(self, fabric: Fabric, name: str, *, timeout_s: float, max_in_flight: int) -> ReferencePeer:
        return self.peer(fabric, name, timeout_s=timeout_s, max_in_flight=max_in_flight)

    def distribution(self) -> str:
        return f"tests/conformance/mutants ({self.peer.__name__}, a deliberately broken backend)"


# -- M1.3: a reference store of HOST and DEVICE memory ----------------------------------------------

def with_device_memory(caps: Capabilities) -> Capabilities:
    """``caps`` with DEVICE memory declared too where a CUDA device is present; as they are
    elsewhere. A backend lists only the kinds it can move (M1.3), and without a CUDA device there
    is no DEVICE memory to move: declaring it there would be a promise no test could check."""
    if not cuda_devices():
        return caps
    return dataclasses.replace(caps, memory_kinds=caps.memory_kinds | {MemoryKind.DEVICE})


class _CudaBytes:
    """The bytes of a DEVICE region as an object with ``__cuda_array_interface__`` (one dimension
    of uint8), which ``torch.as_tensor`` takes as a tensor over that memory without copying it."""

    def __init__(self, region: SlotRegion) -> None:
        self.__cuda_array_interface__ = {"shape": (region.nbytes,), "typestr": "|u1",
                                         "data": (region.base, False), "strides": None, "version": 2}


def _byte_index(offsets: np.ndarray, slot_bytes: int, device: Any) -> Any:
    """The index, on ``device``, of every byte of rows starting at ``offsets``, shape
    ``(rows, slot_bytes)``: one gather or scatter moves all the rows."""
    import torch

    index = np.asarray(offsets, dtype=np.int64)[:, None] + np.arange(slot_bytes, dtype=np.int64)
    return torch.as_tensor(index, device=device)


class DeviceReferenceStore(ReferenceStoreBackend):
    """The reference store, declaring DEVICE memory as well as HOST where a CUDA device is present
    (:func:`with_device_memory`), and moving DEVICE rows with torch over the holder's memory itself:
    a publish gathers the rows on the device and copies them to the host for the store, a fetch
    copies the found rows to the device and scatters them into place, then waits for the device.
    HOST rows move as the reference store moves them."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._capabilities = with_device_memory(self._capabilities)
        self._table = RegionTable(self._capabilities.memory_kinds)

    def _read_rows(self, located: Located, slot_bytes: int) -> np.ndarray:
        region = located.region
        if region is None or region.memory_kind is not MemoryKind.DEVICE:
            return super()._read_rows(located, slot_bytes)
        import torch

        memory = torch.as_tensor(_CudaBytes(region))
        rows: np.ndarray = memory[_byte_index(located.offsets, slot_bytes, memory.device)].cpu().numpy()
        return rows

    def _write_rows(self, located: Located, slot_bytes: int, rows: np.ndarray, data: np.ndarray) -> None:
        region = located.region
        if region is None or region.memory_kind is not MemoryKind.DEVICE or rows.size == 0:
            super()._write_rows(located, slot_bytes, rows, data)
            return
        import torch

        memory = torch.as_tensor(_CudaBytes(region))
        values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.uint8)).to(memory.device)
        memory[_byte_index(located.offsets[rows], slot_bytes, memory.device)] = values
        torch.cuda.synchronize(memory.device)  # the bytes are in place before the rows' bits are set


class DeviceStoreHarness(StoreMutantHarness):
    """A harness of :class:`DeviceReferenceStore` or a subclass of it; it declares what the
    backend declares."""

    #: Without a CUDA device the backend is the reference store (HOST memory only): a run shows
    #: nothing :data:`reference_store` does not, and a mutant of its DEVICE rows passes. The
    #: runners skip such a harness there, saying so.
    needs_cuda = True

    def capabilities(self) -> Capabilities:
        return with_device_memory(super().capabilities())


faithful = MutantHarness("faithful-wrapper", Mutant)
faithful_peer = MutantHarness("faithful-peer-wrapper", PeerMutant, inner=LoopbackHarness())
reference_store = StoreMutantHarness("reference-store-unbroken", ReferenceStoreBackend)
reference_peer = PeerMutantHarness("reference-peer-unbroken", ReferencePeer)
reference_device_store = DeviceStoreHarness("reference-device-store-unbroken", DeviceReferenceStore)
