"""What the ``kvwire`` command prints around its results, as a user sees it in a terminal of 80
columns or in a log file: no library's log flood, no stray progress line, no cut-off cells."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from kvwire.testing.require import backend_usable

#: A glog line (the Mooncake client's C++ logging): severity letter, date, time, thread, file.
GLOG_INFO = re.compile(r"^I\d{4} \d\d:\d\d:\d\d")


def kvwire(*args: str, columns: int = 80, drop: tuple[str, ...] = (), timeout: float = 300,
           ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "kvwire.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_the_mooncake_demo_does_not_flood_stderr_with_the_clients_info_log():
    backend_usable("mooncake")
    # MC_LOG_LEVEL unset, as in a user's shell: the plugin quiets the client library itself.
    r = kvwire("demo", "--backend", "mooncake", "--tokens", "64", "--layers", "2", drop=("MC_LOG_LEVEL",))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    info = [line for line in r.stderr.splitlines() if GLOG_INFO.match(line)]
    assert not info, f"{len(info)} INFO lines of Mooncake's log on stderr, e.g. {info[:3]}"
    # Left: glog's one-time banner and one harmless ERROR line per client (two workers).
    assert len(r.stderr.splitlines()) <= 5, r.stderr


def rule_row(out: str, rule: str) -> str:
    """The conformance table's row of ``rule``, its wrapped lines joined column by column."""
    rows: list[list[str]] = []
    for line in out.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=False)]
    return next(" │ ".join(cells) for cells in rows if cells[0] == rule)


def test_the_conformance_table_says_where_a_rule_was_checked_when_its_own_tests_skip():
    # A10 (causes): memory declares no serve-pulls, so the A10 test selected here (a pull from a
    # serving end that is gone) skips; but the A4, A8 and B3 tests check A10.6-A10.8 and pass. (A10's
    # other tests run on memory, so they are left out of the selection.)
    r = kvwire("conformance", "memory", "--", "-k",
               "A4_cancel_is_idempotent or A8_a_held_publish or A10_a_pull_from_a_serving_end or M3",
               columns=200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    a10 = rule_row(r.stdout, "A10")
    assert "passed in other rules' tests" in a10 and "skipped" not in a10.split("│")[1], a10
    assert "A10.6, A10.7 passed in 2 test(s) of A4, A8" in a10, a10
    assert "its own test(s) skipped: backend does not declare the serve-pulls protocol" in a10, a10
    m3 = rule_row(r.stdout, "M3")
    assert m3.split("│")[1].strip() == "passed" and "other rules" not in m3
    n2 = rule_row(r.stdout, "N2")                   # none of its clauses ran anywhere
    assert n2.split("│")[1].strip() == "not run", n2


def test_a_failed_test_gives_no_credit_to_the_rules_it_also_checks():
    from kvwire.testing.runner import summarize

    inside = {"test_A4_x": {"A10": ["A10.6"]}}
    ok = summarize([{"test": "test_A4_x", "backend": "b", "outcome": "passed"}], inside)["b"]
    assert ok["A10"].status == "passed elsewhere" and ok["A10"].inside == {"A10.6": ["test_A4_x"]}
    bad = summarize([{"test": "test_A4_x", "backend": "b", "outcome": "failed", "reason": "A4: no"}], inside)["b"]
    assert "A10" not in bad and bad["A4"].status == "failed"
    skipped = summarize([{"test": "test_A4_x", "backend": "b", "outcome": "skipped", "reason": "why"}], inside)["b"]
    assert "A10" not in skipped


def test_the_demo_output_opens_with_its_table_when_stdout_is_not_a_terminal():
    r = kvwire("demo", "--tokens", "64", "--layers", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert lines[0].strip() == "kvwire demo · backend memory", lines[:3]   # no bare 'done 0:00:01' first
    assert "done" not in r.stdout and "worker A: prefill" not in r.stdout


def test_backends_says_how_to_see_each_backends_options():
    r = kvwire("backends")
    assert r.returncode == 0 and "kvwire backends --options" in r.stdout, r.stdout
    assert "capacity_bytes" not in r.stdout
    r = kvwire("backends", "--options", columns=200)
    assert r.returncode == 0, r.stderr
    assert "memory options:" in r.stdout and "capacity_bytes (int >= 1, default 1073741824)" in r.stdout
    assert "--option KEY=VALUE" in r.stdout
