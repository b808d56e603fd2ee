"""Versions (docs/contract.md): plugins written against older contract versions, and frozen (their
files are never edited), keep passing the current suite, which checks each against the clauses of
the version it declares and never later ones. Each frozen store breaks some later clauses the way
such a plugin would; the same store claiming the next minor must fail exactly there."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "conformance"))
from test_mutants import run_suite  # noqa: E402

#: Per frozen store: the later clauses it breaks, whose tests must be skipped for it, naming the
#: clause and the versions.
FROZEN = {
    "store_1_0": ("1.0", {"H1.8", "M3.10", "M4.3", "W1.6"}),
    "store_1_1": ("1.1", {"V1.8"}),
    "store_1_2": ("1.2", set()),
}


#: The frozen files' SHA-256: they are never edited (a plugin frozen at a later version joins them
#: as a new file with its own entry).
DIGESTS = {
    "store_1_0.py": "2191d9c2dc9f53654102530758c440009a12382d27631dfa0ada2deaef6f542f",
    "store_1_1.py": "d6862b79a3b2e10a6fef2a64e5dc636f4b2d84a227cd9057e921894e3d445249",
    "store_1_2.py": "9cf3ed6df18ceeb2e92f272110ed4a606225d0d264acd044636d33bcf085227a",
}


@pytest.fixture(autouse=True)
def _frozen_on_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's subprocess imports the frozen stores as top-level modules, as their harness
    entry points would name them."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))


def suite(tmp_path: Path, harness: str, *args: str) -> tuple[int, list[dict[str, Any]], str]:
    return run_suite(tmp_path, f"--kvwire-harness={harness}", *args, fresh=True)


@pytest.mark.parametrize("module", sorted(FROZEN))
def test_a_frozen_plugin_passes_the_suite_of_its_version(tmp_path: Path, module: str) -> None:
    version, skipped_clauses = FROZEN[module]
    code, tests, output = suite(tmp_path, f"{module}:harness")
    failed = [t["test"] for t in tests if t["outcome"] == "failed"]
    assert code == 0 and not failed, f"the suite failed {module}, which keeps contract {version}: {failed}\n" \
                                     f"{output[-3000:]}"
    passed = [t for t in tests if t["outcome"] == "passed"]
    assert len(passed) >= 100, f"only {len(passed)} suite tests ran against {module}:\n{output[-2000:]}"
    reasons = [t["reason"] for t in tests if t["outcome"] == "skipped"]
    for clause in skipped_clauses:
        assert any(r.startswith(f"{clause} arrived in contract") and f"declares contract {version}" in r
                   for r in reasons), f"no test of {clause} was skipped for {module} by its version: {reasons}"


@pytest.mark.parametrize(("harness", "select", "clauses"), [
    ("overclaim:claims_1_1",
     "H1_a_namespace_of_the_wrong_form or M3_registration_after_shutdown or M4_a_group_over_two_registered "
     "or A4_cancel_is_idempotent or A8_a_held_publish_fails",
     {"H1.8", "M3.10", "M4.3", "W1.6", "A10.6", "A10.7"}),
    ("overclaim:claims_1_2", "L1_unusable_hints_and_bad_arguments", {"L1.13"}),
], ids=["1.0-claiming-1.1", "1.1-claiming-1.2"])
def test_the_same_plugin_claiming_the_next_version_fails_its_clauses(tmp_path: Path, harness: str, select: str,
                                                                     clauses: set[str]) -> None:
    code, tests, output = suite(tmp_path, harness, "-k", select, "--kvwire-patience=5", "--kvwire-no-shrink")
    failed = [t for t in tests if t["outcome"] == "failed"]
    assert code == 1 and failed, f"the suite passed {harness}, which breaks {sorted(clauses)}:\n{output[-3000:]}"
    broken = {c for c in clauses if c in output}
    assert broken == clauses, f"{harness}: the failures name {sorted(broken)} of {sorted(clauses)}:\n{output[-4000:]}"


def test_the_frozen_plugins_are_never_edited() -> None:
    """A frozen plugin stands for code its author no longer touches; an edit would hide exactly the
    breakage these tests exist to catch."""
    import hashlib

    found = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(HERE.glob("store_1_*.py"))}
    assert found == DIGESTS, "a frozen plugin changed (or one was added without its digest): leave them as they are"
