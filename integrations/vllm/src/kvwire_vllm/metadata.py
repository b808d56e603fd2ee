"""What the scheduler side tells the worker side each step, as versioned msgpack bytes.

vLLM carries :class:`KvwireMetadata` from the scheduler to the workers by its own means; what
it carries is one ``bytes`` field of plain data (request ids, block ids, names), never an
object of ours to unpickle."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvwire_vllm.names import NAME_BYTES

__all__ = ["BlockPlan", "StepPlan", "KvwireMetadata"]

_VERSION = 1


@dataclass(frozen=True, slots=True)
class BlockPlan:
    """Blocks of one request to load or save: the request's block ids (vLLM's, which are slot
    indices in every layer's region), their names, and the index of the first one in the
    request (its token offset is ``first * block_size``)."""

    req_id: str
    first: int
    block_ids: tuple[int, ...]
    names: bytes  # len(block_ids) * NAME_BYTES

    def __post_init__(self) -> None:
        if len(self.names) != len(self.block_ids) * NAME_BYTES:
            raise ValueError(f"request {self.req_id}: {len(self.names)} name bytes for "
                             f"{len(self.block_ids)} blocks of {NAME_BYTES}-byte names")

    def name_array(self) -> np.ndarray:
        return np.frombuffer(self.names, dtype=np.uint8).reshape(len(self.block_ids), NAME_BYTES)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's work: loads to start, saves to submit, requests preempted this step (their
    blocks may be handed to others before the forward), and whether the step computes nothing."""

    loads: tuple[BlockPlan, ...] = ()
    saves: tuple[BlockPlan, ...] = ()
    preempted: tuple[str, ...] = ()
    idle: bool = False  # nothing is computed this step

    def to_bytes(self) -> bytes:
        def plans(items: tuple[BlockPlan, ...]) -> list[list[object]]:
            return [[p.req_id, p.first, list(p.block_ids), p.names] for p in items]

        return msgpack.packb([_VERSION, plans(self.loads), plans(self.saves), list(self.preempted), self.idle],
                             use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> StepPlan:
        try:
            version, loads, saves, preempted, idle = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, TypeError, msgpack.ExtraData) as exc:
            raise ValueError(f"kvwire connector metadata is malformed: {exc}") from None
        if version != _VERSION:
            raise ValueError(f"kvwire connector metadata version {version}; this kvwire-vllm reads {_VERSION}")

        def plans(items: list[list[object]]) -> tuple[BlockPlan, ...]:
            return tuple(BlockPlan(str(r), int(f), tuple(int(b) for b in ids), bytes(n))  # type: ignore[arg-type]
                         for r, f, ids, n in items)

        return cls(plans(loads), plans(saves), tuple(str(r) for r in preempted), bool(idle))


@dataclass
class KvwireMetadata(KVConnectorMetadata):
    """The :class:`StepPlan` of one step, encoded."""

    payload: bytes = field(default=StepPlan().to_bytes())

    def plan(self) -> StepPlan:
        return StepPlan.from_bytes(self.payload)
