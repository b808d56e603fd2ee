"""The lender: a paged KV cache (torch tensors on the CPU or a CUDA device) that names its whole
blocks, keeps them in a reuse tree, and lends rows through leases. It never calls a backend;
the lease holder (the runtime) drives it and a backend together."""

from kvwire.lender.errors import CacheFull, LeaseError, LenderError, StagingBusy
from kvwire.lender.layout import CacheLayout, GroupSpec, Scope
from kvwire.lender.lease import Lease, LeasedRows, LeaseKind, LeaseOwner
from kvwire.lender.lender import Lender
from kvwire.lender.names import NAME_BYTES
from kvwire.lender.request import Request

__all__ = [
    "Lender",
    "CacheLayout",
    "GroupSpec",
    "Scope",
    "Request",
    "Lease",
    "LeaseKind",
    "LeaseOwner",
    "LeasedRows",
    "LenderError",
    "CacheFull",
    "StagingBusy",
    "LeaseError",
    "NAME_BYTES",
]
