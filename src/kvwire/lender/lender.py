"""The :class:`Lender`: owns a paged KV cache, names its whole blocks, keeps them in a reuse tree,
and lends rows through leases. It never calls a backend.

One lock guards all bookkeeping, so the runtime thread and a serving thread may call it at once;
copies between pools and staging run outside the lock, on rows their lease pins.

Why one file of this size: every operation of the lender (lend, commit, evict, checkpoints,
staging) changes the same tables under one lock; the parts that own their state (``Request``,
``Lease``, ``ReuseTree``, ``StagingArea``) already live in files of their own beside it."""

from __future__ import annotations

import itertools
import logging
import math
import threading
from typing import Any

import numpy as np
import torch

from kvwire.contract import CacheKind, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View
from kvwire.lender.errors import CacheFull, LeaseError
from kvwire.lender.layout import CacheLayout, Scope
from kvwire.lender.lease import Lease, LeasedRows, LeaseKind
from kvwire.lender.names import NAME_BYTES, chain_names, name_keys, names_array, token_array
from kvwire.lender.request import Request
from kvwire.lender.staging import StagingArea
from kvwire.lender.tree import ReuseTree

__all__ = ["Lender"]

log = logging.getLogger(__name__)

#: How many blocks ``probe`` names between two looks at the tree: it stops hashing at a miss,
#: and never holds the lock while hashing.
_PROBE_CHUNK = 256


def _resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev} asked for, but torch sees no CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"a lender's pools live on 'cpu' or a 'cuda' device, got {dev}")
    return dev


class Lender:
    """A KV cache of one pool per layer group (``pool(group_id)``: ``[slots, *slot_shape]``, on
    ``device``), lent through leases.

    Promises: a pinned block is never evicted; a block's bytes change only through its owner
    request's model writes or a write lease's marked rows; every pin taken is returned by
    ``close_request`` or ``Lease.release``, so ``pins()`` is 0 when nothing is open or lent.

    STATE checkpoints (``checkpoints=True``, a layout with PAGED and STATE groups; see
    ``docs/hybrid.md``). Each block slot ``s`` gets a checkpoint row ``num_state_slots + s`` in
    every STATE pool, holding the state after that block; the request slots stay rows
    ``[0, num_state_slots)``. The lender keeps a checkpoint at *every block boundary* the model
    computes: a checkpoint costs one state row per block (small beside the block's K/V here),
    and in exchange every block prefix the tree holds is resumable, so a prompt that shares
    only part of a cached prefix resumes at the shared part's end, not at 0. A checkpoint lives
    and dies with its block (evicted together, cleared when the slot is reused), so it never
    outlives the prefix it stands for, and it is named like its block (the same name in every
    group; backends key rows by (group, name), N1.2). A transfer moves one checkpoint per STATE
    group, the one at the end of the prefix it moves (a STATE group lends one slot, V1.4), so a
    pulled prefix is resumable at its end; a block without a checkpoint resumes at the last
    checkpoint before it."""

    def __init__(self, layout: CacheLayout, scope: Scope, *, device: str | torch.device = "cpu",
                 staging_slots: int = 0, region_id_base: int = 0, checkpoints: bool = False) -> None:
        if not isinstance(layout, CacheLayout):
            raise TypeError(f"layout must be a CacheLayout, got {type(layout).__name__}")
        if not isinstance(scope, Scope):
            raise TypeError(f"scope must be a Scope, got {type(scope).__name__}")
        if staging_slots < 0:
            raise ValueError(f"staging_slots must be >= 0, got {staging_slots}")
        if region_id_base < 0:
            raise ValueError(f"region_id_base must be >= 0, got {region_id_base}")
        self.layout = layout
        self.scope = scope
        self.device = _resolve_device(device)
        self.scope_digest = scope.digest(layout)
        self._bt = layout.block_tokens
        self._lock = threading.Lock()
        self._on_cuda = self.device.type == "cuda"
        self.checkpoints = bool(checkpoints and layout.state_groups and layout.paged_groups)
        if checkpoints and not self.checkpoints:
            raise ValueError("checkpoints=True needs a layout with both PAGED and STATE groups")
        self._ckpt_base = layout.num_state_slots

        self._pools: list[torch.Tensor] = []
        regions: list[SlotRegion] = []
        kind = MemoryKind.DEVICE if self._on_cuda else MemoryKind.HOST
        index = self.device.index if self._on_cuda else None
        for i, g in enumerate(layout.groups):
            slots = layout.num_blocks if g.kind is CacheKind.PAGED else layout.num_state_slots
            if g.kind is CacheKind.STATE and self.checkpoints:
                slots += layout.num_blocks
            pool = torch.zeros((slots, *g.slot_shape), dtype=g.dtype, device=self.device)
            self._pools.append(pool)
            regions.append(SlotRegion(region_id_base + i, pool.data_ptr(), g.slot_bytes, slots, kind, index))
        self._pool_regions = tuple(regions)
        self._group_pos = {g.group_id: i for i, g in enumerate(layout.groups)}
        self._paged = [i for i, g in enumerate(layout.groups) if g.kind is CacheKind.PAGED]
        self._state = [i for i, g in enumerate(layout.groups) if g.kind is CacheKind.STATE]

        self._staging = (
            StagingArea(layout, staging_slots, self.device, region_id_base + len(layout.groups))
            if staging_slots else None
        )
        self._tree = ReuseTree(layout.num_blocks)
        self._state_refs = np.zeros(layout.num_state_slots, dtype=np.int64)
        #: per block slot: its checkpoint row holds the state after the block, in every STATE pool
        self._ckpt = np.zeros(layout.num_blocks, dtype=bool)
        self._ids = itertools.count()
        self._open_requests: dict[int, Request] = {}
        self._leases_open = 0
        self._leases_lent = 0
        self._rows_marked = 0
        self._probes = 0

    # -- memory ------------------------------------------------------------------------------

    def regions(self) -> tuple[SlotRegion, ...]:
        """One region per pool, in layout order, then one HOST staging region per group (when
        ``staging_slots > 0``). They stay valid for the lender's life."""
        staged = self._staging.regions if self._staging is not None else ()
        return self._pool_regions + staged

    def pool(self, group_id: int) -> torch.Tensor:
        """The group's pool, ``[slots, *slot_shape]``, contiguous: the model reads and writes a
        request's pages here (block ``i`` at ``block_table[i]``, state at ``state_slots``)."""
        try:
            return self._pools[self._group_pos[group_id]]
        except KeyError:
            raise KeyError(f"no layer group {group_id}; the layout has {list(self._group_pos)}") from None

    def staging(self, group_id: int) -> torch.Tensor:
        """The group's staging rows (host memory); raises if the lender has none."""
        if self._staging is None:
            raise LeaseError("this lender has no staging slots (build it with staging_slots > 0)")
        return self._staging.tensors[self._group_pos[group_id]]

    # -- names -------------------------------------------------------------------------------

    def names(self, tokens: object) -> np.ndarray:
        """``(whole_blocks, 32)`` uint8: the chained names of ``tokens``' whole blocks in this
        lender's scope (an incomplete last block has none)."""
        return names_array(chain_names(token_array(tokens), self._bt, self.scope_digest))

    def probe(self, tokens: object) -> int:
        """How many leading whole blocks of ``tokens`` the reuse tree holds now; pins nothing.
        Hashing stops shortly after the first miss."""
        toks = token_array(tokens)
        whole = toks.size // self._bt
        parent = self.scope_digest
        held = 0
        with self._lock:
            self._probes += 1
        for first in range(0, whole, _PROBE_CHUNK):
            keys = chain_names(toks, self._bt, parent, first, _PROBE_CHUNK)
            with self._lock:
                count = self._tree.holds(keys)
            held += count
            if count < len(keys):
                break
            parent = keys[-1]
        return held

    def probe_resumable(self, tokens: object) -> int:
        """How many leading whole blocks of ``tokens`` a request could resume after now: the
        held prefix, cut at its last block whose checkpoint the tree holds when the lender
        keeps checkpoints (else :meth:`probe`). Pins nothing."""
        if not self.checkpoints:
            return self.probe(tokens)
        keys = chain_names(token_array(tokens), self._bt, self.scope_digest)
        with self._lock:
            self._probes += 1
            get = self._tree.index.get
            last = 0
            for i, key in enumerate(keys):
                slot = get(key)
                if slot is None:
                    break
                if self._ckpt[slot]:
                    last = i + 1
            return last

    def probe_names(self, names: np.ndarray) -> int:
        """How many leading ``names`` (``(n, 32)`` uint8) the reuse tree holds now; pins nothing."""
        keys = name_keys(names)
        with self._lock:
            self._probes += 1
            return self._tree.holds(keys)

    # -- requests ----------------------------------------------------------------------------

    def open_request(self, tokens: object, *, max_new_tokens: int = 0) -> Request:
        """Opens a request for the prompt ``tokens`` with room for ``max_new_tokens`` more.

        Reuses the longest prefix the tree holds (pinning those blocks for the request), up to
        the last whole block before the prompt's last token, so the model always computes at
        least one token and never writes a shared block. A layout with STATE groups reuses
        nothing locally (the tree holds no state), unless the lender keeps checkpoints: then it
        reuses up to the last block whose checkpoint the tree holds, and copies that checkpoint
        into the request's state slots. Allocates the rest (evicting idle blocks LRU),
        or raises :class:`CacheFull` having changed nothing."""
        toks = token_array(tokens)
        if toks.size == 0:
            raise ValueError("a request needs at least one prompt token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        keys = chain_names(toks, self._bt, self.scope_digest)
        capacity = toks.size + max_new_tokens
        blocks = math.ceil(capacity / self._bt) if self._paged else 0
        if self.checkpoints:
            reusable = (toks.size - 1) // self._bt
        else:
            reusable = 0 if self._state or not self._paged else (toks.size - 1) // self._bt
        with self._lock:
            shared = self._tree.lookup(keys[:reusable])
            if self.checkpoints:
                # resume only at a block whose checkpoint the tree holds: the last such
                held = np.flatnonzero(self._ckpt[shared])
                shared = shared[: int(held[-1]) + 1] if held.size else shared[:0]
            state_slot = -1
            if self._state:
                free_state = np.flatnonzero(self._state_refs == 0)
                if free_state.size == 0:
                    raise CacheFull(
                        f"all {self.layout.num_state_slots} state slots are held by open requests or leases"
                    )
                state_slot = int(free_state[0])
            fresh = self._tree.allocate(blocks - shared.size, keep=shared)  # may raise, nothing done
            self._ckpt[fresh] = False  # a reused slot's old checkpoint stood for another block
            self._tree.pin(shared)
            if state_slot >= 0:
                self._state_refs[state_slot] += 1
            table = np.concatenate([shared, fresh]).astype(np.int64)
            rows = flags = None
            if self.checkpoints:
                rows, flags = self._ckpt_base + table, self._ckpt[shared]
                if shared.size:  # the request's state slot starts at its last reused checkpoint
                    for i in self._state:
                        pool = self._pools[i]
                        pool[state_slot] = pool[self._ckpt_base + int(shared[-1])]
            request = Request(
                next(self._ids), toks, capacity, self._bt, self.scope_digest, table,
                {self.layout.groups[i].group_id: state_slot for i in self._state},
                keys, len(self._paged), int(shared.size), rows, flags,
            )
            self._open_requests[request.request_id] = request
        log.debug("opened %r", request)
        return request

    def extend(self, request: Request, tokens: object) -> None:
        """Appends generated ``tokens`` to the request (within its ``max_new_tokens`` room) and
        names any block they complete, so ``commit`` can put those blocks in the tree."""
        new = token_array(tokens)
        with self._lock:
            self._check_open(request)
            request.extend(new)

    def commit(self, request: Request, upto_tokens: int, *, state_tokens: int | None = None,
               computed_from: int | None = None) -> None:
        """Declares the request's pages written for tokens ``[0, upto_tokens)`` (the model calls
        it after prefill): those whole blocks become valid, are named, and enter the reuse tree
        (fetched blocks included). A block whose name the tree already holds under another slot
        is not inserted again; the request pins the tree's block instead while it is open.
        STATE groups' checkpoint becomes ``state_tokens`` (default ``upto_tokens``): the token at
        which the model wrote the state. The model must not write a state slot that an unstaged
        read lease lends; a commit that would move such a state raises :class:`LeaseError`.
        With checkpoints kept, ``computed_from`` says the model computed ``[computed_from,
        upto_tokens)`` and wrote the checkpoint of each block it completed; other blocks keep
        only checkpoints that arrived whole. A committed block's checkpoint enters the tree with
        it."""
        checkpoint = upto_tokens if state_tokens is None else state_tokens
        with self._lock:
            self._check_open(request)
            request.check_commit(upto_tokens, checkpoint, bool(self._state))
            tree = self._tree
            table = request.block_table
            extra: list[int] = []
            first = request.committed_blocks
            request.committed(upto_tokens, checkpoint, (), computed_from)
            has = request.checkpointed
            for i in range(first, upto_tokens // self._bt):
                key = request.block_key(i)
                held = tree.index.get(key)
                slot = int(table[i])
                if held is None:
                    parent = tree.index.get(request.block_key(i - 1), -1) if i else -1
                    tree.insert(slot, key, i, parent)
                    self._ckpt[slot] = self.checkpoints and bool(has[i])
                elif held != slot:
                    tree.pin(np.array([held], dtype=np.int64))
                    extra.append(held)
                    if self.checkpoints and has[i] and not self._ckpt[held]:
                        # the tree's copy of this block has no checkpoint and no lease lends
                        # one for it; this request's equal state becomes its checkpoint
                        for g in self._state:
                            self._pools[g][self._ckpt_base + held] = self._pools[g][self._ckpt_base + slot]
                        self._ckpt[held] = True
            request.committed(upto_tokens, checkpoint, extra)

    def close_request(self, request: Request) -> None:
        """Drops the request's pins; idempotent. Its committed blocks stay in the tree (evictable
        once no lease pins them); the others are free once no lease pins them."""
        with self._lock:
            extra = request.close()
            if extra is None:
                return
            self._open_requests.pop(request.request_id, None)
            self._tree.unpin(request.block_table)
            self._tree.unpin(extra)
            for slot in set(request.state_slots.values()):
                self._state_refs[slot] -= 1
        log.debug("closed %r", request)

    def resume_bounds(self, request: Request) -> int:
        """The token from which the request may resume: the first block any PAGED group lacks
        stops it (a block counts when committed or marked arrived whole); a STATE group counts
        only at its exact checkpoint, which must not pass the paged bound (else 0)."""
        with self._lock:
            return request.resume_bounds(bool(self._paged), bool(self._state))

    # -- leases ------------------------------------------------------------------------------

    def lend_read(self, request: Request, *, staging: bool = False) -> Lease:
        """A lease over the request's committed whole blocks (and each STATE group's slot at its
        checkpoint), to publish. Rows carry names. With ``staging`` the view's rows are host
        staging rows, filled from the pool before the lease is ready."""
        with self._lock:
            self._check_open(request)
            count = request.committed_blocks
            slots = request.block_table[:count]
            names = request.names[:count]
            state_rows = []
            for i in self._state:
                gid = self.layout.groups[i].group_id
                point = request.checkpoint(gid)
                if point:
                    state_rows.append((i, gid, request.state_slots[gid], point, request.state_name(gid, point)))
            if state_rows:
                request.check_state_free(for_write=False)
            stage = self._take_staging(staging, count, bool(state_rows))
            self._tree.pin(slots)
            for *_, slot, _, _ in state_rows:
                self._state_refs[slot] += 1
            request.begin_read(bool(state_rows) and not staging)
            self._leases_open += 1
        return self._make_lease(LeaseKind.READ, request, slots, None, names, TokenRange(0, count * self._bt),
                                state_rows, stage, copy_in=True)

    def lend_write(self, request: Request, *, first_block: int | None = None, staging: bool = False) -> Lease:
        """A lease over the request's blocks ``first_block`` (default: the first not valid in
        every PAGED group) up to the prompt's last whole block, plus each STATE group's slot at
        that block's end, for a fetch. Rows carry names. Committed blocks are never lent for
        writing, nor rows another write lease holds. Lent in place (not staged), the rows stop
        being valid until marked, since a fetch may leave any bytes in rows it does not deliver;
        staged, the pool is untouched until ``mark_arrived`` copies the marked rows in. With
        checkpoints kept, the view holds only the PAGED rows: a checkpoint is fetched by
        :meth:`lend_checkpoint` once it is known which prefix arrived."""
        with self._lock:
            self._check_open(request)
            end = request.prompt_tokens // self._bt
            committed = request.committed_blocks
            if first_block is None:
                first_block = request.first_incomplete_block()
            if not committed <= first_block <= end:
                raise ValueError(
                    f"first_block must lie in [{committed}, {end}] for request {request.request_id} "
                    f"(blocks before {committed} are committed and shared; the prompt has {end} whole blocks), got {first_block}"
                )
            request.check_writable(first_block, end)
            state_rows = []
            point = end * self._bt
            if self._state and point > 0 and not self.checkpoints:
                for i in self._state:
                    gid = self.layout.groups[i].group_id
                    if request.checkpoint(gid) != point:
                        state_rows.append((i, gid, request.state_slots[gid], point, request.state_name(gid, point)))
                if state_rows:
                    request.check_state_free(for_write=True)
            index = np.arange(first_block, end, dtype=np.int64)
            slots = request.block_table[first_block:end]
            stage = self._take_staging(staging, index.size, bool(state_rows))
            self._tree.pin(slots)
            request.begin_write(first_block, end, [r[1] for r in state_rows], in_place=not staging)
            for *_, slot, _, _ in state_rows:
                self._state_refs[slot] += 1
            self._leases_open += 1
        return self._make_lease(LeaseKind.WRITE, request, slots, index, request.names[first_block:end],
                                TokenRange(first_block * self._bt, end * self._bt), state_rows, stage,
                                copy_in=False)

    def lend_names(self, names: np.ndarray, *, staging: bool = False, checkpoint: bool = False) -> Lease:
        """For serving a request-free pull (N2): looks ``names`` (``(n, 32)`` uint8) up in the
        tree, O(1) each, and pins the longest held leading run for the lease; a miss part way
        pins nothing past it. ``lease.found`` is that run's length (possibly 0); the view holds
        only those rows, of the PAGED groups. With ``checkpoint`` (to publish a prefix to a
        store), the view also holds each STATE group's row at the last checkpoint in that run,
        named like its block, when there is one."""
        keys = name_keys(names)
        with self._lock:
            slots = self._tree.lookup(keys)
            state_rows = []
            if checkpoint and self.checkpoints and slots.size:
                held = np.flatnonzero(self._ckpt[slots])
                if held.size:
                    last = int(held[-1])
                    slot = int(slots[last])
                    point = (int(self._tree.position[slot]) + 1) * self._bt
                    state_rows = [(i, self.layout.groups[i].group_id, self._ckpt_base + slot, point, keys[last])
                                  for i in self._state]
            stage = self._take_staging(staging, slots.size, bool(state_rows))
            self._tree.pin(slots)
            start = int(self._tree.position[slots[0]]) if slots.size else 0
            self._leases_open += 1
        found = np.asarray(names)[: slots.size] if isinstance(names, np.ndarray) else names_array(keys[: slots.size])
        tokens = TokenRange(start * self._bt, (start + slots.size) * self._bt)
        return self._make_lease(LeaseKind.NAMES, None, slots, None, found, tokens, state_rows, stage, copy_in=True,
                                checkpoint=0 if state_rows else None)

    def lend_checkpoint(self, request: Request, point: int, *, staging: bool = False) -> Lease:
        """A lease over each STATE group's checkpoint row at the block boundary ``point`` (the
        state after block ``point // block_tokens - 1``), for a fetch. The rows are named like
        that block (the same name as its PAGED rows; backends key by (group, name)) and cover
        ``TokenRange(0, point)``. Only a block of the request's own may be lent (not committed,
        hence not shared); until marked, it counts as having no checkpoint."""
        with self._lock:
            self._check_open(request)
            if point <= 0 or point % self._bt or point // self._bt > request.block_table.size:
                raise ValueError(f"a checkpoint lies at a block boundary in (0, {request.block_table.size * self._bt}],"
                                 f" got {point}")
            block = point // self._bt - 1
            if block >= len(request.names):
                raise ValueError(f"block {block} of request {request.request_id} has no name yet (not whole)")
            request.check_checkpoint_writable(block)
            slot = int(request.block_table[block])
            stage = self._take_staging(staging, 0, True)
            slots = np.array([slot], dtype=np.int64)
            self._tree.pin(slots)
            request.begin_checkpoint_write(block)
            self._leases_open += 1
        return self._make_checkpoint_lease(LeaseKind.WRITE, request, slots, request.block_key(block), point, stage,
                                           block, copy_in=False)

    def lend_checkpoint_names(self, names: np.ndarray, *, staging: bool = False) -> Lease:
        """For serving a pull of the STATE groups (N2): the checkpoint after the block named
        ``names[0]``, when the tree holds that block with its checkpoint; ``lease.found`` is 1
        then, else 0. The view holds one group per STATE group, in layout order: the checkpoint
        row, named ``names[0]``, or, when there is none, no row (a group of no rows cannot be a
        STATE group, V1.4, so such a group is labelled PAGED; which bytes move never depends on
        the kind, V1.6)."""
        keys = name_keys(names)
        with self._lock:
            slot = self._tree.index.get(keys[0]) if keys else None
            held = slot is not None and self.checkpoints and bool(self._ckpt[slot])
            slots = np.array([slot] if held else [], dtype=np.int64)
            stage = self._take_staging(staging, 0, True) if held else None
            self._tree.pin(slots)
            point = (int(self._tree.position[slot]) + 1) * self._bt if held else 0
            self._leases_open += 1
        return self._make_checkpoint_lease(LeaseKind.NAMES, None, slots, keys[0] if held else None, point, stage,
                                           0, copy_in=True)

    def _make_checkpoint_lease(self, kind: LeaseKind, request: Request | None, slots: np.ndarray,
                               name: bytes | None, point: int, stage: np.ndarray | None, block: int,
                               *, copy_in: bool) -> Lease:
        """A lease whose view holds only the STATE groups: each group's checkpoint row of block
        slot ``slots[0]`` (or, with no slot, a group of no rows). Gives everything back on failure."""
        state = tuple((k, self.layout.groups[i].group_id, self._ckpt_base + int(slots[0]))
                      for k, i in enumerate(self._state)) if slots.size else ()
        held = LeasedRows(slots, None, (), state, stage, block)
        try:
            rows: list[LayerGroupRows] = []
            for i in self._state:
                g = self.layout.groups[i]
                region = self._pool_regions[i] if stage is None else self._staging.regions[i]  # type: ignore[union-attr]
                if not slots.size:
                    rows.append(LayerGroupRows(g.group_id, CacheKind.PAGED, region, np.zeros(0, dtype=np.int64),
                                               TokenRange(0, 0), np.zeros((0, NAME_BYTES), dtype=np.uint8)))
                    continue
                row = self._ckpt_base + int(slots[0]) if stage is None else int(stage[0])
                assert name is not None
                rows.append(LayerGroupRows(g.group_id, CacheKind.STATE, region, np.array([row], dtype=np.int64),
                                           TokenRange(0, point), np.frombuffer(name, dtype=np.uint8).reshape(1, -1)))
            view = View(tuple(rows))
            event = None
            if copy_in and stage is not None:
                assert self._staging is not None
                source = np.array([self._ckpt_base + int(slots[0])], dtype=np.int64)
                event = self._staging.copy_in(self._pools, list(self._state), [source] * len(self._state),
                                              [stage[:1]] * len(self._state))
            elif self._on_cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
        except BaseException:
            self._give_back(kind, request, held)
            raise
        with self._lock:
            self._leases_lent += 1
        return Lease(self, kind, view, held, found=int(slots.size), request=request, event=event)

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request from open_request, got {type(request).__name__}")
        if request.closed:
            raise LeaseError(f"request {request.request_id} is closed")
        if self._open_requests.get(request.request_id) is not request:
            raise LeaseError(f"request {request.request_id} was not opened by this lender")

    def _take_staging(self, staging: bool, paged_rows: int, state_row: bool) -> np.ndarray | None:
        if not staging:
            return None
        if self._staging is None:
            raise LeaseError("staging=True, but this lender has no staging slots (build it with staging_slots > 0)")
        return self._staging.take(paged_rows + int(state_row))

    def _make_lease(self, kind: LeaseKind, request: Request | None, slots: np.ndarray, index: np.ndarray | None,
                    names: np.ndarray, tokens: TokenRange, state_rows: list[Any], stage: np.ndarray | None,
                    *, copy_in: bool, checkpoint: int | None = None) -> Lease:
        """Builds the view, groups in layout order (and, for a staged read, starts the pool ->
        staging copy); on any failure gives back everything the caller took, so no pin or
        staging row is lost."""
        by_group = {row[0]: row for row in state_rows}
        n = int(slots.size)
        paged_pos: list[int] = []
        state: list[tuple[int, int, int]] = []
        for i in range(len(self.layout.groups)):
            if i in by_group:
                state.append((len(paged_pos) + len(state), by_group[i][1], by_group[i][2]))
            elif self.layout.groups[i].kind is CacheKind.PAGED:
                paged_pos.append(len(paged_pos) + len(state))
        held = LeasedRows(slots, index, tuple(paged_pos), tuple(state), stage, checkpoint)
        try:
            staging = self._staging
            stage_paged = stage[:n] if stage is not None else slots
            stage_state = int(stage[n]) if stage is not None and state_rows else -1
            rows: list[LayerGroupRows] = []
            for i, g in enumerate(self.layout.groups):
                region = self._pool_regions[i] if stage is None else staging.regions[i]  # type: ignore[union-attr]
                if i in by_group:
                    _, gid, slot, point, name = by_group[i]
                    row = np.array([slot if stage is None else stage_state], dtype=np.int64)
                    rows.append(LayerGroupRows(gid, CacheKind.STATE, region, row, TokenRange(0, point),
                                               np.frombuffer(name, dtype=np.uint8).reshape(1, -1)))
                elif g.kind is CacheKind.PAGED:
                    rows.append(LayerGroupRows(g.group_id, CacheKind.PAGED, region, stage_paged, tokens, names))
            view = View(tuple(rows))
            event = None
            if copy_in and stage is not None:
                assert staging is not None
                groups = list(self._paged) + [r[0] for r in state_rows]
                sources = [slots] * len(self._paged) + [np.array([r[2]], dtype=np.int64) for r in state_rows]
                targets = [stage[:n]] * len(self._paged) + [stage[n:n + 1]] * len(state_rows)
                event = staging.copy_in(self._pools, groups, sources, targets)
            elif self._on_cuda:
                # The backend must not touch the rows before work already queued on them ends.
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.device))
        except BaseException:
            self._give_back(kind, request, held)
            raise
        with self._lock:
            self._leases_lent += 1
        return Lease(self, kind, view, held, found=n, request=request, event=event)

    # -- the LeaseOwner interface: called only by the leases this lender made ------------------

    def lease_marked(self, lease: Lease, masks: tuple[np.ndarray, ...]) -> None:
        """Makes a write lease's marked rows valid rows of its request; for a staged lease copies
        only those rows into the pool first. The lease's lock is held; the lender's is not."""
        request, held = lease.request, lease.rows
        assert request is not None
        if held.checkpoint is not None:
            self._checkpoint_marked(lease, request, masks)
            return
        assert held.block_index is not None
        n = lease.found
        paged_masks = [masks[k] for k in held.paged_pos]
        if held.stage_rows is not None and self._staging is not None:
            groups, slots, rows = [], [], []
            for k, i in enumerate(self._paged):
                hit = paged_masks[k]
                groups.append(i)
                slots.append(held.block_slots[hit])
                rows.append(held.stage_rows[:n][hit])
            for k, gid, slot in held.state:
                if masks[k][0]:
                    groups.append(self._group_pos[gid])
                    slots.append(np.array([slot], dtype=np.int64))
                    rows.append(held.stage_rows[n:n + 1])
            self._staging.copy_out(self._pools, groups, slots, rows)
        with self._lock:
            request.arrived([held.block_index[hit] for hit in paged_masks],
                            {gid: lease.view.groups[k].tokens.end for k, gid, _ in held.state if masks[k][0]})
            self._rows_marked += int(sum(int(np.count_nonzero(m)) for m in masks))

    def _checkpoint_marked(self, lease: Lease, request: Request, masks: tuple[np.ndarray, ...]) -> None:
        """A checkpoint write lease's masks: the checkpoint counts only when every STATE group's
        row arrived whole (a part of a state is no state)."""
        held = lease.rows
        whole = bool(masks) and all(bool(m.size and m[0]) for m in masks)
        if whole and held.stage_rows is not None and self._staging is not None:
            rows = [np.array([slot], dtype=np.int64) for _, _, slot in held.state]
            self._staging.copy_out(self._pools, list(self._state), rows, [held.stage_rows[:1]] * len(rows))
        with self._lock:
            if whole:
                assert held.checkpoint is not None
                request.checkpoint_arrived(held.checkpoint)
            self._rows_marked += int(sum(int(np.count_nonzero(m)) for m in masks))

    def lease_released(self, lease: Lease) -> None:
        """Gives back a lease's pins, staging rows and write claims. The lease's lock is held."""
        self._give_back(lease.kind, lease.request, lease.rows)

    def _give_back(self, kind: LeaseKind, request: Request | None, held: LeasedRows) -> None:
        with self._lock:
            self._tree.unpin(held.block_slots)
            if held.checkpoint is None:  # checkpoint rows are pinned through their block's slot
                for _, _, slot in held.state:
                    self._state_refs[slot] -= 1
            if held.stage_rows is not None and self._staging is not None:
                self._staging.give(held.stage_rows)
            if kind is LeaseKind.WRITE and request is not None and held.checkpoint is not None:
                request.end_checkpoint_write()
            elif kind is LeaseKind.WRITE and request is not None and held.block_index is not None:
                request.end_write(held.block_index, bool(held.state))
            elif kind is LeaseKind.READ and request is not None:
                request.end_read(bool(held.state) and held.stage_rows is None)
            self._leases_open -= 1

    # -- accounting --------------------------------------------------------------------------

    def pins(self) -> int:
        """Outstanding pins on block and state slots, by open requests and unreleased leases."""
        with self._lock:
            return int(self._tree.refs.sum()) + int(self._state_refs.sum())

    def stats(self) -> dict[str, int]:
        """A snapshot of counters, for metrics and tests."""
        with self._lock:
            tree = self._tree
            pinned = tree.refs > 0
            return {
                "blocks_total": tree.num_blocks,
                "blocks_free": int(np.count_nonzero(~pinned & ~tree.in_tree)),
                "blocks_committed": int(np.count_nonzero(tree.in_tree)),
                "blocks_pinned": int(np.count_nonzero(pinned)),
                "blocks_evictable": int(np.count_nonzero(~pinned & tree.in_tree)),
                "evictions": tree.evictions,
                "lookups": tree.lookups,
                "lookup_blocks": tree.lookup_blocks,
                "lookup_hits": tree.lookup_hits,
                "probes": self._probes,
                "state_slots_free": int(np.count_nonzero(self._state_refs == 0)),
                "checkpoints": int(np.count_nonzero(self._ckpt & tree.in_tree)),
                "staging_slots_free": self._staging.available() if self._staging is not None else 0,
                "requests_open": len(self._open_requests),
                "leases_open": self._leases_open,
                "leases_lent": self._leases_lent,
                "rows_marked": self._rows_marked,
                "pins": int(tree.refs.sum()) + int(self._state_refs.sum()),
            }

    def __repr__(self) -> str:
        return (f"Lender({self.scope.model_id!r}, device={self.device}, blocks={self.layout.num_blocks}, "
                f"block_tokens={self._bt}, groups={len(self.layout.groups)})")
