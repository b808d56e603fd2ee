"""A soak of kvwire across simulated hosts: mixed pulls (kvwire-ucx), publishes and fetches
(Mooncake) between workers on four network namespaces, with the faults a network gives injected
at random, then everything healed and accounted for.

    python tests/reliability/soak.py --minutes 5 [--seed 1] [--json soak.json]

Hosts: h0 runs the Mooncake master and a fault proxy in front of it; h1, h2 and h3 each run a
kvwire-ucx worker (two-sided; each serves its own prompts and pulls the others') and a Mooncake
worker (h1 and h3 contribute the store's memory; h2 contributes none and reaches the master
through the proxy). Faults, one at a time, every few seconds: a cable pulled (sometimes for
longer than a deadline), a slow link, a host's processes SIGKILLed and restarted, the master
SIGKILLed and restarted, a worker SIGSTOPped, a delayed, lossy or stalled path to the master.

Every operation is checked as the tests check one: it concluded within its deadline and the
backend's grace (unless its own process was stopped meanwhile), every attempt that did not deliver
names a cause, and every block its worker holds afterwards has the seed's bytes. At the end every
fault is healed, every host must hold nothing, and new work between every pair must succeed. The
summary counts outcomes by cause, the bytes checked, the faults, and lists anything else
(anomalies). Exit status 0 when there were none, 1 otherwise, 2 when hosts cannot be simulated."""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from host_process import BLOCK_TOKENS, expected_digests
from hosts import HostGone, HostProcess, Network, ProxyProcess, RemoteError, namespaces_problem
from multihost import GRACE_S, MOONCAKE_ENV, SLACK_S, Worker, mooncake_options, start_worker, ucx_options

DEADLINE_S = 4.0
ROW_BYTES = 64 << 10          # one block, both groups
UCX_PROMPTS = 12              # prompts each UCX worker serves
MOONCAKE_SEEDS = range(5000, 5048)


@dataclass
class Slot:
    """One worker the soak keeps alive: which host, which backend, its current process."""

    name: str
    host: int
    backend: str
    options: Any
    seeds: list[int] = field(default_factory=list)   # prompts it serves (kvwire-ucx)
    worker: Worker | None = None
    frozen: list[tuple[float, float]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def alive(self) -> bool:
        return self.worker is not None and self.worker.proc.alive()

    def stopped_between(self, began: float, ended: float) -> bool:
        return any(a < ended and b > began for a, b in self.frozen)


class Soak:
    def __init__(self, seed: int, minutes: float, concurrency: int) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.minutes = minutes
        self.concurrency = concurrency
        self.lock = threading.Lock()
        self.outcomes: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.faults: collections.Counter[str] = collections.Counter()
        self.anomalies: list[str] = []
        self.bytes_checked = 0
        self.checks = 0
        self.published: set[int] = set()
        self.next_seed = 10_000
        self.stop = threading.Event()
        self.net: Network | None = None
        self.master: HostProcess | None = None
        self.master_ports: tuple[int, int] = (0, 0)
        self.proxy: ProxyProcess | None = None
        self.proxy_listen = ""
        self.slots: list[Slot] = []
        self.restarts = 0
        self.killed: set[int] = set()   # pids of host processes the soak killed itself

    # -- set-up -------------------------------------------------------------------------------

    def setup(self) -> None:
        self.net = Network(4)
        h0 = self.net[0]
        self.master = HostProcess(h0, MOONCAKE_ENV)
        made = self.master.call("master", action="start", client_ttl_s=2,
                                extra_args=["-put_start_discard_timeout_sec=5"])
        address = made["address"]
        self.master_ports = (int(address.rpartition(":")[2]), int(made["metrics_port"]))
        self.proxy_listen = f"{h0.add_address(100)}:{self.master_ports[0] + 1}"
        self.proxy = ProxyProcess(h0, self.proxy_listen, address)
        for i in (1, 2, 3):
            host = self.net[i]
            self.slots.append(Slot(f"U{i}", i, "ucx", lambda h=host: ucx_options(h, "two-sided"),
                                   seeds=[100 * i + k for k in range(UCX_PROMPTS)]))
            via = self.proxy.address if i == 2 else address
            self.slots.append(Slot(f"M{i}", i, "mooncake",
                                   lambda via=via, i=i: mooncake_options(via, 0 if i == 2 else 64 << 20,
                                                                         timeout_s=DEADLINE_S)))
        for slot in self.slots:
            self.start(slot)

    def start(self, slot: Slot) -> None:
        assert self.net is not None
        worker = start_worker(self.net[slot.host], slot.backend, slot.options(), name=slot.name, blocks=640,
                              timeout_s=DEADLINE_S)
        for seed in slot.seeds:
            worker.call("fill", seed=seed, tokens=32 * BLOCK_TOKENS)
        with slot.lock:
            slot.worker = worker

    def anomaly(self, text: str) -> None:
        with self.lock:
            self.anomalies.append(f"[{time.strftime('%H:%M:%S')}] {text}")
        print("ANOMALY", text, flush=True)

    # -- operations ---------------------------------------------------------------------------

    def live(self, backend: str) -> list[Slot]:
        return [s for s in self.slots if s.backend == backend and s.alive]

    def operate(self) -> None:
        while not self.stop.is_set():
            kind = self.rng.choice(["pull", "pull", "publish", "fetch"])
            try:
                if kind == "pull":
                    self.pull()
                elif kind == "publish":
                    self.publish()
                else:
                    self.fetch()
            except Exception as exc:  # the soak must outlive anything one operation does
                self.anomaly(f"{kind}: the soak itself raised {type(exc).__name__}: {exc}")

    def pull(self) -> None:
        ucx = self.live("ucx")
        if len(ucx) < 2:
            self.stop.wait(0.2)
            return
        requester, source = self.rng.sample(ucx, 2)
        seed = self.rng.choice(source.seeds)
        assert source.worker is not None
        self.run("pull", requester, seed, 32 * BLOCK_TOKENS, source=source.worker.state)

    def publish(self) -> None:
        mooncake = self.live("mooncake")
        if not mooncake:
            self.stop.wait(0.2)
            return
        slot = self.rng.choice(mooncake)
        seed = self.rng.choice(MOONCAKE_SEEDS)
        worker = slot.worker
        assert worker is not None
        with contextlib.suppress(HostGone, RemoteError):
            worker.call("fill", seed=seed, tokens=32 * BLOCK_TOKENS)
        if self.run("publish", slot, seed, 32 * BLOCK_TOKENS):
            with self.lock:
                self.published.add(seed)

    def fetch(self) -> None:
        mooncake = self.live("mooncake")
        with self.lock:
            seeds = sorted(self.published)
        if not mooncake or not seeds:
            self.stop.wait(0.2)
            return
        slot = self.rng.choice(mooncake)
        assert slot.worker is not None
        self.run("fetch", slot, self.rng.choice(seeds), 32 * BLOCK_TOKENS, source=slot.worker.state)

    def run(self, kind: str, slot: Slot, seed: int, tokens: int, source: str | None = None) -> bool:
        worker = slot.worker
        if worker is None:
            return False
        op = "publish" if kind == "publish" else "pull"
        fields: dict[str, Any] = {"seed": seed, "tokens": tokens, "timeout_s": DEADLINE_S}
        if source is not None:
            fields["source"] = source
        began = time.monotonic()
        try:
            result = worker.proc.call(op, wait_s=DEADLINE_S + 120, **fields)
        except HostGone:
            self.count(kind, "host-gone", "")  # killed by the soak, or a crash sweep_crashes reports
            return False
        except RemoteError as exc:
            self.anomaly(f"{slot.name} {kind} of prompt {seed} raised {exc.error}: {str(exc).splitlines()[0]}")
            self.count(kind, "raised", exc.error)
            return False
        except TimeoutError:
            self.anomaly(f"{slot.name} {kind} of prompt {seed}: no answer within {DEADLINE_S + 120:g} s")
            return False
        ended = time.monotonic()
        attempts = result["attempts"]
        cause = next((a["cause"] or "none" for a in attempts if a["status"] != "delivered"), "")
        self.count(kind, result["status"], cause)
        bound = DEADLINE_S + GRACE_S[slot.backend] + SLACK_S
        if result["wall_s"] > bound and not slot.stopped_between(began, ended):
            self.anomaly(f"{slot.name} {kind} of prompt {seed} took {result['wall_s']:.1f} s (past {bound:g} s): "
                         f"{result['status']} {result['reason']}")
        for a in attempts:
            if a["status"] != "delivered" and (a["cause"] is None or not a["reason"]):
                self.anomaly(f"{slot.name} {kind}: an attempt without a cause or reason: {a}")
        if kind != "publish":
            self.check_bytes(slot, worker, seed, tokens)
        return bool(result["status"] == "delivered" and result["blocks_moved"] == tokens // BLOCK_TOKENS)

    def check_bytes(self, slot: Slot, worker: Worker, seed: int, tokens: int) -> None:
        try:
            got = worker.call("held", seed=seed, tokens=tokens)["digests"]
        except (HostGone, RemoteError):
            return
        want = expected_digests(seed, tokens, worker.slot_shapes)
        bad = [k for k, (g, w) in enumerate(zip(got, want, strict=False)) if g != w]
        with self.lock:
            self.checks += 1
            self.bytes_checked += len(got) * ROW_BYTES
        if bad:
            self.anomaly(f"{slot.name} holds blocks {bad} of prompt {seed} with bytes other than the source's")

    def count(self, kind: str, status: str, cause: str) -> None:
        with self.lock:
            self.outcomes[(kind, status, cause)] += 1

    # -- faults -------------------------------------------------------------------------------

    def restart(self, slot: Slot, why: str) -> None:
        with slot.lock:
            old, slot.worker = slot.worker, None
        if old is not None:
            old.proc.stop(5)
        self.restarts += 1
        try:
            self.start(slot)
        except Exception as exc:
            self.anomaly(f"{slot.name} could not be restarted ({why}): {type(exc).__name__}: {exc}")

    def sweep_crashes(self) -> None:
        """Restart the workers whose process ended without the soak killing it (and say so)."""
        for slot in self.slots:
            worker = slot.worker
            if worker is not None and not worker.proc.alive() and worker.proc.pid not in self.killed:
                self.anomaly(f"{slot.name} died by itself (exit status {worker.proc.popen.poll()}); "
                             f"its log ends: {worker.proc.log_tail(600)!r}")
                self.restart(slot, "crashed")

    def inject(self) -> None:
        assert self.net is not None and self.master is not None and self.proxy is not None
        net, rng = self.net, self.rng
        while not self.stop.wait(rng.uniform(2.0, 6.0)):
            self.sweep_crashes()
            kind = rng.choice(["link", "link", "slow", "kill-host", "kill-master", "freeze", "proxy"])
            hold = rng.uniform(0.5, 3.0) if kind != "link" else rng.choice([rng.uniform(0.3, 2.0),
                                                                           rng.uniform(6.0, 20.0)])
            self.faults[kind] += 1
            print(f"fault: {kind} for {hold:.1f} s", flush=True)
            if kind == "link":
                host = net[rng.randrange(0, 4)]
                with net.cable_pulled(host):
                    self.stop.wait(hold)
                if hold > DEADLINE_S:
                    self.faults["link-longer-than-a-deadline"] += 1
            elif kind == "slow":
                host = net[rng.randrange(1, 4)]
                net.shape(host, rng.choice([8_000_000, 32_000_000]))
                self.stop.wait(hold)
                net.unshape(host)
            elif kind == "kill-host":
                index = rng.randrange(1, 4)
                victims = [s for s in self.slots if s.host == index]
                with self.lock:
                    self.killed.update(net[index].pids())
                self.killed.update(net[index].kill_all())
                self.stop.wait(hold)
                for slot in victims:
                    self.restart(slot, "killed")
            elif kind == "kill-master":
                self.master.call("master", action="kill")
                self.stop.wait(hold)
                self.master.call("master", action="restart")
            elif kind == "freeze":
                slot = rng.choice([s for s in self.slots if s.alive])
                assert slot.worker is not None
                proc, began = slot.worker.proc, time.monotonic()
                proc.freeze()
                self.stop.wait(hold)
                with contextlib.suppress(ProcessLookupError):
                    proc.thaw()
                slot.frozen.append((began, time.monotonic()))
            else:
                fault = rng.choice([{"delay_s": rng.uniform(0.02, 0.2)}, {"loss": rng.uniform(0.1, 0.4)},
                                    {"stall": True}])
                self.proxy.set(**fault)
                self.stop.wait(hold)
                self.proxy.heal()

    # -- the run ------------------------------------------------------------------------------

    def run_all(self) -> None:
        threads = [threading.Thread(target=self.operate, name=f"soak-op-{i}", daemon=True)
                   for i in range(self.concurrency)]
        injector = threading.Thread(target=self.inject, name="soak-faults", daemon=True)
        for thread in (*threads, injector):
            thread.start()
        self.stop.wait(self.minutes * 60)
        self.stop.set()
        injector.join(120)
        for thread in threads:
            thread.join(DEADLINE_S + 180)

    def heal_and_account(self) -> dict[str, Any]:
        assert self.net is not None and self.master is not None and self.proxy is not None
        for host in self.net:
            self.net.link_up(host)
            self.net.unshape(host)
        self.proxy.heal()
        if not self.master.call("master", action="restart")["running"]:  # a no-op when it runs
            self.anomaly("the master did not come back")
        self.sweep_crashes()
        left: dict[str, dict[str, Any]] = {}
        for slot in self.slots:
            assert slot.worker is not None
            acc = slot.worker.call("accounting", settle_s=30)
            held = {k: acc[k] for k in ("pins", "leases_open", "requests_open", "staging_in_use", "kept_leases",
                                        "replies_open", "attempts_open") if acc[k]}
            if acc["registered_regions"] != acc["own_regions"]:
                held["registered_regions"] = acc["registered_regions"]
            if not acc["settled"]:
                held["unsettled_replies"] = True
            if held:
                left[slot.name] = held
                self.anomaly(f"{slot.name} still holds {held} after every fault healed")
        after: list[str] = []
        ucx = [s for s in self.slots if s.backend == "ucx"]
        for requester in ucx:
            for source in ucx:
                if requester is source:
                    continue
                seed = self.fresh_seed()
                assert source.worker is not None and requester.worker is not None
                source.worker.call("fill", seed=seed, tokens=16 * BLOCK_TOKENS)
                r = requester.worker.call("pull", seed=seed, tokens=16 * BLOCK_TOKENS, source=source.worker.state)
                after.append(f"{requester.name}<-{source.name}: {r['status']} {r['cached_tokens'] // 16}/16")
                if r["cached_tokens"] != 16 * BLOCK_TOKENS:
                    self.anomaly(f"after healing, {requester.name} pulled {r['cached_tokens'] // 16} of 16 blocks "
                                 f"from {source.name}: {r['status']} {r['reason']}")
        mooncake = [s for s in self.slots if s.backend == "mooncake"]
        for publisher in mooncake:
            seed = self.fresh_seed()
            assert publisher.worker is not None
            publisher.worker.call("fill", seed=seed, tokens=16 * BLOCK_TOKENS)
            deadline = time.monotonic() + 30
            while (p := publisher.worker.call("publish", seed=seed, tokens=16 * BLOCK_TOKENS))["blocks_moved"] != 16:
                if time.monotonic() > deadline:
                    self.anomaly(f"after healing, {publisher.name} could not publish: {p['status']} {p['reason']}")
                    break
                time.sleep(0.5)  # the clients reconnect to a restarted master on their own
            for fetcher in mooncake:
                if fetcher is publisher:
                    continue
                assert fetcher.worker is not None
                r = fetcher.worker.call("pull", seed=seed, tokens=16 * BLOCK_TOKENS, source=fetcher.worker.state)
                after.append(f"{fetcher.name}<-{publisher.name}: {r['status']} {r['cached_tokens'] // 16}/16")
                if r["cached_tokens"] != 16 * BLOCK_TOKENS:
                    self.anomaly(f"after healing, {fetcher.name} fetched {r['cached_tokens'] // 16} of 16 blocks "
                                 f"published by {publisher.name}: {r['status']} {r['reason']}")
                self.check_bytes(fetcher, fetcher.worker, seed, 16 * BLOCK_TOKENS)
        return {"left": left, "new_work": after}

    def fresh_seed(self) -> int:
        self.next_seed += 1
        return self.next_seed

    def close(self) -> None:
        for slot in self.slots:
            if slot.worker is not None:
                slot.worker.proc.stop(10)
        if self.proxy is not None:
            self.proxy.stop()
        if self.master is not None:
            self.master.stop(10)
        if self.net is not None:
            self.net.close()

    # -- the summary --------------------------------------------------------------------------

    def summary(self, command: str, took: float, end: dict[str, Any]) -> dict[str, Any]:
        by_kind: dict[str, dict[str, int]] = collections.defaultdict(dict)
        for (kind, status, cause), n in sorted(self.outcomes.items()):
            by_kind[kind][f"{status}/{cause}" if cause else status] = n
        return {
            "command": command,
            "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
                       f"Python {platform.python_version()}",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "seed": self.seed,
            "minutes": round(took / 60, 2),
            "operations": sum(self.outcomes.values()),
            "outcomes": by_kind,
            "bytes_checked": self.bytes_checked,
            "byte_checks": self.checks,
            "faults": dict(sorted(self.faults.items())),
            "restarts": self.restarts,
            "anomalies": self.anomalies,
            "left_after_healing": end["left"],
            "new_work_after_healing": end["new_work"],
        }


def render(s: dict[str, Any]) -> str:
    lines = [f"kvwire soak: {s['minutes']} min, seed {s['seed']}, on {s['machine']} ({s['date']})",
             f"command: {s['command']}",
             f"operations: {s['operations']}"]
    for kind, counts in s["outcomes"].items():
        lines.append(f"  {kind:8} " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    lines.append(f"bytes checked: {s['bytes_checked'] / 2**30:.2f} GiB in {s['byte_checks']} checks")
    lines.append("faults: " + ", ".join(f"{k} {v}" for k, v in s["faults"].items()) + f"; restarts {s['restarts']}")
    lines.append(f"left after healing: {s['left_after_healing'] or 'nothing'}")
    work = s["new_work_after_healing"]
    whole = sum(1 for w in work if w.endswith(" 16/16"))
    lines.append(f"new work after healing: {whole}/{len(work)} whole")
    lines.append(f"anomalies: {len(s['anomalies'])}")
    lines += [f"  - {a}" for a in s["anomalies"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=3, help="operations in flight at once")
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()
    problem = namespaces_problem()
    if problem:
        print(f"simulated hosts are not available here: {problem}", file=sys.stderr)
        return 2
    command = "python tests/reliability/soak.py " + " ".join(sys.argv[1:])
    soak = Soak(args.seed, args.minutes, args.concurrency)
    began = time.monotonic()
    try:
        soak.setup()
        soak.run_all()
        end = soak.heal_and_account()
    finally:
        soak.close()
    summary = soak.summary(command, time.monotonic() - began, end)
    print(render(summary))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=2)
    return 1 if summary["anomalies"] else 0


if __name__ == "__main__":
    sys.exit(main())
