"""Runs ``one_sided_cases.py`` (the one-sided NIXL mode) and the conformance suite against a
one-sided pair, each in its own pytest process: once a process has loaded NIXL, two-sided UCX
transfers in it can crash when a peer dies (a UCX 1.21 fault without its registration cache;
see backends/ucx/README.md), and this run goes on to two-sided tests."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvwire.testing.require import backend_module

backend_module("ucxx._lib.libucxx", "ucx", "ucxx-cu12==0.52.0")  # skips, or fails when the run requires ucx
from kvwire_ucx.nixl import nixl_problem  # noqa: E402

if nixl_problem() is not None:
    pytest.skip(nixl_problem(), allow_module_level=True)

HERE = Path(__file__).parent


class Run:
    """One pytest process, started at once, its per-test outcomes read later: both runs of this
    module start as soon as collection ends (``conftest.pytest_collection_finish``) and go on
    beside the rest of the session, which they share nothing with."""

    def __init__(self, *args: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvwire-one-sided-"))
        self.report = self.dir / "report.jsonl"
        (self.dir / "record_outcomes.py").write_text(
            "import json, os\n"
            "def pytest_runtest_logreport(report):\n"
            "    if report.when == 'call' or report.outcome != 'passed':\n"
            "        with open(os.environ['KVWIRE_OUTCOMES'], 'a') as f:\n"
            "            f.write(json.dumps({'test': report.nodeid, 'when': report.when, 'outcome': report.outcome}) + '\\n')\n"
        )
        env = dict(os.environ, KVWIRE_OUTCOMES=str(self.report),
                   PYTHONPATH=os.pathsep.join([str(HERE), str(self.dir), os.environ.get("PYTHONPATH", "")]))
        self.out = open(self.dir / "output.txt", "w+")  # noqa: SIM115 - read back in records()
        self.proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
                                      "record_outcomes", "-q", *args], stdout=self.out, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=HERE.parent.parent)

    def records(self) -> list[dict]:
        try:
            code = self.proc.wait(timeout=900)
        finally:
            self.stop()
        self.out.seek(0)
        output = self.out.read()
        records = [json.loads(line) for line in self.report.read_text().splitlines()] if self.report.exists() else []
        bad = [r for r in records if r["outcome"] == "failed"]
        assert code == 0 and not bad, f"rc {code}, failed {bad}\n{output[-8000:]}"
        return records

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


RUNS = {"cases": (str(HERE / "one_sided_cases.py"),),
        "suite": ("--pyargs", "kvwire.testing.suite", "--kvwire-harness", "kvwire_ucx.harness:one_sided",
                  "--kvwire-profile", "thorough")}
_started: dict[str, Run] = {}


def started(name: str) -> Run:
    """The run ``name``, started now if it was not yet."""
    if name not in _started:
        _started[name] = Run(*RUNS[name])
    return _started[name]


def start_early() -> None:
    for name in RUNS:
        started(name)


@atexit.register
def _stop_all() -> None:  # a session that ended before collecting them
    for run in _started.values():
        run.stop()


def test_one_sided_mode_cases() -> None:
    records = started("cases").records()
    passed = [r["test"] for r in records if r["outcome"] == "passed"]
    skipped = [r["test"] for r in records if r["outcome"] == "skipped"]
    assert not skipped, f"one-sided cases skipped although NIXL is installed: {skipped}"
    assert len(passed) >= 10, passed


def test_the_conformance_suite_passes_in_the_one_sided_mode() -> None:
    records = started("suite").records()
    passed = [r for r in records if r["outcome"] == "passed"]
    assert len(passed) >= 40, records
