"""The conformance suite is itself tested: against each deliberately broken backend of
``mutants/`` that wraps a correct one (:class:`kit.MutantHarness`) it must fail, on a test named
after the rule of the clause the mutant breaks (or a rule its selection names); against the memory
backend, and against the wrappers that break nothing, it must pass. Every mutant is registered
once, in ``mutant_table.py``, and filed in ``mutants/<family>.py`` by the rule family of the clause it
breaks; the subclasses of the reference backends (:class:`kit.StoreMutantHarness`,
:class:`kit.PeerMutantHarness`) are run by ``test_reference_mutants.py``.

Each run is a real ``pytest --pyargs kvwire.testing.suite`` in a subprocess, as a plugin author
runs it, selected with ``-k`` to the broken rule's tests so the whole module stays fast."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from mutant_table import MUTANTS as REGISTERED
from suite_runs import run_suite

import kvwire.testing.suite as suite
from kvwire.testing.harness import Harness
from kvwire.testing.regions import cuda_devices

#: Every test of this module on one xdist worker: its module fixture starts every mutant's suite
#: run at once, and a second worker running any of its tests would start them all again.
pytestmark = pytest.mark.xdist_group("mutants")

MUTANTS_DIR = Path(__file__).with_name("mutants")
#: The rule family of each rule: the file of ``mutants/`` (and of ``kvwire.testing.suite``) it is filed in.
FAMILIES = {"M": "memory", "V": "view", "H": "hints", "S": "submit", "A": "attempt", "W": "wake", "B": "lifecycle",
            "N": "pulls", "L": "lookup", "O": "offers", "K": "blocks"}
#: The harnesses of ``mutants/`` that break nothing, which the suite must pass.
UNBROKEN = ("faithful", "faithful_peer", "faithful_lookup", "reference_store", "reference_peer",
            "reference_device_store")


def rules_of(clause: str, select: str) -> tuple[str, ...]:
    """The rules a catching test may be named after: the broken clause's, then any other rule the
    ``-k`` selection names (``"A10 or A8"``: the bug necessarily breaks both; ``"S3 and
    slot_frees"``: the one test of another rule that also checks this clause)."""
    rule = clause.split(".")[0]
    named = [head for term in select.split(" or ") if re.fullmatch(r"[A-Z][0-9]+", head := term.split(" and ")[0])]
    return (rule, *dict.fromkeys(t for t in named if t != rule))


def load_mutant_files() -> tuple[Any, dict[Path, dict[str, Harness]]]:
    """The kit, and every harness of each file of ``mutants/``, imported as the suite imports a
    harness file: with the folder on ``sys.path``, so each imports the kit as ``kit``."""
    sys.path.insert(0, str(MUTANTS_DIR))
    try:
        kit = importlib.import_module("kit")
        files: dict[Path, dict[str, Harness]] = {}
        for path in sorted(MUTANTS_DIR.glob("*.py")):
            if path.stem == "kit":
                module = kit
            else:
                spec = importlib.util.spec_from_file_location(f"kvwire_conformance_mutants_{path.stem}", path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            files[path] = {name: value for name, value in vars(module).items() if isinstance(value, Harness)}
    finally:
        sys.path.remove(str(MUTANTS_DIR))
    return kit, files


KIT, HARNESSES = load_mutant_files()
#: The file of mutants/ each registered mutant lives in.
MUTANT_FILES: dict[str, Path] = {name: MUTANTS_DIR.parent / file for file, name, _, _ in REGISTERED}
assert len(MUTANT_FILES) == len(REGISTERED), "a mutant is registered twice in mutant_table.py"
#: The harness kinds of the reference backends' subclasses (run by test_reference_mutants.py).
REFERENCE_KINDS = (KIT.StoreMutantHarness, KIT.PeerMutantHarness)


def is_reference_mutant(name: str) -> bool:
    return isinstance(HARNESSES[MUTANT_FILES[name]][name], REFERENCE_KINDS)


@functools.cache
def _cuda_present() -> bool:
    return bool(cuda_devices())


def cuda_skip(name: str) -> str | None:
    """Why the harness ``name`` of mutants/ cannot run on this host, or ``None`` where it runs: a
    harness that shows something only with a CUDA device (``needs_cuda``: the DEVICE-memory
    reference store and its mutants) on a host without one. Torch is imported only to ask."""
    harness = next(files[name] for files in HARNESSES.values() if name in files)
    if not getattr(harness, "needs_cuda", False) or _cuda_present():
        return None
    return (f"{name} needs a CUDA device and this host has none: without one its backend declares HOST memory "
            "only and is the reference store, so the DEVICE rows it is about cannot move here (it runs where "
            "CUDA exists)")


#: (harness, the clause it breaks, -k selection of the suite's tests) of each mutant this module runs.
MUTANTS: list[tuple[str, str, str]] = [(name, clause, select) for _, name, clause, select in REGISTERED
                                       if not is_reference_mutant(name)]


def selected_mutants(request: pytest.FixtureRequest) -> set[str]:
    """The mutants whose test this session runs in the requesting module: all of them, or those a
    ``-k`` left, so that checking one mutant runs one suite."""
    return {item.callspec.params["mutant"] for item in request.session.items
            if item.module is request.module and "mutant" in getattr(getattr(item, "callspec", None), "params", {})}


@pytest.fixture(scope="module")
def mutant_runs(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future]]:  # type: ignore[type-arg]
    """Every selected mutant's suite run, started at once: most of a run is waiting (for a wake
    that never comes, a deadline), so a few run side by side."""
    wanted = selected_mutants(request)
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield {
            mutant: pool.submit(run_suite, tmp_path_factory.mktemp(mutant), f"--kvwire-harness={MUTANT_FILES[mutant]}:{mutant}",
                                "-k", select, "--kvwire-patience=2", "--kvwire-no-shrink", "-x")
            for mutant, _, select in MUTANTS if mutant in wanted
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
    """Every harness of each file of ``mutants/`` is registered in mutant_table.py, save the ones
    that break nothing: none goes unchecked."""
    files = {path.relative_to(MUTANTS_DIR.parent) for path in HARNESSES if path.stem != "kit"}
    assert files == {path.relative_to(MUTANTS_DIR.parent) for path in MUTANT_FILES.values()}, (
        "a file of mutants/ has no registered mutant, or the table names a file that is not there")
    for path, harnesses in HARNESSES.items():
        listed = {name for name, file in MUTANT_FILES.items() if file == path}
        assert set(harnesses) - set(UNBROKEN) == listed, f"{path.name}: harnesses and mutant_table.py differ"
    assert len(MUTANTS) >= 12


def test_every_mutant_is_filed_by_the_family_of_the_clause_it_breaks() -> None:
    """A mutant lives in ``mutants/<family>.py``, the family of the rule of its clause (the
    families of ``kvwire.testing.suite``'s files): never in a file named after when it was written."""
    misfiled = [(name, clause, file) for file, name, clause, _ in REGISTERED
                if file != f"mutants/{FAMILIES[clause[0]]}.py"]
    assert not misfiled, f"mutants filed outside the family of their clause: {misfiled}"
    suite_files = {p.stem.removeprefix("test_") for p in Path(suite.__file__).parent.glob("test_*.py")}
    assert set(FAMILIES.values()) <= suite_files


def test_suite_passes_the_memory_backend(tmp_path: Path) -> None:
    code, tests, output = run_suite(tmp_path, "--kvwire-backend=memory")
    failed = [t["nodeid"] for t in tests if t["outcome"] == "failed"]
    assert code == 0 and not failed, f"the suite failed the memory backend: {failed}\n{output[-3000:]}"
    rules = {t["test"].split("_")[1] for t in tests if t["outcome"] == "passed" and t["test"].startswith("test_")}
    assert {"M1", "M3", "M4", "V1", "V2", "V4", "H1", "S1", "S3", "A1", "A5", "A7", "A8", "W1", "B3", "B4"} <= rules


@pytest.mark.parametrize("harness", ["mutants/kit.py:faithful", "mutants/kit.py:faithful_peer", "loopback_peer.py:harness",
                                     "mutants/submit.py:faithful", "mutants/blocks.py:faithful"])
def test_suite_passes_correct_backends(tmp_path: Path, harness: str) -> None:
    """The mutants' wrappers break nothing by themselves (so each mutant's failure is its one
    change), and the loopback serving peer, which runs the N2 tests, is correct."""
    code, tests, output = run_suite(tmp_path, f"--kvwire-harness={MUTANTS_DIR.parent / harness}")
    failed = [t["nodeid"] for t in tests if t["outcome"] == "failed"]
    assert code == 0 and not failed, f"the suite failed {harness}: {failed}\n{output[-3000:]}"
    if "peer" in harness:
        assert any(t["test"].startswith("test_N2_") and t["outcome"] == "passed" for t in tests)
