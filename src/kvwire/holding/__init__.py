"""The lease holder's kit, without torch: the holder loop (submit, wait on wakes), the shutdown
drain, the serving loop that answers pulls, the transceiver state and pull authentication.
Everything a holder needs that is not a model: the demo ``Worker`` (``kvwire.runtime``), the
vLLM connector, the suite and the benches stand on it (``docs/holding.md``).

Imports ``kvwire.contract``, numpy and the standard library only."""

from __future__ import annotations

from kvwire.holding.auth import MAX_SKEW_S, PullGuard, sign_pull
from kvwire.holding.drain import drain
from kvwire.holding.loop import (
    QUIESCE_GRACE_S,
    AtDeadline,
    Cancel,
    Direction,
    Submission,
    Waited,
    WaitExpired,
    WaitStatus,
    Wakes,
    submit,
    wait,
    wait_all,
    wait_any,
)
from kvwire.holding.serving import Reply, ServingLoop
from kvwire.holding.state import MAX_STATE_BYTES, StateError, TransceiverState

__all__ = [
    "Direction", "Wakes", "Cancel", "Submission", "submit", "wait", "wait_all", "wait_any", "AtDeadline",
    "WaitStatus", "Waited", "WaitExpired", "QUIESCE_GRACE_S", "drain", "ServingLoop", "Reply",
    "TransceiverState", "StateError", "MAX_STATE_BYTES", "PullGuard", "sign_pull", "MAX_SKEW_S",
]
