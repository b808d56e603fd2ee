"""Disaggregated prefill on the producer's side: the prompt blocks of finished requests, pinned
in vLLM's block pool for the consumer's pull. Imports no vLLM.

A hold takes one reference on each block (as a request's prefix hit or a served pull does), so
vLLM neither frees nor evicts them; it ends when a pull that asked for the hold's last block has
ended (delivered, failed or cancelled: the consumer recomputes what it lacks and never asks
again), or when its time is up. A timer rings the engine at that time, since an idle engine core
would otherwise never step to let them go."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvwire_vllm import trace

__all__ = ["Holds", "wants_hold", "hold_seconds"]

log = logging.getLogger(f"vllm.{__name__}")


def wants_hold(role: str, serving: bool, params: Mapping[str, Any] | None) -> bool:
    """Whether a finished request's blocks are kept for a consumer: on an engine that serves
    pulls, for every request of a ``kv_producer``, and for a request whose ``kv_transfer_params``
    say ``do_remote_decode`` (as vLLM's proxy sends a prefill) on a ``kv_both`` one."""
    if not serving or role == "kv_consumer":
        return False
    return role == "kv_producer" or bool((params or {}).get("do_remote_decode"))


def hold_seconds(engine_hold_s: float, params: Mapping[str, Any] | None) -> float:
    """The engine's ``hold_s``, or less where the request asks for a shorter hold
    (``kvwire_hold_s``: a proxy that knows its consumer answers sooner); never more, so a client
    cannot pin a producer's blocks longer than its operator allows."""
    asked = (params or {}).get("kvwire_hold_s")
    if isinstance(asked, (int, float)) and not isinstance(asked, bool) and 0 < asked < engine_hold_s:
        return float(asked)
    return engine_hold_s


@dataclass
class _Hold:
    blocks: list[Any]  # vLLM's KVCacheBlock objects, one reference each
    last_name: bytes  # the kvwire name of the last held block
    deadline: float  # time.monotonic() when the hold lapses without a pull
    seconds: float


class Holds:
    """The holds of one engine. ``free(blocks)`` gives blocks' references back to vLLM's pool;
    ``ring()`` makes an idle engine step (called from a timer thread)."""

    def __init__(self, free: Callable[[list[Any]], None], ring: Callable[[], None]) -> None:
        self._free = free
        self._ring = ring
        self._holds: dict[str, _Hold] = {}
        self.released = 0  # ended by the consumer's pull
        self.lapsed = 0  # ended by time

    def __bool__(self) -> bool:
        return bool(self._holds)

    def take(self, req_id: str, blocks: list[Any], last_name: bytes, seconds: float) -> None:
        """Hold ``blocks`` (already referenced by the caller) for ``seconds``."""
        self._holds[req_id] = _Hold(blocks, last_name, time.monotonic() + seconds, seconds)
        timer = threading.Timer(seconds + 0.05, self._ring)
        timer.daemon = True
        timer.start()
        trace.event("scheduler", "hold", req=req_id, blocks=len(blocks))

    def end(self, pulled: bytes | None = None) -> None:
        """End the holds whose last block a pull that ended asked for (``pulled``: the last name
        it asked for), and the lapsed ones."""
        if not self._holds:
            return
        now = time.monotonic()
        for req_id, hold in list(self._holds.items()):
            if pulled is not None and hold.last_name == pulled:
                self.released += 1
                self._release(req_id, "pulled")
            elif hold.deadline <= now:
                self.lapsed += 1
                log.info("kvwire: request %s's blocks kept %.0f s for a consumer that never pulled them: released",
                         req_id, hold.seconds)
                self._release(req_id, "lapsed")

    def end_all(self) -> int:
        """At shutdown: every hold's blocks back to the pool; how many holds there were."""
        count = len(self._holds)
        for req_id in list(self._holds):
            self._release(req_id, "shutdown")
        return count

    def blocks(self) -> int:
        return sum(len(h.blocks) for h in self._holds.values())

    def _release(self, req_id: str, why: str) -> None:
        hold = self._holds.pop(req_id)
        self._free(hold.blocks)
        trace.event("scheduler", "hold_released", req=req_id, why=why)
