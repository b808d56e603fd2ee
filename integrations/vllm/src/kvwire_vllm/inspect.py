"""What a worker's connector holds now, for operators and tests, run on every worker by name:
start vLLM with ``worker_extension_cls="kvwire_vllm.inspect.WorkerExtension"`` (``LLM(...)``'s
argument, ``--worker-extension-cls`` of ``vllm serve``), then ``LLM.collective_rpc("kvwire_worker_state")``
or ``("kvwire_transceiver_state")``. A name crosses vLLM's RPC as a string: no function is
serialized, so ``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off. (The functions themselves can be
passed to ``collective_rpc`` too, but vLLM sends a function only with that switch on.)"""

from __future__ import annotations

from typing import Any

__all__ = ["WorkerExtension", "worker_state", "transceiver_state"]


def worker_state(worker: object = None) -> dict[str, Any]:
    """The worker-side connector's transfers and registration (:meth:`WorkerSide.state`), or
    ``{"connector": None}`` where this worker has no KvwireConnector."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    side = getattr(connector, "worker", None)
    if side is None:
        return {"connector": None}
    return {"connector": type(connector).__name__, **side.state()}


def transceiver_state(worker: object = None) -> bytes | None:
    """This engine's transceiver state, for ``LLM.collective_rpc(transceiver_state)``: opaque,
    versioned, bounded bytes (kvwire's ``TransceiverState``: magic, version, JSON; no pickle) that
    a pulling engine's request carries as ``kv_transfer_params={"kvwire_source": state}``; None
    where this worker has no KvwireConnector over a backend that serves pulls."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    side = getattr(connector, "worker", None)
    if side is None or not side.serving:
        return None
    return side.transceiver_state()


class WorkerExtension:
    """Methods vLLM adds to each of its workers when started with
    ``worker_extension_cls="kvwire_vllm.inspect.WorkerExtension"``, called through
    ``collective_rpc`` by name. Each returns plain data (a dict, bytes or None)."""

    def kvwire_worker_state(self) -> dict[str, Any]:
        """:func:`worker_state` of this worker."""
        return worker_state(self)

    def kvwire_transceiver_state(self) -> bytes | None:
        """:func:`transceiver_state` of this worker."""
        return transceiver_state(self)
