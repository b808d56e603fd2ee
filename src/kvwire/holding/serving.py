"""The serving holder (N2.8, N2.9, O1): take the pulls ``incoming()`` hands over, decline those
that do not fit this cache, pin the longest held prefix of the others, publish it with the
request's ticket, and give the pins back once that answer concluded and quiesced, whatever its
outcome. Standing offers (O1) are tracked the same way: their pins come back once the offer
quiesced.

It is the one serving loop kvwire has: each holder gives it only how to pin a request's names
(and to say what rows hold them) and how to unpin them; the ``Worker``, the UCX test holders and
the UCX bench use it. It owns no thread: the holder calls :meth:`ServingLoop.step` after a wake
of :attr:`ServingLoop.wakes` (the serve wake and every answer's wake)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvwire import waiting
from kvwire.contract import Backend, Outcome, View
from kvwire.contract.errors import SubmissionError
from kvwire.contract.serving import PullRequest, ServesPulls
from kvwire.holding.loop import Direction, Submission, Wakes, submit

__all__ = ["ServingLoop", "Reply"]

H = TypeVar("H")


@dataclass(eq=False)
class Reply(Generic[H]):
    """An answer in flight, or a standing offer: its submission, the request it answers
    (``None`` for an offer), and what its pins are (given back to ``unpin`` once it quiesced)."""

    submission: Submission
    held: H
    request: PullRequest | None = None
    released: bool = field(default=False)

    @property
    def outcome(self) -> Outcome | None:
        return self.submission.outcome


class ServingLoop(Generic[H]):
    """Answers ``backend``'s pulls. ``pin(request)`` pins the longest prefix of the request's
    names this cache holds and returns the view of those rows (per requested group, in order;
    possibly no rows) with a handle for ``unpin``; it may raise, and then keeps or gives back its
    own pins. ``fit(request)`` returns ``None`` to answer, or the reason to decline it (other
    groups or row sizes, credentials). ``lock`` is held around every call into the backend (B2).

    ``on_declined(request, reason, refused)`` hears of each decline (``refused``: by ``fit``;
    else the backend refused the answer, S3, and the pins came back at once);
    ``on_served(reply)`` of each answer in flight, after it is tracked."""

    def __init__(self, backend: Backend, pin: Callable[[PullRequest], tuple[View, H]], unpin: Callable[[H], object],
                 *, fit: Callable[[PullRequest], str | None] | None = None, wakes: Wakes | None = None,
                 lock: AbstractContextManager[object] | None = None,
                 on_declined: Callable[[PullRequest, str, bool], object] | None = None,
                 on_served: Callable[[Reply[H]], object] | None = None) -> None:
        if not isinstance(backend, ServesPulls):
            raise TypeError("a serving loop needs a backend that implements kvwire.contract.ServesPulls")
        self.backend = backend
        self.serving: ServesPulls = backend
        self.pin = pin
        self.unpin = unpin
        self.fit = fit
        self.wakes = Wakes() if wakes is None else wakes
        self.lock: AbstractContextManager[object] = lock if lock is not None else nullcontext()
        self.on_declined = on_declined
        self.on_served = on_served
        self.served = 0
        self.declined = 0
        #: Pins of answers whose publish raised something other than a refusal: the backend may
        #: touch their rows until ``shutdown()`` returns the empty set (S4.2); :meth:`release_all`.
        self.kept: list[H] = []
        self._replies: list[Reply[H]] = []
        self.changed = threading.Condition()  # notified after each sweep; guards the replies

    def serve(self) -> None:
        """``serve(wakes)``: from now on pulls reach :meth:`take`."""
        with self.lock:
            self.serving.serve(self.wakes)

    def take(self) -> tuple[PullRequest, ...]:
        """The pulls that arrived since the last look (``incoming()``)."""
        with self.lock:
            return tuple(self.serving.incoming())

    def step(self) -> None:
        """Answer every pull that arrived, then give back the pins of answers and offers that
        concluded and quiesced."""
        for request in self.take():
            self.answer(request)
        self.sweep()

    def decline(self, request: PullRequest, reason: str, refused: bool = True) -> None:
        with self.lock:
            self.serving.decline(request, reason)
        self.declined += 1
        if self.on_declined is not None:
            self.on_declined(request, reason, refused)

    def answer(self, request: PullRequest) -> Reply[H] | None:
        """Decline ``request`` if it does not fit; else pin its held prefix and publish it with
        the request's ticket. ``None`` when declined (nothing stays pinned). A publish the
        backend refuses gives the pins back and declines; any other exception keeps them
        (:attr:`kept`) and propagates."""
        reason = self.fit(request) if self.fit is not None else None
        if reason is not None:
            self.decline(request, reason)
            return None
        view, held = self.pin(request)
        try:
            with self.lock:
                sub: Submission = submit(self.backend, Direction.PUBLISH, view, request.ticket, wakes=self.wakes)
        except SubmissionError as exc:  # S3: nothing escaped
            self.unpin(held)
            self.decline(request, f"cannot answer now: {exc}", refused=False)
            return None
        except BaseException:
            self.kept.append(held)  # S4: until shutdown() is empty
            raise
        reply = Reply(sub, held, request)
        # In flight before anyone hears of it: a wait on another thread must find it not ended.
        with self.changed:
            self._replies.append(reply)
        self.served += 1
        if self.on_served is not None:
            self.on_served(reply)
        self.wakes.nudge()  # look at the reply again soon, even if it is done already
        return reply

    def track(self, sub: Submission, held: H) -> Reply[H]:
        """Give ``held`` back to ``unpin`` once ``sub`` (a standing offer, O1.6) concluded and
        quiesced."""
        reply = Reply(sub, held)
        with self.changed:
            self._replies.append(reply)
        self.wakes.nudge()
        return reply

    def sweep(self) -> list[Reply[H]]:
        """Unpin every answer and offer that concluded and quiesced (N2.9, on every outcome
        alike); the ended ones."""
        with self.changed:
            live = list(self._replies)
        ended = []
        for reply in live:
            with self.lock:
                done = reply.submission.look(quiesce=True)
            if done:
                ended.append(reply)
        for reply in ended:
            self.unpin(reply.held)
            reply.released = True
        with self.changed:
            self._replies = [r for r in self._replies if not r.released]
            self.changed.notify_all()
        return ended

    @property
    def answering(self) -> int:
        """Answers to pulls in flight (standing offers not counted)."""
        with self.changed:
            return sum(1 for r in self._replies if r.request is not None)

    @property
    def in_flight(self) -> list[Reply[H]]:
        with self.changed:
            return list(self._replies)

    def wait_answered(self, timeout_s: float) -> bool:
        """Wait until every answer to a pull has ended and its pins are back."""
        with self.changed:
            return waiting.wait_for(self.changed, lambda: not any(r.request is not None for r in self._replies),
                                    timeout_s)

    def release_all(self) -> None:
        """Unpin everything still tracked or kept: only once ``shutdown()`` returned the empty set
        (B3.7), when no attempt touches the rows any more."""
        with self.changed:
            replies, self._replies = self._replies, []
            self.changed.notify_all()
        for reply in replies:
            if not reply.released:
                reply.released = True
                self.unpin(reply.held)
        kept, self.kept = self.kept, []
        for held in kept:
            self.unpin(held)
