"""What the worker core tells vLLM when a load or a save does not go as planned, and what it holds
afterwards: misses and failed fetches are load errors for exactly those blocks, which stay
unwritten; a scatter that fails never marks a block good; an exhausted staging pool defers loads
and makes saves wait (skipping them only past the deadline or at a preemption), never failing a
request; and every path ends with every slot, registration and backend given back (the
``make_core`` fixture checks that after each test). Faults are injected into a real in-process
store (:mod:`kvwire.testing.faults` around the memory backend's driver)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
from core_driver import IDLE, finish_load, load, names, save, start_load, steps_until
from kvwire_memory import forget_store
from kvwire_memory.driver import MemoryDriver
from kvwire_memory.store import named_store
from kvwire_vllm.core import WorkerCore
from kvwire_vllm.plan import BlockPlan, StepPlan, SyncLoad
from vllm_layouts import Shape, block_bytes, make_cache

from kvwire.blob import BlobBackend
from kvwire.contract import Backend, Hint
from kvwire.registry import load as load_backend
from kvwire.testing.faults import Block, FailCall, FailKeys, Fault, FaultyDriver

SHAPE = Shape()
LAYOUT = "LBNHC"  # vLLM 0.32's default on CUDA
ROW = SHAPE.layers * SHAPE.heads * SHAPE.block_size * 2 * SHAPE.head_dim * 2  # bytes of a block, every layer


def slots_mib(slots: int) -> float:
    return slots * ROW / (1 << 20)


@pytest.fixture
def faulty() -> Iterator[Callable[[Sequence[Fault]], tuple[Backend, FaultyDriver]]]:
    """``make(faults)``: a memory backend on this test's store whose driver misbehaves on
    ``faults``; every such driver is released at the end."""
    store = f"vllm-core-faults-{uuid.uuid4().hex}"
    drivers: list[FaultyDriver] = []

    def make(faults: Sequence[Fault] = ()) -> tuple[Backend, FaultyDriver]:
        driver = FaultyDriver(MemoryDriver(named_store(store, capacity_bytes=1 << 26, eviction=True)), faults)
        drivers.append(driver)
        return BlobBackend(driver, timeout_s=10.0, owns_driver=True), driver

    make.store = store  # type: ignore[attr-defined]
    yield make
    for driver in drivers:
        driver.release_all()
    forget_store(store)


def unchanged(cache: dict, blocks: Sequence[int], before: dict[int, list[bytes]]) -> bool:
    return all(block_bytes(cache, LAYOUT, b) == before[b] for b in blocks)


@pytest.mark.parametrize("stage", [None, True], ids=["auto", "staged"])
def test_a_load_that_misses_reports_exactly_the_missing_blocks(
        stage: bool | None, device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    a_cache, b_cache = make_cache(LAYOUT, SHAPE, seed=1, device=device), make_cache(LAYOUT, SHAPE, seed=2, device=device)
    a = make_core(faulty(())[0], SHAPE.layer_names(), stage=stage)
    b = make_core(faulty(())[0], SHAPE.layer_names(), stage=stage)
    a.register_kv_caches(a_cache, SHAPE.blocks)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    all_names = names(5, seed=1)
    save(a, "a", [4, 5, 7], all_names[[0, 1, 3]])
    before = {blk: block_bytes(b_cache, LAYOUT, blk) for blk in range(SHAPE.blocks)}

    errors = load(b, "b", [10, 11, 12, 13, 14], all_names)

    assert errors == {12, 14}
    for src, dst in ((4, 10), (5, 11), (7, 13)):
        assert block_bytes(b_cache, LAYOUT, dst) == block_bytes(a_cache, LAYOUT, src)
    assert unchanged(b_cache, [12, 14], before), "a block that missed was written"
    assert b.take_counts()["load_error_blocks"] == 2  # type: ignore[index]


@pytest.mark.parametrize("stage", [None, True], ids=["auto", "staged"])
def test_a_load_whose_fetch_fails_reports_every_block_and_writes_none(
        stage: bool | None, device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    a = make_core(faulty(())[0], SHAPE.layer_names(), stage=stage)
    b = make_core(faulty([FailCall("get", call=None)])[0], SHAPE.layer_names(), stage=stage)
    a.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=1, device=device), SHAPE.blocks)
    b_cache = make_cache(LAYOUT, SHAPE, seed=2, device=device)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    block_names = names(4, seed=2)
    save(a, "a", [1, 2, 3, 4], block_names)
    before = {blk: block_bytes(b_cache, LAYOUT, blk) for blk in range(SHAPE.blocks)}

    assert load(b, "b", [8, 9, 10, 11], block_names) == {8, 9, 10, 11}
    assert unchanged(b_cache, range(SHAPE.blocks), before)
    counts = b.take_counts()  # a store call that failed: the outcome's cause labels the 4 blocks
    assert counts is not None and counts["load_error_causes"] == {"fault": 4}


def test_a_staged_fetch_that_fails_part_way_reports_the_blocks_it_did_not_get(
        device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    a_cache, b_cache = make_cache(LAYOUT, SHAPE, seed=1, device=device), make_cache(LAYOUT, SHAPE, seed=2, device=device)
    a = make_core(faulty(())[0], SHAPE.layer_names(), stage=True)
    b = make_core(faulty([FailKeys("get", call=1, start=2)])[0], SHAPE.layer_names(), stage=True)
    a.register_kv_caches(a_cache, SHAPE.blocks)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    block_names = names(4, seed=3)
    save(a, "a", [1, 2, 3, 4], block_names)
    before = {blk: block_bytes(b_cache, LAYOUT, blk) for blk in range(SHAPE.blocks)}

    assert load(b, "b", [8, 9, 10, 11], block_names) == {10, 11}
    assert block_bytes(b_cache, LAYOUT, 8) == block_bytes(a_cache, LAYOUT, 1)
    assert block_bytes(b_cache, LAYOUT, 9) == block_bytes(a_cache, LAYOUT, 2)
    assert unchanged(b_cache, [10, 11], before)


def test_a_scatter_that_fails_is_a_load_error_and_marks_no_block_good(
        device: str, faulty: Callable, make_core: Callable[..., WorkerCore], monkeypatch: pytest.MonkeyPatch) -> None:
    a = make_core(faulty(())[0], SHAPE.layer_names(), stage=True)
    b = make_core(faulty(())[0], SHAPE.layer_names(), stage=True)
    a.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=1, device=device), SHAPE.blocks)
    b_cache = make_cache(LAYOUT, SHAPE, seed=2, device=device)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    block_names = names(3, seed=4)
    save(a, "a", [1, 2, 3], block_names)
    before = {blk: block_bytes(b_cache, LAYOUT, blk) for blk in range(SHAPE.blocks)}
    assert b.pool is not None

    def broken(slots: np.ndarray, block_ids: np.ndarray) -> None:
        raise RuntimeError("injected: the device copy failed")

    monkeypatch.setattr(b.pool, "scatter", broken)
    assert load(b, "b", [5, 6, 7], block_names) == {5, 6, 7}
    assert unchanged(b_cache, range(SHAPE.blocks), before)
    counts = b.take_counts()
    assert counts is not None and counts["load_error_causes"] == {"copy-failed": 3}


def test_an_exhausted_pool_moves_a_request_in_turns_and_fails_nothing(
        device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    a_cache, b_cache = make_cache(LAYOUT, SHAPE, seed=1, device=device), make_cache(LAYOUT, SHAPE, seed=2, device=device)
    a = make_core(faulty(())[0], SHAPE.layer_names(), stage=True, staging_mib=slots_mib(2))
    b = make_core(faulty(())[0], SHAPE.layer_names(), stage=True, staging_mib=slots_mib(2))
    a.register_kv_caches(a_cache, SHAPE.blocks)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    assert a.pool is not None and a.pool.slots == 2
    saved, loaded = [0, 3, 6, 9, 12, 15, 18], [1, 4, 7, 10, 13, 16, 19]
    block_names = names(7, seed=5)

    save(a, "a", saved, block_names)
    assert load(b, "b", loaded, block_names) == set()

    for src, dst in zip(saved, loaded, strict=True):
        assert block_bytes(b_cache, LAYOUT, dst) == block_bytes(a_cache, LAYOUT, src)
    a_counts, b_counts = a.take_counts(), b.take_counts()
    assert a_counts is not None and a_counts["save_blocks"] == 7 and a_counts["save_skipped_blocks"] == 0
    assert b_counts is not None and b_counts["load_deferrals"] == 1 and b_counts["load_blocks"] == 7


def test_a_load_waits_for_slots_a_stuck_publish_holds_and_completes_when_it_lets_go(
        device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    filler = make_core(faulty(())[0], SHAPE.layer_names(), stage=True)
    filler_cache = make_cache(LAYOUT, SHAPE, seed=1, device=device)
    filler.register_kv_caches(filler_cache, SHAPE.blocks)
    wanted = names(3, seed=6)
    save(filler, "f", [1, 2, 3], wanted)

    stuck = Block("put", call=1)
    backend, driver = faulty([stuck])
    core = make_core(backend, SHAPE.layer_names(), stage=True, staging_mib=slots_mib(2))
    cache = make_cache(LAYOUT, SHAPE, seed=2, device=device)
    core.register_kv_caches(cache, SHAPE.blocks)
    core.bind(StepPlan(saves=(BlockPlan("s", 0, (20, 21), names(2, seed=7).tobytes()),)))
    core.start_load_kv()
    core.wait_for_save()
    assert driver.wait_blocked(1, timeout_s=10)
    # Gathered into both slots: vLLM's blocks are released while the publish holds the slots.
    steps_until(core, lambda sent, _: "s" in sent, finished={"s"})
    assert core.state()["staging_in_use"] == 2

    start_load(core, "l", [5, 6, 7], wanted)
    core.wait_for_save()
    core.bind(IDLE)
    for _ in range(5):
        _, received = core.get_finished(())
        assert "l" not in received, "a load without slots was reported before it ran"
    assert core.state()["loads"] == ["l"] and core.take_load_errors() == set()

    stuck.release.set()
    assert finish_load(core, "l") == set()
    for src, dst in ((1, 5), (2, 6), (3, 7)):
        assert block_bytes(cache, LAYOUT, dst) == block_bytes(filler_cache, LAYOUT, src)
    assert core.take_counts()["load_deferrals"] == 1  # type: ignore[index]


def test_a_save_waiting_for_slots_past_its_deadline_is_skipped_and_its_blocks_released(
        device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    stuck = Block("put", call=1)
    backend, driver = faulty([stuck])
    core = make_core(backend, SHAPE.layer_names(), stage=True, staging_mib=slots_mib(1), timeout_s=0.3)
    core.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=2, device=device), SHAPE.blocks)
    core.bind(StepPlan(saves=(BlockPlan("first", 0, (1,), names(1, seed=8).tobytes()),
                              BlockPlan("second", 0, (2, 3), names(2, seed=9).tobytes()))))
    core.start_load_kv()
    core.wait_for_save()
    assert driver.wait_blocked(1, timeout_s=10)

    sent, _ = steps_until(core, lambda sent, _: "second" in sent, finished={"first", "second"})
    counts = core.take_counts()
    assert counts is not None and counts["save_skipped_blocks"] == 2 and counts["save_blocks"] == 0
    stuck.release.set()
    steps_until(core, lambda *_: core.state()["staging_in_use"] == 0 and not core.state()["draining"])


def test_a_preempted_request_gives_up_its_queued_save_at_once(
        device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    stuck = Block("put", call=1)
    backend, driver = faulty([stuck])
    core = make_core(backend, SHAPE.layer_names(), stage=True, staging_mib=slots_mib(1))
    core.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=2, device=device), SHAPE.blocks)
    core.bind(StepPlan(saves=(BlockPlan("first", 0, (1,), names(1, seed=8).tobytes()),
                              BlockPlan("second", 0, (2, 3), names(2, seed=9).tobytes()))))
    core.start_load_kv()
    core.wait_for_save()
    assert driver.wait_blocked(1, timeout_s=10)

    core.bind(StepPlan(preempted=("second",)))
    core.handle_preemptions()  # returns although the store is stuck: nothing of "second" moved yet
    assert "second" not in core.state()["saves"]
    sent, _ = core.get_finished({"second"})
    assert "second" in sent
    assert core.take_counts()["save_skipped_blocks"] == 2  # type: ignore[index]
    stuck.release.set()


@pytest.mark.parametrize("stage", [None, True], ids=["auto", "staged"])
def test_an_aborted_load_is_reported_once_its_fetch_quiesced_and_staged_writes_no_block(
        stage: bool | None, device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    a = make_core(faulty(())[0], SHAPE.layer_names(), stage=stage)
    a.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=1, device=device), SHAPE.blocks)
    block_names = names(3, seed=10)
    save(a, "a", [1, 2, 3], block_names)
    stuck = Block("get", call=1)
    backend, driver = faulty([stuck])
    b = make_core(backend, SHAPE.layer_names(), stage=stage)
    b_cache = make_cache(LAYOUT, SHAPE, seed=2, device=device)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    before = {blk: block_bytes(b_cache, LAYOUT, blk) for blk in range(SHAPE.blocks)}

    start_load(b, "b", [5, 6, 7], block_names)
    b.wait_for_save()
    assert driver.wait_blocked(1, timeout_s=10)
    b.bind(IDLE)
    _, received = b.get_finished({"b"})  # vLLM aborts the request mid-load
    assert "b" not in received, "reported before the fetch quiesced: its blocks could still be written"
    stuck.release.set()
    steps_until(b, lambda _, received: "b" in received)
    assert b.take_load_errors() == {5, 6, 7}
    if b.staged:  # a direct fetch wrote vLLM's blocks itself (undefined bytes, A7.3); staged ones never
        assert unchanged(b_cache, range(SHAPE.blocks), before)


@pytest.mark.parametrize("stage", [None, True], ids=["auto", "staged"])
def test_shutdown_mid_transfer_gives_every_slot_and_registration_back(
        stage: bool | None, device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    stuck_put, stuck_get = Block("put", call=1), Block("get", call=1)
    backend, driver = faulty([stuck_put, stuck_get])
    core = make_core(backend, SHAPE.layer_names(), stage=stage)
    core.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=2, device=device), SHAPE.blocks)
    core.bind(StepPlan(loads=(BlockPlan("l", 0, (1, 2), names(2, seed=11).tobytes()),),
                       saves=(BlockPlan("s", 0, (5, 6, 7), names(3, seed=12).tobytes()),)))
    core.start_load_kv()
    core.wait_for_save()
    assert driver.wait_blocked(2, timeout_s=10)

    done = threading.Event()
    result: list[bool] = []

    def shut() -> None:
        result.append(core.shutdown(timeout_s=30))
        done.set()

    thread = threading.Thread(target=shut)
    thread.start()
    assert not done.wait(0.2), "shutdown returned while the store still touched the KV memory"
    driver.release_all()
    thread.join(30)
    assert result == [True]
    state = core.state()
    assert not state["registered"] and not state["backend_open"] and state["staging_in_use"] == 0


@pytest.mark.parametrize("stage", [None, True], ids=["auto", "staged"])
def test_a_load_inside_the_step_is_in_place_when_each_layer_wait_returns(
        stage: bool | None, device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    a_cache, b_cache = make_cache(LAYOUT, SHAPE, seed=1, device=device), make_cache(LAYOUT, SHAPE, seed=2, device=device)
    a = make_core(faulty(())[0], SHAPE.layer_names(), stage=stage)
    b = make_core(faulty(())[0], SHAPE.layer_names(), stage=stage)
    a.register_kv_caches(a_cache, SHAPE.blocks)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    all_names = names(3, seed=13)
    save(a, "a", [1, 2], all_names[:2])

    start_load(b, "b", [8, 9, 10], all_names, sync=True)
    for index, layer in enumerate(SHAPE.layer_names()):
        b.wait_for_layer_load(layer)
        for src, dst in ((1, 8), (2, 9)):
            assert block_bytes(b_cache, LAYOUT, dst)[index] == block_bytes(a_cache, LAYOUT, src)[index]
    b.wait_for_save()
    assert b.take_load_errors() == {10}
    assert b.report().loaded == (SyncLoad("b", 2, 1),)
    counts = b.take_counts()  # the block the store did not hold is a load error of cause "missing"
    assert counts is not None and counts["load_error_causes"] == {"missing": 1}


def test_a_save_of_a_request_whose_load_in_the_step_missed_is_never_stored(
        device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    backend = faulty(())[0]
    core = make_core(backend, SHAPE.layer_names(), stage=True)
    core.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=1, device=device), SHAPE.blocks)
    computed = names(1, seed=15)
    core.bind(StepPlan(loads=(BlockPlan("r", 0, (1,), names(1, seed=14).tobytes(), b"", True),),
                       saves=(BlockPlan("r", 1, (2,), computed.tobytes()),)))
    core.start_load_kv()
    core.wait_for_layer_load(SHAPE.layer_names()[0])
    core.wait_for_save()
    assert core.take_load_errors() == {1}
    steps_until(core, lambda sent, _: "r" in sent, finished={"r"})
    probe = load_backend("memory").build({"store": faulty.store, "capacity_bytes": 1 << 26})
    try:
        assert list(probe.lookup((0,), computed, Hint.of("store", namespace="t"), timeout_s=5.0)) == [False]
    finally:
        assert probe.shutdown() == frozenset()
        probe.close()


def test_saves_of_several_requests_through_one_slot_are_all_stored_in_turn(
        device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    core = make_core(faulty(())[0], SHAPE.layer_names(), stage=True, staging_mib=slots_mib(1))
    cache = make_cache(LAYOUT, SHAPE, seed=3, device=device)
    core.register_kv_caches(cache, SHAPE.blocks)
    plans = tuple(BlockPlan(f"r{i}", 0, (2 * i, 2 * i + 1), names(2, seed=20 + i).tobytes()) for i in range(3))
    core.bind(StepPlan(saves=plans))
    core.start_load_kv()
    core.wait_for_save()
    steps_until(core, lambda sent, _: sent >= {"r0", "r1", "r2"}, finished={"r0", "r1", "r2"})
    steps_until(core, lambda *_: not core.state()["draining"])
    counts = core.take_counts()
    assert counts is not None and counts["save_blocks"] == 6 and counts["save_failures"] == 0


def test_a_staged_request_moves_in_chunks_and_arrives_whole(
        device: str, faulty: Callable, make_core: Callable[..., WorkerCore], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvwire_vllm import holder

    monkeypatch.setattr(holder, "CHUNK_BYTES", 2 * ROW)  # two blocks a chunk
    a_backend, a_driver = faulty(())
    b_backend, b_driver = faulty(())
    a_cache, b_cache = make_cache(LAYOUT, SHAPE, seed=1, device=device), make_cache(LAYOUT, SHAPE, seed=2, device=device)
    a = make_core(a_backend, SHAPE.layer_names(), stage=True)
    b = make_core(b_backend, SHAPE.layer_names(), stage=True)
    a.register_kv_caches(a_cache, SHAPE.blocks)
    b.register_kv_caches(b_cache, SHAPE.blocks)
    saved, loaded = [2, 4, 6, 8, 10, 12, 14], [3, 5, 7, 9, 11, 13, 15]
    block_names = names(7, seed=40)

    save(a, "a", saved, block_names)
    assert load(b, "b", loaded, block_names) == set()

    assert a_driver.calls["put"] == 4 and b_driver.calls["get"] == 4
    for src, dst in zip(saved, loaded, strict=True):
        assert block_bytes(b_cache, LAYOUT, dst) == block_bytes(a_cache, LAYOUT, src)


def test_a_staged_save_the_backend_cannot_take_now_is_submitted_again_later(
        device: str, faulty: Callable, make_core: Callable[..., WorkerCore]) -> None:
    """A backend at its ``max_in_flight`` answers "not now" (S3.1): the save keeps its slots and
    is submitted once the queue has room, instead of being lost."""
    stuck = Block("put", call=1)
    store = faulty.store
    driver = FaultyDriver(MemoryDriver(named_store(store, capacity_bytes=1 << 26, eviction=True)), [stuck])
    core = make_core(BlobBackend(driver, timeout_s=10.0, max_in_flight=1, owns_driver=True), SHAPE.layer_names(),
                     stage=True)
    try:
        core.register_kv_caches(make_cache(LAYOUT, SHAPE, seed=2, device=device), SHAPE.blocks)
        second = names(2, seed=42)
        core.bind(StepPlan(saves=(BlockPlan("first", 0, (1,), names(1, seed=41).tobytes()),
                                  BlockPlan("second", 0, (2, 3), second.tobytes()))))
        core.start_load_kv()
        core.wait_for_save()
        assert driver.wait_blocked(1, timeout_s=10)
        core.bind(IDLE)
        core.get_finished(())
        assert core.state()["staging_in_use"] == 3  # the second save holds its gathered slots
        stuck.release.set()
        steps_until(core, lambda sent, _: sent >= {"first", "second"}, finished={"first", "second"})
        steps_until(core, lambda *_: not core.state()["draining"])
        counts = core.take_counts()
        assert counts is not None and counts["save_blocks"] == 3 and counts["save_failures"] == 0
    finally:
        driver.release_all()
    probe = load_backend("memory").build({"store": store, "capacity_bytes": 1 << 26})
    try:
        assert list(probe.lookup((0,), second, Hint.of("store", namespace="t"), timeout_s=5.0)) == [True, True]
    finally:
        assert probe.shutdown() == frozenset()
        probe.close()
