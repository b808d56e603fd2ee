"""``kvwire doctor``: what a user checks when something is wrong, each problem with its fix."""

from __future__ import annotations

import ctypes.util
import inspect
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["Finding", "diagnose", "render"]


@dataclass(frozen=True, slots=True)
class Finding:
    check: str
    ok: bool
    detail: str
    fix: str = ""
    essential: bool = True


def _torch() -> list[Finding]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - report whatever broke the import
        return [Finding("torch", False, f"cannot import: {exc}", "pip install torch==2.13.0")]
    found = [Finding("torch", True, f"{torch.__version__}")]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        found.append(Finding("GPU", True, f"{torch.cuda.device_count()} CUDA device(s): {names}", essential=False))
    else:
        found.append(Finding("GPU", True, "none: DEVICE pools and GPU tests are unavailable (host memory only)", essential=False))
    return found


def _libraries() -> list[Finding]:
    found = []
    for lib, pkg in (("ibverbs", "libibverbs1"), ("rdmacm", "librdmacm1"), ("numa", "libnuma1")):
        path = ctypes.util.find_library(lib)
        found.append(Finding(f"lib{lib}", path is not None, path or "not found",
                             f"apt-get install -y {pkg} (Mooncake's shared objects link against it)", essential=False))
    return found


def _ports() -> list[Finding]:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return [Finding("loopback ports", True, f"can bind 127.0.0.1 (got port {port})")]
    except OSError as exc:
        return [Finding("loopback ports", False, f"cannot bind 127.0.0.1: {exc}",
                        "free a port or check the network namespace; servers and peers listen on loopback")]


def _block_copy() -> list[Finding]:
    try:
        from kvwire.lender import blockcopy
    except ImportError:
        return [Finding("block copy", True, "not available in this kvwire", essential=False)]
    try:
        detail = str(blockcopy.implementation())
    except Exception as exc:  # noqa: BLE001 - report whatever broke, never fail the doctor
        return [Finding("block copy", False, f"cannot tell: {type(exc).__name__}: {exc}",
                        "report it to kvwire's authors", essential=False)]
    return [Finding("block copy", True, detail, essential=False)]


def _host_copy() -> list[Finding]:
    """Which copy the stores' large host copies use (kvwire.copying): the compiled streaming copy,
    or memmove where it was not built; not essential (memmove is correct, only slower)."""
    from kvwire import copying

    if copying.STREAMING:
        return [Finding("host copy", True, copying.COPY_NAME, essential=False)]
    return [Finding("host copy", False, copying.COPY_NAME,
                    "install a C compiler (apt-get install -y gcc) and reinstall kvwire, so large store copies "
                    "bypass the cache (up to 1.5x faster on the hosts measured)", essential=False)]


def _configured() -> tuple[Any, list[Finding]]:
    """The user's backend configuration (file and environment), unvalidated, or a finding
    saying why it cannot be read."""
    from kvwire.registry import ConfigError, load_config

    try:
        return load_config(validate=False), []
    except ConfigError as exc:
        return None, [Finding("configuration", False, str(exc), "fix the key the message names")]


def _plugins() -> list[Finding]:
    from kvwire.registry import ConfigError, survey

    rows = survey()
    if not rows:
        return [Finding("backends", False, "no backend is installed", "pip install -e backends/memory")]
    config, found = _configured()
    for row in rows:
        label = f"backend {row.entry.name}"
        if row.problem:
            fix = row.plugin.install_hint if row.plugin and row.plugin.install_hint else f"pip install --force-reinstall {row.entry.distribution}"
            found.append(Finding(label, False, row.problem, fix, essential=row.entry.name == "memory"))
        else:
            found.append(Finding(label, True, f"{row.entry.distribution} {row.entry.version}: "
                                 f"{row.plugin.capabilities.summary() if row.plugin else ''}"))
            chosen = config is not None and config.name == row.entry.name
            try:
                options = row.plugin.resolve(config.options if chosen else {}) if row.plugin else {}
            except ConfigError as exc:
                found.append(Finding(f"{label}: configuration", False, str(exc), "fix the option the message names"))
                continue
            found.extend(_plugin_checks(label, row.plugin, options))
    return found


def _plugin_checks(label: str, plugin: object, options: Mapping[str, Any] | None = None) -> list[Finding]:
    """A plugin's own optional checks: ``Plugin.extra["doctor"]``, a callable returning
    ``(check, ok, detail, fix)`` tuples (optional features; never essential). A callable that
    takes an argument is given the backend's resolved options: the user's configuration when it
    selects this backend, else the defaults."""
    checks = getattr(plugin, "extra", {}).get("doctor")
    if not callable(checks):
        return []
    try:
        takes_options = bool(inspect.signature(checks).parameters)
        results = checks(dict(options or {})) if takes_options else checks()
        return [Finding(f"{label}: {check}", bool(ok), str(detail), str(fix), essential=False)
                for check, ok, detail, fix in results]
    except Exception as exc:  # noqa: BLE001 - a broken check is reported, never fatal
        return [Finding(f"{label}: checks", False, f"its doctor checks raised {type(exc).__name__}: {exc}",
                        "report it to the plugin's authors", essential=False)]


def diagnose() -> list[Finding]:
    found = [Finding("python", sys.version_info >= (3, 11), sys.version.split()[0], "use Python 3.11 or newer")]
    for part in (_torch, _libraries, _ports, _block_copy, _host_copy, _plugins):
        found.extend(part())
    return found


def render(findings: list[Finding], console: Console) -> int:
    table = Table(title="kvwire doctor")
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col, overflow="fold")
    for f in findings:
        status = "[green]ok[/]" if f.ok else ("[red]problem[/]" if f.essential else "[yellow]warning[/]")
        # Every text is the system's or a plugin's, never markup: "[host]" stays "[host]".
        table.add_row(escape(f.check), status, escape(f.detail), "" if f.ok else escape(f.fix))
    console.print(table)
    bad = [f for f in findings if not f.ok and f.essential]
    if bad:
        console.print(f"[red]{len(bad)} problem(s)[/]: fix them in the order listed.")
        return 1
    console.print("[green]nothing essential is wrong.[/]")
    return 0
