"""The contract's clause table, read from its text (``kvwire/contract/contract.md``): for every
clause, the version it arrived in, the party it binds, whether the conformance suite checks it,
and the optional protocol whose section holds it. :func:`binds` says whether a clause binds a
backend that declares given capabilities (the text's "Versions" section); the suite skips a test
of a clause that does not, and a holder may ask it what a backend promises."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources

from kvwire.contract.capabilities import Capabilities

__all__ = ["Clause", "PARTIES", "clauses", "clause", "binds", "protocol_since"]

#: Who a clause binds.
PARTIES = ("backend", "holder", "lender", "runtime", "types")

_CLAUSE = re.compile(
    r"^- \*\*(?P<id>(?P<rule>[A-Z][0-9]+)\.[0-9]+)\*\* "
    r"\[(?P<major>[0-9]+)\.(?P<minor>[0-9]+) · (?P<party>[a-z]+)(?: · (?P<protocol>(?!unchecked)[a-z][a-z0-9-]*))?"
    r"(?P<unchecked> · unchecked)?\] \S",
    re.MULTILINE)
_SECTION = re.compile(r"^### (?P<rule>[A-Z][0-9]+) (?P<title>.*)$", re.MULTILINE)
_PROTOCOL = re.compile(r"\(protocol `(?P<protocol>[a-z][a-z0-9-]*)`")


@dataclass(frozen=True, slots=True)
class Clause:
    """One numbered clause of the contract's text."""

    id: str
    rule: str
    since: tuple[int, int]
    binds: str
    checked: bool
    #: The optional protocol the clause belongs to (its section's, or the one its tag names), or
    #: ``None`` for the core.
    protocol: str | None


def _text() -> str:
    return resources.files("kvwire.contract").joinpath("contract.md").read_text(encoding="utf-8")


def parse(text: str) -> dict[str, Clause]:
    """Every clause of ``text``, by id, in the text's order. Raises ``ValueError`` for a clause
    line without its ``[VERSION · PARTY]`` tag or with an unknown party."""
    protocol_of = {m["rule"]: (p["protocol"] if (p := _PROTOCOL.search(m["title"])) else None)
                   for m in _SECTION.finditer(text)}
    table: dict[str, Clause] = {}
    for line in re.findall(r"^- \*\*[A-Z][0-9]+\.[0-9]+\*\* .*$", text, re.MULTILINE):
        m = _CLAUSE.match(line)
        if m is None:
            raise ValueError(f"contract clause without a '[MAJOR.MINOR · PARTY]' tag: {line[:80]!r}")
        if m["party"] not in PARTIES:
            raise ValueError(f"clause {m['id']} binds {m['party']!r}, not one of {PARTIES}")
        table[m["id"]] = Clause(m["id"], m["rule"], (int(m["major"]), int(m["minor"])), m["party"],
                                m["unchecked"] is None, m["protocol"] or protocol_of.get(m["rule"]))
    return table


@functools.cache
def clauses() -> dict[str, Clause]:
    """The clause table of the text this kvwire ships."""
    return parse(_text())


def clause(clause_id: str) -> Clause:
    """The clause ``clause_id`` (``"A8.2"``); ``KeyError`` naming it when the text has none."""
    try:
        return clauses()[clause_id]
    except KeyError:
        raise KeyError(f"the contract has no clause {clause_id!r}") from None


@functools.cache
def protocol_since(protocol: str) -> tuple[int, int] | None:
    """The version an optional protocol arrived in (its earliest clause), or ``None`` for a
    protocol the text does not define."""
    versions = [c.since for c in clauses().values() if c.protocol == protocol]
    return min(versions) if versions else None


def binds(capabilities: Capabilities, clause_id: str) -> bool:
    """Whether clause ``clause_id`` binds a backend that declares ``capabilities``: it arrived
    in the declared version or earlier; or it belongs to an optional protocol the backend names
    and arrived with that protocol. A clause of a protocol the backend does not name binds it
    only as far as its version goes (the suite skips such tests by capability anyway)."""
    found = clause(clause_id)
    declared = tuple(capabilities.contract_version)
    if found.since <= declared:
        return True
    if found.protocol is not None and found.protocol in capabilities.protocols:
        return found.since == protocol_since(found.protocol)
    return False
