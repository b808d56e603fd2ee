"""The contract's two refusals: a closed hierarchy under :class:`SubmissionError`."""

from __future__ import annotations

__all__ = ["SubmissionError", "InvalidSubmission", "SubmissionRejected"]


class SubmissionError(Exception):
    """A submission was refused and nothing escaped (S3): no peer or store was told, no memory
    was touched, no capacity was consumed; the lease may be released at once."""


class InvalidSubmission(SubmissionError):
    """The submission is wrong and never will be right: unrecognized rows, overlapping fetch
    rows, a memory kind the backend cannot reach, or a hint it cannot use."""


class SubmissionRejected(SubmissionError):
    """The backend cannot take this submission now: it is shut down, its bounded queue is full,
    or the hint names another domain. The same submission may succeed later."""
