"""The holder loop (``kvwire.holding``): it looks only after wakes, tells a lost wake
from a stall, cancels at the deadline and reports an attempt that never quiesced, so the caller
keeps its lease. Driven by a scripted attempt, no backend and no torch."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from kvwire.contract import Attempt, Backend, Capabilities, Hint, Outcome, View
from kvwire.holding import (
    AtDeadline,
    Cancel,
    Direction,
    Submission,
    WaitExpired,
    WaitStatus,
    Wakes,
    submit,
    wait,
    wait_all,
    wait_any,
)

HINT = Hint.of("store", namespace="t")
VIEW = View(())


class Scripted(Attempt):
    """An attempt the test concludes and quiesces by hand, waking or (to break W1) not."""

    def __init__(self, wake: Wakes, *, on_cancel: str = "conclude") -> None:
        self.wake = wake
        self.outcome: Outcome | None = None
        self.quiet = False
        self.cancels = 0
        self.on_cancel = on_cancel
        self.calls: list[str] = []

    def poll(self) -> Outcome | None:
        self.calls.append("poll")
        return self.outcome

    def quiesced(self) -> bool:
        self.calls.append("quiesced")
        return self.quiet

    def cancel(self) -> None:
        self.cancels += 1
        if self.outcome is None and self.on_cancel != "ignore":
            self.outcome = Outcome.cancelled(())
            self.quiet = self.on_cancel == "conclude"
            self.wake()

    def finish(self, *, quiet: bool = True, wake: bool = True) -> None:
        self.outcome = Outcome.delivered(())
        self.quiet = quiet
        if wake:
            self.wake()


class Backendish(Backend):
    """Hands out :class:`Scripted` attempts; only what ``submit`` calls."""

    def __init__(self, *, on_cancel: str = "conclude") -> None:
        self.attempts: list[Scripted] = []
        self.on_cancel = on_cancel
        self.ops: list[str] = []

    def capabilities(self) -> Capabilities:
        raise NotImplementedError

    def register_regions(self, regions: Sequence[object]) -> object:  # type: ignore[override]
        raise NotImplementedError

    def _attempt(self, wake: object, op: str) -> Scripted:
        assert isinstance(wake, Wakes)
        self.ops.append(op)
        a = Scripted(wake, on_cancel=self.on_cancel)
        self.attempts.append(a)
        return a

    def fetch(self, view: View, hint: Hint, wake):  # type: ignore[no-untyped-def, override]
        return self._attempt(wake, "fetch")

    def publish(self, view: View, hint: Hint, wake):  # type: ignore[no-untyped-def, override]
        return self._attempt(wake, "publish")

    def shutdown(self) -> frozenset[Attempt]:
        return frozenset()


def later(fn, *args, **kwargs) -> threading.Thread:  # type: ignore[no-untyped-def]
    """Runs ``fn`` on another thread once the test's wait is asleep (after its first look)."""
    t = threading.Thread(target=fn, args=args, kwargs=kwargs)
    t.start()
    return t


def test_the_holder_kit_imports_without_torch():
    code = (
        "import sys, kvwire.holding;"
        "from kvwire.holding import wait, drain, ServingLoop, TransceiverState, PullGuard;"
        "bad=[m for m in sys.modules if m.startswith(('torch','kvwire.lender','kvwire.registry','kvwire.runtime'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_old_paths_are_aliases_and_import_without_torch():
    code = (
        "import sys, kvwire.holding, kvwire.runtime.holding, kvwire.runtime.state, kvwire.runtime.auth;"
        "from kvwire.runtime import wait, Direction, TransceiverState;"
        "assert kvwire.runtime.holding.Wakes is kvwire.holding.Wakes and Direction is kvwire.holding.Direction;"
        "assert kvwire.runtime.state.TransceiverState is TransceiverState is kvwire.holding.TransceiverState;"
        "assert kvwire.runtime.auth.PullGuard is kvwire.holding.PullGuard;"
        "bad=[m for m in sys.modules if m.startswith(('torch','kvwire.lender','kvwire.registry','kvwire.runtime.worker'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_submit_takes_a_direction_not_a_string():
    backend = Backendish()
    with pytest.raises(TypeError, match="Direction"):
        submit(backend, "fetch", VIEW, HINT)  # type: ignore[arg-type]
    assert submit(backend, Direction.PUBLISH, VIEW, HINT).op is Direction.PUBLISH
    assert backend.ops == ["publish"]


def test_done_after_a_wake():
    backend = Backendish()
    sub = submit(backend, Direction.FETCH, VIEW, HINT)
    t = later(backend.attempts[0].finish)
    waited = wait(sub, 30.0)
    t.join()
    assert waited.status is WaitStatus.DONE and waited.outcome is not None and waited.outcome.is_delivered
    assert waited.quiesced and not waited.keeps_lease and not waited.cancelled and not waited.timed_out
    assert waited.result() is waited.outcome and sub.outcome is waited.outcome and sub.quiesced_seen


def test_a_change_no_wake_announced_is_unwoken_not_done():
    backend = Backendish()
    sub = submit(backend, Direction.FETCH, VIEW, HINT)
    backend.attempts[0].finish(wake=False)
    # Done before the loop's first look: that look sees it, no wake needed.
    assert wait(sub, 0.05, at_deadline=AtDeadline.RETURN).status is WaitStatus.DONE

    lost = submit(backend, Direction.FETCH, VIEW, HINT)
    attempt = backend.attempts[1]
    original = attempt.poll
    looks = [0]

    def poll() -> Outcome | None:  # the change becomes visible right after the first look
        out = original()
        looks[0] += 1
        if looks[0] == 1:
            attempt.finish(wake=False)
        return out

    attempt.poll = poll  # type: ignore[method-assign]
    waited = wait(lost, 0.05, at_deadline=AtDeadline.RETURN)
    assert waited.status is WaitStatus.UNWOKEN and waited.timed_out and waited.outcome is not None
    assert "wake() was not called" in waited.describe()
    assert waited.result() is waited.outcome  # a lost wake still has its outcome


def test_at_deadline_return_reports_what_never_came_and_cancels_nothing():
    backend = Backendish()
    sub = submit(backend, Direction.PUBLISH, VIEW, HINT)
    waited = wait(sub, 0.02, at_deadline=AtDeadline.RETURN)
    assert waited.status is WaitStatus.EXPIRED and waited.missing == "conclude" and waited.keeps_lease
    assert backend.attempts[0].cancels == 0 and not waited.cancelled
    with pytest.raises(WaitExpired, match="did not conclude"):
        waited.result()

    backend.attempts[0].finish(quiet=False)
    waited = wait(sub, 0.02, at_deadline=AtDeadline.RETURN)
    assert waited.status is WaitStatus.EXPIRED and waited.missing == "quiesce" and waited.outcome is not None
    assert wait(sub, 0.02, quiesce=False).status is WaitStatus.DONE  # concluded is enough when asked


def test_at_deadline_cancel_cancels_and_waits_the_grace_for_quiescence():
    backend = Backendish()
    sub = submit(backend, Direction.FETCH, VIEW, HINT)
    waited = wait(sub, 0.02, grace_s=30.0)
    assert backend.attempts[0].cancels == 1
    assert waited.status is WaitStatus.DONE and waited.cancelled and waited.timed_out
    assert waited.outcome is not None and waited.outcome.is_cancelled and not waited.keeps_lease


def test_an_attempt_that_never_quiesces_keeps_its_lease():
    backend = Backendish(on_cancel="conclude-only")
    sub = submit(backend, Direction.FETCH, VIEW, HINT)
    waited = wait(sub, 0.02, grace_s=0.02)
    assert backend.attempts[0].cancels == 1
    assert waited.status is WaitStatus.EXPIRED and waited.missing == "quiesce" and waited.keeps_lease
    assert waited.outcome is not None and waited.outcome.is_cancelled


def test_a_concluded_attempt_is_not_cancelled_at_the_deadline():
    backend = Backendish()
    sub = submit(backend, Direction.PUBLISH, VIEW, HINT)
    backend.attempts[0].finish(quiet=False)
    waited = wait(sub, 0.02, grace_s=0.02)
    assert backend.attempts[0].cancels == 0 and waited.status is WaitStatus.EXPIRED and waited.keeps_lease


def test_a_cancel_token_cancels_from_another_thread():
    backend = Backendish()
    token = Cancel()
    sub = submit(backend, Direction.FETCH, VIEW, HINT)
    t = later(token.cancel)
    waited = wait(sub, 30.0, cancel=token)
    t.join()
    assert backend.attempts[0].cancels == 1 and waited.cancelled and not waited.timed_out
    assert waited.status is WaitStatus.DONE and waited.outcome is not None and waited.outcome.is_cancelled
    assert sub.wakes.nudges >= 1


def test_a_token_cancelled_before_the_wait_cancels_at_once():
    backend = Backendish()
    token = Cancel()
    token.cancel()
    waited = wait(submit(backend, Direction.FETCH, VIEW, HINT), 30.0, cancel=token)
    assert waited.cancelled and waited.outcome is not None and waited.outcome.is_cancelled


def test_many_attempts_share_one_condition():
    backend = Backendish()
    wakes = Wakes()
    subs = [submit(backend, Direction.FETCH, VIEW, HINT, wakes=wakes) for _ in range(4)]
    backend.attempts[2].finish()
    first = wait_any(subs, 30.0)
    assert [w.submission for w in first] == [subs[2]] and first[0].status is WaitStatus.DONE
    threads = [later(a.finish) for i, a in enumerate(backend.attempts) if i != 2]
    every = wait_all(subs, 30.0)
    for t in threads:
        t.join()
    assert [w.submission for w in every] == subs and all(w.status is WaitStatus.DONE for w in every)

    with pytest.raises(ValueError, match="share one Wakes"):
        wait_all([subs[0], submit(backend, Direction.FETCH, VIEW, HINT)], 1.0)


def test_wait_any_that_runs_out_reports_every_submission_expired():
    backend = Backendish()
    wakes = Wakes()
    subs = [submit(backend, Direction.FETCH, VIEW, HINT, wakes=wakes) for _ in range(2)]
    out = wait_any(subs, 0.02)
    assert [w.status for w in out] == [WaitStatus.EXPIRED] * 2
    assert all(a.cancels == 0 for a in backend.attempts)


class Checked(Submission):
    """What the conformance suite does: check every answer on the way."""

    answers: list[object]

    def poll(self) -> Outcome | None:
        out = super().poll()
        self.__dict__.setdefault("answers", []).append(out)
        return out


def test_a_subclass_sees_every_answer_and_the_lock_guards_each_call():
    backend = Backendish()
    sub = submit(backend, Direction.FETCH, VIEW, HINT, kind=Checked)
    assert isinstance(sub, Checked)
    held: list[bool] = []
    lock = threading.RLock()

    attempt = backend.attempts[0]
    original = attempt.poll

    def poll() -> Outcome | None:
        held.append(lock._is_owned())  # type: ignore[attr-defined]
        return original()

    attempt.poll = poll  # type: ignore[method-assign]
    t = later(attempt.finish)
    waited = wait(sub, 30.0, lock=lock)
    t.join()
    assert waited.status is WaitStatus.DONE
    assert sub.answers and sub.answers[-1] is waited.outcome and all(held)
    assert np.all([a is None or isinstance(a, Outcome) for a in sub.answers])
