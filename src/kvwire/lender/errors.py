"""The lender's refusals: a small closed hierarchy under :class:`LenderError`."""

from __future__ import annotations

__all__ = ["LenderError", "CacheFull", "StagingBusy", "LeaseError"]


class LenderError(Exception):
    """A lender operation was refused; the lender's state is as it was before the call."""


class CacheFull(LenderError):
    """Not enough free or evictable slots: every other slot is pinned by a request or a lease.
    Nothing was allocated or pinned; close requests or release leases and try again."""


class StagingBusy(LenderError):
    """A staged lease needs more staging slots than are free now. No slot was taken; release
    staged leases (or lend fewer rows, or build the lender with more ``staging_slots``)."""


class LeaseError(LenderError):
    """A lease or request was used out of order: marked twice, marked after release, lent
    from a closed request, or over rows another lease is writing."""
