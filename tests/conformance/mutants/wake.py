"""Mutants that each break one waking clause (W1: when and from where a wake is called). Every harness
below is registered once, in ``tests/conformance/mutant_table.py``, with the clause it breaks and
the ``-k`` selection of the suite's tests that must catch it. A mutant either wraps a correct
backend through :mod:`kit` (the memory backend, or the reference peer for the serving protocol) and
breaks the clause from outside, or subclasses a reference backend (:mod:`kvwire.testing.reference`)
and overrides the one method where the bug lives.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants/wake.py:NAME``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kit import (  # beside this file; on sys.path when loaded as a harness
    Mutant,
    MutantHarness,
    PeerMutant,
    PeerMutantHarness,
    StoreMutantHarness,
    Wrapped,
    _Down,
)

from kvwire.contract import (
    Attempt,
    Capabilities,
    Cause,
    Hint,
    Outcome,
    OutcomeStatus,
    SlotRegion,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.contract.serving import PullRequest
from kvwire.testing.reference.core import Access, ReferenceAttempt
from kvwire.testing.reference.harness import ReferencePeerHarness as LoopbackHarness
from kvwire.testing.reference.peer import PullMessage, ReferencePeer
from kvwire.testing.reference.store import ReferenceStoreBackend


class _EarlyWake(Wrapped):
    DELAY_S = 0.3

    def visible(self) -> bool:
        changed = self.__dict__.get("changed_at")
        return changed is not None and time.monotonic() - changed >= self.DELAY_S

    def poll(self) -> Outcome | None:
        return self.inner.poll() if self.visible() else None

    def quiesced(self) -> bool:
        return self.inner.quiesced() if self.visible() else False


class WakesEarly(Mutant):
    """W1: calls wake() as soon as a change happens, but shows the change only 0.3 s later."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        holder: list[_EarlyWake] = []

        def early() -> None:
            holder[0].changed_at = time.monotonic()  # type: ignore[attr-defined]
            wake()

        call = self.inner.fetch if op == "fetch" else self.inner.publish
        attempt = _EarlyWake.__new__(_EarlyWake)
        holder.append(attempt)
        Wrapped.__init__(attempt, call(view, hint, early), view, op, self)
        return attempt


class _DoesNotWakeOnCancel(Wrapped):
    def cancel(self) -> None:
        self.inner.cancel()
        self.__dict__["cancelled_at"] = time.monotonic()

    def poll(self) -> Outcome | None:
        # The cancelled outcome shows only after a delay, and nothing wakes the holder then.
        at = self.__dict__.get("cancelled_at")
        if at is not None and time.monotonic() - at < 0.3:
            return None
        return self.inner.poll()


class SilentCancel(Mutant):
    """W1/A4: a cancelled outcome becomes visible later, with no wake after it."""

    attempt_type = _DoesNotWakeOnCancel


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


class _Concluded(Attempt):
    """An attempt concluded and quiesced at once with ``outcome``, whose wake is never called."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome

    def poll(self) -> Outcome | None:
        return self.outcome

    def quiesced(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


# -- W1.6: close() wakes every attempt it ever made ---------------------------------------------------

class WakesInsideClose(Mutant):
    """W1.6: ``close()`` calls the wake of every attempt the instance made, from inside the call
    (a final "notify all waiters" on the holder's thread)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        self.__dict__.setdefault("wakes", []).append(wake)
        return super().make(op, view, hint, wake)

    def close(self) -> None:
        for wake in self.__dict__.pop("wakes", []):
            try:
                wake()
            except Exception:  # W1.7: a raising wake is survived
                pass
        super().close()


# -- W1.7: a raising wake dropped ----------------------------------------------------------------------

class RaisingWakeDropped(Mutant):
    """W1.7 / W1.3: once an attempt's wake raised, the backend drops it: the attempt's later
    changes (a quiescence after the conclusion) come without a wake."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        dropped: list[bool] = []

        def guarded() -> None:
            if dropped:
                return
            try:
                wake()
            except Exception:
                dropped.append(True)
                raise

        return super().make(op, view, hint, guarded)


# -- W1.2: an empty view concludes without a wake ---------------------------------------------------

class EmptyViewsNeverWake(_Down):
    """W1.2: a view with no groups concludes delivered inside the call, and nothing wakes the
    holder for it (there was nothing to wait for)."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if not view.groups and not self.down:
            return _Concluded(Outcome.delivered(()))
        return super().submit(op, view, hint, wake)


log = logging.getLogger(__name__)


# -- W1.6: the serve wake from inside the holder's calls ---------------------------------------

def _guarded(wake: WakeFn) -> None:
    """Call ``wake`` as a backend keeping W1.7 does: an exception is logged and dropped."""
    try:
        wake()
    except Exception:
        log.debug("the serve wake raised", exc_info=True)


class ServeWakeInsideServe(PeerMutant):
    """W1.6: ``serve(wake)`` calls ``wake`` once from inside the call ("look now, in case")."""

    def serve(self, wake: WakeFn) -> None:
        self.serving.serve(wake)
        _guarded(wake)


class ServeWakeInsideIncoming(PeerMutant):
    """W1.6: ``incoming()`` calls the serve wake from inside the call whenever it hands a
    request over ("more may be waiting")."""

    def serve(self, wake: WakeFn) -> None:
        self.__dict__["wake"] = wake
        self.serving.serve(wake)

    def incoming(self) -> tuple[PullRequest, ...]:
        got = self.serving.incoming()
        if got:
            _guarded(self.__dict__["wake"])
        return got


# -- W1.6: wakes called from inside register_regions(), Registration.close(), capabilities() ------

class _Waking(Mutant):
    """Runs its completion queue on whatever thread calls :meth:`flush`: it calls the wake of
    every attempt not yet concluded and quiesced (a spurious wake is allowed, W1.8; one from
    inside a call the holder made to the backend is not, W1.6)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        attempt = super().make(op, view, hint, wake)
        self.__dict__.setdefault("wakes", []).append((attempt, wake))
        return attempt

    def flush(self) -> None:
        for attempt, wake in list(self.__dict__.get("wakes", [])):
            if attempt.inner.poll() is None or not attempt.inner.quiesced():
                wake()


class WakesInsideRegistration(_Waking):
    """W1.6: register_regions() and capabilities() drain the completion queue on the caller's
    thread, calling the wakes of attempts in flight from inside the holder's call."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        self.flush()
        return self.inner.register_regions(regions)

    def capabilities(self) -> Capabilities:
        self.flush()
        return self.inner.capabilities()


class _FlushingRegistration(Registration):
    def __init__(self, inner: Registration, backend: _Waking) -> None:
        self.inner = inner
        self.backend = backend

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self.inner.regions

    def close(self) -> None:
        self.backend.flush()
        self.inner.close()


class WakesInsideRegistrationClose(_Waking):
    """W1.6: Registration.close() (only) drains the completion queue on the caller's thread."""

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        return _FlushingRegistration(self.inner.register_regions(regions), self)


class WakesInsideCapabilities(_Waking):
    """W1.6: capabilities() (only) drains the completion queue on the caller's thread."""

    def capabilities(self) -> Capabilities:
        self.flush()
        return self.inner.capabilities()


class _SilentQuiescence(ReferenceAttempt):
    def untouch_locked(self) -> None:
        if self.access is Access.TOUCHING:
            self.access = Access.ENDED if self.outcome is not None else Access.WAITING
            if self.settled:
                self.runner.live.discard(self)  # frees the slot, but no wake


class NoWakeForLateQuiescence(ReferenceStoreBackend):
    """W1: quiescence that comes after the conclusion (a cancel or deadline while a store call
    runs) is not followed by a wake."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _SilentQuiescence
        return attempt


class _WakeFirst(ReferenceAttempt):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if self.outcome is None:
            self.wake()  # tell the holder at once, from this thread, instead of after the change
            time.sleep(0.001)  # (the store's bookkeeping between the two)
        concluded = super().conclude_locked(status, cause, reason, by_peer=by_peer)
        if concluded and self.wake in self.runner._wakes:
            self.runner._wakes.remove(self.wake)  # already woken above
        return concluded


class WakesBeforeOutcome(ReferenceStoreBackend):
    """W1: wake() is called before the outcome is stored."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        attempt.__class__ = _WakeFirst
        return attempt


class WakesBeforeRequestVisible(ReferencePeer):
    """W1: the serving wake is called as a request arrives, just before it is put where
    incoming() finds it."""

    def _on_request(self, message: PullMessage) -> None:
        with self._runner.lock:
            wake = self._serving_wake
        if wake is None:
            super()._on_request(message)
            return
        wake()
        time.sleep(0.001)  # (building the PullRequest)
        with self._runner.lock:
            self._serving_wake = lambda: None  # woken above already
            try:
                super()._on_request(message)
            finally:
                self._serving_wake = wake


wakes_early = MutantHarness("wakes-early", WakesEarly)
silent_cancel = MutantHarness("silent-cancel", SilentCancel)


serve_wake_only_when_drained = MutantHarness("serve-wake-only-when-drained", ServeWakeOnlyWhenDrained,
                                             inner=LoopbackHarness())


raising_serve_wake_stops_serving = MutantHarness("raising-serve-wake-stops-serving", RaisingServeWakeStopsServing,
                                                 inner=LoopbackHarness())
empty_views_never_wake = MutantHarness("empty-views-never-wake", EmptyViewsNeverWake)
wakes_inside_close = MutantHarness("wakes-inside-close", WakesInsideClose)
raising_wake_dropped = MutantHarness("raising-wake-dropped", RaisingWakeDropped)
serve_wake_inside_serve = MutantHarness("serve-wake-inside-serve", ServeWakeInsideServe, inner=LoopbackHarness())


serve_wake_inside_incoming = MutantHarness("serve-wake-inside-incoming", ServeWakeInsideIncoming,
                                           inner=LoopbackHarness())
wakes_inside_registration = MutantHarness("wakes-inside-registration", WakesInsideRegistration)
wakes_inside_registration_close = MutantHarness("wakes-inside-registration-close", WakesInsideRegistrationClose)
wakes_inside_capabilities = MutantHarness("wakes-inside-capabilities", WakesInsideCapabilities)
no_wake_for_late_quiescence = StoreMutantHarness("no-wake-for-late-quiescence", NoWakeForLateQuiescence)
wakes_before_outcome = StoreMutantHarness("wakes-before-outcome", WakesBeforeOutcome)
wakes_before_request_visible = PeerMutantHarness("wakes-before-request-visible", WakesBeforeRequestVisible)


# -- W1.1: a wake before the quiescence it reports is visible ------------------------------------------

class _QuiescedShownLate(Wrapped):
    """``quiesced()`` answers true only half a second after the inner attempt first said so: the
    inner backend's wake for quiescence comes before a holder can see it."""

    LAG_S = 0.5

    def quiesced(self) -> bool:
        if not self.inner.quiesced():
            return False
        first = self.__dict__.setdefault("first_seen", time.monotonic())
        return time.monotonic() - first >= self.LAG_S


class QuiescedShownAfterItsWake(Mutant):
    """W1.1: calls the wake for an attempt's quiescence before ``quiesced()`` says true (the flag
    is published by a later step of its worker), so a holder woken for it sees nothing new."""

    attempt_type = _QuiescedShownLate


quiesced_shown_after_its_wake = MutantHarness("quiesced-shown-after-its-wake", QuiescedShownAfterItsWake)
