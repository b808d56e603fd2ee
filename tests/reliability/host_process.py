"""The process a simulated host runs (``tests/reliability/hosts.py``): one kvwire ``Worker`` (and,
on the host that is asked to, a ``mooncake_master``), driven by JSON lines.

Each line on standard input is a command ``{"id": N, "op": NAME, ...}``; each command runs on its
own thread (a ``Worker`` takes calls from several threads), and its answer is one line on standard
output, ``{"id": N, "ok": true, ...}`` or ``{"id": N, "ok": false, "error": TYPE, "message":
TEXT}``. Lines without an ``id`` are events (``{"event": "pull_served", ...}``). Nothing here
decodes anything but JSON. The process ends on ``exit`` or when its input closes.

Pages are not computed by the model: :func:`page_values` fills a prompt's blocks with values
drawn from the prompt's seed, so any process (the test's included) knows the bytes every block
of every prompt must hold, without asking the hosts under test."""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

#: The model every host of a network runs: rows of 32 KiB (one layer, K and V, 16 tokens of 4
#: heads of 64 float32) in each of two groups, 64 KiB per block.
MODEL = {"layers": 2, "layers_per_group": 1, "heads": 4, "head_dim": 64, "block_tokens": 16,
         "max_tokens": 1 << 16, "seed": 5}
BLOCK_TOKENS = MODEL["block_tokens"]


def prompt(seed: int, tokens: int, vocab: int = 512) -> np.ndarray:
    """The token ids of prompt ``seed``."""
    return np.random.default_rng([seed, 0x70]).integers(0, vocab, tokens)


def page_values(seed: int, group: int, blocks: int, slot_shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values of the first ``blocks`` blocks of prompt ``seed`` in ``group``."""
    return np.random.default_rng([seed, group, 0x9A]).standard_normal((blocks, *slot_shape), dtype=np.float32)


def block_digests(rows_by_group: list[np.ndarray]) -> list[str]:
    """One digest per block over its rows in every group, in group order."""
    blocks = rows_by_group[0].shape[0] if rows_by_group else 0
    out = []
    for k in range(blocks):
        h = hashlib.blake2b(digest_size=16)
        for rows in rows_by_group:
            h.update(np.ascontiguousarray(rows[k]).tobytes())
        out.append(h.hexdigest())
    return out


def expected_digests(seed: int, tokens: int, slot_shapes: list[tuple[int, ...]]) -> list[str]:
    """The digests every whole block of prompt ``seed`` must have wherever it is held."""
    blocks = tokens // BLOCK_TOKENS
    return block_digests([page_values(seed, g, blocks, shape) for g, shape in enumerate(slot_shapes)])


class Host:
    def __init__(self) -> None:
        self.out_lock = threading.Lock()
        self.worker: Any = None
        self.master: Any = None
        self.local = threading.local()

    # -- output ------------------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message)
        with self.out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    # -- observer hooks (pluggy calls these by name) ------------------------------------------

    def make_observer(self) -> Any:
        from kvwire.observe import hookimpl

        host = self

        class Observer:
            @hookimpl
            def kvwire_transfer(self, direction: Any, rows: int, delivered: int, status: Any, cause: Any,
                                reason: str | None, seconds: float) -> None:
                seen = getattr(host.local, "attempts", None)
                if seen is not None:
                    seen.append({"direction": str(direction), "rows": rows, "delivered": delivered,
                                 "status": status.value, "cause": None if cause is None else cause.value,
                                 "reason": reason, "seconds": seconds})

            @hookimpl
            def kvwire_pull_served(self, peer: str, requested: int, served: int) -> None:
                host.send({"event": "pull_served", "peer": peer, "requested": requested, "served": served})

        return Observer()

    # -- commands ----------------------------------------------------------------------------

    def op_worker(self, backend: str, options: dict[str, Any], blocks: int, name: str, timeout_s: float) -> dict:
        from kvwire.runtime import ModelConfig, Worker

        self.worker = Worker(ModelConfig(**MODEL), backend=backend, options=options, num_blocks=blocks, name=name,
                             timeout_s=timeout_s, observers=[self.make_observer()])
        shapes = [list(self.worker.lender.pool(g.group_id).shape[1:]) for g in self.worker.lender.layout.groups]
        return {"state": self.worker.transceiver_state().hex(), "slot_shapes": shapes}

    def op_fill(self, seed: int, tokens: int) -> dict:
        """Commit prompt ``seed``'s whole blocks with :func:`page_values`, as a prefill would."""
        import torch

        lender = self.worker.lender
        tokens_ids = prompt(seed, tokens)
        request = lender.open_request(tokens_ids)
        try:
            table = torch.tensor(np.asarray(request.block_table, dtype=np.int64))
            for g in lender.layout.groups:
                pool = lender.pool(g.group_id)
                pool[table] = torch.from_numpy(page_values(seed, g.group_id, len(table), tuple(pool.shape[1:])))
            lender.commit(request, len(tokens_ids))
        finally:
            lender.close_request(request)
        return {"blocks": len(tokens_ids) // BLOCK_TOKENS}

    def _transfer(self, call: Any) -> dict:
        self.local.attempts = []
        began = time.monotonic()
        try:
            result = call()
        finally:
            wall = time.monotonic() - began
            attempts, self.local.attempts = self.local.attempts, None
        return {"status": str(result.status), "reason": result.reason, "cached_tokens": result.cached_tokens,
                "blocks_wanted": result.blocks_wanted, "blocks_moved": result.blocks_moved,
                "blocks_skipped": result.blocks_skipped, "bytes_moved": result.bytes_moved,
                "wall_s": wall, "attempts": attempts}

    def op_publish(self, seed: int, tokens: int, timeout_s: float | None = None) -> dict:
        return self._transfer(lambda: self.worker.publish(prompt(seed, tokens), timeout_s=timeout_s))

    def op_pull(self, seed: int, tokens: int, source: str, timeout_s: float | None = None) -> dict:
        return self._transfer(lambda: self.worker.pull(prompt(seed, tokens), bytes.fromhex(source),
                                                       timeout_s=timeout_s))

    def op_held(self, seed: int, tokens: int) -> dict:
        """The digests of the leading blocks of prompt ``seed`` this cache holds."""
        import torch

        lender = self.worker.lender
        names = lender.names(prompt(seed, tokens))
        held = lender.probe_names(names)
        if not held:
            return {"digests": []}
        with lender.lend_names(names[:held]) as lease:
            rows = [lender.pool(g.group_id)[torch.from_numpy(g.slots.copy())].numpy() for g in lease.view.groups]
        return {"digests": block_digests(rows)}

    def op_accounting(self, settle_s: float = 5.0) -> dict:
        """What this host holds now, once the pulls it answered have ended (within ``settle_s``)."""
        worker = self.worker
        settled = worker.wait_served(settle_s)
        stats = worker.lender.stats()
        staging = worker.lender.staging(worker.lender.layout.groups[0].group_id).shape[0] if worker.staged else 0
        return {
            "settled": settled,
            "pins": stats["pins"],
            "leases_open": stats["leases_open"],
            "requests_open": stats["requests_open"],
            "staging_in_use": staging - stats["staging_slots_free"] if staging else 0,
            "kept_leases": len(worker._kept),
            "replies_open": len(worker._loop.in_flight) if worker._loop is not None else 0,
            "attempts_open": _attempts_open(worker.backend),
            "registered_regions": _registered_regions(worker.backend),
            "store_registrations": _store_registrations(worker.backend),
            "own_regions": len(worker._registration.regions),
            "counters": {k: dict(v) if isinstance(v, dict) else v for k, v in vars(worker.counters).items()},
        }

    def op_close(self) -> dict:
        """Close the worker; what it still held afterwards."""
        worker, began = self.worker, time.monotonic()
        worker.close()
        return {"close_s": time.monotonic() - began, "kept_leases": len(worker._kept),
                "attempts_open": _attempts_open(worker.backend), "registered_regions": _registered_regions(worker.backend),
                "store_registrations": _store_registrations(worker.backend), "pins": worker.pins()}

    def op_master(self, action: str, lease_ttl_ms: int = 1000, client_ttl_s: int = 2,
                  extra_args: tuple[str, ...] = (), rpc_port: int = 0, metrics_port: int = 0) -> dict:
        """``start`` (a master on this host's address; ports 0 pick free ones), ``kill``,
        ``restart`` (the same ports) or ``stop``."""
        from kvwire_mooncake.master import MasterProcess

        if action == "start":
            self.master = MasterProcess(host=os.environ["KVWR_ADDRESS"], lease_ttl_ms=lease_ttl_ms,
                                        client_ttl_s=client_ttl_s, extra_args=extra_args, rpc_port=rpc_port,
                                        metrics_port=metrics_port).start()
        elif action == "kill":
            self.master.kill()
        elif action == "restart":
            self.master.start()
        elif action == "stop":
            self.master.stop()
        else:
            raise ValueError(f"unknown master action {action!r}")
        return {"address": self.master.address, "metrics_port": self.master.metrics_port,
                "running": self.master.running()}

    def op_ping(self) -> dict:
        return {"pid": os.getpid()}

    # -- the loop ----------------------------------------------------------------------------

    def run_one(self, message: dict[str, Any]) -> None:
        ident = message.pop("id")
        op = message.pop("op")
        try:
            answer = getattr(self, f"op_{op}")(**message)
            self.send({"id": ident, "ok": True, **answer})
        except Exception as exc:  # every failure goes back to the test, named
            self.send({"id": ident, "ok": False, "error": type(exc).__name__, "message": str(exc),
                       "trace": traceback.format_exc(limit=8)})

    def serve(self) -> None:
        threads = []
        for line in sys.stdin:
            message = json.loads(line)
            if message.get("op") == "exit":
                break
            thread = threading.Thread(target=self.run_one, args=(message,), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(60)
        if self.worker is not None:
            self.worker.close()
        if self.master is not None:
            self.master.stop()


def _attempts_open(backend: Any) -> int:
    """Attempts of this backend not yet both concluded and quiesced."""
    engine = getattr(backend, "engine", None)
    if engine is not None:  # kvwire-ucx
        return len(engine.attempts)
    core = getattr(backend, "_core", None)
    if core is not None:  # a blob backend (mooncake)
        return len(core.attempts)
    raise TypeError(f"no count of open attempts for {type(backend).__name__}")


def _registered_regions(backend: Any) -> int:
    """Regions registered with this backend (its region table)."""
    regions = getattr(backend, "_regions", None)
    if regions is not None:  # kvwire-ucx
        return len(regions.table.regions)
    return len(backend._core.table.regions)


def _store_registrations(backend: Any) -> int | None:
    """Buffers a store backend's client holds registered (``None`` for a peer backend)."""
    core = getattr(backend, "_core", None)
    registered = getattr(core.driver, "_registered", None) if core is not None else None
    return None if registered is None else len(registered)


def main() -> None:
    faulthandler.enable()  # a crash inside a native library leaves its Python stacks in the log
    faulthandler.register(signal.SIGUSR1)  # and SIGUSR1 writes them there on demand (a hang)
    level = os.environ.get("KVWR_LOG_LEVEL")  # e.g. DEBUG: the backends' logs go to the host's log file
    if level:
        import logging

        logging.basicConfig(level=level.upper(), stream=sys.stderr,
                            format="%(asctime)s.%(msecs)03d %(threadName)s %(name)s %(levelname)s %(message)s",
                            datefmt="%H:%M:%S")
    Host().serve()
    os._exit(0)  # UCX and Mooncake threads must not delay the exit the test waits for


if __name__ == "__main__":
    main()
