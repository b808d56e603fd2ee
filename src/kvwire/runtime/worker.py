"""The lease holder: a :class:`Worker` drives a lender and a backend exactly as the contract says
— lend, wait for the view, submit it as it stands, wait for quiescence, mark, release — and
offers ``generate``, ``publish``, ``pull`` and ``transceiver_state``; a worker whose backend
declares ``serve-pulls`` answers other workers' pulls from its reuse tree.

Why one file of this size: a ``Worker`` is one lease holder whose pull, publish and serving loop
share its lender, backend and lock; the holder loop (``holding``), the state codec (``state``)
and the model (``model``) live beside it."""

from __future__ import annotations

import enum
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvwire import waiting
from kvwire.blob.keys import check_namespace
from kvwire.contract import Attempt, Backend, CacheKind, Hint, InvalidSubmission, MemoryKind, Outcome, View
from kvwire.contract.capabilities import OFFER_PULLS, SERVE_PULLS, OtherEnd
from kvwire.contract.errors import SubmissionError
from kvwire.contract.outcome import Cause
from kvwire.contract.serving import OffersPulls, PullRequest, ServesPulls
from kvwire.holding import (
    QUIESCE_GRACE_S,
    AtDeadline,
    Cancel,
    Direction,
    PullGuard,
    Reply,
    ServingLoop,
    StateError,
    Submission,
    TransceiverState,
    WaitStatus,
    drain,
    sign_pull,
    submit,
    wait,
)
from kvwire.lender import Lease, Lender, Scope
from kvwire.observe import Observers, cause_label
from kvwire.registry import BackendConfig, ConfigError, load_config
from kvwire.runtime.model import ModelConfig, TinyTransformer

__all__ = ["Worker", "Cancel", "Generation", "PromptOffer", "TransferResult", "TransferStatus", "TransferError", "StateError",
           "WorkerClosed"]

log = logging.getLogger(__name__)

class TransferStatus(enum.StrEnum):
    """How a ``pull`` or ``publish`` ended: its outcome's status, or ``SKIPPED`` when nothing
    needed to move. A ``str`` enum, so code that compared the former strings keeps working."""

    DELIVERED = "delivered"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"

    @classmethod
    def of(cls, outcome: Outcome) -> TransferStatus:
        return cls(outcome.status.value)


class TransferError(RuntimeError):
    """A transfer could not be submitted, or its attempt never quiesced; the message says why."""


class WorkerClosed(TransferError):
    """The worker was closed: it generates, moves and hands out nothing more."""


@dataclass(frozen=True, slots=True)
class Generation:
    """What ``generate`` produced: the new tokens, how many prompt tokens came from the cache,
    the logits after the prompt, and the seconds spent on the prompt."""

    tokens: tuple[int, ...]
    cached_tokens: int
    logits: torch.Tensor
    prefill_seconds: float


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What a ``pull`` or ``publish`` did. ``cached_tokens`` is how many leading prompt tokens
    this worker now holds (for a hybrid model: the checkpoint a request resumes from);
    ``status`` is the outcome's, or ``SKIPPED`` when nothing needed to move. ``state_rows_moved``
    counts the STATE rows (checkpoints, one per STATE group) that moved whole."""

    status: TransferStatus
    cached_tokens: int
    blocks_wanted: int
    blocks_moved: int
    blocks_skipped: int
    bytes_moved: int
    seconds: float
    reason: str | None = None
    state_rows_moved: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _Counters:
    submissions: int = 0
    rows_delivered: int = 0
    rows_missed: int = 0
    bytes_moved: int = 0
    pulls_served: int = 0
    pulls_declined: int = 0
    deadline_expiries: int = 0
    #: outcomes that did not deliver, by cause (``"unspecified"`` from a contract 1.0 backend)
    causes: dict[str, int] = field(default_factory=dict)
    refusals: int = 0


@dataclass(frozen=True)
class PromptOffer:
    """A standing offer made by :meth:`Worker.offer`: how many blocks it holds, and its end."""

    blocks: int
    attempt: Attempt | None = field(repr=False)
    worker: Worker = field(repr=False)

    def withdraw(self) -> None:
        """End the offer now (idempotent; nothing to do for an offer of no block); its pins come
        back once its answers in flight have stopped reading the rows."""
        if self.attempt is not None:
            self.worker._withdraw(self.attempt)

    @property
    def ended(self) -> bool:
        """Whether the offer has concluded (run out or withdrawn)."""
        if self.attempt is None:
            return True
        with self.worker._lock:  # B2: one call sequence into the backend
            return self.attempt.poll() is not None


class Worker:
    """One inference worker: a tiny model, its paged cache (a lender), and a backend chosen by
    configuration. Thread-safe: calls into the backend are serialized (B2).

    Arguments are checked before anything is lent or submitted: a prompt is a 1-D sequence of
    integer token ids below the model's vocabulary, a timeout a finite number of seconds > 0, a
    namespace one the stores accept (:func:`kvwire.blob.keys.check_namespace`); anything else is
    a ``ValueError`` or ``TypeError`` naming it. After :meth:`close`, every method that generates,
    moves or describes the cache to others raises :class:`WorkerClosed`; ``close``, ``pins``,
    ``describe`` and ``wait_served`` still answer, to check what the worker left.

    A transfer whose attempt did not quiesce within its deadline and grace raises
    :class:`TransferError` and keeps its lease (the backend may still touch the rows); the worker
    returns that lease at its first call after the attempt has quiesced (``pins`` counts as one)."""

    def __init__(
        self,
        model: ModelConfig | None = None,
        *,
        config: BackendConfig | None = None,
        backend: str | None = None,
        options: Mapping[str, Any] | None = None,
        num_blocks: int = 512,
        staging_slots: int | None = None,
        device: str | torch.device = "cpu",
        tenant_salt: bytes = b"",
        name: str | None = None,
        timeout_s: float | None = None,
        pull_secret: bytes | str | None = None,
        allowed_peers: Sequence[str] | None = None,
        observers: Sequence[object] = (),
        instance: Backend | None = None,
    ) -> None:
        if config is None:
            config = load_config(backend=backend, validate=False)
            if options:
                config = BackendConfig(config.name, {**config.options, **options}, config.source, config.worker)
        self.config = config
        settings = _worker_settings(config.worker)
        self.name = name if name is not None else settings.get("name", "worker")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a worker's name is a non-empty str, got {self.name!r}")
        self.model_config = model or ModelConfig()
        self.device = torch.device(device)
        self.timeout_s = _seconds("timeout_s", timeout_s if timeout_s is not None else settings.get("timeout_s", 30.0))
        secret = pull_secret if pull_secret is not None else settings.get("pull_secret")
        self._secret = secret.encode() if isinstance(secret, str) else secret
        allowed = allowed_peers if allowed_peers is not None else settings.get("allowed_peers")
        self.guard = PullGuard(self._secret, None if allowed is None else frozenset(allowed))
        self.observers = Observers(*observers)
        self.plugin = config.plugin()
        # ``instance``: a backend built by the caller (fault injection, embedding) that stands
        # for the configured plugin; the worker owns it from here on.
        self.backend: Backend = instance if instance is not None else config.build()
        try:
            self._build(num_blocks, staging_slots, tenant_salt)
        except BaseException:
            self.backend.close()  # the worker's own: nobody else would close its threads, files, sockets
            raise

    def _build(self, num_blocks: int, staging_slots: int | None, tenant_salt: bytes) -> None:
        """The rest of the constructor, once the backend exists: model, cache, registration, serving."""
        self.capabilities = self.backend.capabilities()
        self.model = TinyTransformer(self.model_config, self.device)
        layout = self.model_config.layout(num_blocks)
        pool_kind = MemoryKind.DEVICE if self.device.type == "cuda" else MemoryKind.HOST
        self.staged = pool_kind not in self.capabilities.memory_kinds
        if self.staged and staging_slots is None:
            staging_slots = num_blocks
        # A hybrid model's lender keeps a STATE checkpoint at every block boundary (docs/hybrid.md).
        self.lender = Lender(layout, Scope(self.model_config.model_id, tenant_salt), device=self.device,
                             staging_slots=staging_slots or 0,
                             checkpoints=bool(layout.state_groups and layout.paged_groups))
        self._pools = {g.group_id: self.lender.pool(g.group_id) for g in layout.groups}
        pools = len(layout.groups)
        regions = self.lender.regions()[pools:] if self.staged else self.lender.regions()[:pools]
        self._lock = threading.RLock()  # B2: one call sequence into the backend
        # Leases whose memory the backend may still touch: with the attempt that did not quiesce
        # in time (returned once it has, A2), or with None after a submission raised (S4.2: kept
        # until shutdown() is empty).
        self._kept: list[tuple[Attempt | None, Lease]] = []
        self.counters = _Counters()
        self._registration = self.backend.register_regions(regions)
        self._tree_seen = (0, 0)  # (committed blocks, evictions) last announced
        self._closed = False
        self._serving: threading.Thread | None = None
        # Answers to pulls and standing offers (O1), each with the lease pinning its rows.
        self._loop: ServingLoop[Lease] | None = None
        self.pull_filter: Callable[[PullRequest], str | None] | None = None
        if SERVE_PULLS in self.capabilities.protocols and isinstance(self.backend, ServesPulls):
            self._loop = ServingLoop(self.backend, self._pin, Lease.release, fit=self._fit, lock=self._lock,
                                     on_declined=self._declined, on_served=self._served_pull)
            self._loop.serve()
            self._serving = threading.Thread(target=self._serve_loop, args=(self._loop,),
                                             name=f"kvwire-serve-{self.name}", daemon=True)
            self._serving.start()

    # --- lifecycle --------------------------------------------------------------------------

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop serving, shut the backend down until no attempt can touch memory, then release
        every lease it kept and close the registration. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.wakes.nudge()
        if self._serving is not None:
            waiting.join(self._serving, timeout_s)
        pending = drain(self.backend, timeout_s, lock=self._lock,
                        release=(self._release_held, self._registration.close))
        if pending:
            log.error("%s: %d attempt(s) never quiesced; their leases stay held", self.name, len(pending))

    def _release_held(self) -> None:
        """Once ``shutdown()`` returned the empty set: every lease still held comes back."""
        if self._loop is not None:
            self._loop.release_all()
        for _, lease in self._kept:
            lease.release()
        self._kept.clear()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the model ----------------------------------------------------------------------------

    def generate(self, prompt: Sequence[int] | np.ndarray, max_tokens: int = 1) -> Generation:
        """Greedy generation. Leading whole blocks this cache holds (computed here earlier or
        pulled) are reused and not recomputed; ``cached_tokens`` says how many."""
        self._check_open()
        self._return_kept()
        tokens = self._tokens(prompt)
        if tokens.size == 0:
            raise ValueError("prompt must be a non-empty 1-D sequence of token ids")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral):
            raise TypeError(f"max_tokens must be an int, got {type(max_tokens).__name__} {max_tokens!r}")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        max_tokens = int(max_tokens)
        request = self.lender.open_request(tokens, max_new_tokens=max_tokens)
        try:
            cached = int(request.cached_tokens)
            start = min(cached, len(tokens) - 1)
            began = time.perf_counter()
            logits = self.model.forward(request, self._pools, tokens, start, len(tokens), written=cached)
            prefill = time.perf_counter() - began
            self.lender.commit(request, len(tokens), computed_from=start)
            out: list[int] = []
            seq = tokens
            step = logits
            for i in range(max_tokens):
                nxt = int(step.argmax())
                out.append(nxt)
                if i + 1 == max_tokens:
                    break
                seq = np.append(seq, nxt)
                step = self.model.forward(request, self._pools, seq, len(seq) - 1, len(seq), written=len(seq) - 1)
            return Generation(tuple(out), cached, logits, prefill)
        finally:
            self.lender.close_request(request)
            self._announce_blocks()

    def cached_tokens(self, prompt: Sequence[int] | np.ndarray) -> int:
        """How many leading tokens of ``prompt`` this cache holds as whole blocks (for a hybrid
        model: up to the last block whose STATE checkpoint it holds, where a request resumes)."""
        self._check_open()
        return self.lender.probe_resumable(self._tokens(prompt)) * self.model_config.block_tokens

    # --- transceiver state --------------------------------------------------------------------

    def transceiver_state(self) -> bytes:
        """Opaque, versioned, bounded bytes another worker passes to ``pull``."""
        self._check_open()
        address = b""
        if self.capabilities.other_end is OtherEnd.PEER and isinstance(self.backend, ServesPulls):
            with self._lock:
                address = self.backend.address()
        namespace = self._namespace() if self.capabilities.other_end is OtherEnd.STORE else ""
        return TransceiverState(
            worker=self.name,
            backend=self.plugin.name,
            other_end=self.capabilities.other_end,
            address=address,
            namespace=namespace,
            model_id=self.model_config.model_id,
            layout_digest=self.lender.layout.digest(),
            scope_digest=self.lender.scope_digest,
            block_tokens=self.model_config.block_tokens,
        ).to_bytes()

    def _namespace(self) -> str:
        """The store namespace this worker's backend writes to (its option, or the default)."""
        return str(self.plugin.resolve(self.config.options).get("namespace", "default"))

    def _check_state(self, raw: bytes) -> TransceiverState:
        state = TransceiverState.from_bytes(raw)
        if state.backend != self.plugin.name:
            raise StateError(
                f"the source worker {state.worker!r} uses backend {state.backend!r}, this worker "
                f"{self.plugin.name!r}; both ends must use the same backend"
            )
        if state.other_end is not self.capabilities.other_end:
            raise StateError(f"the source's state says its other end is a {state.other_end.value}, but backend "
                             f"{self.plugin.name!r} reaches a {self.capabilities.other_end.value}")
        if state.block_tokens != self.model_config.block_tokens:
            raise StateError(f"the source's block_tokens {state.block_tokens} differs from this worker's "
                             f"{self.model_config.block_tokens}")
        if state.model_id != self.model_config.model_id:
            raise StateError(f"the source's model {state.model_id!r} differs from this worker's {self.model_config.model_id!r}")
        if state.layout_digest != self.lender.layout.digest():
            raise StateError("the source's cache layout differs from this worker's; its blocks cannot be used here")
        if state.scope_digest != self.lender.scope_digest:
            raise StateError(
                "the source's cache scope (model, layout, dtype or tenant) differs from this worker's: "
                "its block names can never match"
            )
        return state

    # --- transfers ----------------------------------------------------------------------------

    def pull(
        self,
        prompt: Sequence[int] | np.ndarray,
        source: bytes,
        *,
        timeout_s: float | None = None,
        cancel: Cancel | None = None,
    ) -> TransferResult:
        """Bring the prompt's whole blocks from ``source`` (a transceiver state): skip those held
        here, fetch the rest, commit what arrived. A partial prefix is a success. ``cancel``
        stops it early; whatever arrived whole before that is still committed.

        For a hybrid model a second fetch brings the STATE checkpoint at the end of the PAGED
        prefix that arrived (named like that prefix's last block); the pull commits up to the
        last checkpoint that arrived whole, or that this cache held already."""
        self._check_open()
        tokens = self._tokens(prompt)
        timeout = self._timeout(timeout_s)
        _check_cancel(cancel)
        state = self._check_state(source)
        B = self.model_config.block_tokens
        wanted = len(tokens) // B
        resume_at = self._resume_block(len(tokens))
        held = self.lender.probe(tokens)
        resumable = self.lender.probe_resumable(tokens)
        began = time.perf_counter()
        if held >= wanted and resumable >= resume_at:
            return TransferResult(TransferStatus.SKIPPED, resumable * B, wanted, 0, held, 0, 0.0)
        request = self.lender.open_request(tokens[: wanted * B])
        try:
            skipped = int(request.cached_tokens) // B
            lease = self.lender.lend_write(request, staging=self.staged)
            outcome = self._fetch(lease, state, timeout, cancel)
            moved = _whole_blocks(outcome, lease.view)
            nbytes = _bytes_moved(outcome, lease.view)
            status, reason, state_rows = TransferStatus.of(outcome), outcome.reason, 0
            arrived = request.first_incomplete_block()
            target = min(arrived, resume_at)  # where a request of this prompt resumes
            if (self.lender.checkpoints and outcome.is_delivered and target > skipped
                    and not request.checkpointed[target - 1]):
                left = max(timeout - (time.perf_counter() - began), 1e-3)
                checkpoint = self.lender.lend_checkpoint(request, target * B, staging=self.staged)
                got = self._fetch(checkpoint, state, left, cancel)
                state_rows = got.rows_delivered
                nbytes += _bytes_moved(got, checkpoint.view)
                if not got.is_delivered:
                    status, reason = TransferStatus.of(got), got.reason
            bound = self.lender.resume_bounds(request)
            if self.lender.checkpoints and arrived:
                # Every block that arrived enters the tree (so a later pull skips it), each with
                # the checkpoint it has; a request resumes only at one. The state slot still
                # holds the state at the request's reused checkpoint.
                self.lender.commit(request, arrived * B, state_tokens=request.cached_tokens)
            elif bound:
                self.lender.commit(request, bound)
        finally:
            self.lender.close_request(request)
            self._announce_blocks()
        seconds = time.perf_counter() - began
        return TransferResult(status, bound, wanted, moved, skipped, nbytes, seconds, reason, state_rows)

    def _resume_block(self, prompt_tokens: int) -> int:
        """Blocks a request for a prompt this long reuses at most (it computes its last token):
        for a hybrid model, where the STATE checkpoint that a pull or publish moves lies."""
        return (prompt_tokens - 1) // self.model_config.block_tokens

    def _fetch(self, lease: Lease, state: TransceiverState, timeout: float, cancel: Cancel | None) -> Outcome:
        """One fetch of ``lease``'s view from the source ``state`` names (a peer, signed when
        this worker has a pull secret, or a store namespace)."""
        if state.other_end is OtherEnd.PEER:
            fields: dict[str, Any] = {"address": state.address}
            if self._secret is not None:
                view = lease.view
                names = view.groups[0].names
                assert names is not None  # the lender names every row it lends for a request
                fields["credentials"] = sign_pull(self._secret, self.name, tuple(g.group_id for g in view.groups),
                                                  names)
            hint = Hint.of("peer", timeout_s=timeout, **fields)
        else:
            hint = Hint.of("store", timeout_s=timeout, namespace=state.namespace)
        try:
            return self._transfer(lease, Direction.FETCH, hint, timeout, cancel)
        except InvalidSubmission as exc:
            # The view is this lender's own; what the backend cannot use is the hint, built
            # from the state's fields: the state is at fault, and nothing escaped (S3).
            field_name = "address" if state.other_end is OtherEnd.PEER else "namespace"
            raise StateError(f"the source's transceiver state field {field_name!r} is unusable by backend "
                             f"{self.plugin.name!r}: {exc}") from exc

    def publish(self, prompt: Sequence[int] | np.ndarray, *, timeout_s: float | None = None,
                namespace: str | None = None, cancel: Cancel | None = None) -> TransferResult:
        """Offer the prompt's whole blocks this cache holds to a store backend; for a hybrid
        model, with the STATE checkpoint at the last block of that prefix that has one and, when
        that is not where a request of this prompt resumes, the checkpoint there too."""
        self._check_open()
        if self.capabilities.other_end is not OtherEnd.STORE or not self.capabilities.publish:
            raise TransferError(f"backend {self.plugin.name!r} does not publish to a store; peers pull instead")
        tokens = self._tokens(prompt)
        timeout = self._timeout(timeout_s)
        _check_cancel(cancel)
        if namespace is not None:  # given: used as it is, never replaced by the default
            check_namespace(namespace)
        B = self.model_config.block_tokens
        wanted = len(tokens) // B
        hint = Hint.of("store", timeout_s=timeout, namespace=self._namespace() if namespace is None else namespace)
        began = time.perf_counter()
        lease = self.lender.lend_names(self.lender.names(tokens), staging=self.staged,
                                       checkpoint=self.lender.checkpoints)
        held = lease.found
        outcome = self._transfer(lease, Direction.PUBLISH, hint, timeout, cancel)
        seconds = time.perf_counter() - began
        moved = _whole_blocks(outcome, lease.view)
        nbytes = _bytes_moved(outcome, lease.view)
        state_rows = _state_rows(outcome, lease.view)
        status, reason = TransferStatus.of(outcome), outcome.reason
        resume_at = min(self._resume_block(len(tokens)), held)
        sent = [g.tokens.end // B for g in lease.view.groups if g.kind is CacheKind.STATE]
        if self.lender.checkpoints and outcome.is_delivered and resume_at and resume_at not in sent:
            names = lease.view.groups[0].names
            assert names is not None
            extra = self.lender.lend_checkpoint_names(names[resume_at - 1:resume_at], staging=self.staged)
            if extra.found:
                left = max(timeout - (time.perf_counter() - began), 1e-3)
                again = Hint.of("store", timeout_s=left, namespace=self._namespace() if namespace is None else namespace)
                more = self._transfer(extra, Direction.PUBLISH, again, left, cancel)
                state_rows += _state_rows(more, extra.view)
                nbytes += _bytes_moved(more, extra.view)
                if not more.is_delivered:
                    status, reason = TransferStatus.of(more), more.reason
            else:
                extra.release()
            seconds = time.perf_counter() - began
        return TransferResult(status, held * B, wanted, moved, wanted - held, nbytes, seconds, reason, state_rows)

    def _transfer(self, lease: Lease, direction: Direction, hint: Hint, timeout: float,
                  cancel: Cancel | None = None) -> Outcome:
        """Lend → wait for the view → submit as it stands → wait for quiescence → mark →
        release, through the holder loop (``kvwire.holding``). Refusals release at once
        (S3); any other raise keeps the lease until the backend has shut down (S4, B3), and an
        attempt that did not quiesce in time keeps it until the attempt quiesces."""
        self._return_kept()
        try:
            if not lease.wait_ready(timeout):
                raise TransferError(f"{self.name}: staging copies did not complete within {timeout:g} s")
            began = time.perf_counter()
            try:
                with self._lock:
                    sub: Submission = submit(self.backend, direction, lease.view, hint)
                    self.counters.submissions += 1
            except SubmissionError as exc:
                self.counters.refusals += 1
                self.observers.announce("refused", worker=self.name, backend=self.plugin.name,
                                        direction=direction, reason=str(exc))
                raise
            except BaseException:
                self._keep(lease)
                lease = None  # type: ignore[assignment]
                raise
            # The backend concludes by its deadline (A8); the holder gives it a grace beyond
            # that, then cancels and gives it another grace to quiesce.
            waited = wait(sub, timeout + QUIESCE_GRACE_S, at_deadline=AtDeadline.CANCEL,
                          grace_s=QUIESCE_GRACE_S, cancel=cancel, lock=self._lock)
            if waited.status is WaitStatus.UNWOKEN:
                log.warning("%s: backend %s breaks W1: %s", self.name, self.plugin.name, waited.describe())
            if waited.status is WaitStatus.EXPIRED:
                if waited.keeps_lease:
                    self._keep(lease, sub.attempt)
                    lease = None  # type: ignore[assignment]
                kept = "; its lease is kept until the attempt quiesces" if waited.keeps_lease else ""
                raise TransferError(f"{self.name}: {waited.describe()}, waited up to "
                                    f"{timeout + 2 * QUIESCE_GRACE_S:g} s{kept}")
            outcome = waited.result()
            if direction is Direction.FETCH:
                lease.mark_arrived(outcome.masks)
            delivered = outcome.rows_delivered
            rows = sum(m.size for m in outcome.masks)
            nbytes = _bytes_moved(outcome, lease.view)
            self.counters.bytes_moved += nbytes
            paged = [g for g in lease.view.groups if g.kind is CacheKind.PAGED]
            self.observers.announce("transfer", worker=self.name, backend=self.plugin.name,
                                    direction=direction, rows=rows, delivered=delivered, nbytes=nbytes,
                                    seconds=time.perf_counter() - began, status=outcome.status,
                                    reason=outcome.reason, cause=outcome.cause,
                                    blocks=paged[0].rows if paged else 0,
                                    whole=_whole_blocks(outcome, lease.view))
            self.counters.rows_delivered += delivered
            self.counters.rows_missed += sum(m.size for m in outcome.masks) - delivered
            if not outcome.is_delivered:
                cause = cause_label(outcome.cause)
                self.counters.causes[cause] = self.counters.causes.get(cause, 0) + 1
            if outcome.cause is Cause.DEADLINE:
                self.counters.deadline_expiries += 1
            return outcome
        finally:
            if lease is not None:
                lease.release()

    # --- serving pulls ------------------------------------------------------------------------

    def _serve_loop(self, loop: ServingLoop[Lease]) -> None:
        wakes = loop.wakes
        while not self._closed:
            seen, nudged = wakes.count, wakes.nudges  # before the round: a wake during it is not missed
            try:
                self._return_kept()
                loop.step()
            except Exception:  # serving must outlive any one bad request
                log.exception("%s: serving a pull failed", self.name)
            while not self._closed and not wakes.wait_beyond(seen, time.monotonic() + 3600, nudged):
                pass

    def offer(self, prompt: Sequence[int] | np.ndarray, *, timeout_s: float | None = None) -> PromptOffer:
        """Pin the leading whole blocks of ``prompt`` this cache holds, and let the backend answer
        pulls of them on its own thread, without this worker's serving loop (a *standing offer*,
        contract O1), for ``timeout_s`` (default: the worker's timeout) or until withdrawn; the
        pins come back once the offer has ended. The returned :class:`PromptOffer` says how many
        blocks stand offered (0: none held, nothing offered) and withdraws it. A pull of more
        than the offer holds is answered as before, by the serving loop. Each standing offer
        takes one of the backend's ``max_in_flight`` slots; when none is free this raises
        ``SubmissionRejected`` and nothing is pinned.

        An offer answers any requester that names its blocks, so a worker that checks pull
        credentials (``pull_secret``, ``allowed_peers``) or filters pulls cannot offer."""
        self._check_open()
        if OFFER_PULLS not in self.capabilities.protocols or not isinstance(self.backend, OffersPulls):
            raise TransferError(f"backend {self.plugin.name!r} does not declare {OFFER_PULLS!r}: pulls of it are "
                                "answered by the serving loop only")
        if self._secret is not None or self.guard.allowed is not None or self.pull_filter is not None:
            raise TransferError("this worker checks each pull (pull_secret, allowed_peers or pull_filter); a standing "
                                "offer would answer any requester that names its blocks (contract O1.11)")
        tokens = self._tokens(prompt)
        offer_s = self._timeout(timeout_s)
        self._return_kept()
        lease = self.lender.lend_names(self.lender.names(tokens), staging=self.staged)
        if lease.found == 0:
            lease.release()
            return PromptOffer(0, None, self)
        loop = self._loop
        assert loop is not None  # O1.1: a backend that offers also serves pulls
        try:
            if not lease.wait_ready(self.timeout_s):
                raise TransferError("staging copies did not complete")
            with self._lock:
                attempt = self.backend.offer(lease.view, loop.wakes, offer_s)
        except (SubmissionError, TransferError):
            lease.release()  # S3: nothing escaped
            raise
        except BaseException:
            self._keep(lease)  # S4
            raise
        loop.track(Submission(Direction.PUBLISH, self.backend, lease.view, attempt, loop.wakes), lease)
        return PromptOffer(lease.found, attempt, self)

    def _withdraw(self, attempt: Attempt) -> None:
        with self._lock:
            attempt.cancel()
        if self._loop is not None:
            self._loop.wakes.nudge()  # the serving loop releases the pins once the offer quiesced

    def _fit(self, request: PullRequest) -> str | None:
        """Why this worker declines ``request`` (credentials, allowlist, filter, another layout),
        or ``None`` to answer it."""
        reason = self.guard.check(request)
        if reason is None and self.pull_filter is not None:
            reason = self.pull_filter(request)
        if reason is not None:
            return reason
        layout = self.lender.layout
        paged = [g.group_id for g in layout.paged_groups]
        states = [g.group_id for g in layout.state_groups] if self.lender.checkpoints else []
        wanted = list(request.groups)
        if wanted != paged and (not states or wanted != states):
            return (f"requested groups {wanted} differ from this cache's PAGED groups {paged}"
                    + (f" and from its STATE groups {states}" if states else ""))
        sizes = [self._pools[g][0].numel() * self._pools[g].element_size() for g in wanted]
        if list(request.slot_bytes) != sizes:
            return f"requested row sizes {list(request.slot_bytes)} differ from this cache's {sizes}"
        return None

    def _pin(self, request: PullRequest) -> tuple[View, Lease]:
        """A lease pinning the longest prefix of ``request``'s blocks this cache holds, its rows
        ready: of the PAGED groups, or the STATE checkpoint after the block ``names[0]`` names."""
        if list(request.groups) == [g.group_id for g in self.lender.layout.paged_groups]:
            lease = self.lender.lend_names(request.names, staging=self.staged)
        else:
            lease = self.lender.lend_checkpoint_names(request.names, staging=self.staged)
        try:
            if not lease.wait_ready(self.timeout_s):
                raise TransferError("staging copies did not complete")
        except BaseException:
            self._keep(lease)  # a staging copy may still touch its rows: kept until shutdown (S4)
            raise
        return lease.view, lease

    def _declined(self, request: PullRequest, reason: str, refused: bool) -> None:
        self.counters.pulls_declined += 1
        if refused:
            self.observers.announce("pull_declined", worker=self.name, backend=self.plugin.name,
                                    peer=request.peer, reason=reason)

    def _served_pull(self, reply: Reply[Lease]) -> None:
        assert reply.request is not None
        self.counters.pulls_served += 1
        self.observers.announce("pull_served", worker=self.name, backend=self.plugin.name, peer=reply.request.peer,
                                requested=reply.request.blocks, served=reply.held.found)

    def _keep(self, lease: Lease, attempt: Attempt | None = None) -> None:
        """Keep ``lease``: its rows may still be touched by ``attempt`` (until it quiesces) or,
        with no attempt, by a submission that raised (until the backend has shut down, S4.2)."""
        with self._lock:
            self._kept.append((attempt, lease))

    def _return_kept(self) -> None:
        """Release every kept lease whose attempt has quiesced since it was kept: nothing acting
        for the backend touches its rows again (S2.1, A2.3, A2.4). The others stay kept."""
        if not self._kept:  # read unlocked: a lease kept meanwhile is looked at next time
            return
        quiet: list[Lease] = []
        with self._lock:  # B2: quiesced() is a call into the backend
            still: list[tuple[Attempt | None, Lease]] = []
            for attempt, lease in self._kept:
                if attempt is not None and attempt.quiesced():
                    quiet.append(lease)
                else:
                    still.append((attempt, lease))
            self._kept = still
        for lease in quiet:  # outside the backend's lock: a staged lease may wait for its copies
            lease.release()
        if quiet:
            log.info("%s: %d kept lease(s) returned, their attempts quiesced late", self.name, len(quiet))

    def _check_open(self) -> None:
        if self._closed:
            raise WorkerClosed(f"worker {self.name!r} is closed; make a new Worker")

    def _tokens(self, prompt: Sequence[int] | np.ndarray) -> np.ndarray:
        """``prompt`` as a 1-D int64 array of token ids this model knows; a ``ValueError`` naming
        what is wrong otherwise (floats are refused, not truncated; bools are not token ids)."""
        tokens = np.asarray(prompt)
        if tokens.ndim != 1:
            raise ValueError(f"prompt must be a 1-D sequence of token ids, got shape {tokens.shape}")
        if tokens.size and tokens.dtype.kind not in "iu":
            raise ValueError(f"prompt must hold integer token ids, got {tokens.dtype} values")
        tokens = tokens.astype(np.int64, copy=False)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.model_config.vocab):
            bad = tokens[(tokens < 0) | (tokens >= self.model_config.vocab)][0]
            raise ValueError(f"token ids must lie in [0, {self.model_config.vocab}); the prompt holds {bad}")
        return tokens

    def _timeout(self, timeout_s: float | None) -> float:
        """The worker's timeout, or ``timeout_s`` checked."""
        return self.timeout_s if timeout_s is None else _seconds("timeout_s", timeout_s)

    def _announce_blocks(self) -> None:
        """Tell observers how the reuse tree changed since the last time: blocks stored, evicted."""
        stats = self.lender.stats()
        committed, evictions = stats["blocks_committed"], stats["evictions"]
        seen_committed, seen_evictions = self._tree_seen
        evicted = evictions - seen_evictions
        stored = committed - seen_committed + evicted
        self._tree_seen = (committed, evictions)
        if stored or evicted:
            self.observers.announce("blocks", worker=self.name, stored=stored, evicted=evicted, pinned=stats["pins"])

    def wait_served(self, timeout_s: float = 5.0) -> bool:
        """Wait until every pull this worker answered has ended at its end too (the requester's
        Ack arrives after the requester's pull returned) and its pins are back; whether that
        happened within ``timeout_s``."""
        return self._loop.wait_answered(timeout_s) if self._loop is not None else True

    #: The former name of :meth:`wait_served`, kept so callers keep working.
    settle = wait_served

    def pins(self) -> int:
        """Blocks pinned in this worker's cache right now (0 when nothing is lent or served), after
        returning the kept leases whose late attempts have quiesced since."""
        self._return_kept()
        return self.lender.pins()

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backend": self.plugin.name,
            "capabilities": self.capabilities.summary(),
            "staged": self.staged,
            "pins": self.pins(),
            "counters": {k: dict(v) if isinstance(v, dict) else v for k, v in vars(self.counters).items()},
        }




def _seconds(what: str, value: object) -> float:
    """``value`` as seconds: a finite real number > 0 (not a bool, not a str); else an error naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__} {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {value!r}")
    return seconds


def _check_cancel(cancel: object) -> None:
    if cancel is not None and not isinstance(cancel, Cancel):
        raise TypeError(f"cancel must be a kvwire.runtime.Cancel or None, got {type(cancel).__name__}")


_WORKER_KEYS: dict[str, type | tuple[type, ...]] = {"name": str, "timeout_s": (int, float), "pull_secret": str, "allowed_peers": list}


def _worker_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[worker]`` table of a config file, validated."""
    out = {}
    for key, value in settings.items():
        if key not in _WORKER_KEYS:
            raise ConfigError(f"unknown key worker.{key}; allowed: " + ", ".join(f"worker.{k}" for k in _WORKER_KEYS))
        if not isinstance(value, _WORKER_KEYS[key]) or isinstance(value, bool):
            raise ConfigError(f"worker.{key} has the wrong type ({type(value).__name__})")
        if key == "allowed_peers" and not (isinstance(value, list) and all(isinstance(p, str) for p in value)):
            raise ConfigError("worker.allowed_peers must be a list of worker names")
        if key == "timeout_s":
            try:
                _seconds("worker.timeout_s", value)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if key == "name" and not value:
            raise ConfigError("worker.name must not be empty")
        out[key] = value
    return out


def _bytes_moved(outcome: Outcome, view: View) -> int:
    """Bytes of the rows whose bits are true."""
    return sum(int(np.count_nonzero(m)) * g.region.slot_bytes for m, g in zip(outcome.masks, view.groups, strict=True))


def _whole_blocks(outcome: Outcome, view: View) -> int:
    """Blocks whose row arrived in every PAGED group."""
    masks = [m for m, g in zip(outcome.masks, view.groups, strict=True) if g.kind is CacheKind.PAGED]
    if not masks:
        return 0
    return int(np.count_nonzero(np.logical_and.reduce(masks)))


def _state_rows(outcome: Outcome, view: View) -> int:
    """STATE rows that moved whole."""
    return sum(int(np.count_nonzero(m)) for m, g in zip(outcome.masks, view.groups, strict=True)
               if g.kind is CacheKind.STATE)
