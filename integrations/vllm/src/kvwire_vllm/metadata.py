"""What the scheduler side tells the worker side each step (and back), in vLLM's metadata classes.

vLLM carries :class:`KvwireMetadata` from the scheduler to the workers and :class:`KvwireWorkerMeta`
back by its own means; each carries one ``bytes`` field of plain data (:mod:`kvwire_vllm.plan`'s
encodings), never an object of ours to unpickle."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvwire_vllm.plan import (
    MAX_ASK_BLOCKS,
    MAX_ASKS,
    MAX_REASON,
    MAX_REPORT_BYTES,
    BlockPlan,
    PullAsk,
    ServePlan,
    StepPlan,
    SyncLoad,
    WorkerReport,
)

__all__ = ["BlockPlan", "ServePlan", "StepPlan", "KvwireMetadata", "PullAsk", "SyncLoad", "WorkerReport",
           "KvwireWorkerMeta", "MAX_ASKS", "MAX_ASK_BLOCKS", "MAX_REASON", "MAX_REPORT_BYTES"]


@dataclass
class KvwireMetadata(KVConnectorMetadata):
    """The :class:`StepPlan` of one step, encoded."""

    payload: bytes = field(default=StepPlan().to_bytes())

    def plan(self) -> StepPlan:
        return StepPlan.from_bytes(self.payload)


@dataclass
class KvwireWorkerMeta(KVConnectorWorkerMetadata):
    """A :class:`WorkerReport`, encoded (vLLM carries it worker -> scheduler)."""

    payload: bytes = b""

    def report(self) -> WorkerReport:
        return WorkerReport.from_bytes(self.payload) if self.payload else WorkerReport()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvwireWorkerMeta):
            return self
        return KvwireWorkerMeta(self.report().merged(other.report()).to_bytes())
