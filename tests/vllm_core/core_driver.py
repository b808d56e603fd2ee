"""Driving a :class:`kvwire_vllm.core.WorkerCore` as vLLM's worker does, one step at a time, with
the test playing the scheduler side (the plans it would send)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from kvwire_vllm.core import WorkerCore
from kvwire_vllm.names import NAME_BYTES
from kvwire_vllm.plan import BlockPlan, StepPlan

__all__ = ["names", "save", "start_load", "finish_load", "load", "steps_until", "IDLE"]

IDLE = StepPlan(idle=True)


def names(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, NAME_BYTES), dtype=np.uint8)


def steps_until(core: WorkerCore, done: Callable[[set[str], set[str]], bool], timeout_s: float = 15.0,
                finished: set[str] | None = None) -> tuple[set[str], set[str]]:
    """Idle steps (each sleeps on the backend's wake, at most a few ms) until ``done(sent,
    received)`` over everything reported so far; fails at ``timeout_s``."""
    sent: set[str] = set()
    received: set[str] = set()
    deadline = time.monotonic() + timeout_s
    first = True
    while True:
        s, r = core.get_finished(finished if first and finished else ())
        first = False
        sent |= s
        received |= r
        if done(sent, received):
            return sent, received
        assert time.monotonic() < deadline, f"not done after {timeout_s} s: {core.state()}"
        core.bind(IDLE)


def save(core: WorkerCore, req: str, block_ids: list[int], block_names: np.ndarray, first: int = 0) -> None:
    """One step that saves ``block_ids`` of a request that then finishes; returns once the
    request is reported sent and every publish of it has ended."""
    core.bind(StepPlan(saves=(BlockPlan(req, first, tuple(block_ids), block_names.tobytes()),)))
    core.start_load_kv()
    core.wait_for_save()
    steps_until(core, lambda sent, _: req in sent, finished={req})
    steps_until(core, lambda *_: not core.state()["saves"] and not core.state()["draining"])


def start_load(core: WorkerCore, req: str, block_ids: list[int], block_names: np.ndarray, *, first: int = 0,
               source: bytes = b"", sync: bool = False) -> None:
    core.bind(StepPlan(loads=(BlockPlan(req, first, tuple(block_ids), block_names.tobytes(), source, sync),)))
    core.start_load_kv()


def finish_load(core: WorkerCore, req: str, timeout_s: float = 15.0) -> set[int]:
    """Steps until the load of ``req`` is reported received; the block ids vLLM is told are load
    errors."""
    core.wait_for_save()
    core.bind(IDLE)
    steps_until(core, lambda _, received: req in received, timeout_s)
    return core.take_load_errors()


def load(core: WorkerCore, req: str, block_ids: list[int], block_names: np.ndarray, **kwargs: object) -> set[int]:
    start_load(core, req, block_ids, block_names, **kwargs)  # type: ignore[arg-type]
    return finish_load(core, req)
