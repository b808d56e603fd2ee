"""Run the conformance suite against installed backends and summarize it by contract rule: what
``kvwire conformance NAME`` does.

The suite runs as ``pytest --pyargs kvwire.testing.suite`` in a subprocess, from an empty
directory so no project's pytest configuration applies, with its output shown as it goes; then a
table per backend says, for each rule of docs/contract.md, how many tests passed, failed and were
skipped, and why."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["run_conformance", "summarize", "RULES", "RuleResult"]

#: The contract's rules in docs/contract.md order, and the suite's stateful model.
RULES: tuple[str, ...] = (
    "M1", "M2", "M3", "M4", "V1", "V2", "V3", "V4", "H1", "S1", "S2", "S3", "S4", "S5",
    "A1", "A2", "A3", "A4", "A5", "A6", "A7", "A8", "A9", "A10", "W1", "B1", "B2", "B3", "B4", "N1", "N2", "L1", "O1",
    "holder model",
)
_RULE = re.compile(r"^test_((?:[A-Z][0-9]{1,2}_)+)")


@dataclass
class RuleResult:
    """How the tests of one rule fared against one backend."""

    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    #: Clauses of this rule that passing tests of other rules check too (their docstrings name
    #: them): clause -> those tests
    inside: dict[str, list[str]] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.failed:
            return "failed"
        if self.passed:
            return "passed"
        if self.inside:
            return "passed elsewhere"
        return "skipped" if self.skipped else "not run"


def rules_of(test: str) -> list[str]:
    """The rules a suite test checks, from its name (``test_M3_...`` checks M3)."""
    if test.startswith("test_stateful"):
        return ["holder model"]
    match = _RULE.match(test)
    return [r for r in match.group(1).split("_") if r] if match else []


def clauses_inside() -> dict[str, dict[str, list[str]]]:
    """For each suite test, the clauses of rules other than its own that it is marked as checking
    (``@checks(...)`` with its ``also``: a ``test_A4_...`` marked with A10.6 checks that cause as
    well): test name -> rule -> clauses. Read from the suite's source, nothing imported."""
    out: dict[str, dict[str, list[str]]] = {}
    for name, marked in suite_marks().items():
        own = set(rules_of(name))
        for clause_id in marked:
            rule = clause_id.split(".")[0]
            if rule not in own:
                clauses = out.setdefault(name, {}).setdefault(rule, [])
                if clause_id not in clauses:
                    clauses.append(clause_id)
    return out


def suite_marks(where: Path | None = None) -> dict[str, list[str]]:
    """Every test of the suite (the ``test_*.py`` files of ``where``, by default the installed
    ``kvwire.testing.suite``) and the clauses its ``@checks(...)`` mark names, those that gate it
    first, then its ``also``; read from the source, nothing imported. A test without the mark
    maps to an empty list."""
    if where is None:
        spec = importlib.util.find_spec("kvwire.testing.suite")
        if spec is None or not spec.submodule_search_locations:
            return {}
        where = Path(next(iter(spec.submodule_search_locations)))
    out: dict[str, list[str]] = {}
    for path in sorted(where.glob("test_*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                out[node.name] = marks_of(node)
    return out


def marks_of(node: ast.FunctionDef) -> list[str]:
    """The clauses of a test function's ``@checks(...)`` decorator, as written."""
    for deco in node.decorator_list:
        if isinstance(deco, ast.Call) and isinstance(deco.func, ast.Name) and deco.func.id == "checks":
            found = [a.value for a in deco.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            for keyword in deco.keywords:
                if keyword.arg == "also":
                    found += [a.value for a in ast.walk(keyword.value)
                              if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            return found
    return []


def summarize(tests: Sequence[dict[str, Any]],
              inside: Mapping[str, Mapping[str, Sequence[str]]] | None = None) -> dict[str, dict[str, RuleResult]]:
    """Per backend, per rule: the results of the suite's report (``--kvwire-report``). With
    ``inside`` (:func:`clauses_inside`), a passing test also counts for the clauses of other
    rules it checks."""
    out: dict[str, dict[str, RuleResult]] = {}
    for test in tests:
        backend = test.get("backend") or "(no backend)"
        if test["outcome"] == "passed":
            for rule, clauses in (inside or {}).get(test["test"], {}).items():
                result = out.setdefault(backend, {}).setdefault(rule, RuleResult())
                for clause in clauses:
                    if test["test"] not in result.inside.setdefault(clause, []):
                        result.inside[clause].append(test["test"])
        broken = test.get("broken") or [] if test["outcome"] == "failed" else []
        if broken and broken[0].split(".")[0] not in rules_of(test["test"]):
            # A failure is reported under the rule it breaks, not the test that tripped on it.
            rule = broken[0].split(".")[0]
            result = out.setdefault(backend, {}).setdefault(rule, RuleResult())
            result.failed.append(f"{test['test']} (found there): {test.get('reason', '')}")
        for rule in rules_of(test["test"]):
            result = out.setdefault(backend, {}).setdefault(rule, RuleResult())
            if test["outcome"] == "passed":
                result.passed += 1
            elif test["outcome"] == "failed":
                broken = test.get("broken") or []
                if broken and broken[0].split(".")[0] != rule:
                    continue  # counted under the rule its message names, below
                result.failed.append(f"{test['test']}: {test.get('reason', '')}")
            else:
                reason = test.get("reason", "") or "skipped"
                if reason not in result.skipped:
                    result.skipped.append(reason)
    return out


def _table(backend: str, results: dict[str, RuleResult], profile: str) -> Table:
    table = Table(title=f"kvwire conformance · {backend} · profile {profile}", show_lines=False)
    table.add_column("rule")
    table.add_column("result")
    table.add_column("passed", justify="right")
    table.add_column("failed", justify="right")
    table.add_column("why skipped / what failed", overflow="fold")
    style = {"passed": "[green]passed[/]", "failed": "[red]failed[/]", "skipped": "[yellow]skipped[/]",
             "not run": "[dim]not run[/]", "passed elsewhere": "[green]passed[/] in other rules' tests"}
    for rule in RULES:
        result = results.get(rule, RuleResult())
        if rule == "holder model" and rule not in results:
            continue
        if result.failed:
            notes = "; ".join(result.failed)
        elif result.passed or not result.inside:
            notes = "; ".join(result.skipped)
        else:
            # Its own tests were skipped, yet some of its clauses were checked, and passed, in
            # tests named after other rules: say which, and why the rest were not.
            tests = sorted({t for names in result.inside.values() for t in names})
            rules = sorted({r for t in tests for r in rules_of(t)}, key=lambda r: (r not in RULES, RULES.index(r)
                                                                                    if r in RULES else r))
            notes = (f"{', '.join(sorted(result.inside, key=_clause_order))} passed in {len(tests)} test(s) of "
                     f"{', '.join(rules)}")
            if result.skipped:
                notes += f"; its own test(s) skipped: {'; '.join(result.skipped)}"
        table.add_row(rule, style[result.status], str(result.passed), str(len(result.failed)), escape(notes))
    return table


def _clause_order(clause: str) -> tuple[int, int]:
    number = clause.split(".")
    return int(number[0][1:]), int(number[1])


def run_conformance(names: list[str], profile: str = "quick", extra_args: Sequence[str] = ()) -> int:
    """Run the suite against the installed backends ``names`` (every installed backend with a
    harness when empty) under ``profile`` ("quick" or "thorough"), show pytest's output and a
    per-rule table per backend, and return pytest's exit status (0: every test passed or was
    skipped by capability; 1: a test failed; 2-5: pytest could not run it)."""
    console = Console()
    with tempfile.TemporaryDirectory(prefix="kvwire-conformance-") as tmp:
        where = Path(tmp)
        (where / "pytest.ini").write_text("[pytest]\n")
        report = where / "report.json"
        cmd = [sys.executable, "-m", "pytest", "--pyargs", "kvwire.testing.suite", "-p", "no:cacheprovider",
               "-q", "-rfE", f"--kvwire-profile={profile}", f"--kvwire-report={report}",
               *[f"--kvwire-backend={name}" for name in names], *extra_args]
        code = subprocess.call(cmd, cwd=where)
        if not report.exists():
            console.print(f"[red]the conformance suite did not run[/] (pytest exit status {code}); see above")
            return code if code else 4
        data = json.loads(report.read_text())
    results = summarize(data["tests"], clauses_inside())
    for backend in sorted(results):
        console.print(_table(backend, results[backend], profile))
    failed = sum(len(r.failed) for per in results.values() for r in per.values())
    if code == 0:
        console.print(f"[green]conformant[/]: every declared capability of {', '.join(sorted(results)) or 'nothing'} "
                      "passed; skips name what the backend does not declare")
    elif failed:
        console.print(f"[red]not conformant[/]: {failed} rule check(s) failed; the table and the output above say "
                      "which rule and why")
    return code
