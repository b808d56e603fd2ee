"""What the multi-host tests and the soak share: how each backend is set up on a simulated host,
and the checks made after every fault (the attempt concluded in time and says why, nothing is
left held, every block a host holds has the source's bytes)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from host_process import BLOCK_TOKENS, expected_digests
from hosts import Host, HostProcess, Network

from kvwire.holding import TransceiverState

#: UCX would move rows between processes of one kernel through shared memory (cma, posix), past
#: the simulated network; on separate machines only the network is there.
UCX_ENV = {"UCX_TLS": "self,tcp", "UCX_NET_DEVICES": "eth0"}
MOONCAKE_ENV = {"MC_LOG_LEVEL": "ERROR"}
#: kvwire-ucx's grace after a deadline, a cancel or a shutdown (its option ``grace_s``).
UCX_GRACE_S = 0.5
#: How long an attempt may take beyond its deadline: the backend's grace (kvwire-ucx: grace_s
#: plus 1.5 s for a forced close, as its conformance harness states; kvwire-mooncake: the 5 s its
#: harness states), plus scheduling on a loaded 2-core machine.
SLACK_S = 2.0
GRACE_S = {"ucx": UCX_GRACE_S + 1.5, "mooncake": 5.0}
#: What an attempt that did not deliver may say, by the fault the test made.
CAUSES = {"deadline", "fault", "peer-gone", "declined", "holder-cancelled", "peer-cancelled", "shutdown"}


def ucx_options(host: Host, mode: str, **more: Any) -> dict[str, Any]:
    return {"listen_host": host.address, "net_devices": "eth0", "grace_s": UCX_GRACE_S, "mode": mode, **more}


def mooncake_options(master: str, segment_bytes: int, **more: Any) -> dict[str, Any]:
    # a master call may wait for a busy master (2 cores shared by the whole test run) up to 5 s
    return {"master": master, "segment_bytes": segment_bytes, "setup_retries": 1, "rpc_timeout_s": 5.0, **more}


@dataclass
class Worker:
    """A kvwire worker in a host process: the process, its transceiver state, its row shapes."""

    proc: HostProcess
    state: str
    slot_shapes: list[tuple[int, ...]]
    backend: str

    @property
    def host(self) -> Host:
        return self.proc.host

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        return self.proc.call(op, **fields)


def start_worker(host: Host, backend: str, options: dict[str, Any], *, name: str, blocks: int = 512,
                 timeout_s: float = 5.0, env: dict[str, str] | None = None) -> Worker:
    """A host process on ``host`` with one worker of ``backend``."""
    proc = HostProcess(host, env if env is not None else (UCX_ENV if backend == "ucx" else MOONCAKE_ENV))
    try:
        made = proc.call("worker", backend=backend, options=options, blocks=blocks, name=name, timeout_s=timeout_s)
    except BaseException:
        proc.stop()
        raise
    return Worker(proc, made["state"], [tuple(s) for s in made["slot_shapes"]], backend)


def state_via(state: str, host: str, port: int) -> str:
    """``state`` with its peer address pointing at ``host:port`` (a proxy in front of the peer)."""
    from kvwire_ucx.address import PeerAddress

    decoded = TransceiverState.from_bytes(bytes.fromhex(state))
    peer = PeerAddress.from_bytes(decoded.address)
    moved = PeerAddress(host, port, peer.instance)
    return dataclasses.replace(decoded, address=moved.to_bytes()).to_bytes().hex()


def listen_port(state: str) -> int:
    from kvwire_ucx.address import PeerAddress

    return PeerAddress.from_bytes(TransceiverState.from_bytes(bytes.fromhex(state)).address).port


# -- the checks --------------------------------------------------------------------------------


def check_bytes(worker: Worker, seed: int, tokens: int) -> int:
    """Every leading block of prompt ``seed`` that ``worker`` holds has exactly the bytes the
    prompt's source wrote (A7); returns how many it holds."""
    got = worker.call("held", seed=seed, tokens=tokens)["digests"]
    want = expected_digests(seed, tokens, worker.slot_shapes)[: len(got)]
    bad = [k for k, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    assert not bad, f"{worker.host.name} holds blocks {bad} of prompt {seed} with bytes other than the source's"
    return len(got)


def check_result(result: dict[str, Any], worker: Worker, seed: int, tokens: int, *, deadline_s: float,
                 causes: set[str] = CAUSES) -> int:
    """A pull or publish ``result`` concluded within its deadline and the backend's grace, each of
    its attempts that did not deliver names a cause from ``causes``, and (for a pull) the blocks
    it reports are the blocks held, with the source's bytes. Returns the blocks held."""
    bound = deadline_s + GRACE_S[worker.backend] + SLACK_S
    assert result["wall_s"] <= bound, f"the {result} took {result['wall_s']:.1f} s, past deadline + grace ({bound:g} s)"
    for attempt in result["attempts"]:
        assert attempt["seconds"] <= bound, f"an attempt took {attempt['seconds']:.1f} s, past {bound:g} s: {attempt}"
        if attempt["status"] == "delivered":
            assert attempt["cause"] is None, attempt
        else:
            assert attempt["cause"] in causes, f"cause {attempt['cause']!r} is not one of {sorted(causes)}: {attempt}"
            assert attempt["reason"], attempt
    held = check_bytes(worker, seed, tokens)
    if result["attempts"] and result["attempts"][0]["direction"] == "fetch":
        assert result["cached_tokens"] == held * BLOCK_TOKENS, (result, held)
    return held


def check_nothing_held(worker: Worker, settle_s: float = 10.0) -> dict[str, Any]:
    """Within ``settle_s`` (the pulls ``worker`` answered end when their requesters' last word
    comes): no pin, lease, open request, staging slot, kept lease, reply or open attempt, and no
    registration beyond the worker's own. Returns the last accounting."""
    deadline = time.monotonic() + settle_s
    while True:
        acc = worker.call("accounting", settle_s=max(0.0, min(1.0, deadline - time.monotonic())))
        left = {key: acc[key] for key in ("pins", "leases_open", "requests_open", "staging_in_use", "kept_leases",
                                          "replies_open", "attempts_open") if acc[key]}
        if acc["registered_regions"] != acc["own_regions"]:
            left["registered_regions"] = acc["registered_regions"]
        if acc["store_registrations"] not in (None, acc["own_regions"]):
            left["store_registrations"] = acc["store_registrations"]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.05)  # asking another process again: it has no event to wait on
    assert not left, f"{worker.host.name} still holds {left} after {settle_s:g} s: {acc}"
    return acc  # type: ignore[no-any-return]


def until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Ask ``predicate`` (a question to another process, which has no event to wait on) until
    it answers something true, for at most ``timeout_s``; its answer."""
    deadline = time.monotonic() + timeout_s
    pause = 0.01
    while not (answer := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
    return answer


@dataclass
class Pair:
    """Two UCX workers on two hosts: ``server`` (h1) serves pulls, ``client`` (h2) pulls."""

    network: Network
    mode: str
    server: Worker
    client: Worker
    seeds: list[int] = field(default_factory=list)

    def next_seed(self) -> int:
        """A prompt no earlier test used (so the client holds none of it)."""
        seed = 1000 + len(self.seeds)
        self.seeds.append(seed)
        return seed
