"""The shutdown drain (B3.7): call ``shutdown()`` until it returns the empty set, and only then
give back what the holder kept and close the backend. It is the one drain kvwire has; the
``Worker``, the vLLM connector, the suite's harnesses, the UCX test holders and the benches use it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext

from kvwire.contract import Attempt, Backend
from kvwire.holding.loop import Wakes

__all__ = ["drain", "FIRST_LOOK_S", "LAST_LOOK_S"]

#: Between two ``shutdown()`` calls the drain sleeps until a wake, but at most this long at
#: first, doubling up to :data:`LAST_LOOK_S`: ``shutdown()`` has no wake of its own, and the
#: attempts' wakes may belong to someone else (a harness draining a backend its tests drove).
FIRST_LOOK_S = 0.001
LAST_LOOK_S = 0.05


def drain(backend: Backend, timeout_s: float, wakes: Wakes | None = None, *,
          release: Iterable[Callable[[], object]] = (), close: bool = True,
          lock: AbstractContextManager[object] | None = None) -> frozenset[Attempt]:
    """Call ``backend.shutdown()`` (under ``lock``, B2) until it returns the empty set, waiting
    between calls on ``wakes`` (the attempts' wakes, W1.2-W1.3) through :mod:`kvwire.waiting`;
    then call each of ``release`` in order (the kept leases' releases, the registrations'
    closes) and, with ``close``, ``backend.close()``. Returns the attempts still not quiesced
    after ``timeout_s``: when that set is not empty nothing was released nor closed, since the
    backend may still touch the leases' memory (S4.2, B3.6)."""
    guard: AbstractContextManager[object] = lock if lock is not None else nullcontext()
    wakes = wakes if wakes is not None else Wakes()
    deadline = time.monotonic() + timeout_s
    look = FIRST_LOOK_S
    while True:
        seen = wakes.count  # before the call: a wake that comes during it is not missed
        with guard:
            pending = frozenset(backend.shutdown())
        if not pending:
            break
        now = time.monotonic()
        if now >= deadline:
            return pending
        wakes.wait_beyond(seen, min(deadline, now + look))
        look = min(look * 2, LAST_LOOK_S)
    for give_back in release:
        give_back()
    if close:
        backend.close()
    return frozenset()
