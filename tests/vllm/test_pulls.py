"""Request-free pulls between real vLLM engines (issue 17): engine 0 serves pulls from vLLM's
prefix cache through kvwire-ucx (``serve-pulls``), engine 1's requests carry engine 0's
transceiver state and load the prompt's blocks from it (engine 2 too, for concurrent pulls from two
engines). Each engine runs in its own process
(:mod:`engine_driver`); the engines of one UCX mode start once per module. Engine 2's core runs
inside its driver's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as an offline ``LLM`` may be
built): it pulls as the others do, and says at start that it cannot serve pulls while idle.
Nothing waits by sleeping: every wait is for a condition, with a deadline."""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engines import VLLM_PYTHON, Engine, close_all, kvwire_transfer_config, start_all

from kvwire.testing.holder import wait_for

BLOCK = 32
#: The deadline of every load (and the peer's pull): a dead or silent peer ends within it.
TIMEOUT_S = 8.0
BACKGROUND_S = 120.0

#: One worker runs every vLLM test module, in order, under pytest-xdist (``--dist loadgroup``):
#: their engines would otherwise start side by side on a small host, and this module's last test
#: kills engine 0.
pytestmark = [pytest.mark.usefixtures("vllm_venv"), pytest.mark.xdist_group("vllm")]


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(length)]


def out(answer: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return answer["outputs"][i]


def kv(output: dict[str, Any]) -> dict[str, int]:
    return (output.get("kv_transfer_params") or {}).get("kvwire", {})


def whole_blocks(length: int) -> int:
    """Blocks a request may take from elsewhere: whole ones, leaving one token to compute."""
    return (length - 1) // BLOCK


class Pair:
    """Engine 0 (serving) and engine 1 (pulling) of one UCX mode, and engine 2 (pulling too, for
    concurrent pulls from two engines)."""

    def __init__(self, serving: Engine, pulling: Engine, other: Engine, mode: str, logs: Path) -> None:
        self.serving, self.pulling, self.other, self.mode, self.logs = serving, pulling, other, mode, logs
        self._state: str | None = None

    @property
    def state(self) -> str:
        if self._state is None:
            self._state = self.serving.transceiver_state()
        assert self._state is not None
        return self._state


def events_endpoint(logs: Path, name: str) -> str:
    """Where an engine's KV event publisher binds (a local socket file: nothing on the network)."""
    return f"ipc://{logs}/events-{name}"


def _engines(model_dir: Path, logs: Path, mode: str) -> dict[str, Engine]:
    options: dict[str, Any] = {"timeout_s": TIMEOUT_S, "grace_s": 1.0}
    if mode != "two-sided":
        options["mode"] = mode
    env = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_MODULES": "^ib",
           "NIXL_LOG_LEVEL": "WARN"}
    config = kvwire_transfer_config("ucx", options, timeout_s=TIMEOUT_S)

    def events(name: str) -> dict[str, Any]:  # vLLM's own KV events, for the prefix-aware router's test
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint(logs, name)}

    engines = {
        "serving": Engine(f"{mode}-0", model_dir, config, env=env, log_dir=logs, new_session=True,
                          kv_events_config=events("serving")),
        "pulling": Engine(f"{mode}-1", model_dir, config, env=env, log_dir=logs, new_session=True,
                          kv_events_config=events("pulling")),
        # The other pulling engine loads inside the step (load_async false), its engine core
        # inside its driver's process (nothing steps it between the driver's calls).
        "other": Engine(f"{mode}-2", model_dir, kvwire_transfer_config("ucx", options, timeout_s=TIMEOUT_S,
                                                                       load_async=False),
                        env=env, log_dir=logs, new_session=True, kv_events_config=events("other"), processes=1),
    }
    return engines


@pytest.fixture(scope="module", params=["two-sided", "one-sided"])
def pair(request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    mode = request.param
    logs = tmp_path_factory.mktemp(f"pull-logs-{mode}")
    engines = _engines(model_dir, logs, mode)
    try:
        start_all(list(engines.values()))
        yield Pair(engines["serving"], engines["pulling"], engines["other"], mode, logs)
    finally:
        close_all(engines.values())  # a killed one's close returns at once


def holds_no_pin_and_serves_on(pair: Pair, seed: int) -> None:
    """Engine 0 ends with no reply in flight and no pin (vLLM resets its prefix cache only when no
    block is referenced), and serves on: its own request, and a pull of the same prompt."""

    def settled() -> bool:
        s = pair.serving.state()
        return s["replies_in_flight"] == 0 and s["pulls_pending"] == 0

    wait_for(settled, BACKGROUND_S, "engine 0's replies all quiesced")
    wait_for(pair.serving.reset_prefix_cache, BACKGROUND_S, "engine 0's prefix cache reset (no pinned block)")
    again = prompt(seed, 200)
    mine = out(pair.serving.generate([again], max_tokens=1))
    theirs = out(pair.pulling.generate([again], max_tokens=1, source=pair.state))
    assert theirs["tokens"] == mine["tokens"] and kv(theirs)["loaded_blocks"] == whole_blocks(200)


def test_five_steps(pair: Pair) -> None:
    """The seed's flow: engine 0 serves a prompt, its state is non-empty bytes, engine 1 given
    both produces the same token with the prompt's whole blocks external, a normal request for
    the prompt on engine 1 then hits its own cache, an unrelated prompt hits less."""
    p = prompt(1700, 300)
    served = out(pair.serving.generate([p], max_tokens=1))
    state = base64.b64decode(pair.state)
    assert state and state[:4] == b"KVWS"
    pulled = out(pair.pulling.generate([p], max_tokens=1, source=pair.state))
    assert pulled["tokens"] == served["tokens"]
    assert pulled["num_cached_tokens"] == whole_blocks(len(p)) * BLOCK
    assert kv(pulled)["loaded_blocks"] == whole_blocks(len(p))
    assert kv(pulled)["failed_blocks"] == 0
    again = out(pair.pulling.generate([p], max_tokens=1))
    assert again["num_cached_tokens"] >= whole_blocks(len(p)) * BLOCK
    assert again["tokens"] == served["tokens"]
    other = out(pair.pulling.generate([prompt(1701, 300)], max_tokens=1))
    assert other["num_cached_tokens"] < again["num_cached_tokens"]


class Router:
    """The prefix-aware router's core (:mod:`router_driver`) fed by the three engines' events."""

    def __init__(self, pair: Pair) -> None:
        spec = {"block_size": BLOCK, "engines": {name: events_endpoint(pair.logs, name)
                                                 for name in ("serving", "pulling", "other")}}
        self.log = (pair.logs / "router.log").open("w")
        self.proc = subprocess.Popen([str(VLLM_PYTHON), str(Path(__file__).with_name("router_driver.py")),
                                      json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        assert self._answer().get("ready")

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@driver "):
                answer: dict[str, Any] = json.loads(line[len("@@driver "):])
                assert "error" not in answer, answer
                return answer
        raise AssertionError(f"the router exited (status {self.proc.wait()})")

    def call(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.call_quit()
        self.log.close()

    def call_quit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_a_prefix_aware_router_sends_a_request_to_pull_the_prefix_a_busy_engine_holds(pair: Pair) -> None:
    """The router's index follows the three engines' own KV events: after engine 0 served a
    prompt it holds its 9 blocks; with engine 0 busy the request goes to the least loaded engine
    with engine 0 to pull from, which loads all 9 blocks and gives engine 0's token; the index
    then has that engine holding them too (the next such request goes there, no pull), and once
    engine 0's prefix cache is reset, engine 0 holds nothing."""
    if pair.mode != "two-sided":
        pytest.skip("the router is the same over either UCX mode; its engines run once")
    router = Router(pair)
    try:
        p = prompt(1750, 9 * BLOCK + 5)
        served = out(pair.serving.generate([p], max_tokens=1))
        wait_for(lambda: router.call(op="held", tokens=p)["held"]["serving"] == 9, BACKGROUND_S,
                 "the router indexing engine 0's 9 blocks from its events")
        load = {"serving": 8, "pulling": 0, "other": 1}
        route = router.call(op="choose", tokens=p, load=load, can_pull=True)
        assert route == {"engine": "pulling", "blocks": 9, "pull_from": "serving"}
        pulled = out(pair.pulling.generate([p], max_tokens=1, source=pair.state))
        assert pulled["tokens"] == served["tokens"] and kv(pulled)["loaded_blocks"] == 9
        wait_for(lambda: router.call(op="held", tokens=p)["held"]["pulling"] == 9, BACKGROUND_S,
                 "the router indexing the 9 blocks engine 1 pulled")
        assert router.call(op="choose", tokens=p, load=load, can_pull=True) == \
            {"engine": "pulling", "blocks": 9, "pull_from": None}
        assert router.call(op="held", tokens=p)["held"]["other"] == 0
        wait_for(pair.serving.reset_prefix_cache, BACKGROUND_S, "engine 0's prefix cache reset")
        # vLLM publishes the reset's AllBlocksCleared with its next step's events: step it.
        pair.serving.generate([prompt(1751, BLOCK + 1)], max_tokens=1)
        wait_for(lambda: router.call(op="held", tokens=p)["held"]["serving"] == 0, BACKGROUND_S,
                 "the router dropping engine 0's blocks after its reset")
    finally:
        router.close()


def pulls_a_partial_prefix(pair: Pair, puller: Engine, seed: int) -> None:
    """Engine 0 loses part of a prompt's prefix (its cache reset, then only the first 5 blocks
    served again): ``puller`` gets those 5, recomputes the rest, same tokens."""
    p = prompt(seed, 300)
    served = out(pair.serving.generate([p], max_tokens=2))
    wait_for(pair.serving.reset_prefix_cache, BACKGROUND_S, "engine 0's prefix cache reset (no block in use)")
    pair.serving.generate([p[:5 * BLOCK + 7]], max_tokens=1)
    pulled = out(puller.generate([p], max_tokens=2, source=pair.state))
    assert pulled["tokens"] == served["tokens"]
    assert kv(pulled)["loaded_blocks"] == 5
    assert kv(pulled)["failed_blocks"] == whole_blocks(len(p)) - 5


def test_a_partial_prefix_is_a_success(pair: Pair) -> None:
    """Engine 0 lost part of the prefix: engine 1 gets what is left of it, recomputes the rest."""
    pulls_a_partial_prefix(pair, pair.pulling, 1702)


def test_a_pull_inside_the_step(pair: Pair) -> None:
    """The other pulling engine loads inside the step that computes the rest (``load_async``
    false): a whole prefix arrives in one pull of every layer; a partial one is a success too,
    the rest recomputed in later steps; the tokens are the serving engine's either way."""
    p = prompt(1710, 300)
    served = out(pair.serving.generate([p], max_tokens=2))
    pulled = out(pair.other.generate([p], max_tokens=2, source=pair.state))
    assert pulled["tokens"] == served["tokens"]
    assert pulled["num_cached_tokens"] == whole_blocks(len(p)) * BLOCK
    assert kv(pulled)["loaded_blocks"] == whole_blocks(len(p)) and kv(pulled)["failed_blocks"] == 0
    pulls_a_partial_prefix(pair, pair.other, 1711)
    state = pair.other.state()
    assert state == {**state, "loads": [], "step_loads": [], "kept": 0, "load_errors_pending": 0}


#: What the connector says at start in an engine whose core runs inside its caller's process.
IN_CALLER = "this engine's core runs inside its caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"


def test_an_engine_core_inside_its_callers_process_says_it_serves_no_pull_while_idle(pair: Pair) -> None:
    """Engine 2 (its core in the driver's process; it pulled in the tests above) warns that a pull
    reaching it while idle waits for its caller; engines 0 and 1 (cores of their own) do not."""
    assert IN_CALLER in pair.other.log_tail(400_000)
    assert IN_CALLER not in pair.serving.log_tail(400_000)
    assert IN_CALLER not in pair.pulling.log_tail(400_000)


def test_local_blocks_are_skipped_and_a_second_pull_moves_nothing(pair: Pair) -> None:
    """Engine 1 pulls only what its own prefix cache lacks; pulling a prompt it holds moves nothing
    (no pull reaches engine 0)."""
    p = prompt(1703, 300)
    served = out(pair.serving.generate([p], max_tokens=1))
    local = out(pair.pulling.generate([p[:4 * BLOCK + 3]], max_tokens=1))
    assert kv(local).get("loaded_blocks", 0) == 0
    before = pair.serving.state()["pulls_served"]
    first = out(pair.pulling.generate([p], max_tokens=1, source=pair.state))
    assert first["tokens"] == served["tokens"]
    assert kv(first)["loaded_blocks"] == whole_blocks(len(p)) - 4
    assert first["num_cached_tokens"] == whole_blocks(len(p)) * BLOCK
    assert pair.serving.state()["pulls_served"] == before + 1
    second = out(pair.pulling.generate([p], max_tokens=1, source=pair.state))
    assert second["tokens"] == served["tokens"]
    assert kv(second)["loaded_blocks"] == 0
    assert second["num_cached_tokens"] == whole_blocks(len(p)) * BLOCK
    assert pair.serving.state()["pulls_served"] == before + 1


def test_many_concurrent_pulls_leave_no_pin(pair: Pair) -> None:
    """50 requests pulled at once from engine 0 by two engines (25 each, all in flight together),
    all correct; then engine 0 holds no pin: no reply in flight, and vLLM's prefix cache can be
    reset (it refuses while any block is referenced)."""
    prompts = [prompt(1800 + i, 200) for i in range(50)]
    served = pair.serving.generate(prompts, max_tokens=1)["outputs"]
    ids = {pair.pulling: [f"c{i}" for i in range(0, 50, 2)], pair.other: [f"c{i}" for i in range(1, 50, 2)]}
    for engine, names in ids.items():
        for name in names:
            engine.add(name, prompts[int(name[1:])], max_tokens=1, source=pair.state)
    pulled: dict[int, dict[str, Any]] = {}
    for engine, names in ids.items():
        for name, output in zip(names, engine.collect(*names), strict=True):
            pulled[int(name[1:])] = output
    assert [pulled[i]["tokens"] for i in range(50)] == [o["tokens"] for o in served]
    assert sum(kv(pulled[i])["loaded_blocks"] for i in range(50)) == 50 * whole_blocks(200)
    assert pair.serving.state()["pulls_served"] >= 50
    holds_no_pin_and_serves_on(pair, 1850)


def test_a_silent_serving_engine_costs_a_deadline_and_leaks_no_pin(pair: Pair) -> None:
    """Engine 0 stopped (SIGSTOP: alive, silent) for the whole of engine 1's pull: engine 1's
    request completes once the load's deadline passed, every block recomputed, with engine 0's
    tokens; engine 0, continued, drops the stale pull (no reply in flight, no pin: its prefix
    cache resets) and serves the next pull."""
    p = prompt(1705, 300)
    served = out(pair.serving.generate([p], max_tokens=2))
    state = pair.state
    group = pair.serving.proc.pid
    os.killpg(group, signal.SIGSTOP)
    try:
        pair.pulling.add("silent", p, max_tokens=2, source=state)
        (done,) = pair.pulling.collect("silent")  # the driver's own timeout: it must not hang
    finally:
        os.killpg(group, signal.SIGCONT)
    assert done["tokens"] == served["tokens"]
    assert kv(done)["loaded_blocks"] == 0
    assert kv(done)["failed_blocks"] == whole_blocks(len(p))
    assert pair.pulling.state()["loads"] == []
    holds_no_pin_and_serves_on(pair, 1706)


def test_a_serving_engine_killed_mid_pull(pair: Pair) -> None:
    """Engine 0 stopped with engine 1's pull on its way to it, then killed: engine 1's request
    completes within its load deadline (plus the backend's grace), every block recomputed, with
    engine 0's tokens. Runs last: engine 0 is gone afterwards."""
    p = prompt(1704, 300)
    served = out(pair.serving.generate([p], max_tokens=2))
    state = pair.state
    group = pair.serving.proc.pid  # its own session: the driver, the engine core and the worker
    os.killpg(group, signal.SIGSTOP)
    try:
        pair.pulling.add("victim", p, max_tokens=2, source=state)
        wait_for(lambda: "victim" in pair.pulling.state()["loads"], BACKGROUND_S, "engine 1's pull in flight")
        os.killpg(group, signal.SIGKILL)
    finally:
        os.killpg(group, signal.SIGKILL)
    pair.serving.proc.wait(timeout=60)
    answer = pair.pulling.call({"op": "collect", "ids": ["victim"]}, timeout_s=TIMEOUT_S + 60)
    (done,) = answer["outputs"]
    assert done["tokens"] == served["tokens"]
    assert kv(done)["loaded_blocks"] == 0
    assert kv(done)["failed_blocks"] == whole_blocks(len(p))
    assert pair.pulling.state()["loads"] == []
