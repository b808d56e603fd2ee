"""Deliberately broken backends around shutdown and cancel: each wraps the memory backend (as
``mutants.py`` does) and breaks one clause of B3, A1.5, A4 or A10.8 that the suite once let
through. ``test_mutants.py`` reads its entries in ``mutant_table.py`` and checks that the suite fails each one on a
test named after the rule it breaks.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants_shutdown.py:NAME``."""

from __future__ import annotations

from mutants import Mutant, MutantHarness, Wrapped  # beside this file; on sys.path when loaded as a harness

from kvwire.blob.keys import store_keys
from kvwire.contract import Attempt, Cause, Hint, Outcome, View, WakeFn

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


# -- A1.3 / A1.5: shutdown() writes over an outcome already answered ------------------------------

class _Overwritable(Wrapped):
    overwritten: Outcome | None = None

    def poll(self) -> Outcome | None:
        if self.overwritten is not None:
            return self.overwritten
        return self.inner.poll()


class ShutdownOverwritesConcluded(Mutant):
    """A1.3 / A1.5: shutdown() cancels every attempt that has not quiesced, writing cancelled
    (cause SHUTDOWN) over the outcome of one that had already concluded (cancelled or failed,
    its access not yet ended)."""

    attempt_type = _Overwritable

    def shutdown(self) -> frozenset[Attempt]:
        for a in self._attempts():
            if a.overwritten is None and not a.inner.quiesced() and a.inner.poll() is not None:  # type: ignore[attr-defined]
                masks = a.view.row_masks()
                for mask in masks:
                    mask.setflags(write=False)
                a.overwritten = Outcome.cancelled(masks, reason="the backend shut down",  # type: ignore[attr-defined]
                                                  cause=Cause.SHUTDOWN)
        return super().shutdown()


# -- A4.3 / A10.6: a publish the holder cancelled reports a fault ---------------------------------

class _CancelledPublishFails(Wrapped):
    cancelled_early = False

    def cancel(self) -> None:
        if self.inner.poll() is None:
            self.cancelled_early = True
        self.inner.cancel()

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is not None and self.op == "publish" and out.is_cancelled and self.cancelled_early:
            return Outcome.failed("publish aborted", out.masks, cause=Cause.FAULT)
        return out


class CancelledPublishFails(Mutant):
    """A4.3 / A10.6: a publish the holder cancelled before it concluded reports FAILED (cause
    FAULT, "publish aborted") instead of CANCELLED with cause HOLDER_CANCELLED. Fetches are
    right."""

    attempt_type = _CancelledPublishFails


# -- A4.6: cancel() after a delivered publish takes back what it stored ----------------------------

class _RollsBack(Wrapped):
    def cancel(self) -> None:
        self.inner.cancel()
        out = self.inner.poll()
        if out is not None and out.is_delivered and self.op == "publish" and not self.__dict__.get("rolled"):
            self.__dict__["rolled"] = True
            self.backend.rollback(self)  # type: ignore[attr-defined]


class CancelRollsBackPublish(Mutant):
    """A4.6: cancel() after a publish delivered removes the objects it stored (an "abort" that
    should have been a no-op)."""

    attempt_type = _RollsBack

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        attempt = super().make(op, view, hint, wake)
        attempt.__dict__["namespace"] = hint.get("namespace")
        return attempt

    def rollback(self, attempt: Wrapped) -> None:
        inner = self.inner  # the memory backend: a BlobBackend over its store driver
        namespace = attempt.__dict__.get("namespace") or inner.namespace  # type: ignore[attr-defined]
        keys: list[str] = []
        for group in attempt.view.groups:
            if group.names is not None and group.rows:
                keys += store_keys(namespace, group.group_id, group.names)
        if keys:
            inner.driver.remove(keys)  # type: ignore[attr-defined]


shutdown_cause_fault = MutantHarness("shutdown-cause-fault", ShutdownCauseFault)
shutdown_omits_earlier_concluded = MutantHarness("shutdown-omits-earlier-concluded", ShutdownOmitsEarlierConcluded)
shutdown_needs_polling = MutantHarness("shutdown-needs-polling", ShutdownNeedsPolling)
shutdown_overwrites_concluded = MutantHarness("shutdown-overwrites-concluded", ShutdownOverwritesConcluded)
cancelled_publish_fails = MutantHarness("cancelled-publish-fails", CancelledPublishFails)
cancel_rolls_back_publish = MutantHarness("cancel-rolls-back-publish", CancelRollsBackPublish)
