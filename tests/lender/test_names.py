"""Names (N1): deterministic across processes, chained over the whole prefix, bound to the scope."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from lender_pages import paged_layout, prefill

from kvwire.contract import CacheKind
from kvwire.lender import CacheLayout, GroupSpec, Lender, Scope

TOKENS = list(range(1000, 1000 + 37))


def test_names_shape_and_incomplete_block():
    lender = Lender(paged_layout(block_tokens=4), Scope("m"))
    names = lender.names(TOKENS)
    assert names.shape == (9, 32) and names.dtype == np.uint8  # 37 tokens: 9 whole blocks of 4
    assert lender.names(TOKENS[:3]).shape == (0, 32)


def test_names_are_the_documented_chain():
    """An independent computation of the chain (version 2): SHA-256 of the previous name and the
    block's little-endian int64 tokens, from the root SHA-256(tag + scope digest)."""
    layout = paged_layout(block_tokens=4)
    scope = Scope("m", b"salt")
    parent = hashlib.sha256(b"kvwire-block-v2" + scope.digest(layout)).digest()
    expected = []
    for b in range(len(TOKENS) // 4):
        data = np.array(TOKENS[b * 4:(b + 1) * 4], dtype="<i8").tobytes()
        parent = hashlib.sha256(parent + data).digest()
        expected.append(parent)
    got = Lender(layout, scope).names(np.array(TOKENS))
    assert [n.tobytes() for n in got] == expected


def test_zero_tokens_and_trailing_zero_bytes_are_hashed():
    """Every byte of a block counts, also trailing zero bytes (a token 0 at a block's end)."""
    lender = Lender(paged_layout(block_tokens=4), Scope("m"))
    a = lender.names([5, 6, 7, 0, 1, 2, 3, 0])
    b = lender.names([5, 6, 7, 256, 1, 2, 3, 0])
    c = lender.names([5, 6, 7, 0, 1, 2, 3, 1])
    assert not (a[0] == b[0]).all() and (a[0] == c[0]).all() and not (a[1] == c[1]).all()


def test_name_commits_to_the_whole_prefix():
    lender = Lender(paged_layout(block_tokens=4), Scope("m"))
    a = lender.names(TOKENS)
    changed = list(TOKENS)
    changed[1] += 1  # only block 0's tokens differ
    b = lender.names(changed)
    assert not (a == b).all(axis=1).any(), "every later block's name must change with an earlier token"


def test_token_containers_agree():
    lender = Lender(paged_layout(block_tokens=4), Scope("m"))
    base = lender.names(TOKENS)
    for other in (np.array(TOKENS, dtype=np.int32), torch.tensor(TOKENS), tuple(TOKENS)):
        assert (lender.names(other) == base).all()


def test_names_equal_in_another_process():
    code = textwrap.dedent(
        """
        import sys, torch
        from kvwire.contract import CacheKind
        from kvwire.lender import CacheLayout, GroupSpec, Lender, Scope
        layout = CacheLayout(4, 8, 0, (GroupSpec(0, CacheKind.PAGED, (2, 4, 3), torch.float16),))
        lender = Lender(layout, Scope("model-x", b"tenant-a"))
        sys.stdout.write(lender.names(list(range(1000, 1037))).tobytes().hex())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    layout = CacheLayout(4, 8, 0, (GroupSpec(0, CacheKind.PAGED, (2, 4, 3), torch.float16),))
    here = Lender(layout, Scope("model-x", b"tenant-a")).names(TOKENS)
    assert bytes.fromhex(out.stdout.strip()) == here.tobytes()


def _variants(layout: CacheLayout, scope: Scope):
    g = layout.groups[0]
    yield "model", layout, dataclasses.replace(scope, model_id="other-model")
    yield "salt", layout, dataclasses.replace(scope, tenant_salt=b"tenant-b")
    yield "dtype", dataclasses.replace(layout, groups=(dataclasses.replace(g, dtype=torch.bfloat16),) + layout.groups[1:]), scope
    yield "shape", dataclasses.replace(layout, groups=(dataclasses.replace(g, slot_shape=(2, 2, 4, 4)),) + layout.groups[1:]), scope


def test_names_differ_when_any_part_of_the_scope_differs():
    layout, scope = paged_layout(block_tokens=4), Scope("m", b"tenant-a")
    base = Lender(layout, scope).names(TOKENS)
    for what, other_layout, other_scope in _variants(layout, scope):
        other = Lender(other_layout, other_scope).names(TOKENS)
        assert not (other == base).all(axis=1).any(), f"changing the {what} must change every name"


def test_pool_size_does_not_change_names():
    """Workers of different capacity share names: only what makes blocks interchangeable counts."""
    small, big = paged_layout(num_blocks=4), paged_layout(num_blocks=40)
    assert small.digest() == big.digest()
    assert (Lender(small, Scope("m")).names(TOKENS) == Lender(big, Scope("m")).names(TOKENS)).all()


def test_another_tenant_misses():
    layout = paged_layout(block_tokens=4)
    a = Lender(layout, Scope("m", b"tenant-a"))
    request = a.open_request(TOKENS)
    prefill(a, request)
    a.close_request(request)
    assert a.probe(TOKENS) == 9
    b_names = Lender(layout, Scope("m", b"tenant-b")).names(TOKENS)
    assert a.probe_names(b_names) == 0
    with a.lend_names(b_names) as lease:
        assert lease.found == 0 and lease.view.rows == 0
    assert a.pins() == 0
    with a.lend_names(a.names(TOKENS)) as lease:
        assert lease.found == 9
    assert a.pins() == 0


def test_layout_round_trips_through_json():
    layout = CacheLayout(
        16, 100, 4,
        (GroupSpec(3, CacheKind.PAGED, (2, 2, 16, 8, 64), torch.bfloat16),
         GroupSpec(5, CacheKind.STATE, (4, 128), torch.float32)),
    )
    again = CacheLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout and again.digest() == layout.digest()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"version": 99}, "version"),
        ({"groups": [{"group_id": 0, "kind": "paged", "slot_shape": [4], "dtype": "floaty"}]}, "dtype"),
        ({"groups": [{"group_id": 0, "kind": "paged", "slot_shape": [4]}]}, "dtype"),
    ],
)
def test_layout_from_bad_dict_says_what_is_wrong(change, message):
    d = paged_layout().to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=message):
        CacheLayout.from_dict(d)


def test_layout_validation():
    g = GroupSpec(0, CacheKind.PAGED, (4,), torch.float32)
    with pytest.raises(ValueError, match="unique"):
        CacheLayout(4, 4, 0, (g, g))
    with pytest.raises(ValueError, match="num_blocks"):
        CacheLayout(4, 0, 0, (g,))
    with pytest.raises(ValueError, match="num_state_slots"):
        CacheLayout(4, 4, 0, (g, GroupSpec(1, CacheKind.STATE, (4,), torch.float32)))
    with pytest.raises(TypeError, match="dtype"):
        GroupSpec(0, CacheKind.PAGED, (4,), np.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model_id"):
        Scope("")
