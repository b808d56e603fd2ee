"""How an attempt ended (A5) and the delivery masks it carries (A6, A7)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["Outcome", "OutcomeStatus", "Cause"]


class OutcomeStatus(enum.Enum):
    DELIVERED = "delivered"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Cause(enum.Enum):
    """Why an attempt did not deliver (A10, contract 1.1): code and metrics branch on this, never
    on the reason text. ``FAILED`` outcomes carry ``DEADLINE``, ``FAULT``, ``PEER_GONE``,
    ``DECLINED`` or ``SHUTDOWN``; ``CANCELLED`` outcomes ``HOLDER_CANCELLED``, ``PEER_CANCELLED``
    or ``SHUTDOWN``."""

    #: The attempt's deadline passed before it concluded (A8).
    DEADLINE = "deadline"
    #: The other end answered with an error (a store call failed, a peer reported a fault).
    FAULT = "fault"
    #: The other end stopped answering or went away (connection lost, process died).
    PEER_GONE = "peer-gone"
    #: The other end refused the request (a declined pull, a full store that takes nothing).
    DECLINED = "declined"
    #: The holder called ``cancel()``.
    HOLDER_CANCELLED = "holder-cancelled"
    #: The peer cancelled its side.
    PEER_CANCELLED = "peer-cancelled"
    #: This backend shut down with the attempt in flight (B3).
    SHUTDOWN = "shutdown"


_FAILED_CAUSES = frozenset({Cause.DEADLINE, Cause.FAULT, Cause.PEER_GONE, Cause.DECLINED, Cause.SHUTDOWN})
_CANCELLED_CAUSES = frozenset({Cause.HOLDER_CANCELLED, Cause.PEER_CANCELLED, Cause.SHUTDOWN})


_BOOL = np.dtype(np.bool_)


def _keep_or_copy(mask: object, index: int) -> np.ndarray:
    # The common case first, in as few steps as possible: a plain, read-only, one-dimensional
    # bool array is kept as it is (A6.3). Anything else takes the full path below, which gives
    # the same answer for that case and the errors for the others.
    if type(mask) is np.ndarray and mask.dtype is _BOOL and mask.ndim == 1 and not mask.flags.writeable:
        return mask
    dtype = getattr(mask, "dtype", None)
    if dtype is None:
        raise TypeError(f"delivery mask {index} must be a bool numpy array, got {type(mask).__name__}")
    if np.dtype(dtype) != np.bool_:
        raise TypeError(f"delivery mask {index} must have dtype bool, got {dtype}")
    if type(mask) is np.ndarray and not mask.flags.writeable:
        if mask.ndim != 1:
            raise ValueError(f"delivery mask {index} must be one-dimensional, got shape {mask.shape}")
        return mask
    # A writable mask may change under us; a subclass (masked array) may answer all() for
    # only some rows. Either way: a plain, private, read-only copy.
    plain = np.array(mask, dtype=bool, copy=True, subok=False)
    if plain.ndim != 1:
        raise ValueError(f"delivery mask {index} must be one-dimensional, got shape {plain.shape}")
    plain.setflags(write=False)
    return plain


_set = object.__setattr__
_DELIVERED, _FAILED, _CANCELLED = OutcomeStatus.DELIVERED, OutcomeStatus.FAILED, OutcomeStatus.CANCELLED


@dataclass(frozen=True, slots=True, eq=False, init=False)
class Outcome:
    """How an attempt ended: ``DELIVERED``, ``FAILED`` (with a reason) or ``CANCELLED``
    (locally, or by the peer), and one read-only bool delivery mask per view group.
    ``cause`` (contract 1.1) says in a word why it did not deliver; ``None`` from a backend that
    speaks 1.0. A cancelled outcome's cause defaults from ``by_peer``.

    For a fetch, a true bit means the row's bytes arrived whole and equal the source's; for a
    publish, that the other end now holds the row. A row the source simply does not hold is a
    miss: a false bit in a ``DELIVERED`` outcome, never a failure."""

    status: OutcomeStatus
    masks: tuple[np.ndarray, ...]
    reason: str | None = None
    by_peer: bool = False
    cause: Cause | None = None

    def __init__(self, status: OutcomeStatus, masks: tuple[np.ndarray, ...], reason: str | None = None,
                 by_peer: bool = False, cause: Cause | None = None) -> None:
        # Written out rather than generated: an outcome is made for every submission, so the
        # checks run in as few Python steps as the same rules allow (one pass, no generator).
        if not isinstance(status, OutcomeStatus):
            raise TypeError(f"Outcome.status must be an OutcomeStatus, got {status!r}")
        if isinstance(masks, np.ndarray):
            raise TypeError("Outcome.masks is a sequence of masks, one per view group")
        kept = []
        for i, mask in enumerate(masks):
            kept.append(_keep_or_copy(mask, i))
        _set(self, "status", status)
        _set(self, "masks", tuple(kept))
        _set(self, "reason", reason)
        _set(self, "by_peer", by_peer)
        _set(self, "cause", cause)
        if status is _DELIVERED and reason is None and cause is None and not by_peer:
            return  # the common case: nothing more to check
        if status is _FAILED and not reason:
            raise ValueError("a FAILED Outcome must say why (reason)")
        if status is _DELIVERED and reason is not None:
            raise ValueError("a DELIVERED Outcome carries no failure reason")
        if by_peer and status is not _CANCELLED:
            raise ValueError("only a CANCELLED Outcome can be cancelled by the peer")
        if cause is not None and not isinstance(cause, Cause):
            raise TypeError(f"Outcome.cause must be a Cause or None, got {cause!r}")
        if status is _DELIVERED and cause is not None:
            raise ValueError("a DELIVERED Outcome carries no cause")
        if status is _FAILED and cause is not None and cause not in _FAILED_CAUSES:
            raise ValueError(f"a FAILED Outcome's cause is one of {sorted(c.name for c in _FAILED_CAUSES)}, "
                             f"got {cause.name}")
        if status is _CANCELLED:
            if cause is None:
                _set(self, "cause", Cause.PEER_CANCELLED if by_peer else Cause.HOLDER_CANCELLED)
            elif cause not in _CANCELLED_CAUSES:
                raise ValueError(f"a CANCELLED Outcome's cause is one of "
                                 f"{sorted(c.name for c in _CANCELLED_CAUSES)}, got {cause.name}")
            elif (cause is Cause.PEER_CANCELLED) != by_peer:
                raise ValueError("a CANCELLED Outcome's cause is PEER_CANCELLED exactly when by_peer is true")

    @classmethod
    def delivered(cls, masks: Iterable[np.ndarray]) -> Outcome:
        return cls(OutcomeStatus.DELIVERED, tuple(masks))

    @classmethod
    def failed(cls, reason: str, masks: Iterable[np.ndarray], cause: Cause | None = None) -> Outcome:
        return cls(OutcomeStatus.FAILED, tuple(masks), reason, cause=cause)

    @classmethod
    def cancelled(cls, masks: Iterable[np.ndarray], *, by_peer: bool = False, reason: str | None = None,
                  cause: Cause | None = None) -> Outcome:
        return cls(OutcomeStatus.CANCELLED, tuple(masks), reason, by_peer, cause)

    @property
    def is_delivered(self) -> bool:
        return self.status is OutcomeStatus.DELIVERED

    @property
    def is_failed(self) -> bool:
        return self.status is OutcomeStatus.FAILED

    @property
    def is_cancelled(self) -> bool:
        return self.status is OutcomeStatus.CANCELLED

    @property
    def rows_delivered(self) -> int:
        """How many rows carry a true bit, over all groups."""
        return int(sum(int(np.count_nonzero(m)) for m in self.masks))

    def __repr__(self) -> str:
        total = sum(m.size for m in self.masks)
        why = f", reason={self.reason!r}" if self.reason else ""
        peer = ", by_peer=True" if self.by_peer else ""
        cause = f", cause={self.cause.value}" if self.cause is not None else ""
        return f"Outcome({self.status.value}, {self.rows_delivered}/{total} rows{why}{peer}{cause})"
