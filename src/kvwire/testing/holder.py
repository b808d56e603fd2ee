"""The suite's lease holder: it submits, then waits only on wakes, as a runtime does, and checks
every answer the backend gives on the way (A1, A2, A5, A6, W1).

Each check fails with an ``AssertionError`` whose message starts with the rule it enforces."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from kvwire import holding
from kvwire.contract import Attempt, Backend, Cause, Hint, InvalidSubmission, Outcome, View
from kvwire.contract.errors import SubmissionError

__all__ = ["Wakes", "RaisingWakes", "Submission", "submit", "settle", "check_outcome", "same_outcome",
           "call_briefly", "wait_for", "refused", "check_refusal_message", "speaks_causes", "declares", "holder_call",
           "BLOCKING_LIMIT_S"]

T = TypeVar("T")

#: The causes a failed outcome may carry (A10.3), and a cancelled one (A10.4).
FAILED_CAUSES = frozenset({Cause.DEADLINE, Cause.FAULT, Cause.PEER_GONE, Cause.DECLINED, Cause.SHUTDOWN})
CANCELLED_CAUSES = frozenset({Cause.HOLDER_CANCELLED, Cause.PEER_CANCELLED, Cause.SHUTDOWN})

#: Where a :class:`Submission` keeps a copy of its outcome's masks as ``poll()`` first answered them.
FIRST_MASKS = "masks at first poll"

#: A call that must never block (poll, quiesced, cancel, wake) fails the suite when it has not
#: returned after this long.
BLOCKING_LIMIT_S = 1.0


#: Which call of the holder's into a backend the current thread is inside, if any (W1.6).
_inside = threading.local()


class holder_call:
    """Marks the current thread as inside a call the holder made to a backend (``what``), so a
    wake that comes from inside it is noticed (W1.6)."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        self.outer = getattr(_inside, "what", None)
        _inside.what = self.what

    def __exit__(self, *exc: object) -> None:
        _inside.what = self.outer


class Wakes(holding.Wakes):
    """The holder loop's counting ``WakeFn`` (:class:`kvwire.holding.Wakes`), which also
    records a wake that came from inside a call the holder made to the backend (W1.6). The
    suite never calls into a backend from inside it (W1)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside: list[str] = []

    def __call__(self) -> None:
        what = getattr(_inside, "what", None)
        if what is not None:
            self.inside.append(what)
        super().__call__()


class RaisingWakes(Wakes):
    """A wake that counts its call, then raises: a backend survives it and goes on (W1.7)."""

    def __call__(self) -> None:
        super().__call__()
        raise RuntimeError("kvwire suite: this wake raises on purpose")


@dataclass(eq=False)
class Submission(holding.Submission):
    """One submission as the suite tracks it, in the holder loop of :mod:`kvwire.holding`:
    what was submitted, the attempt, its wakes, and what the backend has said so far; every
    answer is checked as it comes."""

    wakes: Wakes  # the suite's own, which also notes a wake from inside a holder's call (W1.6)
    extra: dict[str, Any] = field(default_factory=dict)

    def poll(self) -> Outcome | None:
        """``attempt.poll()``, checked: an ``Outcome`` or ``None``, and once an outcome, the
        same one on every later call (A1); a failure arrives in it, never as an exception (S5)."""
        try:
            with holder_call("poll()"):
                out = self.attempt.poll()
        except Exception as exc:
            raise AssertionError(f"S5: poll() of a {self.op} raised {type(exc).__name__}: {exc}; once a submission "
                                 "returned an attempt, every failure travels in its outcome") from exc
        if out is None:
            assert self.outcome is None, (
                f"A1: poll() of a {self.op} answered {self.outcome!r} before and None now; "
                "after it concludes, poll() gives the same outcome on every call")
            return None
        assert isinstance(out, Outcome), (
            f"A5: poll() of a {self.op} must answer an Outcome or None, got {type(out).__name__}")
        if self.outcome is None:
            check_outcome(out, self.view, self.op, speaks_causes(self.backend))
            self.outcome = out
            self.extra[FIRST_MASKS] = tuple(np.array(m, dtype=bool, copy=True) for m in out.masks)
        else:
            same_outcome(self.outcome, out, self.op)
            self.masks_unchanged()
        return out

    def masks_unchanged(self) -> None:
        """A6.5: the masks of the outcome are the bits they were when ``poll()`` first answered it
        (the same object answered again may have had its masks written since)."""
        first = self.extra.get(FIRST_MASKS)
        if self.outcome is None or first is None:
            return
        for gi, (now, then) in enumerate(zip(self.outcome.masks, first, strict=True)):
            assert np.array_equal(now, then), (
                f"A6.5: mask {gi} of the {self.op}'s {self.outcome.status.value} outcome changed after poll() first "
                f"answered it (it was {then.astype(int).tolist()}, now {np.asarray(now).astype(int).tolist()}); an "
                "outcome's masks never change")

    def quiesced(self) -> bool:
        """``attempt.quiesced()``, checked: a bool that stays true once true (A2)."""
        try:
            with holder_call("quiesced()"):
                q = self.attempt.quiesced()
        except Exception as exc:
            raise AssertionError(f"S5: quiesced() of a {self.op} raised {type(exc).__name__}: {exc}") from exc
        assert isinstance(q, (bool, np.bool_)), f"A2: quiesced() must answer a bool, got {type(q).__name__}"
        if self.quiesced_seen:
            assert q, f"A2: quiesced() of a {self.op} answered True before and False now; it stays true"
        self.quiesced_seen = bool(q)
        return bool(q)


def speaks_causes(backend: Backend) -> bool:
    """Whether ``backend``'s declared version binds it to give a cause (A10) on every failed and
    cancelled outcome (contract 1.1 and later)."""
    return declares(backend, "A10.5")


def declares(backend: Backend, clause_id: str) -> bool:
    """Whether ``backend``'s declared version and protocols bind it to clause ``clause_id``
    (docs/contract.md, Versions): a test checks a later clause only where this is true."""
    from kvwire.contract.clauses import binds

    try:
        caps = backend.capabilities()
    except Exception:  # B4's tests report a backend whose capabilities() fails
        return False
    return binds(caps, clause_id)


def submit(backend: Backend, op: str, view: View, hint: Hint, wakes: Wakes | None = None) -> Submission:
    """Submit ``view`` as ``op`` ("fetch" or "publish") with ``wakes`` (a fresh :class:`Wakes` by
    default), through the holder loop's ``submit``. Whatever the backend raises propagates; what
    it returns must be an ``Attempt`` (S1)."""
    direction = holding.Direction(op)
    with holder_call(f"{direction}()"):
        sub = holding.submit(backend, direction, view, hint, wakes=Wakes() if wakes is None else wakes,
                             kind=Submission)
    assert isinstance(sub.attempt, Attempt), (
        f"S1: {direction}() must return an Attempt, got {type(sub.attempt).__name__}")
    return sub


def settle(sub: Submission, patience_s: float, *, quiesce: bool = True, purpose: str | None = None) -> Outcome:
    """Wait as a holder does, through the holder loop (:func:`kvwire.holding.wait`),
    looking only after each wake, until the attempt has concluded (and, with ``quiesce``,
    quiesced). Fails naming W1 if the change became visible but no wake came after it, W1.6 if
    a wake came from inside a call the holder made, and A3 or A8 (or ``purpose``, which names
    what the wait is for) if it never came within ``patience_s``."""
    waited = holding.wait(sub, patience_s, quiesce=quiesce, at_deadline=holding.AtDeadline.RETURN)
    if waited.status is holding.WaitStatus.EXPIRED:
        missing = waited.missing
        if purpose is not None:
            raise AssertionError(f"{purpose}: the {sub.op} did not {missing} within {patience_s:g} s "
                                 f"({sub.wakes.count} wake(s) so far)")
        raise AssertionError(
            f"A3/A8: the {sub.op} did not {missing} within {patience_s:g} s ({sub.wakes.count} wake(s) so far); "
            "a backend advances its own work and concludes every attempt by its deadline")
    if waited.status is holding.WaitStatus.UNWOKEN:
        raise AssertionError(
            f"W1: the {sub.op} {'concluded and quiesced' if quiesce else 'concluded'}, but wake() was not "
            f"called after that became visible (waited {patience_s:g} s after the last wake); a holder that "
            "sleeps until woken would never see it")
    out = waited.outcome
    assert out is not None
    # W1.2: the holder looks once right after submitting, so an attempt that concluded inside the
    # call is seen without a wake; a holder that sleeps until woken would never see it.
    assert sub.wakes.count or sub.wakes.wait_beyond(0, time.monotonic() + patience_s), (
        f"W1.2: the {sub.op} concluded, but its wake was never called (waited {patience_s:g} s); at least one "
        "wake follows each conclusion, also of an attempt that concluded at once")
    # A1/A2: what was answered stays answered; ask once more, as a holder may.
    sub.poll()
    if quiesce:
        sub.quiesced()
    assert not sub.wakes.inside or not declares(sub.backend, "W1.6"), (
        f"W1.6: the backend called the {sub.op}'s wake from inside {sub.wakes.inside[0]}, a call the holder "
        "made to it; a holder may hold a lock its wake takes while it calls the backend")
    return out


def check_outcome(out: Outcome, view: View, op: str, cause_required: bool = False) -> None:
    """What every outcome must look like: one plain, read-only, one-dimensional bool mask per
    view group, as long as the group (A5, A6); a failure says why."""
    assert isinstance(out, Outcome), f"A5: expected an Outcome, got {type(out).__name__}"
    masks = out.masks
    assert isinstance(masks, tuple) and len(masks) == len(view.groups), (
        f"A5: the {op} outcome carries {len(masks) if isinstance(masks, tuple) else masks!r} masks for "
        f"{len(view.groups)} view groups; it carries one per group")
    for group, mask in zip(view.groups, masks, strict=True):
        assert type(mask) is np.ndarray, (
            f"A6: the mask of group {group.group_id} is a {type(mask).__name__}, not a plain numpy.ndarray")
        assert mask.dtype == np.bool_, f"A6: the mask of group {group.group_id} has dtype {mask.dtype}, not bool"
        assert mask.ndim == 1 and mask.size == group.rows, (
            f"V1/A5: the mask for group {group.group_id} has shape {mask.shape}, the group {group.rows} rows; an "
            "outcome carries one mask per view group, in the view's order")
        assert not mask.flags.writeable, f"A6: the mask of group {group.group_id} is writable after hand-over"
    if out.is_failed:
        assert isinstance(out.reason, str) and out.reason.strip(), "A5.2: a failed outcome must say why"
    # Outcome's constructor refuses these, but a backend may build its outcome some other way
    # (a subclass, object.__setattr__): what the holder reads is checked here (A5.2, A5.3, A10).
    if out.is_delivered:
        assert out.reason is None, (
            f"A5.2: a delivered {op} outcome carries no reason; got reason {out.reason!r}")
        assert out.cause is None, f"A10.2: a delivered {op} outcome has no cause; got cause {out.cause!r}"
    assert not out.by_peer or out.is_cancelled, (
        f"A5.3: by_peer is true only on a cancelled outcome; the {op} outcome is {out.status.value} with "
        f"by_peer={out.by_peer!r}")
    assert out.cause is None or isinstance(out.cause, Cause), (
        f"A10.1: an outcome's cause is a kvwire.contract.Cause or None; the {op} outcome's is {out.cause!r}")
    if out.is_failed and out.cause is not None:
        assert out.cause in FAILED_CAUSES, (
            f"A10.3: a failed {op} outcome's cause is one of {sorted(c.name for c in FAILED_CAUSES)}; got "
            f"{out.cause.name}")
    if out.is_cancelled:
        assert out.cause in CANCELLED_CAUSES, (
            f"A10.4: a cancelled {op} outcome's cause is one of {sorted(c.name for c in CANCELLED_CAUSES)}; got "
            f"{out.cause!r}")
        assert (out.cause is Cause.PEER_CANCELLED) == bool(out.by_peer), (
            f"A10.4: a cancelled {op} outcome's cause is PEER_CANCELLED exactly when by_peer is true; got cause "
            f"{out.cause.name} with by_peer={out.by_peer}")
    if cause_required and not out.is_delivered:
        assert out.cause is not None, (
            f"A10.5: the backend speaks contract 1.1 or later, so its {out.status.value} {op} outcome must carry a cause "
            f"(kvwire.contract.Cause); got {out!r}")


def same_outcome(first: Outcome, later: Outcome, op: str) -> None:
    """A1: a later poll gives the same outcome: same status, reason and masks."""
    assert later is first or (
        later.status is first.status and later.reason == first.reason and later.by_peer == first.by_peer and later.cause is first.cause
        and len(later.masks) == len(first.masks)
        and all(np.array_equal(a, b) for a, b in zip(first.masks, later.masks, strict=True))
    ), f"A1: poll() of a {op} answered {first!r} and later {later!r}; it must give the same outcome"


def call_briefly(fn: Callable[[], T], what: str, limit_s: float = BLOCKING_LIMIT_S,
                 on_block: Callable[[], None] | None = None) -> T:
    """Run ``fn`` and fail naming ``what`` if it has not returned within ``limit_s``. When it
    blocks, ``on_block`` runs (e.g. to release a held store) so the stuck call can finish."""
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            with holder_call(what):
                result.append(fn())
        except BaseException as exc:  # re-raised in the test's thread
            error.append(exc)

    thread = threading.Thread(target=run, name=f"kvwire-suite-{what}", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        if on_block is not None:
            on_block()
        thread.join(10.0)
        raise AssertionError(f"{what} blocked for more than {limit_s:g} s; it must never block")
    if error:
        raise error[0]
    return result[0]  # type: ignore[no-any-return]


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait until ``condition()`` holds, re-checking on a short growing interval; fail saying
    ``what`` did not happen within ``timeout_s``. For conditions no wake announces (e.g. a
    held store receiving a call)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def refused(call: Callable[[], object], what: str,
            error: type[SubmissionError] = InvalidSubmission) -> SubmissionError:
    """Run ``call`` and fail unless it raises ``error`` with a message (S3.3); ``what`` names the
    submission and rule."""
    try:
        call()
    except error as exc:
        check_refusal_message(exc, what)
        return exc
    except Exception as exc:
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}; the contract refuses it with "
                             f"{error.__name__}") from exc
    raise AssertionError(f"{what} was accepted; the contract refuses it with {error.__name__}")


_CLAUSE_PREFIX = re.compile(r"^(?:[A-Z][0-9]+(?:\.[0-9]+)?(?: ?/ ?[A-Z][0-9]+(?:\.[0-9]+)?)*: )+")


def check_refusal_message(exc: BaseException, what: str) -> None:
    """S3.3: a refusal's message says what was wrong and what to do; an empty one says nothing."""
    assert str(exc).strip(), (
        f"S3.3: {_CLAUSE_PREFIX.sub('', what)} raised {type(exc).__name__} with an empty message; a refusal's "
        "message says what was wrong and what to do")
