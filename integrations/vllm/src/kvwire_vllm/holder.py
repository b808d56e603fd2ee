"""How the connector moves a request's blocks, in one place: a *move* is one load, save or pull
reply of one request, driven through kvwire's holder loop (:mod:`kvwire.holding`) with the
worker's one shared :class:`Wakes`. A move only progresses when :meth:`Move.advance` looks at it
(never blocking), so the engine's step is held up only where vLLM needs memory back (a
preemption, a load inside the step, shutdown). Imports no vLLM.

- :class:`Direct`: the backend moves vLLM's own memory (host tensors, or CUDA tensors with a
  backend that declares DEVICE memory): one attempt over vLLM's blocks. On CUDA the submission
  waits for a *gate*, an event recorded on vLLM's stream when the move was made, so a publish
  never reads a block the forward is still computing and a fetch never writes a block a queued
  kernel still reads for its previous owner.
- :class:`StagedSave` and :class:`StagedLoad`: the backend moves pinned host slots
  (:class:`~kvwire_vllm.staging.StagingPool`), in chunks of at most :data:`CHUNK_BYTES` (as many
  slots as are free), so one chunk's copy on the device overlaps another's transfer; a chunk the
  backend answers "not now" (S3.1: its queue is full) keeps its slots and is submitted again at a
  later look. A save gathers each chunk into slots and publishes them once the gather's event
  completed; vLLM's
  blocks are free again as soon as every chunk is gathered, the publish then holds only slots. A
  load fetches each chunk into slots and, once the attempt concluded and quiesced, scatters the
  rows that arrived whole into vLLM's blocks; the load is over only when every scatter's event
  completed. A row that did not arrive, or a scatter that raised, leaves its blocks unwritten and
  reports them as load errors: a block is never half written and marked good.

**When the pool is exhausted**, a save *waits*: its remaining blocks stay queued (vLLM keeps them
allocated: the scheduler side delays freeing a finished request's blocks until its saves are
reported) and are gathered, in order, as slots come back, without holding up any step. A save is
*skipped* only when its blocks must go back: it waited past the connector's ``timeout_s``, the
request was preempted, or the worker shuts down; its blocks are then a later cache miss, never a
failed request. Waiting rather than skipping at once keeps a burst of saves (a long prompt's
blocks arrive in one step) from being dropped because the store is a little behind; the deadline
bounds how long vLLM's blocks stay held for it. A load is *deferred* the same way: it waits for
slots (the request stays in vLLM's waiting-for-remote-KV state) up to ``timeout_s``, after which
the blocks it could not fetch are load errors that vLLM recomputes.

Why one file of this size: the three kinds of move share one life cycle (advance, cancel, what
is whole, what holds vLLM's blocks) and one idle wait (:func:`doze`), which the worker core calls
without knowing which kind it holds."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvwire.contract import CacheKind, Hint, LayerGroupRows, TokenRange, View
from kvwire.contract.backend import Backend
from kvwire.contract.errors import SubmissionError, SubmissionRejected
from kvwire.contract.outcome import Cause
from kvwire.holding import QUIESCE_GRACE_S, Direction, Submission, WaitStatus, Wakes, submit, wait_any
from kvwire.observe import cause_label
from kvwire_vllm.plan import BlockPlan
from kvwire_vllm.staging import StagingPool

__all__ = ["Move", "Direct", "StagedSave", "StagedLoad", "StepLoad", "UNSENT", "doze", "QUIESCE_GRACE_S", "MISSING",
           "REFUSED", "NO_STAGING_SLOT", "COPY_FAILED"]

#: Load-error causes (metric labels) besides the contract's outcome causes (:class:`Cause`).
MISSING = "missing"  # the other end concluded without holding the block
REFUSED = "refused"  # the submission was refused (nothing escaped, S3)
NO_STAGING_SLOT = "no-staging-slot"  # no staging slot came free in time
COPY_FAILED = "copy-failed"  # a staging gather or scatter on the device raised

log = logging.getLogger(f"vllm.{__name__}")

Event = torch.cuda.Event


#: A staged move goes in chunks of at most this many bytes (at least one block): a chunk's gather
#: or scatter on the device overlaps the store's work on another, and a chunk's slots come back
#: as soon as it ends.
CHUNK_BYTES = 256 << 20


def _done(event: Event | None) -> bool:
    return event is None or bool(event.query())


class Move:
    """One request's load, save or reply. :attr:`ended`: nothing of it touches vLLM's memory or
    a staging slot any more (slots of an attempt that never quiesced are kept by the pool), and
    :meth:`whole` says per block whether it arrived (fetch) or is held (publish) in every group.
    :attr:`holds_blocks`: vLLM's blocks are still read or written for it."""

    req_id: str
    op: Direction
    block_ids: tuple[int, ...]
    started: float
    cancelled: bool = False
    deferred: bool = False  # waited for staging slots at least once

    def advance(self) -> None:
        raise NotImplementedError

    @property
    def ended(self) -> bool:
        raise NotImplementedError

    @property
    def holds_blocks(self) -> bool:
        return not self.ended

    @property
    def overdue(self) -> bool:
        """An attempt of it was cancelled and did not quiesce within the grace: its memory stays
        held until ``backend.shutdown()`` says otherwise."""
        return False

    def whole(self) -> np.ndarray:
        raise NotImplementedError

    def submissions(self) -> list[Submission]:
        """Its attempts that have not been seen done (to doze on)."""
        raise NotImplementedError

    def events(self) -> list[Event]:
        """Its copies queued on the device and not seen done."""
        return []

    def cancel(self) -> None:
        raise NotImplementedError

    def note(self) -> str:
        """What went wrong, for a log line ('' when nothing did)."""
        return ""

    def cause(self) -> str:
        """Why blocks of it did not arrive (or are not held), as a metric label: the outcome's
        cause (``deadline``, ``fault``, ``peer-gone``, ...), ``missing`` when the other end
        delivered and did not hold them, ``refused`` when a submission was refused,
        ``no-staging-slot`` when they got no slot in time."""
        return MISSING


class Direct(Move):
    """One attempt over vLLM's own memory, submitted once ``gate`` completed (at once without
    one). A refusal (S3: nothing escaped) ends it with no block moved."""

    def __init__(self, backend: Backend, op: Direction, req_id: str, view: View, block_ids: Sequence[int], hint: Hint,
                 wakes: Wakes, timeout_s: float, gate: Event | None = None) -> None:
        self.backend, self.op, self.req_id, self.view, self.hint = backend, op, req_id, view, hint
        self.block_ids = tuple(int(b) for b in block_ids)
        self.wakes, self.timeout_s, self.gate = wakes, timeout_s, gate
        self.started = time.perf_counter()
        self.deadline = time.monotonic() + timeout_s  # reset at submission
        self.sub: Submission | None = None
        self.refused: str | None = None
        self.cancelled = False
        self._seen = False
        self.advance()

    def _submit(self) -> None:
        try:
            self.sub = submit(self.backend, self.op, self.view, self.hint, wakes=self.wakes)
        except SubmissionError as exc:  # nothing escaped (S3)
            self.refused = f"{type(exc).__name__}: {exc}"
            log.warning("kvwire %s of request %s refused: %s", self.op.value, self.req_id, exc)
            return
        self.deadline = time.monotonic() + self.timeout_s

    def advance(self) -> None:
        if self.sub is None:
            if self.refused is None and not self.cancelled and _done(self.gate):
                self._submit()
            return
        if not self._seen:
            self._seen = self.sub.look(True)
            if not self._seen and not self.cancelled and time.monotonic() >= self.deadline:
                self.cancel()  # the backend's own deadline should have ended it (A8)

    def wait_gate(self) -> None:
        """Block until the gate's event completed (a preemption, a load inside the step), then
        submit: an event wait, never the whole device."""
        if self.sub is None and self.gate is not None and not self.cancelled:
            self.gate.synchronize()
        self.advance()

    @property
    def ended(self) -> bool:
        return self._seen or self.refused is not None or (self.cancelled and self.sub is None)

    @property
    def overdue(self) -> bool:
        return self.cancelled and not self.ended and time.monotonic() > self.deadline + QUIESCE_GRACE_S

    def whole(self) -> np.ndarray:
        outcome = self.sub.outcome if self.sub is not None else None
        if outcome is None or not outcome.masks:
            return np.zeros(len(self.block_ids), dtype=bool)
        return np.logical_and.reduce(np.stack(outcome.masks))

    def submissions(self) -> list[Submission]:
        return [self.sub] if self.sub is not None and not self._seen else []

    def events(self) -> list[Event]:
        return [self.gate] if self.sub is None and self.gate is not None and not self.cancelled else []

    def cancel(self) -> None:
        if not self.cancelled and self.sub is not None and self.sub.outcome is None:
            self.sub.cancel()
        self.cancelled = True

    def cause(self) -> str:
        if self.refused is not None:
            return REFUSED
        outcome = self.sub.outcome if self.sub is not None else None
        if outcome is None:
            return cause_label(Cause.HOLDER_CANCELLED) if self.cancelled else cause_label(None)
        return MISSING if outcome.is_delivered else cause_label(outcome.cause)

    def note(self) -> str:
        if self.refused is not None:
            return f"refused: {self.refused}"
        outcome = self.sub.outcome if self.sub is not None else None
        return repr(outcome) if outcome is not None else ("cancelled before submission" if self.cancelled else "")


class _Phase(enum.Enum):
    GATHER = "gather"    # a save's gather is queued on the device
    READY = "ready"      # its slots are ready; the backend said "not now" (S3.1): submitted again later
    MOVE = "move"        # the attempt is in flight
    SCATTER = "scatter"  # a load's scatter is queued on the device
    DONE = "done"


@dataclass(eq=False)
class _Chunk:
    """Blocks ``[at, at + len(ids))`` of a staged move and the slots they travel through."""

    at: int
    ids: np.ndarray
    slots: np.ndarray
    phase: _Phase
    event: Event | None = None
    sub: Submission | None = None
    deadline: float = 0.0
    cancelled: bool = False
    mask: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))


class _Staged(Move):
    """The chunks of a staged move, and what is still queued for slots."""

    def __init__(self, backend: Backend, op: Direction, req_id: str, pool: StagingPool, block_ids: Sequence[int],
                 names: np.ndarray, first_token: int, block_size: int, hint: Hint, wakes: Wakes, timeout_s: float,
                 whole_only: bool = False) -> None:
        self.backend, self.op, self.req_id, self.pool, self.hint, self.wakes = backend, op, req_id, pool, hint, wakes
        self.block_ids = tuple(int(b) for b in block_ids)
        self.ids = np.asarray(self.block_ids, dtype=np.int64)
        self.names, self.first_token, self.block_size, self.timeout_s = names, first_token, block_size, timeout_s
        self.whole_only = whole_only  # one attempt for every block or none (a pull's reply: one ticket)
        self.started = time.perf_counter()
        self.queue_deadline = time.monotonic() + timeout_s
        self.chunks: list[_Chunk] = []
        self.next = 0  # first block not yet given to a chunk
        self.mask = np.zeros(len(self.block_ids), dtype=bool)
        self.cancelled = False
        self.deferred = False
        self.skipped = 0  # blocks given up before they moved: no slots in time, cancelled
        self.submitted = False  # an attempt of it was taken (a reply's ticket is answered)
        self.failures: list[str] = []
        self.causes: list[str] = []  # metric labels of what went wrong, in order (cause())
        self.advance()

    def _view(self, chunk: _Chunk) -> View:
        n = chunk.ids.size
        tokens = TokenRange(self.first_token + chunk.at * self.block_size,
                            self.first_token + (chunk.at + n) * self.block_size)
        return View((LayerGroupRows(self.pool.region.region_id, CacheKind.PAGED, self.pool.region, chunk.slots,
                                    tokens, self.names[chunk.at:chunk.at + n]),))

    def _submit(self, chunk: _Chunk) -> None:
        try:
            chunk.sub = submit(self.backend, self.op, self._view(chunk), self.hint, wakes=self.wakes)
        except SubmissionRejected as exc:  # "not now" (its queue is full): again at a later look
            if not self.cancelled and time.monotonic() < self.queue_deadline:
                chunk.phase = _Phase.READY
                self.deferred = True
                return
            self.failures.append(f"refused: {type(exc).__name__}: {exc}")
            self.causes.append(REFUSED)
            self._finish(chunk)
            return
        except SubmissionError as exc:  # nothing escaped (S3): the slots are free at once
            self.failures.append(f"refused: {type(exc).__name__}: {exc}")
            self.causes.append(REFUSED)
            log.warning("kvwire staged %s of request %s refused: %s", self.op.value, self.req_id, exc)
            self._finish(chunk)
            return
        chunk.phase = _Phase.MOVE
        chunk.deadline = time.monotonic() + self.timeout_s
        self.submitted = True

    def _finish(self, chunk: _Chunk, keep: bool = False) -> None:
        """The chunk's slots go back (or stay kept); its mask is final."""
        if keep:
            self.pool.keep(chunk.slots)
        else:
            self.pool.give(chunk.slots)
        if chunk.mask.size:
            self.mask[chunk.at:chunk.at + chunk.ids.size] = chunk.mask
        chunk.phase = _Phase.DONE
        chunk.event = None

    def _look(self, chunk: _Chunk) -> bool:
        """The chunk's attempt concluded and quiesced (its mask taken); cancels it at its
        deadline and gives it up (slots kept) a grace after that."""
        assert chunk.sub is not None
        if chunk.sub.look(True):
            outcome = chunk.sub.outcome
            assert outcome is not None
            chunk.mask = np.array(outcome.masks[0], dtype=bool) if outcome.masks else np.zeros(chunk.ids.size, bool)
            if outcome.reason:
                self.failures.append(outcome.reason)
            if not chunk.mask.all():
                self.causes.append(MISSING if outcome.is_delivered else cause_label(outcome.cause))
            return True
        now = time.monotonic()
        if now >= chunk.deadline and not chunk.cancelled:
            chunk.sub.cancel()
            chunk.cancelled = True
        elif chunk.cancelled and now > chunk.deadline + QUIESCE_GRACE_S:
            log.error("kvwire staged %s of request %s did not quiesce %.0f s after its deadline; its %d staging "
                      "slot(s) stay out of use until the backend shuts down", self.op.value, self.req_id,
                      QUIESCE_GRACE_S, chunk.slots.size)
            self.failures.append("an attempt never quiesced")
            self.causes.append(cause_label(Cause.DEADLINE))
            self._finish(chunk, keep=True)
        return False

    def advance(self) -> None:
        for chunk in self.chunks:
            if chunk.phase is not _Phase.DONE:
                self._step(chunk)
        self.chunks = [c for c in self.chunks if c.phase is not _Phase.DONE]
        if self.queued and (self.cancelled or time.monotonic() >= self.queue_deadline):
            self.give_up_queued()
        while self.queued:
            left = self.queued
            if self.whole_only:
                want = left if self.pool.free >= left else 0
            else:  # chunks, so one chunk's copy on the device overlaps another's transfer
                want = min(left, max(1, CHUNK_BYTES // self.pool.region.slot_bytes))
            slots = self.pool.take(want)
            if not slots.size:
                self.deferred = True
                return
            chunk = _Chunk(self.next, self.ids[self.next:self.next + slots.size], slots, _Phase.MOVE)
            self.next += slots.size
            self.chunks.append(chunk)
            self._start(chunk)
            if chunk.phase is _Phase.READY:
                break  # the backend takes no more now
        self.chunks = [c for c in self.chunks if c.phase is not _Phase.DONE]

    def _start(self, chunk: _Chunk) -> None:
        raise NotImplementedError

    def _step(self, chunk: _Chunk) -> None:
        raise NotImplementedError

    @property
    def queued(self) -> int:
        return len(self.block_ids) - self.next

    @property
    def ended(self) -> bool:
        return self.queued == 0 and not self.chunks

    def whole(self) -> np.ndarray:
        return self.mask.copy()

    def submissions(self) -> list[Submission]:
        return [c.sub for c in self.chunks if c.phase is _Phase.MOVE and c.sub is not None]

    def events(self) -> list[Event]:
        return [c.event for c in self.chunks if c.event is not None]

    def give_up_queued(self) -> None:
        """Blocks still waiting for slots are given up (skipped; for a load, load errors)."""
        self.skipped += self.queued
        self.next = len(self.block_ids)

    def cancel(self) -> None:
        """Queued blocks are given up; attempts in flight are cancelled, and what they deliver
        is not copied on; copies already on the device complete (they are short, and a scatter
        that completed wrote whole blocks)."""
        self.cancelled = True
        for chunk in self.chunks:
            if chunk.phase is _Phase.MOVE and chunk.sub is not None and chunk.sub.outcome is None and \
                    not chunk.cancelled:
                chunk.sub.cancel()
                chunk.cancelled = True
        self.advance()

    def cause(self) -> str:
        if self.causes:
            return self.causes[0]
        return NO_STAGING_SLOT if self.skipped else MISSING

    def note(self) -> str:
        parts = list(dict.fromkeys(self.failures))[:3]
        if self.skipped:
            parts.append(f"{self.skipped} block(s) got no staging slot in time or were given up")
        return "; ".join(parts)


class StagedSave(_Staged):
    """A save (or a pull's reply, ``whole_only``) through staging slots: gather, then publish."""

    def _start(self, chunk: _Chunk) -> None:
        try:
            chunk.event = self.pool.gather(chunk.ids, chunk.slots)
        except (ValueError, TypeError, RuntimeError) as exc:  # copied nothing (blockcopy checks first)
            self.failures.append(f"gather failed: {exc}")
            self.causes.append(COPY_FAILED)
            log.error("kvwire staged save of request %s: gather failed: %s", self.req_id, exc)
            self._finish(chunk)
            return
        chunk.phase = _Phase.GATHER
        self._step(chunk)

    def _step(self, chunk: _Chunk) -> None:
        if chunk.phase is _Phase.GATHER:
            if not _done(chunk.event):
                return
            chunk.event = None
            chunk.phase = _Phase.READY
        if chunk.phase is _Phase.READY:
            if self.cancelled:
                self._finish(chunk)
                return
            self._submit(chunk)
        if chunk.phase is _Phase.MOVE and self._look(chunk):
            self._finish(chunk)

    @property
    def holds_blocks(self) -> bool:
        return self.queued > 0 or any(c.phase is _Phase.GATHER for c in self.chunks)

    def wait_gathers(self) -> None:
        """Block until every queued gather completed (an event wait, never the whole device)."""
        for chunk in self.chunks:
            if chunk.phase is _Phase.GATHER and chunk.event is not None:
                chunk.event.synchronize()
        self.advance()


class StagedLoad(_Staged):
    """A load through staging slots: fetch, then scatter what arrived."""

    def _start(self, chunk: _Chunk) -> None:
        self._submit(chunk)

    def _step(self, chunk: _Chunk) -> None:
        if chunk.phase is _Phase.READY:
            if self.cancelled:
                self._finish(chunk)
                return
            self._submit(chunk)
        if chunk.phase is _Phase.MOVE:
            if not self._look(chunk):
                return
            arrived = np.flatnonzero(chunk.mask)
            if self.cancelled:  # an aborted request, or shutdown: its blocks are not written
                chunk.mask = np.zeros(chunk.ids.size, dtype=bool)
                arrived = arrived[:0]
            if not arrived.size:
                self._finish(chunk)
                return
            try:
                chunk.event = self.pool.scatter(chunk.slots[arrived], chunk.ids[arrived])
            except (ValueError, TypeError, RuntimeError) as exc:  # a scatter that raised wrote no block
                self.failures.append(f"scatter failed: {exc}")
                self.causes.append(COPY_FAILED)
                log.error("kvwire staged load of request %s: scatter failed: %s", self.req_id, exc)
                chunk.mask = np.zeros(chunk.ids.size, dtype=bool)
                self._finish(chunk)
                return
            chunk.phase = _Phase.SCATTER
        if chunk.phase is _Phase.SCATTER and _done(chunk.event):
            self._finish(chunk)


UNSENT = object()  # a layer of a load inside the step not submitted yet


class StepLoad:
    """A load inside this step (``load_async`` false): per layer its move (:data:`UNSENT` until
    submitted) and whether it ended once waited for. A pull from a peer, and a staged load, is one
    move of every layer (a serving engine answers pulls of all its layers only; a staging slot is
    a whole row)."""

    __slots__ = ("plan", "transfers", "waited", "started", "gate")

    def __init__(self, plan: BlockPlan, attempts: int, gate: Event | None = None) -> None:
        self.plan = plan
        self.gate = gate  # after vLLM's work queued before the step: every layer's fetch waits for it
        self.transfers: list[object] = [UNSENT] * attempts
        self.waited: list[bool | None] = [None] * attempts
        self.started = time.perf_counter()


#: How often a doze looks at the device copies queued beside attempts in flight: the device sends
#: no wake when a copy ends, and the next chunk's submission waits for it.
EVENT_LOOK_S = 0.0005


def doze(moves: Sequence[Move], seconds: float) -> None:
    """Sleep until one of ``moves``' attempts is done (woken by the backend), one of their
    device copies completed, or ``seconds`` pass; with only device copies pending, until the
    first of them completed (a copy of a few blocks, queued on an idle device: an event wait,
    never the whole device)."""
    subs = [s for m in moves for s in m.submissions()]
    events = [e for m in moves for e in m.events()]
    if subs and events:
        deadline = time.monotonic() + seconds
        while not any(map(_done, events)):
            left = deadline - time.monotonic()
            if left <= 0 or any(w.status is not WaitStatus.EXPIRED for w in wait_any(subs, min(EVENT_LOOK_S, left))):
                return
        return
    if subs:
        wait_any(subs, seconds)
        return
    if events:
        events[0].synchronize()
