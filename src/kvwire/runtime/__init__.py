"""The demo lease holder: a :class:`Worker` that drives a lender and a backend chosen by config,
answers request-free pulls, and runs a tiny deterministic model to prove transfers (torch).

The torch-free holder kit it stands on is :mod:`kvwire.holding`; the names of it this package
re-exports, and the modules ``kvwire.runtime.holding``, ``.state`` and ``.auth``, are aliases
kept for plugins and holders written before it moved (nothing in this repository imports them).
Names load on first use because such code must not import torch: importing
``kvwire.runtime.holding`` runs this file first."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "AtDeadline": "kvwire.holding",
    "Cancel": "kvwire.holding",
    "Direction": "kvwire.holding",
    "Submission": "kvwire.holding",
    "Wakes": "kvwire.holding",
    "WaitExpired": "kvwire.holding",
    "WaitStatus": "kvwire.holding",
    "Waited": "kvwire.holding",
    "submit": "kvwire.holding",
    "wait": "kvwire.holding",
    "wait_all": "kvwire.holding",
    "wait_any": "kvwire.holding",
    "Generation": "kvwire.runtime.worker",
    "PromptOffer": "kvwire.runtime.worker",
    "TransferError": "kvwire.runtime.worker",
    "TransferResult": "kvwire.runtime.worker",
    "TransferStatus": "kvwire.runtime.worker",
    "Worker": "kvwire.runtime.worker",
    "WorkerClosed": "kvwire.runtime.worker",
    "ModelConfig": "kvwire.runtime.model",
    "TinyTransformer": "kvwire.runtime.model",
    "StateError": "kvwire.holding",
    "TransceiverState": "kvwire.holding",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'kvwire.runtime' has no attribute {name!r}")
