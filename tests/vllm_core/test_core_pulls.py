"""Request-free pulls between two engines' worker cores over kvwire-ucx (real UCX endpoints on
loopback): engine B loads a prefix from engine A's cache, directly from vLLM's host memory or
through both engines' staging slots, and gets A's blocks bit for bit; the test plays both
scheduler sides (A's pins, B's plan)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from core_driver import IDLE, names, start_load
from kvwire_vllm.core import WorkerCore
from kvwire_vllm.plan import ServePlan, StepPlan
from vllm_layouts import Shape, block_bytes, make_cache

from kvwire.contract import Backend, MemoryKind
from kvwire.registry import load

SHAPE = Shape()
LAYOUT = "LBNHC"


@pytest.fixture
def ucx() -> Callable[[], Backend]:
    from kvwire.testing.require import backend_module

    backend_module("ucxx._lib.libucxx", "ucx", "ucxx-cu12==0.52.0")  # skips, or fails when the run requires ucx
    return lambda: load("ucx").build({"timeout_s": 10.0, "grace_s": 0.5})


def pull(a: WorkerCore, b: WorkerCore, held: dict[bytes, int], req: str, block_ids: list[int],
         block_names: np.ndarray) -> set[int]:
    """B pulls ``block_names`` from A into ``block_ids``; A's scheduler side pins the leading
    names it holds (``held``: name -> A's block). Returns B's load errors."""
    start_load(b, req, block_ids, block_names, source=a.backend.address())  # type: ignore[union-attr]
    b.wait_for_save()
    b.bind(IDLE)
    received: set[str] = set()
    for _ in range(2000):
        report = a.report()
        serves = []
        for ask in report.asks:
            asked = np.frombuffer(ask.names, dtype=np.uint8).reshape(-1, 16)
            prefix = []
            for name in asked:
                if name.tobytes() not in held:
                    break
                prefix.append(held[name.tobytes()])
            serves.append(ServePlan(ask.pull_id, tuple(prefix)))
        a.bind(StepPlan(serves=tuple(serves), idle=not serves))
        a.start_load_kv()
        a.wait_for_save()
        a.get_finished(())
        _, got = b.get_finished(())
        received |= got
        if req in received and not a.state()["replies_in_flight"]:
            return b.take_load_errors()
    raise AssertionError(f"the pull did not end: A {a.state()}, B {b.state()}")


@pytest.mark.parametrize("stage", [None, True], ids=["direct", "staged"])
def test_a_prefix_pulled_from_another_engine_arrives_bit_for_bit(
        stage: bool | None, device: str, ucx: Callable[[], Backend], make_core: Callable[..., WorkerCore]) -> None:
    a_backend, b_backend = ucx(), ucx()
    if device == "cuda" and stage is None and MemoryKind.DEVICE not in a_backend.capabilities().memory_kinds:
        stage = True  # this host's UCX has no CUDA transports: a CUDA cache is staged either way
    a_cache, b_cache = make_cache(LAYOUT, SHAPE, seed=1, device=device), make_cache(LAYOUT, SHAPE, seed=2, device=device)
    a = make_core(a_backend, SHAPE.layer_names(), stage=stage)
    b = make_core(b_backend, SHAPE.layer_names(), stage=stage)
    a.register_kv_caches(a_cache, SHAPE.blocks)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    assert a.serving and a.staged is bool(stage)
    block_names = names(5, seed=30)
    held = {block_names[i].tobytes(): blk for i, blk in enumerate([4, 9, 13])}  # A holds the first three
    before = {blk: block_bytes(b_cache, LAYOUT, blk) for blk in range(SHAPE.blocks)}

    errors = pull(a, b, held, "b", [1, 2, 3, 5, 6], block_names)

    assert errors == {5, 6}
    for src, dst in ((4, 1), (9, 2), (13, 3)):
        assert block_bytes(b_cache, LAYOUT, dst) == block_bytes(a_cache, LAYOUT, src)
    if b.staged:
        assert all(block_bytes(b_cache, LAYOUT, blk) == before[blk] for blk in (5, 6))
    assert a.state()["pulls_served"] == 1 and a.state()["pull_blocks_served"] == 3


def test_engines_that_store_blocks_differently_decline_each_others_pulls(
        ucx: Callable[[], Backend], make_core: Callable[..., WorkerCore]) -> None:
    """A staged engine's rows are whole blocks; a direct one's are layers: A declines, B recomputes."""
    a = make_core(ucx(), SHAPE.layer_names(), stage=None)
    b = make_core(ucx(), SHAPE.layer_names(), stage=True)
    a.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=1), SHAPE.blocks)
    b.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=2), SHAPE.blocks)
    block_names = names(2, seed=31)
    errors = pull(a, b, {block_names[0].tobytes(): 3}, "b", [7, 8], block_names)
    assert errors == {7, 8}
    assert a.state()["pulls_declined"] == 1 and a.state()["pulls_served"] == 0
