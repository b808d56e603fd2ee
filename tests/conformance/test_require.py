"""``--kvwire-require``: a run that expects a backend fails, before any test, when it cannot load,
and a test that needs a required backend's library fails instead of skipping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _pytest(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVWIRE_", "PYTEST_"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=tmp_path,
                          env={**base, **(env or {})}, capture_output=True, text=True, timeout=120)


def test_a_required_backend_that_is_not_installed_stops_the_run(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    run = _pytest(tmp_path, "--kvwire-require", "memory,kvwire-no-such-backend", "test_nothing.py")
    assert run.returncode == 4, run.stdout + run.stderr
    assert "'kvwire-no-such-backend' is required but does not load" in run.stdout + run.stderr
    assert "1 passed" not in run.stdout
    # The same through the environment, as ./dev.sh sets it.
    run = _pytest(tmp_path, "test_nothing.py", env={"KVWIRE_REQUIRE": "kvwire-no-such-backend"})
    assert run.returncode == 4 and "kvwire-no-such-backend" in run.stdout + run.stderr


def test_installed_backends_pass_the_check(tmp_path: Path) -> None:
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    run = _pytest(tmp_path, "--kvwire-require", "memory", "test_nothing.py")
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


def test_a_missing_library_fails_for_a_required_backend_and_skips_otherwise(tmp_path: Path) -> None:
    (tmp_path / "test_lib.py").write_text(
        "from kvwire.testing.require import backend_module\n"
        "backend_module('kvwire_no_such_module', 'memory', 'the memory backend needs it')\n"
        "def test_uses_it():\n    pass\n")
    skipped = _pytest(tmp_path, "-rs", "test_lib.py")
    assert skipped.returncode == 5 and "1 skipped" in skipped.stdout, skipped.stdout  # 5: nothing ran
    assert "kvwire_no_such_module is not importable" in skipped.stdout
    failed = _pytest(tmp_path, "--kvwire-require", "memory", "test_lib.py")
    assert failed.returncode != 0, failed.stdout
    assert "backend 'memory' is required (--kvwire-require) but kvwire_no_such_module" in failed.stdout
