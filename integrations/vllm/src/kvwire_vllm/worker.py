"""The connector's worker half in vLLM: reads what the worker core needs from vLLM's config (the
layers, block size, tensor-parallel shard, resolved KV cache layout, the device) and hands each of
vLLM's worker calls to :class:`~kvwire_vllm.core.WorkerCore`, which holds every piece of state
and imports no vLLM."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from kvwire_vllm import cores, peer, trace
from kvwire_vllm.config import ConnectorConfig
from kvwire_vllm.core import WorkerCore
from kvwire_vllm.kvcache import StoreRows
from kvwire_vllm.layout import facts_of, layout_of, resolved_layout, rows_of, scope_of, store_namespace
from kvwire_vllm.metadata import KvwireWorkerMeta, StepPlan
from kvwire_vllm.stats import KvwireStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerSide"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level


class WorkerSide:
    """One worker's connector: the :class:`WorkerCore` over the backend the config names, with
    vLLM's view of the engine (model, layout, engine id) for names and pulls."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ConnectorConfig) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.config = config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size, self.layers, self.layout = layout_of(kv_cache_config)
        self.model_id = str(vllm_config.model_config.model)
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
        backend = config.plugin().build(config.options)
        self.core = WorkerCore(backend, layers=self.layers, block_size=self.block_size,
                               namespace=store_namespace(config.namespace(), rank, tp_size),
                               timeout_s=config.timeout_s, backend_name=config.backend,
                               staging_mib=config.staging_mib, on_pull=self._ring)
        self.rows: StoreRows | None = None
        self.scope = b""

    def _ring(self) -> None:
        """A pull reached an engine core that may be idle (nothing else would step it)."""
        rang = peer.ring(self.engine_id)
        trace.event("worker", "pull_arrived", rang=rang)

    @property
    def serving(self) -> bool:
        return self.core.serving

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        # The layout is resolved by the engine core before the cache is allocated, so it is
        # known here (and maybe not yet when the connector was built).
        layout = resolved_layout(self.vllm_config, self.kv_cache_config)
        self.rows = rows_of(self.vllm_config, self.kv_cache_config, self.core.capabilities)
        self.layout = {**self.layout, "kv_cache_layout": layout, "rows": self.rows.describe()}
        self.scope = scope_of(self.vllm_config, self.layout)
        self.core.expected_rows = self.rows
        num_blocks = getattr(self.kv_cache_config, "num_blocks", None)
        self.core.register_kv_caches(kv_caches, int(num_blocks) if num_blocks else None)
        if self.core.cache is not None and not self.core.cache.on_cuda:
            sharing = cores.workers_sharing_cores()  # vLLM bound this (main) thread to its cores by now
            if sharing:
                log.warning(cores.advice(sharing))
                trace.event("worker", "cores_shared", workers=[pid for pid, _ in sharing])
        if self.core.serving:
            self.core.state_to_report = self.transceiver_state()
            log.info("kvwire: serving pulls from vLLM's prefix cache")

    def transceiver_state(self) -> bytes:
        """This engine's transceiver state (kvwire's TransceiverState bytes): what a pulling
        engine's request carries as ``kv_transfer_params['kvwire_source']``."""
        backend = self.core.backend
        if not self.core.serving or backend is None:
            raise RuntimeError(f"kvwire backend {self.config.backend!r} does not serve pulls (serve-pulls); "
                               "this engine has no transceiver state")
        return peer.transceiver_state(worker=f"vllm-{self.engine_id[:8]}", backend=self.config.backend,
                                      address=backend.address(),  # type: ignore[attr-defined]
                                      model_id=self.model_id, layout=self.layout, scope=self.scope,
                                      block_size=self.block_size, facts=facts_of(self.vllm_config, self.layout))

    def bind(self, plan: StepPlan) -> None:
        self.core.bind(plan)

    def handle_preemptions(self) -> None:
        self.core.handle_preemptions()

    def start_load_kv(self) -> None:
        self.core.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.core.wait_for_layer_load(layer_name)

    def wait_for_save(self) -> None:
        self.core.wait_for_save()

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        return self.core.get_finished(finished_req_ids)

    def take_load_errors(self) -> set[int]:
        return self.core.take_load_errors()

    def worker_meta(self) -> KvwireWorkerMeta | None:
        report = self.core.report()
        return KvwireWorkerMeta(report.to_bytes()) if report else None

    def take_stats(self) -> KvwireStats | None:
        counts = self.core.take_counts()
        return KvwireStats(dict(counts)) if counts is not None else None

    def state(self) -> dict[str, Any]:
        return self.core.state()

    def shutdown(self) -> None:
        self.core.shutdown()
