"""Device rows between two processes on one GPU over kvwire-ucx: the serving process (run this
file) and the pulling end (:class:`Puller`), used by ``bench/bench_gpu_ucx.py`` and
``tests/gpu/test_ucx_device.py``.

The serving process fills ``groups`` CUDA tensors of ``blocks`` rows of ``slot_bytes`` with bytes
drawn from ``seed``, registers them as DEVICE regions, and offers every block under its name
(O1: answered on kvwire-ucx's progress thread). It prints one JSON line (its address, what its
backend reaches, and a CUDA IPC handle of its first tensor for the bench's baseline) and serves
until its standard input closes (declining pulls of blocks it did not offer); then it cancels the offer, shuts down and prints ``left`` (what
it still held, which must be nothing)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from kvwire_ucx.backend import UcxBackend

from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, Outcome, SlotRegion, TokenRange, View
from kvwire.holding import AtDeadline, Direction, WaitStatus, submit, wait

BLOCK_TOKENS = 16


def names(seed: int, blocks: int) -> list[bytes]:
    return [hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=16).digest() for i in range(blocks)]


def fill(seed: int, groups: int, blocks: int, slot_bytes: int) -> list[torch.Tensor]:
    """The serving end's rows: the same bytes for the same arguments on the same device."""
    out = []
    for g in range(groups):
        generator = torch.Generator(device="cuda").manual_seed(seed * 1000 + g)
        out.append(torch.randint(0, 256, (blocks, slot_bytes), dtype=torch.uint8, device="cuda", generator=generator))
    return out


def regions(tensors: Sequence[torch.Tensor], first_id: int = 0) -> list[SlotRegion]:
    return [SlotRegion(first_id + i, t.data_ptr(), t.shape[1], t.shape[0], MemoryKind.DEVICE, device=t.device.index or 0)
            for i, t in enumerate(tensors)]


def view(region_list: Sequence[SlotRegion], slots: Sequence[int] | np.ndarray,
         block_names: Sequence[bytes] | np.ndarray) -> View:
    """Arrays are taken as they are (a bench builds them once, outside its clock)."""
    slot_array = slots if isinstance(slots, np.ndarray) else np.asarray(slots, dtype=np.int64)
    name_array = (block_names if isinstance(block_names, np.ndarray) else
                  np.frombuffer(b"".join(block_names), dtype=np.uint8).reshape(len(block_names), -1))
    tokens = TokenRange(0, len(slots) * BLOCK_TOKENS)
    groups: list[LayerGroupRows] = []
    for g, r in enumerate(region_list):  # the first group's read-only copies go to the others as they are
        groups.append(LayerGroupRows(g, CacheKind.PAGED, r, groups[0].slots if groups else slot_array, tokens,
                                     groups[0].names if groups else name_array))
    return View(tuple(groups))


class Puller:
    """The pulling end: ``groups`` zeroed CUDA tensors registered as DEVICE regions, and pulls of
    named blocks from a serving address into their first rows."""

    def __init__(self, mode: str, groups: int, blocks: int, slot_bytes: int, **options: Any) -> None:
        self.backend = UcxBackend(mode=mode, **options)
        self.timeline: dict[str, float] = {}
        self.tensors = [torch.zeros((blocks, slot_bytes), dtype=torch.uint8, device="cuda") for _ in range(groups)]
        self.regions = regions(self.tensors, first_id=100)
        self.registration = self.backend.register_regions(self.regions)

    def pull(self, address: bytes, block_names: Sequence[bytes] | np.ndarray, timeout_s: float = 60.0) -> Outcome:
        began = time.perf_counter()
        slots = np.arange(len(block_names), dtype=np.int64)
        rows = view(self.regions, slots, block_names)
        built = time.perf_counter()
        submission = submit(self.backend, Direction.FETCH, rows, Hint.of("peer", address=address, timeout_s=timeout_s))
        waited = wait(submission, timeout_s + 10, quiesce=True, at_deadline=AtDeadline.RETURN)
        if waited.status is not WaitStatus.DONE or waited.outcome is None:
            raise RuntimeError(f"the pull did not end: {waited.describe()}")
        submitted = getattr(submission.attempt, "submitted_at", 0.0)
        # where the pull's time went, from the submission (negative: before it)
        self.timeline = {"began": began - submitted, "view built": built - submitted}
        self.timeline.update(getattr(submission.attempt, "timeline", dict)())
        self.timeline["returned"] = time.perf_counter() - submitted
        return waited.outcome

    def close(self) -> frozenset[Any]:
        self.registration.close()
        return self.backend.shutdown()


class RawNixl:
    """A bare NIXL agent (kvwire-ucx's thin wrapper of it, no kvwire protocol) with ``regions``
    registered: the transport alone, for the bench's raw row."""

    def __init__(self, name: str, region_list: Sequence[SlotRegion]) -> None:
        from kvwire_ucx.nixl import NixlAgent

        self.name = name
        self.agent = NixlAgent(name, loopback=True)
        self._handles = self.agent.register(region_list)

    def metadata(self) -> bytes:
        return self.agent.metadata()[1]

    def read_span(self, peer: bytes, local: int, remote: int, nbytes: int, device: int) -> None:
        """Read ``nbytes`` at ``remote`` of ``peer`` into ``local`` as one span; returns when done."""
        here = np.array([[local, nbytes, device]], dtype=np.uint64)
        there = np.array([[remote, nbytes, device]], dtype=np.uint64)
        handle, done = self.agent.read(here, there, peer, (device, device))
        while not done:
            done = self.agent.done(handle)
        self.agent.release(handle)

    def close(self) -> None:
        self.agent.deregister(self._handles)
        self.agent.close()


def serve(args: argparse.Namespace) -> int:
    backend = UcxBackend(mode=args.mode, spin_us=args.spin_us)
    kinds = sorted(k.value for k in backend.capabilities().memory_kinds)
    tensors = fill(args.seed, args.groups, args.blocks, args.slot_bytes)
    torch.cuda.synchronize()
    ipc = [x.hex() if isinstance(x, bytes) else x for x in tensors[0].untyped_storage()._share_cuda_()]
    first = {"address": backend.address().hex(), "memory_kinds": kinds, "ipc": ipc}
    if "device" not in kinds:
        print(json.dumps(first), flush=True)
        backend.shutdown()
        return 3
    region_list = regions(tensors)
    registration = backend.register_regions(region_list)
    # The offer stands before anyone has the address: a puller's first pull finds it, and (one-sided,
    # wire version 4) the offer is pushed to the puller right after its connection's Hello, so its
    # later pulls read without asking.
    backend.serve(lambda: None)
    offer = backend.offer(view(region_list, range(args.blocks), names(args.seed, args.blocks)), lambda: None,
                          timeout_s=3600)
    print(json.dumps(first), flush=True)
    raw = RawNixl(f"raw-server-{os.getpid()}", region_list[:1]) if args.raw_nixl else None
    if raw is not None:  # the bench's raw NIXL row: its agent's metadata, read by the puller
        print(json.dumps({"agent": raw.name, "metadata": raw.metadata().hex(), "base": region_list[0].base}),
              flush=True)
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    while not closed.wait(0.001 if raw is not None else 0.01):  # until the puller closes standard input
        for request in backend.incoming():  # a pull the offer does not cover whole
            backend.decline(request, "not offered here")
        if raw is not None:
            raw.agent.progress()  # NIXL's connection wire-up needs the serving agent's progress
    offer.cancel()
    end = time.monotonic() + 10
    while not offer.quiesced() and time.monotonic() < end:
        time.sleep(0.01)
    if raw is not None:
        raw.close()
    registration.close()
    left = backend.shutdown()
    print(json.dumps({"left": len(left), "quiesced": offer.quiesced()}), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="two-sided", choices=("two-sided", "one-sided"))
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--slot-bytes", type=int, default=64 << 10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--raw-nixl", action="store_true", help="also serve the bench's raw NIXL row")
    parser.add_argument("--spin-us", type=int, default=0, help="kvwire-ucx's spin_us option")
    sys.exit(serve(parser.parse_args()))
