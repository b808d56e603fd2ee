"""The contract's two refusals: a closed hierarchy under :class:`SubmissionError`."""

from __future__ import annotations

__all__ = ["SubmissionError", "InvalidSubmission", "SubmissionRejected", "LookupFailed"]


class SubmissionError(Exception):
    """A submission was refused and nothing escaped (S3): no peer or store was told, no memory
    was touched, no capacity was consumed; the lease may be released at once."""


class InvalidSubmission(SubmissionError):
    """The submission is wrong and never will be right: unrecognized rows, overlapping fetch
    rows, a memory kind the backend cannot reach, or a hint it cannot use."""


class SubmissionRejected(SubmissionError):
    """The backend cannot take this submission now: it is shut down, its bounded queue is full,
    or the hint names another domain. The same submission may succeed later."""


class LookupFailed(Exception):
    """A lookup (the optional protocol ``lookup``, L1) got no answer: the other end faulted or
    the lookup's deadline passed. Not a :class:`SubmissionError`: a lookup submits nothing and
    takes no pins, so there is nothing to release; the caller may treat every name as not held
    and go on (a later fetch that misses is a miss, never a fault)."""
