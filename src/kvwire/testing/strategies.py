"""Hypothesis strategies for the contract's data: view plans (group counts, cache kinds, row
counts, slot choices, names), delivery masks, hints, and fault schedules.

They are public: a plugin's own tests may draw from them too. Everything drawn is plain data;
:class:`~kvwire.testing.layout.Bench` turns a plan into memory and views."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from kvwire.contract import CacheKind, Hint
from kvwire.testing.harness import FaultPlan
from kvwire.testing.layout import GroupPlan, ViewPlan

__all__ = [
    "SLOT_BYTES",
    "NAME_WIDTHS",
    "group_plans",
    "view_plans",
    "selections",
    "masks",
    "hint_values",
    "hints",
    "fault_plans",
    "fault_schedules",
]

#: Slot sizes drawn: odd sizes and sizes around common page rows.
SLOT_BYTES: tuple[int, ...] = (1, 7, 64, 100, 256, 4096)
#: Content name widths drawn (bytes).
NAME_WIDTHS: tuple[int, ...] = (2, 8, 16, 32)


@st.composite
def group_plans(draw: st.DrawFn, group_id: int, *, max_rows: int = 8, kinds: tuple[CacheKind, ...] = tuple(CacheKind),
                min_rows: int = 0, rows: int | None = None, slot_bytes: int | None = None,
                name_width: int | None = None) -> GroupPlan:
    """One group: its kind, slot size, rows and the distinct slots they take on each side, in a
    region with a few spare slots that must stay untouched."""
    kind = draw(st.sampled_from(kinds))
    if kind is CacheKind.STATE:
        count = 1
    elif rows is not None:
        count = rows
    else:
        count = draw(st.integers(min_rows, max_rows))
    size = slot_bytes if slot_bytes is not None else draw(st.sampled_from(SLOT_BYTES))
    spare = draw(st.integers(0, 3))
    region_slots = max(1, count + spare)
    source = draw(st.permutations(range(region_slots)))[:count]
    sink = draw(st.permutations(range(region_slots)))[:count]
    width = name_width if name_width is not None else draw(st.sampled_from(NAME_WIDTHS))
    return GroupPlan(group_id, kind, size, count, tuple(source), tuple(sink), region_slots, width)


@st.composite
def view_plans(draw: st.DrawFn, *, max_groups: int = 3, max_rows: int = 8, min_groups: int = 1,
               kinds: tuple[CacheKind, ...] = tuple(CacheKind), min_rows: int = 0,
               shared_names: bool = False) -> ViewPlan:
    """A view of ``min_groups..max_groups`` groups with distinct ids. With ``shared_names``, every
    group is PAGED with the same row count and names (blocks named once for all layer groups)."""
    count = draw(st.integers(min_groups, max_groups))
    ids = draw(st.lists(st.integers(0, 15), min_size=count, max_size=count, unique=True))
    if shared_names:
        rows = draw(st.integers(max(min_rows, 1), max_rows))
        width = draw(st.sampled_from(NAME_WIDTHS[1:]))
        groups = tuple(draw(group_plans(gid, kinds=(CacheKind.PAGED,), rows=rows, name_width=width)) for gid in ids)
    else:
        groups = tuple(draw(group_plans(gid, max_rows=max_rows, kinds=kinds, min_rows=min_rows)) for gid in ids)
    seed = draw(st.integers(0, 2**32 - 1))
    return ViewPlan(groups, seed, shared_names)


@st.composite
def selections(draw: st.DrawFn, plan: ViewPlan, *, min_size: int = 0) -> dict[int, list[int]]:
    """A subset of each group's rows (by group index), in a drawn order."""
    out: dict[int, list[int]] = {}
    for gi, g in enumerate(plan.groups):
        chosen = draw(st.lists(st.integers(0, max(0, g.rows - 1)), unique=True, max_size=g.rows,
                               min_size=min(min_size, g.rows))) if g.rows else []
        out[gi] = chosen
    return out


@st.composite
def masks(draw: st.DrawFn, rows: int | None = None, *, writable: bool | None = None) -> np.ndarray:
    """A bool delivery mask of ``rows`` bits (drawn if not given), read-only or writable."""
    n = draw(st.integers(0, 32)) if rows is None else rows
    bits = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    mask = np.array(bits, dtype=bool)
    if writable is None:
        writable = draw(st.booleans())
    mask.setflags(write=writable)
    return mask


_KEYS = st.from_regex(r"\A[a-z][a-z0-9_]{0,15}\Z")


def hint_values() -> st.SearchStrategy[Any]:
    """Every kind of value a hint field may hold."""
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=40),
        st.binary(max_size=64),
    )


@st.composite
def hints(draw: st.DrawFn, kind: str | None = None, **fixed: Any) -> Hint:
    """A hint of ``kind`` (drawn if not given) with ``fixed`` fields plus drawn ones, and maybe a
    timeout."""
    name = kind if kind is not None else draw(_KEYS)
    extra = draw(st.dictionaries(_KEYS.filter(lambda k: k not in fixed), hint_values(), max_size=5))
    timeout = draw(st.one_of(st.none(), st.floats(0.001, 3600.0)))
    return Hint(name, tuple({**extra, **fixed}.items()), timeout)


@st.composite
def fault_plans(draw: st.DrawFn, names: list[bytes], *, publish: bool = True, fetch: bool = True) -> FaultPlan:
    """Faults on a drawn subset of ``names`` for each direction (possibly none)."""
    pick = st.lists(st.sampled_from(names), unique=True, max_size=len(names)) if names else st.just([])
    return FaultPlan(
        fetch=frozenset(draw(pick)) if fetch else frozenset(),
        publish=frozenset(draw(pick)) if publish else frozenset(),
    )


def fault_schedules(ops: tuple[str, ...] = ("put", "get"), max_faults: int = 3) -> st.SearchStrategy[tuple[Any, ...]]:
    """Schedules of :mod:`kvwire.testing.faults` records for a store driver: failed calls and
    keys, declined puts, objects evicted behind the caller's back, slow calls. (Blocking faults
    are left out: the suite holds a store through :class:`~kvwire.testing.harness.Hold`.)"""
    from kvwire.testing import faults as f

    op = st.sampled_from(ops)
    call = st.one_of(st.none(), st.integers(1, 3))
    start = st.integers(0, 6)

    def key_range(kind: Any, **kw: Any) -> st.SearchStrategy[Any]:
        return st.builds(lambda s, n, **k: kind(start=s, stop=None if n is None else s + n, **k),
                         start, st.one_of(st.none(), st.integers(0, 4)), **kw)

    record = st.one_of(
        st.builds(f.FailCall, op=op, call=call),
        key_range(f.FailKeys, op=op, call=call),
        key_range(f.Decline, call=call) if "put" in ops else st.nothing(),
        key_range(f.Evict, op=st.just("get"), call=call) if "get" in ops else st.nothing(),
        st.builds(f.Slow, op=op, call=call, delay_s=st.sampled_from((0.0, 0.001, 0.005))),
    )
    return st.lists(record, max_size=max_faults).map(tuple)
