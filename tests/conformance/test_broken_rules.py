"""A conformance failure's report names the clause it broke, for every clause family of the
contract, including the optional protocols' (L1 lookup, O1 offers, K1 block objects)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvwire.testing.plugin import broken_rules

CONTRACT = Path(__file__).parents[2] / "docs" / "contract.md"
FAMILIES = sorted(set(re.findall(r"^### ([A-Z][0-9]+) ", CONTRACT.read_text(), flags=re.M)))


def test_the_contract_has_the_families_this_test_expects() -> None:
    assert {"A1", "K1", "L1", "O1", "N2", "W1"} <= set(FAMILIES), FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_a_failure_naming_a_clause_reports_that_clause(family: str) -> None:
    rules, first = broken_rules(AssertionError(f"{family}.3: what the backend did wrong"))
    assert rules == [f"{family}.3"]
    assert first == f"{family}.3: what the backend did wrong"


def test_every_distinct_example_of_a_hypothesis_group_is_reported_once() -> None:
    group = ExceptionGroup("examples", [AssertionError("K1.5: a part of a block was read"),
                                        AssertionError("O1.4/L1: held too long"),
                                        AssertionError("K1.5: again")])
    assert broken_rules(group)[0] == ["K1.5", "O1.4"]


def test_a_message_that_names_no_clause_reports_none() -> None:
    assert broken_rules(ValueError("Kx: not a clause"))[0] == []
