"""The serving loop and the drain (``kvwire.holding``): pins come back once an answer quiesced,
at once after a refusal, and only after the drain for a publish that raised otherwise; the drain
releases nothing while ``shutdown()`` is not empty. Scripted backend, no torch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from test_holding import Backendish, Scripted

from kvwire.contract import Attempt, Hint, PullRequest, SubmissionRejected, View
from kvwire.contract.serving import ServesPulls
from kvwire.holding import Direction, ServingLoop, Submission, Wakes, drain


def request(blocks: int = 2, groups: Sequence[int] = (0,)) -> PullRequest:
    return PullRequest(Hint.of("ticket", id=b"t"), tuple(groups), tuple(64 for _ in groups),
                       np.zeros((blocks, 32), dtype=np.uint8))


class Serving(Backendish, ServesPulls):
    def __init__(self, raises: BaseException | None = None) -> None:
        super().__init__()
        self.waiting: list[PullRequest] = []
        self.declined: list[str] = []
        self.raises = raises
        self.pending: frozenset[Attempt] = frozenset()
        self.shutdowns = 0
        self.closed = False

    def address(self) -> bytes:
        return b"here"

    def serve(self, wake):  # type: ignore[no-untyped-def, override]
        self.serve_wake = wake

    def incoming(self) -> tuple[PullRequest, ...]:
        out, self.waiting = tuple(self.waiting), []
        return out

    def decline(self, request: PullRequest, reason: str) -> None:
        self.declined.append(reason)

    def publish(self, view: View, hint: Hint, wake):  # type: ignore[no-untyped-def, override]
        if self.raises is not None:
            raise self.raises
        return super().publish(view, hint, wake)

    def shutdown(self) -> frozenset[Attempt]:
        self.shutdowns += 1
        return self.pending

    def close(self) -> None:
        self.closed = True


def loop_over(backend: Serving, pins: list[str]) -> ServingLoop[str]:
    def pin(req: PullRequest) -> tuple[View, str]:
        pins.append("pin")
        return View(()), "held"

    return ServingLoop(backend, pin, lambda held: pins.append("unpin"),
                       fit=lambda req: None if req.blocks else "no blocks asked")


def test_an_answer_unpins_once_it_quiesced_not_before():
    backend, pins = Serving(), []
    loop = loop_over(backend, pins)
    backend.waiting.append(request())
    loop.step()
    assert backend.ops == ["publish"] and pins == ["pin"] and loop.answering == 1
    attempt: Scripted = backend.attempts[0]
    attempt.finish(quiet=False)
    loop.sweep()
    assert pins == ["pin"], "unpinned before the answer quiesced (N2.9)"
    attempt.quiet = True
    assert [r.outcome for r in loop.sweep()] == [attempt.outcome]
    assert pins == ["pin", "unpin"] and loop.answering == 0 and loop.wait_answered(0.1)


def test_a_misfit_is_declined_and_nothing_is_pinned():
    backend, pins = Serving(), []
    loop = loop_over(backend, pins)
    backend.waiting.append(request(blocks=0))
    loop.step()
    assert backend.declined == ["no blocks asked"] and pins == [] and loop.declined == 1


def test_a_refused_answer_unpins_at_once_and_declines():
    backend, pins = Serving(raises=SubmissionRejected("full")), []
    loop = loop_over(backend, pins)
    backend.waiting.append(request())
    loop.step()
    assert pins == ["pin", "unpin"] and backend.declined == ["cannot answer now: full"]


def test_an_answer_that_raised_keeps_its_pins_until_the_drain_is_empty():
    backend, pins = Serving(raises=RuntimeError("lost")), []
    loop = loop_over(backend, pins)
    backend.waiting.append(request())
    with pytest.raises(RuntimeError):
        loop.step()
    assert pins == ["pin"] and loop.kept == ["held"]
    backend.pending = frozenset({Scripted(Wakes())})
    assert drain(backend, 0.05, release=(loop.release_all,)) == backend.pending
    assert pins == ["pin"] and not backend.closed, "released while shutdown() was not empty (B3.7)"
    assert backend.shutdowns >= 2
    backend.pending = frozenset()
    assert drain(backend, 1.0, release=(loop.release_all,)) == frozenset()
    assert pins == ["pin", "unpin"] and backend.closed


def test_a_tracked_offer_unpins_once_it_quiesced():
    backend, pins = Serving(), []
    loop = loop_over(backend, pins)
    sub_attempt = Scripted(loop.wakes)
    loop.track(Submission(Direction.PUBLISH, backend, View(()), sub_attempt, loop.wakes), "offered")
    loop.sweep()
    assert pins == [] and loop.answering == 0, "an offer is no answer to a pull"
    sub_attempt.finish()
    loop.sweep()
    assert pins == ["unpin"]
