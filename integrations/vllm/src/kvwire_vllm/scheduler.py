"""The connector's scheduler half: how much of a prompt the store holds, what to load into which
blocks, which blocks to save, and when a finished request's blocks may be freed.

It runs in vLLM's engine-core process and moves no bytes; it asks the backend the optional
``lookup`` question (contract L1) when the backend declares it. A producer's holds for
disaggregated prefill are :mod:`kvwire_vllm.handoff`'s; what it derives from vLLM's config alike
with the worker side (layout, rows per block, scope) is :mod:`kvwire_vllm.layout`'s.

Why one file of this size: vLLM drives this side hook by hook, and lookups, loads, saves, served
pulls and holds all read the same per-request tracking and the same step's plan; split further,
each part would reach into that state."""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvwire.contract import Backend, Hint
from kvwire.contract.blocks import BLOCKS_FIELD
from kvwire.contract.capabilities import SERVE_PULLS, OtherEnd
from kvwire.contract.errors import SubmissionError
from kvwire.holding import StateError
from kvwire_vllm import peer, trace
from kvwire_vllm.config import ConnectorConfig
from kvwire_vllm.events import StoreEvents, block_infos, medium_of, to_vllm
from kvwire_vllm.handoff import Holds, hold_seconds, wants_hold
from kvwire_vllm.layout import facts_of, layout_of, resolved_layout, rows_of, scope_of, store_namespace
from kvwire_vllm.metadata import (
    BlockPlan,
    KvwireMetadata,
    KvwireWorkerMeta,
    ServePlan,
    StepPlan,
    WorkerReport,
)
from kvwire_vllm.names import NAME_BYTES, block_names

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

try:  # contract 1.1's optional protocol L1; absent from older kvwire
    from kvwire.contract import LOOKUP, LookupFailed
except ImportError:  # pragma: no cover - kvwire before L1
    # None stands for "no L1"; mypy types an imported name by the import (str) and cannot widen it.
    LOOKUP = None  # type: ignore[assignment]

    class LookupFailed(Exception):  # type: ignore[no-redef]
        """Stands in for kvwire's own before L1."""

__all__ = ["SchedulerSide"]

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler, format and level


@dataclass
class _Tracked:
    """A request the scheduler side follows from allocation to finish."""

    request: Request
    next_save: int  # index of the first block not yet saved (or loaded, or a local hit)
    load: BlockPlan | None = None
    loaded_blocks: int = 0
    failed_blocks: int = 0
    saved_blocks: int = 0
    named: int = 0  # blocks whose name -> block hash this side has recorded (for serving pulls)
    source: bytes | None = None  # the serving engine's address, for a request pulled from a peer


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: ConnectorConfig) -> None:
        self.config = config
        plugin = config.plugin()
        self.block_size, self.layers, layout = layout_of(kv_cache_config)
        # The groups a store holds per name follow the layout and how the worker reaches it
        # (its own memory, or staging slots of whole blocks): kvwire_vllm.kvcache.
        rows = rows_of(vllm_config, kv_cache_config, plugin.capabilities)
        layout = {**layout, "kv_cache_layout": resolved_layout(vllm_config, kv_cache_config), "rows": rows.describe()}
        self.scope = scope_of(vllm_config, layout)
        self.facts = facts_of(vllm_config, layout)
        self.groups = rows.groups
        self.rows = rows
        parallel = vllm_config.parallel_config
        self.namespace = store_namespace(config.namespace(), 0, int(parallel.tensor_parallel_size))
        self.layout = layout
        self.backend: Backend | None = None
        self.peer = plugin.capabilities.other_end is OtherEnd.PEER
        self.serving = self.peer and SERVE_PULLS in plugin.capabilities.protocols
        # Serving pulls (N2): kvwire name -> vLLM block hash of blocks this engine computed or
        # loaded (bounded; vLLM's own prefix cache is the truth of what is held), the pins taken
        # for each forwarded pull (block objects of vLLM's pool, one reference each), and the
        # answers for the next step's plan.
        self._hash_of: dict[bytes, bytes] = {}
        self._hash_cap = 4 * int(getattr(kv_cache_config, "num_blocks", 0) or 65536)
        self._pins: dict[int, list[Any]] = {}
        # Disaggregated prefill: a producer's finished requests whose prompt blocks stay pinned
        # for the consumer's pull (req_id -> hold), the last name each forwarded pull asked for
        # (the pull of a hold's last block ends the hold), and this engine's transceiver state
        # (from the worker's first report) that a producer's kv_transfer_params carry.
        self.role = str(getattr(vllm_config.kv_transfer_config, "kv_role", None) or "kv_both")
        self.holds = Holds(self._free_blocks, self._on_ring)
        self._pull_last: dict[int, bytes] = {}
        self._state: bytes = b""
        self._refused: dict[str, str] = {}  # req_id -> why its kvwire_source was not used
        self._serves: list[ServePlan] = []
        # A serving engine steps once while idle at start: that step's worker report brings the
        # worker's transceiver state, which a producer's first finished request already needs
        # (vLLM hands a step's worker reports over only after the step's requests finished).
        self._poked = self.serving
        self.pulls_answered = 0
        self.blocks_pinned_total = 0
        self._core = peer.find_engine_core() if self.serving else None
        self._bell: peer.Doorbell | None = None
        if self.serving:
            engine_id = str(vllm_config.kv_transfer_config.engine_id)
            self._bell = peer.Doorbell(engine_id, self._on_ring)
            core = self._core() if self._core is not None else None
            if core is not None and getattr(core, "input_queue", None) is None:
                # vLLM's in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): it steps only
                # inside its caller's calls, so the bell has no loop to wake
                log.warning("kvwire: this engine's core runs inside its caller's process "
                            "(VLLM_ENABLE_V1_MULTIPROCESSING=0), so it steps only while the caller drives it: "
                            "a pull or a disaggregated-prefill consumer reaching it while it is idle waits until "
                            "the caller's next generate or step, and fails at the puller's deadline if none comes. "
                            "Leave the engine core its own process (vLLM's default) for an engine that serves pulls")
        if self.peer:
            pass  # a peer answers how much it holds within the pull itself (a partial prefix is delivered)
        elif config.lookup and LOOKUP is not None and LOOKUP in plugin.capabilities.protocols:
            self.backend = plugin.build(config.options)
        elif config.lookup:
            log.warning("kvwire backend %r does not answer lookups (contract L1): the scheduler assumes the store "
                        "holds every whole block of a prompt and vLLM recomputes what a load misses",
                        config.backend)
        # KV events (vLLM's kv_events_config): what this engine's saves put in the store, and
        # what it found the store no longer holds (kvwire_vllm.events). A peer stores nothing.
        events = getattr(vllm_config, "kv_events_config", None)
        self.medium = medium_of(config.backend)
        self.events = StoreEvents() if (events is not None and events.enable_kv_cache_events
                                        and not self.peer) else None
        self._pins_reported = 0
        self.kv_cache_manager: KVCacheManager | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, tuple[int, int]] = {}  # req_id -> (first block, blocks) of the last answer
        # req_id -> the end of the leading blocks the store held at the last answer, when that
        # reaches past the blocks a load may cover (the prompt's last whole block, which the step
        # computes since one token is always left to compute): those are not saved again.
        self._held_to: dict[str, int] = {}
        self._loads: list[BlockPlan] = []
        self._saving: set[str] = set()
        # req_id -> index of the first block a load of it missed: vLLM reschedules such a request
        # and asks again; offering those blocks again would load (and miss) them forever.
        self._missed_from: dict[str, int] = {}
        self.lookups = 0
        self._sources: dict[str, bytes] = {}  # req_id -> the peer address its load pulls from

    def _source(self, request: Request) -> bytes | None:
        """The serving engine's address a request names (``kv_transfer_params['kvwire_source']``,
        its transceiver state), checked against this engine's cache; None when it names none or
        names one that cannot serve it (logged: the request is computed here)."""
        try:
            raw = peer.source_of(request.kv_transfer_params)
            if raw is None:
                return None
            state = peer.check_state(raw, backend=self.config.backend, layout=self.layout, scope=self.scope,
                                     block_size=self.block_size, facts=self.facts)
        except StateError as exc:
            log.warning("request %s: kvwire source not used, computing it here: %s", request.request_id, exc)
            self._refused[request.request_id] = str(exc)
            return None
        return state.address

    # -- how much the store holds --------------------------------------------------------------

    def names(self, request: Request, first: int, end: int) -> np.ndarray:
        return block_names(self.scope, request.block_hashes[first:end])

    def loadable_blocks(self, request: Request) -> int:
        """Whole blocks of the prompt a load may cover: one token is always left to compute."""
        return min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Leading whole blocks past the local hit that the store holds (all of them, when the
        backend cannot be asked), to load asynchronously (or, with ``load_async`` false, inside
        the step that computes the rest)."""
        first = num_computed_tokens // self.block_size
        end = min(self.loadable_blocks(request), self._missed_from.get(request.request_id, len(request.block_hashes)))
        held = 0
        if self.peer:
            source = self._source(request)
            if source is None:
                end = first  # nothing to load: no peer named
            self._sources[request.request_id] = source or b""
        self._held_to.pop(request.request_id, None)
        if end > first:
            # Ask also about the prompt's whole blocks past the loadable ones (the last one, when
            # the prompt ends on a block boundary): held, the step computes it but saves it not.
            ask = end
            if end == self.loadable_blocks(request) and request.request_id not in self._missed_from:
                ask = max(end, min(len(request.block_hashes), request.num_prompt_tokens // self.block_size))
            trace.event("scheduler", "lookup", req=request.request_id, blocks=ask - first)
            held = end - first if self.backend is None else self._lookup(self.names(request, first, ask))
            if held > end - first:
                self._held_to[request.request_id] = first + held
                held = end - first
            trace.event("scheduler", "matched", req=request.request_id, held=held)
        # Remembered even when nothing is held: blocks below ``first`` are local hits, not saved again.
        self._matched[request.request_id] = (first, held)
        if held <= 0:
            return 0, False
        return held * self.block_size, self.config.load_async

    def _lookup(self, names: np.ndarray) -> int:
        """How many leading names the store holds in every layer; 0 when it cannot say."""
        assert self.backend is not None
        hint = Hint.of("store", timeout_s=self.config.timeout_s, namespace=self.namespace,
                       **({BLOCKS_FIELD: self.rows.block_layout()} if self.rows.block_objects else {}))
        try:
            mask = np.asarray(self.backend.lookup(self.groups, names, hint,  # type: ignore[attr-defined]
                                                  timeout_s=self.config.timeout_s), dtype=np.bool_)
        except (LookupFailed, SubmissionError) as exc:  # advice only: no answer means nothing to load
            log.warning("kvwire lookup failed, loading nothing for this request: %s: %s", type(exc).__name__, exc)
            return 0
        self.lookups += 1
        if self.events is not None and not mask.all():
            self.events.missing(n.tobytes() for n in names[~mask])
        missing = np.flatnonzero(~mask)
        return int(missing[0]) if missing.size else int(mask.size)

    # -- allocation and the step's plan ----------------------------------------------------------

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        first, held = self._matched.pop(req_id, (request.num_computed_tokens // self.block_size, 0))
        tracked = self._tracked.get(req_id)
        if tracked is None or num_external_tokens > 0:
            tracked = self._tracked[req_id] = _Tracked(request, next_save=first)
        if num_external_tokens <= 0:
            return
        count = num_external_tokens // self.block_size
        if count != held:
            log.warning("request %s: vLLM allocated %d external tokens, kvwire matched %d blocks; loading %d",
                        req_id, num_external_tokens, held, min(count, held))
            count = min(count, held)
        block_ids = blocks.get_block_ids()[0][first:first + count]
        plan = BlockPlan(req_id, first, tuple(int(b) for b in block_ids),
                         self.names(request, first, first + count).tobytes(), self._sources.get(req_id, b""),
                         sync=not self.config.load_async)
        tracked.load = plan
        tracked.next_save = first + count
        if count == held:  # loads all it matched: the held blocks past it need no save
            tracked.next_save = max(tracked.next_save, self._held_to.pop(req_id, 0))
        self._loads.append(plan)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvwireMetadata:
        self.holds.end()  # lapsed ones
        saves: list[BlockPlan] = []
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            request = tracked.request
            computed = request.num_computed_tokens + scheduled
            end = min(computed, request.num_prompt_tokens, len(request.block_hashes) * self.block_size)
            end //= self.block_size
            if self.serving and end > tracked.named:
                self._name_blocks(request, tracked.named, end)
                tracked.named = end
            if self.peer or end <= tracked.next_save:  # a peer backend does not store: peers pull
                continue
            assert self.kv_cache_manager is not None
            block_ids = self.kv_cache_manager.get_block_ids(req_id)[0][tracked.next_save:end]
            names = self.names(request, tracked.next_save, end)
            saves.append(BlockPlan(req_id, tracked.next_save, tuple(int(b) for b in block_ids), names.tobytes()))
            if self.events is not None:
                self.events.saving([n.tobytes() for n in names],
                                   block_infos(request, tracked.next_save, end, self.block_size))
            tracked.saved_blocks += end - tracked.next_save
            tracked.next_save = end
            self._saving.add(req_id)
        if trace.enabled():
            trace.event("scheduler", "step", scheduled=dict(scheduler_output.num_scheduled_tokens),
                        loads=[p.req_id for p in self._loads])
        plan = StepPlan(tuple(self._loads), tuple(saves), tuple(sorted(scheduler_output.preempted_req_ids or ())),
                        idle=scheduler_output.total_num_scheduled_tokens == 0, serves=tuple(self._serves))
        self._loads = []
        self._serves = []
        self._poked = False  # the worker takes its backend's incoming pulls after this plan
        return KvwireMetadata(plan.to_bytes())

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KvwireWorkerMeta):
            try:
                report = meta.report()
                self._serve(report)
            except ValueError as exc:
                log.error("kvwire: dropped a malformed worker report: %s", exc)
            else:
                if self.events is not None and report.saved:
                    self.events.saved(report.saved_names())
                for done in report.loaded:  # loads that ran inside the step (load_async false)
                    self._load_ended(done.req_id, done.first_missed if done.first_missed >= 0 else None,
                                     done.missed)
        bad = output.invalid_block_ids or set()
        for req_id in output.finished_recving or ():
            trace.event("scheduler", "load_reported", req=req_id)
            tracked = self._tracked.get(req_id)
            if tracked is None or tracked.load is None:
                continue
            failed = [i for i, b in enumerate(tracked.load.block_ids) if b in bad]
            self._load_ended(req_id, failed[0] if failed else None, len(failed), failed)

    def _load_ended(self, req_id: str, first_missed: int | None, missed: int,
                    failed: Sequence[int] | None = None) -> None:
        """A request's load is over: count it; from the first block that did not arrive vLLM
        recomputes, so those blocks are saved again once computed, and never offered again.
        ``failed``: the indices of every block that did not arrive, when known (else the first)."""
        tracked = self._tracked.get(req_id)
        if tracked is None or tracked.load is None:
            return
        load = tracked.load
        if self.events is not None and first_missed is not None:
            names = load.name_array()
            self.events.missing(names[i].tobytes() for i in (failed if failed else (first_missed,))
                                if 0 <= i < len(names))
        missed = min(missed, len(load.block_ids))
        tracked.failed_blocks += missed
        tracked.loaded_blocks += len(load.block_ids) - missed
        if first_missed is not None:
            at = load.first + first_missed
            tracked.next_save = min(tracked.next_save, at)
            self._missed_from[req_id] = min(self._missed_from.get(req_id, at), at)
        tracked.load = None

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks with saves submitted stay allocated until the worker reports the saves ended."""
        req_id = request.request_id
        load = self._tracked[req_id].load if req_id in self._tracked else None
        if load is not None and load.sync:
            # Finished in the step that ran its load, before the worker's report of it reaches
            # update_connector_output: vLLM lets a request finish there only if its load missed
            # nothing (it discards the step's output of one that missed, and reschedules it),
            # unless the failure policy failed the request.
            failed = getattr(request.status, "name", "") == "FINISHED_ERROR"
            self._load_ended(req_id, 0 if failed else None, len(load.block_ids) if failed else 0)
        tracked = self._tracked.pop(req_id, None)
        self._matched.pop(req_id, None)
        self._held_to.pop(req_id, None)
        self._missed_from.pop(req_id, None)
        self._sources.pop(req_id, None)
        delay = req_id in self._saving
        self._saving.discard(req_id)
        params: dict[str, Any] | None = None
        if tracked is not None:
            params = {"kvwire": {"loaded_blocks": tracked.loaded_blocks, "failed_blocks": tracked.failed_blocks,
                                 "save_blocks": tracked.saved_blocks, "at": time.time()}}
        refused = self._refused.pop(req_id, None)
        if refused is not None:
            params = params or {"kvwire": {}}
            params["kvwire"]["source_refused"] = refused
        handoff = self._hold(request, block_ids)
        if handoff is not None:
            params = {**(params or {}), **handoff}
        elif self.serving and self._state and (request.kv_transfer_params or {}).get("kvwire_want_source"):
            # the seed's request-free pull over HTTP: a client asks a server for its state this way
            params = {**(params or {}), peer.SOURCE_KEY: base64.b64encode(self._state).decode()}
        return delay, params

    # -- disaggregated prefill: a producer's blocks kept for its consumer (kvwire_vllm.handoff) -----

    def _hold(self, request: Request, block_ids: Sequence[int]) -> dict[str, Any] | None:
        """For a producer's finished request: pin the prompt's whole blocks (those a consumer's
        load may cover) and answer the ``kv_transfer_params`` the consumer's request needs
        (vLLM's proxy passes them on)."""
        if not wants_hold(self.role, self.serving, request.kv_transfer_params):
            return None
        pool = self.kv_cache_manager.block_pool if self.kv_cache_manager is not None else None
        if pool is None or not self._state or not self._running():
            why = ("the engine is shutting down" if pool is not None and self._state else
                   "the worker has not reported its transceiver state yet")
            log.warning("request %s: kvwire keeps no blocks for a consumer: %s", request.request_id, why)
            return {"do_remote_prefill": False, "do_remote_decode": False, "kvwire": {"hold_refused": why}}
        count = min(len(block_ids), len(request.block_hashes), (request.num_prompt_tokens - 1) // self.block_size)
        held = []
        for block_id in block_ids[:count]:
            block = pool.blocks[int(block_id)]
            if getattr(block, "block_hash", None) is None:  # not in the prefix cache: a pull cannot find it
                break
            held.append(block)
        seconds = hold_seconds(self.config.hold_s, request.kv_transfer_params)
        params: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False,
                                  peer.SOURCE_KEY: base64.b64encode(self._state).decode(),
                                  "kvwire_held_blocks": len(held), "kvwire_hold_s": seconds}
        if held:
            self._name_blocks(request, 0, len(held))
            pool.touch(held)
            self.holds.take(request.request_id, held, self.names(request, len(held) - 1, len(held))[0].tobytes(),
                            seconds)
        return params

    def _free_blocks(self, blocks: list[Any]) -> None:
        if self.kv_cache_manager is not None:
            self.kv_cache_manager.block_pool.free_blocks(blocks)

    # -- serving pulls (N2) ------------------------------------------------------------------------

    def _name_blocks(self, request: Request, first: int, end: int) -> None:
        names = self.names(request, first, end)
        hashes = request.block_hashes
        table = self._hash_of
        for i, name in enumerate(names):
            key = name.tobytes()
            table.pop(key, None)  # re-inserted last: the oldest go first when over the cap
            table[key] = bytes(hashes[first + i])
        while len(table) > self._hash_cap:
            del table[next(iter(table))]

    def _serve(self, report: WorkerReport) -> None:
        """Pins out for pulls whose reply quiesced go back to vLLM's pool; each new pull gets the
        longest prefix of its names that vLLM's prefix cache holds, pinned (one reference per
        block, as a request hit takes), to serve in the next step."""
        pool = self.kv_cache_manager.block_pool if self.kv_cache_manager is not None else None
        if report.state:
            self._state = report.state
        for pull_id in report.done:
            blocks = self._pins.pop(pull_id, None)
            if blocks and pool is not None:
                pool.free_blocks(blocks)
            self.holds.end(self._pull_last.pop(pull_id, None))
        for ask in report.asks:
            if pool is None:
                self._serves.append(ServePlan(ask.pull_id, (), "the serving engine has no block pool bound"))
                continue
            if not self._running():
                self._serves.append(ServePlan(ask.pull_id, (), "the serving engine is shutting down"))
                continue
            names = np.frombuffer(ask.names, dtype=np.uint8).reshape(-1, NAME_BYTES)
            if len(names):
                self._pull_last[ask.pull_id] = names[-1].tobytes()
            held = []
            for name in names:
                block_hash = self._hash_of.get(name.tobytes())
                got = pool.get_cached_block(block_hash, [0]) if block_hash is not None else None
                if not got:
                    break
                held.append(got[0])
            if held:
                pool.touch(held)
                self._pins[ask.pull_id] = held
            self.pulls_answered += 1
            self.blocks_pinned_total += len(held)
            trace.event("scheduler", "pull_pinned", pull=ask.pull_id, asked=ask.blocks, held=len(held))
            self._serves.append(ServePlan(ask.pull_id, tuple(int(b.block_id) for b in held)))

    def pinned_blocks(self) -> int:
        return sum(len(b) for b in self._pins.values())

    # -- what routers and operators see --------------------------------------------------------------

    def take_events(self) -> list[Any]:
        """vLLM's KV events since the last call (none without ``kv_events_config``)."""
        if self.events is None:
            return []
        records = self.events.take()
        return to_vllm(records, self.medium, self.block_size) if records else []

    def pins_changed(self) -> int | None:
        """Blocks of vLLM's pool this side pins now (served pulls, producers' holds), when that
        changed since the last call; else None."""
        pins = self.pinned_blocks() + self.holds.blocks()
        if pins == self._pins_reported:
            return None
        self._pins_reported = pins
        return pins

    def _running(self) -> bool:
        core = self._core() if self._core is not None else None
        state = getattr(core, "shutdown_state", None)
        return state is None or getattr(state, "name", "RUNNING") == "RUNNING"

    def _on_ring(self) -> None:
        """The worker's backend has a pull (or a reply that ended) for an engine that may be
        idle: make the engine step (doorbell thread; only flags and vLLM's wake-up sentinel)."""
        self._poked = True
        core = self._core() if self._core is not None else None
        inputs = getattr(core, "input_queue", None)
        trace.event("scheduler", "rang", core=inputs is not None)
        if inputs is not None:
            from vllm.v1.engine import EngineCoreRequestType

            inputs.put_nowait((EngineCoreRequestType.WAKEUP, None))

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a pull is on its way to this side, answered but not yet
        served, or holding pins; an idle engine with none of these sleeps as vLLM's does."""
        if not self.serving:
            return False
        return bool(self._pins or self._serves or (self._poked and self._running()))

    def shutdown(self) -> None:
        began = time.monotonic()
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        backend, self.backend = self.backend, None
        if backend is not None:
            if backend.shutdown():  # it only answered lookups: no attempt can be in flight
                log.error("kvwire lookup backend reports attempts in flight at shutdown; not closing it")
            else:
                backend.close()
        pool = self.kv_cache_manager.block_pool if self.kv_cache_manager is not None else None
        pins = self._pins
        self._pins = {}
        if pool is not None:
            for blocks in pins.values():
                pool.free_blocks(blocks)
        holds = self.holds.end_all()
        log.info("kvwire: scheduler side shut down in %.3f s (%d pull pin set(s) and %d producer hold(s) returned)",
                 time.monotonic() - began, len(pins), holds)
