"""Every rule of docs/contract.md that a backend can break has a suite test named after it, and
docs/conformance.md maps exactly the suite's tests and the mutants that prove them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_mutants import MUTANTS

import kvwire.testing.suite as suite
from kvwire.contract.clauses import clauses
from kvwire.testing.runner import suite_marks

#: Every rule a backend must keep (N1 is the lender's, N3 the runtime's).
RULES = ("M1 M2 M3 M4 V1 V2 V3 V4 H1 S1 S2 S3 S4 S5 A1 A2 A3 A4 A5 A6 A7 A8 A9 W1 B1 B2 B3 B4 N2 O1 K1").split()
DOC = Path(__file__).parents[2] / "docs" / "conformance.md"


def suite_tests() -> set[str]:
    names = set()
    for path in Path(suite.__file__).parent.glob("test_*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.add(node.name)
    return names


def test_every_rule_has_a_test_named_after_it() -> None:
    tests = suite_tests()
    missing = [rule for rule in RULES if not any(t.startswith(f"test_{rule}_") for t in tests)]
    assert not missing, f"rules without a suite test: {missing}"


def test_every_rule_has_a_mutant_the_suite_catches() -> None:
    broken = {clause.split(".")[0] for _, clause, _ in MUTANTS}
    assert set(RULES) <= broken, f"rules no mutant breaks: {sorted(set(RULES) - broken)}"


def test_the_doc_maps_exactly_the_suite_tests_and_mutants() -> None:
    text = DOC.read_text()
    mentioned = set(re.findall(r"`(test_[A-Za-z0-9_]+)", text))
    tests = suite_tests()
    assert tests <= mentioned, f"suite tests missing from docs/conformance.md: {sorted(tests - mentioned)}"
    assert mentioned <= tests, f"docs/conformance.md names tests that do not exist: {sorted(mentioned - tests)}"
    for mutant, _, _ in MUTANTS:
        assert f"`{mutant}`" in text, f"mutant {mutant} missing from docs/conformance.md"


def test_every_suite_test_is_marked_with_clauses_the_contract_has() -> None:
    """Each suite test names the clauses it checks with ``@checks(...)``; the holder models,
    which check every rule at every step, are the only tests that may name none."""
    marks = suite_marks(Path(suite.__file__).parent)
    assert set(marks) == suite_tests()
    unmarked = sorted(t for t, found in marks.items() if not found and not t.startswith("test_stateful_"))
    assert not unmarked, f"suite tests without a @checks(...) clause: {unmarked}"
    unknown = sorted({c for found in marks.values() for c in found} - set(clauses()))
    assert not unknown, f"@checks(...) names clauses docs/contract.md does not have: {unknown}"


def _conformance_map():  # type: ignore[no-untyped-def]
    import importlib.util

    path = Path(__file__).parents[2] / "scripts" / "conformance_map.py"
    spec = importlib.util.spec_from_file_location("kvwire_conformance_map", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_clause_map_in_the_doc_is_what_the_script_generates() -> None:
    """docs/conformance.md's clause map is generated: run ``python scripts/conformance_map.py``
    after changing a mark, a mutant registration or the contract."""
    generated = _conformance_map()
    text = DOC.read_text()
    assert generated.rewritten(text) == text, "docs/conformance.md is stale: run python scripts/conformance_map.py"


def test_every_checkable_backend_clause_has_a_marked_test_or_is_listed_uncovered() -> None:
    """Every backend clause the suite can check has a suite test marked with it, except those of
    tests/conformance/uncovered_clauses.txt; that list may only shrink: a clause uncovered and
    not listed fails, and so does a listed clause that a test now covers (take it off)."""
    generated = _conformance_map()
    now, listed = set(generated.uncovered_now()), generated.listed_uncovered()
    assert len(listed) == len(set(listed)), "uncovered_clauses.txt names a clause twice"
    assert not now - set(listed), f"backend clauses with no marked test: {sorted(now - set(listed))}"
    assert not set(listed) - now, (f"uncovered_clauses.txt names clauses a test now covers (take them off): "
                                   f"{sorted(set(listed) - now)}")
    unknown = set(listed) - set(clauses())
    assert not unknown, f"uncovered_clauses.txt names clauses the contract does not have: {sorted(unknown)}"


def test_every_checkable_backend_clause_has_a_registered_mutant_or_is_listed_unbroken() -> None:
    """Every backend clause the suite can check has a mutant registered against it in
    tests/conformance/mutant_table.py, except those of tests/conformance/unbroken_clauses.txt; that
    list may only shrink: a clause with no mutant and not listed fails, and so does a listed clause
    that a mutant now breaks (take it off)."""
    generated = _conformance_map()
    now, listed = set(generated.unbroken_now()), generated.listed_unbroken()
    assert len(listed) == len(set(listed)), "unbroken_clauses.txt names a clause twice"
    assert not now - set(listed), f"backend clauses no registered mutant breaks: {sorted(now - set(listed))}"
    assert not set(listed) - now, (f"unbroken_clauses.txt names clauses a mutant now breaks (take them off): "
                                   f"{sorted(set(listed) - now)}")


def test_every_mutant_is_registered_against_a_clause_the_contract_has() -> None:
    unknown = sorted({clause for _, _, clause, _ in _conformance_map().registered()} - set(clauses()))
    assert not unknown, f"mutant_table.py names clauses docs/contract.md does not have: {unknown}"
