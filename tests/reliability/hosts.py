"""Simulated hosts for the reliability tests: Linux network namespaces joined by veth pairs to a
bridge, processes run inside them, and the faults a network gives (a link down, a slow link, a
host's processes killed).

Layout of one :class:`Network` (names unique per run: ``kvwr-<creator pid>-<token>-...``):

- a *switch* namespace holding the bridge ``br0`` and one port ``h<i>`` per host;
- a namespace per host with ``lo`` and ``eth0``, the other end of its port's veth pair, holding
  ``10.77.0.<i+1>/24``. These addresses exist only inside the run's namespaces: the machine's
  own network (the root namespace) gets no interface, address or route.

Taking a host's switch port down is a pulled cable: both ends lose carrier, packets go nowhere,
TCP retransmits into silence, nobody is told. :meth:`Network.shape` slows a host's link with the
kernel's token bucket filter (``tc qdisc tbf``; ``netem`` is not in this kernel), which also
drops what overflows its queue. :meth:`Network.close` kills every process left in the run's
namespaces and deletes them, also after a failure; :func:`sweep_stale` removes the namespaces of
earlier runs whose creator died without closing (a crash, SIGKILL)."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwire import waiting

__all__ = ["PREFIX", "Network", "Host", "HostProcess", "ProxyProcess", "HostGone", "RemoteError", "NetworkError",
           "namespaces_problem", "sweep_stale"]

#: Every namespace this fixture makes starts with this (the stale sweep looks only at these).
PREFIX = "kvwr-"
#: The hosts' /24, inside the namespaces only.
SUBNET = "10.77.0"
#: Host-side interface and the bridge's name (inside their namespaces, so no clash between runs).
IFACE, BRIDGE = "eth0", "br0"


class NetworkError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message carries the command and what it printed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


def _netns_names() -> list[str]:
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_pids(netns: str) -> list[int]:
    done = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def namespaces_problem() -> str | None:
    """Why simulated hosts cannot be made here (not root, no ``ip``, namespaces refused), or
    ``None``. Makes and deletes one probe namespace."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this run is not root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        _ip("netns", "add", probe)
    except (NetworkError, OSError, subprocess.TimeoutExpired) as exc:
        return f"this machine refuses network namespaces: {exc}"
    try:
        _ip("-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
    except NetworkError as exc:
        return f"this machine refuses veth pairs inside a namespace: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _creator(netns: str) -> int | None:
    """The pid encoded in a name of this fixture (``kvwr-<pid>-...``), or ``None``."""
    if not netns.startswith(PREFIX):
        return None
    head = netns[len(PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(netns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in ``netns`` (all of them were started there by this fixture) and
    wait until none is left."""
    deadline = time.monotonic() + timeout_s
    while pids := _netns_pids(netns):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise NetworkError(f"processes {pids} in namespace {netns} outlived SIGKILL for {timeout_s:g} s")
        time.sleep(0.01)  # polling /proc: a killed process in another's care has no event to wait on


def _delete(names: Sequence[str]) -> None:
    for netns in names:
        _kill_inside(netns)
    for netns in names:
        _ip("netns", "del", netns, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces (and kill their processes) of runs of this fixture whose creating
    process no longer exists; returns their names. A live run's namespaces are never touched."""
    stale = [n for n in _netns_names() if (pid := _creator(n)) is not None and not _alive(pid)]
    _delete(stale)
    return stale


@dataclass
class Host:
    """One simulated host: its namespace, its address, the switch port its link hangs on."""

    name: str
    netns: str
    address: str
    port: str
    network: Network = field(repr=False)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def spawn(self, argv: Sequence[str], **popen: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this host. It dies with the calling thread's process when that
        is the main thread (``PR_SET_PDEATHSIG``), and with :meth:`Network.close` in any case."""
        if threading.current_thread() is threading.main_thread():
            popen.setdefault("preexec_fn", _die_with_parent)
        return subprocess.Popen(self.argv(argv), **popen)  # type: ignore[call-overload, no-any-return]

    def run(self, argv: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside this host to its end; raises :class:`NetworkError` if it fails."""
        done = subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise NetworkError(f"{' '.join(argv)} on {self.name} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def pids(self) -> list[int]:
        """Every process running inside this host now."""
        return _netns_pids(self.netns)

    def kill_all(self) -> list[int]:
        """SIGKILL every process on this host, as a crash of the machine would, and wait until
        none is left; returns their pids."""
        pids = self.pids()
        _kill_inside(self.netns)
        return pids

    def add_address(self, last_octet: int) -> str:
        """A second address on this host's interface (for a proxy in front of a listener on the
        same port)."""
        address = f"{SUBNET}.{last_octet}"
        _ip("-n", self.netns, "addr", "add", f"{address}/24", "dev", IFACE)
        return address


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


_open: weakref.WeakSet[Network] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for network in list(_open):
        with contextlib.suppress(Exception):
            network.close()


class Network:
    """``hosts`` simulated hosts on one switch. Use as a context manager, or call
    :meth:`close` (idempotent); either way nothing of it is left afterwards."""

    def __init__(self, hosts: int = 3) -> None:
        if not 2 <= hosts <= 200:
            raise ValueError(f"a network has 2 to 200 hosts, got {hosts}")
        sweep_stale()
        self.run_id = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.run_id}-sw"
        self.hosts: list[Host] = []
        self._made: list[str] = []
        self._closed = False
        _open.add(self)
        try:
            self._make(hosts)
        except BaseException:
            self.close()
            raise

    def _make(self, count: int) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", self.switch, "link", "set", BRIDGE, "up")
        for i in range(count):
            netns, port = f"{self.run_id}-h{i}", f"h{i}"
            _ip("netns", "add", netns)
            self._made.append(netns)
            # Both ends are made inside the namespaces: the root namespace never sees them.
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", netns)
            _ip("-n", self.switch, "link", "set", port, "master", BRIDGE)
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            _ip("-n", netns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", IFACE)
            _ip("-n", netns, "link", "set", IFACE, "up")
            self.hosts.append(Host(f"h{i}", netns, f"{SUBNET}.{i + 1}", port, self))

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def namespaces(self) -> list[str]:
        """The namespaces this network made and has not deleted yet."""
        return list(self._made)

    # -- faults ------------------------------------------------------------------------------

    def link_down(self, host: Host) -> None:
        """Pull ``host``'s cable: its switch port goes down, and its interface loses carrier."""
        _ip("-n", self.switch, "link", "set", host.port, "down")

    def link_up(self, host: Host) -> None:
        """Plug it back in."""
        _ip("-n", self.switch, "link", "set", host.port, "up")

    @contextlib.contextmanager
    def cable_pulled(self, host: Host) -> Iterator[None]:
        """The link of ``host`` is down inside the block and back up after it, whatever happens."""
        self.link_down(host)
        try:
            yield
        finally:
            self.link_up(host)

    def shape(self, host: Host, rate_bit: int, *, latency_ms: int = 200) -> None:
        """Slow what ``host`` sends (both of its link's directions when applied to both ends:
        here its interface and its switch port) to ``rate_bit`` bits/s; what waits longer than
        ``latency_ms`` in the queue is dropped. Raises :class:`NetworkError` where ``tbf`` is
        not available."""
        burst = max(1600, rate_bit // 8 // 100)  # 10 ms worth of bytes, at least one packet
        spec = ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "latency", f"{latency_ms}ms"]
        _ip("netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", IFACE, "root", *spec)
        _ip("netns", "exec", self.switch, "tc", "qdisc", "replace", "dev", host.port, "root", *spec)

    def unshape(self, host: Host) -> None:
        """Give ``host``'s link its full speed back."""
        _ip("netns", "exec", host.netns, "tc", "qdisc", "del", "dev", IFACE, "root", check=False)
        _ip("netns", "exec", self.switch, "tc", "qdisc", "del", "dev", host.port, "root", check=False)

    def link_bytes(self, host: Host) -> tuple[int, int]:
        """Bytes ``host``'s interface has received and sent so far."""
        info = json.loads(_ip("-n", host.netns, "-s", "-j", "link", "show", IFACE).stdout)[0]["stats64"]
        return int(info["rx"]["bytes"]), int(info["tx"]["bytes"])

    # -- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in this network's namespaces, then delete them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        made, self._made = self._made, []
        _delete(list(reversed(made)))
        _open.discard(self)

    def __repr__(self) -> str:
        return f"Network({self.run_id}, {len(self.hosts)} hosts{', closed' if self._closed else ''})"


# -- a kvwire host process, driven from the test ---------------------------------------------------

HOST_PROCESS = Path(__file__).with_name("host_process.py")
FAULT_PROXY = Path(__file__).with_name("faultproxy.py")


class HostGone(RuntimeError):
    """The host process ended (killed, crashed) before it answered."""


class RemoteError(RuntimeError):
    """A command raised inside the host process; ``error`` is the exception's type name."""

    def __init__(self, op: str, answer: dict[str, Any]) -> None:
        self.error = str(answer.get("error"))
        super().__init__(f"{op} on the host raised {self.error}: {answer.get('message')}\n{answer.get('trace', '')}")


class Pending:
    """A command sent and not yet answered."""

    def __init__(self, proc: HostProcess, ident: int, op: str) -> None:
        self.proc, self.ident, self.op = proc, ident, op

    def done(self) -> bool:
        """Whether the answer came, or the process ended without it."""
        with self.proc._cond:
            return self.ident in self.proc._answers or self.proc._ended

    def answered(self) -> bool:
        """Whether the answer came (a process killed first never answers)."""
        with self.proc._cond:
            return self.ident in self.proc._answers

    def result(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """The answer; :class:`RemoteError` if the command raised, :class:`HostGone` if the
        process ended first, ``TimeoutError`` if none came within ``timeout_s``."""
        proc = self.proc
        with proc._cond:
            waiting.wait_for(proc._cond, lambda: self.ident in proc._answers or proc._ended, timeout_s)
            answer = proc._answers.pop(self.ident, None)
        if answer is None:
            if proc._ended:
                raise HostGone(f"{proc.host.name}: the host process ended before answering {self.op} "
                               f"(exit status {proc.popen.poll()}); its log ends:\n{proc.log_tail()}")
            raise TimeoutError(f"{proc.host.name}: no answer to {self.op} within {timeout_s:g} s")
        answer.pop("id", None)
        if not answer.pop("ok"):
            raise RemoteError(self.op, answer)
        return answer


class HostProcess:
    """``host_process.py`` running inside ``host``: :meth:`call` sends a command and waits for its
    answer, :meth:`begin` sends one and returns at once (a :class:`Pending`), :meth:`events`
    lists what the process announced. Its standard error goes to a log file
    (:meth:`log_tail`). ``env`` adds to the process's environment."""

    def __init__(self, host: Host, env: dict[str, str] | None = None) -> None:
        self.host = host
        self._log = tempfile.NamedTemporaryFile(prefix=f"kvwr-{host.name}-", suffix=".log", delete=False)
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", "KVWR_ADDRESS": host.address, **(env or {})}
        self.popen = host.spawn([sys.executable, str(HOST_PROCESS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=self._log, env=environ)
        self._ids = itertools.count(1)
        self._cond = threading.Condition()
        self._answers: dict[int, dict[str, Any]] = {}
        self._events: list[dict[str, Any]] = []
        self._ended = False
        self._write_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"kvwr-{host.name}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                continue  # a library that printed to stdout: not ours to read
            with self._cond:
                if "id" in message:
                    self._answers[message["id"]] = message
                else:
                    self._events.append(message)
                self._cond.notify_all()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def begin(self, op: str, **fields: Any) -> Pending:
        ident = next(self._ids)
        line = json.dumps({"id": ident, "op": op, **fields}) + "\n"
        with self._write_lock:
            try:
                assert self.popen.stdin is not None
                self.popen.stdin.write(line.encode())
                self.popen.stdin.flush()
            except (BrokenPipeError, ValueError):
                with self._cond:
                    self._ended = True
        return Pending(self, ident, op)

    def call(self, op: str, *, wait_s: float = 60.0, **fields: Any) -> dict[str, Any]:
        """Send ``op`` and wait up to ``wait_s`` for its answer (see :meth:`Pending.result`)."""
        return self.begin(op, **fields).result(wait_s)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self._cond:
            return [e for e in self._events if kind is None or e.get("event") == kind]

    def wait_event(self, kind: str, count: int = 1, timeout_s: float = 30.0) -> bool:
        """Whether ``count`` events of ``kind`` have come (in all), waiting up to ``timeout_s``."""
        def seen() -> bool:
            return sum(1 for e in self._events if e.get("event") == kind) >= count or self._ended
        with self._cond:
            waiting.wait_for(self._cond, seen, timeout_s)
            return sum(1 for e in self._events if e.get("event") == kind) >= count

    def freeze(self) -> None:
        """SIGSTOP: the process keeps its sockets and reads nothing."""
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the process (and, through its parent-death signal, a master it started)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(10)
        self._reader.join(10)

    def log_tail(self, limit: int = 3000) -> str:
        try:
            text = Path(self._log.name).read_text(errors="replace")
        except OSError:
            return ""
        return text[-limit:]

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Ask the process to close its worker and exit; SIGKILL it if it has not within
        ``timeout_s``. Returns its exit status. Idempotent."""
        if self.popen.poll() is None:
            with self._write_lock, contextlib.suppress(BrokenPipeError, ValueError, OSError):
                assert self.popen.stdin is not None
                self.popen.stdin.write(b'{"op": "exit"}\n')
                self.popen.stdin.close()
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGCONT)
                self.popen.kill()
                self.popen.wait(10)
        self._reader.join(10)
        self._log.close()
        if not os.environ.get("KVWR_KEEP_LOGS"):  # set: the logs stay in the temp dir, for a failure's post-mortem
            with contextlib.suppress(OSError):
                os.unlink(self._log.name)
        return self.popen.returncode

    def __repr__(self) -> str:
        return f"HostProcess({self.host.name}, pid {self.pid}, {'alive' if self.alive() else 'ended'})"


class ProxyProcess:
    """``faultproxy.py`` inside ``host`` (``None``: this process's own network), listening on
    ``listen`` (``host:port``; port 0 picks one) and forwarding to ``target``. :meth:`set`
    changes its faults (see the script) and returns its settings and counters."""

    def __init__(self, host: Host | None, listen: str, target: str) -> None:
        self.host = host
        self.name = host.name if host is not None else "local"
        argv = [sys.executable, str(FAULT_PROXY), listen, target]
        pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL}
        self.popen = host.spawn(argv, **pipes) if host is not None else subprocess.Popen(argv, **pipes)
        self._lines: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._ended = False
        self._reader = threading.Thread(target=self._read, name=f"kvwr-proxy-{self.name}", daemon=True)
        self._reader.start()
        first = self._next(10.0)
        self.port = int(first["listening"])
        self.address = f"{listen.rpartition(':')[0]}:{self.port}"

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            with self._cond:
                self._lines.append(json.loads(raw))
                self._cond.notify_all()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def _next(self, timeout_s: float) -> dict[str, Any]:
        with self._cond:
            waiting.wait_for(self._cond, lambda: self._lines or self._ended, timeout_s)
            if not self._lines:
                raise HostGone(f"the fault proxy on {self.name} said nothing within {timeout_s:g} s "
                               f"(exit status {self.popen.poll()})")
            return self._lines.pop(0)

    def set(self, **settings: Any) -> dict[str, Any]:
        """Apply ``settings`` (``delay_s``, ``rate_bps``, ``loss``, ``rto_s``, ``stall``,
        ``reset``, ``seed``) to every connection, open and new; its answer."""
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(settings) + "\n").encode())
        self.popen.stdin.flush()
        answer = self._next(10.0)
        if not answer.pop("ok"):
            raise ValueError(answer.get("message"))
        return answer

    def heal(self) -> dict[str, Any]:
        """No delay, no limit, no loss, no stall."""
        return self.set(delay_s=0, rate_bps=0, loss=0, stall=False)

    def stop(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.popen.stdin is not None
                self.popen.stdin.close()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._reader.join(10)
