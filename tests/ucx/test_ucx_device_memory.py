"""kvwire-ucx's device memory without a GPU: what it declares where UCX has no CUDA transports,
how it reads a UCX context's resources, device byte views, one device per backend, and how a
one-sided range is split into one read per pair of memories (NIXL reads one kind into one kind).
The transfers themselves run on a GPU host: tests/gpu/test_ucx_device.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from kvwire_ucx.backend import UcxBackend
from kvwire_ucx.cuda import reaches_cuda
from kvwire_ucx.nixl_reads import RangeReads
from kvwire_ucx.regions import HOST, DeviceBytes, GroupRows, RegisteredRegions
from kvwire_ucx.settings import WITH_DEVICE

from kvwire.contract import InvalidSubmission, MemoryKind, SlotRegion


class _Info:
    def __init__(self, info: str) -> None:
        self.info = info


def test_cuda_is_reached_only_where_a_cuda_component_loaded() -> None:
    with_cuda = "#     component 4  :  cma\n#     component 5  :  cuda_cpy\n#     component 6  :  cuda_ipc\n"
    assert reaches_cuda(_Info(with_cuda))
    assert not reaches_cuda(_Info("#     component 4  :  cma\n#      resource 0  :  md 0  dev 0  flags -- self/memory\n"))
    assert not reaches_cuda(object())  # no info at all: host only


def test_without_cuda_transports_the_backend_declares_host_memory_and_refuses_device_regions() -> None:
    backend = UcxBackend()
    try:
        if MemoryKind.DEVICE in backend.capabilities().memory_kinds:  # tests/gpu/test_ucx_device.py's case
            pytest.skip("this host's UCX reaches CUDA memory (cuda_copy/cuda_ipc), so the backend rightly "
                        "declares DEVICE; the case without CUDA transports runs on hosts without them")
        assert backend.capabilities().memory_kinds == frozenset({MemoryKind.HOST})
        with pytest.raises(InvalidSubmission):
            backend.register_regions([SlotRegion(1, 1 << 40, 4096, 4, MemoryKind.DEVICE, device=0)])
    finally:
        assert backend.shutdown() == frozenset()


def test_device_bytes_slice_into_contiguous_spans_that_cuda_readers_see() -> None:
    span = DeviceBytes(0x7000_0000, 1 << 20, readonly=True)
    part = span[4096:8192]
    assert part.__cuda_array_interface__ == {"shape": (4096,), "typestr": "|u1", "data": (0x7000_1000, True),
                                            "strides": None, "version": 3}
    assert span[(1 << 20) - 10:(1 << 20) + 10].nbytes == 10  # clipped like a byte array
    with pytest.raises(ValueError):
        span[0:100:2]


def test_one_backend_takes_the_device_memory_of_one_device() -> None:
    regions = RegisteredRegions(WITH_DEVICE)
    first = regions.register([SlotRegion(1, 1 << 40, 4096, 4, MemoryKind.DEVICE, device=0)])
    assert regions.device == 0
    with pytest.raises(InvalidSubmission, match=r"devices \[0, 1\]"):
        regions.register([SlotRegion(2, 1 << 41, 4096, 4, MemoryKind.DEVICE, device=1)])
    with pytest.raises(InvalidSubmission, match=r"devices \[1, 2\]"):
        RegisteredRegions(WITH_DEVICE).register([SlotRegion(3, 1 << 40, 64, 1, MemoryKind.DEVICE, device=1),
                                           SlotRegion(4, 1 << 41, 64, 1, MemoryKind.DEVICE, device=2)])
    first.close()


class _Agent:
    """Stands in for the NIXL agent: records each read's memories and descriptors."""

    def __init__(self) -> None:
        self.reads: list[tuple[tuple[int, int], np.ndarray, np.ndarray]] = []

    def read(self, local, remote, peer, memories=(-1, -1)):
        self.reads.append((memories, local.copy(), remote.copy()))
        return len(self.reads), True

    def release(self, handle) -> bool:
        return True


def _rows(group_id: int, base: int, memory: int, count: int) -> GroupRows:
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(256)
    return GroupRows(group_id, 256, None, offsets, base, memory)


def test_a_range_over_groups_in_different_memories_is_one_read_per_pair_naming_each_device() -> None:
    agent = _Agent()
    groups = (_rows(0, 0x1000_0000, HOST, 4), _rows(1, 0x2000_0000, 1, 4), _rows(2, 0x3000_0000, 1, 4))
    reads = RangeReads(agent, groups, "peer")  # type: ignore[arg-type]
    reads.remote = tuple(np.array([[b, 4]], dtype=np.uint64) for b in (0xA000, 0xB000, 0xC000))  # runs there
    reads.remote_memories = (1, 1, HOST)
    reads.plan((4, 4, 4), ((0, 4),))
    assert reads.start(0, 1) is not None and not reads.running
    pairs = {memories: (local, remote) for memories, local, remote in agent.reads}
    assert set(pairs) == {(HOST, 1), (1, 1), (1, HOST)}  # host here from device 1 there, and so on
    local, remote = pairs[(HOST, 1)]
    assert local.tolist() == [[0x1000_0000, 1024, 0]] and remote.tolist() == [[0xA000, 1024, 1]]
    local, remote = pairs[(1, HOST)]
    assert local.tolist() == [[0x3000_0000, 1024, 1]] and remote.tolist() == [[0xC000, 1024, 0]]
    local, remote = pairs[(1, 1)]
    assert local.tolist() == [[0x2000_0000, 1024, 1]] and remote.tolist() == [[0xB000, 1024, 1]]
    # all host both ends (the wire's empty memories): one read, as before device memory
    agent.reads.clear()
    host = RangeReads(agent, (_rows(0, 0x1000, HOST, 2), _rows(1, 0x1200, HOST, 2)), "peer")  # type: ignore[arg-type]
    host.remote = (np.array([[0x5000, 2]], np.uint64), np.array([[0x6000, 2]], np.uint64))
    host.plan((2, 2), ((0, 2),))
    host.start(0, 1)
    assert [m for m, _, _ in agent.reads] == [(HOST, HOST)]


@pytest.mark.parametrize(("preset", "expected"), [(None, "on"), ("off", "off")])
def test_cuda_ipc_get_is_enabled_for_nixl_unless_the_user_said_otherwise(preset: str | None, expected: str) -> None:
    """UCX turns cuda_ipc's zero-copy get off where it finds no active NVLink (one GPU, or GPUs on
    PCIe), and a one-sided read of device rows then crawls over TCP (0.08 GB/s measured on an
    H100, 18-68 GB/s with it on). The plugin sets it in the environment, where NIXL's UCX reads
    it, and keeps what the user set."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"}
    if preset is not None:
        env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = preset
    code = "import os, kvwire_ucx.backend; print(os.environ['UCX_CUDA_IPC_ENABLE_GET_ZCOPY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == expected
