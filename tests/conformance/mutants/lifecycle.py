"""Mutants that each break one lifecycle clause (B1-B4: instances, threads, shutdown, capabilities).
Every harness below is registered once, in ``tests/conformance/mutant_table.py``, with the clause it
breaks and the ``-k`` selection of the suite's tests that must catch it. A mutant either wraps a
correct backend through :mod:`kit` (the memory backend, or the reference peer for the serving
protocol) and breaks the clause from outside, or subclasses a reference backend
(:mod:`kvwire.testing.reference`) and overrides the one method where the bug lives.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants/lifecycle.py:NAME``."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from kit import (  # beside this file; on sys.path when loaded as a harness
    HoleHarness,
    Mutant,
    MutantHarness,
    PeerMutantHarness,
    StoreMutantHarness,
    Wrapped,
    _Bounded,
    _WideInner,
)

from kvwire.contract import (
    LOOKUP,
    Attempt,
    Backend,
    Capabilities,
    Cause,
    Hint,
    Outcome,
    OutcomeStatus,
    SlotRegion,
    SubmissionRejected,
    View,
    WakeFn,
)
from kvwire.contract.backend import Registration
from kvwire.testing.harness import Ends, FaultPlan
from kvwire.testing.reference.core import Access, ReferenceAttempt, Runner
from kvwire.testing.reference.peer import ReferencePeer
from kvwire.testing.reference.store import ReferenceStoreBackend, store_capabilities


class AcceptsAfterShutdown(Mutant):
    """B3: shutdown() says done but keeps taking submissions."""

    def shutdown(self) -> frozenset[Attempt]:
        return frozenset()


_everyone: list[Mutant] = []


class SharesShutdown(Mutant):
    """B1: one instance's shutdown() shuts every instance down."""

    def __init__(self, inner: Backend, harness: MutantHarness) -> None:
        super().__init__(inner, harness)
        _everyone.append(self)

    def shutdown(self) -> frozenset[Attempt]:
        pending: set[Attempt] = set()
        for mutant in list(_everyone):
            pending |= mutant.inner.shutdown()
        return frozenset(pending)


class DriftingCapabilities(Mutant):
    """B4: capabilities() answers differently on every call."""

    def capabilities(self) -> Capabilities:
        count = self.__dict__["asked"] = self.__dict__.get("asked", 0) + 1
        caps = self.inner.capabilities()
        return dataclasses.replace(caps, max_in_flight=caps.max_in_flight + count)


class _ThreadBound(Wrapped):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.owner = threading.current_thread()  # thread idents are reused; thread objects are not

    def poll(self) -> Outcome | None:
        return self.inner.poll() if threading.current_thread() is self.owner else None

    def quiesced(self) -> bool:
        return self.inner.quiesced() if threading.current_thread() is self.owner else False


class ThreadBoundAttempts(Mutant):
    """B2: an attempt answers only the thread that submitted it."""

    attempt_type = _ThreadBound


# -- B4.1: capabilities() is not frozen -----------------------------------------------------------

class _LooseCapabilities(Capabilities):
    """A Capabilities whose fields can be assigned."""

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Capabilities):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in Capabilities.__dataclass_fields__)

    __hash__ = None  # type: ignore[assignment]


class MutableCapabilities(Mutant):
    """B4.1: capabilities() returns a Capabilities whose fields a caller can assign (equal in
    value to the declaration, but not frozen), one shared object for the instance's life."""

    def capabilities(self) -> Capabilities:
        caps = self.__dict__.get("caps")
        if caps is None:
            inner = self.inner.capabilities()
            caps = _LooseCapabilities(**{f: getattr(inner, f) for f in Capabilities.__dataclass_fields__})
            self.__dict__["caps"] = caps
        return caps


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


# -- B3.2 / A10.8: shutdown and a held publish -------------------------------------------------------

def _shut(out: Outcome | None) -> bool:
    return out is not None and out.cause is Cause.SHUTDOWN


class _PublishOutlivesShutdown(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if self.op == "publish" and _shut(out) and not self.inner.quiesced():
            return None  # still waiting on the store, as if shutdown() had not touched it
        return out


class ShutdownSparesPublishes(Mutant):
    """B3.2: ``shutdown()`` concludes the fetches in flight but leaves a publish waiting on its
    store: it concludes only once the store answers."""

    attempt_type = _PublishOutlivesShutdown


class _PublishShutdownFaults(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if self.op == "publish" and _shut(out):
            assert out is not None
            return Outcome.failed("the store connection was closed under the publish", out.masks, cause=Cause.FAULT)
        return out


class ShutdownPublishCauseFault(Mutant):
    """A10.8 / B3.2: a publish that ``shutdown()`` concluded fails with cause ``FAULT`` (its store
    connection was closed under it), not ``SHUTDOWN``."""

    attempt_type = _PublishShutdownFaults


class ShutdownHidesPublishes(Mutant):
    """B3.3: ``shutdown()`` leaves publishes out of the set it returns, also one its store still
    holds (found by a review after the round: the B3 publish test checked only that the set held
    nothing foreign)."""

    def shutdown(self) -> frozenset[Attempt]:
        return frozenset(a for a in super().shutdown() if getattr(a, "op", None) != "publish")


# -- B1.4 / B3.3: instances on one store that share their shutdown ----------------------------------

_instances: list[Mutant] = []


class _Shared(Mutant):
    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        _instances.append(self)

    def others(self) -> list[Mutant]:
        return [m for m in _instances if m is not self]


class ShutdownCancelsOtherInstances(_Shared):
    """B1.4: ``shutdown()`` of one instance cancels the attempts in flight on every other
    instance of the process (one shared connection pool closed)."""

    def shutdown(self) -> frozenset[Attempt]:
        for other in self.others():
            for attempt in other._attempts():
                if attempt.inner.poll() is None:
                    attempt.inner.cancel()
        return super().shutdown()


class ShutdownListsOtherInstances(_Shared):
    """B3.3: ``shutdown()`` returns the attempts not quiesced of every instance of the process, not
    only its own."""

    def shutdown(self) -> frozenset[Attempt]:
        pending = set(super().shutdown())
        for other in self.others():
            pending |= {a for a in other._attempts() if not a.inner.quiesced()}
        return frozenset(pending)


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


# -- B3.2: shutdown() lets a fetch in flight run to its end -------------------------------------------

class _Closing(Mutant):
    """Keeps its own shut-down state, so its ``shutdown()`` may hold back the inner one's: once
    shut down it refuses submissions, registrations and lookups as the inner backend would."""

    def closed(self) -> bool:
        return bool(self.__dict__.get("shut", False))

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if self.closed():
            raise SubmissionRejected("this backend is shut down; it takes no submission")
        return super().submit(op, view, hint, wake)

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        if self.closed():
            raise SubmissionRejected("this backend is shut down; it registers nothing")
        return super().register_regions(regions)

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        if self.closed():
            raise SubmissionRejected("this backend is shut down; it answers no lookup")
        return super().lookup(groups, names, hint, timeout_s)


class _ShutdownCause(Wrapped):
    """A publish ``shutdown()`` cancelled answers cause ``SHUTDOWN`` (A10.8)."""

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.__dict__.get("by_shutdown") and out.is_cancelled:
            return Outcome(OutcomeStatus.CANCELLED, out.masks, out.reason, False, Cause.SHUTDOWN)
        return out


class ShutdownLetsFetchesFinish(_Closing):
    """B3.2: ``shutdown()`` cancels the publishes in flight, but lets each fetch in flight run to
    its end ("its rows are already being written into the holder's memory"): a fetch its other
    end holds concludes only when the other end answers, or at its deadline, never by the
    shutdown. The set it returns is right (every attempt not quiesced)."""

    attempt_type = _ShutdownCause

    def shutdown(self) -> frozenset[Attempt]:
        self.__dict__["shut"] = True
        made = self._attempts()
        if any(a.op == "fetch" and a.inner.poll() is None for a in made):
            for a in made:
                if a.op == "publish" and a.inner.poll() is None:
                    a.__dict__["by_shutdown"] = True
                    a.inner.cancel()
            return frozenset(a for a in made if not a.inner.quiesced())
        return super().shutdown()


# -- B3.2 / W1.2: shutdown() concludes a fetch without waking its holder ------------------------------

class ShutdownConcludesFetchesUnwoken(Mutant):
    """B3.2 / W1.2: ``shutdown()`` concludes every fetch in flight, but calls no wake for that
    conclusion ("the holder called shutdown(), so it knows"): the holder of a fetch its other end
    holds hears of it only at its quiescence, once the other end lets go."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        box: dict[str, Wrapped] = {}

        def relay() -> None:
            attempt = box.get("attempt")
            if attempt is not None and attempt.__dict__.get("muted") and not attempt.inner.quiesced():
                return
            wake()

        call = self.inner.fetch if op == "fetch" else self.inner.publish
        attempt = self.attempt_type(call(view, hint, relay), view, op, self)
        box["attempt"] = attempt
        return attempt

    def shutdown(self) -> frozenset[Attempt]:
        for a in self._attempts():
            if a.op == "fetch" and a.inner.poll() is None:
                a.__dict__["muted"] = True
        return super().shutdown()


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


# -- B3.2 / A10.8: an attempt shutdown() concluded fails with cause FAULT ------------------------

class _ShutdownAsFault(Wrapped):
    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and out.cause is Cause.SHUTDOWN:
            return Outcome.failed("the store connection was closed", out.masks, cause=Cause.FAULT)
        return out


class ShutdownCauseFault(Mutant):
    """B3.2 / A10.8: an attempt that shutdown() concluded fails with cause FAULT ("the store
    connection was closed"), not SHUTDOWN."""

    attempt_type = _ShutdownAsFault


# -- B3.3: attempts that concluded before shutdown() are left out until they quiesce -------------

class ShutdownOmitsEarlierConcluded(Mutant):
    """B3.3: shutdown() tracks only the attempts it ends itself; one that had already concluded
    (cancelled by the holder, or failed by its deadline) but whose access has not ended is never
    in the set."""

    def shutdown(self) -> frozenset[Attempt]:
        if "before" not in self.__dict__:
            self.__dict__["before"] = {id(w) for w in self._attempts() if w.inner.poll() is not None}
        before = self.__dict__["before"]
        return frozenset(a for a in super().shutdown() if id(a) not in before)


# -- B3.5: shutdown() keeps every attempt the holder has not polled ------------------------------

class _RemembersPoll(Wrapped):
    polled = False

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None:
            self.polled = True
        return out


class ShutdownNeedsPolling(Mutant):
    """B3.5: shutdown() lets an attempt go only once the holder has polled its outcome, so it
    keeps returning attempts that concluded and quiesced but were never polled."""

    attempt_type = _RemembersPoll

    def shutdown(self) -> frozenset[Attempt]:
        pending = set(super().shutdown())
        pending |= {a for a in self._attempts() if not a.polled}  # type: ignore[attr-defined]
        return frozenset(pending)


class _SharedLive:
    live: set[ReferenceAttempt] = set()


class SharesQueueBetweenInstances(ReferenceStoreBackend):
    """B1: the in-flight set (the queue bound, what shutdown cancels) is a class attribute,
    shared by every instance in the process."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._runner.live = _SharedLive.live


_module_tables: dict[int, Any] = {}


class RegionsAtModuleLevel(ReferenceStoreBackend):
    """B1: registered regions live in one module-level table for all instances."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._table = _module_tables.setdefault(0, self._table)

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        with self._runner.lock:
            self._runner.closed = True
        pending = frozenset(a for a in self._runner.live if not a.quiesced())
        for a in list(self._runner.live):
            with self._runner.lock:
                a.conclude_locked(OutcomeStatus.CANCELLED, Cause.SHUTDOWN, "the backend shut down")
        pending = frozenset(a for a in self._runner.live if not a.quiesced())
        if not pending:
            self._runner.stop()
        return pending


class DriftingBound(ReferenceStoreBackend):
    """B4: capabilities() builds a fresh declaration each call, its queue bound the room left."""

    def capabilities(self) -> Capabilities:
        return store_capabilities(max(1, self._capabilities.max_in_flight - len(self._runner.live)))


class ShutdownKeepsPulls(ReferencePeer):
    """B3: shutdown() leaves pulls waiting for an answer in flight and reports them quiesced."""

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        with self._runner.lock:
            waiting = {t: p for t, p in self._pulls.items()}
            for pull in waiting.values():
                self._runner.live.discard(pull)
            self._pulls.clear()
        pending = super().shutdown()
        with self._runner.lock:
            self._pulls.update(waiting)
        return pending


class _NeverStops(Runner):
    def stop(self, *, wait_workers: bool = True) -> None:
        pass


class CloseLeavesThreadsRunning(ReferenceStoreBackend):
    """B3: neither shutdown() nor close() stops the backend's worker and clock threads."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._runner.__class__ = _NeverStops


class SecondCloseRaises(ReferenceStoreBackend):
    """B3: close() is not idempotent: a second call raises."""

    def close(self) -> None:
        if self.__dict__.get("closed_once"):
            raise RuntimeError("this backend is already closed")
        self.__dict__["closed_once"] = True
        super().close()


shares_shutdown = MutantHarness("shares-shutdown", SharesShutdown)
thread_bound_attempts = MutantHarness("thread-bound-attempts", ThreadBoundAttempts)
accepts_after_shutdown = MutantHarness("accepts-after-shutdown", AcceptsAfterShutdown)
drifting_capabilities = MutantHarness("drifting-capabilities", DriftingCapabilities)
takes_work_while_draining = HoleHarness("takes-work-while-draining", TakesWorkWhileDraining)
mutable_capabilities = MutantHarness("mutable-capabilities", MutableCapabilities)
shutdown_lists_quiesced_once = MutantHarness("shutdown-lists-quiesced-once", ShutdownListsQuiescedOnce)
shutdown_spares_publishes = MutantHarness("shutdown-spares-publishes", ShutdownSparesPublishes)
shutdown_publish_cause_fault = MutantHarness("shutdown-publish-cause-fault", ShutdownPublishCauseFault)
shutdown_cancels_other_instances = MutantHarness("shutdown-cancels-other-instances", ShutdownCancelsOtherInstances)
shutdown_lists_other_instances = MutantHarness("shutdown-lists-other-instances", ShutdownListsOtherInstances)
shutdown_hides_publishes = MutantHarness("shutdown-hides-publishes", ShutdownHidesPublishes)
queue_shared_on_a_store = _SharedQueueHarness("queue-shared-on-a-store", QueueSharedOnAStore)
shutdown_lets_fetches_finish = MutantHarness("shutdown-lets-fetches-finish", ShutdownLetsFetchesFinish)


shutdown_concludes_fetches_unwoken = MutantHarness("shutdown-concludes-fetches-unwoken",
                                                   ShutdownConcludesFetchesUnwoken)
shutdown_cause_fault = MutantHarness("shutdown-cause-fault", ShutdownCauseFault)
shutdown_omits_earlier_concluded = MutantHarness("shutdown-omits-earlier-concluded", ShutdownOmitsEarlierConcluded)
shutdown_needs_polling = MutantHarness("shutdown-needs-polling", ShutdownNeedsPolling)
blocking_undeclared_cancel = MutantHarness("blocking-undeclared-cancel", BlockingUndeclaredCancel)
shares_queue_between_instances = StoreMutantHarness("shares-queue", SharesQueueBetweenInstances)
regions_at_module_level = StoreMutantHarness("regions-at-module-level", RegionsAtModuleLevel)
drifting_bound = StoreMutantHarness("drifting-bound", DriftingBound)
shutdown_keeps_pulls = PeerMutantHarness("shutdown-keeps-pulls", ShutdownKeepsPulls)
close_leaves_threads_running = StoreMutantHarness("close-leaves-threads-running", CloseLeavesThreadsRunning)
second_close_raises = StoreMutantHarness("second-close-raises", SecondCloseRaises)


# -- issue 36, second batch: single-clause subclasses of the reference store ----------------------

class LaterShutdownReturnsNothing(ReferenceStoreBackend):
    """B3: shutdown() is idempotent by remembering it ran: a second call returns the empty set,
    though attempts have still not quiesced."""

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        if self.__dict__.get("shut"):
            return frozenset()
        self.__dict__["shut"] = True
        return super().shutdown()


class ShutdownLetsGoOfHeldCalls(ReferenceStoreBackend):
    """B3: shutdown() declares the access of every attempt ended and returns the empty set,
    while a store call held at the other end still writes the fetch's rows when it returns."""

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        runner = self._runner
        with runner.lock:
            runner.closed = True
            self._table.close()
            for attempt in list(runner.live):
                attempt.conclude_locked(OutcomeStatus.CANCELLED, Cause.SHUTDOWN, "the backend shut down")
                if attempt.access is not Access.ENDED:
                    attempt.access = Access.ENDED  # "detached": the call in progress is left to end on its own
                    runner.changed_locked(attempt)
        runner.stop(wait_workers=False)
        return frozenset()


class InstanceDeclaresAnOlderVersion(ReferenceStoreBackend):
    """B4: a built backend declares contract (1, 2), its plugin (the harness) (1, 3): the literal
    was raised in one place only."""

    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities(), contract_version=(1, 2))


class _FetchOnlyHarness(StoreMutantHarness):
    """Declares a store that only fetches (``publish`` false), for the plugin and every instance."""

    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities(), publish=False)


class PublishTakenThoughUndeclared(ReferenceStoreBackend):
    """B4: built fetch-only (``publish`` false in its capabilities), it still takes a publish and
    stores its rows."""

    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities(), publish=False)


class _WithoutLookupHarness(StoreMutantHarness):
    """Declares the store without the ``lookup`` protocol, for the plugin and every instance."""

    def capabilities(self) -> Capabilities:
        caps = super().capabilities()
        return dataclasses.replace(caps, protocols=caps.protocols - {LOOKUP})


class LookupAnsweredThoughUndeclared(ReferenceStoreBackend):
    """B4: built without the ``lookup`` protocol (it is not in its capabilities), its lookup()
    still answers instead of refusing."""

    def capabilities(self) -> Capabilities:
        caps = super().capabilities()
        return dataclasses.replace(caps, protocols=caps.protocols - {LOOKUP})


later_shutdown_returns_nothing = StoreMutantHarness("later-shutdown-returns-nothing", LaterShutdownReturnsNothing)
shutdown_lets_go_of_held_calls = StoreMutantHarness("shutdown-lets-go-of-held-calls", ShutdownLetsGoOfHeldCalls)
instance_declares_an_older_version = StoreMutantHarness("instance-declares-an-older-version",
                                                        InstanceDeclaresAnOlderVersion)
publish_taken_though_undeclared = _FetchOnlyHarness("publish-taken-though-undeclared", PublishTakenThoughUndeclared)
lookup_answered_though_undeclared = _WithoutLookupHarness("lookup-answered-though-undeclared",
                                                          LookupAnsweredThoughUndeclared)


class LookupOnAClientObject(Backend):
    """B4: a store that declares the ``lookup`` protocol (its plugin too) but answers lookups
    through a separate client object: the backend itself implements no ``Lookup``. Everything
    else is the reference store's."""

    def __init__(self, store: Any, **options: Any) -> None:
        self.inner = ReferenceStoreBackend(store, **options)
        self.client = self.inner  # where lookup() lives

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        return self.inner.register_regions(regions)

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self.inner.fetch(view, hint, wake)

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self.inner.publish(view, hint, wake)

    def shutdown(self) -> frozenset[Attempt]:
        return frozenset(self.inner.shutdown())

    def close(self) -> None:
        self.inner.close()


lookup_on_a_client_object = StoreMutantHarness("lookup-on-a-client-object",
                                               LookupOnAClientObject)  # type: ignore[arg-type]


class OptionsKeptOnTheClass(ReferenceStoreBackend):
    """B1: the deadline option is kept on the class, not the instance: every instance uses the
    option of the instance built last."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        type(self).deadline_option = self._timeout_s

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        self._timeout_s = type(self).deadline_option
        return super()._submit(op, view, hint, wake)


options_kept_on_the_class = StoreMutantHarness("options-kept-on-the-class", OptionsKeptOnTheClass)
