"""The conformance suite is itself tested: against each deliberately broken backend of
``mutants.py`` and ``mutants_*.py`` it must fail, on a test named after the rule of the clause the
mutant breaks (or a rule its selection names); against the memory backend, and against the wrapper
that breaks nothing, it must pass. Every mutant is registered once, in ``mutant_table.py``.

Each run is a real ``pytest --pyargs kvwire.testing.suite`` in a subprocess, as a plugin author
runs it, selected with ``-k`` to the broken rule's tests so the whole module stays fast."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from mutant_table import MUTANTS as REGISTERED

#: Every test of this module on one xdist worker: its module fixture starts every mutant's suite
#: run at once, and a second worker running any of its tests would start them all again.
pytestmark = pytest.mark.xdist_group("mutants")

MUTANTS_FILE = Path(__file__).with_name("mutants.py")
#: The mutant files with a runner of their own (test_lookup_mutants.py, test_reference_mutants.py).
OWN_RUNNER = ("lookup_mutants.py", "reference_mutants.py")


def rules_of(clause: str, select: str) -> tuple[str, ...]:
    """The rules a catching test may be named after: the broken clause's, then any other rule the
    ``-k`` selection names (``"A10 or A8"``: the bug necessarily breaks both)."""
    rule = clause.split(".")[0]
    named = [term for term in select.split(" or ") if re.fullmatch(r"[A-Z][0-9]+", term)]
    return (rule, *dict.fromkeys(t for t in named if t != rule))


#: (harness, the clause it breaks, -k selection of the suite's tests) of each mutant this module runs.
MUTANTS: list[tuple[str, str, str]] = [(name, clause, select) for file, name, clause, select in REGISTERED
                                       if file not in OWN_RUNNER]
#: Where each mutant harness lives: mutants.py, or a mutants_*.py file beside it.
MUTANT_FILES: dict[str, Path] = {name: MUTANTS_FILE.with_name(file) for file, name, _, _ in REGISTERED
                                 if file not in OWN_RUNNER}
assert len(MUTANT_FILES) == len(MUTANTS), "a mutant is registered twice in mutant_table.py"


def run_suite(tmp_path: Path, *args: str) -> tuple[int, list[dict[str, Any]], str]:
    """Run the suite in a subprocess from an empty directory (so no project configuration
    applies); return its exit status, its per-test report and its output."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVWIRE_", "PYTEST_"))}
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "kvwire.testing.suite", "-q", "-p", "no:cacheprovider",
           "--kvwire-profile=quick", f"--kvwire-report={report}", "--hypothesis-seed=0", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    tests = json.loads(report.read_text())["tests"] if report.exists() else []
    return proc.returncode, tests, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def mutant_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:  # type: ignore[type-arg]
    """Every mutant's suite run, started at once: most of a run is waiting (for a wake that never
    comes, a deadline), so a few run side by side."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield {
            mutant: pool.submit(run_suite, tmp_path_factory.mktemp(mutant), f"--kvwire-harness={MUTANT_FILES[mutant]}:{mutant}",
                                "-k", select, "--kvwire-patience=2", "--kvwire-no-shrink", "-x")
            for mutant, _, select in MUTANTS
        }


@pytest.mark.parametrize(("mutant", "clause", "select"), MUTANTS, ids=[m[0] for m in MUTANTS])
def test_suite_catches_the_mutant(mutant_runs: dict[str, Future], mutant: str, clause: str,  # type: ignore[type-arg]
                                  select: str) -> None:
    code, tests, output = mutant_runs[mutant].result()
    failed = [t["test"] for t in tests if t["outcome"] == "failed"]
    rules = rules_of(clause, select)
    assert code == 1, f"the suite did not fail against {mutant} (exit {code}):\n{output[-3000:]}"
    assert any(f"_{rule}_" in name for name in failed for rule in rules), (
        f"the suite failed against {mutant} ({clause}), but not on a {'/'.join(rules)} test (failed: {failed}):\n"
        f"{output[-3000:]}")


def test_all_mutants_are_exported() -> None:
    """Every mutant harness in mutants.py and in each mutants_*.py is registered in mutant_table.py:
    none goes unchecked."""
    import importlib.util

    files = {path.name for path in MUTANTS_FILE.parent.glob("mutants*.py")}
    assert files == {path.name for path in MUTANT_FILES.values()}, "a mutants*.py file has no registered mutant"

    sys.path.insert(0, str(MUTANTS_FILE.parent))
    try:
        for path in sorted(set(MUTANT_FILES.values())):
            spec = importlib.util.spec_from_file_location(f"kvwire_conformance_{path.stem}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            harness_type = sys.modules["mutants"].MutantHarness if path != MUTANTS_FILE else module.MutantHarness
            harnesses = {name for name, value in vars(module).items() if isinstance(value, harness_type)}
            listed = {name for name, file in MUTANT_FILES.items() if file == path}
            assert harnesses - {"faithful", "faithful_peer"} == listed, f"{path.name}: harnesses and list differ"
    finally:
        sys.path.remove(str(MUTANTS_FILE.parent))
    assert len(MUTANTS) >= 12


def test_suite_passes_the_memory_backend(tmp_path: Path) -> None:
    code, tests, output = run_suite(tmp_path, "--kvwire-backend=memory")
    failed = [t["nodeid"] for t in tests if t["outcome"] == "failed"]
    assert code == 0 and not failed, f"the suite failed the memory backend: {failed}\n{output[-3000:]}"
    rules = {t["test"].split("_")[1] for t in tests if t["outcome"] == "passed" and t["test"].startswith("test_")}
    assert {"M1", "M3", "M4", "V1", "V2", "V4", "H1", "S1", "S3", "A1", "A5", "A7", "A8", "W1", "B3", "B4"} <= rules


@pytest.mark.parametrize("harness", ["mutants.py:faithful", "mutants.py:faithful_peer", "loopback_peer.py:harness",
                                     "mutants_capacity.py:faithful", "mutants_blocks.py:faithful"])
def test_suite_passes_correct_backends(tmp_path: Path, harness: str) -> None:
    """The mutants' wrappers break nothing by themselves (so each mutant's failure is its one
    change), and the loopback serving peer, which runs the N2 tests, is correct."""
    code, tests, output = run_suite(tmp_path, f"--kvwire-harness={MUTANTS_FILE.parent / harness}")
    failed = [t["nodeid"] for t in tests if t["outcome"] == "failed"]
    assert code == 0 and not failed, f"the suite failed {harness}: {failed}\n{output[-3000:]}"
    if "peer" in harness:
        assert any(t["test"].startswith("test_N2_") and t["outcome"] == "passed" for t in tests)
