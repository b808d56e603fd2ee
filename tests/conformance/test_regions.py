"""The suite's independent path to memory: what it writes is what it reads back, rows land in
their slots, and a write just outside a region shows in its guard bytes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvwire.contract import MemoryKind
from kvwire.testing.regions import DeviceMemory, HostMemory, RegionMemory, cuda_devices, fake_region


def _exercise(memory: RegionMemory) -> None:
    region = memory.region
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, size=(3, region.slot_bytes), dtype=np.uint8)
    memory.write([4, 0, 2], data)
    assert np.array_equal(memory.read([4, 0, 2]), data)
    assert np.array_equal(memory.read_all()[[4, 0, 2]], data)
    memory.fill([1], 0x7F)
    assert (memory.read([1]) == 0x7F).all()
    assert memory.guards_intact()


def test_host_memory_rows_and_guards() -> None:
    memory = HostMemory(7, 5)
    assert memory.region.memory_kind is MemoryKind.HOST and memory.region.nbytes == 35
    _exercise(memory)
    # The region's address is the memory the suite reads: a write there shows.
    ctypes.memset(memory.region.base + 3 * 7, 0x11, 7)
    assert (memory.read([3]) == 0x11).all()
    ctypes.memset(memory.region.end, 0x00, 1)
    assert not memory.guards_intact()
    head = HostMemory(7, 5)
    ctypes.memset(head.region.base - 1, 0x00, 1)
    assert not head.guards_intact()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_devices(), reason="no CUDA device")
def test_device_memory_rows_and_guards() -> None:
    import torch

    memory = DeviceMemory(7, 5)
    region = memory.region
    assert region.memory_kind is MemoryKind.DEVICE and region.device == 0
    _exercise(memory)
    # The region's address is the device memory the suite reads: a write there shows.
    _at(torch, region.base + 3 * 7, 7).fill_(0x22)
    torch.cuda.synchronize()
    assert (memory.read([3]) == 0x22).all()
    _at(torch, region.end, 1).zero_()
    torch.cuda.synchronize()
    assert not memory.guards_intact()


def _at(torch, address: int, size: int):  # type: ignore[no-untyped-def]
    """A uint8 CUDA tensor over ``size`` bytes at ``address`` (not a copy)."""

    class Span:
        __cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False), "version": 3}

    return torch.as_tensor(Span(), device="cuda")


def test_fake_regions_lie_nowhere_anyone_allocated() -> None:
    a, b = fake_region(MemoryKind.DEVICE), fake_region(MemoryKind.HOST)
    assert a.memory_kind is MemoryKind.DEVICE and a.device == 0 and b.device is None
    assert a.region_id != b.region_id and not a.overlaps(fake_region(MemoryKind.DEVICE))
