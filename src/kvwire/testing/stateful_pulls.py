"""The holder model for a peer that serves pulls (N2): a hypothesis ``RuleBasedStateMachine`` that
plays both holders of a pair, the requesting one (pulls, cancels, waits) and the serving one
(holds blocks in its reuse tree, answers, declines, evicts unpinned blocks), in any interleaving,
and checks at every step what the store model checks for stores: bytes, masks, memory outside
attempts in flight, and pins.

The model: which block names the serving tree holds now (content follows from the name and the
group), which are pinned by an answer in flight, and per sink slot whose content it holds. A
pull's expected mask is the prefix of its names the tree held when the suite answered it, in
every group alike; a declined pull fails; a cancelled one may deliver or not, but every true bit
is byte-exact (A7). Pins return to zero once every answer quiesced (N2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvwire.contract import CacheKind, Cause, LayerGroupRows, MemoryKind, Outcome, TokenRange, View
from kvwire.contract.backend import Registration
from kvwire.contract.errors import SubmissionError
from kvwire.contract.serving import PullRequest
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Ends, Harness
from kvwire.testing.holder import Submission, call_briefly, speaks_causes
from kvwire.testing.layout import random_names
from kvwire.testing.serving import Answer, SuiteServer
from kvwire.testing.stateful import GROUPS, bound, close_ends, content

__all__ = ["pull_model", "PullModel"]

#: Block names in the machine's universe, source slots (one block each) and sink slots per group.
NAMES = 10
SLOTS = 12
QUEUE = 4
UNKNOWN = -2
JUNK = -1


@dataclass(eq=False)
class Pull:
    """A fetch the requesting holder submitted: its names in order and the sink slots they go to."""

    sub: Submission
    names: tuple[int, ...]
    slots: np.ndarray
    cancelled: bool = False
    taken: bool = False
    #: How many leading names the suite served (``None``: not answered; -1: declined).
    served: int | None = None


class PullModel(RuleBasedStateMachine):
    """Drives a serving pair as its two holders would, against the model."""

    harness: Harness
    kind: MemoryKind = MemoryKind.HOST

    def __init__(self) -> None:
        super().__init__()
        self.patience = profiles.active().patience_s
        self.ends: Ends = needs.open_ends(self.harness, timeout_s=120.0, max_in_flight=QUEUE)
        self.ex = Exchange(self.ends, self.patience, self.harness.quiesce_grace_s)
        self.caps = self.ex.caps
        self.bound = min(self.caps.max_in_flight, QUEUE)
        self.names = random_names(np.random.default_rng(1), NAMES, 16)
        self.source = [self.harness.allocate(self.kind, size, SLOTS) for _, size in GROUPS]
        self.sink = [self.harness.allocate(self.kind, size, SLOTS) for _, size in GROUPS]
        for gi, (_, size) in enumerate(GROUPS):
            self.sink[gi].write(np.arange(SLOTS), np.full((SLOTS, size), 0x33, dtype=np.uint8))
        self.sink_holds = [np.full(SLOTS, JUNK, dtype=np.int64) for _ in GROUPS]
        self.registrations: list[Registration] = [
            self.ends.source.register_regions([m.region for m in self.source]),
            self.ends.sink.register_regions([m.region for m in self.sink]),
        ]
        self.holder: SuiteServer = self.ex.holder()
        self.tree = self.holder.tree
        for gi, (gid, _) in enumerate(GROUPS):
            self.tree.regions[gid] = self.source[gi].region  # an empty answer still names its regions
        #: name index -> source slot (the same slot in every group) for names the tree holds.
        self.held: dict[int, int] = {}
        self.pulls: list[Pull] = []
        #: Cancelled pulls settled before the serving end saw their request (it may still come).
        self.gone: list[Pull] = []
        #: Requests that arrived before the machine turned to their pull, by the pull's names.
        self.arrived: dict[tuple[int, ...], list[PullRequest]] = {}
        self.answers: list[Answer] = []

    # -- helpers ------------------------------------------------------------------------------

    def _name(self, index: int) -> bytes:
        return self.names[index].tobytes()

    def _pinned(self) -> set[int]:
        return {i for i in range(NAMES) if self.tree.pins.get(self._name(i), 0) > 0}

    def _sink_busy(self) -> set[int]:
        return {int(s) for p in self.pulls for s in p.slots}

    def _names_of(self, request: PullRequest) -> tuple[int, ...]:
        found = []
        for row in request.names:
            hit = np.flatnonzero((self.names == row).all(axis=1))
            assert hit.size, "N2: a pull request names a block the requester never asked for"
            found.append(int(hit[0]))
        return tuple(found)

    def _take_for(self, pull: Pull) -> PullRequest:
        """The request of ``pull``: requests arrive in the backend's order, so the ones that come
        first are kept until their turn (the machine's draws never depend on that order)."""
        while not self.arrived.get(pull.names):
            (request,) = self.holder.take(1)
            names = self._names_of(request)
            assert any(p.names == names for p in (*self.pulls, *self.gone)), (
                f"N2: a pull request for blocks {names} matches no pull the requester made")
            self.arrived.setdefault(names, []).append(request)
        request = self.arrived[pull.names].pop(0)
        pull.taken = True
        assert list(request.groups) == [gid for gid, _ in GROUPS], (
            f"N2: the request names groups {request.groups}; the fetch's view has {[g for g, _ in GROUPS]}")
        return request

    def _live(self) -> list[Pull]:
        return [p for p in self.pulls if not p.taken and not p.cancelled]

    def _check(self, pull: Pull, out: Outcome) -> None:
        for gi, ((gid, size), mask) in enumerate(zip(GROUPS, out.masks, strict=True)):
            for name, slot, bit in zip(pull.names, pull.slots.tolist(), mask.tolist(), strict=True):
                if bit:
                    actual = self.sink[gi].read([slot])[0]
                    assert np.array_equal(actual, content(gid, name, size)), (
                        f"A7: block {name} of group {gid} is marked delivered, but its bytes differ from the server's")
                    self.sink_holds[gi][slot] = name
                else:
                    self.sink_holds[gi][slot] = UNKNOWN
        if pull.cancelled:
            return
        if pull.served == -1:
            assert out.is_failed, f"N2: a declined pull must fail the fetch, got {out!r}"
            if speaks_causes(pull.sub.backend):
                assert out.cause is Cause.DECLINED, f"A10: a declined pull's cause is DECLINED: {out!r}"
            return
        assert pull.served is not None
        assert out.is_delivered, f"N2: a pull served {pull.served} of {len(pull.names)} blocks must deliver: {out!r}"
        want = np.arange(len(pull.names)) < pull.served
        for (gid, _), mask in zip(GROUPS, out.masks, strict=True):
            assert np.array_equal(mask, want), (
                f"N2/A5: group {gid}: the server served the first {pull.served} of {len(pull.names)} blocks, the "
                f"outcome marks rows {np.flatnonzero(mask).tolist()}")

    # -- the serving holder -------------------------------------------------------------------

    @precondition(lambda self: len(self.held) < NAMES)
    @rule(data=st.data())
    def hold_blocks(self, data: st.DataObject) -> None:
        """The serving holder computes some blocks: their content lands in free, unpinned source
        slots, and its reuse tree names them."""
        fresh = [i for i in range(NAMES) if i not in self.held]
        chosen = data.draw(st.lists(st.sampled_from(fresh), unique=True, min_size=1, max_size=4), label="names")
        used = set(self.held.values())
        free = [s for s in range(SLOTS) if s not in used]
        for name in chosen[: len(free)]:
            slot = free.pop(0)
            for gi, (gid, size) in enumerate(GROUPS):
                self.source[gi].write([slot], content(gid, name, size)[None, :])
                self.tree.add(self._name(name), gid, self.source[gi].region, slot)
            self.held[name] = slot

    @precondition(lambda self: bool(set(self.held) - self._pinned()))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        """The serving holder evicts an unpinned block: the tree forgets it and its slot is junk."""
        name = data.draw(st.sampled_from(sorted(set(self.held) - self._pinned())), label="name")
        slot = self.held.pop(name)
        self.tree.rows.pop(self._name(name), None)
        for gi, (_, size) in enumerate(GROUPS):
            self.source[gi].write([slot], np.full((1, size), 0xEE, dtype=np.uint8))

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def answer(self, data: st.DataObject) -> None:
        """The serving holder takes a pull's request (looking only after wakes) and answers with
        the held prefix, pinned, maybe cut shorter."""
        pull = data.draw(st.sampled_from(self._live()), label="pull")
        limit = data.draw(st.one_of(st.none(), st.integers(0, len(pull.names))), label="limit")
        answer = self.holder.answer(self._take_for(pull), limit)
        pull.served = len(answer.pinned)
        self.answers.append(answer)

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def decline(self, data: st.DataObject) -> None:
        pull = data.draw(st.sampled_from(self._live()), label="pull")
        self.holder.decline(self._take_for(pull), "the suite's serving holder declines this pull")
        pull.served = -1

    @precondition(lambda self: any(not a.released for a in self.answers))
    @rule(data=st.data())
    def finish_answer(self, data: st.DataObject) -> None:
        """Wait until an answer quiesced, then unpin its blocks (on every outcome alike)."""
        answer = data.draw(st.sampled_from([a for a in self.answers if not a.released]), label="answer")
        self.holder.finish(answer)

    # -- the requesting holder ----------------------------------------------------------------

    @precondition(lambda self: sum(1 for p in self.pulls) < self.bound)
    @rule(data=st.data())
    def pull(self, data: st.DataObject) -> None:
        """Pull some blocks by name, in a drawn order, into free sink slots."""
        free = sorted(set(range(SLOTS)) - self._sink_busy())
        if not free:
            return
        names = tuple(data.draw(st.lists(st.integers(0, NAMES - 1), unique=True, min_size=1,
                                         max_size=min(5, len(free))), label="names"))
        if any(p.names == names and not p.taken for p in (*self.pulls, *self.gone)):
            return  # two identical requests in flight could not be told apart
        slots = np.array(data.draw(st.permutations(free), label="slots")[: len(names)], dtype=np.int64)
        groups = tuple(LayerGroupRows(gid, CacheKind.PAGED, self.sink[gi].region, slots,
                                      TokenRange(0, 16 * len(names)), self.names[list(names)])
                       for gi, (gid, _) in enumerate(GROUPS))
        try:
            sub = self.ex.fetch(View(groups))
        except SubmissionError as exc:
            raise AssertionError(f"S3: a well-formed pull was refused with {len(self.pulls)} in flight "
                                 f"(bound {self.bound}): {type(exc).__name__}: {exc}") from exc
        self.pulls.append(Pull(sub, names, slots))

    @precondition(lambda self: self.caps.cancellation and any(not p.cancelled for p in self.pulls))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        pull = data.draw(st.sampled_from([p for p in self.pulls if not p.cancelled]), label="pull")
        call_briefly(pull.sub.attempt.cancel, "A4: cancel() of a pull")
        pull.cancelled = True

    @precondition(lambda self: any(p.served is not None or p.cancelled for p in self.pulls))
    @rule(data=st.data())
    def settle_pull(self, data: st.DataObject) -> None:
        """Wait, on wakes only, until a pull that was answered, declined or cancelled concluded
        and quiesced; check its outcome and bytes."""
        pull = data.draw(st.sampled_from([p for p in self.pulls if p.served is not None or p.cancelled]),
                         label="pull")
        out = self.ex.settle(pull.sub)
        self.pulls.remove(pull)
        if not pull.taken:
            self.gone.append(pull)
        self._check(pull, out)

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def pins_and_memory(self) -> None:
        """Pins are exactly those of answers not yet finished (N2); sink slots no pull may write
        hold what the model says (S2, A2); held source blocks were never written (a publish only
        reads)."""
        open_pins: dict[bytes, int] = {}
        for answer in self.answers:
            if not answer.released:
                for pin in answer.pinned:
                    open_pins[pin] = open_pins.get(pin, 0) + 1
        pins = {k: v for k, v in self.tree.pins.items() if v}
        assert pins == open_pins, f"N2: pins {pins} differ from those of the answers in flight {open_pins}"
        busy = self._sink_busy()
        for gi, (gid, size) in enumerate(GROUPS):
            actual = self.sink[gi].read_all()
            for slot in range(SLOTS):
                held = int(self.sink_holds[gi][slot])
                if slot in busy or held == UNKNOWN:
                    continue
                want = np.full(size, 0x33, dtype=np.uint8) if held == JUNK else content(gid, held, size)
                assert np.array_equal(actual[slot], want), (
                    f"S2/A2: sink slot {slot} of group {gid} changed outside any pull in flight on it")
            source = self.source[gi].read_all()
            for name, slot in self.held.items():
                assert np.array_equal(source[slot], content(gid, name, size)), (
                    f"S2: the serving end's slot {slot} of group {gid} changed; answering a pull only reads it")
            assert self.sink[gi].guards_intact() and self.source[gi].guards_intact(), (
                "S2/M2: memory just outside a region changed")

    def _decline_leftovers(self) -> None:
        for requests in self.arrived.values():
            for request in requests:
                self.holder.decline(request, "the requester cancelled it")
        self.arrived.clear()
        self.holder.decline_waiting("the requester cancelled it")

    def teardown(self) -> None:
        try:
            # Answer until every live pull's request was taken: a cancelled pull's request may
            # still arrive first (the cancel reaches the serving end when it does), or never.
            for pull in self._live():
                self.answers.append(self.holder.answer(self._take_for(pull)))
                pull.served = len(self.answers[-1].pinned)
            # What is left are requests of cancelled pulls, taken from incoming() or not: decline
            # them, so no serving ticket stays open while its requester winds down.
            self._decline_leftovers()
            for pull in list(self.pulls):
                out = self.ex.settle(pull.sub)
                self.pulls.remove(pull)
                self._check(pull, out)
            for answer in self.answers:
                self.holder.finish(answer)
            self._decline_leftovers()
            assert self.tree.pinned == 0, f"N2: {self.tree.pinned} pins left after every answer quiesced"
        finally:
            close_ends(self.harness, self.ends, self.registrations)


def pull_model(harness: Harness, kind: MemoryKind = MemoryKind.HOST) -> type[PullModel]:
    """The pull model for ``harness``, with rows in ``kind`` memory."""
    return bound(PullModel, harness, kind)


def settings_for_pull_machine() -> Any:
    p = profiles.active()
    return profiles.examples(max_examples=max(5, p.machine_examples // 2), stateful_step_count=p.machine_steps)
