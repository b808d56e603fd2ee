"""What the two halves of the connector tell each other each step, as plain values with versioned
msgpack encodings: the scheduler's :class:`StepPlan` (loads, saves, preemptions, pull answers) and
the worker's :class:`WorkerReport` (pulls to pin, replies done, loads run inside the step).

Nothing here imports vLLM: the worker core (:mod:`kvwire_vllm.core`) runs on these alone, and
:mod:`kvwire_vllm.metadata` wraps their bytes in vLLM's metadata classes. Encodings carry plain
data only (request ids, block ids, names), never an object to unpickle, and decoding is bounded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from kvwire.holding import MAX_STATE_BYTES
from kvwire_vllm.names import NAME_BYTES

__all__ = ["BlockPlan", "ServePlan", "StepPlan", "PullAsk", "SyncLoad", "WorkerReport", "COUNTERS",
           "MAX_ASKS", "MAX_ASK_BLOCKS", "MAX_REASON", "MAX_REPORT_BYTES"]

#: The connector's transfer counters (summed over workers and intervals; :mod:`kvwire_vllm.stats`
#: reports them to vLLM).
COUNTERS = (
    "loads", "load_blocks", "load_bytes", "load_seconds", "load_error_blocks",
    "saves", "save_blocks", "save_bytes", "save_seconds", "save_failures", "lookups",
    "save_skipped_blocks", "load_deferrals", "pulls_served",
)

_VERSION = 3
_REPORT_VERSION = 4
#: Bounds of what one step's report may carry (decoding refuses more).
MAX_ASKS = 4096
MAX_ASK_BLOCKS = 32768
MAX_REASON = 1024
MAX_REPORT_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """Blocks of one request to load or save: the request's block ids (vLLM's, which are slot
    indices in every layer's region), their names, and the index of the first one in the
    request (its token offset is ``first * block_size``)."""

    req_id: str
    first: int
    block_ids: tuple[int, ...]
    names: bytes  # len(block_ids) * NAME_BYTES
    source: bytes = b""  # a load's peer address (its transceiver state's); empty: the store
    sync: bool = False  # a load vLLM computes on in this same step (load_async false)

    def __post_init__(self) -> None:
        if len(self.names) != len(self.block_ids) * NAME_BYTES:
            raise ValueError(f"request {self.req_id}: {len(self.names)} name bytes for "
                             f"{len(self.block_ids)} blocks of {NAME_BYTES}-byte names")

    def name_array(self) -> np.ndarray:
        return np.frombuffer(self.names, dtype=np.uint8).reshape(len(self.block_ids), NAME_BYTES)


@dataclass(frozen=True, slots=True)
class ServePlan:
    """The scheduler's answer to a pull the worker forwarded (:class:`PullAsk`): serve the rows of
    ``block_ids`` (the held prefix, pinned in the block pool until the worker reports the reply
    quiesced; possibly empty), or decline with ``reason``."""

    pull_id: int
    block_ids: tuple[int, ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's work: loads to start, saves to submit, requests preempted this step (their
    blocks may be handed to others before the forward), and whether the step computes nothing."""

    loads: tuple[BlockPlan, ...] = ()
    saves: tuple[BlockPlan, ...] = ()
    preempted: tuple[str, ...] = ()
    idle: bool = False  # nothing is computed this step
    serves: tuple[ServePlan, ...] = ()

    def to_bytes(self) -> bytes:
        def plans(items: tuple[BlockPlan, ...]) -> list[list[object]]:
            return [[p.req_id, p.first, list(p.block_ids), p.names, p.source, p.sync] for p in items]

        serves = [[s.pull_id, list(s.block_ids), s.reason] for s in self.serves]
        return msgpack.packb([_VERSION, plans(self.loads), plans(self.saves), list(self.preempted), self.idle,
                              serves], use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> StepPlan:
        try:
            version, *rest = msgpack.unpackb(data, raw=False, strict_map_key=True)
            if version != _VERSION:
                raise ValueError(f"kvwire connector metadata version {version}; this kvwire-vllm reads {_VERSION}")
            loads, saves, preempted, idle, serves = rest

            def plans(items: list[list[Any]]) -> tuple[BlockPlan, ...]:  # msgpack's: checked as converted
                return tuple(BlockPlan(str(r), int(f), tuple(int(b) for b in ids), bytes(n), bytes(src),
                                       bool(sync))
                             for r, f, ids, n, src, sync in items)

            return cls(plans(loads), plans(saves), tuple(str(r) for r in preempted), bool(idle),
                       tuple(ServePlan(int(i), tuple(int(b) for b in ids), str(why)[:MAX_REASON])
                             for i, ids, why in serves))
        except (ValueError, TypeError, msgpack.ExtraData) as exc:
            raise ValueError(f"kvwire connector metadata is malformed: {exc}") from None


@dataclass(frozen=True, slots=True)
class PullAsk:
    """A pull the worker's peer backend received, forwarded to the scheduler (which owns the
    block pool): its id (the worker's, never reused), and the requested names in prefix order."""

    pull_id: int
    names: bytes  # blocks * NAME_BYTES

    @property
    def blocks(self) -> int:
        return len(self.names) // NAME_BYTES


@dataclass(frozen=True, slots=True)
class SyncLoad:
    """A load that ran inside this step (``load_async`` false): the request, and the index in
    its load plan of the first block that did not arrive in every layer (-1: all arrived)."""

    req_id: str
    first_missed: int = -1
    missed: int = 0  # blocks that did not arrive


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What a worker tells the scheduler side each step: pulls to look up and pin, pulls whose
    reply has concluded and quiesced (their pins may go), the loads this step ran, and the names
    of blocks whose save ended held by the store in every group (for KV events)."""

    asks: tuple[PullAsk, ...] = ()
    done: tuple[int, ...] = ()
    loaded: tuple[SyncLoad, ...] = ()
    state: bytes = b""  # the worker's transceiver state, once, for a producer's kv_transfer_params
    saved: bytes = b""  # blocks * NAME_BYTES

    def __bool__(self) -> bool:
        return bool(self.asks or self.done or self.loaded or self.state or self.saved)

    def saved_names(self) -> list[bytes]:
        return [self.saved[i:i + NAME_BYTES] for i in range(0, len(self.saved), NAME_BYTES)]

    def to_bytes(self) -> bytes:
        return msgpack.packb([_REPORT_VERSION, [[a.pull_id, a.names] for a in self.asks], list(self.done),
                              [[s.req_id, s.first_missed, s.missed] for s in self.loaded], self.state, self.saved],
                             use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> WorkerReport:
        """Bounded: at most :data:`MAX_ASKS` asks of :data:`MAX_ASK_BLOCKS` names each."""
        if len(data) > MAX_REPORT_BYTES:
            raise ValueError(f"kvwire worker report of {len(data)} bytes is too large")
        try:
            version, *rest = msgpack.unpackb(data, raw=False, strict_map_key=True,
                                             max_bin_len=MAX_ASK_BLOCKS * NAME_BYTES,
                                             max_str_len=MAX_REASON, max_array_len=max(MAX_ASKS, 2) * 4)
            if version != _REPORT_VERSION:
                raise ValueError(f"version {version}; this kvwire-vllm reads {_REPORT_VERSION}")
            asks, done, loaded, state, saved = rest
            out = tuple(PullAsk(int(i), bytes(n)) for i, n in asks)
            if any(len(a.names) % NAME_BYTES for a in out) or not isinstance(saved, bytes) or \
                    len(saved) % NAME_BYTES:
                raise ValueError("names are not whole")
            if not isinstance(state, bytes) or len(state) > MAX_STATE_BYTES:
                raise ValueError(f"the worker's state must be at most {MAX_STATE_BYTES} bytes")
            return cls(out, tuple(int(i) for i in done), tuple(SyncLoad(str(r), int(f), int(m)) for r, f, m in loaded),
                       state, saved)
        except (ValueError, TypeError, msgpack.ExtraData) as exc:
            raise ValueError(f"kvwire worker report is malformed: {exc}") from None

    def merged(self, other: WorkerReport) -> WorkerReport:
        return WorkerReport(self.asks + other.asks, self.done + other.done, self.loaded + other.loaded,
                            self.state or other.state, self.saved + other.saved)
