"""Checks of the command line's values, made before any work starts: a value the command cannot
use is a :class:`UsageError` whose one line names the option, the value and what is allowed
(the command prints it and exits with status 2)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvwire.registry import BackendConfig, ConfigError

__all__ = ["MAX_TOKENS", "MAX_LAYERS", "UsageError", "demo_shape", "device", "writable_file", "output_dir", "with_options", "bench_backends"]

#: The longest prompt ``kvwire demo`` takes. Its tiny model's prefill holds a tokens × tokens
#: attention matrix per head: 8192 tokens took 30 s and 3.5 GB here (a 2-core VM), twice as
#: many would take four times both.
MAX_TOKENS = 8192
#: The deepest model ``kvwire demo`` builds (each layer's cache is 2 KiB a token, on each worker).
MAX_LAYERS = 32


class UsageError(Exception):
    """A command-line value the command cannot use; the message names the option, the value
    and what is allowed."""


def demo_shape(tokens: int, layers: int, model: str) -> None:
    """The demo's prompt length and model depth are within what its tiny model runs on a
    laptop's memory in seconds to minutes."""
    if not 1 <= tokens <= MAX_TOKENS:
        raise UsageError(f"--tokens {tokens}: the prompt length must be between 1 and {MAX_TOKENS} tokens (the "
                         f"demo's model prefills with a tokens × tokens attention matrix: {MAX_TOKENS} tokens already "
                         f"take about 4 GB of memory)")
    if model == "tiny" and (layers % 2 or not 2 <= layers <= MAX_LAYERS):
        raise UsageError(f"--layers {layers}: the tiny model needs an even number of layers (two per layer "
                         f"group) from 2 to {MAX_LAYERS}")
    if not 2 <= layers <= MAX_LAYERS:
        raise UsageError(f"--layers {layers}: the {model} model needs from 2 to {MAX_LAYERS} layers (every "
                         f"other one recurrent)")


def device(text: str) -> None:
    """``text`` names a device the caches can live on here: ``cpu``, or a CUDA device that exists
    (and torch, which the demo's model needs, is installed)."""
    try:
        import torch
    except ImportError:
        raise UsageError("the demo runs a model with torch, which is not installed here: pip install torch==2.13.0 "
                         "(the CPU build: --index-url https://download.pytorch.org/whl/cpu); backends, doctor, "
                         "conformance and the suite need no torch") from None

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {text!r}: not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise UsageError(f"--device {text!r}: the caches live on cpu or cuda[:N], not on {dev.type}")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {text!r}: no CUDA device is available here (torch {torch.__version__} sees "
                         "none); use --device cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise UsageError(f"--device {text!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")


def writable_file(option: str, path: str) -> None:
    """A file can be written at ``path`` (tried for real, and a file created by trying removed),
    so that a long run does not end unable to save its result."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{option} {path}: is a directory; name a file to write")
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot be written: {exc.strerror or exc}") from None
    if not existed:
        with contextlib.suppress(OSError):
            target.unlink()


@contextlib.contextmanager
def output_dir(option: str, path: str) -> Iterator[Path]:
    """``path`` as a directory files can be written in, created if missing, checked before the
    block runs; a directory this created is removed again if the block fails and left it empty."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UsageError(f"{option} {path}: is a file; name a directory to write in")
    existed = target.exists()
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot write files there: {exc.strerror or exc}") from None
    try:
        yield target
    except BaseException:
        if not existed:
            with contextlib.suppress(OSError):
                target.rmdir()  # only when empty
        raise


def with_options(config: BackendConfig, pairs: Sequence[str]) -> BackendConfig:
    """``config`` with ``--option KEY=VALUE`` pairs added (they win over the file and the
    environment), each validated through the backend's declared options."""
    if not pairs:
        return config
    options = dict(config.options)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--option {pair!r}: expected KEY=VALUE, e.g. --option timeout_s=5 (kvwire backends "
                             "--options lists each backend's options)")
        key = key.strip()
        try:
            config.plugin().option(key).coerce(value, config.name)
        except ConfigError as exc:
            raise UsageError(f"--option {pair!r}: {exc}") from None
        options[key] = value
    updated = BackendConfig(config.name, options, f"{config.source}, --option", config.worker)
    try:
        updated.resolved()
    except ConfigError as exc:
        raise UsageError(f"--option: {exc}") from None
    return updated


def bench_backends(names: Sequence[str]) -> list[str]:
    """The backends ``kvwire bench`` measures: those named (each must load and work here), else
    every installed one that works here, less those whose plugin declares
    ``extra["bench"] = False`` (templates and toys)."""
    from kvwire.registry import PluginError, load, survey

    if not names:
        return [row.entry.name for row in survey() if row.plugin is not None and not row.problem
                and row.plugin.extra.get("bench", True) is not False]
    for name in names:
        try:
            plugin = load(name)
        except (ConfigError, PluginError) as exc:
            raise UsageError(f"--backend {name}: {exc}") from None
        problem = plugin.check() if plugin.check else None
        if problem:
            raise UsageError(f"--backend {name}: cannot be used here: {problem}")
    return list(dict.fromkeys(names))

