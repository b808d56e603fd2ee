"""The serving peer the suite's peer paths and N2 tests run against, and that the peer mutants of
``mutants/`` wrap: now the reference peer shipped as :mod:`kvwire.testing.reference.peer`
(moved there from this file). Kept so ``--kvwire-harness tests/conformance/loopback_peer.py:harness``
and ``from loopback_peer import LoopbackHarness`` still work."""

from kvwire.testing.reference.harness import ReferencePeerHarness as LoopbackHarness
from kvwire.testing.reference.harness import peer_harness as harness
from kvwire.testing.reference.peer import Fabric, ReferencePeer

__all__ = ["LoopbackHarness", "harness", "Fabric", "ReferencePeer"]
