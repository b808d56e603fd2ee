"""Deliberately broken backends of the seventh probing round, on values at the edges of what the
contract allows (V1.8): each wraps the reference peer (``loopback_peer.py``) or the memory
backend, as ``mutants.py`` does, and breaks one clause. ``test_mutants.py`` reads
:data:`CATCHES` and checks that the suite fails each one on a test named after the rule it breaks.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants_round7.py:NAME``."""

from __future__ import annotations

import threading

from loopback_peer import LoopbackHarness  # beside this file; on sys.path when loaded as a harness
from mutants import MutantHarness, PeerMutant

from kvwire.contract import Attempt, Cause, Hint, Outcome, View, WakeFn

#: (harness, the rule it breaks, -k selection of the suite's tests): read by test_mutants.py as
#: a literal, without importing this file.
CATCHES = [
    ("large_group_ids_fail_later", "V1", "V1 and large_group_id and 33_bits"),
]


# -- V1.8: a group id the wire cannot carry is taken, then fails ---------------------------------

class _FailedAtOnce(Attempt):
    """Concluded failed at once (nothing moved), woken from a timer thread."""

    def __init__(self, view: View, wake: WakeFn, reason: str) -> None:
        self.outcome = Outcome.failed(reason, view.row_masks(), cause=Cause.FAULT)
        threading.Timer(0.01, wake).start()

    def poll(self) -> Outcome | None:
        return self.outcome

    def quiesced(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


class LargeGroupIdsFailLater(PeerMutant):
    """V1.8: a fetch naming a group id of 2**32 or more (more than its wire carries) is taken and
    fails at once with ``FAULT``, where the contract refuses it when submitted."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(view, View) and any(g.group_id >= 1 << 32 for g in view.groups):
            return _FailedAtOnce(view, wake, "a group id does not fit the wire's 32 bits")
        return super().fetch(view, hint, wake)


large_group_ids_fail_later = MutantHarness("large-group-ids-fail-later", LargeGroupIdsFailLater,
                                           inner=LoopbackHarness())
