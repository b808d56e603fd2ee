"""The lease holder: a :class:`Worker` that drives a lender and a backend chosen by config,
its transceiver state, request-free pulls, and a tiny deterministic model to prove transfers.

Names load on first use, so ``kvwire.runtime.holding`` (the holder loop) and
``kvwire.runtime.state`` import without torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "AtDeadline": "kvwire.runtime.holding",
    "Cancel": "kvwire.runtime.holding",
    "Direction": "kvwire.runtime.holding",
    "Submission": "kvwire.runtime.holding",
    "Wakes": "kvwire.runtime.holding",
    "WaitExpired": "kvwire.runtime.holding",
    "WaitStatus": "kvwire.runtime.holding",
    "Waited": "kvwire.runtime.holding",
    "submit": "kvwire.runtime.holding",
    "wait": "kvwire.runtime.holding",
    "wait_all": "kvwire.runtime.holding",
    "wait_any": "kvwire.runtime.holding",
    "Generation": "kvwire.runtime.worker",
    "PromptOffer": "kvwire.runtime.worker",
    "TransferError": "kvwire.runtime.worker",
    "TransferResult": "kvwire.runtime.worker",
    "TransferStatus": "kvwire.runtime.worker",
    "Worker": "kvwire.runtime.worker",
    "WorkerClosed": "kvwire.runtime.worker",
    "ModelConfig": "kvwire.runtime.model",
    "TinyTransformer": "kvwire.runtime.model",
    "StateError": "kvwire.runtime.state",
    "TransceiverState": "kvwire.runtime.state",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'kvwire.runtime' has no attribute {name!r}")
