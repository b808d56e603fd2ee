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
    broken = {rule for _, rule, _ in MUTANTS}
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
