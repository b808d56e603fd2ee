"""A transceiver state with one byte changed, as a new user would try it: it decodes to a state
of equal meaning, or it is refused with ``StateError`` naming the field — at decode time, or by
``Worker.pull`` — and never reaches the caller as another exception (the contract's
``InvalidSubmission`` included). One backend of each kind: the memory store and the UCX peer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvwire.holding import StateError, TransceiverState
from kvwire.registry import ConfigError, PluginError, load
from kvwire.runtime import ModelConfig, Worker

MODEL = ModelConfig(layers=2, layers_per_group=1, heads=2, head_dim=8, block_tokens=16, max_tokens=512, seed=7)


def ucx_missing() -> str | None:
    try:
        return load("ucx").check() if load("ucx").check else None
    except (ConfigError, PluginError) as exc:
        return str(exc)


def same_meaning(a: TransceiverState, b: TransceiverState) -> bool:
    """Equal but for the worker's display name, which no pull reads."""
    return dataclasses.replace(a, worker=b.worker) == b


@pytest.mark.parametrize("backend", ["memory", "ucx"])
def test_every_one_byte_change_of_a_state_is_equal_in_meaning_or_a_state_error(backend: str):
    if backend == "ucx" and (why := ucx_missing()):
        pytest.skip(f"the ucx backend is unavailable: {why}")
    options = {"store": "state-flips"} if backend == "memory" else {}
    with Worker(MODEL, backend=backend, options=options, name="A", timeout_s=5) as a, \
         Worker(MODEL, backend=backend, options=options, name="B", timeout_s=5) as b:
        p = np.random.default_rng(11).integers(0, MODEL.vocab, 64)
        a.generate(p)
        if backend == "memory":
            a.publish(p)
        raw = a.transceiver_state()
        original = TransceiverState.from_bytes(raw)
        equal: list[bytes] = []
        refused_at_decode = 0
        for i in range(len(raw)):
            flipped = bytearray(raw)
            flipped[i] ^= 0x01
            try:
                state = TransceiverState.from_bytes(bytes(flipped))
            except StateError:
                refused_at_decode += 1
                continue
            # any other exception fails the test here
            if same_meaning(original, state):
                equal.append(bytes(flipped))
                continue
            try:
                result = b.pull(p, source=bytes(flipped), timeout_s=2)
            except StateError:
                continue
            # A state that names another namespace, an address nobody answers at, or another
            # instance at A's address (a stale state) is still a valid state: the pull misses or
            # fails, moving nothing, and keeps nothing pinned.
            assert result.blocks_moved == 0 and result.cached_tokens == 0, (i, result)
            assert b.pins() == 0
        assert refused_at_decode >= len(raw) // 3  # keys, structure, hex, digests, enums
        assert equal, "the worker's name changes meaning nowhere"
        pulled = b.pull(p, source=equal[0])
        assert pulled.status == "delivered" and pulled.blocks_moved == len(p) // MODEL.block_tokens


def test_a_state_whose_fields_do_not_fit_its_other_end_is_refused_at_decode():
    state = TransceiverState.from_bytes(store_state_bytes())
    for changes, field in [
        ({"namespace": "/bad"}, "namespace"),
        ({"namespace": ""}, "namespace"),
        ({"address": b"\x01"}, "address"),
        ({"layout_digest": b"\x00" * 31}, "layout_digest"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"backend": "Not A Name"}, "backend"),
        ({"model_id": ""}, "model_id"),
    ]:
        with pytest.raises(StateError, match=field):
            dataclasses.replace(state, **changes)


def store_state_bytes() -> bytes:
    with Worker(MODEL, backend="memory", options={"store": "state-fields"}, name="A") as a:
        return a.transceiver_state()
