"""Deliberately broken backends around wakes from inside the holder's calls (W1.6), cancel()
without declared cancellation (B4.5), and the serving end's answer to a cancelled pull (N2.13):
each wraps a correct backend (the memory backend, or the reference serving peer for the N2 ones)
and breaks exactly one clause that the suite once let through (found by the second probing
round).

``test_mutants.py`` reads its entries in ``mutant_table.py`` and points the suite at each harness here with
``--kvwire-harness tests/conformance/mutants_wakes.py:NAME``: each run must fail on a test named
after the rule."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from loopback_peer import LoopbackHarness  # beside this file; on sys.path when loaded as a harness
from mutants import Mutant, MutantHarness, PeerMutant, Wrapped

from kvwire.contract import Capabilities, Hint, Outcome, SlotRegion, View, WakeFn
from kvwire.contract.backend import Registration

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


# -- B4.5: cancel() without declared cancellation blocks ---------------------------------------

class _CancelWaits(Wrapped):
    def cancel(self) -> None:
        deadline = time.monotonic() + 30.0
        while self.inner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)


class BlockingUndeclaredCancel(Mutant):
    """B4.5: declares no cancellation, and its cancel() waits for the attempt to conclude (by its
    deadline when the other end does not answer)."""

    attempt_type = _CancelWaits

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:  # type: ignore[override]
        return dataclasses.replace(caps, cancellation=False)

    def capabilities(self) -> Capabilities:
        return self.declare(self.inner.capabilities())


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


# -- the harnesses ----------------------------------------------------------------------------------

wakes_inside_registration = MutantHarness("wakes-inside-registration", WakesInsideRegistration)
wakes_inside_registration_close = MutantHarness("wakes-inside-registration-close", WakesInsideRegistrationClose)
wakes_inside_capabilities = MutantHarness("wakes-inside-capabilities", WakesInsideCapabilities)
blocking_undeclared_cancel = MutantHarness("blocking-undeclared-cancel", BlockingUndeclaredCancel)
cancelled_pull_answer_delivers = MutantHarness("cancelled-pull-answer-delivers", CancelledPullAnswerDelivers,
                                               inner=LoopbackHarness())
cancelled_pull_answer_not_by_peer = MutantHarness("cancelled-pull-answer-not-by-peer", CancelledPullAnswerNotByPeer,
                                                  inner=LoopbackHarness())
