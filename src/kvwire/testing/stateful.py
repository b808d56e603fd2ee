"""A stateful test of a backend against a plain model: a hypothesis ``RuleBasedStateMachine``
that drives a pair of ends the way a holder does (register, write rows, publish, fetch, poll,
cancel, wait for quiescence, shut down) and checks bytes and masks at every step.

The model is a set: which ``(group, name)`` objects the other end holds. Content follows from
the name (equal names mean equal bytes, N1), so the model never needs the bytes themselves. The
memory model is per slot: which name's content it holds, junk the suite wrote, or undefined
(a fetched row whose bit was false, A7). Slots under an attempt in flight are the backend's
until it quiesces (S2); every other slot must hold what the model says after every step.

Use :func:`holder_model` to get the machine for one harness, and run it with
``hypothesis.stateful.run_state_machine_as_test``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvwire.contract import (
    CacheKind,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    SubmissionRejected,
    TokenRange,
    View,
)
from kvwire.contract.backend import Registration
from kvwire.contract.errors import SubmissionError
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Ends, Harness
from kvwire.testing.holder import Submission, call_briefly, refused
from kvwire.testing.layout import random_names
from kvwire.testing.regions import RegionMemory

__all__ = ["holder_model", "HolderModel", "GROUPS"]

#: The machine's layer groups: (group id, slot bytes).
GROUPS: tuple[tuple[int, int], ...] = ((0, 48), (3, 7))
#: Names per group in the machine's universe, and slots per region.
NAMES = 10
SLOTS = 12
#: The queue bound the machine asks for, so full queues happen.
QUEUE = 4
JUNK = -1
UNKNOWN = -2
#: Steps before the machine may shut an end down (after which most submissions are rejected).
SHUTDOWN_AFTER = 15

M = TypeVar("M", bound=RuleBasedStateMachine)


def content(group: int, name: int, size: int) -> np.ndarray:
    """The bytes of name ``name`` in group ``group``: a function of the name alone (N1)."""
    return np.random.default_rng([group, name, size]).integers(0, 256, size=size, dtype=np.uint8)


@dataclass(eq=False)
class InFlight:
    """A submission the machine has not yet seen concluded and quiesced."""

    sub: Submission
    rows: list[tuple[int, np.ndarray, np.ndarray]]  # (group index, slots, name indices)
    held_at_submit: frozenset[tuple[int, int]] = frozenset()
    cancelled: bool = False


@dataclass(eq=False)
class ModelEnd:
    memories: list[RegionMemory]
    #: Per group, per slot: the name index whose content the slot holds, JUNK, or UNKNOWN.
    holds: list[np.ndarray] = field(default_factory=list)
    junk: list[np.ndarray] = field(default_factory=list)


class HolderModel(RuleBasedStateMachine):
    """Drives one pair of ends as a holder would, against the model. Subclassed per harness by
    :func:`holder_model`."""

    harness: Harness
    kind: MemoryKind = MemoryKind.HOST

    def __init__(self) -> None:
        super().__init__()
        self.patience = profiles.active().patience_s
        self.ends: Ends = needs.open_ends(self.harness, timeout_s=120.0, max_in_flight=QUEUE)
        self.ex = Exchange(self.ends, self.patience, self.harness.quiesce_grace_s)
        self.caps = self.ex.caps
        self.bound = self.caps.max_in_flight
        rng = np.random.default_rng(0)
        self.names = [random_names(rng, NAMES, 16) for _ in GROUPS]
        self.source = self._side()
        self.sink = self._side()
        self.registrations: list[Registration] = [
            self.ends.source.register_regions([m.region for m in self.source.memories]),
            self.ends.sink.register_regions([m.region for m in self.sink.memories]),
        ]
        self.held: set[tuple[int, int]] = set()
        self.offered: set[tuple[int, int]] = set()
        self.maybe: set[tuple[int, int]] = set()
        self.flight: list[InFlight] = []
        self.shut: set[str] = set()
        self.steps = 0

    def _side(self) -> ModelEnd:
        side = ModelEnd([self.harness.allocate(self.kind, size, SLOTS) for _, size in GROUPS])
        for gi, (_, size) in enumerate(GROUPS):
            junk = np.full((SLOTS, size), 0x11 * (gi + 1), dtype=np.uint8)
            side.memories[gi].write(np.arange(SLOTS), junk)
            side.holds.append(np.full(SLOTS, JUNK, dtype=np.int64))
            side.junk.append(junk)
        return side

    # -- helpers ------------------------------------------------------------------------------

    def _busy(self, op: str, gi: int) -> set[int]:
        return {int(s) for f in self.flight if f.sub.op == op for g, slots, _ in f.rows if g == gi for s in slots}

    def _view(self, side: ModelEnd, rows: list[tuple[int, np.ndarray, np.ndarray]]) -> View:
        groups = []
        for gi, slots, names in rows:
            gid, _ = GROUPS[gi]
            groups.append(LayerGroupRows(gid, CacheKind.PAGED, side.memories[gi].region, slots,
                                         TokenRange(0, 16 * max(1, slots.size)), self.names[gi][names]))
        return View(tuple(groups))

    def _expected(self, side: ModelEnd, gi: int, slot: int) -> np.ndarray | None:
        held = int(side.holds[gi][slot])
        if held == UNKNOWN:
            return None
        if held == JUNK:
            return side.junk[gi][slot]
        return content(GROUPS[gi][0], held, GROUPS[gi][1])

    def _check_rejection(self, exc: SubmissionError, op: str) -> None:
        assert isinstance(exc, SubmissionRejected), (
            f"S3/S4: a well-formed {op} was refused with {type(exc).__name__}: {exc}")
        end = "source" if op == "publish" else "sink"
        assert end in self.shut, (
            f"S3: a {op} was rejected ({exc}) with only {len(self.flight)} attempts in flight; the backend "
            f"declares room for {self.bound}")

    def _finish(self, f: InFlight) -> None:
        out = self.ex.settle(f.sub)
        self.flight.remove(f)
        self._apply(f, out)

    def _apply(self, f: InFlight, out: Outcome) -> None:
        if f.sub.op == "publish":
            if not f.cancelled and "source" not in self.shut:
                assert out.is_delivered, f"A5: a publish to a store with room to spare must deliver: {out!r}"
            for (gi, _, names), mask in zip(f.rows, out.masks, strict=True):
                if not f.cancelled and "source" not in self.shut:
                    assert mask.all(), f"A5: a publish to a store with room to spare must hold every row: {out!r}"
                for name in names[mask]:
                    self.held.add((gi, int(name)))
                # A cancelled publish's false bits say the store had not confirmed those rows when
                # it concluded; a chunk already inside the store may still land them.
                for name in names[~mask]:
                    self.maybe.add((gi, int(name)))
            return
        if not f.cancelled and "sink" not in self.shut:
            assert out.is_delivered, f"A5: nothing faults in this model, and misses are no failure: {out!r}"
        for (gi, slots, names), mask in zip(f.rows, out.masks, strict=True):
            gid, size = GROUPS[gi]
            for slot, name, bit in zip(slots.tolist(), names.tolist(), mask.tolist(), strict=True):
                if bit:
                    actual = self.sink.memories[gi].read([slot])[0]
                    assert np.array_equal(actual, content(gid, name, size)), (
                        f"A7: row for name {name} of group {gid} is marked delivered, but its bytes differ")
                    pending = {(g, int(n)) for p in self.flight if p.sub.op == "publish" for g, _, ns in p.rows
                               for n in ns}
                    assert (gi, name) in self.held | self.maybe | pending | f.held_at_submit, (
                        f"A5/A7: name {name} of group {gid} was never published, yet marked delivered")
                    self.sink.holds[gi][slot] = name
                else:
                    if out.is_delivered and (gi, name) in f.held_at_submit:
                        raise AssertionError(
                            f"A5: name {name} of group {gid} was held when the fetch was submitted, but its bit is "
                            f"false in a delivered {out!r}; a backend never skips rows")
                    self.sink.holds[gi][slot] = UNKNOWN

    # -- rules --------------------------------------------------------------------------------

    @rule(data=st.data())
    def write_source(self, data: st.DataObject) -> None:
        """The holder writes a name's content into a source slot no publish is reading."""
        gi = data.draw(st.integers(0, len(GROUPS) - 1), label="group")
        free = sorted(set(range(SLOTS)) - self._busy("publish", gi))
        if not free:
            return
        slot = data.draw(st.sampled_from(free), label="slot")
        name = data.draw(st.integers(0, NAMES - 1), label="name")
        gid, size = GROUPS[gi]
        self.source.memories[gi].write([slot], content(gid, name, size)[None, :])
        self.source.holds[gi][slot] = name

    # Submissions stay below the queue bound: a full queue's rejection depends on timing, and the
    # machine's draws must not (the S3 tests fill queues on purpose).
    @precondition(lambda self: self.caps.publish and len(self.flight) < self.bound)
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        """Lend rows holding some names' content (writing the content into free source slots
        where no slot holds it yet) and publish them."""
        rows = []
        for gi in data.draw(st.lists(st.integers(0, len(GROUPS) - 1), unique=True, min_size=1), label="groups"):
            gid, size = GROUPS[gi]
            names = data.draw(st.lists(st.integers(0, NAMES - 1), unique=True, min_size=1, max_size=6), label="names")
            busy = self._busy("publish", gi)
            slots: list[int] = []
            for name in names:
                where = [s for s in range(SLOTS) if self.source.holds[gi][s] == name and s not in slots]
                if where:
                    slots.append(where[0])
                    continue
                free = [s for s in range(SLOTS) if s not in busy and s not in slots]
                if not free:
                    break
                slot = data.draw(st.sampled_from(free), label="slot")
                self.source.memories[gi].write([slot], content(gid, name, size)[None, :])
                self.source.holds[gi][slot] = name
                slots.append(slot)
            names = names[: len(slots)]
            if slots:
                rows.append((gi, np.array(slots, dtype=np.int64), np.array(names, dtype=np.int64)))
        if not rows:
            return
        try:
            sub = self.ex.publish(self._view(self.source, rows))
        except SubmissionError as exc:
            self._check_rejection(exc, "publish")
            return
        assert "source" not in self.shut, "B3: a publish after shutdown() was accepted"
        self.flight.append(InFlight(sub, rows))
        self.offered.update((gi, int(n)) for gi, _, names in rows for n in names)

    @precondition(lambda self: self.caps.fetch and len(self.flight) < self.bound)
    @rule(data=st.data())
    def fetch(self, data: st.DataObject) -> None:
        rows = []
        for gi in data.draw(st.lists(st.integers(0, len(GROUPS) - 1), unique=True, min_size=1), label="groups"):
            free = sorted(set(range(SLOTS)) - self._busy("fetch", gi))
            count = data.draw(st.integers(0, min(6, len(free))), label="rows")
            slots = data.draw(st.permutations(free), label="slots")[:count]
            names = data.draw(st.lists(st.integers(0, NAMES - 1), unique=True, min_size=count, max_size=count),
                              label="names")
            # Names once offered (not those held: what a cancelled publish left depends on timing).
            held = sorted(n for g, n in self.offered if g == gi and n not in names)
            if held and count and data.draw(st.booleans(), label="ask for held names"):
                # Mostly names the store holds, so deliveries (and skips) can show.
                swap = data.draw(st.lists(st.sampled_from(held), unique=True, max_size=count), label="held names")
                names = (swap + [n for n in names if n not in swap])[:count]
            rows.append((gi, np.array(slots, dtype=np.int64), np.array(names, dtype=np.int64)))
        held_now = frozenset(self.held)
        try:
            sub = self.ex.fetch(self._view(self.sink, rows))
        except SubmissionError as exc:
            self._check_rejection(exc, "fetch")
            self.check_memory()
            return
        assert "sink" not in self.shut, "B3: a fetch after shutdown() was accepted"
        self.flight.append(InFlight(sub, rows, held_now))

    @precondition(lambda self: bool(self.flight))
    @rule(data=st.data())
    def settle_one(self, data: st.DataObject) -> None:
        """Wait, on wakes only, until one attempt concluded and quiesced; check it."""
        f = data.draw(st.sampled_from(self.flight), label="attempt")
        self._finish(f)

    @precondition(lambda self: bool(self.flight) and self.caps.cancellation)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        f = data.draw(st.sampled_from(self.flight), label="attempt")
        before = f.sub.poll()
        call_briefly(f.sub.attempt.cancel, "A4: cancel()")
        f.cancelled = True
        if before is not None:
            after = f.sub.poll()  # A1: the same outcome; checked by Submission.poll
            assert after is not None

    @precondition(lambda self: "sink" not in self.shut and not any(f.sub.op == "fetch" for f in self.flight))
    @rule(data=st.data())
    def reregister_sink(self, data: st.DataObject) -> None:
        """With no fetch in flight, the holder closes the sink's registration (twice: idempotent);
        a fetch into it is then refused whole (M4); registering the same regions again works,
        and closing the old handle once more revokes nothing (M3)."""
        old = self.registrations[1]
        old.close()
        old.close()
        gi = data.draw(st.integers(0, len(GROUPS) - 1), label="group")
        slots = np.array([0], dtype=np.int64)
        view = self._view(self.sink, [(gi, slots, np.array([0], dtype=np.int64))])
        refused(lambda: self.ex.fetch(view), "M4: a fetch into a region whose registration was closed")
        self.registrations[1] = self.ends.sink.register_regions([m.region for m in self.sink.memories])
        old.close()

    @precondition(lambda self: bool(self.flight))
    @rule()
    def poll_all(self) -> None:
        """Poll every attempt once (never blocks, A1; same outcome once concluded)."""
        for f in list(self.flight):
            call_briefly(f.sub.poll, "A1: poll()")
            call_briefly(f.sub.quiesced, "A2: quiesced()")

    @rule()
    def quiesce_all(self) -> None:
        """Wait for every attempt, as a holder does before it releases its leases."""
        for f in list(self.flight):
            self._finish(f)

    @precondition(lambda self: not self.shut and self.steps >= SHUTDOWN_AFTER)
    @rule(end=st.sampled_from(["source", "sink"]))
    def shutdown(self, end: str) -> None:
        """Shut one end down; call until empty, as a holder does (B3)."""
        backend = self.ends.source if end == "source" else self.ends.sink
        op = "publish" if end == "source" else "fetch"
        mine = [f for f in self.flight if f.sub.op == op]
        pending = call_briefly(backend.shutdown, "B3: shutdown()")
        self.shut.add(end)
        known = {id(f.sub.attempt) for f in mine}
        assert all(id(a) in known for a in pending), "B3: shutdown() returned attempts never submitted"
        for f in mine:
            f.cancelled = True
            self._finish(f)
        assert not backend.shutdown(), "B3: every attempt quiesced, yet shutdown() is not empty"

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def check_memory(self) -> None:
        """Every slot no attempt in flight may touch holds what the model says (S2, A2, A7)."""
        self.steps += 1
        for label, side, op in (("source", self.source, "publish"), ("sink", self.sink, "fetch")):
            for gi, memory in enumerate(side.memories):
                assert memory.guards_intact(), f"S2/M2: memory around a {label} region changed"
                busy = self._busy("fetch", gi) if label == "sink" else set()
                actual = memory.read_all()
                for slot in range(SLOTS):
                    if slot in busy:
                        continue
                    want = self._expected(side, gi, slot)
                    if want is not None and not np.array_equal(actual[slot], want):
                        raise AssertionError(
                            f"S2/A2: {label} slot {slot} of group {GROUPS[gi][0]} changed outside any attempt "
                            f"in flight on it ({op}s write only their own rows, and only until they quiesce)")

    def teardown(self) -> None:
        try:
            for f in list(self.flight):
                self._finish(f)
        finally:
            close_ends(self.harness, self.ends, self.registrations)


def close_ends(harness: Harness, ends: Ends, registrations: list[Registration]) -> None:
    """A machine's last step: close the registrations it made, then the harness's ends."""
    for registration in registrations:
        registration.close()
    harness.close(ends)


def bound(machine: type[M], harness: Harness, kind: MemoryKind) -> type[M]:
    """``machine`` bound to ``harness``, with rows in ``kind`` memory (one class per backend, so
    hypothesis keeps their examples apart)."""
    return type(f"{machine.__name__}_{harness.name.replace('-', '_')}", (machine,), {"harness": harness, "kind": kind})


def holder_model(harness: Harness, kind: MemoryKind = MemoryKind.HOST) -> type[HolderModel]:
    """The holder model for ``harness``, with rows in ``kind`` memory."""
    return bound(HolderModel, harness, kind)


def settings_for_machine() -> Any:
    """Hypothesis settings for the machine under the active profile."""
    p = profiles.active()
    return profiles.examples(max_examples=p.machine_examples, stateful_step_count=p.machine_steps)
