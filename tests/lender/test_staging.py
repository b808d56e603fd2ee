"""Staging round trips, byte for byte: one lender publishes through its staging rows, another
fetches into its own; a stand-in backend moves the bytes through the regions' addresses only,
as a host-memory backend would."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvwire.contract import CacheKind, MemoryKind
from kvwire.lender import CacheLayout, GroupSpec, Lender, Scope

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a CUDA device")]),
]
PROMPT = np.arange(5000, 5000 + 8 * 16 + 5)  # 8 whole blocks of 16 and a partial one


def layout() -> CacheLayout:
    return CacheLayout(
        block_tokens=16,
        num_blocks=24,
        num_state_slots=2,
        groups=(
            GroupSpec(0, CacheKind.PAGED, (2, 2, 16, 2, 8), torch.bfloat16),
            GroupSpec(1, CacheKind.STATE, (4, 8), torch.float32),
            GroupSpec(2, CacheKind.PAGED, (2, 16, 4), torch.float16),
        ),
    )


def random_pages(lender: Lender, seed: int) -> None:
    """Every pool filled with random bytes (NaN patterns included), so only a byte copy agrees."""
    gen = torch.Generator().manual_seed(seed)
    for g in lender.layout.groups:
        pool = lender.pool(g.group_id)
        raw = torch.randint(0, 256, (pool.numel() * pool.element_size(),), dtype=torch.uint8, generator=gen)
        pool.view(-1).view(torch.uint8).copy_(raw.to(pool.device))


def host_rows(group) -> list[bytes]:
    """What a host-memory backend reads: each row's bytes, from the region's addresses alone."""
    assert group.region.memory_kind is MemoryKind.HOST
    return [ctypes.string_at(int(a), group.region.slot_bytes) for a in group.addresses()]


def write_host_rows(group, rows: list[bytes]) -> None:
    for address, data in zip(group.addresses(), rows, strict=True):
        assert len(data) == group.region.slot_bytes
        ctypes.memmove(int(address), data, len(data))


def pool_bytes(lender: Lender, group_id: int, slot: int) -> bytes:
    row = lender.pool(group_id)[slot].contiguous().cpu()
    return row.view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("device", DEVICES)
def test_staged_round_trip_is_byte_exact(device):
    source = Lender(layout(), Scope("m"), device=device, staging_slots=10, region_id_base=0)
    sink = Lender(layout(), Scope("m"), device=device, staging_slots=10, region_id_base=100)
    if device == "cuda":
        assert all(r.memory_kind is MemoryKind.DEVICE and r.device == source.device.index for r in source.regions()[:3])
        assert all(r.memory_kind is MemoryKind.HOST for r in source.regions()[3:])
        assert source.staging(0).is_pinned()
    random_pages(source, 1)
    request = source.open_request(PROMPT)
    source.commit(request, 8 * 16)

    store: dict[bytes, bytes] = {}  # the "store": bytes by content name
    with source.lend_read(request, staging=True) as lease:
        assert lease.wait_ready(10.0)
        for group in lease.view.groups:
            for row, data in enumerate(host_rows(group)):
                store[group.name(row) + bytes([group.group_id])] = data
        lease.mark_arrived([np.ones(g.rows, dtype=bool) for g in lease.view.groups])
    assert len(store) == 8 * 2 + 1

    random_pages(sink, 2)  # the sink's rows hold other bytes before the fetch
    target = sink.open_request(PROMPT)
    delivered = np.array([1, 1, 1, 0, 1, 1, 1, 1], dtype=bool)  # block 3 "fails" in group 0
    before = pool_bytes(sink, 0, int(target.block_table[3]))
    with sink.lend_write(target, staging=True) as lease:
        masks = []
        for group in lease.view.groups:
            write_host_rows(group, [store[group.name(r) + bytes([group.group_id])] for r in range(group.rows)])
            masks.append(delivered if group.group_id == 0 else np.ones(group.rows, dtype=bool))
        assert lease.mark_arrived(masks) == 7 + 1 + 8
    assert sink.resume_bounds(target) == 0, "the state's checkpoint (128) lies past the paged gap at 48"
    assert pool_bytes(sink, 0, int(target.block_table[3])) == before, "an unmarked row never reaches the pool"
    for g in (0, 2):
        for b in range(8):
            if g == 0 and b == 3:
                continue
            assert pool_bytes(sink, g, int(target.block_table[b])) == pool_bytes(source, g, int(request.block_table[b]))
    assert pool_bytes(sink, 1, target.state_slots[1]) == pool_bytes(source, 1, request.state_slots[1])

    # the missing block arrives on a second fetch; now the request resumes at the checkpoint
    with sink.lend_write(target, staging=True) as lease:
        assert [g.rows for g in lease.view.groups] == [5, 5]  # blocks 3..7 of groups 0 and 2; the state is held
        for group in lease.view.groups:
            write_host_rows(group, [store[group.name(r) + bytes([group.group_id])] for r in range(group.rows)])
        lease.mark_arrived([np.ones(5, dtype=bool)] * 2)
    assert sink.resume_bounds(target) == 128
    assert pool_bytes(sink, 0, int(target.block_table[3])) == pool_bytes(source, 0, int(request.block_table[3]))

    for lender, req in ((source, request), (sink, target)):
        lender.close_request(req)
        assert lender.pins() == 0 and lender.stats()["staging_slots_free"] == 10


@pytest.mark.parametrize("device", DEVICES)
def test_unstaged_leases_locate_the_pool(device):
    lender = Lender(layout(), Scope("m"), device=device)
    random_pages(lender, 3)
    request = lender.open_request(PROMPT)
    lender.commit(request, 64)
    with lender.lend_read(request) as lease:
        assert lease.wait_ready(10.0)
        for group, region in zip(lease.view.groups, lender.regions(), strict=True):
            assert group.region == region
            assert (group.slots == (request.block_table[:4] if group.kind is CacheKind.PAGED
                                    else [request.state_slots[1]])).all()
    lender.close_request(request)
    assert lender.pins() == 0
