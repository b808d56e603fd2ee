"""Command-line values the ``kvwire`` command cannot use (issue 37): each is refused before any
work starts, with one line naming the option, the value and what is allowed, exit status 2 and
no traceback, and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvwire.cli.checks import MAX_LAYERS, MAX_TOKENS


def kvwire(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, COLUMNS="80", **(env or {}))
    return subprocess.run([sys.executable, "-m", "kvwire.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full)


def refused(r: subprocess.CompletedProcess[str], *words: str) -> str:
    """The one line of a refusal, after checking its form: status 2, one line on stderr starting
    'kvwire: error:', naming each of ``words``, nothing on stdout, no traceback."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, (r.returncode, r.stdout[-1000:], r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("kvwire: error: "), r.stderr
    assert "Traceback" not in r.stderr and not r.stdout.strip(), r.stdout + r.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.mark.parametrize(("args", "words"), [
    (("--tokens", "0"), ("--tokens 0", f"between 1 and {MAX_TOKENS}")),
    (("--tokens", "-5"), ("--tokens -5", f"between 1 and {MAX_TOKENS}")),
    (("--tokens", "100000"), ("--tokens 100000", f"between 1 and {MAX_TOKENS}")),
    (("--layers", "0"), ("--layers 0", f"from 2 to {MAX_LAYERS}", "even")),
    (("--layers", "3"), ("--layers 3", "even")),
    (("--layers", "64"), ("--layers 64", f"from 2 to {MAX_LAYERS}")),
    (("--model", "hybrid", "--layers", "1"), ("--layers 1", f"from 2 to {MAX_LAYERS}")),
    (("--device", "banana"), ("--device 'banana'", "cpu", "cuda")),
    (("--device", "meta"), ("--device 'meta'", "cpu or cuda")),
    (("--option", "capacity_bytes"), ("--option 'capacity_bytes'", "KEY=VALUE")),
    (("--option", "capacity_byte=5"), ("capacity_byte", "capacity_bytes", "memory")),
    (("--option", "capacity_bytes=many"), ("capacity_bytes=many", "int")),
    (("--option", "capacity_bytes=0"), ("capacity_bytes", ">= 1")),
])
def test_a_demo_value_out_of_range_is_refused_up_front(args, words):
    line = refused(kvwire("demo", *args), *words)
    if "--option" in args and "=" in args[-1]:
        assert "backend 'memory'" in line  # an option's error names the backend it is checked against


def test_the_layers_a_hybrid_model_takes_are_not_the_tiny_models(tmp_path):
    # Three layers are refused for the tiny model (two per group) but make a hybrid (one recurrent).
    out = tmp_path / "demo.json"
    r = kvwire("demo", "--model", "hybrid", "--layers", "3", "--tokens", "64", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]


def test_cuda_on_a_machine_without_one_is_refused():
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        refused(kvwire("demo", "--device", f"cuda:{count}"), f"cuda:{count}", f"has {count} CUDA device")
    else:
        refused(kvwire("demo", "--device", "cuda"), "--device 'cuda'", "no CUDA device", "--device cpu")


def test_an_unwritable_json_file_is_refused_before_the_demo_runs(tmp_path):
    refused(kvwire("demo", "--json", str(tmp_path / "missing" / "demo.json")), "--json", "missing", "cannot be written")
    refused(kvwire("demo", "--json", str(tmp_path)), "--json", str(tmp_path), "is a directory")
    assert list(tmp_path.iterdir()) == []


def test_a_writable_json_file_is_written_and_the_check_leaves_no_file_on_a_refusal(tmp_path):
    out = tmp_path / "demo.json"
    refused(kvwire("demo", "--tokens", "0", "--json", str(out)), "--tokens 0")
    assert not out.exists()          # the --json check tried the file and removed what it created
    r = kvwire("demo", "--tokens", "64", "--layers", "2", "--json", str(out))
    assert r.returncode == 0 and out.read_text().startswith("{"), r.stderr[-2000:]


def test_bench_refuses_an_output_directory_it_cannot_write_before_measuring(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    refused(kvwire("bench", "--quick", "--out", str(blocker)), "--out", str(blocker), "is a file")
    below = blocker / "out"
    refused(kvwire("bench", "--quick", "--out", str(below)), "--out", str(below), "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_bench_refuses_an_unknown_backend_before_measuring_any(tmp_path):
    out = tmp_path / "out"
    refused(kvwire("bench", "--backend", "memory", "--backend", "nonesuch", "--out", str(out)),
            "--backend nonesuch", "unknown backend", "memory")
    assert not out.exists()



def test_the_demo_without_torch_says_what_to_install(tmp_path):
    # torch made unimportable for this process only: a module of that name that raises, first on the path
    (tmp_path / "torch.py").write_text('raise ImportError("No module named \'torch\'")\n')
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    refused(kvwire("demo", env={"PYTHONPATH": path}), "torch", "pip install torch==2.13.0", "need no torch")
