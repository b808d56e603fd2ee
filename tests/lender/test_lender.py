"""The lender's flows as a runtime drives them: reuse, commit, eviction, the three kinds of lease,
resume bounds, and the errors a misuse gets."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from lender_pages import garbage, mixed_layout, page, paged_layout, prefill, state_key, write_blocks

from kvwire.contract import CacheKind, MemoryKind
from kvwire.lender import CacheFull, LeaseError, Lender, Scope, StagingBusy

PROMPT = list(range(100, 111))  # 11 tokens, block_tokens 2: 5 whole blocks


def fill_view(lender, lease, hits) -> None:
    """What a fetching backend does: writes the right bytes into rows whose bit is true, garbage
    into the others, wherever the view says the rows are."""
    view = lease.view
    for group, bits in zip(view.groups, hits, strict=True):
        spec = lender.layout.group(group.group_id)
        target = lender.staging(group.group_id) if group.region.memory_kind is MemoryKind.HOST and lease.staged \
            else lender.pool(group.group_id)
        for row, slot in enumerate(group.slots):
            if group.kind is CacheKind.STATE:
                right = page(state_key(np.array(PROMPT[: group.tokens.end])), spec)
            else:
                right = page(group.name(row), spec)
            target[int(slot)] = right if bits[row] else garbage(spec)


def slot_state(lender) -> dict:
    return {k: v for k, v in lender.stats().items() if k.startswith(("blocks", "pins", "evictions", "state", "staging"))}


def published(lender):
    """A lender whose tree holds PROMPT's 5 whole blocks, nothing open."""
    request = lender.open_request(PROMPT)
    prefill(lender, request)
    lender.close_request(request)
    return lender


def test_regions_describe_the_pools():
    lender = Lender(mixed_layout(), Scope("m"), staging_slots=4, region_id_base=10)
    regions = lender.regions()
    assert [r.region_id for r in regions] == list(range(10, 16))
    for region, g in zip(regions[:3], lender.layout.groups, strict=True):
        pool = lender.pool(g.group_id)
        assert pool.is_contiguous() and region.base == pool.data_ptr()
        assert region.slot_bytes == pool[0].numel() * pool.element_size()
        assert region.slot_count == pool.shape[0] and region.memory_kind is MemoryKind.HOST
    assert all(r.memory_kind is MemoryKind.HOST and r.slot_count == 4 for r in regions[3:])
    assert not any(a.overlaps(b) for i, a in enumerate(regions) for b in regions[i + 1:])


def test_reuse_pins_and_close_returns_them():
    lender = published(Lender(paged_layout(), Scope("m")))
    assert lender.probe(PROMPT) == 5 and lender.pins() == 0
    request = lender.open_request(PROMPT, max_new_tokens=3)
    assert request.cached_tokens == 10 and request.block_table.size == 7
    assert lender.resume_bounds(request) == 10
    assert lender.pins() == 7
    lender.close_request(request)
    lender.close_request(request)  # idempotent
    assert lender.pins() == 0


def test_an_aligned_prompt_leaves_its_last_block_to_compute():
    lender = Lender(paged_layout(), Scope("m"))
    request = lender.open_request(PROMPT[:10])
    prefill(lender, request)
    lender.close_request(request)
    again = lender.open_request(PROMPT[:10])
    assert again.cached_tokens == 8, "the model must compute at least the last token in a private block"
    prefill(lender, again)  # block 4's name is in the tree already: no duplicate is made
    assert lender.stats()["blocks_committed"] == 5
    lender.close_request(again)
    assert lender.stats()["blocks_committed"] == 5 and lender.pins() == 0


def test_eviction_is_lru_and_cache_full_changes_nothing():
    lender = Lender(paged_layout(num_blocks=6), Scope("m"))
    first = lender.open_request([1, 2, 3, 4, 5])
    prefill(lender, first)
    lender.close_request(first)
    second = lender.open_request([9, 8, 7, 6, 5])
    prefill(lender, second)
    lender.close_request(second)
    assert lender.probe([1, 2, 3, 4, 5]) == 2 and lender.probe([9, 8, 7, 6, 5]) == 2
    third = lender.open_request([4, 4, 4, 4, 4, 4, 4])  # 4 blocks: 2 free + the 2 of `first`
    assert lender.stats()["evictions"] == 2
    assert lender.probe([1, 2, 3, 4, 5]) == 0 and lender.probe([9, 8, 7, 6, 5]) == 2
    before = slot_state(lender)
    with pytest.raises(CacheFull, match="pinned"):
        lender.open_request(list(range(50)))
    assert slot_state(lender) == before
    lender.close_request(third)
    assert lender.pins() == 0


def test_a_pinned_block_is_never_evicted():
    lender = published(Lender(paged_layout(num_blocks=6), Scope("m")))
    names = lender.names(PROMPT)
    with lender.lend_names(names[:3]) as lease:
        assert lease.found == 3
        with pytest.raises(CacheFull):
            lender.open_request(list(range(200, 208)))  # 4 blocks; only 3 idle
        other = lender.open_request(list(range(200, 206)))  # 3 blocks: takes the idle ones
        assert lender.probe(PROMPT) == 3
        for g in lender.layout.paged_groups:
            rows = lender.pool(g.group_id)[torch.from_numpy(lease.view.groups[0].slots.copy())]
            for i in range(3):
                assert torch.equal(rows[i], page(names[i].tobytes(), g))
        lender.close_request(other)
    assert lender.pins() == 0


def test_lend_names_pins_only_the_held_prefix():
    lender = published(Lender(paged_layout(), Scope("m")))
    names = lender.names(PROMPT).copy()
    names[3] ^= 1  # a miss at block 3: blocks 3 and 4 are not served, even if 4 were held
    with lender.lend_names(names) as lease:
        assert lease.found == 3 and lease.view.rows == 6
        assert lender.pins() == 3
        assert lease.view.groups[0].tokens.end == 6
    assert lender.pins() == 0
    with lender.lend_names(lender.names(PROMPT)[2:]) as tail:  # a receiver that holds blocks 0, 1
        assert tail.found == 3 and tail.view.groups[0].tokens.start == 4
    with pytest.raises(ValueError, match="shape"):
        lender.lend_names(np.zeros((2, 16), dtype=np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        lender.lend_names(np.zeros((2, 32), dtype=np.int64))
    assert lender.pins() == 0


def test_fetch_with_a_gap_then_commit_serves_later_requests():
    source = published(Lender(paged_layout(), Scope("m")))
    sink = Lender(paged_layout(), Scope("m"), staging_slots=8)
    request = sink.open_request(PROMPT)
    with sink.lend_write(request, staging=True) as lease:
        assert [g.rows for g in lease.view.groups] == [5, 5]
        assert (lease.view.groups[0].names == source.names(PROMPT)).all()
        hits = [np.array([1, 1, 0, 1, 1], dtype=bool), np.array([1, 1, 1, 1, 1], dtype=bool)]
        fill_view(sink, lease, hits)
        assert lease.mark_arrived(hits) == 9
    assert sink.resume_bounds(request) == 4, "group 0's gap at block 2 stops the request"
    g0, g1 = sink.layout.paged_groups
    slot = int(request.block_table[2])
    assert torch.equal(sink.pool(0)[slot], torch.zeros(g0.slot_shape, dtype=g0.dtype)), "unmarked: never copied (A7)"
    assert torch.equal(sink.pool(1)[slot], page(source.names(PROMPT)[2].tobytes(), g1)), "marked in group 1: copied"
    prefill(sink, request)  # recompute from 4, commit everything
    assert sink.resume_bounds(request) == 11
    sink.close_request(request)
    assert sink.probe(PROMPT) == 5 and sink.pins() == 0
    assert sink.stats()["staging_slots_free"] == 8


def test_fetched_block_already_committed_meanwhile_is_not_duplicated():
    lender = Lender(paged_layout(), Scope("m"))
    fetching = lender.open_request(PROMPT)
    lease = lender.lend_write(fetching)
    computing = lender.open_request(PROMPT)
    prefill(lender, computing)  # puts the 5 blocks in the tree under computing's slots
    hits = [np.ones(5, dtype=bool)] * 2
    fill_view(lender, lease, hits)
    lease.mark_arrived(hits)
    lease.release()
    lender.commit(fetching, 11)
    assert lender.stats()["blocks_committed"] == 5
    lender.close_request(computing)  # fetching still pins the tree's copies of its names
    assert lender.probe(PROMPT) == 5
    lender.close_request(fetching)
    assert lender.pins() == 0 and lender.stats()["blocks_committed"] == 5


def test_read_lease_staging_holds_the_pool_rows():
    lender = Lender(mixed_layout(), Scope("m"), staging_slots=8)
    request = lender.open_request(PROMPT)
    prefill(lender, request, 10)
    with lender.lend_read(request, staging=True) as lease:
        assert lease.wait_ready(5.0)
        assert [g.group_id for g in lease.view.groups] == [0, 7, 1], "groups in layout order"
        state = lease.view.groups[1]
        assert state.kind is CacheKind.STATE and state.tokens.end == 10
        for group in lease.view.groups:
            spec = lender.layout.group(group.group_id)
            staged = lender.staging(group.group_id)
            for row, slot in enumerate(group.slots):
                key = state_key(np.array(PROMPT[:10])) if group.kind is CacheKind.STATE else group.name(row)
                assert torch.equal(staged[int(slot)], page(key, spec))
        assert lease.mark_arrived(lease.view.row_masks()) == 0
    lender.close_request(request)
    assert lender.pins() == 0


@pytest.mark.parametrize("delivered, bound", [(True, 10), (False, 0)])
def test_state_counts_only_at_its_checkpoint(delivered, bound):
    lender = Lender(mixed_layout(), Scope("m"))
    request = lender.open_request(PROMPT)
    assert request.cached_tokens == 0, "the tree holds no state, so a STATE layout reuses nothing"
    with lender.lend_write(request) as lease:
        state_row = lease.view.groups[1]
        assert state_row.kind is CacheKind.STATE and state_row.tokens.end == 10
        hits = [np.ones(5, dtype=bool), np.array([delivered]), np.ones(5, dtype=bool)]
        fill_view(lender, lease, hits)
        lease.mark_arrived(hits)
    assert lender.resume_bounds(request) == bound
    assert lender.pool(7)[request.state_slots[7]].equal(page(state_key(np.array(PROMPT[:10])), lender.layout.group(7))) \
        == delivered
    lender.close_request(request)


def test_state_beyond_the_paged_bound_resumes_at_zero():
    lender = Lender(mixed_layout(), Scope("m"))
    request = lender.open_request(PROMPT)
    with lender.lend_write(request) as lease:
        hits = [np.array([1, 1, 1, 0, 1], dtype=bool), np.array([True]), np.ones(5, dtype=bool)]
        lease.mark_arrived(hits)
    assert lender.resume_bounds(request) == 0  # checkpoint 10 > paged bound 6
    lender.close_request(request)


def test_mark_and_release_misuse_is_refused_clearly():
    lender = Lender(paged_layout(), Scope("m"))
    request = lender.open_request(PROMPT)
    lease = lender.lend_write(request)
    with pytest.raises(ValueError, match=r"one per view group"):
        lease.mark_arrived(lease.view.row_masks()[:1])
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        lease.mark_arrived([np.zeros(4, dtype=bool), np.zeros(5, dtype=bool)])
    with pytest.raises(TypeError, match="dtype bool"):
        lease.mark_arrived([np.zeros(5, dtype=np.uint8), np.zeros(5, dtype=bool)])
    with pytest.raises(TypeError, match="bool numpy array"):
        lease.mark_arrived([[True] * 5, np.zeros(5, dtype=bool)])
    with pytest.raises(LeaseError, match="already lent for writing"):
        lender.lend_write(request)
    with pytest.raises(LeaseError, match="lent for writing"):
        lender.commit(request, 11)
    assert lease.mark_arrived(lease.view.row_masks()) == 0
    with pytest.raises(LeaseError, match="already called"):
        lease.mark_arrived(lease.view.row_masks())
    lease.release()
    lease.release()
    late = lender.lend_write(request)
    late.release()
    with pytest.raises(LeaseError, match="after release"):
        late.mark_arrived(late.view.row_masks())
    lender.close_request(request)
    with pytest.raises(LeaseError, match="closed"):
        lender.lend_read(request)
    with pytest.raises(LeaseError, match="no staging"):
        lender.lend_names(lender.names(PROMPT), staging=True)
    assert lender.pins() == 0


def test_exception_inside_with_releases():
    lender = published(Lender(paged_layout(), Scope("m"), staging_slots=5))
    with pytest.raises(RuntimeError, match="boom"), lender.lend_names(lender.names(PROMPT), staging=True) as lease:
        assert lender.pins() == 5
        raise RuntimeError("boom")
    assert lease.released and lender.pins() == 0 and lender.stats()["staging_slots_free"] == 5


def test_staging_is_bounded_first_come_first_served():
    lender = published(Lender(paged_layout(), Scope("m"), staging_slots=6))
    names = lender.names(PROMPT)
    first = lender.lend_names(names, staging=True)  # 5 rows
    with pytest.raises(StagingBusy, match="needs 2 staging slot"):
        lender.lend_names(names[:2], staging=True)
    assert lender.pins() == 5, "the refused lease took no pin"
    with lender.lend_names(names[:1], staging=True):
        assert lender.stats()["staging_slots_free"] == 0
    first.release()
    assert lender.stats()["staging_slots_free"] == 6 and lender.pins() == 0


def test_write_lease_never_covers_committed_blocks():
    lender = published(Lender(paged_layout(), Scope("m")))
    request = lender.open_request(PROMPT[:10])
    with lender.lend_write(request) as lease:  # blocks 0..3 are reused and valid: only block 4
        assert lease.view.groups[0].tokens == type(lease.view.groups[0].tokens)(8, 10)
    with pytest.raises(ValueError, match="committed"):
        lender.lend_write(request, first_block=0)
    lender.close_request(request)


def test_extend_names_generated_blocks():
    lender = Lender(paged_layout(), Scope("m"))
    request = lender.open_request(PROMPT, max_new_tokens=4)
    prefill(lender, request)
    lender.extend(request, [7, 8, 9])
    assert (request.names == lender.names(PROMPT + [7, 8, 9])).all()
    write_blocks(lender, request, 5, 7)
    lender.commit(request, 14)
    with pytest.raises(ValueError, match="max_new_tokens"):
        lender.extend(request, [1, 2])
    lender.close_request(request)
    assert lender.probe(PROMPT + [7, 8, 9]) == 7


def test_concurrent_runtime_and_serving_threads_balance_pins():
    lender = published(Lender(paged_layout(num_blocks=16), Scope("m"), staging_slots=8))
    names = lender.names(PROMPT)
    errors: list[BaseException] = []
    stop = threading.Event()

    def serve() -> None:
        try:
            while not stop.is_set():
                try:
                    with lender.lend_names(names, staging=True) as lease:
                        lease.wait_ready(1.0)
                        lease.mark_arrived(lease.view.row_masks())
                except StagingBusy:
                    pass
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=serve) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(150):
            request = lender.open_request(PROMPT[: 3 + i % 9])
            prefill(lender, request)
            with lender.lend_read(request):
                pass
            lender.close_request(request)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not errors
    assert lender.pins() == 0 and lender.stats()["staging_slots_free"] == 8


def test_rows_lent_in_place_are_invalid_until_marked():
    """A fetch may leave any bytes in rows it does not deliver (A7), so a row lent in place for
    writing stops counting until marked, even if an earlier fetch had delivered it."""
    lender = Lender(paged_layout(), Scope("m"), staging_slots=8)
    request = lender.open_request(PROMPT)
    with lender.lend_write(request) as first:
        first.mark_arrived([np.zeros(5, dtype=bool), np.ones(5, dtype=bool)])  # group 1 only
    assert lender.resume_bounds(request) == 0
    with lender.lend_write(request) as again:  # from block 0: group 0 lacks it
        assert lender.resume_bounds(request) == 0
        again.mark_arrived([np.ones(5, dtype=bool), np.zeros(5, dtype=bool)])
    assert lender.resume_bounds(request) == 0, "group 1's rows were lent in place and not marked again"
    with lender.lend_write(request, staging=True) as staged:  # the pool is untouched until marking
        staged.mark_arrived([np.zeros(5, dtype=bool), np.array([1, 1, 0, 0, 0], dtype=bool)])
    assert lender.resume_bounds(request) == 4
    lender.close_request(request)
    assert lender.pins() == 0


def test_a_lease_dropped_unreleased_is_reported(caplog):
    lender = published(Lender(paged_layout(), Scope("m")))
    lease = lender.lend_names(lender.names(PROMPT))
    with caplog.at_level("WARNING", logger="kvwire.lender.lease"):
        del lease
    assert "without release()" in caplog.text
    assert lender.pins() == 5, "the pins stay taken: a leak is reported, never papered over"
