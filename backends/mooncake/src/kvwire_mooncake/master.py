"""A private ``mooncake_master`` for tests, demos and benchmarks, on free loopback ports.

:class:`MasterProcess` starts the master from the virtual environment's ``bin``, waits until
its ``/health`` says it serves, and stops it with SIGTERM, then SIGKILL. It never leaves a
process behind: ``stop()`` runs on ``with`` exit, at interpreter exit and when the object is
collected, and a master started from the main thread also dies with this process (Linux
``PR_SET_PDEATHSIG``), even if this process is killed."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO

__all__ = ["MasterProcess", "MasterError", "find_master_binary", "free_port"]

log = logging.getLogger(__name__)

# Sets PR_SET_PDEATHSIG, then becomes the master (execv keeps the pid, so the pid we hold is the
# master's). The signal survives the exec of the console script and of the real binary.
_EXEC_WITH_PARENT_DEATH = (
    "import ctypes, os, signal, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class MasterError(RuntimeError):
    """The master could not be started; the message says why and carries its log's tail."""


class _Exited(MasterError):
    """The master process exited before it served (a port taken, most often)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def find_master_binary() -> Path:
    """``mooncake_master`` beside this interpreter (the virtual environment's ``bin``), else on
    ``PATH``. Raises :class:`MasterError` if neither has it."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.exists():
        return beside
    found = shutil.which("mooncake_master")
    if found:
        return Path(found)
    raise MasterError(
        f"mooncake_master is neither in {beside.parent} nor on PATH: install "
        "'kvwire-mooncake[cpu]' (or [cuda]) in this environment"
    )


class MasterProcess:
    """One ``mooncake_master`` on ``host`` with its RPC and metrics ports (0 picks free ones).

    ``lease_ttl_ms`` is how long a read or written object refuses removal (Mooncake's default is
    seconds; short here so tests can remove what they just wrote); ``client_ttl_s`` how fast the
    segments of a client that died are dropped. ``stop()`` is idempotent."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        rpc_port: int = 0,
        metrics_port: int = 0,
        lease_ttl_ms: int = 1000,
        client_ttl_s: int = 2,
        extra_args: Sequence[str] = (),
        binary: str | os.PathLike[str] | None = None,
        ready_timeout_s: float = 10.0,
    ) -> None:
        self.host = host
        # Ports picked here may be taken by another process between the pick and the master's
        # bind; start() picks those again when the master exits for it.
        self._picked = (not rpc_port, not metrics_port)
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self._pick_ports()
        self.lease_ttl_ms = int(lease_ttl_ms)
        self.client_ttl_s = int(client_ttl_s)
        self.extra_args = tuple(extra_args)
        self.binary = Path(binary) if binary is not None else find_master_binary()
        self.ready_timeout_s = float(ready_timeout_s)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._finalizer: weakref.finalize | None = None

    def _pick_ports(self) -> None:
        pick_rpc, pick_metrics = self._picked
        if pick_rpc:
            self.rpc_port = free_port(self.host)
        if pick_metrics:
            self.metrics_port = free_port(self.host)
            while self.metrics_port == self.rpc_port:
                self.metrics_port = free_port(self.host)

    @property
    def address(self) -> str:
        """``host:rpc_port``, what clients pass as the master address."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        return [
            str(self.binary),
            f"-rpc_address={self.host}",
            f"-rpc_port={self.rpc_port}",
            f"-metrics_host={self.host}",
            f"-metrics_port={self.metrics_port}",
            "-enable_metric_reporting=false",
            f"-default_kv_lease_ttl={self.lease_ttl_ms}",
            f"-client_ttl={self.client_ttl_s}",
            "-logtostderr",
            *self.extra_args,
        ]

    def start(self) -> MasterProcess:
        """Start the master (again, on the same ports, after ``kill()`` or ``stop()``) and
        return once ``/health`` says it serves and its RPC port takes connections. Raises
        :class:`MasterError` if it exits or is not ready within ``ready_timeout_s``; nothing is
        left running then. A master that exits on a port this object picked (taken by another
        process since) is started again on fresh ports, up to three times."""
        if self.running():
            return self
        attempts = 3 if any(self._picked) and self._proc is None else 1
        for attempt in range(attempts):
            try:
                self._start_once()
                return self
            except _Exited:
                if attempt + 1 == attempts:
                    raise
                log.info("mooncake_master exited before serving on %s; trying fresh ports", self.address)
                self._pick_ports()
        raise AssertionError("unreachable")

    def _start_once(self) -> None:
        self._close_log()
        self._log = tempfile.TemporaryFile(prefix="mooncake-master-")
        argv = self.command()
        if sys.platform == "linux" and threading.current_thread() is threading.main_thread():
            argv = [sys.executable, "-c", _EXEC_WITH_PARENT_DEATH, str(os.getpid()), *argv]
        self._proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        if self._finalizer is None or not self._finalizer.alive:
            self._finalizer = weakref.finalize(self, _terminate, self._proc)
        else:  # a restart: the finalizer must reach the new process
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _terminate, self._proc)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        log.info("mooncake_master %s ready (pid %s, metrics port %d)", self.address, self.pid, self.metrics_port)

    def _wait_ready(self) -> None:
        """``/health`` answers ready AND the master itself listens on the RPC port: it serves its
        health page before it binds the RPC port, and exits after if that port is taken (so a
        connection that succeeds may reach whoever took the port)."""
        assert self._proc is not None
        url = f"http://{self.host}:{self.metrics_port}/health"
        deadline = time.monotonic() + self.ready_timeout_s
        pause = 0.01
        healthy = False
        while True:
            code = self._proc.poll()
            if code is not None:
                raise _Exited(
                    f"mooncake_master exited with status {code} before serving on {self.address} "
                    f"(a port in use?); its log ends:\n{self.log_tail()}"
                )
            try:
                if not healthy:
                    with urllib.request.urlopen(url, timeout=1.0) as reply:
                        healthy = json.loads(reply.read() or b"{}").get("service_ready") is True
                if healthy and _listens(self._proc.pid, self.rpc_port):
                    return
            except (OSError, ValueError, urllib.error.URLError):
                pass
            if time.monotonic() >= deadline:
                raise MasterError(
                    f"mooncake_master on {self.address} was not ready within {self.ready_timeout_s:g} s; "
                    f"its log ends:\n{self.log_tail()}"
                )
            time.sleep(pause)  # polling a child's readiness: no event to wait on
            pause = min(pause * 2, 0.1)

    def log_tail(self, limit: int = 4000) -> str:
        """The last ``limit`` characters the master wrote."""
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - limit))
        return self._log.read().decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL the master, as a crash would, and reap it; ``start()`` brings it back."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def freeze(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP the master and return once every one of its threads has stopped: it keeps its
        sockets but answers nothing (a hung master). ``kill()`` or ``stop()`` ends it."""
        if not self.running():
            return
        assert self._proc is not None
        self._proc.send_signal(signal.SIGSTOP)
        # The signal is delivered asynchronously: a thread may still answer one more request.
        deadline = time.monotonic() + timeout_s
        while not _all_threads_stopped(self._proc.pid):
            if time.monotonic() >= deadline:
                raise MasterError(f"mooncake_master {self.address} did not stop within {timeout_s:g} s of SIGSTOP")
            time.sleep(0.001)

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit status. Idempotent."""
        proc = self._proc
        code = _terminate(proc, timeout_s) if proc is not None else None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        return code

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> MasterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._close_log()

    def __repr__(self) -> str:
        state = "running" if self.running() else "stopped"
        return f"MasterProcess({self.address}, {state})"


def _terminate(proc: subprocess.Popen[bytes] | None, timeout_s: float = 5.0) -> int | None:
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGCONT)  # a frozen master cannot act on SIGTERM
            proc.terminate()
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
        except ProcessLookupError:
            pass
    return proc.wait()


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (Linux ``/proc``: the
    listening sockets' inodes against the process's descriptors). Elsewhere, whether anything
    on loopback takes a connection on ``port``."""
    if not os.path.isdir("/proc/self/fd"):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return True
        except OSError:
            return False
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh, None)
                for line in fh:
                    fields = line.split()
                    # local address "HEXADDR:HEXPORT", state 0A is LISTEN, inode is field 9
                    if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except FileNotFoundError:
            continue
    if not inodes:
        return False
    wanted = {f"socket:[{inode}]" for inode in inodes}
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, PermissionError):
        return False
    for fd in descriptors:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                return True
        except OSError:
            continue
    return False


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (Linux ``/proc``)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # gone: it answers nothing either
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat", "rb") as fh:
                stat = fh.read()
        except FileNotFoundError:
            continue
        # The state follows the parenthesised command name, which may itself hold spaces.
        if stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"T", b"t"):
            return False
    return True
