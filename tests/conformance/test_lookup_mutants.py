"""The suite's L1 tests are themselves tested: the mutants of ``mutants/lookup.py`` each break one
promise of ``lookup`` and are registered, like every mutant, in ``mutant_table.py`` (the wrappers
among them are run by ``test_mutants.py``, the reference subclasses by
``test_reference_mutants.py``); against the wrapper that breaks nothing the L1 tests must pass.
Each run is a real ``pytest --pyargs kvwire.testing.suite -k L1`` in a subprocess
(:func:`test_mutants.run_suite`)."""

from __future__ import annotations

from pathlib import Path

from mutant_table import MUTANTS as REGISTERED
from test_mutants import HARNESSES, MUTANTS_DIR, run_suite

LOOKUP_FILE = MUTANTS_DIR / "lookup.py"


def test_all_lookup_mutants_are_listed() -> None:
    """Every harness of mutants/lookup.py but the faithful wrapper is registered, against an L1
    clause."""
    listed = {name: clause for file, name, clause, _ in REGISTERED if MUTANTS_DIR.parent / file == LOOKUP_FILE}
    assert set(HARNESSES[LOOKUP_FILE]) - {"faithful_lookup"} == set(listed)
    assert all(clause.startswith("L1.") for clause in listed.values()), listed
    assert len(listed) >= 15


def test_suite_passes_the_faithful_lookup_wrapper(tmp_path: Path) -> None:
    """The wrapper breaks nothing: every L1 test passes, none is skipped (the memory backend
    declares lookup)."""
    code, tests, output = run_suite(tmp_path, f"--kvwire-harness={LOOKUP_FILE}:faithful_lookup", "-k", "L1")
    outcomes = {t["nodeid"]: t["outcome"] for t in tests}
    assert code == 0 and outcomes and set(outcomes.values()) == {"passed"}, (
        f"the L1 tests did not all pass the faithful wrapper: {outcomes}\n{output[-3000:]}")
