"""``KvwireConnector``: vLLM's KV connector API over any kvwire backend.

vLLM builds one instance per role: the SCHEDULER one (engine-core process) decides what to load
and save (:mod:`kvwire_vllm.scheduler`); each WORKER one holds the backend and moves vLLM's own
KV memory (:mod:`kvwire_vllm.worker`). Both validate the configuration at construction, so a
bad backend name or option stops the engine at start with kvwire's message."""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvwire_vllm.config import ConnectorConfig
from kvwire_vllm.metadata import KvwireMetadata
from kvwire_vllm.scheduler import SchedulerSide
from kvwire_vllm.stats import PINS, KvwirePromMetrics, KvwireStats
from kvwire_vllm.worker import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvwireConnector"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level


def _engine_transfer_config(own: Any) -> Any:
    """The engine's ``kv_transfer_config``: that of the scheduler being built up this stack (a
    MultiConnector hands each child a copy of its own), else ``own``."""
    try:
        from vllm.v1.core.sched.interface import SchedulerInterface
    except ImportError:  # pragma: no cover - another vLLM layout
        return own
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, SchedulerInterface):
            found = getattr(getattr(obj, "vllm_config", None), "kv_transfer_config", None)
            return found if found is not None else own
        frame = frame.f_back
    return own


class KvwireConnector(KVConnectorBase_V1):
    """Loads a prompt's leading whole blocks from a kvwire store and saves the blocks it
    computes, asynchronously, straight from and into vLLM's paged KV tensors."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.parse(transfer.kv_connector_extra_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            if self.config.load_failure_policy == "recompute":
                # A store is a cache: a block it lost is recomputed, never a failed request. The
                # scheduler reads the policy right after building its connector, from the engine's
                # config: inside a MultiConnector that is not ours (each child gets a copy).
                for config in {id(c): c for c in (transfer, _engine_transfer_config(transfer))}.values():
                    if config.kv_load_failure_policy != "recompute":
                        if config is not transfer:
                            log.info("kvwire: setting the engine's kv_load_failure_policy to 'recompute' "
                                     "(kvwire's load_failure_policy; 'fail' leaves it alone)")
                        config.kv_load_failure_policy = "recompute"
            self.scheduler = SchedulerSide(vllm_config, kv_cache_config, self.config)
        else:
            self.worker = WorkerSide(vllm_config, kv_cache_config, self.config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a later cache miss, never a lost result

    # -- worker side ------------------------------------------------------------------------------

    def _worker(self) -> WorkerSide:
        assert self.worker is not None, "a worker-side method was called on the scheduler-side connector"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, KvwireMetadata):
            raise TypeError(f"KvwireConnector got metadata of type {type(connector_metadata).__name__}")
        self._worker().bind(connector_metadata.plan())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KvwireMetadata):
            self._worker().bind(kv_connector_metadata.plan())
        self._worker().handle_preemptions()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer_load(layer_name)  # only loads inside the step (load_async false)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # whole blocks are saved once per step, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, received = self._worker().get_finished(finished_req_ids)
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.worker_meta() if self.worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker is not None:
            return self.worker.take_stats()
        pins = self.scheduler.pins_changed() if self.scheduler is not None else None
        return KvwireStats({PINS: pins}) if pins is not None else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True when a step's forward waits on kvwire (``load_async`` false): vLLM then runs
        piecewise CUDA graphs, so ``wait_for_layer_load`` runs between the pieces instead of being
        skipped by a full graph's replay (:attr:`ConnectorConfig.waits_inside_the_forward`).

        vLLM asks this while it builds its configuration, where CUDA graphs capture whole forward
        passes (a GPU engine's default), before any model loads; the configuration is validated
        here too, so a bad backend name or option stops ``vllm serve`` in its first seconds rather
        than after the model loaded (kvwire's ``ConfigError``, the same message as at start)."""
        return ConnectorConfig.parse(extra_config).waits_inside_the_forward

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvwireStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KvwirePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()

    # -- scheduler side ---------------------------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler is not None, "a scheduler-side method was called on a worker-side connector"
        return self.scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler().kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler.take_events() if self.scheduler is not None else ()

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_push_work() if self.scheduler is not None else False

