"""A producer's holds for disaggregated prefill (kvwire_vllm.handoff), without vLLM: which requests
are held, for how long, and that every hold's blocks go back to the pool exactly once, by the
consumer's pull, by time, or at shutdown."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kvwire_vllm.handoff import Holds, hold_seconds, wants_hold


class Pool:
    """Stands for vLLM's block pool: counts the references given back."""

    def __init__(self) -> None:
        self.freed: list[Any] = []
        self.rings = threading.Semaphore(0)

    def free(self, blocks: list[Any]) -> None:
        self.freed.extend(blocks)

    def ring(self) -> None:
        self.rings.release()


@pytest.mark.parametrize("role, serving, params, held", [
    ("kv_producer", True, None, True),
    ("kv_both", True, {"do_remote_decode": True}, True),
    ("kv_both", True, {"do_remote_decode": False}, False),
    ("kv_both", True, None, False),
    ("kv_consumer", True, {"do_remote_decode": True}, False),
    ("kv_producer", False, {"do_remote_decode": True}, False),  # a store backend: the store keeps them
])
def test_which_requests_are_held(role: str, serving: bool, params: dict | None, held: bool) -> None:
    assert wants_hold(role, serving, params) is held


@pytest.mark.parametrize("asked, seconds", [(None, 30.0), (3, 3.0), (0.5, 0.5), (3600, 30.0), (0, 30.0),
                                            (-1, 30.0), (True, 30.0), ("3", 30.0)])
def test_a_request_may_ask_for_a_shorter_hold_never_a_longer_one(asked: object, seconds: float) -> None:
    assert hold_seconds(30.0, None if asked is None else {"kvwire_hold_s": asked}) == seconds


def test_a_pull_of_the_last_block_ends_only_that_hold() -> None:
    pool = Pool()
    holds = Holds(pool.free, pool.ring)
    holds.take("a", ["a0", "a1"], b"A-last", 60.0)
    holds.take("b", ["b0"], b"B-last", 60.0)
    assert holds.blocks() == 3
    holds.end(b"A-first")  # a pull that did not reach the last block
    holds.end(None)  # a step: nothing lapsed
    assert pool.freed == [] and holds.blocks() == 3
    holds.end(b"A-last")
    assert pool.freed == ["a0", "a1"] and holds.blocks() == 1 and holds.released == 1
    holds.end(b"A-last")  # once only
    assert pool.freed == ["a0", "a1"]
    assert holds.end_all() == 1 and pool.freed == ["a0", "a1", "b0"] and not holds


def test_a_hold_nobody_pulls_lapses_and_rings_the_idle_engine() -> None:
    pool = Pool()
    holds = Holds(pool.free, pool.ring)
    holds.take("a", ["a0"], b"A-last", 0.2)
    assert pool.rings.acquire(timeout=10), "the timer never rang the engine"
    holds.end()  # the step the ring caused
    assert pool.freed == ["a0"] and holds.lapsed == 1 and not holds


def test_holds_not_yet_due_stay() -> None:
    pool = Pool()
    holds = Holds(pool.free, pool.ring)
    holds.take("a", ["a0"], b"A-last", 30.0)
    holds.end()
    assert pool.freed == [] and holds.blocks() == 1
    assert holds.end_all() == 1 and pool.freed == ["a0"]
