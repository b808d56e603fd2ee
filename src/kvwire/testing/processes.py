"""A backend in another process on the same store, for the suite's cross-process cases.

A store that several processes share (the files store: one directory) must keep its promises
while another process publishes, reads, removes objects and dies beside this one. A
:class:`~kvwire.testing.stores.StoreHarness` whose :attr:`~kvwire.testing.stores.StoreHarness.process_harness`
names it (``module:object``, importable in a fresh interpreter) gives :attr:`Ends.other_process
<kvwire.testing.harness.Ends.other_process>`: a :class:`StoreProcess`, a child interpreter that
builds ``BlobBackend(harness.driver(store))`` with the ends' namespace and does what the suite asks,
one command at a time, over its stdin and stdout (one JSON object a line; no pickle).

Both processes derive a row's bytes from its name alone (:func:`row_bytes`), so neither sends
rows: a fetch answers its mask and a digest of each row it marked true."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["StoreProcess", "row_bytes", "digest"]

#: How long the child may take to answer one command before the suite gives up on it.
ANSWER_S = 60.0


def row_bytes(name: bytes, size: int) -> np.ndarray:
    """The bytes of the row named ``name``, ``size`` long: the same in every process, and
    different for every name (a row's name commits to its bytes, N1.1)."""
    seed = int.from_bytes(hashlib.blake2b(bytes(name), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def digest(data: np.ndarray) -> str:
    """A short digest of a row's bytes, to compare rows across processes."""
    return hashlib.blake2b(np.ascontiguousarray(data).tobytes(), digest_size=16).hexdigest()


class StoreProcess:
    """The parent's handle of one child process. Each call sends one command and waits for its
    answer; :meth:`start_publishing` lets the child publish on its own until :meth:`kill`."""

    def __init__(self, harness: str, store: str, namespace: str, timeout_s: float) -> None:
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvwire.testing.processes", harness, json.dumps(store), namespace, str(timeout_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="kvwire-suite-store-process", daemon=True)
        self._reader.start()
        self._expect("ready")

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._lines.append("")  # end of output
            self._cond.notify_all()

    def _next(self, timeout_s: float) -> dict[str, Any]:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._lines), timeout=timeout_s):
                raise AssertionError(f"the store's other process (pid {self.pid}) answered nothing within "
                                     f"{timeout_s:g} s")
            line = self._lines.pop(0)
        if not line:
            err = self._proc.stderr.read() if self._proc.stderr is not None and self._proc.poll() is not None else ""
            raise AssertionError(f"the store's other process (pid {self.pid}) ended: {err[-2000:]}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise AssertionError(f"the store's other process failed: {answer['error']}")
        return answer

    def _expect(self, what: str) -> dict[str, Any]:
        answer = self._next(ANSWER_S)
        assert answer.get("done") == what, f"the store's other process answered {answer!r}, expected {what!r}"
        return answer

    def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        return self._expect(command["op"])

    def publish(self, group: int, names: Sequence[bytes], size: int) -> np.ndarray:
        """Publish rows ``names`` (their :func:`row_bytes`) of ``group`` and wait: the mask."""
        answer = self._ask({"op": "publish", "group": group, "names": [n.hex() for n in names], "size": size})
        return np.array(answer["mask"], dtype=bool)

    def fetch(self, group: int, names: Sequence[bytes], size: int) -> tuple[str, np.ndarray, list[str | None]]:
        """Fetch rows ``names`` of ``group`` and wait: the status, the mask, and the digest of each
        row marked true (``None`` for the others)."""
        answer = self._ask({"op": "fetch", "group": group, "names": [n.hex() for n in names], "size": size})
        return answer["status"], np.array(answer["mask"], dtype=bool), answer["digests"]

    def remove(self, group: int, names: Sequence[bytes]) -> None:
        """Remove the objects of ``names`` of ``group`` from the store, as its eviction does."""
        self._ask({"op": "remove", "group": group, "names": [n.hex() for n in names]})

    def start_publishing(self, group: int, names: Sequence[bytes], size: int, rounds: int) -> None:
        """Let the child publish ``names`` in ``rounds`` rounds on its own (round ``r`` publishes
        every ``rounds``-th name from ``r``); returns at once. :meth:`wait_round` follows it."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"op": "publish_rounds", "group": group, "names": [n.hex() for n in names],
                                           "size": size, "rounds": rounds}) + "\n")
        self._proc.stdin.flush()

    def wait_round(self, number: int) -> None:
        """Wait until the child says it is submitting round ``number`` (from 0)."""
        while True:
            answer = self._next(ANSWER_S)
            if answer.get("round") == number:
                return

    def publishing_done(self) -> bool:
        """Without waiting: whether the rounds :meth:`start_publishing` began have all been
        published (what the child said meanwhile is read and dropped)."""
        while True:
            with self._cond:
                if not self._lines:
                    return False
            answer = self._next(0.0)
            if answer.get("done") == "publish_rounds":
                return True

    def kill(self) -> None:
        """SIGKILL the child: it dies wherever it is, a write or a lock of the store included."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
        self._proc.wait(ANSWER_S)

    def stop(self) -> None:
        """End the child (its backend shut down and closed), or kill it if it does not end."""
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self._proc.stdin.flush()
                self._proc.wait(ANSWER_S)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            if stream is not None:
                stream.close()
        self._reader.join(ANSWER_S)


# -- the child ----------------------------------------------------------------------------------

def _child(spec: str, store: str, namespace: str, timeout_s: float) -> None:
    import importlib

    from kvwire import holding
    from kvwire.blob import BlobBackend, store_keys
    from kvwire.contract import CacheKind, Hint, LayerGroupRows, TokenRange, View
    from kvwire.testing.regions import HostMemory

    module, _, name = spec.partition(":")
    harness = getattr(importlib.import_module(module), name)
    driver = harness.driver(store)
    backend = BlobBackend(driver, namespace=namespace, timeout_s=timeout_s, owns_driver=True,
                          **dict(harness.blob_options))
    hint = Hint.of("store", namespace=namespace)
    out = sys.stdout

    def say(answer: dict[str, Any]) -> None:
        out.write(json.dumps(answer) + "\n")
        out.flush()

    def move(op: str, group: int, names: list[bytes], size: int) -> tuple[Any, HostMemory]:
        memory = HostMemory(size, max(1, len(names)))
        if op == "publish":
            for i, n in enumerate(names):
                memory.write([i], row_bytes(n, size)[None, :])
        width = len(names[0]) if names else 1
        packed = np.frombuffer(b"".join(names), dtype=np.uint8).reshape(len(names), width)
        view = View((LayerGroupRows(group, CacheKind.PAGED, memory.region, np.arange(len(names)),
                                    TokenRange(0, 16 * len(names)), packed),))
        with backend.register_regions([memory.region]):
            sub: holding.Submission = holding.submit(backend, holding.Direction(op), view, hint)
            waited = holding.wait(sub, timeout_s + 60.0)
        return waited.outcome, memory

    say({"done": "ready"})
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "quit":
                break
            names = [bytes.fromhex(n) for n in command.get("names", ())]
            group = int(command.get("group", 0))
            if op in ("publish", "fetch"):
                size = int(command["size"])
                outcome, memory = move(op, group, names, size)
                mask = np.asarray(outcome.masks[0], dtype=bool) if outcome is not None else np.zeros(len(names), bool)
                answer: dict[str, Any] = {"done": op, "status": outcome.status.value if outcome else "none",
                                          "mask": mask.tolist()}
                if op == "fetch":
                    answer["digests"] = [digest(memory.read([i])[0]) if mask[i] else None for i in range(len(names))]
                say(answer)
            elif op == "remove":
                packed = np.frombuffer(b"".join(names), dtype=np.uint8).reshape(len(names), -1)
                driver.remove(store_keys(namespace, group, packed))
                say({"done": "remove"})
            elif op == "publish_rounds":
                rounds, size = int(command["rounds"]), int(command["size"])
                for r in range(rounds):
                    say({"round": r})
                    move("publish", group, names[r::rounds], size)
                say({"done": "publish_rounds"})
            else:
                say({"error": f"unknown command {op!r}"})
        except Exception as exc:  # reported to the parent, which fails the test saying so
            say({"error": f"{type(exc).__name__}: {exc}"})
    from kvwire.testing.harness import shut_down

    shut_down(backend, timeout_s=timeout_s + 60.0)
    backend.close()


if __name__ == "__main__":
    _child(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
