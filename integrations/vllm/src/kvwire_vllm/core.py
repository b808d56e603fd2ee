"""The connector's worker half without vLLM: a kvwire lease holder over a paged KV cache, driven
hook by hook (:mod:`kvwire_vllm.worker` adapts vLLM's calls to it; tests drive it directly with
torch tensors in vLLM's layouts). It holds the regions, the staging pool, the moves in flight,
what finished and what failed, and the step's report to the scheduler side.

How the cache reaches the backend is decided once, at :meth:`WorkerCore.register_kv_caches`
(:mod:`kvwire_vllm.kvcache`): a backend that declares the cache's memory kind (HOST for vLLM's
CPU build, DEVICE for CUDA) gets vLLM's tensors registered directly, one region per plane (or
one of whole rows); any other backend that takes HOST memory is served through a fixed pool of
pinned host slots (:mod:`kvwire_vllm.staging`, :mod:`kvwire_vllm.holder` for what waits how),
each slot a whole block, published as one group. Either way a request's block ids are the rows,
its blocks' content names the names. Direct regions of many planes go to a store that names the
``block-objects`` protocol (contract K1) as one object per block: every store hint carries the
block layout, and a load reads a block's planes together.

Loads and saves are submitted and left to the backend's threads; each step looks at them without
blocking. A save keeps its request's blocks allocated (the scheduler side delays their freeing)
until vLLM's blocks are no longer read for it: until its attempt quiesced, or for a staged save
until every block is gathered into slots (the publish then holds only slots).

With ``load_async`` false a load runs inside the step that computes on it: one move per layer
(one for all layers when staged, stored as block objects or pulled from a peer: those read a
block's layers together), the first submitted before the forward;
each layer's attention waits for its own and then submits the next layer's, which loads while
this one computes. Blocks that did not arrive are load errors of that same step, and the
request's blocks computed in that step, on a context that was not whole, are not saved.

Why one file of this size: the worker side is one object that vLLM drives hook by hook, and its
loads, saves and served pulls share one step plan, one set of moves in flight and one report to
the scheduler side; split apart, each part would reach into that state."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

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
from kvwire.contract.blocks import BLOCKS_FIELD
from kvwire.contract.capabilities import SERVE_PULLS, OtherEnd
from kvwire.contract.outcome import Cause
from kvwire.contract.serving import PullRequest, ServesPulls
from kvwire.holding import Direction, Wakes, drain
from kvwire.observe import cause_label
from kvwire_vllm import trace
from kvwire_vllm.holder import (
    MISSING,
    QUIESCE_GRACE_S,
    UNSENT,
    Direct,
    Move,
    StagedLoad,
    StagedSave,
    StepLoad,
    doze,
)
from kvwire_vllm.kvcache import Grouping, PagedCache, StoreRows
from kvwire_vllm.names import NAME_BYTES
from kvwire_vllm.plan import (
    COUNTERS,
    MAX_ASK_BLOCKS,
    BlockPlan,
    PullAsk,
    ServePlan,
    StepPlan,
    SyncLoad,
    WorkerReport,
)
from kvwire_vllm.staging import DEFAULT_STAGING_MIB, StagingPool

__all__ = ["WorkerCore", "IDLE_WAIT_S"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger where vLLM runs: its handler and format

#: On a step with nothing scheduled and moves in flight, sleep on the backend's wake up to this
#: long instead of letting the engine spin through empty steps.
IDLE_WAIT_S = 0.02
#: While a step waits for a move (a load inside the step, a preemption), it looks again at least
#: this often: device copies and slots other moves give back come with no wake.
_LOOK_S = 0.005


class WorkerCore:
    """The worker side of one engine's connector over ``backend`` (which it closes at
    :meth:`shutdown`). ``layers`` name the cache's layers in order; ``rows`` is what vLLM's
    config says the store holds per block (:func:`kvwire_vllm.kvcache.store_rows`; checked
    against the tensors at registration, ``None``: not checked); ``stage`` forces staging
    (``True``) or direct registration (``False``) instead of deciding by the backend's memory
    kinds; ``on_pull`` is called (from the backend's thread) when a pull arrives."""

    def __init__(self, backend: Backend, *, layers: Iterable[str], block_size: int, namespace: str,
                 timeout_s: float = 10.0, backend_name: str = "", staging_mib: float = DEFAULT_STAGING_MIB,
                 rows: StoreRows | None = None, stage: bool | None = None,
                 on_pull: Callable[[], None] | None = None) -> None:
        self.backend: Backend | None = backend
        self.layers = list(layers)
        self.block_size = int(block_size)
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.backend_name = backend_name
        self.staging_mib = float(staging_mib)
        self.expected_rows = rows
        self.force_stage = stage
        self.on_pull = on_pull
        self.cache: PagedCache | None = None
        self.pool: StagingPool | None = None
        self.rows: StoreRows | None = None
        self.registration: Registration | None = None
        self.regions: tuple[SlotRegion, ...] = ()
        self.wakes = Wakes()  # one for every attempt of this worker
        self._plan = StepPlan()
        self._loads: dict[str, Move] = {}
        self._saves: dict[str, list[Move]] = {}
        self._draining: list[Move] = []  # staged saves done with vLLM's blocks, still publishing slots
        self._with_saves: set[str] = set()  # requests whose blocks the scheduler keeps until we say
        self._finished: set[str] = set()  # ... and that have finished: report once their saves let go
        self._errors: set[int] = set()
        self._kept: list[Move] = []  # never quiesced: their memory is not ours to reuse
        # Loads inside this step (load_async false), per request; requests whose load missed
        # blocks (their saves this step are skipped); what to report to the scheduler side.
        self._layer_of = {name: i for i, name in enumerate(self.layers)}
        self._sync: dict[str, StepLoad] = {}
        self._sync_missed: set[str] = set()
        self._report_loaded: list[SyncLoad] = []
        self.counts: dict[str, float] = {k: 0 for k in COUNTERS}
        # For metrics: each load's seconds until quiescence, and blocks loads missed by cause.
        self._load_seconds: list[float] = []
        self._error_causes: dict[str, int] = {}
        self._report_saved: list[bytes] = []  # names of blocks whose save ended held (KV events)
        capabilities = self.capabilities = backend.capabilities()
        self.memory_kinds = frozenset(capabilities.memory_kinds)
        self.peer = capabilities.other_end is OtherEnd.PEER
        self.serving = SERVE_PULLS in capabilities.protocols and isinstance(backend, ServesPulls)
        # Serving pulls: pulls forwarded to the scheduler side (awaiting its pins), replies in
        # flight (their pins held there until we report them done), and what to report next.
        self._pull_serial = 0
        self._asked: dict[int, PullRequest] = {}
        self._replies: dict[int, Move] = {}
        self._reply_of: dict[Move, tuple[int, PullRequest]] = {}
        self._report_asks: list[PullAsk] = []
        self._report_done: list[int] = []
        #: The transceiver state the scheduler side hands producers' consumers (set by the adapter
        #: once the cache is registered; reported once).
        self.state_to_report = b""
        self.pulls_served = 0
        self.pulls_declined = 0
        self.pull_blocks_served = 0

    # -- registration ------------------------------------------------------------------------

    @property
    def staged(self) -> bool:
        return self.pool is not None

    @property
    def block_objects(self) -> bool:
        """Whether the store keeps a block's groups as one object (K1): a load reads all of them
        at once, never layer by layer."""
        return self.rows is not None and self.rows.block_objects

    @property
    def groups(self) -> tuple[int, ...]:
        """The store groups of every block: region ids (staged: the one slot region)."""
        return tuple(r.region_id for r in self.regions)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every layer."""
        return self.cache.row_bytes if self.cache is not None else 0

    def _decide(self, cache: PagedCache) -> StoreRows:
        direct_kind = MemoryKind.DEVICE if cache.on_cuda else MemoryKind.HOST
        grouping = cache.grouping()
        staged = self.force_stage if self.force_stage is not None else (
            direct_kind not in self.memory_kinds or grouping is None)
        if not staged:
            if grouping is None:
                raise ValueError(f"the KV cache ({self._shapes()}) keeps no plane's blocks, nor whole rows, at a "
                                 "stride of their own size: it cannot be registered without staging")
            if direct_kind not in self.memory_kinds:
                raise ValueError(f"backend {self.backend_name!r} does not move {direct_kind.name} memory, where "
                                 f"this KV cache lies ({cache.device})")
            count = len(cache.planes) if grouping is Grouping.PLANE else 1
            return StoreRows(grouping, tuple(range(count)), staged=False)
        if MemoryKind.HOST not in self.memory_kinds:
            raise ValueError(f"backend {self.backend_name!r} moves {sorted(k.name for k in self.memory_kinds)} memory "
                             f"only; this KV cache on {cache.device} needs {direct_kind.name} memory, or HOST "
                             "memory for staging slots")
        return StoreRows(Grouping.BLOCK, (0,), staged=True)

    def _shapes(self, kv_caches: Mapping[str, torch.Tensor] | None = None) -> str:
        tensors = kv_caches if kv_caches is not None else {}
        parts = [f"{name}: shape {tuple(t.shape)}, strides {t.stride()}, {t.dtype} on {t.device}"
                 for name, t in list(tensors.items())[:2]]
        return "; ".join(parts) + (" ..." if len(tensors) > 2 else "") if parts else "no tensors"

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int | None = None) -> None:
        """Take vLLM's KV tensors (one per layer, in vLLM's layouts) and register them, or the
        staging pool, with the backend. Raises ``ValueError`` naming shapes and strides for a
        layout it does not know or one other than the config said."""
        assert self.backend is not None, "the worker is shut down"
        try:
            cache = PagedCache(kv_caches, self.layers, num_blocks)
            rows = self._decide(cache)
        except ValueError as exc:
            raise ValueError(f"kvwire-vllm cannot use this KV cache ({self._shapes(kv_caches)}): {exc}") from None
        pool = StagingPool.sized(cache, self.staging_mib) if rows.staged else None
        regions = (pool.region,) if pool is not None else cache.regions()
        rows = replace(rows, row_bytes=tuple(r.slot_bytes for r in regions))
        if self.expected_rows is None:
            rows = rows.with_block_objects(self.capabilities.protocols, not self.peer)
        else:  # as the scheduler side asks the store (it keeps per-group objects where it lacks the row sizes)
            rows = replace(rows, block_objects=self.expected_rows.block_objects)
        try:
            self._check_rows(rows, kv_caches)
        except ValueError:
            if pool is not None:
                pool.close()
            raise
        try:
            self.registration = self.backend.register_regions(regions)
        except BaseException:
            if pool is not None:
                pool.close()
            raise
        self.cache, self.pool, self.rows, self.regions = cache, pool, rows, regions
        if pool is not None:
            log.info("kvwire: KV cache (%s) staged through %d pinned slot(s) of %d bytes (%.0f MiB) for backend %r",
                     cache.describe(), pool.slots, cache.row_bytes, pool.slots * cache.row_bytes / (1 << 20),
                     self.backend_name)
        else:
            log.info("kvwire: registered %d KV region(s) of %d blocks x %d bytes (%s) with backend %r",
                     len(regions), regions[0].slot_count, regions[0].slot_bytes, cache.describe(), self.backend_name)
        if self.serving:
            assert isinstance(self.backend, ServesPulls)
            self.backend.serve(self._on_pull)

    def _check_rows(self, rows: StoreRows, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Raises ``ValueError`` when the rows of the tensors vLLM registered are not those its
        config names (the scheduler side asks the store about those)."""
        expected = self.expected_rows
        if expected is None:
            return
        if (expected.grouping, expected.groups, expected.staged) != (rows.grouping, rows.groups, rows.staged):
            raise ValueError(f"vLLM's config says the store holds {expected.grouping.value} rows in "
                             f"{len(expected.groups)} group(s){' through staging' if expected.staged else ''}, but "
                             f"the KV cache vLLM registered ({self._shapes(kv_caches)}) gives "
                             f"{rows.grouping.value} rows in {len(rows.groups)} group(s)"
                             f"{' through staging' if rows.staged else ''}: not the layout vLLM's config names")
        if rows.block_objects and expected.row_bytes != rows.row_bytes:
            raise ValueError(f"vLLM's config gives blocks of layout {expected.block_layout()!r}, but the KV cache "
                             f"vLLM registered ({self._shapes(kv_caches)}) gives {rows.block_layout()!r}: the "
                             "scheduler side would ask the store about objects this worker never stores")

    def _on_pull(self) -> None:
        """The backend's wake for new pulls (its thread): wake a dozing step, and let the
        adapter ring the engine core, which may be idle."""
        self.wakes()
        if self.on_pull is not None:
            self.on_pull()

    # -- moves ---------------------------------------------------------------------------------

    def bind(self, plan: StepPlan) -> None:
        self._plan = plan

    def view_of(self, plan: BlockPlan, regions: tuple[SlotRegion, ...] | None = None) -> View:
        names = plan.name_array()
        tokens = TokenRange(plan.first * self.block_size, (plan.first + len(plan.block_ids)) * self.block_size)
        return layer_view(regions or self.regions, np.asarray(plan.block_ids), tokens, names)

    def _gate(self) -> torch.cuda.Event | None:
        """An event after what vLLM's stream has queued so far (``None`` on the CPU)."""
        if self.cache is None or not self.cache.on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.cache.device))
        return event

    def _start(self, op: Direction, plan: BlockPlan, view: View | None = None,
               gate: torch.cuda.Event | None = None) -> Move:
        assert self.backend is not None
        if plan.source:
            hint = Hint.of("peer", timeout_s=self.timeout_s, address=plan.source)
        elif self.rows is not None and self.rows.block_objects:  # one object per block (K1)
            hint = Hint.of("store", timeout_s=self.timeout_s, namespace=self.namespace,
                           **{BLOCKS_FIELD: self.rows.block_layout()})
        else:
            hint = Hint.of("store", timeout_s=self.timeout_s, namespace=self.namespace)
        timeout = self.timeout_s + QUIESCE_GRACE_S
        if self.pool is not None:
            kind = StagedLoad if op is Direction.FETCH else StagedSave
            return kind(self.backend, op, plan.req_id, self.pool, plan.block_ids, plan.name_array(),
                        plan.first * self.block_size, self.block_size, hint, self.wakes, timeout)
        return Direct(self.backend, op, plan.req_id, view or self.view_of(plan), plan.block_ids, hint, self.wakes,
                      timeout, gate if gate is not None else self._gate())

    def _in_flight(self) -> list[Move]:
        return [*self._loads.values(), *(m for ms in self._saves.values() for m in ms), *self._draining,
                *self._replies.values()]

    def _advance(self) -> None:
        for move in self._in_flight():
            move.advance()
        for load in self._sync.values():
            for sent in load.transfers:
                if isinstance(sent, Move):
                    sent.advance()

    def _wait_out(self, move: Move, *, blocks_only: bool = False) -> bool:
        """Block until ``move`` ended (with ``blocks_only``: until vLLM's blocks are free of it),
        driving every move meanwhile (slots come back from others); false if an attempt of it
        never quiesced (its memory stays held)."""
        if isinstance(move, Direct):
            move.wait_gate()
        while True:
            seen = self.wakes.count
            self._advance()
            if (not move.holds_blocks) if blocks_only else move.ended:
                return True
            if move.overdue:
                return False
            events = move.events()
            if events and not move.submissions():
                events[0].synchronize()  # one copy of this move: an event wait, never the device
                continue
            self.wakes.wait_beyond(seen, time.monotonic() + _LOOK_S)

    def handle_preemptions(self) -> None:
        """A preempted request's blocks go back to the pool before this step's forward: its saves
        must be done with them by then (a staged save gives up what it has not gathered)."""
        for req_id in self._plan.preempted:
            for move in self._saves.pop(req_id, []):
                if isinstance(move, StagedSave):
                    move.give_up_queued()
                if not self._wait_out(move, blocks_only=True):
                    self._keep(move)
                elif move.ended:
                    self._account_save(move)
                else:
                    self._draining.append(move)

    def start_load_kv(self) -> None:
        if self.registration is None:
            return
        for plan in self._plan.loads:
            if plan.sync:
                whole_rows = bool(plan.source) or self.staged or self.block_objects
                load = self._sync[plan.req_id] = StepLoad(plan, 1 if whole_rows else len(self.regions), self._gate())
                self._submit_layer(load, 0)
                trace.event("worker", "load_submitted", req=plan.req_id, blocks=len(plan.block_ids), sync=True)
                continue
            self._loads[plan.req_id] = self._start(Direction.FETCH, plan)
            trace.event("worker", "load_submitted", req=plan.req_id, blocks=len(plan.block_ids))

    def _submit_layer(self, load: StepLoad, index: int) -> None:
        if index < len(load.transfers) and load.transfers[index] is UNSENT:
            plan = load.plan
            assert isinstance(plan, BlockPlan)
            regions = self.regions if len(load.transfers) == 1 else (self.regions[index],)
            load.transfers[index] = self._start(Direction.FETCH, plan, self.view_of(plan, regions), load.gate)

    def _wait_layer(self, load: StepLoad, index: int) -> None:
        """Layer ``index`` of ``load`` has ended (submitted now if it was not), and the next
        layer's fetch is on its way: one layer in flight per request, so it loads while this
        layer computes (two fetches at once ran slower here: their threads share one GIL)."""
        self._submit_layer(load, index)
        if load.waited[index] is None:
            move = load.transfers[index]
            load.waited[index] = isinstance(move, Move) and self._wait_out(move)
        self._submit_layer(load, index + 1)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer's attention: this step's loads of that layer have ended (a staged
        load's scatters completed on the device)."""
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
            assert isinstance(plan, BlockPlan)
            whole = np.ones(len(plan.block_ids), dtype=bool)
            cause = ""
            for index in range(len(load.transfers)):
                self._wait_layer(load, index)
                move = load.transfers[index]
                assert isinstance(move, Move)
                if not load.waited[index]:  # never quiesced: its memory may still be written
                    self._keep(move)
                    whole[:] = False
                    cause = cause or cause_label(Cause.DEADLINE)
                else:
                    got = move.whole()
                    if not got.all():
                        cause = cause or move.cause()
                    whole &= got
                    self._count_deferral(move)
            missed = self._account_load(req_id, plan.block_ids, whole, load.started, cause=cause)
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
            move = self._start(Direction.PUBLISH, plan)
            trace.event("worker", "save_submitted", req=plan.req_id, first=plan.first, blocks=len(plan.block_ids),
                        refused=isinstance(move, Direct) and move.refused is not None)
            self._saves.setdefault(plan.req_id, []).append(move)

    @property
    def idle(self) -> bool:
        return self._plan.idle

    # -- serving pulls ----------------------------------------------------------------------------

    def _take_pulls(self) -> None:
        """Pulls the backend received: decline those this cache cannot answer (other groups or
        row sizes), forward the others' names to the scheduler side, which owns the block pool."""
        if not self.serving or self.backend is None or self.registration is None:
            return
        assert isinstance(self.backend, ServesPulls)
        groups = self.groups
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

    def _decline(self, pull_id: int, request: PullRequest, reason: str) -> None:
        assert isinstance(self.backend, ServesPulls)
        self.backend.decline(request, reason)
        self.pulls_declined += 1
        self._report_done.append(pull_id)

    def _reply(self, serve: ServePlan) -> None:
        request = self._asked.pop(serve.pull_id, None)
        if request is None or self.backend is None:
            self._report_done.append(serve.pull_id)  # unknown here: let its pins go
            return
        if serve.reason:
            self._decline(serve.pull_id, request, serve.reason)
            return
        count = len(serve.block_ids)
        if self.pool is not None and count:
            # One ticket, one publish: a staged reply serves the prefix that fits the free slots.
            count = min(count, self.pool.free)
            if not count:
                self._decline(serve.pull_id, request, "no staging slot is free on the serving engine; try later")
                return
        block_ids = serve.block_ids[:count]
        names = request.names[:count]
        move: Move
        if self.pool is not None and count:
            move = StagedSave(self.backend, Direction.PUBLISH, f"pull-{serve.pull_id}", self.pool, block_ids, names,
                              0, self.block_size, request.ticket, self.wakes, self.timeout_s + QUIESCE_GRACE_S,
                              whole_only=True)
        else:
            tokens = TokenRange(0, count * self.block_size)
            view = layer_view(self.regions, np.asarray(block_ids, dtype=np.int64), tokens, names)
            move = Direct(self.backend, Direction.PUBLISH, f"pull-{serve.pull_id}", view, block_ids, request.ticket,
                          self.wakes, self.timeout_s + QUIESCE_GRACE_S, self._gate() if count else None)
        if isinstance(move, Direct) and move.refused is not None:  # nothing escaped (S3): decline, pins go
            self._decline(serve.pull_id, request, f"cannot answer now: {move.refused}")
            return
        self._replies[serve.pull_id] = move
        self._reply_of[move] = (serve.pull_id, request)
        trace.event("worker", "pull_replied", pull=serve.pull_id, blocks=count)
        self.pulls_served += 1
        self.pull_blocks_served += count
        self._add(pulls_served=1)

    def _reply_ended(self, move: Move) -> None:
        pull_id, request = self._reply_of.pop(move)
        del self._replies[pull_id]
        if isinstance(move, StagedSave) and not move.submitted:  # the ticket was never answered
            self._decline(pull_id, request, f"cannot answer now: {move.note() or 'nothing was sent'}")
            return
        self._report_done.append(pull_id)

    def report(self) -> WorkerReport:
        """This step's report to the scheduler side: pulls to pin, replies whose pins may go,
        loads that ran inside the step."""
        self._take_pulls()
        saved = self._report_saved[:MAX_ASK_BLOCKS]  # a report is bounded; the rest goes next step
        report = WorkerReport(tuple(self._report_asks), tuple(self._report_done), tuple(self._report_loaded),
                              self.state_to_report, b"".join(saved))
        self._report_saved = self._report_saved[MAX_ASK_BLOCKS:]
        self._report_asks, self._report_done, self._report_loaded = [], [], []
        self.state_to_report = b""
        return report

    # -- what finished ------------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """Requests that finished and whose saves are all done with vLLM's blocks, and requests
        whose load ended (whatever it delivered; what it missed goes to :meth:`take_load_errors`)."""
        for req_id in finished_req_ids:
            load = self._loads.get(req_id)
            if load is not None:  # aborted mid-load: stop it; reported once ended
                load.cancel()
            if req_id in self._with_saves:
                self._finished.add(req_id)
        if self._loads and trace.enabled():
            trace.event("worker", "get_finished", loads=sorted(self._loads), idle_step=self._plan.idle)
        self._advance()
        if self._plan.idle and not any(m.ended for m in self._in_flight()) and self._in_flight():
            # Nothing to compute this step: sleep on the backend's wake rather than let the
            # engine spin through empty steps on cores the transfer needs.
            doze(self._in_flight(), IDLE_WAIT_S)
            self._advance()
        received: set[str] = set()
        for req_id, load in list(self._loads.items()):
            if not load.ended:
                continue
            trace.event("worker", "load_ended", req=req_id, idle_step=self._plan.idle,
                        seconds=time.perf_counter() - load.started)
            del self._loads[req_id]
            self._count_deferral(load)
            self._account_load(req_id, load.block_ids, load.whole(), load.started, load.note(), load.cause())
            received.add(req_id)
        for req_id, moves in list(self._saves.items()):
            left = [m for m in moves if m.holds_blocks]
            for move in moves:
                if not move.holds_blocks:
                    if move.ended:
                        self._account_save(move)
                    else:
                        self._draining.append(move)
            if left:
                self._saves[req_id] = left
            else:
                del self._saves[req_id]
        draining = []
        for move in self._draining:
            if move.ended:
                self._account_save(move)
            else:
                draining.append(move)
        self._draining = draining
        for move in [m for m in self._replies.values() if m.ended]:
            self._reply_ended(move)  # a pull's reply ended: its pins may go
        for move in self._in_flight():
            if move.overdue and move not in self._reply_of:  # a reply's pins stay until shutdown
                self._keep(move)
        sent = {r for r in self._finished if r not in self._saves}
        self._finished -= sent
        self._with_saves -= sent
        return sent, received

    def _keep(self, move: Move) -> None:
        """A move whose attempt did not quiesce a grace after it was cancelled: its request keeps
        waiting (its memory may still be touched) until ``backend.shutdown()`` says otherwise."""
        if move not in self._kept:
            log.error("kvwire %s of request %s did not quiesce %.0f s after its deadline; its blocks stay held",
                      move.op.value, move.req_id, QUIESCE_GRACE_S)
            self._kept.append(move)
            if move.op is Direction.PUBLISH and move not in self._saves.get(move.req_id, []) and \
                    move not in self._reply_of:
                self._saves.setdefault(move.req_id, []).append(move)

    def _count_deferral(self, move: Move) -> None:
        if move.deferred:
            self.counts["load_deferrals"] += 1

    def _account_load(self, req_id: str, block_ids: tuple[int, ...], whole: np.ndarray, started: float,
                      note: str = "", cause: str = "") -> np.ndarray:
        """A load is over: blocks not ``whole`` (arrived in every layer) become load errors,
        counted under ``cause`` (a metric label, :meth:`Move.cause`); the counters count it.
        Returns the indices of the blocks that did not arrive."""
        missed = np.flatnonzero(~whole)
        self._errors.update(block_ids[i] for i in missed.tolist())
        moved = int(whole.sum())
        seconds = time.perf_counter() - started
        self._add(loads=1, load_blocks=moved, load_bytes=moved * self.block_bytes, load_seconds=seconds,
                  load_error_blocks=int(missed.size))
        self._load_seconds.append(seconds)
        if missed.size:
            label = cause or MISSING
            self._error_causes[label] = self._error_causes.get(label, 0) + int(missed.size)
        if missed.size:
            log.warning("kvwire load of request %s: %d of %d blocks did not arrive%s; vLLM recomputes them",
                        req_id, missed.size, len(block_ids), f" ({note})" if note else "")
        return missed

    def _account_save(self, move: Move) -> None:
        whole = move.whole()
        moved = int(whole.sum())
        if moved:
            names = move.names if isinstance(move, StagedSave) else \
                move.view.groups[0].names if isinstance(move, Direct) else None
            if names is not None:
                self._report_saved.extend(bytes(n) for n in np.asarray(names)[whole])
        self._add(saves=1, save_blocks=moved, save_bytes=moved * self.block_bytes,
                  save_seconds=time.perf_counter() - move.started, save_failures=int(moved < len(move.block_ids)),
                  save_skipped_blocks=getattr(move, "skipped", 0))

    def _add(self, **counts: float) -> None:
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + value

    def take_load_errors(self) -> set[int]:
        self._finish_sync_loads()
        errors, self._errors = self._errors, set()
        return errors

    def take_counts(self) -> dict[str, Any] | None:
        """The counters since the last call, or ``None`` when nothing was counted; with them
        ``load_seconds_each`` (each load's seconds) and ``load_error_causes`` (blocks loads
        missed, by cause)."""
        if not any(self.counts.values()):
            return None
        counts: dict[str, Any] = dict(self.counts)
        counts["load_seconds_each"], self._load_seconds = self._load_seconds, []
        counts["load_error_causes"], self._error_causes = self._error_causes, {}
        self.counts = {k: 0 for k in COUNTERS}
        return counts

    def state(self) -> dict[str, Any]:
        """What this worker holds now: moves in flight (their requests), moves that never
        quiesced, requests whose blocks vLLM keeps for our saves, whether vLLM's KV memory (or the
        staging pool) is registered with an open backend, and the staging slots in use."""
        pool = self.pool
        return {"loads": sorted(self._loads), "step_loads": sorted(self._sync), "saves": sorted(self._saves),
                "draining": len(self._draining), "kept": len(self._kept),
                "holding_blocks_of": sorted(self._with_saves), "registered": self.registration is not None,
                "backend_open": self.backend is not None, "load_errors_pending": len(self._errors),
                "staged": pool is not None, "staging_slots": pool.slots if pool is not None else 0,
                "staging_in_use": pool.in_use if pool is not None else 0,
                "staging_kept": pool.kept if pool is not None else 0,
                "serving": self.serving, "pulls_pending": len(self._asked), "replies_in_flight": len(self._replies),
                "pulls_served": self.pulls_served, "pulls_declined": self.pulls_declined,
                "pull_blocks_served": self.pull_blocks_served}

    # -- lifecycle ----------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 30.0) -> bool:
        """Cancel what is in flight, call ``backend.shutdown()`` until no attempt can touch vLLM's
        memory or a staging slot, then close the registration, the backend and the staging pool.
        False (logged) when attempts still touch memory after ``timeout_s``: then the backend,
        its registration and the pool stay open. Idempotent."""
        backend, self.backend = self.backend, None
        if backend is None:
            return True
        in_flight = [*self._in_flight(),
                     *(m for load in self._sync.values() for m in load.transfers if isinstance(m, Move))]
        for move in in_flight:
            move.cancel()
        pending = drain(backend, timeout_s, self.wakes, close=False)
        if pending:
            log.error("kvwire: %d attempt(s) still touch KV memory after %.0f s; leaving the backend, its "
                      "registration and the staging slots open", len(pending), timeout_s)
            return False
        for move in in_flight:  # every attempt quiesced: the last looks give staging slots back
            for event in move.events():
                event.synchronize()  # shutdown only: a copy still queued touches slots
            move.advance()
        self._loads.clear()
        self._sync.clear()
        self._saves.clear()
        self._draining.clear()
        self._replies.clear()
        self._reply_of.clear()
        self._kept.clear()
        if self.registration is not None:
            self.registration.close()
            self.registration = None
        backend.close()
        if self.pool is not None:
            self.pool.close()
        log.info("kvwire: connector shut down: %d transfer(s) in flight cancelled, every attempt quiesced, "
                 "registration and backend closed", len(in_flight))
        return True


def layer_view(regions: tuple[SlotRegion, ...], block_ids: np.ndarray, tokens: TokenRange,
               names: np.ndarray | None) -> View:
    """One PAGED group per region, every group the same blocks: the first group's read-only copies
    of the block ids and names go to the others as they are (one copy a view, not one a layer)."""
    if not regions:
        return View(())
    first = LayerGroupRows(regions[0].region_id, CacheKind.PAGED, regions[0], block_ids, tokens, names)
    return View((first, *(LayerGroupRows(region.region_id, CacheKind.PAGED, region, first.slots, tokens, first.names)
                          for region in regions[1:])))
