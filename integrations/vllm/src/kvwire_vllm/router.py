"""A prefix-aware router's core (issue 38): an index of which engine holds which leading blocks of
a prompt, fed by the KV events engines publish (vLLM's own prefix cache and kvwire's store, each by
its ``medium``), and the choice for a request: the engine holding the longest prefix, or a less
loaded engine that pulls that prefix from it first (the seed's request-free pull: the request
carries the holder's transceiver state as ``kv_transfer_params["kvwire_source"]``).

:class:`PrefixIndex` and :func:`choose` do no I/O (events in, a :class:`Route` out), so every
ordering is a plain unit test; :class:`EventFeed` is the thin loop that subscribes to an engine's
ZMQ publisher (pyzmq) and applies what it decodes (msgpack, as vLLM's ``KVEventBatch`` encodes:
``[ts, [event, ...], dp_rank]``, each event a map with its ``type``).

The index keys a block by its parent's hash, its tokens and its extra keys, as the events carry
them, so the router needs neither vLLM nor the engines' hash seed; a request is matched by walking
those keys from the prompt's first block. Requests whose blocks carry extra keys (a cache salt,
LoRA, multimodal inputs) are matched against nothing and routed by load alone. A block a store
evicted stays in the index until the engine that announced it finds it missing (see the
connector's README): a route to it is then a miss that the engine recomputes."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = ["PrefixIndex", "Route", "choose", "EventFeed", "decode_batch", "STORE_PREFIX"]

log = logging.getLogger(__name__)

#: The medium of kvwire's store events (``kvwire:<backend>``); vLLM's ``AllBlocksCleared`` (a
#: reset of an engine's own prefix cache) leaves blocks of these media held.
STORE_PREFIX = "kvwire:"
#: Blocks remembered per engine by default; beyond that the oldest are forgotten.
DEFAULT_CAP = 1 << 20

_Key = tuple[Any, tuple[int, ...]]


def decode_batch(payload: bytes) -> list[dict[str, Any]]:
    """The events of one published message (vLLM's ``KVEventBatch``, msgpack), as maps with a
    ``type``; ``ValueError`` for anything else."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ValueError(f"not a KV event batch: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list) or \
            not all(isinstance(e, dict) and "type" in e for e in batch[1]):
        raise ValueError("not a KV event batch: expected [ts, [{'type': ...}, ...], ...]")
    return list(batch[1])


class _Engine:
    """What one engine holds: block hash -> media holding it, and the key each hash is found by."""

    def __init__(self) -> None:
        self.media: dict[Any, set[str]] = {}
        self.by_key: dict[_Key, Any] = {}
        self.key_of: dict[Any, _Key] = {}

    def forget(self, block_hash: Any) -> None:
        self.media.pop(block_hash, None)
        key = self.key_of.pop(block_hash, None)
        if key is not None and self.by_key.get(key) == block_hash:
            del self.by_key[key]


class PrefixIndex:
    """Which engine holds which blocks, from their KV events (:meth:`apply`), and how many leading
    whole blocks of a prompt each holds (:meth:`held`). Not thread-safe: one feed thread per
    engine applies under :attr:`lock`, and readers take it too."""

    def __init__(self, block_size: int, cap: int = DEFAULT_CAP) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = int(block_size)
        self.cap = int(cap)
        self.lock = threading.Lock()
        self._engines: dict[str, _Engine] = {}

    @property
    def engines(self) -> list[str]:
        return list(self._engines)

    def add_engine(self, engine: str) -> None:
        self._engines.setdefault(engine, _Engine())

    def apply(self, engine: str, events: Iterable[Mapping[str, Any]]) -> None:
        """Apply ``engine``'s events in order (``BlockStored``, ``BlockRemoved``,
        ``AllBlocksCleared``; others are ignored)."""
        state = self._engines.setdefault(engine, _Engine())
        for event in events:
            kind = event.get("type")
            if kind == "BlockStored":
                self._stored(state, event)
            elif kind == "BlockRemoved":
                medium = str(event.get("medium"))
                for block_hash in event.get("block_hashes") or ():
                    media = state.media.get(block_hash)
                    if media is not None:
                        media.discard(medium)
                        if not media:
                            state.forget(block_hash)
            elif kind == "AllBlocksCleared":  # the engine's own prefix cache was reset
                for block_hash, media in list(state.media.items()):
                    media.intersection_update({m for m in media if m.startswith(STORE_PREFIX)})
                    if not media:
                        state.forget(block_hash)
        while len(state.media) > self.cap:
            state.forget(next(iter(state.media)))

    def _stored(self, state: _Engine, event: Mapping[str, Any]) -> None:
        hashes = list(event.get("block_hashes") or ())
        tokens = list(event.get("token_ids") or ())
        size = int(event.get("block_size") or 0)
        if size != self.block_size or len(tokens) != size * len(hashes):
            return  # another granularity (or a partial block): not indexable by whole blocks
        extra = event.get("extra_keys") or [None] * len(hashes)
        medium = str(event.get("medium"))
        parent = event.get("parent_block_hash")
        for i, block_hash in enumerate(hashes):
            key: _Key = (parent, tuple(tokens[i * size:(i + 1) * size]))
            if extra[i] is None:  # blocks with extra keys are never matched (see the module's text)
                state.by_key[key] = block_hash
                state.key_of[block_hash] = key
            media = state.media.pop(block_hash, set())  # re-inserted last: the oldest go first
            media.add(medium)
            state.media[block_hash] = media
            parent = block_hash

    def held(self, engine: str, tokens: Sequence[int]) -> int:
        """How many leading whole blocks of ``tokens`` ``engine`` holds in any medium."""
        state = self._engines.get(engine)
        if state is None:
            return 0
        size, parent, count = self.block_size, None, 0
        for start in range(0, len(tokens) - size + 1, size):
            block_hash = state.by_key.get((parent, tuple(int(t) for t in tokens[start:start + size])))
            if block_hash is None or not state.media.get(block_hash):
                break
            parent, count = block_hash, count + 1
        return count


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: ``engine``, which holds ``blocks`` leading blocks of it, or, with
    ``pull_from``, which pulls those blocks from that engine first (its transceiver state in the
    request's ``kv_transfer_params["kvwire_source"]``)."""

    engine: str
    blocks: int
    pull_from: str | None = None


def choose(index: PrefixIndex, tokens: Sequence[int], load: Mapping[str, int], *, can_pull: bool = False,
           max_imbalance: int = 4, min_pull_blocks: int = 4) -> Route:
    """The route of a request for ``tokens``, given each engine's ``load`` (requests in flight):
    the engine holding the longest prefix (the least loaded among equals); but when that engine
    has more than ``max_imbalance`` requests more than the least loaded one and the prefix is at
    least ``min_pull_blocks`` long, the least loaded one with ``pull_from`` set (``can_pull``: the
    engines serve pulls, kvwire-ucx). No engine holding anything: the least loaded."""
    if not load:
        raise ValueError("no engine to route to")
    with index.lock:
        held = {engine: index.held(engine, tokens) for engine in load}
    best = min(load, key=lambda e: (-held[e], load[e], e))
    least = min(load, key=lambda e: (load[e], -held[e], e))
    if held[best] == 0:
        return Route(least, 0)
    if can_pull and load[best] - load[least] > max_imbalance and held[best] - held[least] >= min_pull_blocks:
        return Route(least, held[best], pull_from=best)
    return Route(best, held[best])


class EventFeed:
    """Subscribes to one engine's KV event publisher (``endpoint``, e.g. ``tcp://host:5557`` where
    the engine's ``kv_events_config`` binds ``tcp://*:5557``) on a thread of its own and applies
    each batch to ``index`` under ``engine``'s name until :meth:`close`. ``on_batch`` (optional)
    is called after each batch (tests, metrics). A message that does not decode is logged and
    skipped; a gap in sequence numbers (ZMQ drops when a subscriber is slow) is counted in
    :attr:`gaps`."""

    def __init__(self, index: PrefixIndex, engine: str, endpoint: str, topic: str = "",
                 on_batch: Callable[[str], None] | None = None) -> None:
        try:
            import zmq
        except ImportError:
            raise ImportError("kvwire_vllm.router.EventFeed needs pyzmq (pip install pyzmq; vLLM installs it)") \
                from None
        self.index, self.engine, self.endpoint = index, engine, endpoint
        self.on_batch = on_batch
        self.gaps = 0
        self.batches = 0
        self._last_seq: int | None = None
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.connect(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        index.add_engine(engine)
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{engine}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            frames = self._sub.recv_multipart()
            if len(frames) != 3:
                log.warning("engine %s: a KV event message of %d frames, expected 3; skipped", self.engine,
                            len(frames))
                continue
            _topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if self._last_seq is not None and seq > self._last_seq + 1:
                self.gaps += seq - self._last_seq - 1
            self._last_seq = seq
            try:
                events = decode_batch(payload)
            except ValueError as exc:
                log.warning("engine %s: %s; skipped", self.engine, exc)
                continue
            with self.index.lock:
                self.index.apply(self.engine, events)
            self.batches += 1
            if self.on_batch is not None:
                self.on_batch(self.engine)

    def close(self) -> None:
        """Stop the thread and close the socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=10)
        self._sub.close(linger=0)
        self._ctx.term()
