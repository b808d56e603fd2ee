"""Nothing kvwire ships decodes with pickle, marshal or eval: a syntax-level check over every
module of the core, every in-repo plugin and the example plugin."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "src", *sorted((ROOT / "backends").glob("*/src")), *sorted((ROOT / "examples").glob("*/"))]
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "cloudpickle", "dill", "shelve"}
BANNED_CALLS = {"eval", "exec"}


def python_files():
    for base in SOURCES:
        yield from (p for p in base.rglob("*.py") if "tests" not in p.parts)


def test_there_is_code_to_check():
    assert sum(1 for _ in python_files()) > 20


def offences_in(paths):
    offences = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                offences += [f"{path}:{node.lineno} import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
                offences.append(f"{path}:{node.lineno} from {node.module} import ...")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BANNED_CALLS:
                offences.append(f"{path}:{node.lineno} {node.func.id}(...)")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("loads", "load") \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in BANNED_MODULES:
                offences.append(f"{path}:{node.lineno} {node.func.value.id}.{node.func.attr}(...)")
    return offences


def test_no_module_imports_pickle_or_marshal_or_calls_eval():
    offences = offences_in(python_files())
    assert not offences, "unsafe decoding:\n" + "\n".join(offences)


def test_the_check_catches_each_kind_of_offence(tmp_path):
    planted = {
        "a.py": "import pickle\n",
        "b.py": "from marshal import loads\n",
        "c.py": "x = eval('1')\n",
        "d.py": "import cloudpickle as cp\n",
        "e.py": "import json\njson.loads('1')\n",
    }
    for name, text in planted.items():
        (tmp_path / name).write_text(text)
    found = offences_in(sorted(tmp_path.glob("*.py")))
    assert [f.split("/")[-1].split(":")[0] for f in found] == ["a.py", "b.py", "c.py", "d.py"]


