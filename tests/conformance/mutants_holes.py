"""Deliberately broken backends of issue 39's holes, one per mechanism that single-rule breakers
written outside the project got past the suite with: an answer that ignores a cancel crossing it
(N2.13), a serving end whose count of waiting pulls never drops (N2.4), a stopped answer passed off
as a shorter prefix (A5.10), a poll that waits a little (A1.1), an attempt that says it quiesced
while it waits in the backend's own queue (A2.3), a refused overlapping fetch that keeps a queue
slot (S3.6), a hint deadline kept only when the hint has fields (H1.6), submissions taken while
``shutdown()`` drains (B3.1), region overlap judged in the new region's slot size (M3.5) and a full
store that fails the publish (A5.11). Each wraps the memory backend or the reference peer
(``loopback_peer.py``), as ``mutants.py`` does, and breaks one clause; ``test_mutants.py`` reads
its entries in ``mutant_table.py`` and checks that the suite fails each one on a test named after the rule it breaks.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants_holes.py:NAME``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from kvwire_files import FilesDriver, FileStore
from kvwire_files.harness import FilesHarness
from kvwire_memory import MemoryDriver, named_store
from kvwire_memory.harness import MemoryHarness
from loopback_peer import LoopbackHarness  # beside this file; on sys.path when loaded as a harness
from mutants import Mutant, MutantHarness, PeerMutant, Wrapped
from mutants_round8 import _ShutdownCause

from kvwire.blob import BatchResult, KeyStatus, StoreDriver
from kvwire.contract import (
    Attempt,
    Backend,
    Hint,
    InvalidSubmission,
    Outcome,
    OutcomeStatus,
    SlotRegion,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.testing.harness import Ends, FaultPlan, close_spawned
from kvwire.testing.reference.core import Access, read_rows
from kvwire.testing.reference.peer import Declined, Fabric, Message, PullMessage, ReferencePeer, Rows


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


# -- A5.10: a stopped answer passed off as a shorter prefix -----------------------------------------------

class _StopsShort(ReferencePeer):
    """An answer held on the wire that its holder cancels meanwhile sends only the first block it
    had "already sent", and the requester takes that as the served prefix."""

    def _send_rows(self, answer: Any) -> None:
        with self._runner.lock:
            if not answer.touch_locked():
                return
        data = tuple(read_rows(loc, g.region.slot_bytes) for g, loc in zip(answer.view.groups, answer.located,
                                                                           strict=True))
        with self._runner.lock:
            answer.untouch_locked()
            answer.end_access_locked()
        gate = getattr(self._fabric.link, "gate", None)
        if gate is not None:
            with gate.passage():  # the wire, held by the harness
                pass
        with self._runner.lock:
            stopped = answer.outcome is not None and answer.outcome.status is OutcomeStatus.CANCELLED
        if stopped:
            data = tuple(d[:1] for d in data)
        self._send(answer.reply_to, Rows(answer.ticket, self.address(), data))


class StoppedAnswerAsShortPrefix(PeerMutant):
    """A5.10: an answer its holder stops while it is on the wire reaches the requester cut to the
    blocks already sent, and the requester delivers them as a shorter prefix: rows the serving end
    held throughout are false bits of a delivered fetch."""


# -- A1.1: a poll that waits a little for the outcome ------------------------------------------------------

class _PollWaits(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            time.sleep(0.02)  # "give the outcome a moment to arrive"
            out = self.inner.poll()
        return out


class PollWaitsBriefly(Mutant):
    """A1.1: ``poll()`` of an attempt that has not concluded waits 20 ms for the outcome before it
    answers ``None``: it returns, but a holder polling many attempts stalls."""

    attempt_type = _PollWaits


# -- A2.3: an attempt in the backend's own queue says it quiesced -------------------------------------------

class _Queued(Wrapped):
    """A submission the mutant keeps in its own queue until the one before it is done."""

    def __init__(self, op: str, view: View, hint: Hint, wake: WakeFn, backend: Mutant) -> None:
        self.inner: Attempt | None = None  # type: ignore[assignment]
        self.view = view
        self.op = op
        self.hint = hint
        self.wake = wake
        self.backend = backend
        self.cancelled = False

    def poll(self) -> Outcome | None:
        return None if self.inner is None else self.inner.poll()

    def quiesced(self) -> bool:
        return True if self.inner is None else self.inner.quiesced()  # "nothing touches its rows yet"

    def cancel(self) -> None:
        self.cancelled = True
        if self.inner is not None:
            self.inner.cancel()


class QuiescedWhileQueued(Mutant):
    """A2.3: submissions run one at a time from the mutant's own queue; one still waiting there
    says ``quiesced()`` (nothing touches its rows yet), though it will write them once it runs."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        attempt = _Queued(op, view, hint, wake, self)
        with self._cond():
            self.__dict__.setdefault("queue", []).append(attempt)
            if "thread" not in self.__dict__:
                self.__dict__["thread"] = threading.Thread(target=self._run, daemon=True)
                self.__dict__["thread"].start()
            self._cond().notify_all()
        self.remember(attempt)
        return attempt

    def _cond(self) -> threading.Condition:
        return self.__dict__.setdefault("cond", threading.Condition())  # type: ignore[no-any-return]

    def _run(self) -> None:
        cond = self._cond()
        while True:
            with cond:
                cond.wait_for(lambda: self.__dict__["queue"] or self.__dict__.get("stopped"))
                if self.__dict__.get("stopped"):
                    return
                attempt: _Queued = self.__dict__["queue"].pop(0)
            call = self.inner.fetch if attempt.op == "fetch" else self.inner.publish
            attempt.inner = call(attempt.view, attempt.hint, attempt.wake)
            if attempt.cancelled:
                attempt.inner.cancel()
            while not (attempt.inner.poll() is not None and attempt.inner.quiesced()):
                with cond:
                    if cond.wait_for(lambda: self.__dict__.get("stopped"), timeout=0.005):
                        return

    def shutdown(self) -> frozenset[Attempt]:
        with self._cond():
            self.__dict__["stopped"] = True
            self._cond().notify_all()
        return super().shutdown()


# -- S3.6: a fetch refused for overlapping rows keeps a queue slot ------------------------------------------

class OverlapRefusalKeepsASlot(Mutant):
    """S3.6: a fetch refused for overlapping rows (V4) has already counted itself in the queue,
    and that slot is never given back."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        bound = self.inner.capabilities().max_in_flight
        kept = self.__dict__.get("kept", 0)
        live = sum(1 for a in self._attempts() if not (a.inner.poll() is not None and a.inner.quiesced()))
        if live + kept >= bound:
            raise SubmissionRejected(f"{bound} attempts are in flight")
        if op == "fetch" and isinstance(view, View) and view.overlapping_rows() is not None:
            self.__dict__["kept"] = kept + 1
        return super().submit(op, view, hint, wake)


# -- H1.6: a hint's deadline kept only when the hint has fields ---------------------------------------------

class DeadlineNeedsOtherFields(Mutant):
    """H1.6: a hint's ``timeout_s`` is read only along with its fields ("an empty hint is no
    hint"): a store hint of only a deadline gets the options' deadline."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(hint, Hint) and not hint.fields and hint.timeout_s is not None:
            hint = Hint(hint.kind, (), None)
        return super().submit(op, view, hint, wake)


# -- B3.1: submissions taken while shutdown() drains ----------------------------------------------------------

class TakesWorkWhileDraining(Mutant):
    """B3.1: ``shutdown()`` cancels what is in flight (cause ``SHUTDOWN``) and returns what has not
    quiesced, but shuts the backend down, refusing submissions, only once nothing is left: while
    it drains, new work is still taken."""

    attempt_type = _ShutdownCause

    def shutdown(self) -> frozenset[Attempt]:
        made = self._attempts()
        live = [a for a in made if not a.inner.quiesced()]
        if live:
            for a in live:
                if a.inner.poll() is None:
                    a.__dict__["by_shutdown"] = True
                    a.inner.cancel()
            pending = frozenset(a for a in live if not a.inner.quiesced())
            if pending:
                return pending
        return super().shutdown()


# -- M3.5: region overlap judged in the new region's slot size --------------------------------------------

def _overlap_in_own_slot_size() -> Callable[[], None]:
    """Patch :meth:`SlotRegion.overlaps` for this process: the other region's extent is taken as
    its slot count times this region's slot size."""
    original = SlotRegion.overlaps

    def overlaps(self: SlotRegion, other: SlotRegion) -> bool:
        if self.memory_kind is not other.memory_kind or self.device != other.device:
            return False
        return self.base < other.base + other.slot_count * self.slot_bytes and other.base < self.end

    SlotRegion.overlaps = overlaps  # type: ignore[method-assign]
    return lambda: setattr(SlotRegion, "overlaps", original)


# -- A5.11: a full store fails the publish -------------------------------------------------------------

class _FullIsAFault(MemoryDriver):
    """A client whose store answers "out of memory" as an error: a put the store declines for
    space is reported ``FAILED`` (the third-party Redis plugin's bug)."""

    def put(self, keys: Any, addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        result = super().put(keys, addresses, sizes)
        declined = np.asarray(result.status) == int(KeyStatus.DECLINED)
        if not declined.any():
            return result
        status = np.array(result.status, dtype=np.uint8)
        status[declined] = int(KeyStatus.FAILED)
        reasons = dict(result.reasons)
        reasons.update({int(i): "OOM command not allowed when used memory > 'maxmemory'"
                        for i in np.flatnonzero(declined)})
        return BatchResult(status, reasons)


class _FullIsAFaultHarness(MemoryHarness):
    def driver(self, store: Any) -> StoreDriver:
        from kvwire_memory.harness import CAPACITY_BYTES

        return _FullIsAFault(named_store(store, capacity_bytes=CAPACITY_BYTES, eviction=False))

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float,
                   max_in_flight: int | None) -> Backend | None:
        return None  # every end on the broken client


# -- V1.8: a group-id limit tighter than the one the refusal states ------------------------------------

class GroupIdsTighterThanStated(Mutant):
    """V1.8: refuses a view with a group id of 2**31 or more, saying its wire carries ids below
    2**32 (a signed 32-bit field where the message says unsigned): ids it promises are refused."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(view, View):
            for group in view.groups:
                if group.group_id >= 1 << 31:
                    raise InvalidSubmission(f"group id {group.group_id} does not fit the wire, which carries group "
                                            "ids below 2**32 (contract V1.8)")
        return super().submit(op, view, hint, wake)


# -- A5.6: a publish answered from this process's memory of what the store held ----------------------

class _RemembersWhatItStored(FilesDriver):
    """Remembers, for this process, every key the store held when one of its drivers of that
    store stored or read it, and answers a put of one ``ALREADY_THERE`` from that memory without
    asking the store, which another process may have removed it from since."""

    #: store root -> keys this process saw held there
    seen: dict[str, set[str]] = {}

    def __init__(self, store: FileStore, **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        self.stored = self.seen.setdefault(str(store.root), set())

    def put(self, keys: Any, addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        known = np.array([k in self.stored for k in keys], dtype=bool)
        status = np.full(len(keys), int(KeyStatus.ALREADY_THERE), dtype=np.uint8)
        reasons: dict[int, str] = {}
        rest = np.flatnonzero(~known)
        if rest.size:
            result = super().put([keys[i] for i in rest.tolist()], np.asarray(addresses)[rest], np.asarray(sizes)[rest])
            status[rest] = result.status
            reasons = {int(rest[j]): text for j, text in result.reasons.items()}
        self.stored.update(k for k, s in zip(keys, status.tolist(), strict=True)
                           if s in (int(KeyStatus.OK), int(KeyStatus.ALREADY_THERE)))
        return BatchResult(status, reasons)

    def get_into(self, keys: Any, addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        result = super().get_into(keys, addresses, sizes)
        self.stored.update(k for k, s in zip(keys, np.asarray(result.status).tolist(), strict=True)
                           if s == int(KeyStatus.OK))
        return result


class _StaleFilesHarness(FilesHarness):
    def driver(self, store: Any) -> StoreDriver:
        from kvwire_files.harness import CAPACITY_BYTES

        return _RemembersWhatItStored(FileStore(store, capacity_bytes=CAPACITY_BYTES, eviction=False), owns_store=True)

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float,
                   max_in_flight: int | None) -> Backend | None:
        return None  # every end on the remembering driver; the other process runs the real one


answer_ignores_a_late_cancel = HoleHarness("answer-ignores-a-late-cancel", AnswerIgnoresALateCancel,
                                           inner=_peer_harness(_IgnoresLateCancel))
busy_count_never_drops = HoleHarness("busy-count-never-drops", BusyCountNeverDrops,
                                     inner=_peer_harness(_BusyCountLeaks, pending_pulls=BUSY_BOUND))
stopped_answer_as_short_prefix = HoleHarness("stopped-answer-as-short-prefix", StoppedAnswerAsShortPrefix,
                                             inner=_peer_harness(_StopsShort))
poll_waits_briefly = HoleHarness("poll-waits-briefly", PollWaitsBriefly)
quiesced_while_queued = HoleHarness("quiesced-while-queued", QuiescedWhileQueued)
overlap_refusal_keeps_a_slot = HoleHarness("overlap-refusal-keeps-a-slot", OverlapRefusalKeepsASlot)
deadline_needs_other_fields = HoleHarness("deadline-needs-other-fields", DeadlineNeedsOtherFields)
takes_work_while_draining = HoleHarness("takes-work-while-draining", TakesWorkWhileDraining)
overlap_in_own_slot_size = HoleHarness("overlap-in-own-slot-size", Mutant, setup=_overlap_in_own_slot_size)
full_store_fails_the_publish = HoleHarness("full-store-fails-the-publish", Mutant, inner=_FullIsAFaultHarness())
group_ids_tighter_than_stated = HoleHarness("group-ids-tighter-than-stated", GroupIdsTighterThanStated)
publish_trusts_a_stale_index = HoleHarness("publish-trusts-a-stale-index", Mutant, inner=_StaleFilesHarness())
