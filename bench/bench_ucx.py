"""kvwire-ucx pulls against raw ucxx tag send/recv moving the same bytes, in the same run; or,
with ``--mode one-sided``, kvwire-ucx's one-sided mode against a raw NIXL agent pair.

    .venv/bin/python bench/bench_ucx.py [--rows N] [--runs N] [--sizes 64K,256K,1M,4M] [--json PATH]
                                        [--window-bytes N] [--raw-busy-poll]
    .venv/bin/python bench/bench_ucx.py --mode one-sided [--prompts 1k,4k,16k,64k,128k] [--token-bytes 4096]

One-sided mode: a prompt of T tokens is T/16 blocks of one group, each block row 16 x
``token-bytes``. kvwire: both backends ``mode="one-sided"``, timed as below (request, the holder's
answer with the rows' addresses, the NIXL READs, the acknowledgement). raw: a ``nixl_agent`` in
each process (UCX backend, same loopback settings), metadata exchanged and the connection wired
up once before any clock; the serving process polls its agent during the raw runs only (once it
knows the reading agent, for the "ask" answers, a READ of its memory waits for that; the polling
thread would slow the kvwire end in that process); timed from building the per-row descriptor
lists through ``initialize_xfer("READ")`` and
``transfer`` until the state is ``DONE``; "raw" gives NIXL one descriptor per row (as the rows
are lent), "raw 1" one descriptor for the whole span (possible here because the rows are
adjacent on both sides; kvwire-ucx merges adjacent rows itself). The raw pair has no request and
no answer: it is the floor kvwire's protocol adds to. "ask" is the raw pair doing the same
protocol with NIXL's own means: the names in one notification, the serving end's lookup (the
holder's, vectorized) and the held rows' addresses in one notification back, the READ (one
descriptor per row) carrying a "done" notification, both agents polling; timed from sending the
names until the READ is ``DONE``. Ratios are raw seconds / kvwire seconds.

Two processes on loopback (``UCX_NET_DEVICES=lo``, endpoint error handling on for both paths).
A serving process holds ``rows`` blocks of each row size; this process pulls them all:

- kvwire: ``fetch`` on a ``UcxBackend`` (built through ``kvwire.registry``) of every block's name
  from the serving backend, whose holder answers from a sorted name table with ``publish``; timed
  from the ``fetch`` call until the attempt has concluded and quiesced (the request, the offer,
  the windowed rows and the acknowledgement all inside the clock);
- raw: this process posts one ``tag_recv`` per row into the same rows and sends an 8-byte "go"
  message; the serving process then posts one ``tag_send`` per row from the same rows; timed
  from the first ``tag_recv`` until every receive completed. Both ends progress their workers
  and, when idle, sleep on the worker's epoll fd after ``arm()``, as kvwire-ucx's progress thread
  does (``--raw-busy-poll`` spins instead: slower here, where two cores are shared).

Each size gets a warm-up of each, then ``runs`` back-to-back pairs whose order alternates. Rates
are payload / median seconds; a ratio is the median over pairs of raw seconds / kvwire seconds.
The destination is zeroed before and checked byte for byte after every run. Goal: >= 0.9x raw.

The serving process is driven over its stdin/stdout with JSON lines (no pickle).

Why one file of this size: one command measures both wire modes and the raw transports side by
side in one run, so they share the processes it sets up."""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import select
import selectors
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import numpy as np  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
GO_TAG = 1 << 62
RAW_TAG = 1 << 61


def pattern(nbytes: int) -> np.ndarray:
    """The bytes the serving process holds (cheap to make on both sides)."""
    words = np.arange((nbytes + 7) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return words.view(np.uint8)[:nbytes]


def block_names(count: int) -> np.ndarray:
    return np.arange(count * 4, dtype=np.uint64).reshape(count, 4).view(np.uint8).copy()  # 32-byte names


def held_prefix(tree: np.ndarray, names: np.ndarray) -> int:
    """How many leading ``names`` (32-byte rows) the sorted ``tree`` holds; vectorized, as a
    holder's reuse tree answers a lookup without a Python step per block."""
    wanted = np.ascontiguousarray(names).view("S32").ravel()
    if not len(tree):
        return 0
    at = np.minimum(np.searchsorted(tree, wanted), len(tree) - 1)
    missing = np.flatnonzero(tree[at] != wanted)
    return int(missing[0]) if len(missing) else len(wanted)


def view_of(region: Any, rows: int, names: np.ndarray) -> Any:
    from kvwire.contract import CacheKind, LayerGroupRows, TokenRange, View

    slots = np.arange(rows, dtype=np.int64)
    return View((LayerGroupRows(0, CacheKind.PAGED, region, slots, TokenRange(0, rows * 16), names[:rows]),))


def pull(backend: Any, view: Any, address: bytes, woken: threading.Event,
         timelines: list[dict[str, float]] | None = None, spin: bool = False) -> float:
    """Seconds for one kvwire pull of ``view`` from ``address``, until concluded and quiesced;
    every row must arrive. The attempt's timeline goes to ``timelines``. ``spin``: poll the
    attempt (yielding the GIL between looks) instead of sleeping until a wake."""
    from kvwire.contract import Hint

    started = time.perf_counter()
    attempt = backend.fetch(view, Hint.of("peer", address=address), woken.set)
    while not (attempt.poll() is not None and attempt.quiesced()):
        if spin:
            time.sleep(0)
            continue
        woken.wait(60)
        woken.clear()
    seconds = time.perf_counter() - started
    outcome = attempt.poll()
    assert outcome is not None and outcome.is_delivered and outcome.masks[0].all(), outcome
    if timelines is not None:
        # the timeline counts from when the backend made the attempt, after fetch()'s checks
        made = attempt.submitted_at - started
        timelines.append({**{k: made + v for k, v in attempt.timeline().items()}, "seen": seconds, "at": started})
    return seconds


#: --spin: the backends' spin_us, longer than the pause between two pulls of a run
SPIN_US = 2_000_000

#: The steps of a one-sided pull that --trace times, each from the end of the one before: the
#: caller's fetch() to its Pull on the wire (the call's checks, then the Pull sent on the
#: caller's thread when the progress thread sleeps, else by the progress thread), to the
#: serving holder taking the pull up (the socket, the serving progress thread, the holder's
#: wake), to its publish() (the bench holder's lookup and view), to the ReadOffer on the wire
#: (sent inside publish() likewise), to the requester having it (the socket
#: and its progress thread's wake), to the conclusion (the NIXL READs and the Ack), to
#: quiescence, to the caller seeing it (its wake).
TRACE_STEPS = ("fetch() -> Pull sent", "-> serving holder takes it", "-> publish() called",
               "-> ReadOffer sent", "-> requester has it", "-> concluded (READs, Ack)", "-> quiesced",
               "-> the caller sees it")


def trace_steps(pulls: list[dict[str, float]], served: list[dict[str, float]]) -> dict[str, list[float]]:
    """Seconds of each of :data:`TRACE_STEPS` for every pull whose serving side is known (the
    serving holder took it up while the pull ran). Both processes read the host's monotonic
    clock (``perf_counter``). "Sent" is noted when the send call returned, so the other process
    may have the message a little earlier: a step across processes can come out slightly
    negative."""
    steps: dict[str, list[float]] = {name: [] for name in TRACE_STEPS}
    for p in pulls:
        at = p["at"]
        side = next((s for s in served if at <= s["taken"] <= at + p["seen"] and "answered" in s), None)
        if side is None or not {"asked", "answered", "concluded", "quiesced"} <= p.keys():
            continue
        marks = [at, at + p["asked"], side["taken"], side["publish"], side["answered"], at + p["answered"],
                 at + p["concluded"], at + p["quiesced"], at + p["seen"]]
        for name, a, b in zip(TRACE_STEPS, marks[:-1], marks[1:], strict=True):
            steps[name].append(b - a)
    return steps


#: The steps of a pull answered from a standing offer, as the requester sees them: its Pull on
#: the wire, the ReadOffer back (the socket, the serving progress thread's look-up in the offer
#: index, the socket again, this progress thread's wake), the READs and the Ack, quiescence, the
#: caller seeing it.
OFFER_STEPS = ("fetch() -> Pull sent", "-> ReadOffer arrived", "-> concluded (READs, Ack)", "-> quiesced",
               "-> the caller sees it")


#: The steps of a pull answered from an offer the serving end pushed (wire version 4): no Pull,
#: no ReadOffer; the offer found among this connection's pushed offers, the read planned from it,
#: the READs (no Ack), quiescence, the caller seeing it.
PUSHED_STEPS = ("fetch() -> pushed offer found", "-> reads planned", "-> concluded (READs)", "-> quiesced",
                "-> the caller sees it")


def requester_steps(pulls: list[dict[str, float]], pushed: bool = False) -> dict[str, list[float]]:
    """Seconds of each of :data:`OFFER_STEPS` (``pushed``: :data:`PUSHED_STEPS`) for every pull
    with all its marks (a pull that asked, or one read from a pushed offer)."""
    names = PUSHED_STEPS if pushed else OFFER_STEPS
    first = "pushed" if pushed else "asked"
    steps: dict[str, list[float]] = {name: [] for name in names}
    for p in pulls:
        if not {first, "answered", "concluded", "quiesced"} <= p.keys():
            continue
        marks = [0.0, p[first], p["answered"], p["concluded"], p["quiesced"], p["seen"]]
        for name, a, b in zip(names, marks[:-1], marks[1:], strict=True):
            steps[name].append(b - a)
    return steps


def print_trace(traces: list[tuple[int, dict[str, list[float]]]], names: tuple[str, ...] = TRACE_STEPS,
                what: str = "a pull answered by the serving holder") -> None:
    print(f"\nwhere the time of {what} goes (--trace): medians in microseconds over the timed pulls "
          "traced (n), by prompt length in tokens")
    print(f"{'step':<30}" + "".join(f"{tokens:>9}" for tokens, _ in traces))
    for name in names:
        print(f"{name:<30}" + "".join(f"{statistics.median(s[name]) * 1e6:>9.0f}" if s[name] else f"{'-':>9}"
                                      for _, s in traces))
    print(f"{'n':<30}" + "".join(f"{len(s[names[0]]):>9}" for _, s in traces))


def checked(run: Callable[[], float], memory: np.ndarray, expected: np.ndarray, nbytes: int) -> float:
    """``run()``'s seconds, with the destination zeroed before and compared byte for byte after."""
    memory[:nbytes] = 0
    seconds = run()
    if not np.array_equal(memory[:nbytes], expected[:nbytes]):
        raise AssertionError("the pulled bytes differ from the serving process's")
    return seconds


def close(backend: Any) -> None:
    from kvwire.holding import drain

    drain(backend, 5.0)


def wait_all(worker: Any, requests: list[Any], busy: bool = False) -> None:
    """Progress until every request completed, looking at each once it is the oldest open one
    (they complete about in order). Between progress calls with nothing to do, sleep on the
    worker's epoll fd after ``arm()`` (as kvwire-ucx's progress thread does) unless ``busy``."""
    i = 0
    fd = worker.epoll_file_descriptor
    while i < len(requests):
        if requests[i].completed:
            i += 1
        elif not worker.progress_once() and not busy and worker.arm():
            select.select([fd], [], [], 0.1)


def ucx_worker() -> tuple[Any, Any]:
    """A context and worker with the settings kvwire-ucx gives its own (loopback, tag + wakeup)."""
    from kvwire_ucx._ucx import context_config, ucx_api

    context = ucx_api.UCXContext(config_dict=context_config("lo"),
                                 feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    worker = ucx_api.UCXWorker(context)
    worker.init_blocking_progress_mode()
    return context, worker


# ---------------------------------------------------------------------------- serving process

def raw_nixl_agent(name: str, memory: np.ndarray) -> Any:
    """A NIXL agent as kvwire-ucx makes its own (UCX backend, loopback, no progress thread), with
    ``memory`` registered."""
    from kvwire_ucx.nixl import _api

    api = _api()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_devices": "lo"})
    agent.register_memory([(memory.ctypes.data, memory.nbytes, 0, "")], "DRAM")
    return agent


def serve(max_bytes: int, busy: bool, mode: str, spin: bool = False) -> None:
    """The serving process: a kvwire-ucx backend whose holder answers every pull in full, and a
    raw ucxx worker that sends rows when told (two-sided) or a raw NIXL agent whose registered
    memory the other process reads (one-sided)."""
    from kvwire_ucx._ucx import Array, ucx_api

    from kvwire.contract import MemoryKind, SlotRegion
    from kvwire.holding import ServingLoop, drain
    from kvwire.registry import load

    memory = pattern(max_bytes).copy()
    backend = load("ucx").build({"timeout_s": 60.0, "mode": mode, "spin_us": SPIN_US if spin else 0})
    registration = None
    tree = np.zeros(0, dtype="S32")  # the held names, sorted
    region: SlotRegion | None = None
    lock = threading.Lock()
    stop = False
    polling = threading.Event()  # the raw NIXL agent is progressed by the thread below
    polled = threading.Lock()  # held by that thread while it progresses the agent
    #: For --trace: (when the holder took a pull up, when it called publish, the publish attempt)
    served: collections.deque[tuple[float, float, Any]] = collections.deque(maxlen=4096)
    spinning = threading.Event()  # --spin, during kvwire's runs: the holder looks without sleeping
    offered: list[Any] = []  # the standing offer (contract O1) of the region's blocks, while one stands

    called = 0.0  # when the holder's lookup gave publish() its view

    def pin(request: Any) -> tuple[Any, None]:
        nonlocal called
        with lock:
            count = held_prefix(tree, request.names)
            view = view_of(region, count, request.names)
        called = time.perf_counter()
        return view, None  # nothing to pin: the bench's rows stay put

    loop = ServingLoop(backend, pin, lambda held: None)
    wakes = loop.wakes

    def holder() -> None:
        seen = 0
        while not stop:
            if spinning.is_set():
                time.sleep(0)  # look again at once, yielding the GIL to the progress thread
            else:
                wakes.wait_beyond(seen, time.monotonic() + 0.5)
            seen = wakes.count
            for request in loop.take():
                taken = time.perf_counter()
                reply = loop.answer(request)
                if reply is not None:
                    served.append((taken, called, reply.submission.attempt))
            loop.sweep()

    threading.Thread(target=holder, daemon=True).start()
    loop.serve()
    if mode == "one-sided":
        agent = raw_nixl_agent("raw-server", memory)

        def progress() -> None:
            # NIXL's wire-up, and the raw READs once this agent knows the reader too, wait for the
            # target to progress; between raw runs this thread stops taking turns at this
            # process's GIL (and leaves the agent's notifications to answer_asks)
            while not stop:
                if not polling.wait(0.05):
                    continue
                with polled:
                    if polling.is_set():  # not after "unpoll": the next ask's notification is answer_asks'
                        agent.get_new_notifs()

        polling.set()
        threading.Thread(target=progress, daemon=True).start()
        say(kvwire=backend.address().hex(), nixl=agent.get_agent_metadata().hex(),  # type: ignore[attr-defined]
            base=memory.ctypes.data)
    else:
        _context, worker = ucx_worker()
        say(kvwire=backend.address().hex(), raw=bytes(worker.address).hex())  # type: ignore[attr-defined]
    peer_ep = None
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "size":
            size, rows = command["size"], command["rows"]
            with lock:
                if registration is not None:
                    registration.close()
                region = SlotRegion(1, memory.ctypes.data, size, rows, MemoryKind.HOST)
                registration = backend.register_regions([region])
                names = block_names(rows)
                tree = np.sort(names.view("S32").ravel())
            say(ok=True)
        elif command["do"] == "peer":
            address = ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(command["raw"]))
            peer_ep = ucx_api.UCXEndpoint.create_from_worker_address(worker, address, True)
            say(ok=True)
        elif command["do"] == "raw":
            assert peer_ep is not None
            size, rows = command["size"], command["rows"]
            go = np.zeros(1, dtype=np.uint64)
            request = worker.tag_recv(Array(go), ucx_api.UCXXTag(GO_TAG))
            say(ready=True)
            wait_all(worker, [request], busy)
            request.check_error()
            buffers = [Array(memory[i * size:(i + 1) * size]) for i in range(rows)]
            sends = [peer_ep.tag_send(b, ucx_api.UCXXTag(RAW_TAG | i)) for i, b in enumerate(buffers)]
            wait_all(worker, sends, busy)
            for s in sends:
                s.check_error()
            del buffers
            say(sent=rows)
        elif command["do"] == "nixl-peer":  # the pulling agent, for answers to its asks
            client = agent.add_remote_agent(bytes.fromhex(command["nixl"]))
            agent.send_notif(client, b"hello")  # wired up while the progress thread runs
            say(ok=True)
        elif command["do"] == "raw-ask":
            say(ready=True)
            answer_asks(agent, client, base=memory.ctypes.data, size=command["size"], tree=tree)
            say(answered=True)
        elif command["do"] in ("poll", "unpoll"):
            if command["do"] == "poll":
                polling.set()
            else:
                polling.clear()
                with polled:  # out of get_new_notifs: the next ask's notification is answer_asks'
                    pass
            say(ok=True)
        elif command["do"] == "spin":
            if command["on"]:
                spinning.set()
            else:
                spinning.clear()
            say(ok=True)
        elif command["do"] == "offer":  # a standing offer of every held block, or its end
            if command["on"]:
                with lock:
                    offered.append(backend.offer(view_of(region, len(tree), block_names(len(tree))),  # type: ignore[attr-defined]
                                                 wakes, 3600.0))
            else:
                attempt = offered.pop()
                attempt.cancel()
                deadline = time.monotonic() + 10
                while not attempt.quiesced():
                    assert time.monotonic() < deadline, "the standing offer did not quiesce"
                    time.sleep(0.001)
            say(ok=True)
        elif command["do"] == "served":  # --trace: the serving holder's steps, on this host's monotonic clock
            steps = [{"taken": taken, "publish": called, **{k: a.submitted_at + v for k, v in a.timeline().items()}}
                     for taken, called, a in list(served)]
            served.clear()
            say(served=steps)
        elif command["do"] == "quit":
            break
    stop = True
    wakes()  # the holder's thread looks at stop now
    if peer_ep is not None:
        peer_ep.close_blocking()
    drain(backend, 5.0, release=(registration.close,) if registration is not None else ())
    say(bye=True)


def answer_asks(agent: Any, client: bytes, base: int, size: int, tree: np.ndarray) -> None:
    """The serving end of the raw NIXL protocol pair, with NIXL's own means: wait for an ask (the
    block names, one notification), look them up as the kvwire holder does, answer with the held
    rows' addresses (one notification), and keep progressing until the reader's "done" (the
    notification its READ carries): a cma READ of a passive agent that stops progressing can
    stay in PROC."""
    names = b""
    while not names:
        for messages in agent.get_new_notifs().values():
            names = next((m for m in messages if m != b"done"), names)
    count = held_prefix(tree, np.frombuffer(names, dtype=np.uint8).reshape(-1, 32))
    addresses = np.arange(count, dtype=np.uint64) * np.uint64(size) + np.uint64(base)
    agent.send_notif(client, addresses.tobytes())
    done = False
    while not done:
        done = any(b"done" in messages for messages in agent.get_new_notifs().values())


def say(**message: Any) -> None:
    print(json.dumps(message), flush=True)


# ---------------------------------------------------------------------------- pulling process

class Server:
    def __init__(self, max_bytes: int, busy: bool, mode: str, spin: bool = False) -> None:
        argv = [sys.executable, "-u", __file__, "--serve", str(max_bytes), "--mode", mode] + (
            ["--raw-busy-poll"] if busy else []) + (["--spin"] if spin else [])
        self.proc = subprocess.Popen(argv,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]

    def read(self, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            if not self.selector.select(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the serving process said nothing in {timeout} s")
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise EOFError(f"the serving process exited with {self.proc.wait()}")
            if line.startswith("{"):
                return json.loads(line)

    def send(self, **command: Any) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def ask(self, **command: Any) -> dict[str, Any]:
        self.send(**command)
        return self.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask(do="quit")
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
                self.proc.wait(30)
        self.selector.close()


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": KIB, "M": MIB}.get(text[-1], 1)
    return int(text.rstrip("KM")) * scale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256, help="rows (blocks) per pull")
    parser.add_argument("--runs", type=int, default=7, help="timed pairs per row size")
    parser.add_argument("--sizes", default="64K,256K,1M,4M", help="row sizes")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--window-bytes", type=int, default=None, help="kvwire-ucx window_bytes option")
    parser.add_argument("--raw-busy-poll", action="store_true",
                        help="raw ends spin on progress() instead of sleeping on the epoll fd (slower on few cores)")
    parser.add_argument("--mode", choices=("two-sided", "one-sided"), default="two-sided",
                        help="kvwire-ucx mode; one-sided compares against a raw NIXL agent pair")
    parser.add_argument("--prompts", default="1k,4k,16k,64k,128k", help="one-sided: prompt lengths in tokens")
    parser.add_argument("--token-bytes", type=int, default=4096, help="one-sided: KV bytes per token")
    parser.add_argument("--spin", action="store_true",
                        help="one-sided: kvwire's ends poll as the raw pair does (both progress threads with spin_us, "
                             "the caller and the serving holder looking without sleeping): the same work as the raw pair")
    parser.add_argument("--trace", action="store_true",
                        help="one-sided: also print where a pull's time goes, step by step, across both processes")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.raw_busy_poll, args.mode, args.spin)
        return 0
    if args.mode == "one-sided":
        return main_one_sided(args)

    from kvwire_ucx._ucx import Array, ucx_api

    from kvwire.contract import MemoryKind, SlotRegion
    from kvwire.registry import load

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    max_bytes = max(sizes) * args.rows
    expected = pattern(max_bytes)
    memory = np.zeros(max_bytes, dtype=np.uint8)
    server = Server(max_bytes, args.raw_busy_poll, "two-sided")
    results = []
    try:
        hello = server.read()
        address = bytes.fromhex(hello["kvwire"])
        options: dict[str, Any] = {"timeout_s": 60.0}
        if args.window_bytes:
            options["window_bytes"] = args.window_bytes
        backend = load("ucx").build(options)
        _context, worker = ucx_worker()
        server.ask(do="peer", raw=bytes(worker.address).hex())
        raw_ep = ucx_api.UCXEndpoint.create_from_worker_address(
            worker, ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(hello["raw"])), True)
        woken = threading.Event()

        def run_kvwire(size: int, region: SlotRegion, names: np.ndarray) -> float:
            return pull(backend, view_of(region, args.rows, names), address, woken)

        def run_raw(size: int) -> float:
            server.send(do="raw", size=size, rows=args.rows)
            assert server.read().get("ready")
            go = np.ones(1, dtype=np.uint64)
            started = time.perf_counter()
            buffers = [Array(memory[i * size:(i + 1) * size]) for i in range(args.rows)]
            receives = [worker.tag_recv(b, ucx_api.UCXXTag(RAW_TAG | i)) for i, b in enumerate(buffers)]
            kick = raw_ep.tag_send(Array(go), ucx_api.UCXXTag(GO_TAG))
            wait_all(worker, [kick, *receives], args.raw_busy_poll)
            seconds = time.perf_counter() - started
            for r in receives:
                r.check_error()
            del buffers
            assert server.read().get("sent") == args.rows
            return seconds

        def timed(run: Callable[[], float], nbytes: int) -> float:
            return checked(run, memory, expected, nbytes)

        wait = "busy polling" if args.raw_busy_poll else "epoll wake-ups"
        print(f"kvwire-ucx vs raw ucxx tag send/recv; {args.rows} rows per pull, two processes on loopback, "
              f"endpoint error handling on, raw with {wait}, {args.runs} runs (medians)")
        print(f"{'row size':>9} {'payload':>9} {'kvwire GB/s':>12} {'raw GB/s':>9} {'ratio':>6}")
        for size in sizes:
            nbytes = size * args.rows
            assert server.ask(do="size", size=size, rows=args.rows).get("ok")
            region = SlotRegion(2, memory.ctypes.data, size, args.rows, MemoryKind.HOST)
            registration = backend.register_regions([region])
            names = block_names(args.rows)
            kv: list[float] = []
            raw: list[float] = []
            timed(lambda: run_kvwire(size, region, names), nbytes)  # noqa: B023 - warm-up
            timed(lambda: run_raw(size), nbytes)  # noqa: B023
            for i in range(args.runs):
                pair = [("kv", lambda: run_kvwire(size, region, names)), ("raw", lambda: run_raw(size))]  # noqa: B023
                for which, run in (pair if i % 2 == 0 else pair[::-1]):
                    (kv if which == "kv" else raw).append(timed(run, nbytes))
            registration.close()
            ratio = statistics.median(r / k for r, k in zip(raw, kv, strict=True))
            kv_rate = nbytes / statistics.median(kv) / 1e9
            raw_rate = nbytes / statistics.median(raw) / 1e9
            results.append({"row_bytes": size, "rows": args.rows, "payload_bytes": nbytes, "kvwire_gbps": kv_rate,
                            "raw_gbps": raw_rate, "ratio": ratio, "kvwire_s": kv, "raw_s": raw})
            print(f"{size // KIB:>6} KiB {nbytes / MIB:>5.0f} MiB {kv_rate:>12.2f} {raw_rate:>9.2f} {ratio:>6.2f}",
                  flush=True)
        raw_ep.close_blocking()
        close(backend)
    finally:
        server.stop()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": platform.node(), "cpus": os.cpu_count(), "results": results}, fh, indent=1)
    return 0


def main_one_sided(args: argparse.Namespace) -> int:
    from kvwire.contract import MemoryKind, SlotRegion
    from kvwire.registry import load

    row = 16 * args.token_bytes
    cases = [(row, parse_size(p.upper().replace("K", "")) * (1024 if "k" in p.lower() else 1) // 16)
             for p in args.prompts.split(",")]
    max_bytes = max(size * rows for size, rows in cases)
    expected = pattern(max_bytes)
    memory = np.zeros(max_bytes, dtype=np.uint8)
    server = Server(max_bytes, False, "one-sided", args.spin)
    results = []
    try:
        hello = server.read()
        address = bytes.fromhex(hello["kvwire"])
        options: dict[str, Any] = {"timeout_s": 60.0, "mode": "one-sided", "spin_us": SPIN_US if args.spin else 0}
        if args.window_bytes:
            options["window_bytes"] = args.window_bytes
        backend = load("ucx").build(options)
        agent = raw_nixl_agent("raw-client", memory)
        peer = agent.add_remote_agent(bytes.fromhex(hello["nixl"]))
        base = int(hello["base"])
        woken = threading.Event()

        timelines: list[dict[str, float]] = []
        offer_timelines: list[dict[str, float]] = []
        traces: list[tuple[int, dict[str, list[float]]]] = []
        offer_traces: list[tuple[int, dict[str, list[float]]]] = []
        pushed_traces: list[tuple[int, dict[str, list[float]]]] = []

        def run_kvwire(view: Any) -> float:
            return pull(backend, view, address, woken, timelines, args.spin)

        def run_offered(view: Any) -> float:
            """The same pull, answered from a standing offer (O1) the serving holder made of
            every held block before the clock started, and withdrew after it stopped."""
            received = getattr(backend.stats(), "pushes_received", None)  # None: a kvwire-ucx without pushes
            assert server.ask(do="offer", on=True).get("ok")
            try:
                if received is not None:  # the offer is pushed to this end: wait for it, off the clock
                    deadline = time.monotonic() + 10
                    while backend.stats().pushes_received == received:
                        assert time.monotonic() < deadline, "the standing offer was never pushed to this end"
                        time.sleep(0.0005)
                return pull(backend, view, address, woken, offer_timelines, args.spin)
            finally:
                assert server.ask(do="offer", on=False).get("ok")

        def read(size: int, local_rows: np.ndarray, remote_rows: np.ndarray, done: bytes) -> float:
            """One NIXL READ, a descriptor of ``size`` bytes per row, until it is ``DONE``; the
            clock's reading then (before the handle is released)."""
            local = np.zeros((len(local_rows), 3), dtype=np.uint64)
            remote = np.zeros((len(remote_rows), 3), dtype=np.uint64)
            local[:, 0], remote[:, 0] = local_rows, remote_rows
            local[:, 1] = remote[:, 1] = size
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs(remote, "DRAM"), peer, done)
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            ended = time.perf_counter()
            agent.release_xfer_handle(handle)
            assert state == "DONE", state
            return ended

        def rows_at(start: int, size: int, rows: int) -> np.ndarray:
            return np.arange(rows, dtype=np.uint64) * np.uint64(size) + np.uint64(start)

        def run_raw(size: int, rows: int) -> float:
            assert server.ask(do="poll").get("ok")
            try:
                return raw_read(size, rows)
            finally:
                assert server.ask(do="unpoll").get("ok")

        def raw_read(size: int, rows: int) -> float:
            started = time.perf_counter()
            if size < 0:  # one descriptor for the whole span
                size, rows = -size * rows, 1
            return read(size, rows_at(memory.ctypes.data, size, rows), rows_at(base, size, rows), b"") - started

        def run_raw_ask(size: int, names: bytes) -> float:
            """The raw protocol pair: the names in a notification, the addresses back in one, the
            READ (one descriptor per row, as "raw") carrying the "done" notification."""
            assert server.ask(do="raw-ask", size=size).get("ready")
            started = time.perf_counter()
            agent.send_notif(peer, names)
            answer = b""
            while not answer:
                for messages in agent.get_new_notifs().values():
                    answer = messages[0] if messages else answer
            remote_rows = np.frombuffer(answer, dtype=np.uint64)
            seconds = read(size, rows_at(memory.ctypes.data, size, len(remote_rows)), remote_rows, b"done") - started
            assert server.read().get("answered")
            return seconds

        def timed(run: Callable[[], float], nbytes: int) -> float:
            return checked(run, memory, expected, nbytes)

        raw_read(1, 1)  # wires the raw pair up while the serving process progresses its agent
        # then the serving agent learns this one, for its answers, and wires that way up with a
        # first notification (told before the READ above, it left that READ in PROC)
        assert server.ask(do="nixl-peer", nixl=agent.get_agent_metadata().hex()).get("ok")
        while not any(b"hello" in m for m in agent.get_new_notifs().values()):
            pass
        assert server.ask(do="unpoll").get("ok")
        print(f"kvwire-ucx one-sided vs a raw NIXL agent pair (READ); two processes on loopback; "
              f"{args.token_bytes} B per token, 16-token blocks; {args.runs} runs (medians)"
              + ("; kvwire's ends spin (--spin)" if args.spin else "; kvwire's ends sleep until woken"))
        print("  answer ms: kvwire's request until its answer arrived (the round trip, the serving holder's lookup")
        print("  included); read ms: the answer until the pull concluded (the NIXL READs); raw 1 ms: raw 1's whole read;")
        print("  ask ms: the raw protocol pair (names in a notification, addresses back in one, READ, done), whole;")
        print("  offered ms: kvwire's pull answered from a standing offer (O1: no serving holder in the path), whole,")
        print("  with its ratios: ask / offered, raw 1 / offered")
        print(f"{'tokens':>7} {'payload':>9} {'kvwire GB/s':>12} {'tokens/s':>10} {'raw GB/s':>9} {'ratio':>6} "
              f"{'worst':>6} {'raw 1 GB/s':>11} {'ratio':>6} {'answer ms':>10} {'read ms':>8} {'raw 1 ms':>9} "
              f"{'kvwire ms':>9} {'ask ms':>7} {'ratio':>6} {'offered ms':>10} {'vs ask':>6} {'vs raw 1':>8}")
        region_id = 2
        for size, rows in cases:
            nbytes = size * rows
            assert server.ask(do="size", size=size, rows=rows).get("ok")
            region = SlotRegion(region_id, memory.ctypes.data, size, rows, MemoryKind.HOST)
            region_id += 1
            registration = backend.register_regions([region])
            view = view_of(region, rows, block_names(rows))
            times: dict[str, list[float]] = {"kv": [], "raw": [], "raw1": [], "ask": [], "offered": []}
            names = block_names(rows).tobytes()
            runs = {"kv": lambda: run_kvwire(view), "raw": lambda: run_raw(size, rows),  # noqa: B023
                    "raw1": lambda: run_raw(-size, rows),  # noqa: B023
                    "ask": lambda: run_raw_ask(size, names),  # noqa: B023
                    "offered": lambda: run_offered(view)}  # noqa: B023
            kvwire_runs = ("kv", "offered")
            for run in runs.values():
                timed(run, nbytes)  # warm-up
            timelines.clear()
            offer_timelines.clear()
            if args.spin:
                time.sleep(SPIN_US / 1e6 + 0.2)  # the warm-up's spin runs out
                # The raw runs first, then kvwire's with its ends spinning, then a pause until
                # the progress threads' spin has run out: no spinning thread of kvwire takes
                # turns at a process's GIL while the raw pair runs.
                for i in range(args.runs):
                    order = [w for w in runs if w not in kvwire_runs]
                    for which in (order if i % 2 == 0 else order[::-1]):
                        times[which].append(timed(runs[which], nbytes))
                assert server.ask(do="spin", on=True).get("ok")
                for i in range(args.runs):
                    for which in (kvwire_runs if i % 2 == 0 else kvwire_runs[::-1]):
                        times[which].append(timed(runs[which], nbytes))
                assert server.ask(do="spin", on=False).get("ok")
                time.sleep(SPIN_US / 1e6 + 0.2)
            else:
                for i in range(args.runs):
                    order = list(runs) if i % 2 == 0 else list(runs)[::-1]
                    for which in order:
                        times[which].append(timed(runs[which], nbytes))
            registration.close()
            if args.trace:
                traces.append((rows * 16, trace_steps(timelines, server.ask(do="served")["served"])))
                offer_traces.append((rows * 16, requester_steps(offer_timelines)))
                pushed_traces.append((rows * 16, requester_steps(offer_timelines, pushed=True)))
            kv, raw, raw1, ask, offer = times["kv"], times["raw"], times["raw1"], times["ask"], times["offered"]
            ratios = [r / k for r, k in zip(raw, kv, strict=True)]
            ratios1 = [r / k for r, k in zip(raw1, kv, strict=True)]
            ratios_ask = [r / k for r, k in zip(ask, kv, strict=True)]
            offer_ask = statistics.median(r / k for r, k in zip(ask, offer, strict=True))
            offer_raw1 = statistics.median(r / k for r, k in zip(raw1, offer, strict=True))
            kv_rate = nbytes / statistics.median(kv) / 1e9
            raw_rate = nbytes / statistics.median(raw) / 1e9
            tokens = rows * 16
            answer_ms = statistics.median(t["answered"] for t in timelines) * 1e3
            read_ms = statistics.median(t["concluded"] - t["answered"] for t in timelines) * 1e3
            results.append({"tokens": tokens, "row_bytes": size, "rows": rows, "payload_bytes": nbytes,
                            "kvwire_gbps": kv_rate, "kvwire_tokens_per_s": tokens / statistics.median(kv),
                            "raw_gbps": raw_rate, "ratio": statistics.median(ratios), "worst": min(ratios),
                            "raw1_gbps": nbytes / statistics.median(raw1) / 1e9,
                            "ratio1": statistics.median(ratios1), "answer_ms": answer_ms, "read_ms": read_ms,
                            "ask_ms": statistics.median(ask) * 1e3, "ratio_ask": statistics.median(ratios_ask),
                            "offered_ms": statistics.median(offer) * 1e3, "offered_ratio_ask": offer_ask,
                            "offered_ratio_raw1": offer_raw1,
                            "kvwire_s": kv, "raw_s": raw, "raw1_s": raw1, "ask_s": ask, "offered_s": offer})
            print(f"{tokens:>7} {nbytes / MIB:>5.0f} MiB {kv_rate:>12.2f} {tokens / statistics.median(kv):>10.3g} "
                  f"{raw_rate:>9.2f} {statistics.median(ratios):>6.2f} {min(ratios):>6.2f} "
                  f"{nbytes / statistics.median(raw1) / 1e9:>11.2f} {statistics.median(ratios1):>6.2f} "
                  f"{answer_ms:>10.2f} {read_ms:>8.2f} {statistics.median(raw1) * 1e3:>9.2f} "
                  f"{statistics.median(kv) * 1e3:>9.2f} {statistics.median(ask) * 1e3:>7.2f} "
                  f"{statistics.median(ratios_ask):>6.2f} {statistics.median(offer) * 1e3:>10.2f} {offer_ask:>6.2f} "
                  f"{offer_raw1:>8.2f}", flush=True)
        agent.remove_remote_agent(peer)
        close(backend)
    finally:
        server.stop()
    if traces:
        print_trace(traces)
        if any(s[OFFER_STEPS[0]] for _, s in offer_traces):
            print_trace(offer_traces, OFFER_STEPS, "a pull answered from a standing offer (the requester's marks only)")
        if any(s[PUSHED_STEPS[0]] for _, s in pushed_traces):
            print_trace(pushed_traces, PUSHED_STEPS, "a pull read from a standing offer pushed to the requester "
                        "(no Pull; the requester's marks only)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": platform.node(), "cpus": os.cpu_count(), "mode": "one-sided",
                       "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
