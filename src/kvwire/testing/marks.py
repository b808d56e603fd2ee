"""The clause marks of the conformance suite: each test of ``kvwire.testing.suite`` says, with
:func:`checks`, which clauses of docs/contract.md it checks.

``@checks("A8.1", "A8.2")`` names the clauses the test is about: the suite runs it only against a
backend that every one of them binds (the contract's "Versions" section), and otherwise skips it,
naming the clause. ``also=(...)`` names clauses the test checks on the way, where they bind,
without gating the test on them (a test of A4 that also checks the cause of A10.6 still runs
against a backend of contract 1.0).

Both lists feed ``docs/conformance.md`` (``scripts/conformance_map.py``) and the coverage
test per clause. A clause id the contract does not have is refused when the suite is imported."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["checks", "checked_by", "CHECKS", "ALSO"]

#: The attribute names :func:`checks` sets on a test function.
CHECKS = "kvwire_checks"
ALSO = "kvwire_also"

F = TypeVar("F", bound=Callable[..., Any])


def checks(*clauses: str, also: Sequence[str] = ()) -> Callable[[F], F]:
    """Mark a suite test with the clauses it checks (``clauses``, which gate it by version and
    protocol) and those it checks as well where they bind (``also``)."""
    from kvwire.contract.clauses import clause

    for clause_id in (*clauses, *also):
        clause(clause_id)  # KeyError naming it when docs/contract.md has no such clause

    def mark(function: F) -> F:
        setattr(function, CHECKS, tuple(clauses))
        setattr(function, ALSO, tuple(c for c in also if c not in clauses))
        return function

    return mark


def checked_by(function: Any) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The clauses ``function`` is marked with, ``(checks, also)``; ``None`` when unmarked."""
    if not hasattr(function, CHECKS):
        return None
    return getattr(function, CHECKS), getattr(function, ALSO, ())
