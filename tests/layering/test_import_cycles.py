"""No import cycle among kvwire's modules, nor among its packages (``kvwire.observe`` and
``kvwire.runtime`` once imported each other), in ``src/kvwire`` and in kvwire-ucx. Every import
counts: at the top, inside a function, and under ``TYPE_CHECKING`` (a cycle hidden from the
interpreter is still one a reader must untangle). Read with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = {"kvwire": ROOT / "src" / "kvwire", "kvwire_ucx": ROOT / "backends" / "ucx" / "src" / "kvwire_ucx"}


def modules(trees: Mapping[str, Path]) -> dict[str, tuple[Path, str]]:
    """Dotted module name -> (file, source) for every ``.py`` file of the trees."""
    found = {}
    for top, root in trees.items():
        for path in sorted(root.rglob("*.py")):
            parts = [top, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = (path, path.read_text())
    return found


def _known(name: str, known: Iterable[str]) -> str | None:
    """``name``, or the nearest enclosing module that is one of ``known``."""
    known = set(known)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(sources: Mapping[str, tuple[Path | None, str]]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports (not itself, not its parent packages,
    which Python imports first in any case: that is not a use)."""
    graph: dict[str, set[str]] = {}
    for name, (path, text) in sources.items():
        package = name if path is None or path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join([*parts, base] if base else parts)
                wanted = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in sources else base
                          for alias in node.names]
            else:
                continue
            for target in wanted:
                hit = _known(target, sources)
                if hit is not None and hit != name and not name.startswith(hit + "."):
                    targets.add(hit)
        graph[name] = targets
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def packages(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """The graph between the top level's parts (``kvwire.observe``, ``kvwire.runtime``, ...)."""
    def part(name: str) -> str:
        return ".".join(name.split(".")[:2])

    out: dict[str, set[str]] = {}
    for source, targets in graph.items():
        out.setdefault(part(source), set()).update(part(t) for t in targets if part(t) != part(source))
    return out


def test_no_module_imports_itself_back():
    found = cycles(imports(modules(TREES)))
    assert not found, f"import cycles among modules (TYPE_CHECKING imports count): {found}"


def test_no_package_imports_itself_back():
    found = cycles(packages(imports(modules(TREES))))
    assert not found, f"import cycles among kvwire's packages (TYPE_CHECKING imports count): {found}"


@pytest.mark.parametrize("planted", ["top", "type-checking", "function", "relative"])
def test_a_planted_cycle_is_found(planted: str):
    back = {
        "top": "from pkg.a import x\n",
        "type-checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n",
        "function": "def f():\n    import pkg.a\n",
        "relative": "from .a import x\n",
    }[planted]
    sources: dict[str, tuple[Path | None, str]] = {
        "pkg": (Path("pkg/__init__.py"), "from pkg.a import x\n"),  # a parent importing its child: no cycle
        "pkg.a": (Path("pkg/a.py"), "from pkg.b import y\nx = 1\n"),
        "pkg.b": (Path("pkg/b.py"), back + "y = 2\n"),
    }
    assert cycles(imports(sources)) == [["pkg.a", "pkg.b"]]
    sources["pkg.b"] = (Path("pkg/b.py"), "y = 2\n")
    assert cycles(imports(sources)) == []


def test_a_planted_cycle_between_packages_is_found():
    """Modules that form no cycle, in packages that do: the package graph finds it."""
    graph = {"k.a.x": {"k.b.y"}, "k.b.y": {"k.a.z"}, "k.a.z": set()}
    assert cycles(graph) == []
    assert cycles(packages(graph)) == [["k.a", "k.b"]]


def test_the_trees_are_read():
    graph = imports(modules(TREES))
    assert "kvwire.holding.loop" in graph["kvwire.runtime.worker"] | graph["kvwire.holding"]
    assert "kvwire_ucx.offers" in graph["kvwire_ucx.jobs"]
