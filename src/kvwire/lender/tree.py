"""The reuse tree over block slots: which slots hold a named (committed) block, who pins them,
which are free, and which go first when a slot must be found (LRU, leaves before parents).

Every method assumes the caller holds the lender's lock. Slot state lives in numpy arrays so
pinning, unpinning and allocation are vectorized; only the name index is a dict (O(1) a name)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvwire.lender.errors import CacheFull
from kvwire.lender.names import NAME_BYTES

__all__ = ["ReuseTree"]

log = logging.getLogger(__name__)


class ReuseTree:
    """Block slots ``0 .. num_blocks-1``: a slot is *pinned* (refs > 0), *committed and idle*
    (named in the tree, evictable), or *free*. A pinned slot is never evicted."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refs = np.zeros(num_blocks, dtype=np.int64)
        self.in_tree = np.zeros(num_blocks, dtype=bool)
        self.last_used = np.zeros(num_blocks, dtype=np.int64)
        self.parent = np.full(num_blocks, -1, dtype=np.int64)
        self.position = np.zeros(num_blocks, dtype=np.int64)
        self.slot_names = np.zeros((num_blocks, NAME_BYTES), dtype=np.uint8)
        self.index: dict[bytes, int] = {}
        self.clock = 0
        self.evictions = 0
        self.lookups = 0
        self.lookup_blocks = 0
        self.lookup_hits = 0

    # -- queries -----------------------------------------------------------------------------

    def idle(self) -> int:
        """Slots an allocation could take now: free plus committed-and-unpinned."""
        return int(np.count_nonzero(self.refs == 0))

    def lookup(self, keys: Sequence[bytes]) -> np.ndarray:
        """The slots of the longest leading run of ``keys`` held in the tree (O(1) a key); pins
        nothing, so a caller that pins what it found has nothing to roll back on a miss."""
        get = self.index.get
        found: list[int] = []
        append = found.append
        for key in keys:
            slot = get(key)
            if slot is None:
                break
            append(slot)
        self.lookups += 1
        self.lookup_blocks += len(keys)
        self.lookup_hits += len(found)
        return np.array(found, dtype=np.int64)

    def holds(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the tree holds; no pins, no statistics."""
        index = self.index
        count = 0
        for key in keys:
            if key not in index:
                break
            count += 1
        return count

    def prefix(self, slot: int) -> list[int]:
        """The committed slots from the tree's root down to ``slot``, following parent links (a
        parent evicted since ends the walk early)."""
        chain = [slot]
        while (up := int(self.parent[chain[-1]])) >= 0 and self.in_tree[up]:
            chain.append(up)
        return chain[::-1]

    # -- pins --------------------------------------------------------------------------------

    def pin(self, slots: np.ndarray) -> None:
        np.add.at(self.refs, slots, 1)

    def unpin(self, slots: np.ndarray) -> None:
        """Drops one pin per entry. Slots are stamped in reverse so that, of a chain released
        together, the deepest block is the least recently used and is evicted first."""
        if slots.size == 0:
            return
        np.subtract.at(self.refs, slots, 1)
        if (self.refs[slots] < 0).any():
            bad = slots[self.refs[slots] < 0]
            np.add.at(self.refs, slots, 1)
            raise RuntimeError(f"unbalanced unpin of block slots {bad[:8].tolist()}: a pin was returned twice")
        self.last_used[slots] = self.clock + np.arange(slots.size - 1, -1, -1, dtype=np.int64)
        self.clock += int(slots.size)

    # -- allocation --------------------------------------------------------------------------

    def allocate(self, count: int, *, keep: np.ndarray | None = None) -> np.ndarray:
        """``count`` slots, pinned once each: free ones first, then the least recently used
        unpinned committed ones, evicted from the tree. ``keep`` (slots the caller is about to
        pin) are never taken. Raises :class:`CacheFull`, having changed nothing, when too few
        slots are idle."""
        if count <= 0:
            return np.zeros(0, dtype=np.int64)
        idle = self.refs == 0
        if keep is not None and keep.size:
            idle[keep] = False
        available = int(np.count_nonzero(idle))
        if available < count:
            raise CacheFull(
                f"need {count} block slot(s) but only {available} of {self.num_blocks} are free or "
                f"evictable; {int(np.count_nonzero(self.refs))} are pinned by open requests and leases"
            )
        free = np.flatnonzero(idle & ~self.in_tree)
        if free.size >= count:
            taken = free[:count]
        else:
            need = count - free.size
            candidates = np.flatnonzero(idle & self.in_tree)
            oldest = np.argpartition(self.last_used[candidates], need - 1)[:need]
            victims = candidates[oldest]
            self._evict(victims)
            taken = np.concatenate([free, victims])
        self.refs[taken] += 1
        return taken.astype(np.int64, copy=False)

    def _evict(self, victims: np.ndarray) -> None:
        index = self.index
        for key in self.slot_names[victims].view(np.dtype((np.void, NAME_BYTES))).ravel().tolist():
            del index[key]
        self.in_tree[victims] = False
        self.parent[victims] = -1
        self.evictions += int(victims.size)
        log.debug("evicted %d block(s) from the reuse tree", victims.size)

    # -- naming ------------------------------------------------------------------------------

    def insert(self, slot: int, key: bytes, position: int, parent: int) -> None:
        """Names ``slot`` (block ``position`` of its prompt) in the tree under ``key``; the
        caller checked that ``key`` is not held yet."""
        self.index[key] = slot
        self.in_tree[slot] = True
        self.slot_names[slot] = np.frombuffer(key, dtype=np.uint8)
        self.position[slot] = position
        self.parent[slot] = parent
