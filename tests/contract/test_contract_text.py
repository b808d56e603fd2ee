"""The contract's text ships with the package, carries the version the code speaks, and numbers
its clauses so that every suite test can name the one it checks (docs/contract.md)."""

from __future__ import annotations

import ast
import re
from importlib import resources
from pathlib import Path

import pytest

import kvwire.contract as contract
import kvwire.testing.suite as suite
from kvwire.contract import CONTRACT_VERSION

#: Every rule of contract 1.2, in the text's order.
RULES = tuple(
    "M1 M2 M3 M4 V1 V2 V3 V4 H1 S1 S2 S3 S4 S5 A1 A2 A3 A4 A5 A6 A7 A8 A9 A10 W1 B1 B2 B3 B4 "
    "N1 N2 N3 L1 O1".split()
)
SOURCE = Path(__file__).parents[2] / "docs" / "contract.md"
TITLE = re.compile(r"^# The kvwire contract, version (\d+)\.(\d+)$")
SECTION = re.compile(r"^### ([A-Z][0-9]+) \S", re.MULTILINE)
CLAUSE = re.compile(r"^- \*\*([A-Z][0-9]+)\.([0-9]+)\*\* \S", re.MULTILINE)
SUITE_RULES = re.compile(r"^test_((?:[A-Z][0-9]+_)+)")
CLAUSE_ID = re.compile(r"\b([A-Z][0-9]+\.[0-9]+)\b")


@pytest.fixture(scope="module")
def text() -> str:
    shipped = resources.files("kvwire.contract").joinpath("contract.md")
    assert shipped.is_file(), "kvwire/contract/contract.md (the contract's text) is missing from the package"
    return shipped.read_text(encoding="utf-8")


def suite_functions() -> list[ast.FunctionDef]:
    out = []
    for path in sorted(Path(suite.__file__).parent.glob("test_*.py")):
        out += [node for node in ast.parse(path.read_text()).body
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    return out


def clauses(text: str) -> list[tuple[str, int]]:
    return [(rule, int(number)) for rule, number in CLAUSE.findall(text)]


def test_the_shipped_text_is_the_one_in_docs(text: str) -> None:
    if not SOURCE.is_file():
        pytest.skip("not a source checkout: docs/contract.md is not here")
    assert text == SOURCE.read_text(encoding="utf-8"), "the package ships another text than docs/contract.md"


def test_the_title_names_the_version_the_code_speaks(text: str) -> None:
    match = TITLE.match(text.splitlines()[0])
    assert match, f"the first line must be '# The kvwire contract, version MAJOR.MINOR', got {text.splitlines()[0]!r}"
    assert (int(match[1]), int(match[2])) == CONTRACT_VERSION
    assert f"`CONTRACT_VERSION = {CONTRACT_VERSION}`" in text


def test_every_rule_the_suite_uses_has_a_section(text: str) -> None:
    sections = set(SECTION.findall(text))
    used = {rule for node in suite_functions() if (m := SUITE_RULES.match(node.name))
            for rule in m[1].split("_") if rule}
    assert used, "no suite test is named after a rule"
    assert not used - sections, f"suite tests name rules the text has no section for: {sorted(used - sections)}"


def test_every_rule_has_one_section_with_clauses(text: str) -> None:
    sections = SECTION.findall(text)
    assert sorted(sections) == sorted(set(sections)), "a rule has two sections"
    assert tuple(sections) == RULES
    numbered = {rule for rule, _ in clauses(text)}
    assert numbered == set(RULES), f"rules without clauses: {sorted(set(RULES) - numbered)}"


def test_every_clause_number_is_unique_and_under_its_rule(text: str) -> None:
    found = clauses(text)
    seen = [f"{rule}.{n}" for rule, n in found]
    twice = sorted({c for c in seen if seen.count(c) > 1})
    assert not twice, f"clause numbers used twice: {twice}"
    for heading, body in zip(SECTION.findall(text), re.split(SECTION, text)[2::2], strict=True):
        numbers = [n for rule, n in clauses(body) if rule == heading]
        assert [rule for rule, _ in clauses(body)] == [heading] * len(numbers), (
            f"section {heading} holds clauses of another rule")
        assert numbers == list(range(1, len(numbers) + 1)), f"{heading}'s clauses are not numbered 1..n: {numbers}"


def test_every_clause_a_suite_test_names_exists(text: str) -> None:
    known = {f"{rule}.{n}" for rule, n in clauses(text)}
    for node in suite_functions():
        doc = ast.get_docstring(node) or ""
        first = doc.splitlines()[0] if doc else ""
        named = set(CLAUSE_ID.findall(first))
        assert named <= known, f"{node.name} names clauses the text lacks: {sorted(named - known)}"


def test_the_exported_names_are_the_packages(text: str) -> None:
    part = text.split("## Exported names", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", part)) - {"__all__"}
    assert listed == set(contract.__all__), (
        f"the text lists {sorted(listed - set(contract.__all__))} that kvwire.contract does not export, and "
        f"misses {sorted(set(contract.__all__) - listed)}")
