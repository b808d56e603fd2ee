"""The ``kvwire`` command end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def kvwire(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, COLUMNS="160", **(env or {}))
    return subprocess.run([sys.executable, "-m", "kvwire.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full)


def test_readme_main_job_command_runs_the_demo(tmp_path):
    out = tmp_path / "demo.json"
    r = subprocess.run([str(ROOT / "dev.sh"), "demo", "--tokens", "256", "--layers", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, COLUMNS="160"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "next-token logits equal a local prefill" in r.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["backend"] == "memory"


def test_demo_summary_numbers_agree_with_the_transfer(tmp_path):
    out = tmp_path / "demo.json"
    r = kvwire("demo", "--tokens", "300", "--layers", "4", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    blocks = 300 // 16                                         # whole blocks of the prompt
    assert rep["blocks_moved"] == blocks and rep["blocks_skipped"] == 0
    row = 2 * 2 * 16 * 4 * 64 * 4                              # layers/group · K,V · tokens · heads · dim · fp32
    assert rep["bytes_moved"] == blocks * row * 2               # two layer groups
    assert rep["cached_tokens"] == blocks * 16 and rep["second_pull_blocks"] == 0
    assert rep["pins_after"] == [0, 0] and rep["logits_equal"]
    assert f"{blocks}" in r.stdout and "GB/s" in r.stdout


@pytest.mark.parametrize("backend", ["memory", "ucx"])
def test_demo_with_the_hybrid_model_moves_the_state_checkpoint_with_the_blocks(tmp_path, backend):
    out = tmp_path / "demo.json"
    r = kvwire("demo", "--model", "hybrid", "--backend", backend, "--tokens", "300", "--layers", "4",
               "--json", str(out))
    if backend == "ucx" and "unavailable" in r.stdout + r.stderr:
        pytest.skip("the ucx backend is unavailable here")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    blocks = 300 // 16
    assert rep["ok"] is True and rep["model"] == "hybrid"
    assert rep["blocks_moved"] == blocks and rep["state_rows_moved"] == 1
    assert rep["checkpoint_tokens"] == rep["cached_tokens"] == blocks * 16   # B resumed at the pulled checkpoint
    paged = 2 * 2 * 16 * 4 * 64 * 4                            # two attention layers · K,V · tokens · heads · dim · fp32
    state = 2 * 4 * 64 * 4                                     # two recurrent layers · d_model · fp32
    assert rep["bytes_moved"] == blocks * paged + state        # the blocks and one STATE row
    assert "STATE rows moved" in r.stdout and "hybrid model" in r.stdout


def test_bad_config_exits_2_with_one_line_naming_the_key(tmp_path):
    cfg = tmp_path / "kvwire.toml"
    cfg.write_text('[backend]\nname = "memory"\n[backend.options]\ncapacity_byte = 10\n')
    r = kvwire("demo", "--config", str(cfg))
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "capacity_byte" in lines[0] and "capacity_bytes" in lines[0], r.stderr
    assert "Traceback" not in r.stderr

    r = kvwire("demo", env={"KVWIRE_BACKEND": "memory", "KVWIRE_BACKEND_QUEUE": "x"})
    assert r.returncode == 2 and "queue" in r.stderr

    r = kvwire("demo", "--backend", "nonesuch")
    assert r.returncode == 2 and "unknown backend 'nonesuch'" in r.stderr and "memory" in r.stderr

    cfg.write_text('[worker]\nnaem = "x"\n')
    r = kvwire("demo", "--config", str(cfg))
    assert r.returncode == 2 and "worker.naem" in r.stderr


def test_backends_and_doctor_report_the_installed_plugins():
    r = kvwire("backends")
    assert r.returncode == 0 and "memory" in r.stdout and "kvwire-memory" in r.stdout
    r = kvwire("doctor")
    assert "backend memory" in r.stdout and "loopback ports" in r.stdout
    assert r.returncode in (0, 1)
    assert ("nothing essential is wrong" in r.stdout) == (r.returncode == 0)


@pytest.mark.parametrize("backend", ["mooncake", "ucx"])
def test_demo_runs_on_the_other_in_repo_backends(tmp_path, backend):
    from kvwire.registry import ConfigError, PluginError, load

    try:
        plugin = load(backend)
        why = plugin.check() if plugin.check else None
    except (ConfigError, PluginError) as exc:
        why = str(exc)
    if why:
        pytest.skip(f"backend {backend} unavailable: {why}")
    out = tmp_path / "demo.json"
    r = kvwire("demo", "--backend", backend, "--tokens", "256", "--layers", "2", "--json", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["backend"] == backend and rep["blocks_moved"] == 16 and rep["pins_after"] == [0, 0]


def test_doctor_shows_a_plugins_own_checks_and_survives_a_broken_one():
    from types import SimpleNamespace

    from kvwire.cli.doctor import _plugin_checks

    good = SimpleNamespace(extra={"doctor": lambda: [("fast mode", False, "library missing", "pip install x")]})
    (finding,) = _plugin_checks("backend demo", good)
    assert finding.check == "backend demo: fast mode" and not finding.ok and not finding.essential
    assert finding.fix == "pip install x"

    def broken():
        raise RuntimeError("boom")

    (finding,) = _plugin_checks("backend demo", SimpleNamespace(extra={"doctor": broken}))
    assert not finding.ok and "RuntimeError: boom" in finding.detail and not finding.essential
    assert _plugin_checks("backend demo", SimpleNamespace(extra={})) == []
