"""The ways people run the suite: one pytest command per backend, the report header, the
runner behind ``kvwire conformance``, and the third-party template passing it."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kvwire.contract import CONTRACT_VERSION
from kvwire.testing.runner import RULES, rules_of, run_conformance, summarize

HERE = Path(__file__).parent


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "kvwire.testing.suite", "-p",
                           "no:cacheprovider", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_report_header_names_backend_version_contract_and_capabilities(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "--kvwire-backend=memory", "--collect-only")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    version = metadata.version("kvwire-memory")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("kvwire backend memory:"))
    assert f"kvwire-memory {version}" in line and "speaks contract {}.{}".format(*CONTRACT_VERSION) in line
    assert "store fetch+publish [host]" in line and "cancel" in line and "names" in line
    assert any(x.startswith("kvwire 0.") and "profile quick" in x for x in proc.stdout.splitlines())


def test_every_installed_backend_with_a_harness_is_a_target(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "--collect-only", "-q")
    assert "test_M3_overlapping_region_refused[memory]" in proc.stdout


def test_an_unknown_backend_is_a_usage_error(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "--kvwire-backend=no-such-backend")
    assert proc.returncode == 4
    assert "no backend 'no-such-backend' is installed" in proc.stderr


def test_a_harness_spec_that_does_not_load_is_a_usage_error(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, f"--kvwire-harness={HERE / 'mutants' / 'kit.py'}:no_such_object")
    assert proc.returncode == 4
    assert "has no attribute 'no_such_object'" in proc.stderr


def test_test_names_map_to_rules() -> None:
    assert rules_of("test_M3_overlapping_region_refused") == ["M3"]
    assert rules_of("test_A5_S5_both") == ["A5", "S5"]
    assert rules_of("test_stateful_holder_model") == ["holder model"]
    assert rules_of("test_something_else") == []
    table = summarize([
        {"test": "test_M3_a", "backend": "x", "outcome": "passed"},
        {"test": "test_M3_b", "backend": "x", "outcome": "skipped", "reason": "backend does not declare fetch"},
        {"test": "test_N2_c", "backend": "x", "outcome": "skipped", "reason": "backend does not declare it"},
        {"test": "test_A1_d", "backend": "x", "outcome": "failed", "reason": "A1: blocked"},
    ])["x"]
    assert table["M3"].status == "passed" and table["N2"].status == "skipped" and table["A1"].status == "failed"
    assert set(table) <= set(RULES)


def test_run_conformance_summarizes_by_rule(capfd: pytest.CaptureFixture[str]) -> None:
    code = run_conformance(["memory"], extra_args=["-k", "M3 or N2"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "kvwire conformance · memory · profile quick" in out
    m3 = next(line for line in out.splitlines() if line.startswith("│ M3"))
    assert "passed" in m3
    n2 = next(line for line in out.splitlines() if line.startswith("│ N2"))
    assert "skipped" in n2 and "serve-pulls" in n2
    assert "conformant" in out


def test_run_conformance_fails_a_broken_backend(capfd: pytest.CaptureFixture[str]) -> None:
    code = run_conformance([], extra_args=[f"--kvwire-harness={HERE / 'mutants' / 'memory.py'}:skips_unrecognized_rows",
                                           "-k", "M4", "--kvwire-no-shrink", "--hypothesis-seed=0"])
    out = capfd.readouterr().out
    assert code == 1, out
    m4 = next(line for line in out.splitlines() if line.startswith("│ M4"))
    assert "failed" in m4
    assert "not conformant" in out


def test_the_third_party_template_passes_with_one_command(tmp_path: Path) -> None:
    try:
        metadata.distribution("kvwire-example")
    except metadata.PackageNotFoundError:
        pytest.skip("kvwire-example is not installed (pip install -e examples/third_party_plugin)")
    proc = _pytest(tmp_path, "--kvwire-backend=example", "--hypothesis-seed=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "kvwire backend example: kvwire-example 0.1.0" in proc.stdout
