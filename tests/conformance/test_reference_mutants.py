"""The suite against single-clause mutants of the reference backends (the harnesses of
``mutants/`` built by :class:`kit.StoreMutantHarness` or :class:`kit.PeerMutantHarness`, each a
subclass that changes the backend's own code): each must fail on a test named after the clause it
breaks; the unbroken reference backends must pass.

Each run is a real ``pytest --pyargs kvwire.testing.suite`` in a process of its own
(:mod:`suite_runs`), selected with ``-k``
to the broken clause's tests. A mutant the suite does not catch yet is marked
``xfail(strict=True)`` with the scenario that exposes it: once the suite catches it the mark
fails, and is removed. A harness that shows something only with a CUDA device (the DEVICE-memory
reference store and its mutants, ``needs_cuda``) is skipped, with that reason, on a host without
one: there it is the reference store, and its mutant would pass."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from mutant_table import MUTANTS as REGISTERED
from suite_runs import run_suite
from test_mutants import (
    HARNESSES,
    MUTANT_FILES,
    MUTANTS_DIR,
    REFERENCE_KINDS,
    cuda_skip,
    is_reference_mutant,
    rules_of,
    selected_mutants,
)

#: Every test of this module on one xdist worker: its module fixture starts every mutant's suite
#: run at once, and a second worker running any of its tests would start them all again.
pytestmark = pytest.mark.xdist_group("reference-mutants")

#: The kit, where the unbroken reference harnesses live.
KIT_FILE = MUTANTS_DIR / "kit.py"


def _survives(why: str) -> Any:
    return pytest.mark.xfail(strict=True, reason=f"suite does not catch this yet: {why}")


#: Mutants the suite does not catch yet: harness -> the scenario that exposes it (marked xfail).
SURVIVORS: dict[str, str] = {}

#: (harness object in mutants/, the rules a catching test may be named after (the first is the
#: broken clause's; others are rules the same bug necessarily breaks too, named by the selection),
#: -k selection, marks), from mutant_table.py.
MUTANTS: list[tuple[str, tuple[str, ...], str, tuple[Any, ...]]] = [
    (name, rules_of(clause, select), select, (_survives(SURVIVORS[name]),) if name in SURVIVORS else ())
    for _, name, clause, select in REGISTERED if is_reference_mutant(name)
]

UNBROKEN = ["reference_store", "reference_peer", "reference_device_store"]


@pytest.fixture(scope="module")
def mutant_runs(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:  # type: ignore[type-arg]
    """The suite run of every mutant whose test this session runs (all of them, or those a ``-k``
    left), started at once, three side by side (most of a run waits on a deadline or a wake that
    never comes)."""
    wanted = selected_mutants(request)
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield {
            mutant: pool.submit(run_suite, tmp_path_factory.mktemp(mutant), f"--kvwire-harness={MUTANT_FILES[mutant]}:{mutant}",
                                "-k", select, "--kvwire-patience=3", "--kvwire-no-shrink")
            for mutant, _, select, _ in MUTANTS if mutant in wanted and cuda_skip(mutant) is None
        }


@pytest.mark.parametrize(("mutant", "rules", "select"),
                         [pytest.param(m, r, s, marks=marks, id=m) for m, r, s, marks in MUTANTS])
def test_suite_catches_the_reference_mutant(mutant_runs: dict[str, Future], mutant: str,  # type: ignore[type-arg]
                                            rules: tuple[str, ...], select: str) -> None:
    if (why := cuda_skip(mutant)) is not None:
        pytest.skip(why)
    code, tests, output = mutant_runs[mutant].result()
    failed = [t["test"] for t in tests if t["outcome"] == "failed"]
    assert code == 1, f"the suite did not fail against {mutant} (exit {code}):\n{output[-3000:]}"
    assert any(name.startswith(f"test_{rule}_") for name in failed for rule in rules), (
        f"the suite failed against {mutant}, but not on a {'/'.join(rules)} test (failed: {failed}):\n"
        f"{output[-3000:]}")


@pytest.mark.parametrize("harness", UNBROKEN)
def test_suite_passes_the_unbroken_reference(tmp_path: Path, harness: str) -> None:
    """The harness plumbing of the mutants breaks nothing by itself: each mutant's failure is its
    one change."""
    if (why := cuda_skip(harness)) is not None:
        pytest.skip(why)
    code, tests, output = run_suite(tmp_path, f"--kvwire-harness={KIT_FILE}:{harness}")
    failed = [t["nodeid"] for t in tests if t["outcome"] == "failed"]
    assert code == 0 and not failed, f"the suite failed {harness}: {failed}\n{output[-3000:]}"


def test_every_reference_mutant_is_listed() -> None:
    """Every harness of mutants/ built on a reference backend is listed above: none goes unchecked."""
    harnesses = {name for files in HARNESSES.values() for name, value in files.items()
                 if isinstance(value, REFERENCE_KINDS)}
    assert harnesses - set(UNBROKEN) == {m[0] for m in MUTANTS}
    peers = {name for files in HARNESSES.values() for name, value in files.items()
             if isinstance(value, REFERENCE_KINDS[1])}
    assert len(MUTANTS) >= 24 and len(peers - set(UNBROKEN)) >= 8
