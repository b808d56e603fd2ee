"""The ``memory`` plugin's option ``device``: rows in CUDA memory saved to and loaded from a store in
pinned host memory by one copy kernel a batch, with no staging. On a CUDA host: bytes come back
bit for bit for row sizes that are not multiples of a word, a fetch writes only its rows, block
objects of many device planes, a view with HOST and DEVICE groups, and a GPU worker's objects
read by a host-only backend of the same store. Everywhere: the option's refusals name the
problem (no CUDA here, a store already made in ordinary memory)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from device_rows import STORE, group, names_of
from device_rows import move as moving
from kvwire_memory import MemoryDriver, MemoryStore, forget_store, named_store

from kvwire.contract import Hint, MemoryKind, Outcome, SlotRegion, View
from kvwire.contract.blocks import BLOCKS_FIELD, block_layout
from kvwire.registry import ConfigError, load, survey

CUDA = torch.cuda.is_available()


@pytest.fixture
def store_name() -> Iterator[str]:
    name = f"test-device-{uuid.uuid4().hex[:10]}"
    yield name
    forget_store(name)


def device_region(rows: torch.Tensor, region_id: int = 0) -> SlotRegion:
    return SlotRegion(region_id, rows.data_ptr(), rows.shape[1], rows.shape[0], MemoryKind.DEVICE,
                      rows.device.index or 0)


def host_region(rows: np.ndarray, region_id: int = 0) -> SlotRegion:
    return SlotRegion(region_id, rows.ctypes.data, rows.shape[1], rows.shape[0], MemoryKind.HOST)


def move(backend, op: str, view: View, regions: list[SlotRegion], hint: Hint = STORE) -> Outcome:  # type: ignore[no-untyped-def]
    # the holder's writes have landed before it submits (S2)
    return moving(backend, op, view, regions, hint, before=torch.cuda.synchronize if CUDA else None)


def random_rows(count: int, size: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (count, size), dtype=torch.uint8, device="cuda", generator=g)


# -- everywhere ----------------------------------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="checks the refusal on a host without CUDA")
def test_the_device_plugin_on_a_host_without_cuda_is_refused_naming_why(store_name):
    with pytest.raises(ConfigError, match="memory-device.*CUDA"):
        load("memory-device").build({"store": store_name})
    (row,) = [r for r in survey() if r.entry.name == "memory-device"]
    assert row.plugin is not None and row.problem is not None and "CUDA" in row.problem


def test_a_store_made_in_ordinary_memory_is_not_taken_for_a_device_backend(store_name):
    named_store(store_name, capacity_bytes=1 << 20, eviction=True)
    with pytest.raises(ValueError, match="not pinned"):
        named_store(store_name, capacity_bytes=1 << 20, eviction=True, pinned=True)
    with pytest.raises(ValueError, match="pinned=True"):
        MemoryDriver(MemoryStore(1 << 20), device=True)


def test_a_host_only_driver_refuses_device_regions_naming_the_plugin_that_takes_them(store_name):
    driver = MemoryDriver(named_store(store_name, capacity_bytes=1 << 20, eviction=True))
    with pytest.raises(RuntimeError, match="'memory-device'"):
        driver.register([SlotRegion(0, 1 << 40, 64, 4, MemoryKind.DEVICE, 0)])


# -- on a CUDA host ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 3, 1000, 4096, 32768 + 8])
@pytest.mark.parametrize("block_objects", [False, True])
def test_device_rows_come_back_bit_for_bit_and_a_fetch_writes_only_its_rows(store_name, size, block_objects):
    if not CUDA:
        pytest.skip("needs a CUDA device (torch sees none here)")
    backend = load("memory-device").build({"store": store_name})
    try:
        assert MemoryKind.DEVICE in backend.capabilities().memory_kinds
        planes = [random_rows(12, size, seed=p) for p in range(3)]  # three "layers"
        regions = [device_region(t, p) for p, t in enumerate(planes)]
        saved, loaded = [1, 4, 5, 9], [0, 2, 7, 11]
        names = names_of(saved)
        view = View(tuple(group(p, r, saved, names) for p, r in enumerate(regions)))
        hint = Hint.of("store", **{BLOCKS_FIELD: block_layout(view)}) if block_objects else STORE
        sent = move(backend, "publish", view, regions, hint)
        assert sent.is_delivered and all(m.all() for m in sent.masks), sent

        targets = [torch.full((12, size), 0xA5, dtype=torch.uint8, device="cuda") for _ in planes]
        target_regions = [device_region(t, p) for p, t in enumerate(targets)]
        back = View(tuple(group(p, r, loaded, names) for p, r in enumerate(target_regions)))
        got = move(backend, "fetch", back, target_regions, hint)
        assert got.is_delivered and all(m.all() for m in got.masks), got
        torch.cuda.synchronize()
        for plane, target in zip(planes, targets, strict=True):
            assert torch.equal(target[loaded], plane[saved])
            untouched = [i for i in range(12) if i not in loaded]
            assert bool((target[untouched] == 0xA5).all()), "a fetch wrote a byte outside its rows"
    finally:
        backend.close()


def test_a_view_of_host_and_device_groups_moves_both(store_name):
    if not CUDA:
        pytest.skip("needs a CUDA device (torch sees none here)")
    backend = load("memory-device").build({"store": store_name})
    try:
        dev = random_rows(8, 2048, seed=7)
        host = np.random.default_rng(8).integers(0, 256, (8, 2048), dtype=np.uint8)
        regions = [device_region(dev, 0), host_region(host, 1)]
        names = names_of([3, 4, 5])
        view = View((group(0, regions[0], [0, 1, 2], names), group(1, regions[1], [5, 6, 7], names)))
        assert move(backend, "publish", view, regions).is_delivered
        dev_back, host_back = torch.zeros_like(dev), np.zeros_like(host)
        back_regions = [device_region(dev_back, 0), host_region(host_back, 1)]
        back = View((group(0, back_regions[0], [0, 1, 2], names), group(1, back_regions[1], [5, 6, 7], names)))
        got = move(backend, "fetch", back, back_regions)
        assert got.is_delivered and all(m.all() for m in got.masks), got
        torch.cuda.synchronize()
        assert torch.equal(dev_back[:3], dev[:3])
        np.testing.assert_array_equal(host_back[5:], host[5:])
    finally:
        backend.close()


def test_what_a_gpu_worker_saved_a_host_only_backend_of_the_store_reads(store_name):
    if not CUDA:
        pytest.skip("needs a CUDA device (torch sees none here)")
    gpu = load("memory-device").build({"store": store_name})
    cpu = load("memory").build({"store": store_name})  # the same store: pinned, so it serves both
    try:
        assert MemoryKind.DEVICE not in cpu.capabilities().memory_kinds
        dev = random_rows(4, 4096, seed=11)
        names = names_of([1, 2, 3, 4])
        region = device_region(dev)
        assert move(gpu, "publish", View((group(0, region, [0, 1, 2, 3], names),)), [region]).is_delivered
        host = np.zeros((4, 4096), dtype=np.uint8)
        hregion = host_region(host)
        got = move(cpu, "fetch", View((group(0, hregion, [3, 2, 1, 0], names),)), [hregion])
        assert got.is_delivered and got.masks[0].all()
        np.testing.assert_array_equal(host, dev.cpu().numpy()[::-1])
    finally:
        gpu.close()
        cpu.close()


def test_a_full_store_declines_device_rows_and_a_miss_is_a_false_bit(store_name):
    if not CUDA:
        pytest.skip("needs a CUDA device (torch sees none here)")
    backend = load("memory-device").build({"store": store_name, "capacity_bytes": 2 * 1024,
                                           "eviction": False})
    try:
        dev = random_rows(3, 1024, seed=3)
        region = device_region(dev)
        sent = move(backend, "publish", View((group(0, region, [0, 1, 2], names_of([1, 2, 3])),)), [region])
        assert sent.is_delivered
        np.testing.assert_array_equal(sent.masks[0], [True, True, False])
        back = torch.zeros_like(dev)
        bregion = device_region(back)
        got = move(backend, "fetch", View((group(0, bregion, [0, 1, 2], names_of([1, 2, 3])),)), [bregion])
        assert got.is_delivered
        np.testing.assert_array_equal(got.masks[0], [True, True, False])
        torch.cuda.synchronize()
        assert torch.equal(back[:2], dev[:2]) and not bool(back[2].any())
    finally:
        backend.close()
