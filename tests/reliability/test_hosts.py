"""The simulated hosts themselves (``hosts.py``): hosts reach each other over their links only,
a pulled cable silences a host and plugging it back heals it, and nothing of a network is left
after it, whether the test passed, failed, or its process was killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import hosts_problem
from hosts import PREFIX, Network, NetworkError, sweep_stale

pytestmark = pytest.mark.xdist_group("simulated-hosts")

HERE = Path(__file__).parent

ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 7000)); s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(c.recv(100)); c.close()
"""
ASK = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2])) as c:
        c.sendall(b"ping"); c.settimeout(float(sys.argv[2])); print(c.recv(100).decode())
except OSError as exc:
    print(type(exc).__name__)
"""


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    problem = hosts_problem()
    if problem:
        pytest.skip(f"simulated hosts are not available here: {problem}")


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _ask(host, address: str, timeout_s: float = 1.0) -> str:
    return host.run([sys.executable, "-c", ASK, address, str(timeout_s)]).stdout.strip()


def test_hosts_talk_over_their_links_only_and_a_pulled_cable_silences_one():
    with Network(3) as net:
        h0, h1, h2 = net
        server = h1.spawn([sys.executable, "-c", ECHO_SERVER, h1.address], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            before = net.link_bytes(h1)
            assert _ask(h0, h1.address) == "ping"
            assert _ask(h2, h1.address) == "ping"
            after = net.link_bytes(h1)
            assert after[0] > before[0] and after[1] > before[1]   # it went over h1's link
            # the machine's own network has none of these addresses and cannot reach them
            own = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True).stdout)
            assert not [a for i in own for a in i.get("addr_info", []) if a.get("local") == h1.address]
            assert server.pid in h1.pids() and not h0.pids()
            with net.cable_pulled(h1):
                assert _ask(h2, h1.address, 0.5) in ("TimeoutError", "timeout")   # silence, not a refusal
                assert _ask(h0, h2.address, 0.5) == "ConnectionRefusedError"       # the others still talk
            assert _ask(h2, h1.address) == "ping"                                   # plugged back in
        finally:
            server.kill()
            server.wait()


def test_nothing_is_left_after_a_failing_test():
    with pytest.raises(RuntimeError, match="the test failed"):
        with Network(2) as net:
            names = net.namespaces
            sleeper = net[0].spawn([sys.executable, "-c", "import time; time.sleep(60)"])
            assert set(names) <= _netns()
            raise RuntimeError("the test failed")
    assert not set(names) & _netns()
    assert sleeper.wait(10) == -signal.SIGKILL
    with pytest.raises(NetworkError, match="Cannot open network namespace"):
        net.link_down(net[0])        # its namespaces are gone, so is every link


def test_a_run_killed_before_its_cleanup_is_swept_by_the_next_one():
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from hosts import Network; "
            "net = Network(2); print(' '.join(net.namespaces), flush=True); time.sleep(60)")
    crashed = subprocess.Popen([sys.executable, "-c", code, str(HERE)], stdout=subprocess.PIPE, text=True)
    try:
        names = crashed.stdout.readline().split()
        assert names and all(n.startswith(PREFIX) for n in names)
    finally:
        os.kill(crashed.pid, signal.SIGKILL)   # its atexit never runs
        crashed.wait()
    assert set(names) <= _netns()              # what it made is still there...
    with Network(2) as live:
        assert not set(names) & _netns()       # ...until the next network sweeps it
        assert set(live.namespaces) <= _netns()
        assert sweep_stale() == []             # a live run's namespaces are never swept
        assert set(live.namespaces) <= _netns()
