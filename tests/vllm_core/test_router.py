"""The prefix-aware router's core (:mod:`kvwire_vllm.router`), without engines: the index follows
stores, removals and prefix-cache resets per engine and medium, and a request goes to the engine
holding its longest prefix, or to a less loaded one that pulls it."""

from __future__ import annotations

import msgpack
import pytest
from kvwire_vllm.router import PrefixIndex, Route, choose, decode_batch

B = 4  # tokens per block


def stored(tokens: list[int], first: int, count: int, medium: str, salt: str = "") -> dict:
    """vLLM's BlockStored of blocks ``first..first+count`` of ``tokens`` (hashes derived from the
    tokens before them, as vLLM's chain is; a salt gives other hashes and extra keys)."""
    def h(i: int) -> bytes:
        return (salt + ",".join(map(str, tokens[: (i + 1) * B]))).encode()

    event = {"type": "BlockStored", "block_hashes": [h(i) for i in range(first, first + count)],
             "parent_block_hash": h(first - 1) if first else None, "token_ids": tokens[first * B:(first + count) * B],
             "block_size": B, "lora_id": None, "medium": medium, "lora_name": None}
    if salt:
        event["extra_keys"] = [(salt,)] + [None] * (count - 1) if first == 0 else [None] * count
    return event


P = list(range(100, 100 + 5 * B + 2))   # 5 whole blocks and 2 tokens
Q = P[:B] + list(range(500, 500 + 3 * B))  # shares P's first block only


def test_the_index_follows_each_engines_stores_removals_and_resets() -> None:
    index = PrefixIndex(B)
    index.apply("e1", [stored(P, 0, 2, "GPU"), stored(P, 2, 3, "GPU")])  # two events chain
    index.apply("e2", [stored(P, 0, 3, "kvwire:files")])
    assert (index.held("e1", P), index.held("e2", P), index.held("e3", P)) == (5, 3, 0)
    assert index.held("e1", Q) == 1 and index.held("e1", P[: 3 * B + 1]) == 3
    h = stored(P, 0, 5, "GPU")["block_hashes"]
    index.apply("e1", [{"type": "BlockRemoved", "block_hashes": [h[2]], "medium": "GPU"}])
    assert index.held("e1", P) == 2  # the prefix stops at the first block not held
    index.apply("e1", [{"type": "BlockRemoved", "block_hashes": [h[0]], "medium": "kvwire:files"}])
    assert index.held("e1", P) == 2  # held in GPU still: another medium's removal changes nothing
    index.apply("e2", [stored(P, 0, 2, "GPU"), {"type": "AllBlocksCleared"}])
    assert index.held("e2", P) == 3  # a reset of e2's own cache leaves what its store holds
    index.apply("e1", [{"type": "AllBlocksCleared"}])
    assert index.held("e1", P) == 0


def test_blocks_of_other_sizes_or_with_extra_keys_are_never_matched() -> None:
    index = PrefixIndex(B)
    index.apply("e1", [{**stored(P, 0, 2, "GPU"), "block_size": 2 * B}, stored(P, 0, 2, "GPU", salt="tenant-a")])
    assert index.held("e1", P) == 0


def test_a_request_goes_to_the_longest_prefix_or_pulls_it_to_a_less_loaded_engine() -> None:
    index = PrefixIndex(B)
    index.apply("e1", [stored(P, 0, 5, "GPU")])
    index.apply("e2", [stored(P, 0, 1, "GPU")])
    assert choose(index, P, {"e1": 3, "e2": 0, "e3": 0}) == Route("e1", 5)
    assert choose(index, P, {"e1": 9, "e2": 0, "e3": 1}) == Route("e1", 5)  # no pulls: stays
    assert choose(index, P, {"e1": 9, "e2": 1, "e3": 0}, can_pull=True) == Route("e3", 5, pull_from="e1")
    assert choose(index, P, {"e1": 4, "e2": 0, "e3": 0}, can_pull=True) == Route("e1", 5)  # within the imbalance
    assert choose(index, list(range(900, 920)), {"e1": 0, "e2": 2, "e3": 1}) == Route("e1", 0)
    with pytest.raises(ValueError, match="no engine"):
        choose(index, P, {})


def test_a_published_batch_decodes_as_vllm_encodes_it() -> None:
    event = stored(P, 0, 2, "kvwire:files")
    payload = msgpack.packb([1.5, [event, {"type": "AllBlocksCleared"}], None], use_bin_type=True)
    assert decode_batch(payload) == [event, {"type": "AllBlocksCleared"}]
    for bad in (b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [1, 2]])):
        with pytest.raises(ValueError, match="not a KV event batch"):
            decode_batch(bad)
