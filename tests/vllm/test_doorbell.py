"""The doorbell a worker rings to wake an idle engine core (kvwire_vllm.peer): it rings, and an
engine core that is killed leaves nothing behind in the temp directory (before, every killed
engine left a ``kvwire-vllm-*.bell`` socket file there for good)."""

from __future__ import annotations

import ast
import glob
import os
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("vllm_venv")

CORE = """
import sys, threading
from kvwire_vllm import peer
rang = threading.Event()
bell = peer.Doorbell("engine-under-test", rang.set)
print(repr(bell.path), flush=True)
for line in sys.stdin:
    if line.strip() == "close":
        bell.close()
        print("closed", flush=True)
    elif line.strip() == "rang?":
        print("rang" if rang.wait(10) else "silent", flush=True)
        rang.clear()
"""

def bells() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "kvwire-vllm-*.bell")))


def start_core(python: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([str(python), "-c", CORE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(core: subprocess.Popen[str], line: str) -> str:
    assert core.stdin is not None and core.stdout is not None
    core.stdin.write(line + "\n")
    core.stdin.flush()
    return core.stdout.readline().strip()


def ring(path: str) -> bool:
    """What a worker's ring does (kvwire_vllm.peer.ring_path): one datagram to the bell's name."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(b"!", path)
        except OSError:
            return False
    return True


def test_a_bell_rings_until_closed_and_a_killed_core_leaves_no_file(vllm_venv: Path) -> None:
    before = bells()
    closing, killed = start_core(vllm_venv), start_core(vllm_venv)  # their imports overlap
    try:
        paths = [ast.literal_eval(core.stdout.readline()) for core in (closing, killed)]  # type: ignore[union-attr]
        assert paths[0] != paths[1], "two engine cores share one bell"
        for core, path in zip((closing, killed), paths, strict=True):
            assert ring(path), f"the worker's ring found no bell at {path!r}"
            assert ask(core, "rang?") == "rang"
        assert ask(closing, "close") == "closed"
        assert not ring(paths[0]), "a ring reached a closed bell"
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert not ring(paths[1]), "a ring reached the bell of a dead engine core"
    finally:
        for core in (closing, killed):
            core.kill()
            core.wait(30)
    assert bells() == before, f"engine cores left {sorted(bells() - before)} behind"
