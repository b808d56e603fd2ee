"""A :class:`Lease`: the lender's promise over exactly one :class:`~kvwire.contract.View`.

Until :meth:`Lease.release`, the rows the view locates stay allocated and pinned (never evicted,
never lent for writing to anyone else). The view itself is an immutable snapshot that outlives
the lease (V2). The delivery masks are taken once; release happens once, on every path."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import numpy as np

from kvwire.contract import View
from kvwire.lender.errors import LeaseError
from kvwire.lender.request import Request

__all__ = ["Lease", "LeaseKind", "LeaseOwner", "LeasedRows"]

log = logging.getLogger(__name__)


class LeaseKind(enum.Enum):
    READ = "read"      # a request's committed rows, to publish
    WRITE = "write"    # a request's rows to fill, by a fetch
    NAMES = "names"    # rows found by name in the reuse tree, to serve a request-free pull


@dataclass(frozen=True, slots=True)
class LeasedRows:
    """What a lease holds in its lender's cache, as the lender lent it (read-only arrays): the
    pool slots of its PAGED rows, the request's block index of each (a WRITE lease), the view
    group of each PAGED group in layout order, ``(view group, group id, state slot)`` per STATE
    row, and its staging rows (PAGED rows, then one state row), if staged. ``checkpoint`` is
    ``None`` when the STATE rows are request state slots; else they are checkpoint rows (pinned
    through their block's slot), and for a WRITE lease it is the request's block index whose
    checkpoint the rows fetch."""

    block_slots: np.ndarray
    block_index: np.ndarray | None
    paged_pos: tuple[int, ...]
    state: tuple[tuple[int, int, int], ...]
    stage_rows: np.ndarray | None
    checkpoint: int | None = None

    def __post_init__(self) -> None:
        for array in (self.block_slots, self.block_index, self.stage_rows):
            if array is not None:
                array.setflags(write=False)


class LeaseOwner(Protocol):
    """What a :class:`Lease` asks of the lender that lent it; it asks nothing else."""

    def lease_marked(self, lease: Lease, masks: tuple[np.ndarray, ...]) -> None:
        """A WRITE lease's checked masks: make its marked rows valid rows of its request. Called
        once, with the lease's lock held."""

    def lease_released(self, lease: Lease) -> None:
        """Give back the lease's pins, staging rows and write claims. Called once, with the
        lease's lock held."""


class Lease:
    """Made only by a lender (a :class:`LeaseOwner`), complete: its view and the event that
    completes the copies into the view's rows are given at construction. Usable as a context
    manager: leaving the ``with`` block releases it, also when the block raises."""

    __slots__ = (
        "_owner", "kind", "view", "found", "request", "rows", "_event", "_masks", "_released", "_lock", "staged",
    )

    def __init__(self, owner: LeaseOwner, kind: LeaseKind, view: View, rows: LeasedRows, *, found: int,
                 request: Request | None, event: Any) -> None:
        self._owner = owner
        self.kind = kind
        self.view = view
        #: Rows of each PAGED group: for a NAMES lease, how many leading names the tree held.
        self.found = found
        self.request = request
        self.rows = rows
        self.staged = rows.stage_rows is not None
        self._event = event
        self._masks: tuple[np.ndarray, ...] | None = None
        self._released = False
        self._lock = threading.Lock()

    # -- readiness ---------------------------------------------------------------------------

    def ready(self) -> bool:
        """True once every copy into the view's rows has completed (the staging copy of a read
        lease, or on CUDA the work queued on the pool before the lease was lent)."""
        event = self._event
        return event is None or bool(event.query())

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Waits until :meth:`ready` or ``timeout`` seconds pass; returns :meth:`ready`."""
        if self.ready():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 50e-6
        while not self.ready():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        return True

    # -- delivery ----------------------------------------------------------------------------

    @property
    def masks(self) -> tuple[np.ndarray, ...] | None:
        """The delivery masks given to :meth:`mark_arrived`, or ``None`` before."""
        return self._masks

    @property
    def marked(self) -> bool:
        return self._masks is not None

    @property
    def released(self) -> bool:
        return self._released

    def mark_arrived(self, masks: Sequence[np.ndarray]) -> int:
        """Takes the delivery masks, one bool array per view group, once. For a WRITE lease the
        rows whose bit is true become valid rows of the request (staged rows are copied into the
        pool, only those, A7); for a READ or NAMES lease the masks are only recorded. Returns the
        number of rows marked true."""
        checked = self._check_masks(masks)
        with self._lock:
            if self._released:
                raise LeaseError("mark_arrived after release: the rows are no longer the lease's; mark first")
            if self._masks is not None:
                raise LeaseError("mark_arrived was already called on this lease; masks are taken once")
            self._masks = checked
            if self.kind is LeaseKind.WRITE:
                self._owner.lease_marked(self, checked)
        return int(sum(int(np.count_nonzero(m)) for m in checked))

    def _check_masks(self, masks: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
        if isinstance(masks, np.ndarray) or not isinstance(masks, Sequence):
            raise TypeError("masks is a sequence of bool arrays, one per view group (e.g. outcome.masks)")
        groups = self.view.groups
        if len(masks) != len(groups):
            raise ValueError(f"expected {len(groups)} mask(s), one per view group, got {len(masks)}")
        out = []
        for i, (mask, group) in enumerate(zip(masks, groups, strict=True)):
            dtype = getattr(mask, "dtype", None)
            if dtype is None:
                raise TypeError(f"mask {i} (group {group.group_id}) must be a bool numpy array, got {type(mask).__name__}")
            if np.dtype(dtype) != np.bool_:
                raise TypeError(f"mask {i} (group {group.group_id}) must have dtype bool, got {dtype}")
            plain = np.array(mask, dtype=bool, copy=True, subok=False)
            if plain.shape != (group.rows,):
                raise ValueError(
                    f"mask {i} (group {group.group_id}) must have shape ({group.rows},), got {plain.shape}"
                )
            plain.setflags(write=False)
            out.append(plain)
        return tuple(out)

    # -- release -----------------------------------------------------------------------------

    def release(self) -> None:
        """Returns the lease's pins and staging rows; idempotent. After it, the view's rows are
        no longer protected (the view itself stays readable)."""
        with self._lock:
            if self._released:
                return
            self._released = True
            if self._event is not None and self.staged:
                # A staging copy may still be writing the rows about to be given back.
                self._event.synchronize()
            self._owner.lease_released(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __del__(self) -> None:
        # Never releases here (a collector may run inside the lender's lock); says who leaked.
        if not getattr(self, "_released", True):
            log.warning("%r was garbage-collected without release(): its pins and staging rows are lost", self)

    def __repr__(self) -> str:
        state = "released" if self._released else ("marked" if self._masks is not None else "open")
        return f"Lease({self.kind.value}, {state}, rows={self.view.rows}, staged={self.staged})"
