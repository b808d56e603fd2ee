"""kvwire.lender.blockcopy on a CUDA device: copies between device planes and pinned host rows
(through the bounded device scratch, chunked when the rows outgrow it, or by the kernel on host
memory), ordering on the caller's stream, two streams sharing the scratch, and what only a device
can refuse. The property tests over layouts and block tables run on CUDA in
tests/lender/test_blockcopy.py. Every test here skips without a CUDA device."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kvwire.lender import blockcopy
from kvwire.lender.blockcopy import PlaneSet, gather, scatter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HAS_TRITON = importlib.util.find_spec("triton") is not None
IMPLS = ["torch", "triton"] if HAS_TRITON else ["torch"]
# (implementation, whether the kernel runs on host memory directly): that exists only as Triton
HOST_PATHS = [pytest.param("torch", False, id="scratch-torch")] + (
    [pytest.param("triton", False, id="scratch-triton"), pytest.param("triton", True, id="direct-triton")]
    if HAS_TRITON else [])


def use(monkeypatch: pytest.MonkeyPatch, impl: str) -> None:
    if impl == "triton":
        if blockcopy._kernel is None:
            blockcopy._kernel = blockcopy._build_kernel()
        monkeypatch.setattr(blockcopy, "_choice", (blockcopy._Impl.TRITON, "triton (test)"))
    else:
        monkeypatch.setattr(blockcopy, "_choice", (blockcopy._Impl.TORCH, "torch (test)"))


def kv(layers: int, blocks: int, seed: int, bs: int = 16, heads: int = 2, dim: int = 64) -> list[torch.Tensor]:
    """FlashAttention-layout layers (2, blocks, bs, heads, dim) of random bf16 bytes, as planes."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    planes = []
    for _ in range(layers):
        t = torch.randint(-32768, 32767, (2, blocks, bs, heads, dim), dtype=torch.int16, device="cuda",
                          generator=gen).view(torch.bfloat16)
        planes.extend([t[0], t[1]])
    return planes


def row(planes: list[torch.Tensor], b: int) -> torch.Tensor:
    return torch.cat([p[b].reshape(-1).view(torch.uint8) for p in planes]).cpu()


def pinned_rows(n: int, row_bytes: int, seed: int) -> torch.Tensor:
    rows = torch.empty((n, row_bytes), dtype=torch.uint8, pin_memory=True)
    rows.copy_(torch.randint(0, 256, (n, row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return rows


def test_the_kernel_is_chosen_where_triton_imports():
    name = blockcopy.implementation()
    assert name.startswith("triton ") if HAS_TRITON else name.startswith("torch (int64 views")


@pytest.mark.parametrize(("impl", "direct"), HOST_PATHS)
@pytest.mark.parametrize("scratch_rows", [1, 3, 1000])
def test_device_blocks_to_pinned_rows_and_back(monkeypatch, impl, direct, scratch_rows):
    """Rows with gaps, out of order, in a scratch of 1, 3 or plenty of rows: every listed row is
    its block, every other row keeps its bytes; back into other blocks, bit for bit."""
    use(monkeypatch, impl)
    monkeypatch.setattr(blockcopy, "_HOST_DIRECT", direct)
    planes = kv(3, 50, seed=1)
    ps = PlaneSet(planes)
    monkeypatch.setattr(blockcopy, "SCRATCH_BYTES", scratch_rows * ps.row_bytes)
    monkeypatch.setattr(blockcopy, "_SCRATCH", blockcopy._Scratch())  # a fresh one, of that size
    ids = np.array([7, 3, 49, 3, 0, 12, 13, 14], dtype=np.int64)
    at = np.array([9, 2, 3, 4, 0, 15, 11, 12], dtype=np.int64)  # runs 2-4, 11-12; gaps; unsorted
    host = pinned_rows(16, ps.row_bytes, seed=2)
    before = host.clone()
    gather(ps, ids, host, at).synchronize()
    for b, r in zip(ids.tolist(), at.tolist(), strict=True):
        assert torch.equal(host[r], row(planes, b)), f"row {r}"
    others = np.setdiff1d(np.arange(16), at)
    assert torch.equal(host[others], before[others]), "a row not listed changed"

    sink = [torch.zeros_like(p) for p in kv(3, 50, seed=3)]
    back = PlaneSet(sink)
    targets = np.array([40, 41, 42, 1, 2, 30, 31, 5], dtype=np.int64)
    scatter(host, at, back, targets).synchronize()
    for b, src in zip(targets.tolist(), ids.tolist(), strict=True):
        assert torch.equal(row(sink, b), row(planes, src)), f"block {b}"
    untouched = np.setdiff1d(np.arange(50), targets)
    assert all(not p[torch.as_tensor(untouched, device="cuda")].view(torch.int16).any() for p in sink)


@pytest.mark.parametrize("impl", IMPLS)
def test_large_tables_on_the_device_are_exact(monkeypatch, impl):
    """4096 random blocks of 512 KiB planes' worth, and of 4 KiB ones, device to device."""
    use(monkeypatch, impl)
    for chunk_elems, blocks, n in ((256 * 1024, 64, 48), (2048, 8192, 4096)):
        plane = torch.randint(-32768, 32767, (blocks, chunk_elems), dtype=torch.int16, device="cuda")
        other = torch.randint(-32768, 32767, (blocks, chunk_elems), dtype=torch.int16, device="cuda")
        ps = PlaneSet([plane, other])
        ids = torch.randint(0, blocks, (n,), generator=torch.Generator().manual_seed(n))
        out = torch.empty((n, ps.row_bytes), dtype=torch.uint8, device="cuda")
        gather(ps, ids, out).synchronize()
        idx = ids.cuda()
        expected = torch.cat([plane[idx].view(torch.uint8), other[idx].view(torch.uint8)], dim=1)
        assert torch.equal(out, expected)
        dst = PlaneSet([torch.zeros_like(plane), torch.zeros_like(other)])
        distinct = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))[:n]
        scatter(out, None, dst, distinct).synchronize()
        assert torch.equal(dst.planes[0][distinct.cuda()], plane[idx])
        assert torch.equal(dst.planes[1][distinct.cuda()], other[idx])


@pytest.mark.parametrize(("impl", "direct"), HOST_PATHS)
def test_the_copy_runs_after_the_work_queued_on_its_stream(monkeypatch, impl, direct):
    """The planes are filled on a side stream that first spins for a while; a gather queued on
    that stream sees the filled bytes, and its event says when the host rows hold them."""
    use(monkeypatch, impl)
    monkeypatch.setattr(blockcopy, "_HOST_DIRECT", direct)
    planes = kv(2, 8, seed=4)
    ps = PlaneSet(planes)
    host = pinned_rows(4, ps.row_bytes, seed=5)
    device_rows = torch.zeros((4, ps.row_bytes), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the fill lands late unless the copy waits for it
        for p in planes:
            p.view(torch.int16).fill_(0x1234)
    ev_host = gather(ps, [1, 5], host, [3, 0], stream=side)
    ev_dev = gather(ps, [2], device_rows, [1], stream=side)
    ev_host.synchronize()
    ev_dev.synchronize()
    expected = torch.full((ps.row_bytes // 2,), 0x1234, dtype=torch.int16).view(torch.uint8)
    assert torch.equal(host[3], expected) and torch.equal(host[0], expected)
    assert torch.equal(device_rows[1].cpu(), expected)


def test_two_streams_share_the_scratch_in_order(monkeypatch):
    """A long gather to host rows on one stream, then another on a second stream: the second's
    use of the scratch waits for the first's DMA, so both land whole."""
    monkeypatch.setattr(blockcopy, "_HOST_DIRECT", False)
    planes = kv(4, 600, seed=6)
    ps = PlaneSet(planes)
    first = pinned_rows(512, ps.row_bytes, seed=7)
    second = pinned_rows(64, ps.row_bytes, seed=8)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    ids_a = np.random.default_rng(9).permutation(600)[:512]
    ids_b = np.random.default_rng(10).permutation(600)[:64]
    ev_a = gather(ps, ids_a, first, stream=a)
    ev_b = gather(ps, ids_b, second, stream=b)
    ev_a.synchronize()
    ev_b.synchronize()
    for r in (0, 1, 255, 511):
        assert torch.equal(first[r], row(planes, int(ids_a[r])))
    for r in range(64):
        assert torch.equal(second[r], row(planes, int(ids_b[r])))


def test_what_only_a_device_can_refuse():
    planes = kv(1, 4, seed=11)
    ps = PlaneSet(planes)
    pageable = torch.zeros((2, ps.row_bytes), dtype=torch.uint8)
    with pytest.raises(ValueError, match="pageable host memory"):
        gather(ps, [0], pageable)
    with pytest.raises(TypeError, match="tensor on cuda"):
        gather(ps, torch.tensor([0], device="cuda"), torch.zeros((1, ps.row_bytes), dtype=torch.uint8, device="cuda"))
    with pytest.raises(ValueError, match="plane 1 is on cpu but plane 0 on cuda"):
        PlaneSet([planes[0], planes[1].cpu()])
    with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream"):
        gather(ps, [0], pinned_rows(1, ps.row_bytes, 0), stream="side")
    cpu_set = PlaneSet([p.cpu() for p in planes])
    with pytest.raises(ValueError, match="on cuda:0 but the planes on cpu"):
        gather(cpu_set, [0], torch.zeros((1, ps.row_bytes), dtype=torch.uint8, device="cuda"))
