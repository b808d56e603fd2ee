"""Whether other vLLM workers on this host are bound to this worker's cores. Imports no vLLM.

vLLM's CPU build binds each server's worker to cores (``VLLM_CPU_OMP_THREADS_BIND``, ``auto`` by
default: every server on the same cores), and after each step a worker, and its engine core
waiting for its answer, busy-poll vLLM's shared-memory queue for a second. Two servers on one host
with the default binding, such as a disaggregated-prefill producer and its consumer, then slow
each other's forward: measured on a 2-core host, the producer's 1k-token prefill took 460 ms
(median) next to its consumer, 18 ms on cores of its own. The connector says so once at start,
naming the other worker and the cores, since nothing else in vLLM's log points at it."""

from __future__ import annotations

import os

__all__ = ["workers_sharing_cores", "advice"]

#: vLLM names its worker processes so (``VLLM::Worker``, ``VLLM::Worker_TP0``, ...).
WORKER_NAME = "VLLM::Worker"


def workers_sharing_cores(proc: str = "/proc") -> list[tuple[int, list[int]]]:
    """Other processes named like vLLM's workers whose CPU affinity overlaps this thread's:
    ``(pid, the cores both may run on)``, by pid. Empty where ``proc`` cannot be read."""
    mine = os.sched_getaffinity(0)
    me = os.getpid()
    found: list[tuple[int, list[int]]] = []
    try:
        entries = os.listdir(proc)
    except OSError:
        return found
    for entry in sorted((e for e in entries if e.isdigit()), key=int):
        pid = int(entry)
        if pid == me:
            continue
        try:
            with open(os.path.join(proc, entry, "comm")) as f:
                if not f.read().startswith(WORKER_NAME):
                    continue
            shared = mine & os.sched_getaffinity(pid)
        except OSError:  # gone, or not ours to read
            continue
        if shared:
            found.append((pid, sorted(shared)))
    return found


def advice(sharing: list[tuple[int, list[int]]]) -> str:
    """The warning for ``sharing`` (:func:`workers_sharing_cores`'s answer), or '' when empty."""
    if not sharing:
        return ""
    others = ", ".join(f"pid {pid} on cores {cores}" for pid, cores in sharing[:4])
    more = f" and {len(sharing) - 4} more" if len(sharing) > 4 else ""
    return (f"kvwire: this vLLM worker shares its cores with another vLLM worker on this host ({others}{more}): "
            "each busy-polls for a second after every step, so they slow each other's forward (a P/D producer's "
            "prefill next to its consumer measured 25x slower); give each server its own cores with "
            "VLLM_CPU_OMP_THREADS_BIND (for example 0-15 for the producer, 16-31 for the consumer)")
