"""The kvwire contract, version 1.3: what a lease holder and a backend promise each other.

This package imports numpy and the standard library only. ``docs/contract.md`` (shipped in
this package as ``kvwire/contract/contract.md``) states the rules, clause by clause; each is a
property the conformance suite (``kvwire.testing``) checks, and each suite test names its clause.

The boundary: :class:`Backend`, :class:`Attempt`, :class:`Registration`, :data:`WakeFn`; the value
types :class:`View`, :class:`LayerGroupRows`, :class:`SlotRegion`, :class:`Hint`,
:class:`Outcome`, :class:`Capabilities`; the refusals under :class:`SubmissionError`; the optional
protocols ``serve-pulls`` (:class:`ServesPulls`, :class:`PullRequest`), ``offer-pulls``
(:class:`OffersPulls`), ``lookup`` (:class:`Lookup`) and ``block-objects``
(:data:`BLOCK_OBJECTS`, :func:`block_layout`); and the toolkit a backend
written directly on the contract uses, :class:`RegionTable` (M3/M4 read once)."""

from kvwire.contract.backend import Attempt, Backend, Registration, WakeFn
from kvwire.contract.blocks import BLOCK_OBJECTS, block_layout
from kvwire.contract.capabilities import CONTRACT_VERSION, OFFER_PULLS, SERVE_PULLS, Capabilities, OtherEnd
from kvwire.contract.errors import InvalidSubmission, LookupFailed, SubmissionError, SubmissionRejected
from kvwire.contract.hint import Hint
from kvwire.contract.lookup import LOOKUP, Lookup
from kvwire.contract.memory import MemoryKind, SlotRegion
from kvwire.contract.outcome import Cause, Outcome, OutcomeStatus
from kvwire.contract.regions import RegionTable, TableRegistration
from kvwire.contract.serving import OffersPulls, PullRequest, ServesPulls
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
    # what a backend written directly on the contract needs besides
    "Registration",
    "OtherEnd",
    "OutcomeStatus",
    "Cause",
    "SubmissionError",
    "SERVE_PULLS",
    "ServesPulls",
    "PullRequest",
    "RegionTable",
    "TableRegistration",
    # the optional protocol lookup (L1, contract 1.1)
    "LOOKUP",
    "Lookup",
    "LookupFailed",
    # the optional protocol offer-pulls (O1, contract 1.2)
    "OFFER_PULLS",
    "OffersPulls",
    # the optional protocol block-objects (K1, contract 1.3)
    "BLOCK_OBJECTS",
    "block_layout",
]
