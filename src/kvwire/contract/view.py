"""What a lease lends: a :class:`View` of :class:`LayerGroupRows` (V1-V4)."""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwire.contract.memory import MemoryKind, SlotRegion

__all__ = ["CacheKind", "TokenRange", "LayerGroupRows", "View", "frozen_array"]

#: Content names are fixed-width byte strings; this bounds the width a view may carry.
MAX_NAME_BYTES = 64


#: The arrays :func:`frozen_array` made, by id (weakly: an entry goes with its array).
_FROZEN: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def frozen_array(value: Any, dtype: Any, what: str, ndim: int) -> np.ndarray:
    """A read-only copy of ``value`` as a plain ndarray of ``dtype`` and ``ndim`` dimensions.

    A copy, so no one who held the input can change the snapshot afterwards (V2), except where no
    one can write the input's bytes, which is then taken as it is (read-only, contiguous, of the
    dtype and dimensions asked): an array this function made (a group's ``slots`` or ``names``),
    so a view of many groups that share their slots and names copies them once (pass the first
    group's arrays on); and a read-only array over a ``bytes`` object (``np.frombuffer(b"...")``
    and read-only views of it), whose bytes Python never changes."""
    if type(value) is np.ndarray and not value.flags.writeable and value.dtype == dtype and value.ndim == ndim \
            and value.flags.c_contiguous and (_FROZEN.get(id(value)) is value or _over_bytes(value)):
        return value
    try:
        array = np.array(value, dtype=dtype, copy=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"{what} must be convertible to {np.dtype(dtype)}: {exc}") from None
    if array.ndim != ndim:
        raise ValueError(f"{what} must have {ndim} dimension(s), got shape {array.shape}")
    array.setflags(write=False)
    _FROZEN[id(array)] = array
    return array


def _over_bytes(array: np.ndarray) -> bool:
    """Whether ``array`` and every array it views are read-only and the memory is a ``bytes``
    object's (immutable: numpy refuses to make such an array writable again)."""
    base: Any = array
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    return type(base) is bytes


class CacheKind(enum.Enum):
    """``PAGED``: block rows whose token end is an upper bound (any prefix is valid).
    ``STATE``: one slot standing for the whole request, whose end is an exact checkpoint."""

    PAGED = "paged"
    STATE = "state"


@dataclass(frozen=True, slots=True, order=True)
class TokenRange:
    """Tokens ``[start, end)``; both non-negative and ``start <= end``."""

    start: int
    end: int

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"TokenRange.{name} must be an int, got {type(value).__name__}")
            object.__setattr__(self, name, int(value))
        if self.start < 0:
            raise ValueError(f"TokenRange.start must be >= 0, got {self.start}")
        if self.end < self.start:
            raise ValueError(f"TokenRange is half-open [start, end): end {self.end} < start {self.start}")

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, token: object) -> bool:
        return isinstance(token, (int, np.integer)) and self.start <= int(token) < self.end


@dataclass(frozen=True, slots=True)
class LayerGroupRows:
    """The rows one layer group lends: slot indices into ``region``, optionally a fixed-width
    content name per row (``names``, shape ``(rows, width)`` uint8), and the tokens they cover.

    Every array is a read-only copy taken at construction (V2)."""

    group_id: int
    kind: CacheKind
    region: SlotRegion
    slots: np.ndarray
    tokens: TokenRange
    names: np.ndarray | None = None
    #: whether the slot indices strictly increase (set at construction, for V4's quick test)
    _ascending: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.group_id, (int, np.integer)) or isinstance(self.group_id, bool):
            raise TypeError(f"LayerGroupRows.group_id must be an int, got {self.group_id!r}")
        object.__setattr__(self, "group_id", int(self.group_id))
        if self.group_id < 0:
            raise ValueError(f"LayerGroupRows.group_id must be >= 0, got {self.group_id}")
        if not isinstance(self.kind, CacheKind):
            raise TypeError(f"LayerGroupRows.kind must be a CacheKind, got {self.kind!r}")
        if not isinstance(self.region, SlotRegion):
            raise TypeError(f"LayerGroupRows.region must be a SlotRegion, got {type(self.region).__name__}")
        if not isinstance(self.tokens, TokenRange):
            raise TypeError(f"LayerGroupRows.tokens must be a TokenRange, got {self.tokens!r}")
        slots = self.slots
        if isinstance(slots, np.ndarray) and slots.dtype.kind not in "iu":
            raise TypeError(f"group {self.group_id}: slots must be integers, got dtype {slots.dtype}")
        slots = frozen_array(slots, np.int64, f"group {self.group_id} slots", 1)
        # One pass: strictly increasing slots (the usual view) have their bounds at their ends,
        # and let View.overlapping_rows skip this group's pass (V4).
        ascending = slots.size < 2 or bool((slots[1:] > slots[:-1]).all())
        if slots.size:
            low, high = (slots[0], slots[-1]) if ascending else (slots.min(), slots.max())
            if low < 0 or high >= self.region.slot_count:
                raise ValueError(
                    f"group {self.group_id}: slot indices must lie in [0, {self.region.slot_count}) "
                    f"of region {self.region.region_id}; got [{low}, {high}]"
                )
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "_ascending", ascending)
        if self.kind is CacheKind.STATE and slots.size != 1:
            raise ValueError(
                f"group {self.group_id}: a STATE group lends exactly one slot, got {slots.size}"
            )
        if self.names is not None:
            names = self.names
            if isinstance(names, (list, tuple)) and names and isinstance(names[0], bytes):
                widths = {len(n) for n in names}
                if len(widths) != 1:
                    raise ValueError(f"group {self.group_id}: names must share one width, got {sorted(widths)}")
                names = np.frombuffer(b"".join(names), dtype=np.uint8).reshape(len(names), -1)
            names = frozen_array(names, np.uint8, f"group {self.group_id} names", 2)
            if names.shape[0] != slots.size:
                raise ValueError(
                    f"group {self.group_id}: {names.shape[0]} names for {slots.size} rows; give one per row"
                )
            if not 1 <= names.shape[1] <= MAX_NAME_BYTES:
                raise ValueError(
                    f"group {self.group_id}: name width must be 1..{MAX_NAME_BYTES} bytes, got {names.shape[1]}"
                )
            object.__setattr__(self, "names", names)

    @property
    def rows(self) -> int:
        """How many rows the group lends."""
        return int(self.slots.size)

    def addresses(self) -> np.ndarray:
        """The start address of each row (uint64), in row order."""
        return self.region.addresses(self.slots)

    def name(self, row: int) -> bytes:
        """The content name of ``row`` as bytes; raises if the group carries no names."""
        if self.names is None:
            raise ValueError(f"group {self.group_id} carries no content names")
        return self.names[row].tobytes()


@dataclass(frozen=True, slots=True)
class View:
    """An immutable snapshot of what a lease lends: one :class:`LayerGroupRows` per layer group,
    in order. It stays valid after the lease is returned; the lease bounds only the protection
    of the payload (V2)."""

    groups: tuple[LayerGroupRows, ...]

    def __post_init__(self) -> None:
        groups = tuple(self.groups)
        for group in groups:
            if not isinstance(group, LayerGroupRows):
                raise TypeError(f"View.groups holds LayerGroupRows, got {type(group).__name__}")
        ids = [g.group_id for g in groups]
        if len(set(ids)) != len(ids):
            raise ValueError(f"View group ids must be unique, got {ids}")
        object.__setattr__(self, "groups", groups)

    def row_masks(self) -> tuple[np.ndarray, ...]:
        """New, writable, all-false bool arrays, one per group, on every call (V3)."""
        return tuple(np.zeros(g.rows, dtype=bool) for g in self.groups)

    @property
    def rows(self) -> int:
        """How many rows the view lends across all groups."""
        return sum(g.rows for g in self.groups)

    def regions(self) -> tuple[SlotRegion, ...]:
        """The distinct regions the view's rows lie in, in first-seen order."""
        seen: dict[int, SlotRegion] = {}
        for g in self.groups:
            seen.setdefault(id(g.region), g.region)
        return tuple(seen.values())

    def _disjoint_by_slots(self) -> bool:
        """A sufficient test for V4 that builds no address array: every group's slot indices
        strictly increase (a slot lies inside its region, so two slots of one region share no
        byte) and no two groups' regions share a byte. ``False`` means "look row by row", not
        "overlap". A view's usual shape passes it without a pass over its slots (each group
        knows from its construction whether they strictly increase)."""
        for g in self.groups:
            if not g._ascending:
                return False
        if len(self.groups) == 1:  # one group: no other group's region to share a byte with
            return True
        spans = []
        for g in self.groups:
            if g.slots.size:
                r = g.region
                spans.append((r.memory_kind.value, -1 if r.device is None else r.device, r.base, r.end))
        spans.sort()
        return all(a[:2] != b[:2] or a[3] <= b[2] for a, b in zip(spans[:-1], spans[1:], strict=True))

    def overlapping_rows(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Two ``(group index, row)`` pairs whose memory overlaps, or ``None`` if every row's
        memory is disjoint from every other's (V4). Vectorized: rows already in ascending
        address order (the usual case) are checked without a sort."""
        if self.rows < 2 or self._disjoint_by_slots():
            return None
        counts = [g.rows for g in self.groups]
        start = np.concatenate([g.addresses() for g in self.groups])
        end = start + np.repeat(np.array([g.region.slot_bytes for g in self.groups], dtype=np.uint64), counts)
        domains: dict[tuple[MemoryKind, int | None], int] = {}
        keys = [domains.setdefault((g.region.memory_kind, g.region.device), len(domains)) for g in self.groups]
        if len(domains) == 1:
            if bool((start[1:] >= end[:-1]).all()):
                return None
            order = np.argsort(start, kind="stable")
            same = np.ones(len(order) - 1, dtype=bool)
        else:
            domain = np.repeat(np.array(keys, dtype=np.int64), counts)
            order = np.lexsort((start, domain))
            same = domain[order[1:]] == domain[order[:-1]]
        clash = same & (start[order[1:]] < end[order[:-1]])
        if not clash.any():
            return None
        i = int(np.argmax(clash))
        bounds = np.cumsum(counts)

        def where(flat: int) -> tuple[int, int]:
            gi = int(np.searchsorted(bounds, flat, side="right"))
            return gi, flat - (int(bounds[gi - 1]) if gi else 0)

        return where(int(order[i])), where(int(order[i + 1]))
