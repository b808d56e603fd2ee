"""``kvwire demo``: two workers, a prompt prefilled on the first, its blocks moved to the second
(pulled from a peer, or published to and fetched from a store), the next token decoded on the
second and checked against the first's local prefill. ``--model hybrid`` makes every other layer
a gated linear recurrence: its STATE checkpoint moves with the attention blocks
(``docs/hybrid.md``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvwire.contract import OtherEnd
from kvwire.registry import BackendConfig

__all__ = ["DemoReport", "run_demo", "MODELS"]

#: The demo's models: ``tiny`` (attention only) and ``hybrid`` (every other layer recurrent).
MODELS = ("tiny", "hybrid")


@dataclass(frozen=True, slots=True)
class DemoReport:
    backend: str
    prompt_tokens: int
    cached_tokens: int
    blocks_moved: int
    blocks_skipped: int
    bytes_moved: int
    transfer_seconds: float
    prefill_seconds: float
    second_pull_blocks: int
    logits_equal: bool
    next_token_equal: bool
    pins_after: tuple[int, int]
    status: str
    reason: str | None
    model: str = "tiny"
    #: STATE rows (checkpoints) the pull moved, and the token B's request resumed from
    state_rows_moved: int = 0
    checkpoint_tokens: int = 0
    #: The backend options the run used (with what its local services set, e.g. a private root)
    backend_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        state_ok = self.model != "hybrid" or (self.state_rows_moved > 0 and self.checkpoint_tokens == self.cached_tokens)
        return (self.status == "delivered" and self.logits_equal and self.next_token_equal and state_ok
                and self.cached_tokens > 0 and self.second_pull_blocks == 0 and self.pins_after == (0, 0))

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__}
        out["backend_options"] = dict(self.backend_options)
        out["ok"] = self.ok
        out["gbps"] = self.bytes_moved / self.transfer_seconds / 1e9 if self.transfer_seconds else 0.0
        return out


def run_demo(
    config: BackendConfig,
    *,
    tokens: int = 2048,
    layers: int = 8,
    seed: int = 7,
    console: Console | None = None,
    model_options: Mapping[str, Any] | None = None,
    device: str = "cpu",
    model_name: str = "tiny",
) -> DemoReport:
    """Run the demo; returns what it measured (the CLI prints it). Progress is shown while it
    runs on a terminal, and nothing of it stays on the screen or lands in a redirected output."""
    from kvwire.runtime import ModelConfig, Worker

    if model_name not in MODELS:
        raise ValueError(f"unknown demo model {model_name!r}; choose one of {', '.join(MODELS)}")
    console = console or Console()
    shape: dict[str, Any] = {"layers_per_group": 2}
    if model_name == "hybrid":
        recurrent = tuple(range(1, layers, 2))
        attention = layers - len(recurrent)
        shape = {"recurrent_layers": recurrent, "layers_per_group": 2 if attention % 2 == 0 else 1}
    model = ModelConfig(layers=layers, heads=4, head_dim=64, block_tokens=16,
                        max_tokens=max(tokens + 16, 64), seed=seed, **{**shape, **dict(model_options or {})})
    prompt = np.random.default_rng(seed).integers(0, model.vocab, tokens)
    blocks = -(-tokens // model.block_tokens) + 4
    with contextlib.ExitStack() as stack:
        progress = stack.enter_context(Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                                TimeElapsedColumn(), console=console, transient=True,
                                                disable=not console.is_terminal))
        step = progress.add_task(f"starting {config.name} backend services", total=None)
        config = stack.enter_context(config.services())
        progress.update(step, description="starting worker A and worker B")
        a = stack.enter_context(Worker(model, config=config, num_blocks=blocks, name="worker-A", device=device))
        b = stack.enter_context(Worker(model, config=config, num_blocks=blocks, name="worker-B", device=device))
        progress.update(step, description=f"worker A: prefill {tokens} tokens")
        began = time.perf_counter()
        local = a.generate(prompt, max_tokens=1)
        prefill = time.perf_counter() - began
        state = a.transceiver_state()
        if a.capabilities.other_end is OtherEnd.STORE:
            progress.update(step, description="worker A: publish the prompt's blocks to the store")
            a.publish(prompt)
        progress.update(step, description="worker B: pull the prompt's blocks from worker A's state")
        pulled = b.pull(prompt, source=state)
        progress.update(step, description="worker B: decode the next token on the pulled cache")
        remote = b.generate(prompt, max_tokens=1)
        progress.update(step, description="worker B: pull again (everything is held: nothing moves)")
        again = b.pull(prompt, source=state)
        a.settle()  # A unpins once B's acknowledgement reaches it, just after B's pull returned
        logits_equal = bool(torch.allclose(local.logits, remote.logits, rtol=1e-4, atol=1e-4 if device != "cpu" else 1e-5))
        report = DemoReport(
            backend=config.name,
            prompt_tokens=tokens,
            cached_tokens=remote.cached_tokens,
            blocks_moved=pulled.blocks_moved,
            blocks_skipped=pulled.blocks_skipped,
            bytes_moved=pulled.bytes_moved,
            transfer_seconds=pulled.seconds,
            prefill_seconds=prefill,
            second_pull_blocks=again.blocks_moved,
            logits_equal=logits_equal,
            next_token_equal=local.tokens == remote.tokens,
            pins_after=(a.pins(), b.pins()),
            status=pulled.status,
            reason=pulled.reason,
            model=model_name,
            state_rows_moved=pulled.state_rows_moved,
            checkpoint_tokens=pulled.cached_tokens if model.recurrent_layers else 0,
            backend_options=dict(config.options),
        )
    return report


def render(report: DemoReport, console: Console) -> None:
    title = f"kvwire demo · backend {report.backend}" + (" · hybrid model" if report.model == "hybrid" else "")
    table = Table(title=title, show_header=True)
    table.add_column("what")
    table.add_column("value", justify="right")
    gbps = report.bytes_moved / report.transfer_seconds / 1e9 if report.transfer_seconds else 0.0
    rows = [
        ("prompt tokens", f"{report.prompt_tokens}"),
        ("prompt tokens reused on worker B (the last block is recomputed)", f"{report.cached_tokens}"),
        ("blocks moved", f"{report.blocks_moved}"),
        ("blocks skipped (already held)", f"{report.blocks_skipped}"),
        *([("STATE rows moved (recurrent-state checkpoints)", f"{report.state_rows_moved}"),
           ("checkpoint worker B resumed from (token)", f"{report.checkpoint_tokens}")]
          if report.model == "hybrid" else []),
        ("bytes moved", f"{report.bytes_moved / 2**20:.1f} MiB"),
        ("transfer time", f"{report.transfer_seconds * 1e3:.1f} ms"),
        ("throughput", f"{gbps:.2f} GB/s"),
        ("recomputing the prefix (prefill on A)", f"{report.prefill_seconds * 1e3:.1f} ms"),
        ("pulling is faster than recomputing by", f"{report.prefill_seconds / report.transfer_seconds:.0f}×" if report.transfer_seconds else "-"),
        ("second pull moved", f"{report.second_pull_blocks} blocks"),
        ("next-token logits equal a local prefill", "yes" if report.logits_equal else "NO"),
        ("pins left (A, B)", f"{report.pins_after}"),
    ]
    for what, value in rows:
        table.add_row(what, value)
    console.print(table)
    if report.ok:
        console.print("[green]✓[/] worker B decoded from worker A's blocks exactly as a local prefill would.")
    else:
        console.print(f"[red]✗[/] the demo's checks failed (status {report.status}, reason {report.reason}).")
