"""Issue 33's third row: device rows between two processes on one GPU over kvwire-ucx (both modes)
vs a cudaMemcpy of the same bytes between the same two processes' buffers over CUDA IPC (torch's
IPC handle of the serving tensor, opened here). Medians; ratio = the copy's time / kvwire's.

    python bench/bench_gpu_ucx.py [--runs 7] [--sizes-mib 1,16,64,256] [--slot-kib 64] [--no-raw]

Beside each row, unless ``--no-raw``, the transport alone on the same bytes (``raw``): for the
one-sided mode one bare NIXL READ of the span between agents wired up in advance (no request, no
answer, no attempt); for the two-sided mode bare ucxx tag messages between two workers of this
process, one per row as kvwire-ucx sends them, and the whole span as one message. kvwire/raw is
what kvwire's protocol costs over its transport; raw/copy is how near the transport itself comes
to the IPC copy.

A row is one 64 KiB slot by default: 16 tokens x 8 KV heads x 128 x (K, V) in bf16, one layer of
an 8B-class model's block. Needs a CUDA device, and UCX with its CUDA transports (see
bench/device_ucx_bundle.sh for a host without network)."""

from __future__ import annotations

import argparse
import json
import os
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
    parser.add_argument("--no-raw", action="store_true", help="skip the raw transport rows")
    parser.add_argument("--spin-us", type=int, default=0, help="kvwire-ucx's spin_us option, at both ends")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timed runs, N more pulls of the largest size under cProfile: the puller's "
                             "functions by own time and by cumulative time (where the caller's time goes)")
    args = parser.parse_args()
    slot = args.slot_kib << 10
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    blocks = max(sizes) // slot
    print(f"# {torch.cuda.get_device_name()} | rows of {args.slot_kib} KiB | {args.runs} runs, medians | "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'mode':<10} {'MiB':>5} {'kvwire ms':>10} {'GB/s':>7} {'IPC copy ms':>12} {'GB/s':>7} {'ratio':>6}"
          + ("" if args.no_raw else f" | {'raw ms':>8} {'GB/s':>7} {'kvwire/raw':>10} {'raw/copy':>8}"))
    for mode in args.modes.split(","):
        raw_nixl = mode == "one-sided" and not args.no_raw
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parent / "ucx_device_peer.py"),
                                 "--mode", mode, "--groups", "1", "--blocks", str(blocks), "--slot-bytes", str(slot),
                                 "--spin-us", str(args.spin_us)]
                                + (["--raw-nixl"] if raw_nixl else []),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            first = json.loads(proc.stdout.readline())
            if "device" not in first["memory_kinds"]:
                print(f"{mode}: the UCX here has no CUDA transports; nothing measured")
                continue
            raw: Raw | None = None
            if raw_nixl:
                served = json.loads(proc.stdout.readline())
                raw = RawNixlRead(served)
            elif not args.no_raw:
                raw = RawTags(slot)
            handle = [bytes.fromhex(x) if isinstance(x, str) else x for x in first["ipc"]]
            there = torch.empty(0, dtype=torch.uint8, device="cuda").set_(torch.UntypedStorage._new_shared_cuda(*handle))
            options: dict[str, int] = {"window_bytes": args.window_mib << 20} if args.window_mib else {}
            if args.spin_us:
                options["spin_us"] = args.spin_us
            puller = peer.Puller(mode, 1, blocks, slot, **options)
            # the names as one array, built once: joining 16k names per pull took ~1 ms on its own
            names = np.frombuffer(b"".join(peer.names(1, blocks)), dtype=np.uint8).reshape(blocks, -1)
            address = bytes.fromhex(first["address"])
            puller.pull(address, names[:16])  # connection and wire-up
            pushes = getattr(puller.backend.stats(), "pushes_received", None)  # None: a kvwire-ucx without pushes
            if mode == "one-sided" and pushes is not None:
                # the serving end's standing offer is pushed after this connection's Hello: from here
                # on a covered pull reads at once, with no Pull frame (wire version 4)
                deadline = time.monotonic() + 10
                while puller.backend.stats().pushes_received == 0:
                    if time.monotonic() > deadline:
                        raise SystemExit("one-sided: the serving end's standing offer was never pushed to the puller")
                    time.sleep(0.001)
            for size in sizes:
                n = size // slot
                ours, copies, steps, raws, whole = [], [], [], [], []
                pushed_before = getattr(puller.backend.stats(), "pulls_pushed", 0)
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
                    if raw is not None:
                        raws.append(raw.time(puller.tensors[0], there, size))
                        if isinstance(raw, RawTags):
                            whole.append(raw.time(puller.tensors[0], there, size, one_message=True))
                pushed = getattr(puller.backend.stats(), "pulls_pushed", 0) - pushed_before
                if not torch.equal(puller.tensors[0][:n], there.view(blocks, slot)[:n]):
                    raise SystemExit(f"{mode}: the rows pulled differ from the served ones")
                a, b = statistics.median(ours), statistics.median(copies)
                line = (f"{mode:<10} {size >> 20:>5} {a * 1e3:>10.3f} {size / a / 1e9:>7.2f} {b * 1e3:>12.3f} "
                        f"{size / b / 1e9:>7.1f} {b / a:>6.3f}")
                if raws:
                    r = statistics.median(raws)
                    line += f" | {r * 1e3:>8.3f} {size / r / 1e9:>7.1f} {r / a:>10.3f} {b / r:>8.3f}  ({raw.what})"
                print(line, flush=True)
                if whole:
                    w = statistics.median(whole)
                    print(f"           raw ucxx, the {size >> 20} MiB as one tag message: {w * 1e3:.3f} ms, "
                          f"{size / w / 1e9:.1f} GB/s, {b / w:.3f}x of the IPC copy", flush=True)
                if pushes is not None and mode == "one-sided":
                    print(f"           read from the pushed offer, no Pull frame: {pushed} of {args.runs} pulls",
                          flush=True)
                print("           steps (ms from the submission, medians): " + ", ".join(
                    f"{step} {statistics.median(s.get(step, float('nan')) for s in steps) * 1e3:.3f}"
                    for step in steps[0]), flush=True)
            if args.profile:
                profile(puller, address, names[:max(sizes) // slot], args.profile)
            if raw is not None:
                raw.close()
            left = puller.close()
            print(f"{mode}: left at the puller after shutdown: {len(left)}")
            del there  # the serving process's memory, opened here: let go of it before that process ends
            torch.cuda.ipc_collect()
        finally:
            proc.stdin.close()
            print(f"{mode}: serving end: {proc.stdout.read().strip()}")
            proc.wait(timeout=60)
    return 0


def profile(puller: peer.Puller, address: bytes, block_names: np.ndarray, pulls: int) -> None:
    """``pulls`` pulls of ``block_names`` under cProfile (each followed by a synchronize, as the
    timed ones): the 20 functions of most own time, then of most cumulative time."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    for _ in range(pulls):
        profiler.enable()
        puller.pull(address, block_names)
        torch.cuda.synchronize()
        profiler.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(20)
        print(f"           profile of {pulls} pulls of {len(block_names)} rows, by {key}:")
        print("\n".join("             " + line for line in text.getvalue().splitlines() if line.strip()), flush=True)


class RawNixlRead:
    """The one-sided transport alone: a bare NIXL agent here reads the serving process's tensor
    (registered with a bare agent there) into this process's rows as one span, with no kvwire
    request, answer or attempt around it."""

    what = "raw: one NIXL READ of the span, agents wired up in advance"

    def __init__(self, served: dict) -> None:
        self._reader: peer.RawNixl | None = None
        self._served = served
        self._peer = served["agent"].encode()

    def _ready(self, rows: torch.Tensor) -> peer.RawNixl:
        if self._reader is None:
            region = peer.regions([rows], first_id=900)
            self._reader = peer.RawNixl(f"raw-puller-{os.getpid()}", region)
            self._reader.agent.load_peer(self._peer, 0, bytes.fromhex(self._served["metadata"]))
            self._read(rows, 4096)  # the connection's wire-up, outside every clock
        return self._reader

    def _read(self, rows: torch.Tensor, size: int) -> None:
        assert self._reader is not None
        self._reader.read_span(self._peer, rows.data_ptr(), self._served["base"], size, rows.device.index or 0)

    def time(self, rows: torch.Tensor, there: torch.Tensor, size: int) -> float:
        self._ready(rows)
        rows.zero_()
        torch.cuda.synchronize()
        start = time.perf_counter()
        self._read(rows, size)
        torch.cuda.synchronize()
        took = time.perf_counter() - start
        if not torch.equal(rows.view(-1)[:size], there.view(-1)[:size]):
            raise SystemExit("the raw NIXL read moved bytes that differ from the served ones")
        return took

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


class RawTags:
    """The two-sided transport alone: bare ucxx tag messages between two workers of this
    process (kvwire-ucx's context settings), one per row as kvwire-ucx sends them, or the whole
    span as one message; from a copy of the served rows made here."""

    what = "raw: bare ucxx, one tag message per row, two workers of one process"
    _TAG = 0x5241570000000000

    def __init__(self, row_bytes: int) -> None:
        from kvwire_ucx._ucx import context_config, ucx_api

        self._api = ucx_api
        self._row = row_bytes
        self._workers = []
        for _ in range(2):
            context = ucx_api.UCXContext(config_dict=context_config("lo"),
                                         feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
            self._workers.append((context, ucx_api.UCXWorker(context)))
        receiver = self._workers[1][1]
        address = ucx_api.UCXAddress.create_from_buffer(bytes(receiver.address))
        self._endpoint = ucx_api.UCXEndpoint.create_from_worker_address(self._workers[0][1], address, True)
        self._source: torch.Tensor | None = None

    def time(self, rows: torch.Tensor, there: torch.Tensor, size: int, one_message: bool = False) -> float:
        from kvwire_ucx._ucx import Array
        from kvwire_ucx.regions import DeviceBytes

        if self._source is None or self._source.numel() < size:
            self._source = there.reshape(-1)[:there.numel()].clone()
            self._move(Array, DeviceBytes, rows, 4096, 4096)  # the connection's wire-up, outside every clock
        rows.zero_()
        torch.cuda.synchronize()
        start = time.perf_counter()
        self._move(Array, DeviceBytes, rows, size, size if one_message else self._row)
        torch.cuda.synchronize()
        took = time.perf_counter() - start
        if not torch.equal(rows.view(-1)[:size], there.view(-1)[:size]):
            raise SystemExit("raw ucxx moved bytes that differ from the served ones")
        return took

    def _move(self, array: type, device_bytes: type, rows: torch.Tensor, size: int, message: int) -> None:
        assert self._source is not None
        src = device_bytes(self._source.data_ptr(), size, True)
        dst = device_bytes(rows.data_ptr(), size, False)
        sender, receiver = self._workers[0][1], self._workers[1][1]
        tag = self._api.UCXXTag
        recvs = [receiver.tag_recv(array(dst[i:i + message]), tag(self._TAG | n))
                 for n, i in enumerate(range(0, size, message))]
        sends = [self._endpoint.tag_send(array(src[i:i + message]), tag(self._TAG | n))
                 for n, i in enumerate(range(0, size, message))]
        while not (all(r.completed for r in recvs) and all(s.completed for s in sends)):
            sender.progress_once()
            receiver.progress_once()
        for request in (*recvs, *sends):
            request.check_error()

    def close(self) -> None:
        self._endpoint.close_blocking()
        self._endpoint = None
        self._workers.clear()


Raw = RawNixlRead | RawTags


if __name__ == "__main__":
    sys.exit(main())
