"""The kvwire contract, version 1: what a lease holder and a backend promise each other.

This package imports numpy and the standard library only. ``CONTRACT.md`` states the rules;
each is a property the conformance suite (``kvwire.testing``) checks."""

from kvwire.contract.backend import Attempt, Backend, WakeFn
from kvwire.contract.capabilities import CONTRACT_VERSION, Capabilities
from kvwire.contract.errors import InvalidSubmission, SubmissionRejected
from kvwire.contract.hint import Hint
from kvwire.contract.memory import MemoryKind, SlotRegion
from kvwire.contract.outcome import Outcome
from kvwire.contract.view import CacheKind, LayerGroupRows, TokenRange, View

__all__ = [
    "Backend",
    "Capabilities",
    "Attempt",
    "Outcome",
    "View",
    "LayerGroupRows",
    "SlotRegion",
    "MemoryKind",
    "Hint",
    "WakeFn",
    "InvalidSubmission",
    "SubmissionRejected",
    "TokenRange",
    "CacheKind",
    "CONTRACT_VERSION",
]
