"""Contract rules that can be checked on the types alone: M1-M2, V1-V3, A5-A6, H1, B4."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire.contract as c
from kvwire.contract import (
    CONTRACT_VERSION,
    CacheKind,
    Capabilities,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    OutcomeStatus,
    SlotRegion,
    SubmissionRejected,
    TokenRange,
    View,
)
from kvwire.contract.capabilities import OtherEnd
from kvwire.contract.errors import SubmissionError
from kvwire.contract.hint import MAX_HINT_BYTES
from kvwire.testing.strategies import hints, masks

REGION = SlotRegion(0, 4096, 64, 16, MemoryKind.HOST)


def group(slots, gid=0, names=None, kind=CacheKind.PAGED, region=REGION):
    return LayerGroupRows(gid, kind, region, slots, TokenRange(0, 16 * max(1, len(slots))), names)


def test_exports_exactly_the_contract_names():
    assert set(c.__all__) == {
        "Backend", "Capabilities", "Attempt", "Outcome", "View", "LayerGroupRows", "SlotRegion",
        "MemoryKind", "Hint", "WakeFn", "InvalidSubmission", "SubmissionRejected", "TokenRange",
        "CacheKind", "CONTRACT_VERSION",
        # what a backend written directly on the contract needs besides (contract 1.1)
        "Registration", "OtherEnd", "OutcomeStatus", "Cause", "SubmissionError", "SERVE_PULLS",
        "ServesPulls", "PullRequest", "RegionTable", "TableRegistration",
        # the optional protocols lookup (contract 1.1) and offer-pulls (contract 1.2)
        "LOOKUP", "Lookup", "LookupFailed", "OFFER_PULLS", "OffersPulls",
        # the optional protocol block-objects (contract 1.3)
        "BLOCK_OBJECTS", "block_layout",
    }
    assert CONTRACT_VERSION == (1, 3)
    for name in c.__all__:
        assert getattr(c, name) is not None, name


def test_contract_imports_no_torch_nor_other_kvwire_parts():
    import subprocess
    import sys

    code = (
        "import sys, kvwire.contract, kvwire.contract.serving;"
        "bad=[m for m in sys.modules if m.startswith(('torch','kvwire.lender','kvwire.runtime','kvwire.registry','kvwire_'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- M1, M2: memory ---------------------------------------------------------------------------

def test_M1_device_region_names_its_device_and_host_none():
    with pytest.raises(ValueError, match="device index"):
        SlotRegion(1, 4096, 64, 4, MemoryKind.DEVICE)
    with pytest.raises(ValueError, match="names no device"):
        SlotRegion(1, 4096, 64, 4, MemoryKind.HOST, device=0)
    assert SlotRegion(1, 4096, 64, 4, MemoryKind.DEVICE, device=2).device == 2


@pytest.mark.parametrize("field,value,msg", [
    ("base", 0, "base"), ("slot_bytes", 0, "slot_bytes"), ("slot_count", -1, "slot_count"), ("region_id", -3, "region_id"),
])
def test_M2_region_rejects_bad_geometry_naming_the_field(field, value, msg):
    args = dict(region_id=0, base=4096, slot_bytes=64, slot_count=4, memory_kind=MemoryKind.HOST)
    args[field] = value
    with pytest.raises(ValueError, match=msg):
        SlotRegion(**args)


@given(a=st.integers(1, 10_000), an=st.integers(1, 500), b=st.integers(1, 10_000), bn=st.integers(1, 500))
def test_M2_overlap_is_byte_exact(a, an, b, bn):
    ra = SlotRegion(0, a, 1, an, MemoryKind.HOST)
    rb = SlotRegion(1, b, 1, bn, MemoryKind.HOST)
    shared = set(range(a, a + an)) & set(range(b, b + bn))
    assert ra.overlaps(rb) == bool(shared) == rb.overlaps(ra)
    rd = SlotRegion(2, b, 1, bn, MemoryKind.DEVICE, device=0)
    assert not ra.overlaps(rd)


# --- V1, V2, V3: views ------------------------------------------------------------------------

def test_V1_state_group_lends_exactly_one_slot():
    with pytest.raises(ValueError, match="exactly one slot"):
        group([1, 2], kind=CacheKind.STATE)
    assert group([3], kind=CacheKind.STATE).rows == 1


def test_V1_slots_must_lie_in_region_and_be_integers():
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        group([0, 16])
    with pytest.raises(TypeError, match="integers"):
        group(np.array([0.5, 1.0]))


def test_V1_names_one_per_row_fixed_width():
    with pytest.raises(ValueError, match="one per row"):
        group([0, 1], names=np.zeros((3, 32), np.uint8))
    with pytest.raises(ValueError, match="one width"):
        group([0, 1], names=[b"a" * 32, b"b" * 31])
    g = group([0, 1], names=[b"a" * 32, b"b" * 32])
    assert g.name(1) == b"b" * 32


@given(slots=st.lists(st.integers(0, 15), max_size=16))
def test_V2_view_is_an_immutable_snapshot(slots):
    src = np.array(slots, dtype=np.int64)
    names = np.arange(len(slots) * 8, dtype=np.uint8).reshape(len(slots), 8) if slots else None
    g = group(src, names=names)
    view = View((g,))
    src[:] = 0  # the giver changes its arrays afterwards...
    if names is not None:
        names[:] = 0
    assert list(view.groups[0].slots) == slots  # ...the view does not change
    assert not view.groups[0].slots.flags.writeable
    with pytest.raises(ValueError):
        view.groups[0].slots[...] = 1
    if names is not None:
        assert not view.groups[0].names.flags.writeable
        assert view.groups[0].names.sum() == np.arange(len(slots) * 8, dtype=np.uint8).sum()
    with pytest.raises(AttributeError):
        view.groups = ()  # type: ignore[misc]


def test_V2_a_groups_frozen_arrays_go_to_the_next_group_without_a_copy_and_nothing_else_does():
    src = np.array([3, 1, 2], dtype=np.int64)
    names = np.arange(3 * 8, dtype=np.uint8).reshape(3, 8)
    first = group(src, names=names)
    second = group(first.slots, names=first.names, gid=1)
    assert second.slots is first.slots and second.names is first.names  # one copy a view, not one a group
    src[:] = 0
    names[:] = 0
    assert list(second.slots) == [3, 1, 2] and second.names.sum() == np.arange(24).sum()
    # anything else is still copied: a read-only array of the caller's (its base stays writable) ...
    mine = np.array([0, 1], dtype=np.int64)
    shown = mine.view()
    shown.setflags(write=False)
    third = group(shown, gid=2)
    assert third.slots is not shown
    mine[:] = 5
    assert list(third.slots) == [0, 1]
    # ... and a frozen array somebody made writable again, or one of another dtype or shape
    loose = group([0, 1], gid=3).slots
    loose.setflags(write=True)
    assert group(loose, gid=4).slots is not loose
    assert group(first.slots.astype(np.int32), gid=5).slots is not first.slots


def test_V2_names_read_only_over_bytes_are_taken_without_a_copy_and_over_a_bytearray_are_copied():
    raw = bytes(range(4 * 8))
    over_bytes = np.frombuffer(raw, dtype=np.uint8).reshape(4, 8)
    taken = group([0, 1, 2], names=over_bytes[:3])
    assert np.shares_memory(taken.names, over_bytes)  # nobody can write a bytes object's memory
    assert taken.names.tobytes() == raw[:24]
    # the same over a bytearray: numpy makes it read-only on request, but the bytearray stays writable
    buffer = bytearray(raw)
    shown = np.frombuffer(buffer, dtype=np.uint8).reshape(4, 8)
    shown.setflags(write=False)
    copied = group([0, 1, 2], names=shown[:3], gid=1)
    assert not np.shares_memory(copied.names, shown)
    buffer[:] = bytes(len(buffer))
    assert copied.names.tobytes() == raw[:24]
    # bytes viewed with steps (not contiguous) are copied into a contiguous snapshot
    stepped = group([0, 1], names=over_bytes[::2], gid=2)
    assert stepped.names.flags.c_contiguous and stepped.names.tobytes() == raw[:8] + raw[16:24]


@given(counts=st.lists(st.integers(0, 8), min_size=1, max_size=4))
def test_V3_row_masks_new_writable_all_false_every_call(counts):
    view = View(tuple(group(list(range(n)), gid=i) for i, n in enumerate(counts)))
    first, second = view.row_masks(), view.row_masks()
    assert [m.size for m in first] == counts
    for a, b in zip(first, second, strict=True):
        assert a.dtype == np.bool_ and a.flags.writeable and not a.any()
        assert not np.shares_memory(a, b)
        a[:] = True
    assert not any(m.any() for m in view.row_masks())


def test_V_unique_group_ids():
    with pytest.raises(ValueError, match="unique"):
        View((group([0]), group([1])))


@given(rows=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 15)), max_size=12))
def test_V4_overlap_detection_matches_brute_force(rows):
    wide = SlotRegion(1, 4096 + 32, 64, 16, MemoryKind.HOST)  # shifted by half a slot: overlaps REGION
    device = SlotRegion(2, 4096, 64, 16, MemoryKind.DEVICE, device=0)  # same addresses, other memory
    regions = (REGION, wide, device)
    by_region: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for r, s in rows:
        by_region[r].append(s)
    view = View(tuple(group(by_region[r], gid=r, region=regions[r]) for r in (0, 1, 2)))
    spans = {(r, i): (regions[r].memory_kind, regions[r].base + s * 64, regions[r].base + s * 64 + 64)
             for r in (0, 1, 2) for i, s in enumerate(by_region[r])}

    def clash(a, b):
        return a[0] is b[0] and a[1] < b[2] and b[1] < a[2]

    brute = any(clash(a, b) for i, a in enumerate(spans.values()) for b in list(spans.values())[i + 1:])
    found = view.overlapping_rows()
    assert (found is not None) == brute
    if found is not None:  # the two rows named really overlap
        (ga, ra), (gb, rb) = found
        assert (ga, ra) != (gb, rb) and clash(spans[(ga, ra)], spans[(gb, rb)])


#: Regions for groups to share or not: two adjacent (one ends where the next begins), one
#: overlapping the first by a byte, one at the first's addresses in device memory, one far off.
_POOL = (SlotRegion(1, 4096, 64, 8, MemoryKind.HOST), SlotRegion(2, 4096 + 512, 64, 8, MemoryKind.HOST),
         SlotRegion(3, 4096 + 511, 32, 4, MemoryKind.HOST), SlotRegion(4, 4096, 64, 8, MemoryKind.DEVICE, device=0),
         SlotRegion(5, 1 << 40, 16, 8, MemoryKind.HOST))


@given(groups=st.lists(st.tuples(st.integers(0, len(_POOL) - 1), st.sets(st.integers(0, 3), max_size=4),
                                 st.booleans()), max_size=5))
def test_V4_overlap_detection_with_groups_in_order_matches_brute_force(groups):
    """Groups whose slots mostly increase, in regions that touch, overlap, repeat or differ in
    memory: the view's answer is the brute-force one (the check that skips address arrays when
    every group's slots increase must not miss a clash between groups)."""
    view = View(tuple(group(sorted(slots, reverse=backwards), gid=i, region=_POOL[r])
                      for i, (r, slots, backwards) in enumerate(groups)))
    spans = [((g.region.memory_kind, g.region.device), int(a), int(a) + g.region.slot_bytes, (gi, row))
             for gi, g in enumerate(view.groups) for row, a in enumerate(g.addresses())]
    brute = any(x[0] == y[0] and x[1] < y[2] and y[1] < x[2] for i, x in enumerate(spans) for y in spans[i + 1:])
    found = view.overlapping_rows()
    assert (found is not None) == brute
    if found is not None:
        where = {s[3]: s for s in spans}
        a, b = where[found[0]], where[found[1]]
        assert a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


# --- TokenRange --------------------------------------------------------------------------------

@given(a=st.integers(-5, 50), b=st.integers(-5, 50))
def test_token_range_half_open_non_negative(a, b):
    if a < 0 or b < a:
        with pytest.raises(ValueError):
            TokenRange(a, b)
    else:
        r = TokenRange(a, b)
        assert len(r) == b - a
        assert (a in r) == (b > a) and (b not in r)


# --- A5, A6: outcomes and masks ---------------------------------------------------------------

def test_A6_non_bool_masks_raise_type_error():
    for bad in (np.zeros(3, np.uint8), np.zeros(3, np.int64), np.zeros(3, np.float32)):
        bad.setflags(write=False)
        with pytest.raises(TypeError, match="bool"):
            Outcome.delivered([bad])
    with pytest.raises(TypeError):
        Outcome.delivered([[True, False]])


def test_A6_read_only_exact_ndarray_is_kept_writable_is_copied():
    kept = np.array([True, False, True])
    kept.setflags(write=False)
    writable = np.array([True, True])
    out = Outcome.delivered([kept, writable])
    assert out.masks[0] is kept
    assert out.masks[1] is not writable and not np.shares_memory(out.masks[1], writable)
    writable[:] = False
    assert out.masks[1].all() and not out.masks[1].flags.writeable


def test_A6_masked_array_is_copied_into_a_plain_array():
    m = np.ma.masked_array(np.array([True, False]), mask=[False, True])
    m.setflags(write=False)
    out = Outcome.delivered([m])
    assert type(out.masks[0]) is np.ndarray
    assert list(out.masks[0]) == [True, False]  # all() no longer skips the masked row
    assert not out.masks[0].all()


def test_A5_outcome_states_and_reasons():
    m = np.zeros(2, bool)
    assert Outcome.delivered([m]).is_delivered
    with pytest.raises(ValueError, match="why"):
        Outcome.failed("", [m])
    f = Outcome.failed("store unreachable", [m])
    assert f.is_failed and f.reason == "store unreachable"
    assert Outcome.cancelled([m], by_peer=True).by_peer
    with pytest.raises(ValueError):
        Outcome(Outcome.delivered([m]).status, (m,), by_peer=True)


# --- H1: hints --------------------------------------------------------------------------------

hint_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40), st.binary(max_size=64),
)
hint_keys = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True)


@given(kind=hint_keys, fields=st.dictionaries(hint_keys, hint_values, max_size=8),
       timeout=st.one_of(st.none(), st.floats(0.001, 1e6)))
def test_H1_hint_round_trips_through_bytes(kind, fields, timeout):
    hint = Hint(kind, tuple(fields.items()), timeout)
    again = Hint.from_bytes(hint.to_bytes())
    assert again == hint
    for k, v in fields.items():
        assert again[k] == v and type(again[k]) is type(v)


@settings(max_examples=50)
@given(kind=hint_keys, fields=st.dictionaries(hint_keys, hint_values, max_size=6),
       timeout=st.one_of(st.none(), st.floats(0.001, 1e6)), wide=st.booleans(), as_text=st.booleans())
def test_H1_the_size_bound_is_exact(kind, fields, timeout, wide, as_text):
    """A hint whose encoding is exactly MAX_HINT_BYTES is taken, one byte more is refused,
    whatever the other fields hold (text padding counts UTF-8 bytes, not characters)."""
    fields.pop("pad", None)
    small = Hint(kind, tuple({**fields, "pad": "" if as_text else b""}.items()), timeout)
    room = MAX_HINT_BYTES - len(small.to_bytes())
    unit = "é" if wide else "e"  # two bytes or one

    def padded(n: int) -> Hint:
        text = unit * (n // len(unit.encode())) + "e" * (n % len(unit.encode()))
        return Hint(kind, tuple({**fields, "pad": text if as_text else text.encode()}.items()), timeout)

    assert len(padded(room).to_bytes()) == MAX_HINT_BYTES
    with pytest.raises(ValueError, match="at most"):
        padded(room + 1)


@settings(max_examples=300)
@given(data=st.binary(max_size=200))
def test_H1_garbage_bytes_give_a_clear_value_error(data):
    try:
        Hint.from_bytes(data)
    except ValueError as exc:
        assert str(exc)
    # anything else (or a crash) fails the test


@given(hint=st.builds(Hint.of, st.just("store"), namespace=st.text(max_size=10)), cut=st.integers(0, 30))
def test_H1_truncated_or_extended_encoding_is_refused(hint, cut):
    raw = hint.to_bytes()
    if cut < len(raw):
        with pytest.raises(ValueError):
            Hint.from_bytes(raw[:cut])
    with pytest.raises(ValueError, match="trailing"):
        Hint.from_bytes(raw + b"\x00")


def test_H1_hint_is_immutable_and_bounded():
    h = Hint.of("store", namespace="a")
    with pytest.raises(AttributeError):
        h.kind = "peer"  # type: ignore[misc]
    with pytest.raises(ValueError, match="at most"):
        Hint.of("store", blob=b"x" * (70 * 1024))
    with pytest.raises(TypeError, match="must be None"):
        Hint.of("store", obj=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version"):
        Hint.from_bytes(b"KVWH\x09")


# --- B4: capabilities -------------------------------------------------------------------------

def caps(**over):
    args = dict(contract_version=CONTRACT_VERSION, fetch=True, publish=True,
                memory_kinds=frozenset({MemoryKind.HOST}), other_end=OtherEnd.STORE,
                content_addressed=True, max_in_flight=8, cancellation=True)
    args.update(over)
    return Capabilities(**args)


def test_B4_capabilities_are_frozen_validated_data():
    cap = caps()
    with pytest.raises(AttributeError):
        cap.fetch = False  # type: ignore[misc]
    assert hash(cap) == hash(caps())
    with pytest.raises(ValueError, match="fetch, publish"):
        caps(fetch=False, publish=False)
    with pytest.raises(ValueError, match="max_in_flight"):
        caps(max_in_flight=0)
    with pytest.raises(ValueError, match="memory_kinds"):
        caps(memory_kinds=frozenset())
    assert "store fetch+publish [host]" in cap.summary()


def test_errors_form_a_closed_hierarchy():
    assert issubclass(InvalidSubmission, SubmissionError)
    assert issubclass(SubmissionRejected, SubmissionError)
    assert not issubclass(InvalidSubmission, SubmissionRejected)


# --- A10: structured causes (contract 1.1) ----------------------------------------------------

def test_A10_failed_outcomes_take_failure_causes_only():
    from kvwire.contract import Cause

    masks = [np.zeros(2, dtype=bool)]
    assert Outcome.failed("deadline passed", masks, Cause.DEADLINE).cause is Cause.DEADLINE
    assert Outcome.failed("something", masks).cause is None  # a 1.0 backend gives none
    for bad in (Cause.HOLDER_CANCELLED, Cause.PEER_CANCELLED):
        with pytest.raises(ValueError, match="FAILED Outcome's cause"):
            Outcome.failed("x", masks, bad)
    with pytest.raises(TypeError, match="Cause"):
        Outcome.failed("x", masks, "deadline")  # type: ignore[arg-type]


def test_A10_cancelled_outcomes_name_who_cancelled():
    from kvwire.contract import Cause

    masks = [np.zeros(1, dtype=bool)]
    assert Outcome.cancelled(masks).cause is Cause.HOLDER_CANCELLED
    assert Outcome.cancelled(masks, by_peer=True).cause is Cause.PEER_CANCELLED
    assert Outcome.cancelled(masks, cause=Cause.SHUTDOWN).cause is Cause.SHUTDOWN
    with pytest.raises(ValueError, match="by_peer"):
        Outcome.cancelled(masks, cause=Cause.PEER_CANCELLED)
    with pytest.raises(ValueError, match="CANCELLED Outcome's cause"):
        Outcome.cancelled(masks, cause=Cause.DEADLINE)
    with pytest.raises(ValueError, match="no cause"):
        Outcome(OutcomeStatus.DELIVERED, tuple(masks), cause=Cause.FAULT)


# --- moved from the conformance suite: no backend can fail these, they check the contract's types

@settings(max_examples=100, deadline=None)
@given(data=st.one_of(st.binary(max_size=256), hints().map(lambda h: h.to_bytes()),
                      hints().map(lambda h: h.to_bytes()[:-1])))
def test_H1_decoding_hint_bytes_executes_nothing(data: bytes) -> None:
    """Any bytes decode to a hint or raise ``ValueError`` saying why; nothing else happens."""
    try:
        decoded = Hint.from_bytes(data)
    except ValueError as exc:
        assert str(exc), "H1: a refused hint encoding must say why"
        return
    assert isinstance(decoded, Hint) and decoded.to_bytes() == data, "H1: decoding must round-trip exactly"


@settings(max_examples=100, deadline=None)
@given(mask=masks(), dtype=st.sampled_from([np.uint8, np.int64, np.float32]))
def test_A6_mask_type_rules(mask: np.ndarray, dtype: type) -> None:
    """``Outcome`` keeps read-only plain bool masks, copies any other bool mask (a masked array
    included), and refuses non-bool ones with ``TypeError``."""
    out = Outcome.delivered([mask])
    if not mask.flags.writeable:
        assert out.masks[0] is mask, "A6: a read-only plain bool mask is kept as it is"
    else:
        assert out.masks[0] is not mask and not out.masks[0].flags.writeable, "A6: a writable mask is copied"
    with pytest.raises(TypeError):
        Outcome.delivered([mask.astype(dtype)])
    masked = np.ma.masked_array(mask, mask=np.zeros(mask.shape, dtype=bool))
    kept = Outcome.delivered([masked]).masks[0]
    assert type(kept) is np.ndarray and not kept.flags.writeable, "A6: a masked array is copied to a plain one"
