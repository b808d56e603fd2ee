"""What the ``kvwire`` command prints around its results, as a user sees it in a terminal of 80
columns or in a log file: no library's log flood, no stray progress line, no cut-off cells."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from kvwire.testing.require import backend_usable

#: A glog line (the Mooncake client's C++ logging): severity letter, date, time, thread, file.
GLOG_INFO = re.compile(r"^I\d{4} \d\d:\d\d:\d\d")


def kvwire(*args: str, columns: int = 80, drop: tuple[str, ...] = (), timeout: float = 300,
           ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "kvwire.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_the_mooncake_demo_does_not_flood_stderr_with_the_clients_info_log():
    backend_usable("mooncake")
    # MC_LOG_LEVEL unset, as in a user's shell: the plugin quiets the client library itself.
    r = kvwire("demo", "--backend", "mooncake", "--tokens", "64", "--layers", "2", drop=("MC_LOG_LEVEL",))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    info = [line for line in r.stderr.splitlines() if GLOG_INFO.match(line)]
    assert not info, f"{len(info)} INFO lines of Mooncake's log on stderr, e.g. {info[:3]}"
    # Left: glog's one-time banner and one harmless ERROR line per client (two workers).
    assert len(r.stderr.splitlines()) <= 5, r.stderr
