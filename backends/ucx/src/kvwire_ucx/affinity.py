"""The CPUs of the threads this backend starts.

A thread inherits the CPU affinity of the thread that starts it. An inference engine may pin the
thread that builds this backend to one core: vLLM's CPU worker binds its OpenMP threads one per
core, the worker's main thread among them, and that main thread busy-waits for its next step.
A progress thread started there (and UCX's and NIXL's own threads, made when their context is)
would share that one core with the engine's compute and its busy-waiting; measured in two vLLM
engines on a 2-core host, a first pull then waited 1.5 to 10 s for the serving end to finish
creating a UCX endpoint. :func:`widened` lets the threads started inside it run on every CPU
that any thread of this process may use: the engine's own cores, never more (a process pinned
with ``taskset`` stays inside its set)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["process_cpus", "widened"]


def _parse_list(text: str) -> set[int]:
    """``0-3,8,10-11`` -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def process_cpus() -> set[int]:
    """The union of the CPU sets of this process's threads (Linux ``/proc``); elsewhere, or if
    that cannot be read, the calling thread's own set."""
    cpus: set[int] = set()
    try:
        for status in Path("/proc/self/task").glob("*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue  # a thread that ended meanwhile
            for line in text.splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    cpus |= _parse_list(line.split(":", 1)[1])
                    break
    except (OSError, ValueError):
        cpus = set()
    if not cpus and hasattr(os, "sched_getaffinity"):
        cpus = set(os.sched_getaffinity(0))
    return cpus


@contextlib.contextmanager
def widened() -> Iterator[None]:
    """Within: the calling thread may run on :func:`process_cpus` (threads it starts keep that);
    after: its own set again. A no-op where affinity cannot be read or set."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    try:
        own = os.sched_getaffinity(0)
        wide = process_cpus()
    except OSError:
        yield
        return
    changed = False
    if wide and wide != own:
        try:
            os.sched_setaffinity(0, wide)
            changed = True
        except OSError:
            pass
    try:
        yield
    finally:
        if changed:
            try:
                os.sched_setaffinity(0, own)
            except OSError:
                pass
