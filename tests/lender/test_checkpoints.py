"""STATE checkpoints (``Lender(..., checkpoints=True)``): a checkpoint row per block slot, kept at
every block boundary the model computes, named like its block, living and dying with it; a
request resumes only at a checkpoint the tree holds or that arrived whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvwire.contract import CacheKind
from kvwire.lender import CacheLayout, GroupSpec, LeaseError, Lender, Scope

B = 4
PROMPT = np.arange(100, 130)  # 30 tokens: 7 whole blocks


def layout(num_blocks: int = 16) -> CacheLayout:
    return CacheLayout(B, num_blocks, 2, (
        GroupSpec(0, CacheKind.PAGED, (2, B), torch.float32),
        GroupSpec(1, CacheKind.STATE, (3,), torch.float32),
    ))


def lender(num_blocks: int = 16) -> Lender:
    return Lender(layout(num_blocks), Scope("m"), checkpoints=True)


def prefill(lend: Lender, tokens: np.ndarray) -> int:
    """What the model does: compute from the resume point, write each completed block's K/V and
    its checkpoint (the state after it: here the token count), commit; returns where it began."""
    request = lend.open_request(tokens)
    start = request.cached_tokens
    pages, state = lend.pool(0), lend.pool(1)
    assert state[request.state_slots[1]][0] == float(start), "the request's slot holds the state at its start"
    for b in range(start // B, len(tokens) // B):
        pages[int(request.block_table[b])] = float(b)
        state[int(request.checkpoint_rows[b])] = float((b + 1) * B)
    lend.commit(request, len(tokens), computed_from=start)
    lend.close_request(request)
    return start


def test_a_prefill_keeps_a_checkpoint_at_every_block_boundary_and_a_later_request_resumes_there():
    lend = lender()
    assert lend.pool(1).shape[0] == 2 + 16, "request slots first, then one checkpoint row per block slot"
    assert prefill(lend, PROMPT) == 0
    assert lend.stats()["checkpoints"] == 7
    assert prefill(lend, PROMPT) == 28, "resumes after the prompt's last whole block before its last token"
    # a prompt that shares 5 blocks and then diverges resumes at the end of the shared part
    other = np.concatenate([PROMPT[:21], [999] * 9])
    assert lend.probe_resumable(other) == 5
    assert prefill(lend, other) == 20
    assert lend.pins() == 0


def test_a_block_without_a_checkpoint_resumes_at_the_last_checkpoint_before_it():
    lend = lender()
    request = lend.open_request(PROMPT)
    # blocks 0..6 are committed, but only blocks 0..2 with checkpoints (a commit without
    # computed_from declares none): the request resumes at 12
    lend.commit(request, 12, computed_from=0)
    lend.commit(request, 28, state_tokens=12)
    assert lend.resume_bounds(request) == 12
    lend.close_request(request)
    assert lend.probe(PROMPT) == 7 and lend.probe_resumable(PROMPT) == 3
    again = lend.open_request(PROMPT)
    assert again.cached_tokens == 12
    lend.close_request(again)


def test_a_fetched_checkpoint_counts_only_when_it_arrived_whole_and_is_named_like_its_block():
    source, sink = lender(), lender()
    prefill(source, PROMPT)
    request = sink.open_request(PROMPT[:28])
    with sink.lend_write(request) as lease:
        assert [g.kind for g in lease.view.groups] == [CacheKind.PAGED], "with checkpoints, PAGED rows only"
        lease.mark_arrived([np.ones(7, dtype=bool)])
    assert sink.resume_bounds(request) == 0, "blocks without any checkpoint: resume at 0"
    with sink.lend_checkpoint(request, 28) as lease:
        (group,) = lease.view.groups
        assert group.kind is CacheKind.STATE and group.tokens.end == 28 and group.rows == 1
        assert group.name(0) == bytes(request.names[6]), "the checkpoint after block 6 is named like block 6"
        lease.mark_arrived([np.zeros(1, dtype=bool)])      # did not arrive
    assert sink.resume_bounds(request) == 0
    with sink.lend_checkpoint(request, 28) as lease:
        sink.pool(1)[int(lease.view.groups[0].slots[0])] = 28.0
        lease.mark_arrived([np.ones(1, dtype=bool)])
    assert sink.resume_bounds(request) == 28
    sink.commit(request, 28, state_tokens=0)
    sink.close_request(request)
    assert sink.probe_resumable(PROMPT) == 7
    assert sink.pins() == 0


def test_a_checkpoint_of_a_committed_block_cannot_be_lent_for_writing():
    lend = lender()
    prefill(lend, PROMPT)
    request = lend.open_request(np.arange(100, 140))  # shares PROMPT's 7 whole blocks
    assert request.cached_tokens == 28
    with pytest.raises(ValueError, match="committed and shared"):
        lend.lend_checkpoint(request, 8)
    with pytest.raises(ValueError, match="block boundary"):
        lend.lend_checkpoint(request, 30)
    with lend.lend_checkpoint(request, 32), pytest.raises(LeaseError, match="already lent"):
        lend.lend_checkpoint(request, 36)
    lend.close_request(request)
    assert lend.pins() == 0


def test_serving_a_checkpoint_by_name_and_a_missing_one_as_no_rows():
    lend = lender()
    prefill(lend, PROMPT)
    names = lend.names(PROMPT)
    with lend.lend_checkpoint_names(names[3:4]) as lease:
        (group,) = lease.view.groups
        assert lease.found == 1 and group.kind is CacheKind.STATE and group.tokens.end == 16
        assert lend.pool(1)[int(group.slots[0])][0] == 16.0
        assert lend.pins() == 1, "the checkpoint is pinned through its block"
    other = lend.names(np.arange(500, 530))
    with lend.lend_checkpoint_names(other[:1]) as lease:
        (group,) = lease.view.groups
        assert lease.found == 0 and group.rows == 0 and group.group_id == 1
    assert lend.pins() == 0


def test_publishing_a_prefix_carries_the_checkpoint_at_its_end():
    lend = lender()
    prefill(lend, PROMPT)
    with lend.lend_names(lend.names(PROMPT[:20]), checkpoint=True) as lease:
        paged, state = lease.view.groups
        assert paged.rows == 5 and state.kind is CacheKind.STATE and state.tokens.end == 20
        assert state.name(0) == paged.name(4)
        assert lend.pool(1)[int(state.slots[0])][0] == 20.0
    assert lend.pins() == 0


def test_an_evicted_block_takes_its_checkpoint_with_it():
    lend = lender(num_blocks=8)
    prefill(lend, PROMPT)                           # 7 blocks + the partial last one: all 8 slots
    prefill(lend, np.arange(700, 730))              # evicts the first prompt's blocks
    assert lend.probe_resumable(PROMPT) == 0
    assert lend.stats()["checkpoints"] == 7
    assert prefill(lend, PROMPT) == 0, "a reused slot's old checkpoint never stands for a new block"


def test_checkpoints_need_paged_and_state_groups():
    paged_only = CacheLayout(B, 4, 0, (GroupSpec(0, CacheKind.PAGED, (2,), torch.float32),))
    with pytest.raises(ValueError, match="PAGED and STATE"):
        Lender(paged_only, Scope("m"), checkpoints=True)


def test_staged_checkpoint_leases_copy_through_the_staging_rows():
    """A backend that reaches only host memory gets staged rows: serving copies the checkpoint
    into a staging row; a fetch's marked checkpoint is copied into the pool, an unmarked one not."""
    source = Lender(layout(), Scope("m"), checkpoints=True, staging_slots=4)
    sink = Lender(layout(), Scope("m"), checkpoints=True, staging_slots=4)
    prefill(source, PROMPT)
    names = source.names(PROMPT)
    with source.lend_checkpoint_names(names[2:3], staging=True) as served:
        assert served.wait_ready(5)
        (group,) = served.view.groups
        assert group.region == source.regions()[2 + 1], "the STATE group's staging region"
        staged_row = source.staging(1)[int(group.slots[0])]
        assert staged_row[0] == 12.0
        request = sink.open_request(PROMPT[:28])
        with sink.lend_checkpoint(request, 12, staging=True) as lease:
            sink.staging(1)[int(lease.view.groups[0].slots[0])] = staged_row     # "the transfer"
            lease.mark_arrived([np.zeros(1, dtype=bool)])
        assert sink.pool(1)[int(request.checkpoint_rows[2])][0] == 0.0, "an unmarked row is not copied in"
        with sink.lend_checkpoint(request, 12, staging=True) as lease:
            sink.staging(1)[int(lease.view.groups[0].slots[0])] = staged_row
            lease.mark_arrived([np.ones(1, dtype=bool)])
        assert sink.pool(1)[int(request.checkpoint_rows[2])][0] == 12.0
        assert bool(request.checkpointed[2])
        sink.close_request(request)
    assert source.pins() == sink.pins() == 0
    assert source.stats()["staging_slots_free"] == 4 and sink.stats()["staging_slots_free"] == 4
