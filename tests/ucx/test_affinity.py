"""The backend's own threads run on every CPU of the process, even when the thread that builds the
backend is pinned to one core (as vLLM's CPU worker pins its main thread): otherwise the progress
thread shares that core with the engine's compute and busy-waiting, and a pull waits seconds."""

from __future__ import annotations

import os
import threading

import pytest

from kvwire.testing.require import backend_module

backend_module("ucxx._lib.libucxx", "ucx", "ucxx-cu12==0.52.0")
from kvwire_ucx import create  # noqa: E402
from kvwire_ucx.affinity import _parse_list, process_cpus, widened  # noqa: E402

needs_two_cpus = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                    reason="needs Linux affinity and at least two CPUs")


def test_cpu_lists_parse() -> None:
    assert _parse_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert _parse_list("5") == {5}
    assert _parse_list("") == set()


def in_pinned_thread(cpu: int, fn):  # noqa: ANN001, ANN202
    """Run ``fn`` in a new thread pinned to ``cpu``; its result (or its exception, raised here)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            os.sched_setaffinity(0, {cpu})
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


@needs_two_cpus
def test_threads_started_inside_widened_run_on_every_cpu_of_the_process() -> None:
    everyone = process_cpus()
    pinned = min(everyone)

    def probe() -> tuple[set[int], set[int], set[int]]:
        seen: dict[str, set[int]] = {}
        with widened():
            child = threading.Thread(target=lambda: seen.setdefault("child", set(os.sched_getaffinity(0))))
            child.start()
            child.join()
            inside = set(os.sched_getaffinity(0))
        return inside, seen["child"], set(os.sched_getaffinity(0))

    inside, child, after = in_pinned_thread(pinned, probe)
    assert inside == everyone and child == everyone
    assert after == {pinned}  # the caller's own pin is given back


@needs_two_cpus
def test_a_backend_built_on_a_pinned_thread_has_an_unpinned_progress_thread() -> None:
    everyone = process_cpus()
    pinned = min(everyone)
    before = {t.ident for t in threading.enumerate()}
    backend = in_pinned_thread(pinned, lambda: create({}))
    try:
        progress = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("kvwire-ucx")]
        assert progress, [t.name for t in threading.enumerate()]
        for t in progress:
            assert set(os.sched_getaffinity(t.native_id)) == everyone, t.name
    finally:
        assert not backend.shutdown()
        backend.close()
