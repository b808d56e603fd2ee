"""The holder loop: how a lease holder submits a view to a backend and waits for the attempt, as
the contract says (S1-S5, A1-A8, W1, B2). It is the one wait kvwire has; the ``Worker``, the
benches, the vLLM connector and (through a subclass of :class:`Submission`) the conformance suite
use it, and an engine integrating kvwire calls it the same way (``docs/holding.md``).

Imports only ``kvwire.contract``, numpy and the standard library: no torch.

Words: an attempt has *concluded* once ``poll()`` answers an outcome, and has *quiesced* once
``quiesced()`` is true (A2). A wait is *done* when the attempt has concluded and, when asked,
quiesced. The wait looks at the attempt only after a wake (W1), so a wake that never came is
noticed (:attr:`WaitStatus.UNWOKEN`) rather than papered over by polling."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TypeVar

from kvwire import waiting
from kvwire.contract import Attempt, Backend, Hint, Outcome, View

__all__ = [
    "Direction", "Wakes", "Cancel", "Submission", "submit", "wait", "wait_all", "wait_any",
    "AtDeadline", "WaitStatus", "Waited", "WaitExpired", "QUIESCE_GRACE_S",
]

#: How long a wait that cancelled an attempt at its deadline waits for it to quiesce (A8).
QUIESCE_GRACE_S = 5.0

S = TypeVar("S", bound="Submission")

#: The guard of a wait given no lock (a nullcontext keeps no state, so one serves every wait).
_NO_LOCK: AbstractContextManager[object] = nullcontext()


class Direction(enum.StrEnum):
    """Which way a submission moves rows (S1). A ``StrEnum``: it reads and prints as its value."""

    FETCH = "fetch"      # fill the view's rows from the other end
    PUBLISH = "publish"  # offer the view's rows to the other end


class Wakes:
    """A ``WakeFn`` that counts its calls, with a condition to sleep on until the next one.

    Cheap and non-blocking, callable from any thread; it never calls into a backend (W1). One
    ``Wakes`` may serve many submissions (one condition, many attempts). :meth:`nudge` wakes a
    sleeper for a holder-side reason (a cancel asked) without counting as a backend's wake."""

    __slots__ = ("_cond", "_count", "_nudges")

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0
        self._nudges = 0

    def __call__(self) -> None:
        with self._cond:
            self._count += 1
            self._cond.notify_all()

    def nudge(self) -> None:
        with self._cond:
            self._nudges += 1
            self._cond.notify_all()

    @property
    def count(self) -> int:
        """Backend wakes so far."""
        with self._cond:
            return self._count

    @property
    def nudges(self) -> int:
        with self._cond:
            return self._nudges

    def wait_beyond(self, seen: int, deadline: float, nudges: int | None = None) -> bool:
        """Sleep until more than ``seen`` wakes have come (or, given ``nudges``, more nudges than
        that); false once the monotonic ``deadline`` passes without one."""
        with self._cond:
            while self._count <= seen and (nudges is None or self._nudges <= nudges):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(waiting.piece(left))
            return True


class Cancel:
    """A holder-side cancellation token: :meth:`cancel`, from any thread, asks every wait that
    watches it to cancel its attempt. The wait still waits for quiescence afterwards."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._watchers: list[Callable[[], None]] = []

    def cancel(self) -> None:
        with self._lock:
            self._set = True
            watchers = list(self._watchers)
        for notify in watchers:
            notify()

    @property
    def cancelled(self) -> bool:
        return self._set

    def watch(self, notify: Callable[[], None]) -> None:
        """Call ``notify`` on :meth:`cancel` (at once, if already cancelled)."""
        with self._lock:
            self._watchers.append(notify)
            fire = self._set
        if fire:
            notify()

    def unwatch(self, notify: Callable[[], None]) -> None:
        with self._lock:
            if notify in self._watchers:
                self._watchers.remove(notify)


@dataclass(eq=False)
class Submission:
    """One submission as its holder tracks it: what was submitted, the attempt, its wakes, the
    outcome once ``poll()`` answered one, and whether ``quiesced()`` has answered true.

    :meth:`poll` and :meth:`quiesced` are the only ways the holder loop looks at the attempt; a
    subclass overrides them to check every answer (the conformance suite checks A1, A2, A5, A6
    there) and must call the base method or keep ``outcome``/``quiesced_seen`` itself."""

    op: Direction
    backend: Backend
    view: View
    attempt: Attempt
    wakes: Wakes
    outcome: Outcome | None = None
    quiesced_seen: bool = False

    def poll(self) -> Outcome | None:
        """``attempt.poll()``; the first outcome it answers is kept in ``outcome``."""
        out = self.attempt.poll()
        if out is not None and self.outcome is None:
            self.outcome = out
        return out

    def quiesced(self) -> bool:
        """``attempt.quiesced()``; once true, ``quiesced_seen`` stays true."""
        q = bool(self.attempt.quiesced())
        if q:
            self.quiesced_seen = True
        return q

    def cancel(self) -> None:
        self.attempt.cancel()

    @property
    def concluded(self) -> bool:
        """Whether an outcome has been seen (without asking the attempt again)."""
        return self.outcome is not None

    def look(self, quiesce: bool) -> bool:
        """Asks the attempt: concluded, and (with ``quiesce``) quiesced? Quiescence is asked only
        once concluded, then every time until true."""
        if self.poll() is None:
            return False
        return not quiesce or self.quiesced_seen or self.quiesced()


def submit(backend: Backend, op: Direction, view: View, hint: Hint, *, wakes: Wakes | None = None,
           kind: type[S] = Submission) -> S:  # type: ignore[assignment]
    """Submit ``view`` as it stands (S1) with ``wakes`` (a fresh :class:`Wakes` by default) and
    track it as a ``kind``. Whatever the backend raises propagates unchanged: after
    ``SubmissionRejected``/``InvalidSubmission`` nothing escaped and the lease may be released
    at once (S3); after any other exception the holder keeps the lease until ``shutdown()``
    returns an empty set (S4)."""
    if not isinstance(op, Direction):
        raise TypeError(f"op must be a Direction, got {op!r}")
    wakes = Wakes() if wakes is None else wakes
    call = backend.fetch if op is Direction.FETCH else backend.publish
    attempt = call(view, hint, wakes)
    return kind(op, backend, view, attempt, wakes)


class AtDeadline(enum.Enum):
    """What a wait does when its deadline passes and the attempt is not done."""

    #: Cancel the attempt (unless it has concluded), then wait ``grace_s`` more for it (A4, A8).
    CANCEL = "cancel"
    #: Stop waiting and report :attr:`WaitStatus.EXPIRED`; the attempt is left as it is.
    RETURN = "return"


class WaitStatus(enum.Enum):
    """How a wait ended."""

    #: Done, and seen after a wake.
    DONE = "done"
    #: Done, but seen only by the last look when the wait ran out: no wake came after the change
    #: became visible, so a holder that sleeps until woken would never have seen it (W1 broken).
    UNWOKEN = "unwoken"
    #: The wait ran out (after the grace, when it cancelled) and the attempt is still not done.
    EXPIRED = "expired"


class WaitExpired(TimeoutError):
    """:meth:`Waited.result` of a wait that ran out; ``waited`` says what was missing."""

    def __init__(self, waited: Waited) -> None:
        self.waited = waited
        super().__init__(waited.describe())


@dataclass(frozen=True, slots=True)
class Waited:
    """What a wait saw. ``outcome`` is set once the attempt concluded; ``quiesced`` says whether
    its memory access is proven ended; ``cancelled`` whether this wait called ``cancel()``
    (for a :class:`Cancel` token or at the deadline); ``timed_out`` whether the wait's deadline
    passed at least once; ``wakes`` the backend wakes so far."""

    submission: Submission
    status: WaitStatus
    outcome: Outcome | None
    quiesced: bool
    cancelled: bool
    timed_out: bool
    wakes: int

    @property
    def keeps_lease(self) -> bool:
        """True while the backend may still touch the view's memory: the holder must keep the
        lease until the attempt reports ``quiesced()`` later, or ``shutdown()`` returns an empty
        set (S2, S4, B3)."""
        return not self.quiesced

    @property
    def missing(self) -> str | None:
        """``"conclude"`` or ``"quiesce"``: what an expired wait waited for in vain."""
        if self.status is not WaitStatus.EXPIRED:
            return None
        return "conclude" if self.outcome is None else "quiesce"

    def describe(self) -> str:
        sub = self.submission
        if self.status is WaitStatus.EXPIRED:
            after = " after it was cancelled" if self.cancelled else ""
            return f"the {sub.op.value} did not {self.missing} in time{after} ({self.wakes} wake(s) so far)"
        if self.status is WaitStatus.UNWOKEN:
            return (f"the {sub.op.value} was done, but wake() was not called after that became visible "
                    f"({self.wakes} wake(s) so far)")
        return f"the {sub.op.value} is done: {self.outcome!r}"

    def result(self) -> Outcome:
        """The outcome of a done wait (``DONE`` or ``UNWOKEN``); raises :class:`WaitExpired`
        for an expired one."""
        if self.status is WaitStatus.EXPIRED or self.outcome is None:
            raise WaitExpired(self)
        return self.outcome


def wait(sub: Submission, timeout_s: float, *, quiesce: bool = True,
         at_deadline: AtDeadline = AtDeadline.CANCEL, grace_s: float = QUIESCE_GRACE_S,
         cancel: Cancel | None = None, lock: AbstractContextManager[object] | None = None) -> Waited:
    """Sleep until woken, then look (:meth:`Submission.look`), until the attempt is done or
    ``timeout_s`` passes. See :func:`wait_all`."""
    return wait_all((sub,), timeout_s, quiesce=quiesce, at_deadline=at_deadline, grace_s=grace_s,
                    cancel=cancel, lock=lock)[0]


def wait_all(subs: Sequence[Submission], timeout_s: float, *, quiesce: bool = True,
             at_deadline: AtDeadline = AtDeadline.CANCEL, grace_s: float = QUIESCE_GRACE_S,
             cancel: Cancel | None = None, lock: AbstractContextManager[object] | None = None
             ) -> tuple[Waited, ...]:
    """Wait for every submission in ``subs`` (which share one :class:`Wakes`) to be done:
    concluded and, with ``quiesce``, quiesced. Returns one :class:`Waited` per submission, in
    order, and never raises for the attempts' sake.

    It looks only after a wake (W1); when ``timeout_s`` passes it looks once more, and an
    attempt done by then without a wake after the change is ``UNWOKEN``. With
    ``AtDeadline.CANCEL`` it then cancels every attempt not yet concluded and waits up to
    ``grace_s`` more; what is still not done is ``EXPIRED`` (``keeps_lease`` says whether the
    lease must be kept). ``cancel`` (a :class:`Cancel`) cancels the attempts not yet concluded
    when it fires and shortens the wait to ``grace_s``. ``lock`` is held around every call into
    the backend (B2: one call sequence), never while sleeping."""
    return _wait(subs, timeout_s, quiesce, at_deadline, grace_s, cancel, lock, any_done=False)


def wait_any(subs: Sequence[Submission], timeout_s: float, *, quiesce: bool = True,
             lock: AbstractContextManager[object] | None = None) -> tuple[Waited, ...]:
    """Wait until at least one of ``subs`` (sharing one :class:`Wakes`) is done, or
    ``timeout_s`` passes; returns a :class:`Waited` for each submission done by then (several
    may be), or, when the wait ran out with none done, for every submission (all ``EXPIRED``).
    Never cancels: a pipelining holder decides what to do with the rest."""
    return _wait(subs, timeout_s, quiesce, AtDeadline.RETURN, 0.0, None, lock, any_done=True)


def _wait(subs: Sequence[Submission], timeout_s: float, quiesce: bool, at_deadline: AtDeadline,
          grace_s: float, cancel: Cancel | None, lock: AbstractContextManager[object] | None,
          any_done: bool) -> tuple[Waited, ...]:
    if not subs:
        return ()
    if not isinstance(at_deadline, AtDeadline):
        raise TypeError(f"at_deadline must be an AtDeadline, got {at_deadline!r}")
    wakes = subs[0].wakes
    if len(subs) > 1 and any(s.wakes is not wakes for s in subs):
        raise ValueError("the submissions of one wait share one Wakes (submit(..., wakes=shared))")
    guard: AbstractContextManager[object] = lock if lock is not None else _NO_LOCK
    deadline = time.monotonic() + timeout_s
    done: dict[int, WaitStatus] = {}
    cancelled: set[int] = set()
    passed = False   # the deadline passed and AtDeadline.CANCEL cancelled what was pending
    ran_out = False  # the deadline passed at least once
    if cancel is not None:
        cancel.watch(wakes.nudge)
    try:
        while True:
            # Read without the condition's lock (an int read is atomic): a value read stale is
            # only lower, which costs one more look, and wait_beyond compares under the lock.
            seen, nudged = wakes._count, wakes._nudges
            with guard:
                for i, sub in enumerate(subs):
                    if i not in done and sub.look(quiesce):
                        done[i] = WaitStatus.DONE
            if len(done) == len(subs) or (any_done and done):
                break
            if cancel is not None and cancel.cancelled and not passed:
                if _cancel_pending(subs, done, cancelled, guard):
                    deadline = min(deadline, time.monotonic() + grace_s)
                    continue
            if wakes.wait_beyond(seen, deadline, nudged if cancel is not None else None):
                continue
            ran_out = True
            # The wait ran out with no new wake: one last look tells a lost wake from a stall.
            with guard:
                for i, sub in enumerate(subs):
                    if i not in done and sub.look(quiesce):
                        done[i] = WaitStatus.UNWOKEN
            if len(done) == len(subs) or (any_done and done):
                break
            if at_deadline is AtDeadline.RETURN or passed:
                break
            passed = True
            _cancel_pending(subs, done, cancelled, guard)
            deadline = time.monotonic() + grace_s
    finally:
        if cancel is not None:
            cancel.unwatch(wakes.nudge)
    count = wakes._count
    picked = sorted(done) if any_done and done else range(len(subs))
    return tuple(
        Waited(subs[i], done.get(i, WaitStatus.EXPIRED), subs[i].outcome, subs[i].quiesced_seen, i in cancelled,
               ran_out, count)
        for i in picked
    )


def _cancel_pending(subs: Sequence[Submission], done: dict[int, WaitStatus], cancelled: set[int],
                    guard: AbstractContextManager[object]) -> bool:
    """Cancels every attempt not yet concluded nor cancelled; whether it cancelled any."""
    fresh = [i for i, s in enumerate(subs) if i not in done and i not in cancelled and s.outcome is None]
    with guard:
        for i in fresh:
            subs[i].cancel()
    cancelled.update(fresh)
    return bool(fresh)
