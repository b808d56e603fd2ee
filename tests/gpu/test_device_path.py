"""The device-memory path: lender pools on a CUDA device as DEVICE regions, staging through host
slots for a backend that reaches host memory only, and the tiny model proving a transfer between
two device caches. Every test here skips cleanly without a CUDA device, except the refusal of
DEVICE rows, which a region declared as device memory shows on the CPU too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvwire_memory.driver import MemoryDriver
from kvwire_memory.store import MemoryStore

from kvwire.blob import BlobBackend
from kvwire.contract import (
    CacheKind,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    SlotRegion,
    TokenRange,
    View,
)
from kvwire.lender import CacheLayout, GroupSpec, Lender, Scope
from kvwire.runtime import ModelConfig, Worker

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODEL = ModelConfig(layers=4, layers_per_group=2, heads=4, head_dim=32, block_tokens=16, max_tokens=2048, seed=11)


def test_a_host_only_backend_refuses_device_rows_even_on_the_cpu():
    backend = BlobBackend(MemoryDriver(MemoryStore(1 << 20)))
    device_region = SlotRegion(7, 1 << 40, 256, 4, MemoryKind.DEVICE, device=0)  # declared, never touched
    with pytest.raises(InvalidSubmission):
        backend.register_regions([device_region])
    view = View((LayerGroupRows(0, CacheKind.PAGED, device_region, [0, 1], TokenRange(0, 32), np.zeros((2, 32), np.uint8)),))
    with pytest.raises(InvalidSubmission):
        backend.fetch(view, Hint.of("store"), lambda: None)
    assert backend.shutdown() == frozenset()


def test_the_holder_falls_back_to_staging_when_the_backend_cannot_reach_the_pools():
    w = Worker(MODEL, backend="memory", options={"store": "gpu-fallback"}, num_blocks=32)
    try:
        assert w.staged is (w.device.type == "cuda")
        assert MemoryKind.DEVICE not in w.capabilities.memory_kinds
    finally:
        w.close()


@cuda
def test_device_pools_are_device_regions_with_their_index():
    layout = CacheLayout(16, 8, 0, (GroupSpec(0, CacheKind.PAGED, (2, 16, 8), torch.float16),))
    lender = Lender(layout, Scope("m"), device="cuda", staging_slots=4)
    pool, staging = lender.regions()
    assert pool.memory_kind is MemoryKind.DEVICE and pool.device == torch.cuda.current_device()
    assert pool.base == lender.pool(0).data_ptr()
    assert staging.memory_kind is MemoryKind.HOST and lender.staging(0).is_pinned()


@cuda
def test_logits_equal_after_a_transfer_between_two_device_caches():
    store = "gpu-logits"
    with Worker(MODEL, backend="memory", options={"store": store}, device="cuda", num_blocks=64, name="A") as a, \
         Worker(MODEL, backend="memory", options={"store": store}, device="cuda", num_blocks=64, name="B") as b:
        assert a.staged and b.staged
        p = np.random.default_rng(2).integers(0, MODEL.vocab, 500)
        local = a.generate(p, max_tokens=3)
        assert a.publish(p).status == "delivered"
        pulled = b.pull(p, source=a.transceiver_state())
        assert pulled.status == "delivered" and pulled.cached_tokens == 496
        remote = b.generate(p, max_tokens=3)
        assert remote.cached_tokens == 496
        assert torch.allclose(remote.logits, local.logits, rtol=1e-4, atol=1e-4)
        assert remote.tokens == local.tokens
        assert a.pins() == 0 and b.pins() == 0
