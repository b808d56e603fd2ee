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
#: The BCP 14 keywords, which carry their meaning only in capitals (the text's "Conventions").
KEYWORD = re.compile(r"\b(?:MUST|SHALL|SHOULD|MAY|REQUIRED|RECOMMENDED|OPTIONAL)\b")
#: Keywords in lowercase, which the text avoids: in prose they would read as requirements that the
#: keyword check cannot see. Lowercase "may" is ordinary English in the text's prose and is refused
#: only inside clauses ("optional" is refused nowhere: "Optional protocols" is a section's name).
LOWERCASE_KEYWORD = re.compile(r"\b(?:must|shall|should|required|recommended)\b")
LOWERCASE_MAY = re.compile(r"\bmay\b")
CODE_SPAN = re.compile(r"`[^`]*`")
CLAUSE_LINE = re.compile(r"^- \*\*([A-Z][0-9]+\.[0-9]+)\*\* \[[^\]]*\] (.*)$", re.MULTILINE)
#: The parties a requirement binds; a ``types`` clause is a definition and needs no keyword.
BOUND_PARTIES = ("backend", "holder", "lender", "runtime")
OPTIONAL_PROTOCOLS = {"SERVE_PULLS": contract.SERVE_PULLS, "LOOKUP": contract.LOOKUP,
                      "OFFER_PULLS": contract.OFFER_PULLS, "BLOCK_OBJECTS": contract.BLOCK_OBJECTS}
PROTOCOL_HEADING = re.compile(
    r"^### (?P<rule>[A-Z][0-9]+) [^\n]*\(protocol `(?P<protocol>[a-z][a-z0-9-]*)`(?:, contract (?P<version>[0-9]+\.[0-9]+))?\)",
    re.MULTILINE)
HISTORY = re.compile(r"\(contract [0-9]+\.[0-9]+\)")


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


def keyword_problems(text: str) -> list[str]:
    """Conventions: what is wrong with how ``text`` states its requirements. A clause that binds
    the backend, holder, lender or runtime states a BCP 14 keyword in capitals and names its party
    before the first one (its subject); no clause uses a keyword in lowercase, and the prose
    outside the clauses uses none but "may" (code spans are not prose)."""
    problems = []
    table = clause_table.parse(text)
    for clause_id, body in CLAUSE_LINE.findall(text):
        prose = CODE_SPAN.sub("``", body)
        if m := LOWERCASE_KEYWORD.search(prose) or LOWERCASE_MAY.search(prose):
            problems.append(f"{clause_id} uses {m[0]!r} in lowercase; write the keyword in capitals or reword it")
        party = table[clause_id].binds
        if party not in BOUND_PARTIES:
            continue
        first = KEYWORD.search(prose)
        if first is None:
            problems.append(f"{clause_id} binds the {party} but states no MUST / SHOULD / MAY")
        elif not re.search(rf"\b{party}", prose[:first.start()], re.IGNORECASE):
            problems.append(f"{clause_id} binds the {party} but does not name the {party} before its first keyword")
    rest = CODE_SPAN.sub("``", CLAUSE_LINE.sub("", text))
    problems += [f"the text outside the clauses uses {m[0]!r} in lowercase: {rest[max(0, m.start() - 40):m.end()]!r}"
                 for m in LOWERCASE_KEYWORD.finditer(rest)]
    return problems


def protocol_problems(text: str, protocols: dict[str, str]) -> list[str]:
    """Optional protocols: what is wrong with where ``text`` states them. Each protocol has one
    section of its own under "## Optional protocols", whose heading names the protocol and the
    version it arrived in; a protocol whose clauses arrived in several versions has a "Versions:"
    line naming each; no section elsewhere is a protocol's, and no other heading carries history."""
    if "\n## Optional protocols\n" not in text:
        return ["the text has no '## Optional protocols' section"]
    before, part = text.split("\n## Optional protocols\n", 1)
    part, after = (part.split("\n## ", 1) + [""])[:2]
    problems = [f"section {m['rule']} of protocol {m['protocol']!r} is not under 'Optional protocols'"
                for m in PROTOCOL_HEADING.finditer(before + "\n## " + after)]
    problems += [f"a heading outside 'Optional protocols' carries history: {m[0]!r}"
                 for m in HISTORY.finditer("\n".join(line for line in (before + after).splitlines()
                                                     if line.startswith("#")))]
    table = clause_table.parse(text)
    sections = {m["protocol"]: m for m in PROTOCOL_HEADING.finditer(part)}
    bodies = dict(zip(SECTION.findall(part), re.split(SECTION, part)[2::2], strict=True))
    for name, protocol in protocols.items():
        found = [m for m in PROTOCOL_HEADING.finditer(part) if m["protocol"] == protocol]
        if len(found) != 1:
            problems.append(f"{name} ({protocol!r}) has {len(found)} sections under 'Optional protocols', not one")
            continue
        heading = sections[protocol]
        versions = sorted({c.since for c in table.values() if c.protocol == protocol})
        if not versions:
            problems.append(f"{name} ({protocol!r}) has a section but no clauses")
            continue
        arrived = "{}.{}".format(*versions[0])
        if heading["version"] != arrived:
            problems.append(f"{name}'s heading says contract {heading['version']}, its first clauses arrived in {arrived}")
        line = next((par for par in bodies.get(heading["rule"], "").split("\n\n") if par.startswith("Versions:")), "")
        if len(versions) > 1:
            missing = ["{}.{}".format(*v) for v in versions if not re.search(r"\b{}\.{}\b".format(*v), line)]
            if missing:
                problems.append(f"{name}'s clauses arrived in several versions and its 'Versions:' line misses {missing}")
    return problems


def test_every_requirement_names_its_party_with_a_keyword(text: str) -> None:
    problems = keyword_problems(text)
    assert not problems, "\n".join(problems)


def test_every_optional_protocol_has_its_own_versioned_section(text: str) -> None:
    assert set(OPTIONAL_PROTOCOLS) <= set(contract.__all__)
    problems = protocol_problems(text, OPTIONAL_PROTOCOLS)
    assert not problems, "\n".join(problems)


GOOD = """# The kvwire contract, version 1.1

## Core

### M9 Test

- **M9.1** [1.0 · types] A `Thing` is a frozen value.
- **M9.2** [1.0 · backend] A backend MUST keep `the thing` whole; it MAY copy it.
- **M9.3** [1.0 · holder] The holder MUST NOT close a thing in flight.

## Optional protocols

### P1 Pulls (protocol `p-one`, contract 1.0)

Versions: `p-one` arrived in 1.0 with P1.1; P1.2 arrived in 1.1.

- **P1.1** [1.0 · backend] A backend that names `p-one` MUST answer pulls.
- **P1.2** [1.1 · backend] A backend MUST NOT answer a pull twice.

## How the suite names clauses
"""


@pytest.mark.parametrize(("old", "new", "problem"), [
    ("A backend MUST keep", "A backend must keep", "M9.2 uses 'must' in lowercase"),
    ("A backend MUST keep `the thing` whole; it MAY copy it.", "The thing stays whole.",
     "M9.2 binds the backend but states no MUST"),
    ("The holder MUST NOT close", "A backend MUST NOT close", "M9.3 binds the holder but does not name the holder"),
    ("it MAY copy it", "it may copy it", "M9.2 uses 'may' in lowercase"),
    ("## Core\n", "## Core\n\nThe holder should wait.\n", "outside the clauses uses 'should'"),
])
def test_the_keyword_check_refuses_a_bad_text(old: str, new: str, problem: str) -> None:
    assert keyword_problems(GOOD) == []
    assert GOOD.count(old) == 1
    assert any(problem in p for p in keyword_problems(GOOD.replace(old, new))), keyword_problems(GOOD.replace(old, new))


@pytest.mark.parametrize(("edits", "problem"), [
    ((("\n## Optional protocols\n", "\n## Core again\n"),
      ("\n## How the suite", "\n## Optional protocols\n\n## How the suite")),
     "section P1 of protocol 'p-one' is not under"),
    ((("(protocol `p-one`, contract 1.0)", "(protocol `p-two`, contract 1.0)"),), "P_ONE ('p-one') has 0 sections"),
    ((("(protocol `p-one`, contract 1.0)", "(protocol `p-one`, contract 1.1)"),), "heading says contract 1.1"),
    ((("; P1.2 arrived in 1.1.", "."),), "'Versions:' line misses ['1.1']"),
    ((("### M9 Test", "### M9 Test (contract 1.0)"),), "carries history"),
])
def test_the_protocol_check_refuses_a_bad_text(edits: tuple[tuple[str, str], ...], problem: str) -> None:
    protocols = {"P_ONE": "p-one"}
    assert protocol_problems(GOOD, protocols) == []
    bad = GOOD
    for old, new in edits:
        assert bad.count(old) == 1, old
        bad = bad.replace(old, new)
    found = protocol_problems(bad, protocols)
    assert any(problem in p for p in found), found
