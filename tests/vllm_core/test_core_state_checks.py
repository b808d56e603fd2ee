"""A pulling engine checks a serving engine's transceiver state before any byte moves, and says
which fact differs: the model, a dtype, the tensor- or pipeline-parallel size, the block size or
the cache's geometry (kvwire_vllm.peer.check_state, without vLLM)."""

from __future__ import annotations

import pytest
from kvwire_vllm import peer

from kvwire.holding import StateError

LAYOUT = {"block_size": 16, "layers": ["l0", "l1"], "num_kv_heads": 8, "head_size": 128}
FACTS = {"model": "org/llama-8b", "model_dtype": "torch.bfloat16", "kv_cache_dtype": "auto",
         "tensor_parallel_size": "1", "pipeline_parallel_size": "1", "block_size": "16", "num_layers": "32",
         "num_kv_heads": "8", "head_size": "128", "kv_cache_layout": "LBNHC"}
SCOPE = b"\x01" * 32


def state(**changed: str) -> bytes:
    facts = tuple(sorted({**FACTS, **changed}.items()))
    return peer.transceiver_state(worker="w", backend="ucx", address=b"\x01", model_id="org/llama-8b",
                                  layout=LAYOUT, scope=SCOPE if not changed else b"\x02" * 32, block_size=16,
                                  facts=facts)


def check(raw: bytes) -> None:
    peer.check_state(raw, backend="ucx", layout=LAYOUT, scope=SCOPE, block_size=16,
                     facts=tuple(sorted(FACTS.items())))


def test_the_same_engine_passes() -> None:
    check(state())


@pytest.mark.parametrize("fact, value", [
    ("tensor_parallel_size", "2"), ("pipeline_parallel_size", "2"), ("model_dtype", "torch.float16"),
    ("kv_cache_dtype", "fp8"), ("model", "org/other-model"), ("block_size", "32"), ("num_kv_heads", "2"),
])
def test_a_differing_fact_is_named_with_both_values(fact: str, value: str) -> None:
    with pytest.raises(StateError) as info:
        check(state(**{fact: value}))
    message = str(info.value)
    assert fact in message and repr(value) in message and repr(FACTS[fact]) in message


def test_a_state_without_facts_still_fails_on_its_scope() -> None:
    raw = peer.transceiver_state(worker="w", backend="ucx", address=b"\x01", model_id="m", layout=LAYOUT,
                                 scope=b"\x02" * 32, block_size=16)
    with pytest.raises(StateError, match="scope"):
        check(raw)
