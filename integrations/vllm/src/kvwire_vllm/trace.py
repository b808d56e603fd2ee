"""An optional per-step trace of the connector, for finding where a load's time goes.

Set ``KVWIRE_VLLM_TRACE`` to a file path: every process of the engine (scheduler and workers)
appends one JSON line per event, ``{"t": unix seconds, "pid", "side", "event", ...}``, so one
file holds a request's whole path (lookup, load planned, submitted, ended, reported, scheduled).
``python -m kvwire_vllm.proxy`` traces the same way (side ``proxy``: prefill sent and answered,
decode sent, each streamed chunk), so a P/D request's hops between the servers show too.
Off (the default) it costs one attribute test per event."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

__all__ = ["event", "enabled"]

_PATH = os.environ.get("KVWIRE_VLLM_TRACE") or None
_lock = threading.Lock()


def enabled() -> bool:
    return _PATH is not None


def event(side: str, name: str, **fields: Any) -> None:
    if _PATH is None:
        return
    line = json.dumps({"t": time.time(), "pid": os.getpid(), "side": side, "event": name, **fields}) + "\n"
    with _lock, open(_PATH, "a") as f:
        f.write(line)
