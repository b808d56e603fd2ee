"""The control channel's codec and the address format: round trips, limits, and garbage."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvwire_ucx import wire
from kvwire_ucx.address import AddressError, PeerAddress

u64 = st.integers(0, 2**64 - 1)
reasons = st.text(max_size=200).map(wire.clip_reason)


@st.composite
def pulls(draw: st.DrawFn) -> wire.Pull:
    ngroups = draw(st.integers(1, 6))
    ids = draw(st.lists(st.integers(0, 2**32 - 1), min_size=ngroups, max_size=ngroups, unique=True))
    slots = draw(st.lists(st.integers(1, 2**40), min_size=ngroups, max_size=ngroups))
    width = draw(st.integers(1, wire.MAX_NAME_BYTES))
    count = draw(st.integers(1, 40))
    one_sided = draw(st.booleans())
    names = draw(st.binary(min_size=count * width, max_size=count * width))
    breaks = () if one_sided else tuple(draw(breaks_of(count)) for _ in range(ngroups))
    return wire.Pull(draw(u64), draw(st.integers(0, wire.MAX_TAG_BASE)), draw(st.integers(1, 2**32 - 1)),
                     tuple(zip(ids, slots, strict=True)), width, names, draw(st.binary(max_size=64)),
                     0 if one_sided else draw(st.integers(0, count * ngroups)), one_sided=one_sided, breaks=breaks)


def breaks_of(rows: int) -> st.SearchStrategy:
    """A group's breaks among ``rows`` rows: every row on its own, or ascending rows 1..rows-1."""
    ascending = st.sets(st.integers(1, rows - 1), max_size=8).map(lambda b: tuple(sorted(b))) if rows > 1 else st.just(())
    return st.one_of(st.none(), ascending)


@st.composite
def offers(draw: st.DrawFn) -> wire.Offer:
    counts = tuple(draw(st.lists(st.integers(0, wire.MAX_BLOCKS), min_size=1, max_size=8)))
    return wire.Offer(draw(u64), counts, tuple(draw(breaks_of(c)) for c in counts))


def _runs(starts: list[int], breaks: list[bool]) -> np.ndarray:
    """Runs of ``len(starts)`` rows in all: a new run where ``breaks`` says (and at row 0)."""
    if not starts:
        return np.zeros((0, 2), dtype=np.uint64)
    firsts = [i for i, b in enumerate(breaks) if b or i == 0]
    ends = firsts[1:] + [len(starts)]
    return np.array([(starts[f], e - f) for f, e in zip(firsts, ends, strict=True)], dtype=np.uint64).reshape(-1, 2)


def runs(*pairs: tuple[int, int]) -> np.ndarray:
    return np.array(pairs, dtype=np.uint64).reshape(-1, 2)


@st.composite
def read_offers(draw: st.DrawFn) -> wire.ReadOffer:
    counts = tuple(draw(st.lists(st.integers(0, 20), min_size=1, max_size=5)))
    addresses = tuple(_runs(draw(st.lists(u64, min_size=c, max_size=c)), draw(st.lists(st.booleans(), min_size=c,
                                                                                       max_size=c)))
                      for c in counts)
    memories = tuple(draw(st.one_of(st.just(()), st.lists(st.integers(-1, wire.MAX_DEVICE - 1), min_size=len(counts),
                                                          max_size=len(counts)))))
    return wire.ReadOffer(draw(u64), counts, draw(st.binary(min_size=1, max_size=wire.MAX_AGENT_NAME_BYTES)),
                          draw(u64), draw(st.binary(max_size=600)), addresses, memories)


@st.composite
def pushed_groups(draw: st.DrawFn, group_id: int) -> wire.PushedGroup:
    width = draw(st.integers(1, wire.MAX_NAME_BYTES))
    rows = draw(st.integers(0, 12))
    slot = draw(st.integers(1, 2**20))
    starts = draw(st.lists(st.integers(0, 2**40), min_size=rows, max_size=rows))
    cuts = draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    return wire.PushedGroup(group_id, slot, draw(st.integers(-1, wire.MAX_DEVICE - 1)), width,
                            draw(st.binary(min_size=rows * width, max_size=rows * width)), _runs(starts, cuts))


@st.composite
def pushes(draw: st.DrawFn) -> wire.PushOffer:
    ids = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4, unique=True))
    return wire.PushOffer(draw(u64), draw(st.integers(1, 2**32 - 1)),
                          draw(st.binary(min_size=1, max_size=wire.MAX_AGENT_NAME_BYTES)), draw(u64),
                          draw(st.binary(max_size=300)), tuple(draw(pushed_groups(g)) for g in ids))


messages = st.one_of(
    st.builds(wire.Hello, u64, st.binary(min_size=1, max_size=300), st.sampled_from([0, wire.HELLO_TAKES_PUSHES])),
    pushes(),
    st.builds(wire.Withdraw, u64),
    st.builds(wire.Withdrawn, u64),
    pulls(),
    read_offers(),
    offers(),
    st.builds(wire.Decline, u64, reasons),
    st.integers(0, wire.MAX_ROWS - 1).flatmap(
        lambda start: st.builds(wire.Go, u64, st.just(start), st.integers(start + 1, wire.MAX_ROWS))),
    st.builds(wire.Cancel, u64, reasons),
    st.builds(wire.Ack, u64, st.integers(0, wire.MAX_ROWS)),
)


@given(messages)
def test_every_message_survives_a_round_trip(message: wire.Message) -> None:
    assert wire.decode(wire.encode(message)) == message


@given(st.lists(messages, min_size=1, max_size=6), st.data())
def test_a_stream_cut_anywhere_yields_the_same_messages(batch: list[wire.Message], data: st.DataObject) -> None:
    stream = b"".join(wire.encode(m) for m in batch)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    reader, out, last = wire.FrameReader(), [], 0
    for cut in [*cuts, len(stream)]:
        out += reader.feed(stream[last:cut])
        last = cut
    assert out == batch
    assert reader.buffered == 0


@settings(deadline=None)
@given(st.lists(messages, min_size=1, max_size=6), st.data())
def test_chunks_fed_apart_or_together_yield_the_same_messages(batch: list[wire.Message], data: st.DataObject) -> None:
    """The reader takes the chunks of one socket read at once (``feed(*chunks)``): a frame in one
    chunk, a frame over several, several frames in one, in any grouping of chunks into calls."""
    stream = b"".join(wire.encode(m) for m in batch)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(stream) - 1)), max_size=12))))
    pieces = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True) if a < b]
    reader, out, i = wire.FrameReader(), [], 0
    while i < len(pieces):
        k = data.draw(st.integers(1, len(pieces) - i))
        out += reader.feed(*pieces[i:i + k])
        i += k
    assert out == batch
    assert reader.buffered == 0


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_garbage_gives_a_clean_error_or_a_valid_message(data: bytes) -> None:
    try:
        message = wire.decode(data)
    except wire.WireError:
        return
    assert wire.encode(message) == data


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(messages, st.data())
def test_a_corrupted_frame_gives_a_clean_error_or_a_valid_message(message: wire.Message, data: st.DataObject) -> None:
    frame = bytearray(wire.encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(frame) - 1))
        frame[position] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        frame = frame[: data.draw(st.integers(0, len(frame)))]
    reader = wire.FrameReader()
    try:
        for decoded in reader.feed(bytes(frame)):
            assert isinstance(decoded, (wire.Hello, wire.Pull, wire.Offer, wire.ReadOffer, wire.Decline, wire.Go, wire.Cancel,
                                        wire.Ack, wire.PushOffer, wire.Withdraw, wire.Withdrawn))
    except wire.WireError:
        pass


def test_an_oversized_frame_is_refused_from_its_header_alone() -> None:
    header = struct.pack("<4sBBHI", b"KVWC", wire.WIRE_VERSION, wire.MessageType.PULL, 0, wire.MAX_MESSAGE_BYTES + 1)
    with pytest.raises(wire.WireError, match="more than the maximum"):
        wire.FrameReader().feed(header)


@pytest.mark.parametrize("kind", list(wire.MessageType))
def test_a_frame_announcing_an_empty_body_is_refused_cleanly(kind: wire.MessageType) -> None:
    """No message has an empty body: the reader says so (a WireError, so the connection is dropped
    and counted), whether the header came alone or with more bytes behind it."""
    header = struct.pack("<4sBBHI", b"KVWC", wire.WIRE_VERSION, kind, 0, 0)
    for data in (header, header + wire.encode(wire.Ack(1, 1))):
        with pytest.raises(wire.WireError, match="ends early"):
            wire.FrameReader().feed(data)


def test_foreign_bytes_and_future_versions_are_named() -> None:
    with pytest.raises(wire.WireError, match="bad magic"):
        wire.FrameReader().feed(b"GET / HTTP/1.1\r\n\r\n")
    future = struct.pack("<4sBBHI", b"KVWC", wire.WIRE_VERSION + 1, 1, 0, 0)
    with pytest.raises(wire.WireError, match="version"):
        wire.decode(future)


def test_pull_limits_are_enforced_on_both_sides() -> None:
    with pytest.raises(wire.WireError, match="blocks"):
        wire.Pull(1, 1, 1000, ((0, 64),), 1, bytes(wire.MAX_BLOCKS + 1))
    with pytest.raises(wire.WireError, match="groups"):
        wire.Pull(1, 1, 1000, tuple((g, 64) for g in range(wire.MAX_GROUPS + 1)), 1, b"x")
    frame = bytearray(wire.encode(wire.Pull(1, 1, 1000, ((0, 64),), 4, b"abcd")))
    struct.pack_into("<I", frame, wire.HEADER_BYTES + 22, wire.MAX_BLOCKS + 1)  # the block count
    with pytest.raises(wire.WireError, match="blocks"):
        wire.decode(bytes(frame))


def test_reasons_are_clipped_to_what_a_message_carries() -> None:
    reason = wire.clip_reason("é" * 5000)
    assert len(reason.encode()) <= wire.MAX_REASON_BYTES
    assert wire.decode(wire.encode(wire.Decline(7, reason))) == wire.Decline(7, reason)


_LABEL = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,20}", fullmatch=True)
_HOSTS = st.one_of(st.ip_addresses().map(str), st.lists(_LABEL, min_size=1, max_size=6).map(".".join))


@given(_HOSTS, st.integers(1, 65535), st.integers(0, 2**64 - 1))
def test_addresses_round_trip(host: str, port: int, instance: int) -> None:
    address = PeerAddress(host, port, instance)
    assert PeerAddress.from_bytes(address.to_bytes()) == address


@given(st.text(min_size=1, max_size=60).filter(lambda h: len(h.encode()) <= 255))
def test_a_host_no_socket_takes_is_refused_with_a_clean_error(host: str) -> None:
    """Any text is either a usable host (an IP address or an ASCII host name) whose address
    round-trips, or refused with AddressError, never taken and failing later in a connect."""
    try:
        address = PeerAddress(host, 1, 0)
    except AddressError as exc:
        assert "host" in str(exc)
        return
    assert PeerAddress.from_bytes(address.to_bytes()) == address
    host.encode("ascii")  # taken only as ASCII, which a socket can always be asked to reach


@given(_HOSTS, st.integers(1, 65535), st.binary(min_size=1, max_size=3))
def test_an_address_decoded_before_does_not_vouch_for_other_bytes(host: str, port: int, extra: bytes) -> None:
    """Decoding is remembered by the exact bytes: the same bytes in another buffer type give an
    equal address, and the good bytes with anything more or less are refused as before."""
    raw = PeerAddress(host, port, 7).to_bytes()
    first = PeerAddress.from_bytes(raw)
    assert PeerAddress.from_bytes(bytearray(raw)) == first == PeerAddress.from_bytes(memoryview(raw))
    for bad in (raw + extra, raw[:-1]):
        with pytest.raises(AddressError):
            PeerAddress.from_bytes(bad)


@given(st.binary(max_size=300))
def test_address_garbage_gives_a_clean_error(data: bytes) -> None:
    try:
        PeerAddress.from_bytes(data)
    except AddressError:
        pass


def test_a_read_offer_with_runs_that_do_not_match_its_counts_is_refused() -> None:
    offer = wire.ReadOffer(7, (2, 1), b"agent", 1, b"meta", (runs((0, 1), (8, 1)), runs((1, 1))))
    frame = bytearray(wire.encode(offer))
    assert wire.decode(bytes(frame)) == offer
    with pytest.raises(wire.WireError, match="ends early"):
        wire.decode_body(wire.MessageType.READ_OFFER, bytes(frame[wire.HEADER_BYTES:-4]))  # one run short
    with pytest.raises(wire.WireError):
        wire.ReadOffer(7, (2,), b"agent", 1, b"", (runs((0, 3)),))
    with pytest.raises(wire.WireError, match="credit is 0"):
        wire.Pull(1, 1, 1, ((0, 8),), 1, b"a", credit=1, one_sided=True)


def test_a_read_offer_of_device_rows_names_each_group_memory_and_an_all_host_one_is_the_old_frame() -> None:
    """A reader must name the memory it reads (NIXL refuses remote VRAM called DRAM): device
    groups travel as READ_OFFER_DEVICE with each group's memory; all-host offers keep the frame an
    end that knows no device memory reads, byte for byte."""
    addresses = (runs((0, 2)), runs((1, 1)))
    device = wire.ReadOffer(7, (2, 1), b"agent", 1, b"meta", addresses, (0, -1))
    frame = wire.encode(device)
    assert wire.read_header(frame[:wire.HEADER_BYTES])[0] is wire.MessageType.READ_OFFER_DEVICE
    assert wire.decode(frame).memories == (0, -1) and wire.decode(frame) == device
    host = wire.ReadOffer(7, (2, 1), b"agent", 1, b"meta", addresses, (-1, -1))
    assert host.memories == () and wire.encode(host) == wire.encode(wire.ReadOffer(7, (2, 1), b"agent", 1, b"meta",
                                                                                   addresses))
    assert wire.read_header(wire.encode(host)[:wire.HEADER_BYTES])[0] is wire.MessageType.READ_OFFER
    assert host != device
    body = frame[wire.HEADER_BYTES:]
    for bad in (body[:-4] + struct.pack("<hh", -1, -1), body[:-4] + struct.pack("<hh", wire.MAX_DEVICE, 0),
                body[:-4] + struct.pack("<hh", -2, 0)):
        with pytest.raises(wire.WireError, match="memories"):
            wire.decode_body(wire.MessageType.READ_OFFER_DEVICE, bad)
    with pytest.raises(wire.WireError, match="ends early"):
        wire.decode_body(wire.MessageType.READ_OFFER_DEVICE, body[:-2])
    with pytest.raises(wire.WireError, match="memories for 1 groups"):
        wire.ReadOffer(7, (2, 1), b"agent", 1, b"", addresses, (0,))
    with pytest.raises(wire.WireError, match="memories must be"):
        wire.ReadOffer(7, (2, 1), b"agent", 1, b"", addresses, (0, wire.MAX_DEVICE))


def test_an_end_of_version_3_is_told_the_version_at_its_hello() -> None:
    """Version 4 (pushed offers) refuses a version-3 frame from its header, naming both."""
    old = struct.pack("<4sBBHI", b"KVWC", 3, wire.MessageType.HELLO, 0, 10) + struct.pack("<QH", 1, 0)
    with pytest.raises(wire.WireError, match=r"version 3 is not supported \(this end speaks 4\)"):
        wire.FrameReader().feed(old)


def test_a_hello_says_whether_its_end_takes_pushes_and_unknown_flags_are_refused() -> None:
    hello = wire.Hello(5, b"worker", wire.HELLO_TAKES_PUSHES)
    assert wire.decode(wire.encode(hello)).flags == wire.HELLO_TAKES_PUSHES
    body = bytearray(wire.encode(hello)[wire.HEADER_BYTES:])
    body[8] = 0x3
    with pytest.raises(wire.WireError, match="flags"):
        wire.decode_body(wire.MessageType.HELLO, bytes(body))
    with pytest.raises(wire.WireError, match="flags"):
        wire.Hello(5, b"worker", 0x80)


def _push(*groups: wire.PushedGroup, metadata: bytes = b"meta") -> wire.PushOffer:
    return wire.PushOffer(3, 5000, b"agent", 1, metadata, groups)


def _group(rows: int = 3, runs_: np.ndarray | None = None, group_id: int = 0, width: int = 4) -> wire.PushedGroup:
    names = b"".join(i.to_bytes(width, "big") for i in range(rows))
    return wire.PushedGroup(group_id, 64, -1, width, names, runs((4096, rows)) if runs_ is None else runs_)


def _body(push: wire.PushOffer) -> bytes:
    return wire.encode(push)[wire.HEADER_BYTES:]


def test_malformed_pushes_and_withdrawals_are_refused_naming_the_problem() -> None:
    """A push is decoded with every length checked before it is read: each bound broken alone
    gives a WireError that says which."""
    push = _push(_group(3, runs((4096, 2), (8192, 1))), _group(2, group_id=7))
    assert wire.decode(wire.encode(push)) == push
    body = _body(push)
    head = wire._PUSH_HEAD
    group_at = head.size + len(b"agent") + len(b"meta")

    def patched(offset: int, layout: str, value: int) -> bytes:
        out = bytearray(body)
        struct.pack_into(layout, out, offset, value)
        return bytes(out)

    cases = {
        "agent name must be": patched(head.size - 7, "<B", 0),                     # no agent name
        "metadata of": patched(head.size - 6, "<I", wire.MAX_AGENT_METADATA_BYTES + 1),
        "1..512 groups": patched(head.size - 2, "<H", 0),
        "name width": patched(group_at + 14, "<B", 0),                               # group 0's width
        "at most 32768 rows": patched(group_at + 15, "<I", wire.MAX_PUSH_ROWS + 1),  # group 0's rows
        "runs for 3 rows": patched(group_at + 19, "<I", 4),                          # more runs than rows
        "must be -1 (host)": patched(group_at + 12, "<h", -2),                       # its memory
    }
    for match, bad in cases.items():
        with pytest.raises(wire.WireError, match=match.replace("(", r"\(").replace(")", r"\)")):
            wire.decode_body(wire.MessageType.PUSH_OFFER, bad)
    with pytest.raises(wire.WireError, match="ends early"):
        wire.decode_body(wire.MessageType.PUSH_OFFER, body[:-4])
    with pytest.raises(wire.WireError, match="trailing"):
        wire.decode_body(wire.MessageType.PUSH_OFFER, body + b"x")
    for bad_runs, match in ((runs((4096, 2), (8192, 2)), "hold 4 rows"), (runs((4096, 0), (8192, 3)), "1..3 rows"),
                            (runs((2**64 - 64, 3)), "64-bit address space")):
        with pytest.raises(wire.WireError, match=match):
            _group(3, bad_runs)
    with pytest.raises(wire.WireError, match="unique"):
        _push(_group(), _group())
    with pytest.raises(wire.WireError, match="remaining_ms"):
        wire.PushOffer(3, 0, b"agent", 1, b"", (_group(),))
    with pytest.raises(wire.WireError, match="at most 32768 rows"):
        _group(wire.MAX_PUSH_ROWS + 1, width=2)
    for kind in (wire.MessageType.WITHDRAW, wire.MessageType.WITHDRAWN):
        assert wire.decode_body(kind, struct.pack("<Q", 9)).offer == 9
        with pytest.raises(wire.WireError, match="ends early"):
            wire.decode_body(kind, b"\x01\x02")
        with pytest.raises(wire.WireError, match="trailing"):
            wire.decode_body(kind, struct.pack("<Q", 9) + b"\x00")
