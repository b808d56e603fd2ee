"""The raw transport for ``kvwire bench``: the same rows moved with bare ucxx tag messages
between two workers of this process, with the settings kvwire-ucx uses (loopback devices,
endpoint error handling on), so the bench can print kvwire's pull beside what UCX alone does."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["raw_bench"]

_TAG = 0x5241570000000000


def _worker(ucx_api: Any, devices: str) -> tuple[Any, Any]:
    from kvwire_ucx._ucx import context_config

    context = ucx_api.UCXContext(config_dict=context_config(devices),
                                 feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    return context, ucx_api.UCXWorker(context)


def raw_bench(options: Mapping[str, Any], row_bytes: int, rows: int, repeat: int) -> float:
    """Median seconds to move ``rows`` rows of ``row_bytes`` from one worker to another."""
    from kvwire_ucx._ucx import Array, ucx_api

    devices = str(options.get("net_devices") or "lo")
    ctx_a, sender = _worker(ucx_api, devices)
    ctx_b, receiver = _worker(ucx_api, devices)
    address = ucx_api.UCXAddress.create_from_buffer(bytes(receiver.address))
    endpoint = ucx_api.UCXEndpoint.create_from_worker_address(sender, address, True)
    src = np.random.default_rng(0).integers(0, 255, rows * row_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    times = []
    try:
        for round_ in range(repeat + 1):
            dst[:] = 0
            t = time.perf_counter()
            recvs = [receiver.tag_recv(Array(dst[i * row_bytes:(i + 1) * row_bytes]), ucx_api.UCXXTag(_TAG | i))
                     for i in range(rows)]
            sends = [endpoint.tag_send(Array(src[i * row_bytes:(i + 1) * row_bytes]), ucx_api.UCXXTag(_TAG | i))
                     for i in range(rows)]
            while not (all(r.completed for r in recvs) and all(s.completed for s in sends)):
                sender.progress_once()
                receiver.progress_once()
            for r in (*recvs, *sends):
                r.check_error()
            if round_:  # the first round sets up the connection
                times.append(time.perf_counter() - t)
            if not np.array_equal(src, dst):
                raise RuntimeError("raw ucxx moved bytes that differ from the source")
            del recvs, sends
    finally:
        endpoint.close_blocking()
        del endpoint, sender, receiver, ctx_a, ctx_b
    return statistics.median(times)
