"""One run of the conformance suite against one harness, as a user runs it: ``pytest --pyargs
kvwire.testing.suite`` in a process of its own, from an empty directory (no project
configuration applies), with no ``KVWIRE_*`` or ``PYTEST_*`` variable of this run.

Hundreds of mutants each need such a run, and most of a run's CPU was the start of a fresh
Python: importing pytest, hypothesis and numpy again (about two seconds of CPU each time on
this machine). So the runs are forked from one server process that imported those once
(``multiprocessing``'s forkserver, which is single-threaded when it forks); each run is still
a process of its own and a pytest session of its own, and kvwire's own modules are imported in
it afresh, so pytest rewrites the suite's asserts as it does for a user."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_suite"]

#: Imported once by the server the runs fork from: the third-party packages every run imports.
#: kvwire's modules are left out on purpose (pytest marks them for assert rewriting at start).
PRELOAD = ["numpy", "hypothesis", "pytest", "_pytest.python", "_pytest.assertion.rewrite", "xdist", "msgpack"]

#: How long one run may take before it is killed (its exit status is then -9).
TIMEOUT_S = 600.0
#: A forked run writes its exit status here (in its directory) just before it exits.
EXIT_FILE = "exit-status"

_context: Any = None


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _run(cwd: str, args: list[str], output: str) -> None:
    """The run itself, in the forked process: its output to ``output``, its exit status pytest's."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    for name in [n for n in os.environ if n.startswith(("KVWIRE_", "PYTEST_"))]:
        del os.environ[name]
    sys.argv = ["pytest", *args]
    import pytest

    code = int(pytest.main(args))
    sys.stdout.flush()
    sys.stderr.flush()
    Path(EXIT_FILE).write_text(str(code))  # cwd: the run's directory
    os._exit(code)


def run_suite(tmp_path: Path, *args: str, fresh: bool = False) -> tuple[int, list[dict[str, Any]], str]:
    """Run the suite with ``args`` from ``tmp_path`` (left empty but for a bare ``pytest.ini``);
    return its exit status, its per-test report and its output. ``fresh``: in a new Python
    started for it, which sees this process's environment as it is now (``PYTHONPATH``
    included), where a forked run sees the server's."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.json"
    output = tmp_path / "output.txt"
    profile = os.environ.get("KVWIRE_MUTANT_PROFILE", "quick")
    argv = ["--pyargs", "kvwire.testing.suite", "-q", "-p", "no:cacheprovider", f"--kvwire-profile={profile}",
            f"--kvwire-report={report}", "--hypothesis-seed=0", *args]
    if fresh:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVWIRE_", "PYTEST_"))}
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", *argv], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=TIMEOUT_S)
            code, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, text = -9, f"{exc.stdout or ''}{exc.stderr or ''}\n[the run was killed after {TIMEOUT_S} s]"
        return code, _tests(report), text
    # pytest and hypothesis were imported by the server before pytest could mark them for
    # rewriting; it says so, harmlessly (nothing of theirs is a test).
    argv += ["-W", "ignore::pytest.PytestAssertRewriteWarning"]
    process = _forkserver().Process(target=_run, args=(str(tmp_path), argv, str(output)))
    process.start()
    process.join(TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()
    code = process.exitcode if process.exitcode is not None else -9
    recorded = tmp_path / EXIT_FILE
    if code == 255 and recorded.exists():
        # multiprocessing answers 255 when it cannot read the status from the forkserver (seen once
        # in a whole run, the run's own output ending "1 failed"); the run wrote its status first.
        code = int(recorded.read_text())
    tests = _tests(report)
    text = output.read_text(errors="replace") if output.exists() else ""
    if code < 0:
        text += f"\n[the run was killed by signal {-code}{' after ' + str(TIMEOUT_S) + ' s' if code == -9 else ''}]"
    return code, tests, text


def _tests(report: Path) -> list[dict[str, Any]]:
    return json.loads(report.read_text())["tests"] if report.exists() else []
