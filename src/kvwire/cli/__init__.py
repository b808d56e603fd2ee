"""The ``kvwire`` command: ``backends`` (and, as they land, ``demo``, ``bench``,
``conformance``, ``doctor``). Exit codes: 0 ok, 1 the job failed, 2 bad usage or config."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from kvwire import __version__
from kvwire.contract import CONTRACT_VERSION

__all__ = ["main"]


def _cmd_backends(args: argparse.Namespace, console: Console) -> int:
    from kvwire.registry import survey

    rows = survey()
    table = Table(title=f"kvwire {__version__} · contract {CONTRACT_VERSION[0]}.{CONTRACT_VERSION[1]} · installed backends")
    for col in ("name", "distribution", "version", "contract", "capabilities", "status"):
        table.add_column(col, overflow="fold")
    broken = 0
    for row in rows:
        plugin = row.plugin
        contract = f"{plugin.contract_version[0]}.{plugin.contract_version[1]}" if plugin else "?"
        caps = plugin.capabilities.summary() if plugin else ""
        if row.problem:
            broken += 1
        status = "[green]ok[/]" if not row.problem else "[red]broken[/] (see below)"
        table.add_row(row.entry.name, row.entry.distribution, row.entry.version, contract, caps, status)
    if not rows:
        console.print("no kvwire backends are installed (pip install kvwire-memory)")
        return 1
    console.print(table)
    if args.verbose:
        for row in rows:
            if row.detail:
                console.print(f"[bold]{row.entry.name}[/]:\n{row.detail}")
    for row in rows:
        if row.problem:
            console.print(f"[red]✗[/] [bold]{row.entry.name}[/]: {row.problem}", highlight=False)
    if broken:
        console.print(f"{broken} backend(s) cannot be used; the lines above say why and how to fix each.")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvwire", description="Move LLM KV-cache blocks between workers and stores.")
    parser.add_argument("--version", action="version", version=f"kvwire {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="more detail (tracebacks of broken plugins)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("backends", help="list installed backends, their capabilities, and broken ones with the reason")
    args = parser.parse_args(argv)
    console = Console()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=Console(stderr=True), show_path=False)])
    if args.command is None:
        parser.print_help()
        return 2
    handlers = {"backends": _cmd_backends}
    try:
        return handlers[args.command](args, console)
    except Exception as exc:
        from kvwire.registry import ConfigError

        if isinstance(exc, ConfigError):
            Console(stderr=True).print(f"kvwire: error: {exc}", highlight=False, soft_wrap=True)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
