"""The bench's KV connectors: vLLM's and kvwire's, each timing its own hooks inside the engine.

``bench_vllm.py`` runs every connector through a subclass made here, so each row also gets the
connector's own time per request: the wall time of every connector hook vLLM called (scheduler
and worker processes summed), the work the issue compares, without the noise of the rest of
the engine's step. The subclasses change nothing else.

Each process appends ``{"t": end, "hook", "wall"}`` records to ``$KVWIRE_BENCH_HOOKS.{pid}``;
a daemon thread writes them out every 0.2 s, so no hook pays for a file write."""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from typing import Any

from kvwire_vllm import KvwireConnector

__all__ = ["TimedExampleConnector", "TimedKvwireConnector", "TimedMooncakeStoreConnector"]

#: Every method of KVConnectorBase_V1 vLLM calls per step or per request.
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "bind_connector_metadata", "clear_connector_metadata",
         "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
         "get_block_ids_with_load_errors", "build_connector_worker_meta", "get_kv_connector_stats",
         "handle_preemptions")

_records: collections.deque[tuple[float, str, float]] = collections.deque()  # appends and pops are thread-safe
_writer: threading.Thread | None = None


def _write_out(path: str) -> None:
    while True:
        time.sleep(0.2)
        batch = [_records.popleft() for _ in range(len(_records))]
        if batch:
            with open(path, "a") as f:
                f.writelines(json.dumps({"t": t, "hook": h, "wall": w}) + "\n" for t, h, w in batch)


def _start_writer() -> None:
    global _writer
    base = os.environ.get("KVWIRE_BENCH_HOOKS")
    if base and _writer is None:
        _writer = threading.Thread(target=_write_out, args=(f"{base}.{os.getpid()}",), name="bench-hooks",
                                   daemon=True)
        _writer.start()


def _timed(cls: type) -> type:
    for name in HOOKS:
        original = getattr(cls, name, None)
        if original is None:
            continue

        def hook(self: Any, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                end = time.perf_counter()
                _records.append((time.time(), _name, end - began))

        hook.__name__ = name
        setattr(cls, name, hook)
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _start_writer()
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


@_timed
class TimedKvwireConnector(KvwireConnector):
    pass


#: vLLM's own connectors, timed: made on first use (vLLM's loader asks the module for the name),
#: from vLLM's connector registry, so a connector whose dependencies are missing (Mooncake's)
#: costs nothing unless used.
_VLLM = {"TimedExampleConnector": "ExampleConnector", "TimedMooncakeStoreConnector": "MooncakeStoreConnector"}
# Declared, not bound: the module's __getattr__ below makes them.
TimedExampleConnector: type
TimedMooncakeStoreConnector: type


def __getattr__(name: str) -> type:
    if name not in _VLLM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    base = KVConnectorFactory._registry[_VLLM[name]]()
    timed = _timed(type(name, (base,), {"__module__": __name__}))
    globals()[name] = timed
    return timed
