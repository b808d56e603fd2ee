"""How the connector submits and waits, in one place, through kvwire's holder loop
(:mod:`kvwire.runtime.holding`): submit with the worker's one shared :class:`Wakes`, then look
at attempts only after wakes; never block the engine's step except where vLLM needs memory
back (a preemption, shutdown)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvwire.contract import Backend, Hint, Outcome, View
from kvwire.runtime.holding import (
    QUIESCE_GRACE_S,
    AtDeadline,
    Direction,
    Submission,
    Wakes,
    submit,
    wait,
    wait_any,
)

if TYPE_CHECKING:
    from kvwire_vllm.metadata import BlockPlan

__all__ = ["Transfer", "StepLoad", "UNSENT", "start", "finished", "doze", "wait_out", "QUIESCE_GRACE_S"]


@dataclass(eq=False)
class Transfer:
    """One submitted attempt of a request's blocks."""

    req_id: str
    op: Direction
    sub: Submission
    block_ids: tuple[int, ...]
    deadline: float  # monotonic: past it, the holder cancels the attempt if it has not concluded
    started: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    @property
    def view(self) -> View:
        return self.sub.view

    @property
    def outcome(self) -> Outcome | None:
        return self.sub.outcome

    def cancel(self) -> None:
        if not self.cancelled and self.sub.outcome is None:
            self.sub.cancel()
        self.cancelled = True


UNSENT = object()  # a layer of a load inside the step not submitted yet


class StepLoad:
    """A load inside this step (``load_async`` false): per layer its fetch (:data:`UNSENT`,
    ``None`` if refused, or the transfer) and whether it quiesced once waited for. A pull from a
    peer is one fetch of every layer (a serving engine answers pulls of all its layers only)."""

    __slots__ = ("plan", "transfers", "waited", "started")

    def __init__(self, plan: BlockPlan, attempts: int) -> None:
        self.plan = plan
        self.transfers: list[object] = [UNSENT] * attempts
        self.waited: list[bool | None] = [None] * attempts
        self.started = time.perf_counter()


def start(backend: Backend, op: Direction, req_id: str, view: View, block_ids: tuple[int, ...], hint: Hint,
          wakes: Wakes, timeout_s: float) -> Transfer:
    """Submit ``view`` as it stands (S1); the backend's refusals propagate (S3: nothing escaped)."""
    sub: Submission = submit(backend, op, view, hint, wakes=wakes)
    return Transfer(req_id, op, sub, block_ids, time.monotonic() + timeout_s)


def finished(transfers: Sequence[Transfer]) -> list[Transfer]:
    """The transfers that have concluded and quiesced, looking once, without blocking; those past
    their deadline and not concluded are cancelled (the backend's own deadline should have
    ended them, A8)."""
    if not transfers:
        return []
    done = [w.submission for w in wait_any([t.sub for t in transfers], 0.0) if w.outcome is not None and w.quiesced]
    ended = [t for t in transfers if t.sub in done]
    now = time.monotonic()
    for t in transfers:
        if t.sub not in done and now >= t.deadline:
            t.cancel()
    return ended


def doze(transfers: Sequence[Transfer], seconds: float) -> None:
    """Sleep until one of ``transfers`` is done (woken by the backend) or ``seconds`` pass."""
    if transfers:
        wait_any([t.sub for t in transfers], seconds)


def wait_out(transfer: Transfer) -> bool:
    """Block until the transfer has concluded and quiesced, cancelling it at its deadline;
    false if it still has not quiesced a grace after that (its memory stays held)."""
    left = max(0.0, transfer.deadline - time.monotonic())
    waited = wait(transfer.sub, left, at_deadline=AtDeadline.CANCEL, grace_s=QUIESCE_GRACE_S)
    transfer.cancelled = transfer.cancelled or waited.cancelled
    return not waited.keeps_lease and waited.outcome is not None
