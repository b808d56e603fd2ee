"""What a harness author meets: a harness passed with ``--kvwire-harness`` under a name no
installed plugin has still runs (its capabilities come from a built backend), and a failure is
reported under the rule it breaks, also when hypothesis groups several failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RENAMED = '''
from kvwire_memory.harness import MemoryHarness


class Renamed(MemoryHarness):
    name = "kvwire-suite-renamed-memory"


harness = Renamed()
'''


def _suite(tmp_path: Path, *args: str) -> tuple[int, list[dict], str]:  # type: ignore[type-arg]
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVWIRE_", "PYTEST_"))}
    run = subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "kvwire.testing.suite", "-q", "-p",
                          "no:cacheprovider", f"--kvwire-report={report}", *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    tests = json.loads(report.read_text())["tests"] if report.exists() else []
    return run.returncode, tests, run.stdout + run.stderr


def test_a_harness_under_a_new_name_runs_without_a_registry_entry(tmp_path: Path) -> None:
    (tmp_path / "renamed.py").write_text(RENAMED)
    code, tests, out = _suite(tmp_path, f"--kvwire-harness={tmp_path / 'renamed.py'}:harness", "-k", "B4 or S1")
    assert code == 0, out
    assert any(t["outcome"] == "passed" and t["test"].startswith("test_B4_") for t in tests), tests


def test_a_failure_is_reported_under_the_rule_it_breaks(tmp_path: Path) -> None:
    mutants = Path(__file__).with_name("mutants") / "attempt.py"
    code, tests, out = _suite(tmp_path, f"--kvwire-harness={mutants}:marks_torn_rows", "-k", "A1_")
    assert code == 1, out
    failed = [t for t in tests if t["outcome"] == "failed"]
    assert failed and all(t["test"].startswith("test_A1_") for t in failed), failed
    assert all(t["broken"] == ["A7"] and t["reason"].startswith("A7:") for t in failed), failed
    assert "kvwire: rule broken" in out and "A7 (found by test_A1_" in out, out
