"""Which other vLLM workers share this worker's cores (kvwire_vllm.cores), without vLLM: a real
child process stands for another server's worker, named as vLLM names its workers in a /proc-like
folder whose other entries are real too."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvwire_vllm.cores import advice, workers_sharing_cores


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def fake_proc(root: Path, entries: dict[int, str]) -> Path:
    for pid, comm in entries.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "comm").write_text(comm + "\n")
    (root / "self").mkdir()  # not a pid: skipped
    return root


def test_a_worker_on_this_threads_cores_is_named(tmp_path: Path, child: subprocess.Popen[bytes]) -> None:
    proc = fake_proc(tmp_path, {child.pid: "VLLM::Worker", os.getpid(): "VLLM::Worker"})
    assert workers_sharing_cores(str(proc)) == [(child.pid, sorted(os.sched_getaffinity(0)))]
    text = advice(workers_sharing_cores(str(proc)))
    assert f"pid {child.pid}" in text and "VLLM_CPU_OMP_THREADS_BIND" in text


def test_other_processes_and_workers_gone_are_not(tmp_path: Path, child: subprocess.Popen[bytes]) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    proc = fake_proc(tmp_path, {child.pid: "python", gone.pid: "VLLM::Worker_TP0"})
    assert workers_sharing_cores(str(proc)) == []
    assert advice([]) == ""
    assert workers_sharing_cores(str(tmp_path / "missing")) == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to bind a worker elsewhere")
def test_a_worker_on_other_cores_is_not(tmp_path: Path, child: subprocess.Popen[bytes]) -> None:
    cores = sorted(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(child.pid, {cores[-1]})
    try:
        os.sched_setaffinity(0, set(cores[:-1]))
        proc = fake_proc(tmp_path, {child.pid: "VLLM::Worker"})
        assert workers_sharing_cores(str(proc)) == []
    finally:
        os.sched_setaffinity(0, before)
