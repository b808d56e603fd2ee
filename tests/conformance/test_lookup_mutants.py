"""The suite's L1 tests are themselves tested: against each broken ``lookup`` of
``lookup_mutants.py`` they must fail, on a ``test_L1_`` test; against the wrapper that breaks
nothing they must pass. Each run is a real ``pytest --pyargs kvwire.testing.suite -k L1`` in a
subprocess (:func:`test_mutants.run_suite`)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from mutant_table import MUTANTS as REGISTERED
from test_mutants import run_suite

#: Every test of this module on one xdist worker: its module fixture starts every mutant's suite
#: run at once, and a second worker running any of its tests would start them all again.
pytestmark = pytest.mark.xdist_group("lookup-mutants")

MUTANTS_FILE = Path(__file__).with_name("lookup_mutants.py")

#: The harness objects of lookup_mutants.py that break one promise of lookup each (mutant_table.py).
MUTANTS = [name for file, name, _, _ in REGISTERED if file == MUTANTS_FILE.name]


@pytest.fixture(scope="module")
def lookup_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:  # type: ignore[type-arg]
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            mutant: pool.submit(run_suite, tmp_path_factory.mktemp(mutant), f"--kvwire-harness={MUTANTS_FILE}:{mutant}",
                                "-k", "L1", "--kvwire-patience=2", "--kvwire-no-shrink", "-x")
            for mutant in MUTANTS
        }


@pytest.mark.parametrize("mutant", MUTANTS)
def test_suite_catches_the_lookup_mutant(lookup_runs: dict[str, Future], mutant: str) -> None:  # type: ignore[type-arg]
    code, tests, output = lookup_runs[mutant].result()
    failed = [t["test"] for t in tests if t["outcome"] == "failed"]
    assert code == 1, f"the suite did not fail against {mutant} (exit {code}):\n{output[-3000:]}"
    assert any(name.startswith("test_L1_") for name in failed), (
        f"the suite failed against {mutant}, but not on an L1 test (failed: {failed}):\n{output[-3000:]}")


def test_all_lookup_mutants_are_listed() -> None:
    harnesses = {name for name, value in _module().items() if type(value).__name__ == "MutantHarness"}
    assert harnesses - {"faithful_lookup"} == set(MUTANTS)


def test_suite_passes_the_faithful_lookup_wrapper(tmp_path: Path) -> None:
    """The wrapper breaks nothing: every L1 test passes, none is skipped (the memory backend
    declares lookup)."""
    code, tests, output = run_suite(tmp_path, f"--kvwire-harness={MUTANTS_FILE}:faithful_lookup", "-k", "L1")
    outcomes = {t["nodeid"]: t["outcome"] for t in tests}
    assert code == 0 and outcomes and set(outcomes.values()) == {"passed"}, (
        f"the L1 tests did not all pass the faithful wrapper: {outcomes}\n{output[-3000:]}")


def _module() -> dict[str, object]:
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("kvwire_conformance_lookup_mutants", MUTANTS_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(MUTANTS_FILE.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(MUTANTS_FILE.parent))
    return vars(module)
