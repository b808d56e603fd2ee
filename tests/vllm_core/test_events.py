"""The scheduler side's KV-event bookkeeping (:mod:`kvwire_vllm.events`), without vLLM: a block
is announced once its save is reported held, in runs that chain, and withdrawn only once this
engine found the store lacking a block it announced."""

from __future__ import annotations

from kvwire_vllm.events import BlockInfo, Removed, Stored, StoreEvents, medium_of


def chain(prefix: bytes, count: int, first: int = 0) -> tuple[list[bytes], list[BlockInfo]]:
    """kvwire names and vLLM's descriptions of blocks ``first..first+count`` of one prompt."""
    names = [prefix + b"n%02d" % i for i in range(first, first + count)]
    blocks = [BlockInfo(prefix + b"h%02d" % i, prefix + b"h%02d" % (i - 1) if i else None, (i,) * 4)
              for i in range(first, first + count)]
    return names, blocks


def test_blocks_are_announced_once_reported_held_in_runs_that_chain() -> None:
    events = StoreEvents()
    names, blocks = chain(b"a", 4)
    other_names, other_blocks = chain(b"b", 2)
    events.saving(names, blocks)
    events.saving(other_names, other_blocks)
    assert events.take() == []  # planned, not yet held: nothing announced
    events.saved([names[0], names[1], names[3], *other_names])  # block 2's save did not hold it
    assert events.take() == [Stored(tuple(blocks[:2])), Stored((blocks[3],)), Stored(tuple(other_blocks))]
    events.saved([*names, *other_names])  # reported again (another worker's shard): only block 2 is new
    assert events.take() == [Stored((blocks[2],))]
    events.saved(names)
    assert events.take() == []
    assert events.announced == 6


def test_only_announced_blocks_found_missing_are_removed() -> None:
    events = StoreEvents()
    names, blocks = chain(b"a", 3)
    events.saving(names, blocks)
    events.saved(names)
    events.take()
    events.missing([names[1], b"never-announced!"])
    assert events.take() == [Removed((blocks[1].block_hash,))]
    events.missing([names[1]])  # withdrawn once
    assert events.take() == []
    events.saving(names[1:2], blocks[1:2])  # recomputed and saved again: announced again
    events.saved(names[1:2])
    assert events.take() == [Stored((blocks[1],))]


def test_the_tables_are_bounded() -> None:
    events = StoreEvents(cap=4)
    names, blocks = chain(b"a", 10)
    events.saving(names, blocks)
    events.saved(names)  # only the last 4 planned are remembered
    (stored,) = events.take()
    assert stored == Stored(tuple(blocks[6:]))
    assert events.announced == 4
    assert medium_of("files") == "kvwire:files"
