"""What a test moves, and the memory it moves it through.

A :class:`ViewPlan` is plain data (hypothesis draws it: :mod:`kvwire.testing.strategies`): per
layer group, its id, cache kind, slot size, row count, the slots the rows take on each side,
and how wide its content names are. A :class:`Bench` makes it real: it allocates the regions
through the harness, fills the source rows with random bytes and every other slot with junk,
registers the regions with the ends, builds views, and keeps a model of every byte of every
region, which it compares with the memory itself after each step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np

from kvwire.contract import Backend, CacheKind, LayerGroupRows, MemoryKind, Outcome, TokenRange, View
from kvwire.contract.backend import Registration
from kvwire.testing.harness import Harness
from kvwire.testing.regions import RegionMemory

__all__ = ["GroupPlan", "ViewPlan", "Bench", "Side", "random_names"]

#: Tokens per block row in the views the suite builds (only the ranges' shape matters).
BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One layer group of a :class:`ViewPlan`. ``source_slots`` and ``sink_slots`` are distinct
    slot indices into regions of ``region_slots`` slots (the slots not used stay junk, so stray
    writes show)."""

    group_id: int
    kind: CacheKind
    slot_bytes: int
    rows: int
    source_slots: tuple[int, ...]
    sink_slots: tuple[int, ...]
    region_slots: int
    name_width: int = 16

    def __post_init__(self) -> None:
        if len(self.source_slots) != self.rows or len(self.sink_slots) != self.rows:
            raise ValueError(f"group {self.group_id}: give one source and one sink slot per row")
        for slots in (self.source_slots, self.sink_slots):
            if len(set(slots)) != len(slots) or any(not 0 <= s < self.region_slots for s in slots):
                raise ValueError(f"group {self.group_id}: slots must be distinct and < {self.region_slots}")
        if self.kind is CacheKind.STATE and self.rows != 1:
            raise ValueError(f"group {self.group_id}: a STATE group has exactly one row")


@dataclass(frozen=True, slots=True)
class ViewPlan:
    """Groups in view order, and the seed their names and bytes come from. With
    ``shared_names`` every group names its rows alike (blocks named once for all layer groups,
    as a request-free pull names them)."""

    groups: tuple[GroupPlan, ...]
    seed: int = 0
    shared_names: bool = False

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)


def random_names(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    """``rows`` distinct content names of ``width`` bytes, shape ``(rows, width)`` uint8."""
    if rows == 0:
        return np.zeros((0, width), dtype=np.uint8)
    while True:
        names = rng.integers(0, 256, size=(rows, width), dtype=np.uint8)
        if len(np.unique(names, axis=0)) == rows:
            return names


class Side:
    """One end's memory in a bench: one region per group, the model of its bytes, and whether
    each slot's bytes are known (a fetched row whose bit is false is undefined, A7)."""

    def __init__(self, label: str, memories: list[RegionMemory], slots: list[np.ndarray]) -> None:
        self.label = label
        self.memories = memories
        self.slots = slots
        self.model = [m.read_all() for m in memories]
        self.known = [np.ones(m.region.slot_count, dtype=bool) for m in memories]

    def verify(self, why: str) -> None:
        """Every known slot holds what the model says, and no guard byte changed."""
        for gi, memory in enumerate(self.memories):
            assert memory.guards_intact(), (
                f"S2/M2: memory just outside {self.label} region {memory.region.region_id} changed ({why}); a "
                "backend touches only the rows it was given")
            actual = memory.read_all()
            differs = np.flatnonzero(self.known[gi] & (actual != self.model[gi]).any(axis=1))
            assert differs.size == 0, (
                f"S2/M2: {self.label} slot(s) {differs[:8].tolist()} of region {memory.region.region_id} changed "
                f"({why}); the backend may write only the rows of a fetch it was given, and only until it quiesces")


class Bench:
    """The memory and views of one test, over a pair of ends. Use as a context manager, or call
    :meth:`close` to close the registrations once no backend touches the memory."""

    def __init__(self, harness: Harness, source: Backend | None, sink: Backend | None, plan: ViewPlan,
                 kind: MemoryKind = MemoryKind.HOST) -> None:
        self.plan = plan
        rng = np.random.default_rng(plan.seed)
        shared: np.ndarray | None = None
        self.names: list[np.ndarray] = []
        self.data: list[np.ndarray] = []
        sources: list[RegionMemory] = []
        sinks: list[RegionMemory] = []
        for g in plan.groups:
            if plan.shared_names:
                if shared is None or shared.shape[0] < g.rows:
                    grown = random_names(rng, g.rows, g.name_width)
                    shared = grown if shared is None else np.vstack([shared, grown[shared.shape[0]:]])
                names = shared[: g.rows]
            else:
                names = random_names(rng, g.rows, g.name_width)
            self.names.append(names)
            self.data.append(rng.integers(0, 256, size=(g.rows, g.slot_bytes), dtype=np.uint8))
            src = harness.allocate(kind, g.slot_bytes, g.region_slots)
            dst = harness.allocate(kind, g.slot_bytes, g.region_slots)
            junk_src = rng.integers(0, 256, size=(g.region_slots, g.slot_bytes), dtype=np.uint8)
            junk_dst = rng.integers(0, 256, size=(g.region_slots, g.slot_bytes), dtype=np.uint8)
            src.write(np.arange(g.region_slots), junk_src)
            dst.write(np.arange(g.region_slots), junk_dst)
            if g.rows:
                src.write(np.asarray(g.source_slots), self.data[-1])
            sources.append(src)
            sinks.append(dst)
        self.source = Side("source", sources, [np.asarray(g.source_slots, dtype=np.int64) for g in plan.groups])
        self.sink = Side("sink", sinks, [np.asarray(g.sink_slots, dtype=np.int64) for g in plan.groups])
        self.registrations: list[Registration] = []
        if source is not None and sources:
            self.registrations.append(source.register_regions([m.region for m in sources]))
        if sink is not None and sinks:
            self.registrations.append(sink.register_regions([m.region for m in sinks]))

    # -- views ------------------------------------------------------------------------------------

    def groups_in(self, select: Mapping[int, Sequence[int]] | None) -> list[int]:
        """The plan group indices a view built with ``select`` holds, in view order: every group
        ``select`` names (all when it is ``None``), except a STATE group given no row (a STATE
        group lends exactly one slot)."""
        rows = self.rows_of(select)
        return [gi for gi, g in enumerate(self.plan.groups)
                if (select is None or gi in select) and (g.kind is CacheKind.PAGED or rows[gi].size == 1)]

    def _view(self, side: Side, select: Mapping[int, Sequence[int]] | None, names: bool) -> View:
        groups = []
        rows_by_group = self.rows_of(select)
        for gi in self.groups_in(select):
            g = self.plan.groups[gi]
            rows = rows_by_group[gi]
            region = side.memories[gi].region
            slots = side.slots[gi][rows]
            groups.append(LayerGroupRows(
                g.group_id, g.kind, region, slots, TokenRange(0, max(1, rows.size) * BLOCK_TOKENS),
                self.names[gi][rows] if names else None))
        return View(tuple(groups))

    def source_view(self, select: Mapping[int, Sequence[int]] | None = None, *, names: bool = True) -> View:
        """The source rows of every group, or of the rows ``select`` lists per group index (a
        group index ``select`` leaves out is not in the view)."""
        return self._view(self.source, select, names)

    def sink_view(self, select: Mapping[int, Sequence[int]] | None = None, *, names: bool = True) -> View:
        """Like :meth:`source_view`, on the sink's slots."""
        return self._view(self.sink, select, names)

    def rows_of(self, select: Mapping[int, Sequence[int]] | None) -> list[np.ndarray]:
        """The plan row indices each group of a view built with ``select`` lends."""
        out = []
        for gi, g in enumerate(self.plan.groups):
            if select is None:
                out.append(np.arange(g.rows))
            else:
                out.append(np.asarray(select.get(gi, ()), dtype=np.int64))
        return out

    # -- checks -----------------------------------------------------------------------------------

    def apply_fetch(self, outcome: Outcome, select: Mapping[int, Sequence[int]] | None = None) -> None:
        """Check a fetch's outcome against memory: every row whose bit is true holds the source's
        bytes (A7); no slot outside the fetched rows changed (S2). Rows whose bit is false become
        undefined, as the contract says."""
        rows = self.rows_of(select)
        for gi, mask in zip(self.groups_in(select), outcome.masks, strict=True):
            g = self.plan.groups[gi]
            got = rows[gi][mask]
            if got.size:
                slots = self.sink.slots[gi][got]
                actual = self.sink.memories[gi].read(slots)
                wrong = np.flatnonzero((actual != self.data[gi][got]).any(axis=1))
                assert wrong.size == 0, (
                    f"A7: row(s) {got[wrong][:8].tolist()} of group {g.group_id} are marked delivered but their "
                    "bytes differ from the source's")
                self.sink.model[gi][slots] = self.data[gi][got]
                self.sink.known[gi][slots] = True
            missed = rows[gi][~mask]
            self.sink.known[gi][self.sink.slots[gi][missed]] = False
        self.sink.verify("after a fetch concluded and quiesced")
        self.source.verify("source rows are only ever read: by a publish, never written")

    def forget_sink(self, select: Mapping[int, Sequence[int]] | None = None) -> None:
        """Mark the sink rows of ``select`` undefined (an attempt that may have written them)."""
        for gi, rows in enumerate(self.rows_of(select)):
            self.sink.known[gi][self.sink.slots[gi][rows]] = False

    def write_sink(self, select: Mapping[int, Sequence[int]] | None, value: int) -> None:
        """Overwrite the sink rows of ``select`` with ``value`` bytes (as the holder may, once an
        attempt quiesced) and remember it."""
        for gi, rows in enumerate(self.rows_of(select)):
            slots = self.sink.slots[gi][rows]
            if slots.size:
                self.sink.memories[gi].fill(slots, value)
                self.sink.model[gi][slots] = value
                self.sink.known[gi][slots] = True

    def write_source(self, select: Mapping[int, Sequence[int]] | None, value: int) -> None:
        """Overwrite the source rows of ``select`` with ``value`` bytes (the bench's data stays
        the bytes a fetch must deliver)."""
        for gi, rows in enumerate(self.rows_of(select)):
            slots = self.source.slots[gi][rows]
            if slots.size:
                self.source.memories[gi].fill(slots, value)
                self.source.model[gi][slots] = value

    def verify(self, why: str) -> None:
        self.source.verify(why)
        self.sink.verify(why)

    def close(self) -> None:
        for registration in self.registrations:
            registration.close()
        self.registrations.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def simple_plan(groups: int = 2, rows: int = 4, slot_bytes: int = 64, seed: int = 7, spare: int = 2,
                name_width: int = 16, shared_names: bool = False) -> ViewPlan:
    """A fixed plan for example-based tests: ``groups`` PAGED groups of ``rows`` rows each."""
    plans = []
    for gid in range(groups):
        slots = tuple(range(spare, spare + rows))
        sink = tuple(reversed(range(spare, spare + rows)))
        plans.append(GroupPlan(gid, CacheKind.PAGED, slot_bytes, rows, slots, sink, rows + 2 * spare, name_width))
    return ViewPlan(tuple(plans), seed, shared_names)
