"""The ``kvwire`` command: ``backends`` (and, as they land, ``demo``, ``bench``,
``conformance``, ``doctor``). Exit codes: 0 ok, 1 the job failed, 2 bad usage or config."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from kvwire import __version__
from kvwire.cli.checks import MAX_LAYERS, MAX_TOKENS
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
        caps = escape(plugin.capabilities.summary()) if plugin else ""
        if row.problem:
            broken += 1
        status = "[green]ok[/]" if not row.problem else "[red]broken[/] (see below)"
        table.add_row(escape(row.entry.name), escape(row.entry.distribution), escape(row.entry.version), contract,
                      caps, status)
    if not rows:
        console.print("no kvwire backends are installed (pip install kvwire-memory)")
        return 1
    console.print(table)
    if args.verbose or args.options:
        for row in rows:
            if row.plugin is not None and row.plugin.options:
                lines = "\n".join(f"  {escape(line)}" for line in row.plugin.describe_options())
                console.print(f"[bold]{escape(row.entry.name)}[/] options:\n{lines}", highlight=False)
            if row.detail and args.verbose:
                console.print(f"[bold]{escape(row.entry.name)}[/]:\n{escape(row.detail)}", highlight=False)
        console.print("Set options in the config file's [backend.options], as KVWIRE_BACKEND_<OPTION>, or with "
                      "kvwire demo --option KEY=VALUE.", highlight=False, markup=False)
    else:
        console.print("Each backend's options: kvwire backends --options", highlight=False, markup=False)
    for row in rows:
        if row.problem:
            console.print(f"[red]✗[/] [bold]{escape(row.entry.name)}[/]: {escape(row.problem)}", highlight=False)
    if broken:
        console.print(f"{broken} backend(s) cannot be used; the lines above say why and how to fix each.")
    return 0


def _config(args: argparse.Namespace):
    from kvwire.registry import load_config

    return load_config(args.config, backend=args.backend)


def _cmd_demo(args: argparse.Namespace, console: Console) -> int:
    import json

    from kvwire.cli import checks

    checks.demo_shape(args.tokens, args.layers, args.model)
    checks.device(args.device)  # first: it says so in one line when torch is missing
    from kvwire.cli.demo import render, run_demo

    if args.json:
        checks.writable_file("--json", args.json)
    config = checks.with_options(_config(args), args.option or ())
    report = run_demo(config, tokens=args.tokens, layers=args.layers, console=console, device=args.device,
                      model_name=args.model)
    render(report, console)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report.as_dict(), fh, indent=2)
    return 0 if report.ok else 1


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from kvwire.cli import checks
    from kvwire.cli.bench import render, run_bench, write

    names = checks.bench_backends(args.backend or ())
    with checks.output_dir("--out", args.out):
        if args.quick:
            run = run_bench(names, rows=(64 << 10, 1 << 20), prompts=(1024, 4096), ttft_prompts=(512,),
                            total_bytes=16 << 20, repeat=3, console=console)
        else:
            run = run_bench(names, console=console)
        render(run, console)
        json_path, png_path = write(run, Path(args.out))
    console.print(f"wrote {json_path} and {png_path}")
    return 0


def _cmd_conformance(args: argparse.Namespace, console: Console) -> int:
    from kvwire.testing.runner import run_conformance

    extra = list(args.pytest_args or ())
    return run_conformance(list(args.names), profile=args.profile, extra_args=extra)


def _cmd_doctor(args: argparse.Namespace, console: Console) -> int:
    from kvwire.cli.doctor import diagnose, render

    return render(diagnose(), console)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", metavar="NAME", help="backend to use (default: KVWIRE_BACKEND, the config file, or 'memory')")
    p.add_argument("--config", metavar="FILE", help="TOML config file (default: KVWIRE_CONFIG)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvwire", description="Move LLM KV-cache blocks between workers and stores.")
    parser.add_argument("--version", action="version", version=f"kvwire {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="more detail (tracebacks of broken plugins)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    backends = sub.add_parser("backends", help="list installed backends, their capabilities, and broken ones with the reason")
    backends.add_argument("--options", action="store_true", help="also list each backend's options (type, default, help)")
    bench = sub.add_parser("bench", help="pull throughput by row size and prompt length, against memcpy and raw transports")
    bench.add_argument("--backend", action="append", metavar="NAME", help="backend to measure (repeatable; default: all that load)")
    bench.add_argument("--out", default="bench-out", metavar="DIR", help="where bench.json and bench.png go (default bench-out)")
    bench.add_argument("--quick", action="store_true", help="fewer, smaller points (a minute or so)")
    conf = sub.add_parser("conformance", help="run the conformance suite against installed backends and summarize by rule",
                          usage="kvwire conformance [-h] [--profile {quick,thorough}] [NAME ...] [-- PYTEST_ARG ...]",
                          epilog="Arguments after -- go to pytest, e.g. -- -k M3 -x")
    conf.add_argument("names", nargs="*", metavar="NAME", help="backends to test (default: every one with a harness)")
    conf.add_argument("--profile", choices=("quick", "thorough"), default="quick")
    sub.add_parser("doctor", help="check plugins, their libraries, loopback ports and the GPU, with fixes")
    demo = sub.add_parser("demo", help="two workers: prefill on one, move its blocks to the other, decode there")
    _add_config_args(demo)
    demo.add_argument("--option", action="append", metavar="KEY=VALUE",
                      help="a backend option (repeatable; wins over the config file and the environment; "
                           "kvwire backends --options lists them)")
    demo.add_argument("--tokens", type=int, default=2048,
                      help=f"prompt length in tokens, 1 to {MAX_TOKENS} (default 2048)")
    demo.add_argument("--layers", type=int, default=8,
                      help=f"model layers, 2 to {MAX_LAYERS} (default 8; the tiny model takes an even number, "
                           "two per layer group)")
    demo.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    demo.add_argument("--device", default="cpu", help="where the caches live: cpu (default) or cuda[:N]")
    demo.add_argument("--model", choices=("tiny", "hybrid"), default="tiny",
                      help="tiny (attention only, default) or hybrid (every other layer a gated linear "
                           "recurrence, whose STATE checkpoint moves with the blocks)")
    argv = list(sys.argv[1:] if argv is None else argv)
    passed_on: list[str] = []
    if "conformance" in argv and "--" in argv[argv.index("conformance"):]:
        cut = argv.index("--", argv.index("conformance"))  # what follows is pytest's, never ours
        argv, passed_on = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    args.pytest_args = passed_on
    # SIGTERM and SIGHUP end the command as Ctrl-C does, so every 'with' unwinds: servers stop
    # and private store roots are removed on those paths too.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    console = Console()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=Console(stderr=True), show_path=False)])
    if args.command is None:
        parser.print_help()
        return 2
    handlers = {"backends": _cmd_backends, "demo": _cmd_demo, "doctor": _cmd_doctor, "bench": _cmd_bench, "conformance": _cmd_conformance}
    try:
        return handlers[args.command](args, console)
    except KeyboardInterrupt:
        Console(stderr=True).print("kvwire: interrupted", highlight=False, markup=False)
        return 130
    except Exception as exc:
        from kvwire.cli.checks import UsageError
        from kvwire.holding import StateError
        from kvwire.registry import ConfigError, PluginError

        if isinstance(exc, (UsageError, ConfigError, PluginError, StateError)):
            Console(stderr=True).print(f"kvwire: error: {exc}", highlight=False, markup=False, soft_wrap=True)
            return 2
        raise


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
