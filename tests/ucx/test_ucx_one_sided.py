"""Runs ``one_sided_cases.py`` (the one-sided NIXL mode) and the conformance suite against a
one-sided pair, each in its own pytest process: once a process has loaded NIXL, two-sided UCX
transfers in it can crash when a peer dies (a UCX 1.21 fault without its registration cache;
see backends/ucx/README.md), and this run goes on to two-sided tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvwire.testing.require import backend_module

backend_module("ucxx._lib.libucxx", "ucx", "ucxx-cu12==0.52.0")  # skips, or fails when the run requires ucx
from kvwire_ucx.nixl import nixl_problem  # noqa: E402

if nixl_problem() is not None:
    pytest.skip(nixl_problem(), allow_module_level=True)

HERE = Path(__file__).parent


def run_pytest(tmp_path: Path, *args: str) -> list[dict]:
    """Run pytest on ``args`` in a fresh process; the per-test outcomes it recorded."""
    report = tmp_path / "report.jsonl"
    plugin = tmp_path / "record_outcomes.py"
    plugin.write_text(
        "import json, os\n"
        "def pytest_runtest_logreport(report):\n"
        "    if report.when == 'call' or report.outcome != 'passed':\n"
        "        with open(os.environ['KVWIRE_OUTCOMES'], 'a') as f:\n"
        "            f.write(json.dumps({'test': report.nodeid, 'when': report.when, 'outcome': report.outcome}) + '\\n')\n"
    )
    env = dict(os.environ, KVWIRE_OUTCOMES=str(report),
               PYTHONPATH=os.pathsep.join([str(HERE), str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "record_outcomes", "-q",
                          *args], capture_output=True, text=True, timeout=900, env=env, cwd=HERE.parent.parent)
    records = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    bad = [r for r in records if r["outcome"] == "failed"]
    assert run.returncode == 0 and not bad, f"rc {run.returncode}, failed {bad}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"
    return records


def test_one_sided_mode_cases(tmp_path) -> None:
    records = run_pytest(tmp_path, str(HERE / "one_sided_cases.py"))
    passed = [r["test"] for r in records if r["outcome"] == "passed"]
    skipped = [r["test"] for r in records if r["outcome"] == "skipped"]
    assert not skipped, f"one-sided cases skipped although NIXL is installed: {skipped}"
    assert len(passed) >= 10, passed


def test_pushed_offer_cases(tmp_path) -> None:
    records = run_pytest(tmp_path, str(HERE / "pushed_offer_cases.py"))
    passed = [r["test"] for r in records if r["outcome"] == "passed"]
    skipped = [r["test"] for r in records if r["outcome"] == "skipped"]
    assert not skipped, f"pushed-offer cases skipped although NIXL is installed: {skipped}"
    assert len(passed) >= 15, passed


def test_the_conformance_suite_passes_in_the_one_sided_mode(tmp_path) -> None:
    records = run_pytest(tmp_path, "--pyargs", "kvwire.testing.suite", "--kvwire-harness",
                         "kvwire_ucx.harness:one_sided", "--kvwire-profile", "thorough")
    passed = [r for r in records if r["outcome"] == "passed"]
    assert len(passed) >= 40, records
