"""What a worker's connector holds now, for operators and tests: run on every worker with
``LLM.collective_rpc(worker_state)`` (vLLM needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send a
function)."""

from __future__ import annotations

from typing import Any

__all__ = ["worker_state", "transceiver_state"]


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
