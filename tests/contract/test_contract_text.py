"""The contract's text ships with the package, carries the version the code speaks, and numbers
its clauses so that every suite test can name the one it checks (docs/contract.md)."""

from __future__ import annotations

import ast
import re
from importlib import resources
from pathlib import Path

import pytest

import kvwire.contract as contract
import kvwire.contract.clauses as clause_table
import kvwire.testing.suite as suite
from kvwire.contract import CONTRACT_VERSION

#: Every rule of contract 1.3, in the text's order.
RULES = tuple(
    "M1 M2 M3 M4 V1 V2 V3 V4 H1 S1 S2 S3 S4 S5 A1 A2 A3 A4 A5 A6 A7 A8 A9 A10 W1 B1 B2 B3 B4 "
    "N1 N3 N2 L1 O1 K1".split()
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


def test_every_clause_says_its_version_and_party(text: str) -> None:
    """Versions: each clause carries the version it arrived in and the party it binds, no clause
    is newer than the version the code speaks, and the table the suite reads is this text's."""
    table = clause_table.parse(text)
    assert [c.id for c in table.values()] == [f"{rule}.{n}" for rule, n in clauses(text)]
    assert set(clause_table.clauses()) == set(table)
    newer = [c.id for c in table.values() if c.since > CONTRACT_VERSION]
    assert not newer, f"clauses newer than CONTRACT_VERSION {CONTRACT_VERSION}: {newer}"
    assert {c.since for c in table.values()} == {(1, minor) for minor in range(CONTRACT_VERSION[1] + 1)}, (
        "every minor version up to this one arrived with at least one clause")
    for rule in ("L1", "O1", "K1"):  # an optional protocol arrives whole in one version
        assert len({c.since for c in table.values() if c.rule == rule}) <= 2, rule


def test_a_clause_line_without_its_tag_is_refused() -> None:
    with pytest.raises(ValueError, match="M9.1"):
        clause_table.parse("### M9 Test\n\n- **M9.1** A clause without a tag.\n")
    with pytest.raises(ValueError, match="nobody"):
        clause_table.parse("### M9 Test\n\n- **M9.1** [1.0 · nobody] A clause of an unknown party.\n")


def test_a_clause_binds_by_the_declared_version_and_the_protocols_named() -> None:
    """Versions: a backend is bound by the clauses of its declared version and earlier, and by
    the clauses a protocol it names arrived with; never by a later clause."""
    from kvwire.contract import Capabilities, MemoryKind, OtherEnd

    def caps(version: tuple[int, int], *protocols: str) -> Capabilities:
        return Capabilities(version, True, True, frozenset({MemoryKind.HOST}), OtherEnd.STORE, True, 4, True,
                            frozenset(protocols))

    assert clause_table.binds(caps((1, 0)), "A8.2")
    assert not clause_table.binds(caps((1, 0)), "H1.8")
    assert clause_table.binds(caps((1, 1)), "H1.8")
    assert not clause_table.binds(caps((1, 1)), "V1.8")
    assert clause_table.binds(caps((1, 2)), "V1.8")
    assert not clause_table.binds(caps((1, 2)), "K1.5")
    assert clause_table.binds(caps((1, 3)), "K1.5")
    assert not clause_table.binds(caps((1, 0)), "L1.3")
    assert clause_table.binds(caps((1, 0), "lookup"), "L1.3"), "naming a protocol binds what it arrived with"
    assert not clause_table.binds(caps((1, 1), "lookup"), "L1.13"), "a later clause of a protocol binds by version"
    assert clause_table.binds(caps((1, 2), "lookup"), "L1.13")
    with pytest.raises(KeyError, match="Z9.9"):
        clause_table.binds(caps((1, 3)), "Z9.9")


def test_the_exported_names_are_the_packages(text: str) -> None:
    part = text.split("## Exported names", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", part)) - {"__all__"}
    assert listed == set(contract.__all__), (
        f"the text lists {sorted(listed - set(contract.__all__))} that kvwire.contract does not export, and "
        f"misses {sorted(set(contract.__all__) - listed)}")
