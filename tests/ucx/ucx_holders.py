"""Test stand-ins for the lease holders on both ends of a pull, written against the contract and
the one public holder loop (``kvwire.holding``): a serving holder that answers pulls from
a dict "reuse tree" with pin counting, and a requesting holder that lends rows, fetches and
releases once the attempt quiesces. Both look at an attempt only after a wake: a lost wake fails
the test (``WaitStatus.UNWOKEN``) instead of being papered over by polling."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvwire.contract import (
    Attempt,
    CacheKind,
    Hint,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    SlotRegion,
    TokenRange,
    View,
)
from kvwire.contract.serving import PullRequest
from kvwire.holding import AtDeadline, Direction, ServingLoop, Submission, WaitStatus, submit, wait

BLOCK_TOKENS = 16


def block_names(count: int, prompt: str = "prompt", width: int = 32) -> list[bytes]:
    """Names that commit to the whole prefix, like a lender's: name i hashes names 0..i."""
    names, running = [], hashlib.sha256(prompt.encode())
    for i in range(count):
        running.update(i.to_bytes(4, "little"))
        names.append(running.copy().digest()[:width])
    return names


def row_pattern(name: bytes, group: int, slot_bytes: int) -> np.ndarray:
    """The bytes a serving end holds for block ``name`` of group ``group`` (independent oracle)."""
    seed = int.from_bytes(hashlib.sha256(name + group.to_bytes(4, "little")).digest()[:4], "little")
    return ((np.arange(slot_bytes, dtype=np.uint32) * 2654435761 + seed) >> 13).astype(np.uint8)


class Pool:
    """Registered host memory: one numpy array of ``slots`` rows per group."""

    def __init__(self, groups: Sequence[int], slots: int, slot_bytes: int, first_region_id: int = 0) -> None:
        self.group_ids = tuple(groups)
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.arrays = [np.zeros((slots, slot_bytes), dtype=np.uint8) for _ in self.group_ids]
        self.regions = [
            SlotRegion(first_region_id + i, a.ctypes.data, slot_bytes, slots, MemoryKind.HOST)
            for i, a in enumerate(self.arrays)
        ]

    def view(self, slots: Sequence[int], names: Sequence[bytes] | None, groups: Sequence[int] | None = None) -> View:
        """A view of ``slots`` in every group (or those of ``groups``, in that order)."""
        order = self.group_ids if groups is None else tuple(groups)
        slot_array = np.asarray(slots, dtype=np.int64)
        name_array = None
        if names is not None:
            name_array = (np.frombuffer(b"".join(names), dtype=np.uint8).reshape(len(names), -1)
                          if names else np.zeros((0, 32), dtype=np.uint8))
        rows = []
        for gid in order:
            i = self.group_ids.index(gid)
            rows.append(LayerGroupRows(gid, CacheKind.PAGED, self.regions[i], slot_array,
                                       TokenRange(0, len(slot_array) * BLOCK_TOKENS), name_array))
        return View(tuple(rows))


class ReuseTree:
    """name -> slot, with a pin count per slot. Pinning the prefix is all or nothing per block
    (a miss stops it); unpinning returns every pin. Thread-safe."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, int] = {}
        self._pins: dict[int, int] = {}
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)

    def insert(self, name: bytes, slot: int) -> None:
        with self._lock:
            self.blocks[name] = slot

    def pin_prefix(self, names: Sequence[bytes]) -> list[int]:
        with self._lock:
            slots = []
            for name in names:
                slot = self.blocks.get(name)
                if slot is None:
                    break
                slots.append(slot)
            for slot in slots:
                self._pins[slot] = self._pins.get(slot, 0) + 1
            return slots

    def unpin(self, slots: Sequence[int]) -> None:
        with self._lock:
            for slot in slots:
                left = self._pins[slot] - 1
                if left:
                    self._pins[slot] = left
                else:
                    del self._pins[slot]
            self.changed.notify_all()

    def pinned(self) -> int:
        with self._lock:
            return sum(self._pins.values())

    def wait_unpinned(self, timeout: float) -> bool:
        with self._lock:
            return self.changed.wait_for(lambda: not self._pins, timeout)


@dataclass
class Answer:
    request: PullRequest
    slots: list[int]
    attempt: Attempt | None = None
    outcome: Outcome | None = None
    declined: str | None = None
    submission: Submission | None = None


class ServingHolder:
    """Plays the serving end's lease holder on its own thread, through kvwire's one serving loop
    (:class:`kvwire.holding.ServingLoop`): on wake it takes the incoming requests, pins the held
    prefix, publishes it with the request's ticket, and unpins once the attempt quiesces.
    ``mode``: ``serve``, ``ignore`` (never answers), ``decline``, ``wrong-slot`` (answers with
    rows of another size). ``gate``: an event each answer waits for."""

    def __init__(self, backend, pool: Pool, tree: ReuseTree, mode: str = "serve",
                 decline_reason: str = "no thanks", on_publish: Callable[[Answer], None] | None = None,
                 other_pool: Pool | None = None, gate: threading.Event | None = None) -> None:
        self.backend = backend
        self.gate = gate  # when given, each answer waits for it to be set
        self.pool = pool
        self.tree = tree
        self.mode = mode
        self.decline_reason = decline_reason
        self.on_publish = on_publish
        self.other_pool = other_pool
        self.answers: list[Answer] = []
        self.requests_seen = 0
        self.loop: ServingLoop[list[int]] = ServingLoop(backend, self._pin, tree.unpin, on_declined=self._declined)
        self.wakes = self.loop.wakes  # one for serve() and every publish
        self._of: dict[int, Answer] = {}  # id of a reply -> its answer
        self._refused: str | None = None
        self._nudged = 0
        self._stop = False
        self._lock = threading.Lock()
        self.settled = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="serving-holder", daemon=True)
        self._thread.start()
        self.loop.serve()

    def _run(self) -> None:
        seen = -1
        while not self._stop:
            if seen >= 0:  # sleep until the backend wakes this holder (or stop() nudges it)
                self.wakes.wait_beyond(seen, time.monotonic() + 3600, nudges=self._nudged)
                self._nudged = self.wakes.nudges
            seen = self.wakes.count
            for request in self.loop.take():
                with self._lock:
                    self.requests_seen += 1
                    self.settled.notify_all()
                self._answer(request)
            for reply in self.loop.sweep():
                answer = self._of.pop(id(reply))
                answer.outcome = reply.outcome
            with self._lock:
                self.settled.notify_all()

    def _pin(self, request: PullRequest) -> tuple[View, list[int]]:
        names = [request.names[i].tobytes() for i in range(request.blocks)]
        slots = self.tree.pin_prefix(names)
        pool = self.other_pool if self.mode == "wrong-slot" and self.other_pool is not None else self.pool
        return pool.view(slots, names[: len(slots)], groups=request.groups), slots

    def _declined(self, request: PullRequest, reason: str, refused: bool) -> None:
        if not refused:  # the publish was refused (S3): its pins are back already
            self._refused = reason

    def _answer(self, request: PullRequest) -> Answer | None:
        if self.mode == "ignore":
            return None
        if self.gate is not None:
            self.gate.wait(10)
        if self.mode == "decline":
            self.loop.decline(request, self.decline_reason)
            answer = Answer(request, [], declined=self.decline_reason)
            with self._lock:
                self.answers.append(answer)
            return answer
        self._refused = None
        reply = self.loop.answer(request)
        if reply is None:
            answer = Answer(request, [], declined=self._refused)
        else:
            answer = Answer(request, reply.held, attempt=reply.submission.attempt, submission=reply.submission)
            self._of[id(reply)] = answer
        with self._lock:
            self.answers.append(answer)
        if self.on_publish is not None:
            self.on_publish(answer)
        return answer

    def wait_requests(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` requests were taken from ``incoming()``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.requests_seen < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.settled.wait(left)
        return True

    def wait_settled(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` answers exist and each has an outcome (or was declined)."""
        deadline = time.monotonic() + timeout

        def done() -> bool:
            return len(self.answers) >= count and all(a.outcome is not None or a.declined for a in self.answers)

        with self._lock:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.settled.wait(min(left, 0.05))
        return True

    def stop(self) -> None:
        self._stop = True
        self.wakes.nudge()
        self._thread.join(5)


class Requester:
    """Plays the requesting end's lease holder: lends free rows, fetches, waits (through
    ``kvwire.holding``), releases."""

    def __init__(self, backend, pool: Pool) -> None:
        self.backend = backend
        self.pool = pool
        self.lent: set[int] = set()
        self._submissions: dict[int, Submission] = {}

    def fetch(self, address: bytes, names: Sequence[bytes], timeout_s: float | None = None,
              slots: Sequence[int] | None = None, **fields: bytes) -> tuple[Attempt, list[int]]:
        if slots is None:
            free = [s for s in range(self.pool.slots) if s not in self.lent]
            slots = free[: len(names)]
        slots = list(slots)
        self.lent.update(slots)
        view = self.pool.view(slots, list(names))
        try:
            hint = Hint.of("peer", address=address, timeout_s=timeout_s, **fields)
            sub = submit(self.backend, Direction.FETCH, view, hint)
        except Exception:
            self.lent.difference_update(slots)
            raise
        self._submissions[id(sub.attempt)] = sub
        return sub.attempt, slots

    def _wait(self, attempt: Attempt, timeout: float, quiesce: bool) -> Outcome:
        waited = wait(self._submissions[id(attempt)], timeout, quiesce=quiesce, at_deadline=AtDeadline.RETURN)
        if waited.status is WaitStatus.UNWOKEN:
            raise AssertionError(f"W1: {waited.describe()}")
        if waited.status is WaitStatus.EXPIRED:
            raise TimeoutError(f"attempt still {attempt.poll()!r}, quiesced={attempt.quiesced()} after {timeout}s")
        assert waited.outcome is not None
        return waited.outcome

    def wait_concluded(self, attempt: Attempt, timeout: float) -> Outcome:
        """Wait (on wakes, with a deadline) until the attempt concluded; keep its rows lent."""
        return self._wait(attempt, timeout, quiesce=False)

    def wait(self, attempt: Attempt, slots: Sequence[int], timeout: float) -> Outcome:
        """Wait (on wakes, with a deadline) until the attempt concluded and quiesced, then
        release its rows."""
        outcome = self._wait(attempt, timeout, quiesce=True)
        self.lent.difference_update(slots)
        return outcome


def fill(pool: Pool, tree: ReuseTree, names: Sequence[bytes], first_slot: int = 0) -> None:
    """Put blocks ``names`` into ``pool`` rows from ``first_slot`` and into the tree."""
    for i, name in enumerate(names):
        slot = first_slot + i
        for g, gid in enumerate(pool.group_ids):
            pool.arrays[g][slot] = row_pattern(name, gid, pool.slot_bytes)
        tree.insert(name, slot)


def serve_filled(server: Any, groups: Sequence[int], blocks: int, slot_bytes: int) -> tuple[ServingHolder, threading.Event]:
    """``server`` serving ``blocks`` filled blocks of ``slot_bytes`` per group through a
    :class:`ServingHolder`, and an event set once it published an answer."""
    pool, tree = Pool(groups, blocks, slot_bytes), ReuseTree()
    server.register_regions(pool.regions)
    fill(pool, tree, block_names(blocks))
    published = threading.Event()
    return ServingHolder(server, pool, tree, on_publish=lambda answer: published.set()), published


def check_timeline(timeline: dict[str, float], wall: float, *orders: tuple[str, ...]) -> None:
    """``timeline`` (an attempt's ``timeline()``) names exactly the steps in ``orders``, each
    reached within ``wall`` seconds of the submission, and the steps of each order in that order."""
    assert set(timeline) == {step for order in orders for step in order}, timeline
    assert all(0.0 <= t <= wall for t in timeline.values()), (timeline, wall)
    for order in orders:
        times = [timeline[step] for step in order]
        assert times == sorted(times), (order, timeline)
