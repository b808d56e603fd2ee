"""A driver call's answer: one :class:`KeyStatus` per key and the reasons of the keys that
failed or were declined (:class:`BatchResult`). Apart from :mod:`kvwire.blob.driver`, which
re-exports them, so that :mod:`kvwire.blob.parts` (which the driver's default methods call)
needs nothing of the driver's module."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["KeyStatus", "BatchResult", "all_ok"]


class KeyStatus(enum.IntEnum):
    """Per-key answer of a driver call."""

    OK = 0             #: put stored a new object; get read it whole; remove removed it; contains: held
    ALREADY_THERE = 1  #: put found an object under this key and kept its bytes unchanged
    DECLINED = 2       #: put refused for space; not a fault, the object is simply not stored
    MISSING = 3        #: get, remove or contains found no object under this key: a miss
    BUSY = 4           #: remove refused for now (the store still leases the object)
    FAILED = 5         #: a fault; the batch result's reason says why


_HIGHEST_STATUS = int(max(KeyStatus))


#: Read-only arrays of OK codes by length, shared, since nobody can write them.
_OK_CODES: dict[int, np.ndarray] = {}


def _all_ok(n: int) -> np.ndarray:
    """A read-only array of ``n`` OK codes (shared; at most 64 lengths are kept)."""
    status = _OK_CODES.get(n)
    if status is None:
        status = np.zeros(n, dtype=np.uint8)  # KeyStatus.OK is 0
        status.setflags(write=False)
        if len(_OK_CODES) >= 64:
            _OK_CODES.clear()
        _OK_CODES[n] = status
    return status


def all_ok(status: np.ndarray) -> bool:
    """Whether every code of a :class:`BatchResult`'s ``status`` is ``OK``: at once for the
    shared array :meth:`BatchResult.ok` answers, else by looking at the codes."""
    return _OK_CODES.get(status.size) is status or not status.any()


@dataclass(frozen=True, slots=True)
class BatchResult:
    """One status per key (uint8 :class:`KeyStatus` codes, read-only) and a reason for each key
    whose status is ``FAILED`` or ``DECLINED`` (index -> text)."""

    status: np.ndarray
    reasons: Mapping[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        status = np.array(self.status, dtype=np.uint8, copy=True)
        if status.ndim != 1:
            raise ValueError(f"BatchResult.status must be one-dimensional, got shape {status.shape}")
        if status.size and status.max() > _HIGHEST_STATUS:
            raise ValueError(f"BatchResult.status holds an unknown code {int(status.max())}")
        status.setflags(write=False)
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "reasons", dict(self.reasons))

    @classmethod
    def ok(cls, n: int) -> BatchResult:
        """Every one of ``n`` keys ``OK``: the common answer, made without checking codes."""
        result = object.__new__(cls)
        object.__setattr__(result, "status", _all_ok(n))
        object.__setattr__(result, "reasons", {})
        return result

    @classmethod
    def uniform(cls, n: int, status: KeyStatus, reason: str | None = None) -> BatchResult:
        """Every key answered alike, e.g. every key ``FAILED`` because the store is unreachable."""
        reasons = {i: reason for i in range(n)} if reason is not None else {}
        return cls(np.full(n, int(status), dtype=np.uint8), reasons)

    def where(self, status: KeyStatus) -> np.ndarray:
        """A bool mask of the keys answered ``status``."""
        return self.status == int(status)

    def first_reason(self) -> str | None:
        """The reason of the lowest-indexed key that has one."""
        return self.reasons[min(self.reasons)] if self.reasons else None
