"""The seed's round trip on real torch pools: one lender publishes a request's blocks through its
staging slots, another lender fetches them into a request of its own, and a test lease holder
drives both exactly as the runtime does: lend, wait for the view, submit it as it stands, wait
for quiescence (woken, never spinning), mark what arrived, release."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from kvwire_memory.driver import MemoryDriver
from kvwire_memory.store import MemoryStore

from kvwire.blob import BlobBackend
from kvwire.contract import CacheKind, Hint, Outcome
from kvwire.lender import CacheLayout, GroupSpec, Lender, Scope
from kvwire.testing.faults import FailKeys, FaultyDriver

B = 16
PROMPT = np.random.default_rng(4).integers(0, 1000, 3 * B + 5)  # three whole blocks and a tail


def rows(block_table, device=None) -> torch.Tensor:
    return torch.tensor(np.array(block_table, dtype=np.int64), device=device)


def layout(groups: int = 2) -> CacheLayout:
    return CacheLayout(B, 16, 0, tuple(GroupSpec(g, CacheKind.PAGED, (2, B, 8), torch.float32) for g in range(groups)))


def drive(backend, lease, op: str, hint: Hint, timeout: float = 10.0) -> Outcome:
    """The holder's sequence, once."""
    assert lease.wait_ready(timeout)
    woken = threading.Event()
    attempt = getattr(backend, op)(lease.view, hint, woken.set)
    deadline = threading.Event()
    timer = threading.Timer(timeout, deadline.set)
    timer.start()
    try:
        while True:
            woken.clear()
            outcome = attempt.poll()
            if outcome is not None and attempt.quiesced():
                break
            assert not deadline.is_set(), "the attempt neither concluded nor quiesced in time"
            woken.wait(timeout)
    finally:
        timer.cancel()
    if op == "fetch":
        lease.mark_arrived(outcome.masks)
    lease.release()
    return outcome


def source_lender(groups: int = 2):
    lender = Lender(layout(groups), Scope("model-x"), staging_slots=8)
    request = lender.open_request(PROMPT)
    for g in lender.layout.groups:  # the "model" writes its pages
        pool = lender.pool(g.group_id)
        for i, slot in enumerate(request.block_table[:4]):
            pool[slot] = torch.randn(pool.shape[1:], generator=torch.Generator().manual_seed(100 * g.group_id + i))
    lender.commit(request, len(PROMPT))
    pages = [lender.pool(g.group_id)[rows(request.block_table[:3])].clone() for g in lender.layout.groups]
    return lender, pages, request


def backend_for(lender: Lender, driver) -> tuple[BlobBackend, object]:
    backend = BlobBackend(driver, namespace="seed", timeout_s=5.0)
    registration = backend.register_regions(lender.regions()[len(lender.layout.groups):])  # staging only
    return backend, registration


def close(backend, registration) -> None:
    assert backend.shutdown() == frozenset()
    registration.close()


def test_pages_come_back_byte_for_byte_and_resume_bounds_cover_the_prompt():
    store = MemoryStore(1 << 26)
    a, pages, req_a = source_lender()
    b = Lender(layout(), Scope("model-x"), staging_slots=8)
    pub, reg_a = backend_for(a, MemoryDriver(store))
    fet, reg_b = backend_for(b, MemoryDriver(store))
    try:
        out = drive(pub, a.lend_read(req_a, staging=True), "publish", Hint.of("store"))
        assert out.is_delivered and all(m.all() and m.size == 3 for m in out.masks)
        req_b = b.open_request(PROMPT)
        out = drive(fet, b.lend_write(req_b, staging=True), "fetch", Hint.of("store"))
        assert out.is_delivered and all(m.all() for m in out.masks)
        for g, expected in zip(b.layout.groups, pages, strict=True):
            got = b.pool(g.group_id)[rows(req_b.block_table[:3])]
            assert torch.equal(got, expected)
        assert b.resume_bounds(req_b) == 3 * B
        a.close_request(req_a)
        b.close_request(req_b)
    finally:
        close(pub, reg_a)
        close(fet, reg_b)
    assert a.pins() == 0 and b.pins() == 0


def test_a_fetch_whose_later_blocks_fault_stops_resume_bounds_at_the_first_gap():
    store = MemoryStore(1 << 26)
    a, pages, req_a = source_lender(groups=1)
    b = Lender(layout(1), Scope("model-x"), staging_slots=8)
    pub, reg_a = backend_for(a, MemoryDriver(store))
    faulty = FaultyDriver(MemoryDriver(store), [FailKeys(op="get", call=1, start=1)])
    fet, reg_b = backend_for(b, faulty)
    try:
        drive(pub, a.lend_read(req_a, staging=True), "publish", Hint.of("store"))
        req_b = b.open_request(PROMPT)
        out = drive(fet, b.lend_write(req_b, staging=True), "fetch", Hint.of("store"))
        assert out.is_failed and "injected" in out.reason      # a fault is a failure, not a miss
        assert list(out.masks[0]) == [True, False, False]      # only the delivered prefix is marked
        assert b.resume_bounds(req_b) == B                      # the first gap stops it
        got = b.pool(0)[int(req_b.block_table[0])]
        assert torch.equal(got, pages[0][0])
        b.close_request(req_b)
        a.close_request(req_a)
    finally:
        close(pub, reg_a)
        close(fet, reg_b)
    assert a.pins() == 0 and b.pins() == 0


def test_a_store_that_declines_for_space_gives_false_bits_not_an_error():
    store = MemoryStore(3 * 2 * B * 8 * 4 + 1, eviction=False)   # room for 3 of the 6 rows
    a, _, req_a = source_lender()
    pub, reg_a = backend_for(a, MemoryDriver(store))
    try:
        out = drive(pub, a.lend_read(req_a, staging=True), "publish", Hint.of("store"))
        assert out.is_delivered
        assert 0 < out.rows_delivered < 6
        a.close_request(req_a)
    finally:
        close(pub, reg_a)
    assert a.pins() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_pages_round_trip_through_staging():
    store = MemoryStore(1 << 26)
    lay = layout()
    a = Lender(lay, Scope("model-x"), device="cuda", staging_slots=8)
    b = Lender(lay, Scope("model-x"), device="cuda", staging_slots=8)
    req_a = a.open_request(PROMPT)
    for g in lay.groups:
        pool = a.pool(g.group_id)
        pool[rows(req_a.block_table, device=pool.device)] = torch.randn_like(pool[: len(req_a.block_table)])
    a.commit(req_a, len(PROMPT))
    pub, reg_a = backend_for(a, MemoryDriver(store))
    fet, reg_b = backend_for(b, MemoryDriver(store))
    try:
        drive(pub, a.lend_read(req_a, staging=True), "publish", Hint.of("store"))
        req_b = b.open_request(PROMPT)
        out = drive(fet, b.lend_write(req_b, staging=True), "fetch", Hint.of("store"))
        assert out.is_delivered
        for g in lay.groups:
            src = a.pool(g.group_id)[rows(req_a.block_table[:3], device="cuda")]
            dst = b.pool(g.group_id)[rows(req_b.block_table[:3], device="cuda")]
            assert torch.equal(src, dst)
        assert b.resume_bounds(req_b) == 3 * B
        a.close_request(req_a)
        b.close_request(req_b)
    finally:
        close(pub, reg_a)
        close(fet, reg_b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_later_blocks_faulting_on_device_stop_at_the_first_gap_and_leave_unmarked_rows_untouched():
    store = MemoryStore(1 << 26)
    layout = CacheLayout(16, 16, 0, (GroupSpec(0, CacheKind.PAGED, (2, 16, 8), torch.float32),))
    prompt = np.arange(16 * 4 + 3)
    a = Lender(layout, Scope("m"), device="cuda", staging_slots=8)
    b = Lender(layout, Scope("m"), device="cuda", staging_slots=8)
    req_a = a.open_request(prompt)
    src = a.pool(0)
    src.copy_(torch.randn_like(src))
    a.commit(req_a, len(prompt))
    sentinel = 7.0
    b.pool(0).fill_(sentinel)
    pub = BlobBackend(MemoryDriver(store))
    fet = BlobBackend(FaultyDriver(MemoryDriver(store), [FailKeys(op="get", call=1, start=2)]))
    regs = [pub.register_regions(a.regions()[1:]), fet.register_regions(b.regions()[1:])]
    drive(pub, a.lend_read(req_a, staging=True), "publish", Hint.of("store"))
    req_b = b.open_request(prompt)
    out = drive(fet, b.lend_write(req_b, staging=True), "fetch", Hint.of("store"))
    assert out.is_failed and list(out.masks[0]) == [True, True, False, False]
    assert b.resume_bounds(req_b) == 32
    table_a = torch.tensor(np.array(req_a.block_table[:4]), device="cuda")
    table_b = torch.tensor(np.array(req_b.block_table[:4]), device="cuda")
    assert torch.equal(b.pool(0)[table_b[:2]], src[table_a[:2]])
    assert bool((b.pool(0)[table_b[2:]] == sentinel).all())   # host -> device copied only marked rows
    a.close_request(req_a)
    b.close_request(req_b)
    for backend, reg in zip((pub, fet), regs, strict=True):
        assert backend.shutdown() == frozenset()
        reg.close()
    assert a.pins() == 0 and b.pins() == 0
