"""Transceiver state bytes (N3): versioned, bounded, pickle-free; garbage gives a clear error."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.contract.capabilities import OtherEnd
from kvwire.holding import MAX_STATE_BYTES, StateError, TransceiverState

STATE = TransceiverState("w0", "ucx", OtherEnd.PEER, b"\x01\x02", "", "tiny-abc", b"\xaa" * 32, b"\xbb" * 32, 16)


def test_round_trip():
    assert TransceiverState.from_bytes(STATE.to_bytes()) == STATE


@settings(max_examples=400)
@given(data=st.binary(max_size=300))
def test_garbage_is_refused_with_state_error(data):
    with pytest.raises(StateError):
        TransceiverState.from_bytes(data)


@settings(max_examples=200)
@given(body=st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                         max_leaves=20))
def test_well_formed_json_of_the_wrong_shape_is_refused(body):
    raw = b"KVWS\x01" + json.dumps(body).encode()
    with pytest.raises(StateError):
        TransceiverState.from_bytes(raw)


def test_each_refusal_says_why():
    raw = STATE.to_bytes()
    cases = [
        (b"nope", "bad magic"),
        (raw[:4] + b"\x07" + raw[5:], "version 7"),
        (b"KVWS\x01" + b"[" * 5000, "JSON"),
        (b"KVWS\x01" + b" " * MAX_STATE_BYTES, "more than"),
        (raw.replace(b'"block_tokens":16', b'"block_tokens":true'), "block_tokens"),
        (raw.replace(b'"other_end":"peer"', b'"other_end":"moon"'), "other_end"),
        (raw.replace(b'"address":"0102"', b'"address":"zz"'), "not hex"),
        (raw.replace(b',"worker":"w0"', b""), "missing ['worker']"),
    ]
    for data, needle in cases:
        with pytest.raises(StateError) as info:
            TransceiverState.from_bytes(data)
        assert needle in str(info.value), (needle, str(info.value))


FACTS = (("block_size", "16"), ("model", "org/llama-8b"), ("tensor_parallel_size", "2"))


def test_facts_round_trip_and_a_state_without_them_reads_as_before():
    with_facts = TransceiverState("w0", "ucx", OtherEnd.PEER, b"\x01", "", "m", b"\xaa" * 32, b"\xbb" * 32, 16,
                                  FACTS)
    assert TransceiverState.from_bytes(with_facts.to_bytes()) == with_facts
    assert with_facts.fact_map()["tensor_parallel_size"] == "2"
    assert b"facts" not in STATE.to_bytes()  # written only when there are some: older readers read it


@pytest.mark.parametrize("facts, needle", [
    ({"Model": "x"}, "facts"),  # not a lower-case name
    ({"model": 3}, "facts"),  # not text
    ({"model": "x" * 300}, "facts"),
    ({f"f{i}": "x" for i in range(40)}, "at most 32"),
    (["model", "x"], "facts"),
])
def test_bad_facts_are_refused_naming_the_field(facts, needle):
    body = json.loads(STATE.to_bytes()[5:])
    body["facts"] = facts
    with pytest.raises(StateError, match=needle):
        TransceiverState.from_bytes(b"KVWS\x01" + json.dumps(body).encode())
