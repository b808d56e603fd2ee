"""The connector's worker core on a CUDA cache: a staged save and a staged load of a request, end to
end through the core's steps (gather, publish, fetch, scatter, every attempt ended), against the
pinned-copy ceiling of the same bytes (one device -> pinned host copy, and back), medians side by
side in one run. No vLLM: the cache is allocated as vLLM 0.32 allocates it (LBNHC, its CUDA
default), 32 layers, 8 KV heads x 128, bf16, block 16 (2 MiB a block over all layers).

    python integrations/vllm/bench/bench_core_gpu.py [--tokens 1024,8192,32768] [--repeat 5]"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "vllm_core"))

from core_driver import IDLE, names, start_load, steps_until  # noqa: E402
from kvwire_vllm.core import WorkerCore  # noqa: E402
from kvwire_vllm.plan import BlockPlan, StepPlan  # noqa: E402
from vllm_layouts import Shape, make_cache  # noqa: E402

from kvwire.lender import blockcopy  # noqa: E402
from kvwire.registry import load  # noqa: E402


def ceiling_s(nbytes: int, repeat: int) -> tuple[float, float]:
    """Median seconds of one device -> pinned copy of ``nbytes``, and of one back."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h, h2d = [], []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - t)
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - t)
    return statistics.median(d2h), statistics.median(h2d)


def saved(core: WorkerCore, req: str, ids: list[int], block_names: np.ndarray) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    core.bind(StepPlan(saves=(BlockPlan(req, 0, tuple(ids), block_names.tobytes()),)))
    core.start_load_kv()
    core.wait_for_save()
    steps_until(core, lambda sent, _: req in sent, 600, finished={req})
    steps_until(core, lambda *_: not core.state()["saves"] and not core.state()["draining"], 600)
    return time.perf_counter() - t


def loaded(core: WorkerCore, req: str, ids: list[int], block_names: np.ndarray) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    start_load(core, req, ids, block_names)
    core.wait_for_save()
    core.bind(IDLE)
    steps_until(core, lambda _, received: req in received, 600)
    elapsed = time.perf_counter() - t
    assert core.take_load_errors() == set(), "a load missed blocks: the bench measured nothing"
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,8192,32768")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_core_gpu: needs a CUDA device")
        return 1
    lengths = [int(x) for x in args.tokens.split(",")]
    most = max(lengths) // 16
    shape = Shape(layers=32, blocks=most + 64, heads=8, block_size=16, head_dim=128)
    row = shape.layers * shape.heads * shape.block_size * 2 * shape.head_dim * 2
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    print(f"bench_core_gpu: {torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} cores, "
          f"{platform.node()}; block copies: {blockcopy.implementation()}")
    print(f"model shape: {shape.layers} layers, {shape.heads} KV heads x {shape.head_dim}, bf16, block "
          f"{shape.block_size} ({row >> 20} MiB a block), layout LBNHC; median of {args.repeat} after a warm-up; "
          f"stores of twice the largest request, evicting; files root {root}")
    print("| store | tokens | save ms | load ms | D->H ceiling ms | H->D ceiling ms | save / ceiling | "
          "load / ceiling |")
    print("|---|---|---|---|---|---|---|---|")
    cache_a = make_cache("LBNHC", shape, seed=1, device="cuda")
    cache_b = make_cache("LBNHC", shape, seed=2, device="cuda")
    # Twice the largest request, evicting: the stores reuse memory they have touched, as a store
    # in steady state does (a fresh store's first touch of every page would be measured otherwise).
    capacity = 2 * (most + 64) * row
    for store in ("memory", "files"):
        with tempfile.TemporaryDirectory(dir=root) as folder:
            options = ({"store": f"bench-{uuid.uuid4().hex[:8]}", "capacity_bytes": capacity, "eviction": True}
                       if store == "memory" else {"root": folder, "capacity_bytes": capacity, "eviction": True})
            mib = (most * row >> 20) + 64
            a = WorkerCore(load(store).build(options), layers=shape.layer_names(), block_size=16, namespace="b",
                           staging_mib=mib, timeout_s=120)
            b = WorkerCore(load(store).build(options), layers=shape.layer_names(), block_size=16, namespace="b",
                           staging_mib=mib, timeout_s=120)
            try:
                a.register_kv_caches(cache_a, shape.blocks)
                b.register_kv_caches(cache_b, shape.blocks)
                for tokens in lengths:
                    n = tokens // 16
                    ids = list(range(n))
                    saves, loads = [], []
                    for i in range(args.repeat + 1):  # the first round warms up (kernels, store pages)
                        block_names = names(n, seed=hash((store, tokens, i)) & 0xFFFF)
                        s_i = saved(a, f"s{tokens}-{i}", ids, block_names)
                        l_i = loaded(b, f"l{tokens}-{i}", ids[::-1], block_names)
                        if i:
                            saves.append(s_i)
                            loads.append(l_i)
                    d2h, h2d = ceiling_s(n * row, args.repeat)
                    s, ld = statistics.median(saves), statistics.median(loads)
                    print(f"| {store} | {tokens} | {s * 1e3:.1f} | {ld * 1e3:.1f} | {d2h * 1e3:.1f} | "
                          f"{h2d * 1e3:.1f} | {d2h / s:.2f}x | {h2d / ld:.2f}x |", flush=True)
            finally:
                assert a.shutdown() and b.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
