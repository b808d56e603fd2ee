"""The vLLM connector's worker core with CUDA KV caches (no vLLM needed): copies are ordered
against vLLM's stream, a load is reported only once its scatter completed on the device, the hot
path never synchronizes the whole device, and a backend that declares DEVICE memory gets vLLM's
tensors themselves. Every test skips without a CUDA device, saying so. (The round trips in every
layout, the faults and the pulls run on CUDA too: ``tests/vllm_core``, device ``cuda``.)"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm_core"))

from core_driver import load, names, save, start_load  # noqa: E402
from kvwire_vllm.core import WorkerCore  # noqa: E402
from kvwire_vllm.plan import StepPlan  # noqa: E402
from vllm_layouts import Shape, block_bytes, make_cache  # noqa: E402

from kvwire.contract import MemoryKind, OtherEnd  # noqa: E402
from kvwire.registry import PluginError, available  # noqa: E402
from kvwire.registry import load as load_backend  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is false here)")

SHAPE = Shape(layers=4, blocks=64, heads=2, block_size=16, head_dim=64)
LAYOUT = "LBNHC"
SLEEP_CYCLES = 2_000_000_000  # a kernel that keeps a stream busy for about a second


@pytest.fixture
def cores() -> Iterator[list[WorkerCore]]:
    from kvwire_memory import forget_store

    store = f"vllm-core-cuda-{uuid.uuid4().hex}"
    made: list[WorkerCore] = []
    for _ in range(2):
        made.append(WorkerCore(load_backend("memory").build({"store": store}), layers=SHAPE.layer_names(),
                               block_size=SHAPE.block_size, namespace="t", staging_mib=8))
    yield made
    for core in made:
        assert core.shutdown(timeout_s=30)
        assert core.state()["staging_in_use"] == 0 and not core.state()["registered"]
    forget_store(store)


def test_a_staged_load_is_reported_only_after_its_scatter_completed_on_the_device(cores: list[WorkerCore]) -> None:
    a, b = cores
    a_cache, b_cache = make_cache(LAYOUT, SHAPE, seed=1, device="cuda"), make_cache(LAYOUT, SHAPE, seed=2, device="cuda")
    a.register_kv_caches(a_cache, SHAPE.blocks)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    block_names = names(8, seed=1)
    save(a, "a", list(range(8)), block_names)
    # A first load compiles the scatter kernel: compiling after the sleep was queued would hide it.
    assert load(b, "warm-up", list(range(40, 48)), block_names) == set()
    assert b.pool is not None and b.pool.stream is not None
    scatters: list[torch.cuda.Event] = []
    real = b.pool.scatter

    def slow_scatter(slots: np.ndarray, block_ids: np.ndarray) -> torch.cuda.Event | None:
        with torch.cuda.stream(b.pool.stream):  # type: ignore[union-attr]
            torch.cuda._sleep(SLEEP_CYCLES)  # the copy queues behind a busy stream
        event = real(slots, block_ids)
        assert event is not None
        scatters.append(event)
        return event

    b.pool.scatter = slow_scatter  # type: ignore[method-assign]
    start_load(b, "b", list(range(20, 28)), block_names)
    b.wait_for_save()
    b.bind(StepPlan())  # steps that compute other requests: get_finished only looks, never dozes
    pending_seen = False
    received: set[str] = set()
    deadline = time.monotonic() + 60
    while "b" not in received:
        assert time.monotonic() < deadline, b.state()
        _, got = b.get_finished(())
        received |= got
        if scatters and "b" not in received:
            pending_seen = pending_seen or not scatters[-1].query()
    assert scatters and all(e.query() for e in scatters), "reported received before the scatter completed"
    assert pending_seen, "the delay never held the scatter back: this test showed nothing"
    assert b.take_load_errors() == set()
    for src, dst in zip(range(8), range(20, 28), strict=True):
        assert block_bytes(b_cache, LAYOUT, dst) == block_bytes(a_cache, LAYOUT, src)


def test_a_staged_save_reads_blocks_only_after_the_work_queued_before_it(cores: list[WorkerCore]) -> None:
    """vLLM queues the forward that writes a block and calls ``wait_for_save`` at once: the
    gather must read what the forward wrote, not what was there before."""
    a, b = cores
    a_cache, b_cache = make_cache(LAYOUT, SHAPE, seed=3, device="cuda"), make_cache(LAYOUT, SHAPE, seed=4, device="cuda")
    a.register_kv_caches(a_cache, SHAPE.blocks)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    torch.cuda._sleep(SLEEP_CYCLES)  # the "forward", on vLLM's (the current) stream
    for t in a_cache.values():
        t[5].fill_(1.5)
        t[6].fill_(-2.25)
    block_names = names(2, seed=2)
    save(a, "a", [5, 6], block_names)
    assert load(b, "b", [40, 41], block_names) == set()
    torch.cuda.current_stream().synchronize()
    for t in b_cache.values():
        assert bool((t[40] == 1.5).all()) and bool((t[41] == -2.25).all())


def test_the_steps_never_synchronize_the_whole_device(cores: list[WorkerCore], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = cores
    a.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=5, device="cuda"), SHAPE.blocks)
    b.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=6, device="cuda"), SHAPE.blocks)

    def forbidden(*_: object) -> None:
        raise AssertionError("a device-wide synchronize on the connector's hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", forbidden)
    block_names = names(16, seed=3)
    save(a, "a", list(range(16)), block_names)
    assert load(b, "b", list(range(30, 46)), block_names) == set()
    start_load(b, "c", list(range(46, 50)), block_names[:4], sync=True)
    for layer in SHAPE.layer_names():
        b.wait_for_layer_load(layer)
    b.wait_for_save()
    assert b.take_load_errors() == set()
    monkeypatch.undo()


def test_a_backend_that_declares_device_memory_gets_vllms_tensors() -> None:
    """Direct registration of CUDA tensors, with whichever installed store backend declares
    DEVICE memory (skipped, saying so, where none does)."""
    device_stores = []
    for entry in available():
        try:
            plugin = load_backend(entry.name)
        except PluginError:  # a broken plugin is the registry's to report, not this test's
            continue
        caps = plugin.capabilities
        if MemoryKind.DEVICE in caps.memory_kinds and caps.other_end is OtherEnd.STORE:
            device_stores.append(entry.name)
    if not device_stores:
        pytest.skip("no installed store backend declares DEVICE memory (kvwire-ucx's device rows are a peer's: "
                    "tests/vllm_core/test_core_pulls.py)")
    name = device_stores[0]
    a = WorkerCore(load_backend(name).build({}), layers=SHAPE.layer_names(), block_size=SHAPE.block_size,
                   namespace=f"d{uuid.uuid4().hex[:8]}")
    b = WorkerCore(load_backend(name).build({}), layers=SHAPE.layer_names(), block_size=SHAPE.block_size,
                   namespace=a.namespace)
    try:
        a_cache, b_cache = make_cache(LAYOUT, SHAPE, seed=7, device="cuda"), make_cache(LAYOUT, SHAPE, seed=8,
                                                                                        device="cuda")
        a.register_kv_caches(a_cache, SHAPE.blocks)
        b.register_kv_caches(b_cache, SHAPE.blocks)
        assert not a.staged and all(r.memory_kind is MemoryKind.DEVICE for r in a.regions)
        block_names = names(4, seed=4)
        save(a, "a", [1, 2, 3, 4], block_names)
        assert load(b, "b", [9, 10, 11, 12], block_names) == set()
        for src, dst in zip([1, 2, 3, 4], [9, 10, 11, 12], strict=True):
            assert block_bytes(b_cache, LAYOUT, dst) == block_bytes(a_cache, LAYOUT, src)
    finally:
        assert a.shutdown() and b.shutdown()
