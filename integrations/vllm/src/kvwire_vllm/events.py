"""What the connector's store holds, told to routers as vLLM's KV events (``BlockStored`` /
``BlockRemoved`` with the medium ``kvwire:<backend>``), through vLLM's own event path: the
scheduler side hands them to vLLM from ``take_events`` and vLLM's publisher (ZMQ, with
``kv_events_config``) sends them with the engine's own.

What is announced, and the bound on what is withdrawn:

- ``BlockStored`` once the worker reported the block's save held in every group (after its
  attempt concluded and quiesced), never at submission: a save that fails announces nothing.
- ``BlockRemoved`` for a block this engine announced when this engine next finds the store
  lacking it: a lookup that answers "not held", or a load that did not get it. A store evicts on
  its own (files' LRU, Mooncake's) and tells nobody, so a router may believe a block is held
  until then; its pull or routed request then misses, and that miss is what it is today: the
  block is recomputed, never a failed request.

The bookkeeping here imports no vLLM; :func:`to_vllm` turns records into vLLM's event classes
in the engine. Both tables are bounded (oldest first out)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BlockInfo", "Stored", "Removed", "StoreEvents", "to_vllm", "medium_of"]

#: At most this many blocks are remembered as announced, and as saving (awaiting the worker's
#: report), by default; beyond that the oldest are forgotten (never withdrawn).
DEFAULT_CAP = 1 << 18


def medium_of(backend: str) -> str:
    """The ``medium`` of this connector's events: where the blocks are, ``kvwire:<backend>``."""
    return f"kvwire:{backend}"


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One whole block as vLLM's ``BlockStored`` describes it, snapshotted while its request
    lives: vLLM's block hash (bytes), its parent's (``None`` for a prompt's first block), its
    tokens, the extra keys vLLM hashed it with, and its LoRA adapter."""

    block_hash: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None = None
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class Stored:
    """A run of blocks, each the parent of the next, now held by the store."""

    blocks: tuple[BlockInfo, ...]


@dataclass(frozen=True, slots=True)
class Removed:
    """Blocks (their vLLM hashes) the store was found no longer to hold."""

    hashes: tuple[bytes, ...]


class StoreEvents:
    """The scheduler side's record of saves on their way (kvwire name -> block), of the blocks
    it announced (kvwire name -> vLLM hash), and of the records not yet taken."""

    def __init__(self, cap: int = DEFAULT_CAP) -> None:
        self.cap = int(cap)
        self._saving: dict[bytes, BlockInfo] = {}
        self._announced: dict[bytes, bytes] = {}
        self._records: list[Stored | Removed] = []

    def saving(self, names: Sequence[bytes], blocks: Sequence[BlockInfo]) -> None:
        """Blocks a save was planned for, under their kvwire names (announced once reported held)."""
        for name, block in zip(names, blocks, strict=True):
            self._saving.pop(name, None)
            self._saving[name] = block
        _trim(self._saving, self.cap)

    def saved(self, names: Iterable[bytes]) -> None:
        """The worker reports these names held by the store: announce each not yet announced, in
        runs of blocks that chain (each the parent of the next)."""
        run: list[BlockInfo] = []
        for name in names:
            block = self._saving.pop(name, None)
            if block is None or name in self._announced:
                continue
            self._announced[name] = block.block_hash
            if run and block.parent != run[-1].block_hash:
                self._records.append(Stored(tuple(run)))
                run = []
            run.append(block)
        if run:
            self._records.append(Stored(tuple(run)))
        _trim(self._announced, self.cap)

    def missing(self, names: Iterable[bytes]) -> None:
        """The store was found lacking these names (a lookup, a load): withdraw those announced."""
        gone = tuple(h for h in (self._announced.pop(n, None) for n in names) if h is not None)
        if gone:
            self._records.append(Removed(gone))

    @property
    def announced(self) -> int:
        return len(self._announced)

    def take(self) -> list[Stored | Removed]:
        records, self._records = self._records, []
        return records


def _trim(table: dict[bytes, Any], cap: int) -> None:
    while len(table) > cap:
        del table[next(iter(table))]


def block_infos(request: Any, first: int, end: int, block_size: int) -> list[BlockInfo]:
    """vLLM's description of a request's whole blocks ``[first, end)`` (its hashes, tokens, extra
    keys and LoRA), as vLLM's block pool puts it in its own ``BlockStored``."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    hashes = request.block_hashes
    tokens = request.all_token_ids
    lora = getattr(request, "lora_request", None)
    out = []
    for i in range(first, end):
        start = i * block_size
        extra, _ = generate_block_hash_extra_keys(request, start, start + block_size, 0)
        out.append(BlockInfo(bytes(hashes[i]), bytes(hashes[i - 1]) if i > 0 else None,
                             tuple(int(t) for t in tokens[start:start + block_size]), extra,
                             lora.adapter_id if lora is not None else None, lora.name if lora is not None else None))
    return out


def to_vllm(records: Iterable[Stored | Removed], medium: str, block_size: int) -> list[Any]:
    """vLLM's ``BlockStored`` / ``BlockRemoved`` events for ``records`` (hashes as vLLM
    publishes its own: bytes, or 64-bit ints with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, to_event_extra_keys

    events: list[Any] = []
    for record in records:
        if isinstance(record, Removed):
            events.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(h) for h in record.hashes],  # type: ignore[arg-type]
                                       medium=medium, group_idx=0))
            continue
        head = record.blocks[0]
        events.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(b.block_hash) for b in record.blocks],  # type: ignore[arg-type]
            parent_block_hash=maybe_convert_block_hash(head.parent) if head.parent is not None else None,  # type: ignore[arg-type]
            token_ids=[t for b in record.blocks for t in b.token_ids], block_size=block_size,
            lora_id=head.lora_id, medium=medium, lora_name=head.lora_name,
            extra_keys=to_event_extra_keys([b.extra_keys for b in record.blocks]), group_idx=0))
    return events
