"""Reference backends written directly on ``kvwire.contract``, shipped for backend authors to read
and copy, and run by the conformance suite like any third-party backend:

- :mod:`~kvwire.testing.reference.store`: :class:`ReferenceStoreBackend` over an in-process
  :class:`ReferenceStore` (a store backend);
- :mod:`~kvwire.testing.reference.peer`: :class:`ReferencePeer`, a peer backend that serves
  request-free pulls (``serve-pulls``) over an in-process network;
- :mod:`~kvwire.testing.reference.core`: what both share (attempt states, threads, row copies);
- :mod:`~kvwire.testing.reference.harness`: their conformance harnesses::

    pytest --pyargs kvwire.testing.suite --kvwire-harness kvwire.testing.reference.harness:store_harness
    pytest --pyargs kvwire.testing.suite --kvwire-harness kvwire.testing.reference.harness:peer_harness

They stay independent of the shipped backends' mechanisms on purpose (they use
:class:`~kvwire.contract.RegionTable`, the contract's own toolkit, but neither
:mod:`kvwire.attempts` nor :mod:`kvwire.blob`): they are the second implementation the suite is
checked against, so a fault of a shared mechanism cannot pass in both.
"""

from kvwire.testing.reference.peer import Fabric, ReferencePeer
from kvwire.testing.reference.store import ReferenceStore, ReferenceStoreBackend

__all__ = ["ReferenceStore", "ReferenceStoreBackend", "ReferencePeer", "Fabric"]
