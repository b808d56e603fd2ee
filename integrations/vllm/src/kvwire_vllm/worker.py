"""The connector's worker half: a kvwire lease holder over vLLM's own paged KV tensors.

Each attention layer's cache tensor is one :class:`SlotRegion` whose slots are vLLM's blocks, so
a request's block ids are the rows of every layer group and bytes move straight between vLLM's
cache and the backend: no staging copy, no Python bytes. Loads and saves are submitted and left
to the backend's threads; each step polls them without blocking. A save keeps its request's
blocks allocated (the scheduler side delays their freeing) until its attempt has quiesced.

With ``load_async`` false a load runs inside the step that computes on it: one attempt per layer,
the first submitted before the forward; each layer's attention waits for its own attempt
(``wait_for_layer_load``) and then submits the next layer's, which loads while this one
computes. Blocks that did not arrive are reported as load errors of that same step (vLLM
discards the step's output for the request and recomputes from the first of them), and the
request's blocks computed in that step, on a context that was not whole, are not saved.

Why one file of this size (~500 lines): the worker side is one object that vLLM drives hook by
hook, and its loads, saves and served pulls share one step plan, one set of transfers in flight
and one report to the scheduler side; split apart, each part would reach into that state."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvwire.contract import (
    Backend,
    CacheKind,
    Hint,
    LayerGroupRows,
    MemoryKind,
    Registration,
    SlotRegion,
    TokenRange,
    View,
)
from kvwire.contract.capabilities import SERVE_PULLS, OtherEnd
from kvwire.contract.errors import SubmissionError
from kvwire.contract.serving import PullRequest, ServesPulls
from kvwire.runtime.holding import Direction, Wakes
from kvwire_vllm import holder, peer, trace
from kvwire_vllm.config import ConnectorConfig
from kvwire_vllm.holder import QUIESCE_GRACE_S, UNSENT, StepLoad, Transfer
from kvwire_vllm.metadata import (
    BlockPlan,
    KvwireWorkerMeta,
    PullAsk,
    ServePlan,
    StepPlan,
    SyncLoad,
    WorkerReport,
)
from kvwire_vllm.names import NAME_BYTES
from kvwire_vllm.scheduler import layout_of, scope_of, store_namespace
from kvwire_vllm.stats import KvwireStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["WorkerSide", "regions_of"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level

#: On a step with nothing scheduled and transfers in flight, sleep on the backend's wake up to
#: this long instead of letting the engine spin through empty steps.
IDLE_WAIT_S = 0.02


def regions_of(kv_caches: Mapping[str, torch.Tensor], layers: list[str]) -> tuple[SlotRegion, ...]:
    """One region per layer, in ``layers`` order (region id = kvwire group id = index): a layer's
    tensor must be ``[blocks, ...]`` with each block one contiguous span of host memory."""
    missing = [name for name in layers if name not in kv_caches]
    if missing:
        raise ValueError(f"vLLM registered no KV cache for layer(s) {missing}; it registered {sorted(kv_caches)}")
    regions = []
    for index, name in enumerate(layers):
        t = kv_caches[name]
        if t.device.type != "cpu":
            raise ValueError(f"layer {name}: KV cache on {t.device}; kvwire-vllm registers host memory only so far")
        block = t[0]
        if not (block.is_contiguous() and t.stride(0) == block.numel()):
            raise ValueError(f"layer {name}: KV cache of shape {tuple(t.shape)} and strides {t.stride()} does not "
                             "keep each block in one contiguous span (blocks must be the outermost dimension)")
        regions.append(SlotRegion(index, t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0], MemoryKind.HOST))
    for i, a in enumerate(regions):
        for b in regions[i + 1:]:
            if a.overlaps(b):
                raise ValueError(f"layers {layers[a.region_id]} and {layers[b.region_id]} share KV memory; "
                                 "kvwire-vllm needs one cache per layer")
    return tuple(regions)


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ConnectorConfig) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.config = config
        self.block_size, self.layers, self.layout = layout_of(kv_cache_config)
        self.scope = scope_of(vllm_config, self.layout)
        self.model_id = str(vllm_config.model_config.model)
        self.engine_id = str(vllm_config.kv_transfer_config.engine_id)
        tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
        self.namespace = store_namespace(config.namespace(), rank, tp_size)
        self.backend: Backend | None = config.plugin().build(config.options)
        self.registration: Registration | None = None
        self.regions: tuple[SlotRegion, ...] = ()
        self.wakes = Wakes()  # one for every attempt of this worker
        self._plan = StepPlan()
        self._loads: dict[str, Transfer] = {}
        self._saves: dict[str, list[Transfer]] = {}
        self._with_saves: set[str] = set()  # requests whose blocks the scheduler keeps until we say
        self._finished: set[str] = set()  # ... and that have finished: report once their saves end
        self._errors: set[int] = set()
        self._refused: set[str] = set()  # loads refused at submission, reported done next step
        self._kept: list[Transfer] = []  # never quiesced: their memory is not ours to reuse
        # Loads inside this step (load_async false), per request; requests whose load missed
        # blocks (their saves this step are skipped); what to report to the scheduler side.
        self._layer_of = {name: i for i, name in enumerate(self.layers)}
        self._sync: dict[str, StepLoad] = {}
        self._sync_missed: set[str] = set()
        self._report_loaded: list[SyncLoad] = []
        self.stats = KvwireStats()
        capabilities = self.backend.capabilities()
        self.peer = capabilities.other_end is OtherEnd.PEER
        self.serving = (SERVE_PULLS in capabilities.protocols and isinstance(self.backend, ServesPulls))
        # Serving pulls: pulls forwarded to the scheduler side (awaiting its pins), replies in
        # flight (their pins held there until we report them done), and what to report next.
        self._pull_serial = 0
        self._asked: dict[int, PullRequest] = {}
        self._replies: dict[int, Transfer] = {}
        self._reply_of: dict[Transfer, int] = {}
        self._report_asks: list[PullAsk] = []
        self._report_done: list[int] = []
        self.pulls_served = 0
        self.pulls_declined = 0
        self.pull_blocks_served = 0

    # -- registration ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        assert self.backend is not None
        self.regions = regions_of(kv_caches, self.layers)
        self.registration = self.backend.register_regions(self.regions)
        log.info("kvwire: registered %d KV regions of %d blocks x %d bytes with backend %r",
                 len(self.regions), self.regions[0].slot_count, self.regions[0].slot_bytes, self.config.backend)
        if self.serving:
            assert isinstance(self.backend, ServesPulls)
            self.backend.serve(self._on_pull)
            log.info("kvwire: serving pulls from vLLM's prefix cache at %d-byte address", len(self.backend.address()))

    def _on_pull(self) -> None:
        """The backend's wake for new pulls (its thread): wake a dozing step, and ring the engine
        core, which may be idle (nothing else would step it)."""
        self.wakes()
        rang = peer.ring(self.engine_id)
        trace.event("worker", "pull_arrived", rang=rang)

    def transceiver_state(self) -> bytes:
        """This engine's transceiver state (kvwire's TransceiverState bytes): what a pulling
        engine's request carries as ``kv_transfer_params['kvwire_source']``."""
        if not self.serving or self.backend is None:
            raise RuntimeError(f"kvwire backend {self.config.backend!r} does not serve pulls (serve-pulls); "
                               "this engine has no transceiver state")
        assert isinstance(self.backend, ServesPulls)
        return peer.transceiver_state(worker=f"vllm-{self.engine_id[:8]}", backend=self.config.backend,
                                      address=self.backend.address(), model_id=self.model_id, layout=self.layout,
                                      scope=self.scope, block_size=self.block_size)

    # -- the step --------------------------------------------------------------------------------

    def bind(self, plan: StepPlan) -> None:
        self._plan = plan

    def view_of(self, plan: BlockPlan, regions: tuple[SlotRegion, ...] | None = None) -> View:
        names = plan.name_array()
        tokens = TokenRange(plan.first * self.block_size, (plan.first + len(plan.block_ids)) * self.block_size)
        return View(tuple(LayerGroupRows(region.region_id, CacheKind.PAGED, region, np.asarray(plan.block_ids),
                                         tokens, names) for region in (regions or self.regions)))

    def _start(self, op: Direction, plan: BlockPlan, view: View | None = None) -> Transfer | None:
        assert self.backend is not None
        if plan.source:
            hint = Hint.of("peer", timeout_s=self.config.timeout_s, address=plan.source)
        else:
            hint = Hint.of("store", timeout_s=self.config.timeout_s, namespace=self.namespace)
        try:
            return holder.start(self.backend, op, plan.req_id, view or self.view_of(plan), plan.block_ids, hint,
                                self.wakes, self.config.timeout_s + QUIESCE_GRACE_S)
        except SubmissionError as exc:  # nothing escaped (S3)
            log.warning("kvwire %s of request %s refused: %s", op.value, plan.req_id, exc)
            return None

    def handle_preemptions(self) -> None:
        """A preempted request's blocks go back to the pool before this step's forward: its saves
        must have quiesced by then."""
        for req_id in self._plan.preempted:
            for transfer in self._saves.pop(req_id, []):
                if holder.wait_out(transfer):
                    self._account_save(transfer)
                else:
                    self._keep(transfer)

    def start_load_kv(self) -> None:
        if self.registration is None:
            return
        for plan in self._plan.loads:
            if plan.sync:
                load = self._sync[plan.req_id] = StepLoad(plan, 1 if plan.source else len(self.regions))
                self._submit_layer(load, 0)
                trace.event("worker", "load_submitted", req=plan.req_id, blocks=len(plan.block_ids), sync=True)
                continue
            transfer = self._start(Direction.FETCH, plan)
            if transfer is None:  # refused: every block is a load error, the request is done waiting
                self._errors.update(plan.block_ids)
                self.stats.add(load_error_blocks=len(plan.block_ids))
                self._refused.add(plan.req_id)
            else:
                self._loads[plan.req_id] = transfer
                trace.event("worker", "load_submitted", req=plan.req_id, blocks=len(plan.block_ids))

    def _submit_layer(self, load: StepLoad, index: int) -> None:
        if index < len(load.transfers) and load.transfers[index] is UNSENT:
            regions = self.regions if len(load.transfers) == 1 else (self.regions[index],)
            load.transfers[index] = self._start(Direction.FETCH, load.plan, self.view_of(load.plan, regions))

    def _wait_layer(self, load: StepLoad, index: int) -> None:
        """Layer ``index`` of ``load`` has quiesced (submitted now if it was not), and the next
        layer's fetch is on its way: one layer in flight per request, so it loads while this
        layer computes (two fetches at once ran slower here: their threads share one GIL)."""
        self._submit_layer(load, index)
        if load.waited[index] is None:
            transfer = load.transfers[index]
            load.waited[index] = isinstance(transfer, Transfer) and holder.wait_out(transfer)
        self._submit_layer(load, index + 1)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer's attention: this step's loads of that layer have quiesced."""
        index = self._layer_of.get(layer_name)
        if index is None:
            return
        for load in self._sync.values():
            self._wait_layer(load, min(index, len(load.transfers) - 1))
        if self._sync:
            trace.event("worker", "layer_waited", layer=index, loads=sorted(self._sync))

    def _finish_sync_loads(self) -> None:
        """After the forward (or when vLLM asks for load errors): wait out any layer no attention
        waited for, then report per request the blocks that did not arrive in every layer."""
        sync, self._sync = self._sync, {}
        for req_id, load in sync.items():
            plan = load.plan
            whole = np.ones(len(plan.block_ids), dtype=bool)
            for index in range(len(load.transfers)):
                self._wait_layer(load, index)
                transfer = load.transfers[index]
                if not isinstance(transfer, Transfer):  # refused at submission (S3: nothing moved)
                    whole[:] = False
                elif not load.waited[index]:  # never quiesced: its memory may still be written
                    self._keep(transfer)
                    whole[:] = False
                else:
                    whole &= self._whole(transfer)
            missed = self._account_load(req_id, plan.block_ids, whole, load.started)
            self._report_loaded.append(SyncLoad(req_id, int(missed[0]) if missed.size else -1, int(missed.size)))
            trace.event("worker", "load_ended", req=req_id, sync=True, seconds=time.perf_counter() - load.started,
                        missed=int(missed.size))
            if missed.size:
                self._sync_missed.add(req_id)

    def wait_for_save(self) -> None:
        self._finish_sync_loads()
        missed, self._sync_missed = self._sync_missed, set()
        if self.registration is None:
            return
        # Pulls are answered here, after this step's forward: vLLM's blocks the scheduler pinned
        # hold KV computed in earlier steps, and nothing writes them while pinned.
        for serve in self._plan.serves:
            self._reply(serve)
        for plan in self._plan.saves:
            self._with_saves.add(plan.req_id)
            if plan.req_id in missed:  # computed on a context whose load missed: never stored
                continue
            transfer = self._start(Direction.PUBLISH, plan)
            trace.event("worker", "save_submitted", req=plan.req_id, first=plan.first, blocks=len(plan.block_ids),
                        refused=transfer is None)
            if transfer is None:
                self.stats.add(save_failures=1)
            else:
                self._saves.setdefault(plan.req_id, []).append(transfer)

    @property
    def idle(self) -> bool:
        return self._plan.idle

    def _in_flight(self) -> list[Transfer]:
        return [*self._loads.values(), *(t for ts in self._saves.values() for t in ts), *self._replies.values()]

    # -- serving pulls ----------------------------------------------------------------------------

    def _take_pulls(self) -> None:
        """Pulls the backend received: decline those this cache cannot answer (other groups or
        row sizes), forward the others' names to the scheduler side, which owns the block pool."""
        if not self.serving or self.backend is None or self.registration is None:
            return
        assert isinstance(self.backend, ServesPulls)
        groups = tuple(r.region_id for r in self.regions)
        sizes = tuple(r.slot_bytes for r in self.regions)
        for request in self.backend.incoming():
            reason = None
            if request.groups != groups:
                reason = f"requested groups {list(request.groups)} differ from this engine's {list(groups)}"
            elif request.slot_bytes != sizes:
                reason = f"requested row sizes {list(request.slot_bytes)} differ from this engine's {list(sizes)}"
            elif request.names.shape[1] != NAME_BYTES:
                reason = f"names of {request.names.shape[1]} bytes; this engine names blocks with {NAME_BYTES}"
            if reason is not None:
                self.backend.decline(request, reason)
                self.pulls_declined += 1
                continue
            self._pull_serial += 1
            trace.event("worker", "pull_taken", pull=self._pull_serial, blocks=request.blocks, peer=request.peer)
            self._asked[self._pull_serial] = request
            self._report_asks.append(PullAsk(self._pull_serial, request.names.tobytes()))

    def _reply(self, serve: ServePlan) -> None:
        request = self._asked.pop(serve.pull_id, None)
        if request is None or self.backend is None:
            self._report_done.append(serve.pull_id)  # unknown here: let its pins go
            return
        assert isinstance(self.backend, ServesPulls)
        if serve.reason:
            self.backend.decline(request, serve.reason)
            self.pulls_declined += 1
            self._report_done.append(serve.pull_id)
            return
        count = len(serve.block_ids)
        names = request.names[:count]
        tokens = TokenRange(0, count * self.block_size)
        view = View(tuple(LayerGroupRows(region.region_id, CacheKind.PAGED, region, np.asarray(serve.block_ids,
                                                                                               dtype=np.int64),
                                         tokens, names) for region in self.regions))
        try:
            transfer = holder.start(self.backend, Direction.PUBLISH, f"pull-{serve.pull_id}", view, serve.block_ids,
                                    request.ticket, self.wakes, self.config.timeout_s + QUIESCE_GRACE_S)
        except SubmissionError as exc:  # nothing escaped (S3): decline, and the pins may go
            self.backend.decline(request, f"cannot answer now: {exc}")
            self.pulls_declined += 1
            self._report_done.append(serve.pull_id)
            return
        self._replies[serve.pull_id] = transfer
        self._reply_of[transfer] = serve.pull_id
        trace.event("worker", "pull_replied", pull=serve.pull_id, blocks=count)
        self.pulls_served += 1
        self.pull_blocks_served += count

    def worker_meta(self) -> KvwireWorkerMeta | None:
        """This step's report to the scheduler side: pulls to pin, replies whose pins may go."""
        self._take_pulls()
        report = WorkerReport(tuple(self._report_asks), tuple(self._report_done), tuple(self._report_loaded))
        self._report_asks, self._report_done, self._report_loaded = [], [], []
        return KvwireWorkerMeta(report.to_bytes()) if report else None

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """Requests that finished and whose saves have all quiesced, and requests whose load has
        quiesced (whatever it delivered; what it missed goes to :meth:`take_load_errors`)."""
        for req_id in finished_req_ids:
            load = self._loads.get(req_id)
            if load is not None:  # aborted mid-load: stop it; reported once quiesced
                load.cancel()
            if req_id in self._with_saves:
                self._finished.add(req_id)
        received, self._refused = self._refused, set()
        if self._loads and trace.enabled():
            trace.event("worker", "get_finished", loads=sorted(self._loads), idle_step=self._plan.idle)
        ended = holder.finished(self._in_flight())
        if not ended and self._plan.idle and (self._loads or self._saves or self._replies):
            # Nothing to compute this step: sleep on the backend's wake rather than let the
            # engine spin through empty steps on two cores the transfer needs.
            holder.doze(self._in_flight(), IDLE_WAIT_S)
            ended = holder.finished(self._in_flight())
        for transfer in ended:
            pull_id = self._reply_of.pop(transfer, None)
            if pull_id is not None:  # a pull's reply quiesced: its pins may go
                del self._replies[pull_id]
                self._report_done.append(pull_id)
                continue
            if transfer.op is Direction.FETCH:
                trace.event("worker", "load_ended", req=transfer.req_id, idle_step=self._plan.idle,
                            seconds=time.perf_counter() - transfer.started)
                del self._loads[transfer.req_id]
                self._account_load(transfer.req_id, transfer.block_ids, self._whole(transfer), transfer.started,
                                   transfer.outcome)
                received.add(transfer.req_id)
            else:
                left = [t for t in self._saves[transfer.req_id] if t is not transfer]
                if left:
                    self._saves[transfer.req_id] = left
                else:
                    del self._saves[transfer.req_id]
                self._account_save(transfer)
        for transfer in self._in_flight():
            if transfer.cancelled and time.monotonic() > transfer.deadline + QUIESCE_GRACE_S:
                if transfer in self._reply_of:
                    continue  # its pins stay (the scheduler is never told) until backend.shutdown()
                self._keep(transfer)
        sent = {r for r in self._finished if r not in self._saves}
        self._finished -= sent
        self._with_saves -= sent
        return sent, received

    def _keep(self, transfer: Transfer) -> None:
        """An attempt that did not quiesce a grace after it was cancelled: its request keeps
        waiting (its memory may still be touched) until ``backend.shutdown()`` says otherwise."""
        if transfer not in self._kept:
            log.error("kvwire %s of request %s did not quiesce %.0f s after its deadline; its blocks stay held",
                      transfer.op.value, transfer.req_id, QUIESCE_GRACE_S)
            self._kept.append(transfer)
            if transfer.op is Direction.PUBLISH and transfer not in self._saves.get(transfer.req_id, []):
                self._saves.setdefault(transfer.req_id, []).append(transfer)

    def _whole(self, transfer: Transfer) -> np.ndarray:
        """Per block: whether it arrived (fetch) or is held (publish) in every layer."""
        outcome = transfer.outcome
        assert outcome is not None
        return np.logical_and.reduce(np.stack(outcome.masks)) if outcome.masks else np.zeros(0, dtype=bool)

    def _account_load(self, req_id: str, block_ids: tuple[int, ...], whole: np.ndarray, started: float,
                      outcome: object = None) -> np.ndarray:
        """A load is over: blocks not ``whole`` (arrived in every layer) become load errors; the
        stats count it. Returns the indices of the blocks that did not arrive."""
        missed = np.flatnonzero(~whole)
        self._errors.update(block_ids[i] for i in missed.tolist())
        moved = int(whole.sum())
        self.stats.add(loads=1, load_blocks=moved, load_bytes=moved * sum(r.slot_bytes for r in self.regions),
                       load_seconds=time.perf_counter() - started, load_error_blocks=int(missed.size))
        if missed.size:
            log.warning("kvwire load of request %s: %d of %d blocks did not arrive%s; vLLM recomputes them",
                        req_id, missed.size, len(block_ids), f" ({outcome!r})" if outcome is not None else "")
        return missed

    def _account_save(self, transfer: Transfer) -> None:
        whole = self._whole(transfer)
        moved = int(whole.sum())
        self.stats.add(saves=1, save_blocks=moved, save_bytes=moved * sum(r.slot_bytes for r in self.regions),
                       save_seconds=time.perf_counter() - transfer.started,
                       save_failures=int(moved < len(transfer.block_ids)))

    def take_load_errors(self) -> set[int]:
        self._finish_sync_loads()
        errors, self._errors = self._errors, set()
        return errors

    def take_stats(self) -> KvwireStats | None:
        if self.stats.is_empty():
            return None
        stats, self.stats = self.stats, KvwireStats()
        return stats

    def state(self) -> dict[str, object]:
        """What this worker holds now: loads and saves in flight (their requests), attempts that
        never quiesced, requests whose blocks vLLM keeps for our saves, and whether vLLM's KV
        memory is registered with an open backend."""
        return {"loads": sorted(self._loads), "step_loads": sorted(self._sync), "saves": sorted(self._saves),
                "kept": len(self._kept),
                "holding_blocks_of": sorted(self._with_saves), "registered": self.registration is not None,
                "backend_open": self.backend is not None, "load_errors_pending": len(self._errors),
                "serving": self.serving, "pulls_pending": len(self._asked), "replies_in_flight": len(self._replies),
                "pulls_served": self.pulls_served, "pulls_declined": self.pulls_declined,
                "pull_blocks_served": self.pull_blocks_served}

    # -- lifecycle ----------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Cancel what is in flight, call ``backend.shutdown()`` until no attempt can touch vLLM's
        memory, then close the registration and the backend. Idempotent."""
        backend, self.backend = self.backend, None
        if backend is None:
            return
        in_flight = [*self._in_flight(),
                     *(t for load in self._sync.values() for t in load.transfers if isinstance(t, Transfer))]
        for transfer in in_flight:
            transfer.cancel()
        deadline = time.monotonic() + timeout_s
        while True:
            seen = self.wakes.count
            pending = backend.shutdown()
            if not pending:
                break
            if time.monotonic() >= deadline:
                log.error("kvwire: %d attempt(s) still touch vLLM's KV memory after %.0f s; leaving the backend "
                          "and its registration open", len(pending), timeout_s)
                return
            self.wakes.wait_beyond(seen, min(deadline, time.monotonic() + 0.1))
        self._loads.clear()
        self._sync.clear()
        self._saves.clear()
        self._replies.clear()
        self._reply_of.clear()
        self._kept.clear()
        if self.registration is not None:
            self.registration.close()
            self.registration = None
        backend.close()
        log.info("kvwire: connector shut down: %d transfer(s) in flight cancelled, every attempt quiesced, "
                 "registration and backend closed", len(in_flight))
