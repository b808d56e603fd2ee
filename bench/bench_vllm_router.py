"""Time to first token of requests routed by prefix (``examples/vllm_prefix_router.py`` over
``kvwire_vllm.router``, fed by each server's KV events) against round-robin, over three
``vllm serve`` processes with ``KvwireConnector`` over kvwire-ucx (issue 38).

The workload: ``--prefixes`` shared prefixes of ``--prefix-tokens`` tokens, each asked
``--per-prefix`` times with a distinct suffix of ``--suffix-tokens``, one request at a time,
interleaved (prefix 0, 1, ..., then again); ``max_tokens`` 1, so a request's latency is its time
to first token. Round-robin sends request k to server k mod 3; the router sends it to the server
holding the longest prefix. Each mode runs on fresh prompts with every server's prefix cache
reset first; ``--runs`` alternate which mode goes first. Tokens of each request are checked against
server 0's for the same prompt (after the timed requests of that mode).

``.venv/bin/python bench/bench_vllm_router.py [--out FILE]`` (starts and stops everything)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "vllm"))

from engines import VLLM_PYTHON, kvwire_transfer_config, report, write_model  # noqa: E402
from servers import Process, free_port, post  # noqa: E402

from kvwire.testing.holder import wait_for  # noqa: E402

BLOCK = 32
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "UCX_WARN_UNUSED_ENV_VARS": "n",
       "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}


def server(name: str, model: Path, top: Path, events: str) -> Process:
    port = free_port()
    kv = kvwire_transfer_config("ucx", {"timeout_s": 8.0, "grace_s": 1.0}, timeout_s=8.0)
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32",
            "--block-size", str(BLOCK), "--max-model-len", "8192", "--enforce-eager", "--seed", "0",
            "--kv-transfer-config", json.dumps(kv), "--kv-events-config",
            json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events})]
    return Process(name, argv, top, port, ENV)


def complete(url: str, model: str, prompt: list[int]) -> tuple[float, list[int], str | None]:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as reply:
        answer = json.loads(reply.read())
        route = reply.headers.get("x-kvwire-route")
    return time.perf_counter() - began, list(answer["choices"][0]["token_ids"]), route


def workload(seed: int, args: argparse.Namespace) -> list[list[int]]:
    rnd = random.Random(seed)
    prefixes = [[rnd.randrange(3, 1000) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    return [prefixes[i] + [rnd.randrange(3, 1000) for _ in range(args.suffix_tokens)]
            for _ in range(args.per_prefix) for i in range(args.prefixes)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, default=5, help="prime to 3, so round-robin rotates a prefix's "
                        "requests over the servers")
    parser.add_argument("--per-prefix", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--gap-s", type=float, default=1.5,
                        help="pause before each request: vLLM's CPU worker busy-polls ~1.2 s after its last step, and "
                             "on a 2-core host that takes a core from the next server (0: measure that too)")
    parser.add_argument("--runs", type=int, default=4, help="runs of both modes, alternating which goes first")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    top = Path(f"/tmp/kvwire-bench-router-{int(time.time())}")
    model = write_model(top / "tiny-llama")
    events = [f"ipc://{top}/events-{i}" for i in range(3)]
    servers = [server(f"s{i}", model, top, events[i]) for i in range(3)]
    procs = list(servers)
    lines: list[str] = []
    try:
        for s in servers:
            s.wait_ready()
        router_port = free_port()
        argv = [str(VLLM_PYTHON), str(REPO / "examples" / "vllm_prefix_router.py"), "--port", str(router_port),
                "--block-size", str(BLOCK), "--pull"]
        for s, e in zip(servers, events, strict=True):
            argv += ["--engine", f"{s.url}={e}"]
        router = Process("router", argv, top, router_port)
        procs.append(router)
        router.wait_ready(60)
        results: dict[str, list[float]] = {"round-robin": [], "prefix router": []}
        order = [("round-robin", "prefix router"), ("prefix router", "round-robin")]
        plan = [(run, mode, 100 * run + i) for run in range(args.runs) for i, mode in enumerate(order[run % 2])]
        run_means: dict[tuple[int, str], float] = {}
        per_request: list[str] = []
        for run, mode, seed in plan:
            for s in servers:
                wait_for(lambda s=s: bool(post(s.url + "/reset_prefix_cache", {})["success"]), 120, "reset")
            prompts = workload(seed, args)
            times, got = [], []
            for k, p in enumerate(prompts):
                url = servers[k % 3].url if mode == "round-robin" else router.url
                time.sleep(args.gap_s)  # the previous server's CPU worker stops busy-polling (see --gap-s)
                seconds, tokens, _route = complete(url, str(model), p)
                times.append(seconds)
                got.append(tokens)
            # checked after the timed requests, so the reference requests change no server's cache
            # while a mode is timed: server 0's token for each prompt
            for k, (p, tokens) in enumerate(zip(prompts, got, strict=True)):
                assert tokens == complete(servers[0].url, str(model), p)[1], f"{mode} request {k}: tokens differ"
            per_request.append(f"run {run}, {mode}, ms per request: " + " ".join(f"{t * 1e3:.0f}" for t in times))
            results[mode] += times
            run_means[(run, mode)] = statistics.mean(times)
        ratios = [run_means[(r, "round-robin")] / run_means[(r, "prefix router")] for r in range(args.runs)]
        lines.append(f"bench_vllm_router: time to first token over 3 vllm serve (kvwire-ucx), {args.prefixes} "
                     f"prefixes of {args.prefix_tokens} tokens x {args.per_prefix} requests, suffix "
                     f"{args.suffix_tokens}, one at a time ({args.gap_s:g} s apart), {args.runs} runs; {time.strftime('%Y-%m-%d')}")
        lines.append("| routing | median ms | mean ms | p90 ms | total s |")
        lines.append("|---|---|---|---|---|")
        for mode, times in results.items():
            ms = sorted(t * 1e3 for t in times)
            lines.append(f"| {mode} | {statistics.median(ms):.1f} | {statistics.mean(ms):.1f} | "
                         f"{ms[int(0.9 * (len(ms) - 1))]:.1f} | {sum(times):.2f} |")
        lines.append("mean TTFT round-robin / prefix router, per run (modes alternate which goes first): "
                     + ", ".join(f"{r:.2f}x" for r in ratios))
        lines += per_request
    finally:
        for p in procs:
            p.close()
    return report(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
