"""One vLLM engine in its own process, driven over stdin/stdout with JSON lines.

Run with ``.venv-vllm/bin/python engine_driver.py SPEC_JSON``. SPEC: ``model`` (a folder with a
config.json: dummy weights), ``kv_transfer_config`` (or null for no connector), ``max_model_len``,
and optionally ``dtype`` (default float32), ``block_size`` (default 32), ``kv_cache_gib``,
``kv_events_config`` (vLLM's KV events publisher) and ``worker_process`` (default false: the
worker runs inside the engine core process, as vLLM runs a model on one GPU; true: in a process of
its own, as vLLM's CPU build runs by default).
Requests are lines ``{"op": "generate", "prompts": [[ids...]], "max_tokens": n}``,
``{"op": "reset_prefix_cache"}`` or ``{"op": "quit"}``; and, for requests the test steers one at a
time, ``{"op": "add", "id": ..., "prompt": [ids...], "max_tokens": n}`` (returns at once),
``{"op": "abort", "ids": [...]}``, ``{"op": "transceiver_state"}`` (each worker's, base64; a
``generate`` or ``add`` with ``"source": STATE`` pulls from that engine), ``{"op": "collect", "ids": [...]}`` (steps the engine until
those requests finished; their outputs) and ``{"op": "state"}`` (each worker's connector state,
:func:`kvwire_vllm.inspect.worker_state`, through ``collective_rpc`` by name: every engine runs
with kvwire's worker extension, so no function crosses vLLM's RPC); every answer is one stdout line starting
with ``@@driver `` (vLLM's own logging goes to stderr and other stdout lines). Startup ends with
``{"ready": true}``, or ``{"ready": false, "error": ...}`` and exit status 3."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

MARK = "@@driver "


def say(obj: object) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def output(o: object) -> dict:
    return {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,  # type: ignore[attr-defined]
            "finish_reason": o.outputs[0].finish_reason,  # type: ignore[attr-defined]
            "kv_transfer_params": o.kv_transfer_params}  # type: ignore[attr-defined]


def sampling(cls: type, req: dict) -> object:
    """Greedy sampling; ``params`` become the request's ``kv_transfer_params``, and ``source`` (a
    serving engine's transceiver state, base64) goes into them as ``kvwire_source``."""
    params = dict(req.get("params") or {})
    if req.get("source"):
        params["kvwire_source"] = req["source"]
    extra = {"kv_transfer_params": params} if params else None
    return cls(temperature=0, max_tokens=int(req.get("max_tokens", 1)), detokenize=False, ignore_eos=True,
               extra_args=extra)


def main() -> int:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=spec["model"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
        dtype=spec.get("dtype", "float32"), block_size=int(spec.get("block_size", 32)), gpu_memory_utilization=0.3,
        enable_prefix_caching=True, worker_extension_cls="kvwire_vllm.inspect.WorkerExtension",
        max_model_len=int(spec.get("max_model_len", 4096)), seed=0,
        max_num_batched_tokens=int(spec.get("max_num_batched_tokens", spec.get("max_model_len", 4096))),
    )
    if not spec.get("worker_process"):
        # vLLM's CPU platform turns the name "uni" into its multiprocess executor (for its OpenMP
        # thread binding); the class itself is taken as given: one process fewer to start, and the
        # connector's two halves share the engine core's process as on a GPU with one rank
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        kwargs["distributed_executor_backend"] = UniProcExecutor
    if spec.get("shutdown_timeout"):  # vLLM drains in-flight requests this long at shutdown (0: aborts them)
        kwargs["shutdown_timeout"] = int(spec["shutdown_timeout"])
    if spec.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("kv_events_config") is not None:  # vLLM's KV events, e.g. a ZMQ publisher
        kwargs["kv_events_config"] = spec["kv_events_config"]
    try:
        llm = LLM(**kwargs)
    except Exception as exc:
        say({"ready": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        return 3
    say({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "quit":
                break
            if op == "reset_prefix_cache":
                say({"ok": bool(llm.reset_prefix_cache())})
            elif op == "generate":
                params = sampling(SamplingParams, req)
                prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
                wall, began = time.time(), time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - began
                say({"seconds": seconds, "began": wall, "outputs": [output(o) for o in outs]})
            elif op == "add":
                params = sampling(SamplingParams, req)
                llm.llm_engine.add_request(str(req["id"]), TokensPrompt(prompt_token_ids=req["prompt"]), params)
                say({"ok": True})
            elif op == "abort":
                llm.llm_engine.abort_request([str(i) for i in req["ids"]])
                say({"ok": True})
            elif op == "collect":
                wanted = {str(i) for i in req["ids"]}
                done: dict[str, dict] = {}
                while wanted - set(done):
                    for o in llm.llm_engine.step():
                        # vLLM may answer with its internal id: the given one and a suffix
                        rid = o.request_id if o.request_id in wanted else o.request_id.rsplit("-", 1)[0]
                        if o.finished and rid in wanted:
                            done[rid] = output(o)
                say({"outputs": [done[str(i)] for i in req["ids"]]})
            elif op == "transceiver_state":
                import base64

                states = llm.collective_rpc("kvwire_transceiver_state")
                say({"states": [None if s is None else base64.b64encode(s).decode() for s in states]})
            elif op == "state":
                say({"workers": llm.collective_rpc("kvwire_worker_state")})
            else:
                say({"error": f"unknown op {op!r}"})
        except Exception as exc:
            say({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
