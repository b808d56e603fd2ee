"""KvwireConnector inside real vLLM engines (CPU build, dummy weights), each in its own process.

Engines are started once per module and kept across tests (a start costs ~25 s here): A and B
use kvwire over one Mooncake master (A asks the store what it holds before loading; B does not,
so a load that misses goes through vLLM's load-error path), P has no connector at all, and G runs
kvwire over the test-only ``gated`` store (:mod:`gated_store`: the real ``files`` store in a
directory of this test's, whose calls a test can hold), for the failure paths that need a load or
a save held inside the store. The files-store pair (A then B over ``files``) is started by its
own test. Nothing waits by sleeping: every wait is for a condition, with a deadline."""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engines import (
    VLLM_PYTHON,
    Engine,
    EngineError,
    close_all,
    files_object_count,
    kvwire_transfer_config,
    start_all,
    store_key_count,
    wait_for_keys,
    wait_for_objects,
)
from kvwire_files import FileStore
from servers import free_port

from kvwire.testing.holder import wait_for

#: One worker runs every vLLM test module, in order, under pytest-xdist (``--dist loadgroup``).
pytestmark = pytest.mark.xdist_group("vllm")

BLOCK = 32
LAYERS = 2  # the tiny model's
#: Objects a store holds per block: files, mooncake and the gated files store name the
#: block-objects protocol (contract K1), so a block of every layer is one object.
OBJECTS = 1
NAMESPACE = "vllm-test"
#: Deadline of the waits for something an engine does in the background (saves, frees).
BACKGROUND_S = 120.0


def prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(length)]


def kvwire_params(answer: dict[str, Any]) -> dict[str, int]:
    outputs = answer["outputs"] if "outputs" in answer else [answer]
    return outputs[0]["kv_transfer_params"]["kvwire"]


def tokens_of(answer: dict[str, Any]) -> list[int]:
    return answer["outputs"][0]["tokens"]


class Gated:
    """The store G's connector reaches, and the gate its calls can be held at."""

    def __init__(self, root: Path, gate: Path) -> None:
        self.root, self.gate = root, gate

    def hold(self, op: str) -> None:
        (self.gate / f"hold-{op}").touch()

    def release(self, op: str) -> None:
        (self.gate / f"hold-{op}").unlink(missing_ok=True)

    def arrived(self, op: str) -> int:
        return len(list(self.gate.glob(f"arrived-{op}-*")))

    def wait_arrived(self, op: str, count: int) -> None:
        wait_for(lambda: self.arrived(op) >= count, BACKGROUND_S, f"{count} held {op} call(s) inside the store")


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Gated:
    top = tmp_path_factory.mktemp("gated")
    (top / "gate").mkdir()
    return Gated(top / "store", top / "gate")


@pytest.fixture(scope="module")
def engines(model_dir: Path, master: Any, gated: Gated, gated_site: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    logs = tmp_path_factory.mktemp("engine-logs")
    options = {"master": master.address, "segment_bytes": 64 << 20, "namespace": NAMESPACE}
    g_options = {"inner": "files", "inner_options": json.dumps({"root": str(gated.root)}), "gate": str(gated.gate)}
    # These four run their workers in processes of their own, as vLLM's CPU build does by default
    # (every other engine of these tests runs its worker inside the engine core, as on one GPU).
    started = {
        "A": Engine("A", model_dir, kvwire_transfer_config("mooncake", options), log_dir=logs, processes=3),
        "B": Engine("B", model_dir, kvwire_transfer_config("mooncake", options, lookup=False), log_dir=logs,
                    processes=3),
        "P": Engine("P", model_dir, None, log_dir=logs, processes=3),
        "G": Engine("G", model_dir, kvwire_transfer_config("gated", g_options, timeout_s=60.0), log_dir=logs,
                    env={"PYTHONPATH": str(gated_site)}, shutdown_timeout=int(BACKGROUND_S), processes=3),
    }
    try:
        start_all(list(started.values()))
        yield started
    finally:
        close_all(started.values())


def test_a_then_b_over_mooncake(engines: dict[str, Engine], master: Any) -> None:
    p = prompt(1, 9 * BLOCK + 9)
    keys = store_key_count(master.metrics_port)
    a = engines["A"].generate([p])
    wait_for_keys(master.metrics_port, keys + 9 * OBJECTS)  # A's saves end after its output returns
    b = engines["B"].generate([p])
    plain = engines["P"].generate([p])
    tokens = plain["outputs"][0]["tokens"]
    assert a["outputs"][0]["tokens"] == tokens
    assert b["outputs"][0]["tokens"] == tokens
    assert kvwire_params(a)["save_blocks"] == 9
    assert b["outputs"][0]["num_cached_tokens"] == 9 * BLOCK
    assert kvwire_params(b) == {**kvwire_params(b), "loaded_blocks": 9, "failed_blocks": 0}
    again = engines["B"].generate([p])
    assert again["outputs"][0]["tokens"] == tokens
    assert again["outputs"][0]["num_cached_tokens"] == 9 * BLOCK  # its own prefix cache now
    assert kvwire_params(again) == {**kvwire_params(again), "loaded_blocks": 0, "save_blocks": 0}


def remove_all_objects(master_address: str) -> int:
    """Remove every object under the test namespace from the store (a pure client, no segment)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master_address) == 0
    try:
        return int(store.remove_by_regex(f"^kvw1/{NAMESPACE}/", True))
    finally:
        store.close()


def test_partial_store_is_recomputed(engines: dict[str, Engine], master: Any) -> None:
    a, b = engines["A"], engines["B"]
    p = prompt(2, 16 * BLOCK + 7)
    tokens = engines["P"].generate([p])["outputs"][0]["tokens"]
    keys = store_key_count(master.metrics_port)
    assert a.generate([p])["outputs"][0]["tokens"] == tokens
    wait_for_keys(master.metrics_port, keys + 16 * OBJECTS)
    assert remove_all_objects(master.address) >= 16 * OBJECTS
    keys = store_key_count(master.metrics_port)
    # The store now gets only the first 8 blocks back.
    a.call({"op": "reset_prefix_cache"})
    assert kvwire_params(a.generate([p[: 8 * BLOCK + 5]]))["save_blocks"] == 8
    wait_for_keys(master.metrics_port, keys + 8 * OBJECTS)
    # B assumes the store holds all 16 blocks: 8 arrive, 8 are load errors vLLM recomputes.
    out = b.generate([p])
    assert out["outputs"][0]["tokens"] == tokens
    assert kvwire_params(out) == {**kvwire_params(out), "loaded_blocks": 8, "failed_blocks": 8}
    # B saved the blocks it recomputed; A, asking the store first, now finds all 16 there.
    wait_for_keys(master.metrics_port, keys + 16 * OBJECTS)
    a.call({"op": "reset_prefix_cache"})
    full = a.generate([p])
    assert full["outputs"][0]["tokens"] == tokens
    assert full["outputs"][0]["num_cached_tokens"] == 16 * BLOCK
    assert kvwire_params(full) == {**kvwire_params(full), "loaded_blocks": 16, "failed_blocks": 0}


def test_store_killed_mid_load_is_recomputed(engines: dict[str, Engine], master: Any) -> None:
    """The Mooncake master dies while B's load is in flight: B recomputes, same tokens. (Last of
    the tests on the master: it is restarted empty afterwards.)"""
    a, b = engines["A"], engines["B"]
    p = prompt(4, 9 * BLOCK + 3)
    tokens = tokens_of(engines["P"].generate([p]))
    keys = store_key_count(master.metrics_port)
    assert tokens_of(a.generate([p])) == tokens
    wait_for_keys(master.metrics_port, keys + 9 * OBJECTS)
    master.freeze()  # it answers nothing now: B's fetch cannot finish before the master is killed
    try:
        b.add("killed", p)  # B does not ask the store first: its load goes straight to the fetch
        wait_for(lambda: b.state()["loads"] == ["killed"], BACKGROUND_S, "B's load of the request in flight")
    finally:
        master.kill()
    (out,) = b.collect("killed")
    assert out["tokens"] == tokens
    assert kvwire_params(out) == {**kvwire_params(out), "loaded_blocks": 0, "failed_blocks": 9}
    # Its saves of the recomputed blocks fail (no master): the request still completed, and
    # nothing is left in flight once they concluded.
    wait_for(lambda: b.state() == {**b.state(), "loads": [], "saves": [], "kept": 0, "holding_blocks_of": []},
             BACKGROUND_S, "B's transfers all concluded")
    master.start()


def test_request_aborted_mid_load(engines: dict[str, Engine], gated: Gated) -> None:
    """G's load is held inside the store when its request is aborted: the engine keeps serving,
    the load is cancelled and reported only once it quiesced, every block is freed, and the
    blocks it was filling are not left cached or corrupted."""
    g = engines["G"]
    p, q = prompt(5, 9 * BLOCK + 9), prompt(6, 3 * BLOCK + 1)
    plain = engines["P"].generate([p, q])
    tokens_p, tokens_q = plain["outputs"][0]["tokens"], plain["outputs"][1]["tokens"]
    objects = files_object_count(gated.root)
    assert tokens_of(g.generate([p])) == tokens_p
    wait_for_objects(gated.root, objects + 9 * OBJECTS)
    wait_for(g.reset_prefix_cache, BACKGROUND_S, "G's blocks all freed (its saves ended)")
    gated.hold("get")
    try:
        g.add("aborted", p)
        gated.wait_arrived("get", 1)
        assert g.state()["loads"] == ["aborted"]
        # The engine keeps serving while that load is held (q is in no store: nothing to load).
        g.add("other", q)
        (other,) = g.collect("other")
        assert other["tokens"] == tokens_q
        g.abort("aborted")
        # The cancelled load is still inside the store: vLLM keeps its blocks, so they are in use.
        assert not g.reset_prefix_cache()
    finally:
        gated.release("get")
    wait_for(lambda: g.state()["loads"] == [], BACKGROUND_S, "the aborted load concluded and quiesced")
    wait_for(g.reset_prefix_cache, BACKGROUND_S, "every block of G free again")
    state = g.state()
    assert state == {**state, "loads": [], "saves": [], "kept": 0, "registered": True, "load_errors_pending": 0}
    # Served again: loaded from the store, right tokens (nothing of the aborted load was cached).
    again = g.generate([p])
    assert tokens_of(again) == tokens_p
    assert again["outputs"][0]["num_cached_tokens"] == 9 * BLOCK
    assert kvwire_params(again) == {**kvwire_params(again), "loaded_blocks": 9, "failed_blocks": 0}


def test_engine_shut_down_mid_transfer(engines: dict[str, Engine], gated: Gated) -> None:
    """G is told to quit while a save and a load are held inside the store: vLLM drains (G runs
    with a shutdown timeout), the connector frees nothing under a call still inside the store,
    the held calls finish once let go, and the engine exits cleanly with the connector reporting
    every attempt quiesced and its registration and backend closed. (Last test of G.)"""
    g = engines["G"]
    p, q = prompt(5, 9 * BLOCK + 9), prompt(7, 5 * BLOCK + 2)  # p is in G's store (the test above)
    tokens_q = tokens_of(engines["P"].generate([q]))
    wait_for(g.reset_prefix_cache, BACKGROUND_S, "G's blocks all free")
    objects = files_object_count(gated.root)
    puts, gets = gated.arrived("put"), gated.arrived("get")
    gated.hold("put")
    gated.hold("get")
    try:
        g.add("saving", q)
        (saving,) = g.collect("saving")  # its output is back; its saves are held inside the store
        assert saving["tokens"] == tokens_q
        gated.wait_arrived("put", puts + 1)
        g.add("loading", p)
        gated.wait_arrived("get", gets + 1)
        state = g.state()
        assert state["loads"] == ["loading"] and state["saves"] == ["saving"], state
        g.quit()
        wait_for(lambda: "[shutdown] EngineCore: start mode=" in g.log_tail(400_000), BACKGROUND_S,
                 "G's engine core beginning its shutdown")
        assert g.proc.poll() is None  # still waiting for the calls inside the store
    finally:
        gated.release("put")
        gated.release("get")
    code = g.close(timeout_s=BACKGROUND_S)  # kills the engine if it hangs: a non-zero status
    log = g.log_tail(400_000)
    assert code == 0, log[-4000:]
    assert "kvwire: connector shut down: " in log and "every attempt quiesced" in log, log[-4000:]
    assert "still touch vLLM's KV memory" not in log, log[-4000:]
    # vLLM's process manager force-kills an engine core whose own teardown outlasts its 5 s budget
    # (seen on a loaded host), which must not be kvwire's doing: the kill, if any, came after the
    # scheduler side's shutdown ended, or while vLLM's engine core still waited for its worker
    # process to exit after kvwire's worker half had shut down (vLLM tears the executor down
    # before the scheduler's connector; seen once in CI beside the rest of the suite).
    ended = log.find("kvwire: scheduler side shut down in ")
    killed = log.find("force killing")
    worker_done = log.find("kvwire: connector shut down: ")
    waiting = log.rfind("[shutdown] Executor: waiting for worker exit")
    if killed < 0:
        assert ended >= 0, log[-4000:]
    else:
        assert (0 <= ended < killed) or (ended < 0 and 0 <= waiting < killed and 0 <= worker_done < killed), log[-4000:]
    assert files_object_count(gated.root) == objects + 5 * OBJECTS  # the held save completed whole


@pytest.fixture(scope="module")
def files_engines(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Three engines over one ``files`` store in a directory of the test's, no server at all:
    A and B as a user runs them by default, and S with ``load_async`` false (its loads run
    inside the step that computes the rest of the prompt) and no lookup (so a load that misses
    goes through vLLM's load-error path for loads inside a step)."""
    top = tmp_path_factory.mktemp("files-engines")
    root = top / "store"
    config = kvwire_transfer_config("files", {"root": str(root)})
    s_trace = top / "s-trace.jsonl"  # S's connector trace: which layer waits vLLM made
    # A publishes vLLM's KV events to a router's subscriber on a loopback port (the subscriber
    # binds, A's ZMQ publisher connects): test_kv_events_*.
    port, events = free_port(), top / "kv-events.jsonl"
    listener = subprocess.Popen([str(VLLM_PYTHON), str(Path(__file__).with_name("kv_events_listener.py")), str(port),
                                 str(events)], stdout=subprocess.DEVNULL, stderr=(top / "listener.log").open("w"))
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    started = {"A": Engine("A-files", model_dir, config, log_dir=top, kv_events_config=kv_events),
               "B": Engine("B-files", model_dir, config, log_dir=top),
               "S": Engine("S-files", model_dir, kvwire_transfer_config("files", {"root": str(root)}, lookup=False,
                                                                        load_async=False), log_dir=top,
                           env={"KVWIRE_VLLM_TRACE": str(s_trace)})}
    try:
        start_all(list(started.values()))
        yield {"root": root, "s_trace": s_trace, "events": events, "listener": listener, **started}
    finally:
        close_all(started.values())
        listener.terminate()
        try:
            listener.wait(timeout=30)
        except subprocess.TimeoutExpired:
            listener.kill()
            listener.wait()


def clear_files_store(root: Path) -> None:
    """Remove every object, as another process sharing the directory would."""
    store = FileStore(str(root), capacity_bytes=1)
    try:
        store.discard_batch(store.keys())
    finally:
        store.close()


def files_payloads(root: Path) -> dict[str, np.ndarray]:
    """Every object of a ``files`` store, by key: its payload (one block of every layer) as float32
    (the tiny model's KV dtype), read from the pack file and offset the index names."""
    store = FileStore(str(root), capacity_bytes=1)
    try:
        out = {}
        for key in store.keys():
            located = store.locate(key)
            assert located is not None, key
            path, offset, size = located
            with open(path, "rb") as f:
                f.seek(offset)
                out[key] = np.frombuffer(f.read(size), dtype=np.float32)
        return out
    finally:
        store.close()


def settled(engine: Engine) -> bool:
    state = engine.state()
    return state == {**state, "loads": [], "step_loads": [], "saves": [], "kept": 0, "holding_blocks_of": []}


def test_a_then_b_over_files_store(files_engines: dict[str, Any], engines: dict[str, Engine]) -> None:
    """Issue test 2: no server at all, the ``files`` store in a directory of the test's."""
    root, a, b = files_engines["root"], files_engines["A"], files_engines["B"]
    p = prompt(3, 9 * BLOCK + 9)
    tokens = tokens_of(engines["P"].generate([p]))
    first = a.generate([p])
    assert tokens_of(first) == tokens
    assert kvwire_params(first)["save_blocks"] == 9
    wait_for_objects(root, 9 * OBJECTS)  # A's saves end after its output returned
    out = b.generate([p])
    assert tokens_of(out) == tokens
    assert out["outputs"][0]["num_cached_tokens"] == 9 * BLOCK
    assert kvwire_params(out) == {**kvwire_params(out), "loaded_blocks": 9, "failed_blocks": 0}
    again = b.generate([p])
    assert tokens_of(again) == tokens
    assert again["outputs"][0]["num_cached_tokens"] == 9 * BLOCK  # B's own prefix cache now
    assert kvwire_params(again) == {**kvwire_params(again), "loaded_blocks": 0, "save_blocks": 0}
    assert files_object_count(root) == 9 * OBJECTS


def test_the_last_block_of_a_prompt_is_saved_only_when_the_store_lacks_it(
        files_engines: dict[str, Any], engines: dict[str, Engine]) -> None:
    """A prompt of exactly 6 whole blocks: B loads the 5 a load may cover (one token is always
    left to compute) and computes the 6th in the step. Its lookup asked about the 6th too: held,
    B submits no save for it and the store is unchanged; not held (A served only 5 blocks of
    another such prompt), B saves it."""
    root, a, b = files_engines["root"], files_engines["A"], files_engines["B"]
    before = files_object_count(root)
    p, q = prompt(11, 6 * BLOCK), prompt(12, 6 * BLOCK)
    plain = engines["P"].generate([p, q])
    tokens_p, tokens_q = plain["outputs"][0]["tokens"], plain["outputs"][1]["tokens"]
    assert kvwire_params(a.generate([p]))["save_blocks"] == 6
    assert kvwire_params(a.generate([q[: 5 * BLOCK + 3]]))["save_blocks"] == 5
    wait_for_objects(root, before + 11 * OBJECTS)
    held = b.generate([p])
    assert tokens_of(held) == tokens_p
    assert kvwire_params(held) == {**kvwire_params(held), "loaded_blocks": 5, "failed_blocks": 0, "save_blocks": 0}
    lacking = b.generate([q])
    assert tokens_of(lacking) == tokens_q
    assert kvwire_params(lacking) == {**kvwire_params(lacking), "loaded_blocks": 5, "failed_blocks": 0,
                                      "save_blocks": 1}
    wait_for_objects(root, before + 12 * OBJECTS)


def test_a_load_inside_the_step(files_engines: dict[str, Any], engines: dict[str, Engine]) -> None:
    """``load_async`` false: S loads what A saved inside the step that computes the rest, and
    generates the same tokens as an engine that computed everything."""
    root, a, s = files_engines["root"], files_engines["A"], files_engines["S"]
    p = prompt(10, 12 * BLOCK + 5)
    tokens = tokens_of(engines["P"].generate([p]))
    objects = files_object_count(root)
    assert tokens_of(a.generate([p])) == tokens
    wait_for_objects(root, objects + 12 * OBJECTS)
    # One token: the request finishes in the very step that ran its load.
    out = s.generate([p], max_tokens=1)
    assert tokens_of(out) == tokens[:1]
    assert out["outputs"][0]["num_cached_tokens"] == 12 * BLOCK
    assert kvwire_params(out) == {**kvwire_params(out), "loaded_blocks": 12, "failed_blocks": 0}
    wait_for(lambda: settled(s), BACKGROUND_S, "S's transfers all concluded")
    assert files_object_count(root) == objects + 12 * OBJECTS  # S saved nothing it loaded
    # vLLM made each layer's attention wait for that layer's load (the dummy weights leave the
    # tokens the same even on a cache never loaded, so only the connector's trace can tell).
    events = [json.loads(line) for line in files_engines["s_trace"].read_text().splitlines()]
    worker = [e for e in events if e["side"] == "worker"]
    submitted = max(i for i, e in enumerate(worker) if e["event"] == "load_submitted" and e.get("sync"))
    ended = next(i for i, e in enumerate(worker) if i > submitted and e["event"] == "load_ended")
    waited = [e["layer"] for e in worker[submitted:ended] if e["event"] == "layer_waited"]
    assert waited == list(range(LAYERS)), f"layer waits between the load's submission and its end: {waited}"


def test_a_load_inside_the_step_that_misses_is_recomputed_and_never_stored(
        files_engines: dict[str, Any], engines: dict[str, Engine]) -> None:
    """S's load inside a step misses half the prompt: vLLM recomputes from the first missing
    block and the tokens are right; the block S computed in that same step (on a context half
    of which never arrived) is not stored; the recomputed blocks are; and the store then holds
    what an engine computing the prompt from scratch stores, so a later load of it is right."""
    root, a, s = files_engines["root"], files_engines["A"], files_engines["S"]
    p = prompt(11, 16 * BLOCK)  # whole blocks only: S computes block 15 in the load's own step
    longer = p + prompt(12, 9)
    plain = engines["P"].generate([p, longer])
    tokens, tokens_longer = tokens_of(plain), plain["outputs"][1]["tokens"]
    # What the store holds when the prompt is computed from scratch: the reference.
    wait_for(lambda: settled(a) and settled(s), BACKGROUND_S, "A and S idle")
    clear_files_store(root)
    wait_for(lambda: a.reset_prefix_cache() and s.reset_prefix_cache(), BACKGROUND_S, "A's and S's blocks all free")
    assert tokens_of(a.generate([p])) == tokens
    wait_for_objects(root, 16 * OBJECTS)
    reference = files_payloads(root)
    # The store gets only the first 8 blocks back.
    clear_files_store(root)
    wait_for(a.reset_prefix_cache, BACKGROUND_S, "A's blocks all free")
    assert kvwire_params(a.generate([p[: 8 * BLOCK + 5]]))["save_blocks"] == 8
    wait_for_objects(root, 8 * OBJECTS)
    # S assumes the store holds blocks 0-14 (the last is always computed): 8 arrive, 7 miss.
    out = s.generate([p])
    assert tokens_of(out) == tokens
    assert kvwire_params(out) == {**kvwire_params(out), "loaded_blocks": 8, "failed_blocks": 7}
    wait_for(lambda: settled(s), BACKGROUND_S, "S's saves all concluded")
    stored = files_payloads(root)
    assert sorted(stored) == sorted(reference)  # blocks 8-15 saved once recomputed
    # Compared bit for bit. The dummy weights make the model nearly blind to its context: the
    # block computed on the half-missing context differs from the reference by ~1e-13 in ~90% of
    # its values (measured), far below any tolerance, while a recompute here, chunked or not,
    # gives the very same bytes (measured: every other object equal).
    differ = sorted(name for name, payload in stored.items() if not np.array_equal(payload, reference[name]))
    assert not differ, f"{len(differ)} stored object(s) differ from what computing the prompt stores: {differ}"
    # A, asking the store, loads all 16 blocks and continues the longer prompt rightly.
    wait_for(a.reset_prefix_cache, BACKGROUND_S, "A's blocks all free")
    after = a.generate([longer])
    assert tokens_of(after) == tokens_longer
    assert kvwire_params(after) == {**kvwire_params(after), "loaded_blocks": 16, "failed_blocks": 0}


def kv_events(path: Path) -> list[dict[str, Any]]:
    """The events the router's subscriber decoded so far (vLLM's own and kvwire's)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_kv_events_say_what_the_store_holds_and_what_it_lost(files_engines: dict[str, Any]) -> None:
    """A runs with vLLM's ``kv_events_config`` (a ZMQ publisher): a subscriber decoding as vLLM's
    own does gets ``BlockStored`` with the medium ``kvwire:files`` for the blocks A's saves put in
    the store, with vLLM's own hashes and tokens of those blocks; once the store lost them (its
    objects removed, as another process or an eviction would) and A's next lookup finds them
    missing, ``BlockRemoved`` for exactly those; the request is recomputed with the right tokens
    and its blocks, saved again, announced again."""
    root, a, path = files_engines["root"], files_engines["A"], files_engines["events"]
    wait_for(lambda: any(e["type"] == "listening" for e in kv_events(path)), BACKGROUND_S, "the subscriber bound")
    p = prompt(21, 9 * BLOCK + 9)
    wait_for(lambda: settled(a) and a.reset_prefix_cache(), BACKGROUND_S, "A idle, its prefix cache empty")
    seen = len(kv_events(path))

    def kvwire(kind: str) -> list[dict[str, Any]]:
        return [e for e in kv_events(path)[seen:] if e["type"] == kind and e.get("medium") == "kvwire:files"]

    first = a.generate([p])
    tokens = tokens_of(first)  # computed whole: nothing of this prompt was stored before
    assert kvwire_params(first) == {**kvwire_params(first), "loaded_blocks": 0, "save_blocks": 9}
    wait_for(lambda: sum(len(e["block_hashes"]) for e in kvwire("BlockStored")) >= 9, BACKGROUND_S,
             "BlockStored of A's 9 saved blocks")
    stored = kvwire("BlockStored")
    hashes = [h for e in stored for h in e["block_hashes"]]
    own = [h for e in kv_events(path)[seen:] if e["type"] == "BlockStored" and e["medium"] != "kvwire:files"
           for h in e["block_hashes"]]
    assert len(hashes) == 9 and hashes == own[:9], "kvwire's events name the blocks by vLLM's own block hashes"
    assert [t for e in stored for t in e["token_ids"]] == p[: 9 * BLOCK]
    assert stored[0]["parent"] is None and all(e["block_size"] == BLOCK for e in stored)
    assert not [e for e in kv_events(path) if e["type"].startswith(("undecodable", "unexpected"))]

    # The store loses the blocks; A finds them missing at its next lookup.
    wait_for(lambda: settled(a), BACKGROUND_S, "A's saves all concluded")
    clear_files_store(root)
    wait_for(a.reset_prefix_cache, BACKGROUND_S, "A's blocks all free")
    seen_stored = len(stored)
    again = a.generate([p])
    assert tokens_of(again) == tokens  # recomputed: a miss, never a failed request
    assert kvwire_params(again) == {**kvwire_params(again), "loaded_blocks": 0, "save_blocks": 9}
    wait_for(lambda: sum(len(e["block_hashes"]) for e in kvwire("BlockRemoved")) >= 9, BACKGROUND_S,
             "BlockRemoved of the 9 blocks the store lost")
    assert sorted(h for e in kvwire("BlockRemoved") for h in e["block_hashes"]) == sorted(hashes)
    wait_for(lambda: sum(len(e["block_hashes"]) for e in kvwire("BlockStored")[seen_stored:]) >= 9, BACKGROUND_S,
             "BlockStored of the 9 blocks saved again")
    assert [h for e in kvwire("BlockStored")[seen_stored:] for h in e["block_hashes"]] == hashes


#: A configuration kvwire refuses (an unknown backend), and the line a user finds in the engine's log.
#: Every other refusal of ``kv_connector_extra_config`` goes through the same
#: ``ConnectorConfig.parse`` call and is checked without vLLM (tests/vllm_core/test_connector_config.py);
#: this one engine shows such a refusal stops vLLM's start with kvwire's message.
BAD_CONFIGURATION = ({"backend": "no-such-store", "options": {}}, "unknown backend 'no-such-store'; installed backends:")


def test_a_bad_configuration_refuses_to_start(model_dir: Path, vllm_venv: Path,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    extra, needle = BAD_CONFIGURATION
    engine = Engine("bad", model_dir, {"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire_vllm",
                                       "kv_role": "kv_both", "kv_connector_extra_config": extra},
                    log_dir=tmp_path_factory.mktemp("bad-config-logs"))
    try:
        try:
            engine.start()
        except EngineError:
            log = engine.log_tail(200_000)
        else:
            raise AssertionError(f"the engine started with {extra}")
    finally:
        engine.close()
    assert needle in log
