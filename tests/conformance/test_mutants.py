"""The conformance suite is itself tested: against each deliberately broken backend of
``mutants.py`` it must fail, on a test named after the rule the mutant breaks; against the
memory backend, and against the wrapper that breaks nothing, it must pass.

More mutants live in ``mutants_*.py`` beside it, each file with a module-level ``CATCHES`` list
of ``(harness, rule, -k selection)``, read here without importing the file.

Each run is a real ``pytest --pyargs kvwire.testing.suite`` in a subprocess, as a plugin author
runs it, selected with ``-k`` to the broken rule's tests so the whole module stays fast."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

#: Every test of this module on one xdist worker: its module fixture starts every mutant's suite
#: run at once, and a second worker running any of its tests would start them all again.
pytestmark = pytest.mark.xdist_group("mutants")

MUTANTS_FILE = Path(__file__).with_name("mutants.py")

#: (harness object in mutants.py, the rule it breaks, -k selection of the suite's tests).
MUTANTS: list[tuple[str, str, str]] = [
    ("accepts_undeclared_memory", "M1", "M1"),
    ("skips_unrecognized_rows", "M4", "M4"),
    ("registers_part_of_a_batch", "M3", "M3"),
    ("writes_past_the_slot", "M2", "M2"),
    ("reverses_groups", "V1", "V1"),
    ("changes_the_view", "V2", "V2"),
    ("shared_row_masks", "V3", "V3"),
    ("drops_overlapping_fetch_rows", "V4", "V4"),
    ("accepts_any_hint", "H1", "H1"),
    ("publishes_nowhere", "S1", "S1"),
    ("scrubs_published_rows", "S2", "S2"),
    ("escapes_on_rejection", "S3", "S3"),
    ("raises_plain_errors", "S4", "S4"),
    ("raises_faults", "S5", "S5"),
    ("blocks_in_poll", "A1", "A1"),
    ("unstable_outcome", "A1", "A1"),
    ("quiesces_early", "A2", "A2"),
    ("needs_polling", "A3", "A3"),
    ("ignores_cancel", "A4", "A4"),
    ("miss_as_failure", "A5", "A5"),
    ("fault_as_miss", "A5", "A5"),
    ("keeps_non_bool_mask", "A6", "A6"),
    ("mutates_mask_after_handover", "A6", "A6"),
    ("marks_torn_rows", "A7", "A7"),
    ("ignores_deadline", "A8", "A8"),
    ("limits_batches", "A9", "A9"),
    ("wakes_early", "W1", "W1"),
    ("silent_cancel", "W1", "W1"),
    ("shares_shutdown", "B1", "B1"),
    ("thread_bound_attempts", "B2", "B2"),
    ("accepts_after_shutdown", "B3", "B3"),
    ("drifting_capabilities", "B4", "B4"),
    ("partial_prefix_fails", "N2", "N2"),
    ("serves_without_wake", "N2", "N2"),
    ("decline_delivers", "N2", "N2"),
]


def _catches(path: Path) -> list[tuple[str, str, str]]:
    """The ``CATCHES`` list of a ``mutants_*.py`` file, read as a literal (nothing imported)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "CATCHES" for t in node.targets):
            return [tuple(entry) for entry in ast.literal_eval(node.value)]  # type: ignore[misc]
    raise AssertionError(f"{path.name} has no CATCHES list")


#: Where each mutant harness lives: mutants.py, or the mutants_*.py file that lists it.
MUTANT_FILES: dict[str, Path] = {name: MUTANTS_FILE for name, _, _ in MUTANTS}
for _path in sorted(MUTANTS_FILE.parent.glob("mutants_*.py")):
    for _entry in _catches(_path):
        assert _entry[0] not in MUTANT_FILES, f"mutant {_entry[0]} is listed twice"
        MUTANT_FILES[_entry[0]] = _path
        MUTANTS.append(_entry)


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


@pytest.mark.parametrize(("mutant", "rule", "select"), MUTANTS, ids=[m[0] for m in MUTANTS])
def test_suite_catches_the_mutant(mutant_runs: dict[str, Future], mutant: str, rule: str,  # type: ignore[type-arg]
                                  select: str) -> None:
    code, tests, output = mutant_runs[mutant].result()
    failed = [t["test"] for t in tests if t["outcome"] == "failed"]
    assert code == 1, f"the suite did not fail against {mutant} (exit {code}):\n{output[-3000:]}"
    assert any(f"_{rule}_" in name for name in failed), (
        f"the suite failed against {mutant}, but not on a {rule} test (failed: {failed}):\n{output[-3000:]}")


def test_all_mutants_are_exported() -> None:
    """Every mutant harness in mutants.py and in each mutants_*.py is listed: none goes unchecked."""
    import importlib.util

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
