"""The lease holder: a :class:`Worker` that drives a lender and a backend chosen by config,
its transceiver state, request-free pulls, and a tiny deterministic model to prove transfers.

Names load on first use, so ``kvwire.runtime.state`` decodes states without importing torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Cancel": "kvwire.runtime.worker",
    "Generation": "kvwire.runtime.worker",
    "TransferError": "kvwire.runtime.worker",
    "TransferResult": "kvwire.runtime.worker",
    "Worker": "kvwire.runtime.worker",
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
