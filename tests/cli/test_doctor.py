"""``kvwire doctor`` as a user reads it: text shown as it is, the files store's root checked
against the configuration, and the block-copy implementation named."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvwire.cli.doctor import _plugin_checks
from kvwire.testing.require import backend_usable


def doctor(env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_BACKEND")}
    full.update(COLUMNS="250", **(env or {}))
    return subprocess.run([sys.executable, "-m", "kvwire.cli", "doctor"], capture_output=True, text=True,
                          timeout=120, env=full)


def row(out: str, check: str) -> str:
    """The table row whose first cell is ``check``, with the lines its cells wrapped onto, each
    column's text joined with spaces."""
    rows: list[list[str]] = []
    for line in out.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=False)]
    for cells in rows:
        if cells[0] == check:
            return " │ ".join(cells)
    raise AssertionError(f"no row {check!r} in:\n{out}")


def test_text_in_square_brackets_is_shown_not_swallowed_as_markup():
    r = doctor()
    # The memory backend's capabilities read "store fetch+publish [host] ...": rich took "[host]"
    # for a style tag and printed nothing in its place.
    assert "store fetch+publish [host]" in row(r.stdout, "backend memory"), r.stdout


def test_the_files_root_is_checked_where_the_configuration_puts_it(tmp_path):
    backend_usable("files")
    fresh = tmp_path / "not-yet" / "store"
    r = doctor({"KVWIRE_BACKEND": "files", "KVWIRE_BACKEND_ROOT": str(fresh)})
    line = row(r.stdout, "backend files: root")
    assert "ok" in line and str(fresh) in line and "does not exist yet" in line and str(tmp_path) in line
    assert "ok" in row(r.stdout, "backend files: space")
    assert not fresh.exists() and list(tmp_path.iterdir()) == []   # the check created nothing


def test_a_files_root_that_cannot_be_a_directory_is_a_warning_with_the_fix(tmp_path):
    backend_usable("files")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    r = doctor({"KVWIRE_BACKEND": "files", "KVWIRE_BACKEND_ROOT": str(blocker / "store")})
    line = row(r.stdout, "backend files: root")
    assert "warning" in line and str(blocker) in line and "not a directory" in line
    assert "set the backend option 'root'" in line


def test_a_capacity_beyond_the_free_space_is_a_warning_that_says_how_much_fits(tmp_path):
    backend_usable("files")
    huge = 1 << 60
    r = doctor({"KVWIRE_BACKEND": "files", "KVWIRE_BACKEND_ROOT": str(tmp_path),
                "KVWIRE_BACKEND_CAPACITY_BYTES": str(huge)})
    line = row(r.stdout, "backend files: space")
    assert "warning" in line and "cannot fill its capacity" in line and "set capacity_bytes to at most" in line
    # Only the configured backend gets the configuration: the defaults fit here.
    r = doctor({"KVWIRE_BACKEND": "memory", "KVWIRE_BACKEND_CAPACITY_BYTES": str(huge)})
    assert "ok" in row(r.stdout, "backend files: space")


def test_what_the_store_already_holds_counts_as_room(tmp_path):
    backend_usable("files")
    import kvwire_files

    (tmp_path / "packs").mkdir()
    (tmp_path / "packs" / "0").write_bytes(b"\0" * 4096)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    found = dict((c, (ok, d)) for c, ok, d, _ in kvwire_files.doctor(
        {"root": str(tmp_path), "capacity_bytes": free + 2048}))
    assert found["space"][0] and "the store holds 4.0 KiB" in found["space"][1]


def test_the_block_copy_implementation_is_named():
    r = doctor()
    line = row(r.stdout, "block copy")
    try:
        from kvwire.lender import blockcopy
    except ImportError:
        assert "not available" in line
        return
    assert blockcopy.implementation() in line and "ok" in line


def test_a_plugin_check_that_takes_options_gets_the_resolved_ones():
    from types import SimpleNamespace

    seen = []

    def checks(options):
        seen.append(options)
        return [("thing", True, f"size {options['size']}", "")]

    (finding,) = _plugin_checks("backend demo", SimpleNamespace(extra={"doctor": checks}), {"size": 3})
    assert seen == [{"size": 3}] and finding.detail == "size 3" and finding.ok


@pytest.mark.parametrize("text", ["[host]", "[red]x[/]", "a [b] c"])
def test_a_plugin_checks_text_is_printed_literally(text):
    from io import StringIO
    from types import SimpleNamespace

    from rich.console import Console

    from kvwire.cli.doctor import render

    findings = _plugin_checks("backend demo", SimpleNamespace(extra={"doctor": lambda: [(text, False, text, text)]}))
    buffer = StringIO()
    render(findings, Console(file=buffer, width=200))
    assert buffer.getvalue().count(text) == 3, buffer.getvalue()


def test_the_host_copy_is_named():
    """The stores' large host copies: the compiled streaming copy where it was built, else memmove
    with the way to get it; which one this kvwire uses is what the row says."""
    from kvwire import copying

    line = row(doctor().stdout, "host copy")
    assert copying.COPY_NAME.split(" (")[0] in line
    if copying.STREAMING:
        assert "non-temporal" in line and "ok" in line
    else:
        assert "memmove" in line and "C compiler" in line
