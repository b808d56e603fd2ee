"""Issue 33's third row: device rows between two processes on one GPU over kvwire-ucx (both modes)
vs a cudaMemcpy of the same bytes between the same two processes' buffers over CUDA IPC (torch's
IPC handle of the serving tensor, opened here). Medians; ratio = the copy's time / kvwire's.

    python bench/bench_gpu_ucx.py [--runs 7] [--sizes-mib 1,16,64,256] [--slot-kib 64]

A row is one 64 KiB slot by default: 16 tokens x 8 KV heads x 128 x (K, V) in bf16, one layer of
an 8B-class model's block. Needs a CUDA device, and UCX with its CUDA transports (see
bench/device_ucx_bundle.sh for a host without network)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ucx_device_peer as peer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--sizes-mib", default="1,16,64,256")
    parser.add_argument("--slot-kib", type=int, default=64)
    parser.add_argument("--modes", default="two-sided,one-sided")
    parser.add_argument("--window-mib", type=int, default=0, help="the puller's window_bytes (0: its default)")
    args = parser.parse_args()
    slot = args.slot_kib << 10
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    blocks = max(sizes) // slot
    print(f"# {torch.cuda.get_device_name()} | rows of {args.slot_kib} KiB | {args.runs} runs, medians | "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'mode':<10} {'MiB':>5} {'kvwire ms':>10} {'GB/s':>7} {'IPC copy ms':>12} {'GB/s':>7} {'ratio':>6}")
    for mode in args.modes.split(","):
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "ucx_device_peer.py"),
                                 "--mode", mode, "--groups", "1", "--blocks", str(blocks), "--slot-bytes", str(slot)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            first = json.loads(proc.stdout.readline())
            if "device" not in first["memory_kinds"]:
                print(f"{mode}: the UCX here has no CUDA transports; nothing measured")
                continue
            handle = [bytes.fromhex(x) if isinstance(x, str) else x for x in first["ipc"]]
            there = torch.empty(0, dtype=torch.uint8, device="cuda").set_(torch.UntypedStorage._new_shared_cuda(*handle))
            options = {"window_bytes": args.window_mib << 20} if args.window_mib else {}
            puller = peer.Puller(mode, 1, blocks, slot, **options)
            # the names as one array, built once: joining 16k names per pull took ~1 ms on its own
            names = np.frombuffer(b"".join(peer.names(1, blocks)), dtype=np.uint8).reshape(blocks, -1)
            address = bytes.fromhex(first["address"])
            puller.pull(address, names[:16])  # connection and wire-up
            for size in sizes:
                n = size // slot
                ours, copies, steps = [], [], []
                for _ in range(args.runs):
                    puller.tensors[0].zero_()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    outcome = puller.pull(address, names[:n])
                    torch.cuda.synchronize()
                    ours.append(time.perf_counter() - start)
                    steps.append(puller.timeline)
                    if outcome.status.value != "delivered" or not bool(outcome.masks[0].all()):
                        raise SystemExit(f"{mode} {size >> 20} MiB: {outcome}")
                    start = time.perf_counter()
                    puller.tensors[0].view(-1)[:size].copy_(there.view(-1)[:size])
                    torch.cuda.synchronize()
                    copies.append(time.perf_counter() - start)
                if not torch.equal(puller.tensors[0][:n], there.view(blocks, slot)[:n]):
                    raise SystemExit(f"{mode}: the rows pulled differ from the served ones")
                a, b = statistics.median(ours), statistics.median(copies)
                print(f"{mode:<10} {size >> 20:>5} {a * 1e3:>10.3f} {size / a / 1e9:>7.2f} {b * 1e3:>12.3f} "
                      f"{size / b / 1e9:>7.1f} {b / a:>6.3f}", flush=True)
                print("           steps (ms from the submission, medians): " + ", ".join(
                    f"{step} {statistics.median(s.get(step, float('nan')) for s in steps) * 1e3:.3f}"
                    for step in steps[0]), flush=True)
            left = puller.close()
            print(f"{mode}: left at the puller after shutdown: {len(left)}")
            del there  # the serving process's memory, opened here: let go of it before that process ends
            torch.cuda.ipc_collect()
        finally:
            proc.stdin.close()
            print(f"{mode}: serving end: {proc.stdout.read().strip()}")
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
