"""Test-side helpers: a tiny model folder, and vLLM engines in their own processes (run with
``.venv-vllm/bin/python``), driven over a pipe with JSON lines. Imports nothing of vLLM."""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).with_name("engine_driver.py")
MARK = "@@driver "
#: Engine start measured ~23 s here; a loaded 2-core machine may take several times that.
START_TIMEOUT_S = 240.0
CALL_TIMEOUT_S = 240.0

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 1024, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}


#: Dummy-weight models with the KV geometry of real ones (hidden size and weights stay small: what
#: a connector moves is the KV cache): an 8B-class model (Llama-3-8B: 32 layers, 8 KV heads x 128)
#: and a 0.5B-class one (Qwen2.5-0.5B: 24 layers, 2 KV heads x 64), in bf16 as served.
REAL_SHAPES: dict[str, dict[str, Any]] = {
    "32L-8x128": {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 32,
                  "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128, "torch_dtype": "bfloat16"},
    "24L-2x64": {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 24,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "bfloat16"},
}
#: The block size of the real-shape engines. Real deployments on GPUs run 16; vLLM's CPU build
#: refuses it ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"), so 32, its smallest.
REAL_BLOCK = 32


def kv_bytes_per_block(config: dict[str, Any], block: int) -> int:
    """One block of every layer: K and V of each KV head, in the model's dtype."""
    size = 2 if config["torch_dtype"] in ("bfloat16", "float16") else 4
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return config["num_hidden_layers"] * 2 * block * config["num_key_value_heads"] * head_dim * size


def write_model(folder: Path, config: dict[str, Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or TINY_LLAMA))
    return folder


def kvwire_transfer_config(backend: str, options: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire_vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"backend": backend, "options": options, **extra}}


def rpc_dir(environ: dict[str, str]) -> str:
    """A directory of its own for one vLLM process tree's ZMQ sockets (``VLLM_RPC_BASE_PATH``, set
    in ``environ``), removed by whoever stops it: vLLM names them ``<temp dir>/<uuid>`` and leaves
    some behind on every exit (~240 a test run here)."""
    environ["VLLM_RPC_BASE_PATH"] = path = tempfile.mkdtemp(prefix="kvwire-vllm-rpc-")
    return path


class EngineError(RuntimeError):
    """The engine did not start or did not answer; the message carries its log's tail."""


class Engine:
    """One vLLM engine process. ``start()`` returns once it is ready (or raises
    :class:`EngineError`); ``call()`` sends one request and waits for its answer.

    ``processes`` says how vLLM's parts are laid out: 2 (default) the engine core in a process of
    its own and the worker inside it, as vLLM runs a model on one GPU; 3 the worker in a process of
    its own too, as vLLM's CPU build does by default; 1 the engine core inside the driver's process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): nothing steps it between the driver's calls, so it cannot
    serve pulls while idle. Each process imports vLLM: here an engine without connector was ready in
    29.7 s with 3, 10.0 s with 1."""

    def __init__(self, name: str, model: Path, kv_transfer_config: dict[str, Any] | None,
                 env: dict[str, str] | None = None, max_model_len: int = 4096, log_dir: Path | None = None,
                 shutdown_timeout: int = 0, new_session: bool = False, dtype: str = "float32", block_size: int = 32,
                 kv_cache_gib: int = 1, kv_events_config: dict[str, Any] | None = None,
                 processes: int = 2) -> None:
        if processes not in (1, 2, 3):
            raise ValueError(f"processes must be 1, 2 or 3, got {processes!r}")
        self.name = name
        spec = {"model": str(model), "kv_transfer_config": kv_transfer_config, "max_model_len": max_model_len,
                "shutdown_timeout": shutdown_timeout, "dtype": dtype, "block_size": block_size,
                "kv_events_config": kv_events_config, "worker_process": processes == 3}
        if processes == 1:
            env = {**(env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        self.log_path = (log_dir or model.parent) / f"engine-{name}.log"
        self._log = self.log_path.open("w")
        environ = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "PYTHONUNBUFFERED": "1",
                   "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO"), **(env or {})}
        environ.pop("VIRTUAL_ENV", None)
        self._rpc_dir = rpc_dir(environ)
        self.proc = subprocess.Popen([str(VLLM_PYTHON), str(DRIVER), json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=environ,
                                     cwd=str(model.parent), start_new_session=new_session)
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"engine-{name}-stdout", daemon=True)
        self._reader.start()
        self.ready: dict[str, Any] | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._answers.put(json.loads(line[len(MARK):]))
            else:
                self._log.write(line)
        self._answers.put(None)  # the process closed its stdout: it exited

    def _answer(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise EngineError(f"engine {self.name}: no answer to {what} within {timeout_s:g} s; log tail:\n"
                              f"{self.log_tail()}") from None
        if answer is None:
            code = self.proc.wait(timeout=30)
            raise EngineError(f"engine {self.name} exited (status {code}) before answering {what}; log tail:\n"
                              f"{self.log_tail()}")
        return answer

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Engine:
        self.ready = self._answer(timeout_s, "start")
        if not self.ready.get("ready"):
            raise EngineError(f"engine {self.name} failed to start: {self.ready.get('error')}")
        return self

    def call(self, request: dict[str, Any], timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self._answer(timeout_s, request.get("op", "?"))
        if "error" in answer:
            raise EngineError(f"engine {self.name}: {answer['error']}\n{answer.get('trace', '')}")
        return answer

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 4, source: str | None = None,
                 params: dict[str, Any] | None = None) -> dict[str, Any]:
        """``source``: a serving engine's transceiver state (base64, :meth:`transceiver_state`)
        that every prompt's request carries, to pull from it; ``params``: every request's
        ``kv_transfer_params``."""
        return self.call({"op": "generate", "prompts": [list(p) for p in prompts], "max_tokens": max_tokens,
                          "source": source, "params": params})

    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int = 4, source: str | None = None,
            params: dict[str, Any] | None = None) -> None:
        """Add one request and return at once (``collect`` steps the engine until it finishes)."""
        self.call({"op": "add", "id": req_id, "prompt": list(prompt), "max_tokens": max_tokens, "source": source,
                   "params": params})

    def transceiver_state(self) -> str | None:
        """The engine's one worker's transceiver state, base64 (None: its backend serves no pulls)."""
        (state,) = self.call({"op": "transceiver_state"})["states"]
        return state

    def abort(self, *req_ids: str) -> None:
        self.call({"op": "abort", "ids": list(req_ids)})

    def collect(self, *req_ids: str) -> list[dict[str, Any]]:
        return self.call({"op": "collect", "ids": list(req_ids)})["outputs"]

    def state(self) -> dict[str, Any]:
        """The connector state of the engine's one worker (kvwire's worker extension, by name)."""
        (worker,) = self.call({"op": "state"})["workers"]
        for key in ("loads", "saves", "holding_blocks_of"):  # vLLM's internal ids: ours plus a suffix
            worker[key] = sorted(r.rsplit("-", 1)[0] for r in worker[key])
        return worker

    def reset_prefix_cache(self) -> bool:
        """True once vLLM reset its prefix cache: only possible when no block is in use."""
        return bool(self.call({"op": "reset_prefix_cache"})["ok"])

    def log_tail(self, limit: int = 6000) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text[-limit:]

    def quit(self) -> None:
        """Ask the engine to quit (it shuts its connector down) and return at once; once asked,
        later calls do nothing."""
        stdin = self.proc.stdin
        if self.proc.poll() is not None or stdin is None or stdin.closed:
            return
        try:
            stdin.write(json.dumps({"op": "quit"}) + "\n")
            stdin.close()
        except (BrokenPipeError, OSError):
            pass

    def close(self, timeout_s: float = 60.0) -> int | None:
        """Ask the engine to quit (:meth:`quit`), then wait; kill after ``timeout_s``."""
        if self.proc.poll() is None:
            self.quit()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=10)
        self._log.close()
        shutil.rmtree(self._rpc_dir, ignore_errors=True)
        return self.proc.returncode


def close_all(engines: Iterable[Engine], timeout_s: float = 60.0) -> None:
    """Close engines that run together: every one is asked to quit first, so their shutdowns
    overlap (four engines one after another took 47-53 s of a module's teardown)."""
    engines = list(engines)
    for engine in engines:
        engine.quit()
    for engine in engines:
        engine.close(timeout_s)


def start_all(engines: Sequence[Engine], timeout_s: float = START_TIMEOUT_S) -> None:
    """Wait for engines started together (their processes already run in parallel)."""
    deadline = time.monotonic() + timeout_s
    for engine in engines:
        engine.start(max(1.0, deadline - time.monotonic()))


def store_key_count(metrics_port: int) -> int:
    """How many objects the Mooncake master knows (its ``master_key_count`` metric)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("master_key_count "):
                return int(float(line.split()[1]))
    raise RuntimeError("the Mooncake master reports no master_key_count metric")


def wait_for_keys(metrics_port: int, count: int, timeout_s: float = 60.0) -> None:
    """Wait until the store holds ``count`` objects: a save is asynchronous, so a request's
    output can come back before its blocks are stored."""
    from kvwire.testing.holder import wait_for

    wait_for(lambda: store_key_count(metrics_port) == count, timeout_s,
             f"the Mooncake store holding {count} objects (it holds {store_key_count(metrics_port)})")


def files_object_count(root: Path) -> int:
    """How many objects a ``files`` store directory holds (the keys its index holds)."""
    if not (root / "FORMAT").exists():
        return 0
    from kvwire_files import FileStore

    store = FileStore(str(root), capacity_bytes=1)
    try:
        return len(store.keys())
    finally:
        store.close()


def wait_for_objects(root: Path, count: int, timeout_s: float = 60.0) -> None:
    """Wait until the ``files`` store at ``root`` holds ``count`` objects (saves are asynchronous)."""
    from kvwire.testing.holder import wait_for

    wait_for(lambda: files_object_count(root) == count, timeout_s,
             f"the files store {root} holding {count} objects (it holds {files_object_count(root)})")


def report(lines: list[str], out: Path | None) -> int:
    """A bench's table: printed, and written to ``out`` when given; the bench's exit status."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        out.write_text(text)
    return 0
