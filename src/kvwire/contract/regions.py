"""The one reading of M3 and M4, for every backend: :class:`RegionTable`.

A backend keeps the regions the holder registered with it in a table and asks the table, for each
submission, where each row lies. The rules it applies are the contract's (``docs/contract.md``):

- M3: one batch, one :class:`~kvwire.contract.backend.Registration`; a region of a memory kind
  the backend does not reach, or one that overlaps another region of the batch or a registered
  region (same memory kind and device), refuses the whole batch and registers nothing; closing
  is idempotent and removes exactly that batch, never a later registration of the same span.
- M4: a row is recognized when its bytes ``[address, address + slot_bytes)`` lie wholly inside
  one registered region of the same memory kind and device. A view's region may be a sub-span of
  a registered region, or another description of registered memory: what counts is where the
  rows are. A row that is not recognized refuses the whole submission with
  ``InvalidSubmission``; a backend never skips rows.

Thread-safe; the lookups are vectorized over a group's rows."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvwire.contract.backend import Registration
from kvwire.contract.errors import InvalidSubmission, SubmissionRejected
from kvwire.contract.memory import MemoryKind, SlotRegion
from kvwire.contract.view import LayerGroupRows, View

__all__ = ["RegionTable", "TableRegistration", "Located"]


@dataclass(frozen=True, slots=True)
class Located:
    """Where one group's rows lie: the registered region holding them all (``None`` for a group
    without rows), each row's byte offset in it, the registration it belongs to, and whether the
    rows are consecutive slots in row order (``adjacent``: one span of memory; ``False`` when not
    known), which a backend may use to skip a pass over the offsets."""

    region: SlotRegion | None
    offsets: np.ndarray
    token: int = 0
    adjacent: bool = False


class TableRegistration(Registration):
    """The regions one :meth:`RegionTable.register` call added; closing removes exactly them."""

    def __init__(self, table: RegionTable, token: int, regions: tuple[SlotRegion, ...]) -> None:
        self._table = table
        self._token = token
        self._regions = regions

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        return self._regions

    @property
    def token(self) -> int:
        """This registration's number in its table (unique for the table's life)."""
        return self._token

    @property
    def closed(self) -> bool:
        return not self._table.holds(self._token)

    def close(self) -> None:
        self._table.unregister(self._token)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<TableRegistration {self._token} of {len(self._regions)} region(s), {state}>"


def _domain(region: SlotRegion) -> tuple[MemoryKind, int | None]:
    return region.memory_kind, region.device


class RegionTable:
    """The regions registered with one backend instance (B1: never shared between instances)."""

    def __init__(self, memory_kinds: frozenset[MemoryKind] | set[MemoryKind]) -> None:
        self._kinds = frozenset(memory_kinds)
        self._entries: list[tuple[int, SlotRegion]] = []
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)
        self._closed = False

    def register(self, regions: Sequence[SlotRegion]) -> TableRegistration:
        """Register ``regions`` as one batch (M3). Raises ``InvalidSubmission`` naming the region
        and what is wrong, registering nothing; ``SubmissionRejected`` after :meth:`close`."""
        batch = tuple(regions)
        for region in batch:
            if not isinstance(region, SlotRegion):
                raise InvalidSubmission(f"register_regions takes SlotRegions, got {type(region).__name__}")
            if region.memory_kind not in self._kinds:
                kinds = ", ".join(sorted(k.value for k in self._kinds))
                raise InvalidSubmission(
                    f"region {region.region_id} is {region.memory_kind.value} memory; this backend reaches {kinds}")
        for a, b in itertools.combinations(batch, 2):
            if a.overlaps(b):
                raise InvalidSubmission(f"regions {a.region_id} and {b.region_id} of one batch overlap")
        with self._lock:
            if self._closed:
                raise SubmissionRejected("the backend is shut down; it registers no more regions")
            for region in batch:
                for _, held in self._entries:
                    if region.overlaps(held):
                        raise InvalidSubmission(
                            f"region {region.region_id} [{region.base:#x}, {region.end:#x}) overlaps registered "
                            f"region {held.region_id} [{held.base:#x}, {held.end:#x}); close that registration first")
            token = next(self._tokens)
            self._entries.extend((token, r) for r in batch)
        return TableRegistration(self, token, batch)

    def unregister(self, token: int) -> None:
        """Remove the regions of registration ``token``; idempotent."""
        with self._lock:
            self._entries = [e for e in self._entries if e[0] != token]

    def holds(self, token: int) -> bool:
        """Whether registration ``token`` is still in the table."""
        with self._lock:
            return any(t == token for t, _ in self._entries)

    def close(self) -> None:
        """Refuse later registrations (a backend calls this from ``shutdown()``). Regions already
        registered stay until their registrations close."""
        with self._lock:
            self._closed = True

    @property
    def regions(self) -> tuple[SlotRegion, ...]:
        """Every registered region now."""
        with self._lock:
            return tuple(r for _, r in self._entries)

    def locate(self, group: LayerGroupRows, index: int = 0) -> Located:
        """Where ``group``'s rows lie (M4): one registered region holding every row, and each
        row's byte offset in it. Raises ``InvalidSubmission`` naming the group (``index`` is its
        position in the view) when a row lies outside every registered region of its memory
        kind and device, or the rows straddle two registrations."""
        region = group.region
        if not group.rows:
            return Located(None, np.zeros(0, dtype=np.int64))
        domain = _domain(region)
        with self._lock:
            entries = [e for e in self._entries if _domain(e[1]) == domain]
        # The usual case: the view's region is (inside) one registered region.
        base, end = region.base, region.end
        for token, held in entries:
            if held.base <= base and end <= held.end:
                offsets = group.slots * region.slot_bytes  # slots are int64 (LayerGroupRows): a new array
                if base != held.base:
                    offsets += base - held.base
                # strictly increasing slots (known from the group's construction) that span
                # exactly as many slots as there are rows are consecutive
                slots = group.slots
                adjacent = group._ascending and int(slots[-1]) - int(slots[0]) == len(slots) - 1
                return Located(held, offsets, token, adjacent)
        addresses = group.addresses().astype(np.int64)
        ends = addresses + region.slot_bytes
        for token, held in entries:
            inside = (addresses >= held.base) & (ends <= held.end)
            if inside.all():
                return Located(held, addresses - held.base, token)
        raise InvalidSubmission(
            f"group {index} (id {group.group_id}) lends rows of region {region.region_id} "
            f"[{region.base:#x}, {region.end:#x}) that lie outside every registered region; "
            "register the region first (register_regions)")

    def locate_view(self, view: View) -> tuple[Located, ...]:
        """:meth:`locate` for every group of ``view``, in order; the first unrecognized group
        refuses the whole view, and anything that is not a ``View`` is refused as malformed (S3.2)."""
        if not isinstance(view, View):
            raise InvalidSubmission(f"a submission takes a kvwire View, got {type(view).__name__}")
        return tuple(self.locate(group, i) for i, group in enumerate(view.groups))
