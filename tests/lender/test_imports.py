"""The lender's and the runtime's modules import each other in one direction only: no cycle,
so each reads on its own (lease.py talks to its lender through ``LeaseOwner``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvwire

ROOT = Path(kvwire.__file__).parent


def module_imports(package: str) -> dict[str, set[str]]:
    """``module -> modules of the same package it imports`` (TYPE_CHECKING imports included)."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / package).glob("*.py"):
        if path.name == "__init__.py":
            continue
        name = f"kvwire.{package}.{path.stem}"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(f"kvwire.{package}."):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith(f"kvwire.{package}."))
        graph[name] = found
    return graph


@pytest.mark.parametrize("package", ["lender", "runtime", "observe"])
def test_no_import_cycle(package: str):
    graph = module_imports(package)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 2:
            return
        assert state.get(node) != 1, f"import cycle: {' -> '.join([*path, node])}"
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        state[node] = 2

    for module in sorted(graph):
        visit(module, [])
