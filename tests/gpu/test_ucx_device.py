"""Device rows between two processes on one GPU over kvwire-ucx, in both modes: the serving
process offers CUDA rows, this one pulls them into its own CUDA rows; the bytes arrive whole, a
pull of blocks not offered delivers nothing and writes nothing, and both ends hold nothing after.
Skips without a CUDA device, or where UCX has no CUDA transports (each says which)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

# Without UCX's Python binding the peer cannot import: a skip that says so, never a collection error
# (a GPU host gets ucxx from bench/device_ucx_bundle.sh).
pytest.importorskip("ucxx", reason="needs ucxx, UCX's Python binding (bench/device_ucx_bundle.sh packs it for a GPU host)")

import ucx_device_peer as peer  # noqa: E402

GROUPS, BLOCKS, SLOT = 2, 48, 64 << 10  # a 64 KiB row: 16 tokens x 8 KV heads x 128 x K,V in bf16


@pytest.fixture(params=["two-sided", "one-sided"])
def serving(request):
    mode = request.param
    if mode == "one-sided":
        from kvwire_ucx.nixl import nixl_problem
        if nixl_problem():
            pytest.skip(nixl_problem())
    proc = subprocess.Popen([sys.executable, str(BENCH / "ucx_device_peer.py"), "--mode", mode, "--groups", str(GROUPS),
                             "--blocks", str(BLOCKS), "--slot-bytes", str(SLOT), "--seed", "7"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())
        if "device" not in first["memory_kinds"]:
            pytest.skip("this host's UCX has no CUDA transports (its cuda module did not load)")
        yield mode, bytes.fromhex(first["address"]), proc
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=60)


def test_device_rows_arrive_whole_from_another_process_and_nothing_is_left(serving):
    mode, address, proc = serving
    puller = peer.Puller(mode, GROUPS, BLOCKS, SLOT)
    assert torch.cuda.is_available() and puller.backend.capabilities().memory_kinds >= {peer.MemoryKind.DEVICE}
    expected = peer.fill(7, GROUPS, BLOCKS, SLOT)
    wanted = peer.names(7, BLOCKS)
    outcome = puller.pull(address, wanted[:40])
    torch.cuda.synchronize()
    assert outcome.status.value == "delivered", outcome
    for got, want in zip(puller.tensors, expected, strict=True):
        assert torch.equal(got[:40], want[:40])
        assert not got[40:].any()  # rows not asked for stay as they were
    # a pull whose first block is not offered delivers nothing and writes nothing
    for t in puller.tensors:
        t.zero_()
    missing = peer.names(8, 4)
    outcome = puller.pull(address, missing)
    torch.cuda.synchronize()
    assert not any(mask.any() for mask in outcome.masks)
    assert all(not t.any() for t in puller.tensors)
    assert puller.close() == frozenset()
    proc.stdin.close()
    last = json.loads(proc.stdout.readline())
    assert last == {"left": 0, "quiesced": True}
    assert proc.wait(timeout=60) == 0
