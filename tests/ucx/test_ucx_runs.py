"""Rows as runs (issue 33). One-sided: the answer names runs of rows adjacent in the serving
end's memory, and the requester reads them, coalesced again with its own adjacency, in batches
of ranges. Two-sided: one tag message per run of rows adjacent at both ends (the Pull names the
requester's breaks, the Offer the serving end's). Checked here without NIXL or a peer: a fake
agent copies the bytes each descriptor names, a fake fabric matches tags and copies messages, so
any row layout at either end (adjacent, reversed, interleaved groups, partial prefixes) is
compared byte for byte, through the real codec, planner, batcher and row movers."""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.testing.require import backend_module

backend_module("ucxx._lib.libucxx", "ucx", "ucxx-cu12==0.52.0")  # skips, or fails when the run requires ucx
from kvwire_ucx import wire  # noqa: E402
from kvwire_ucx.nixl_reads import RangeReads  # noqa: E402
from kvwire_ucx.protocol import events as ev  # noqa: E402
from kvwire_ucx.regions import GroupRows, RowRuns  # noqa: E402
from kvwire_ucx.serving import fit_read_offer, offer_runs  # noqa: E402
from kvwire_ucx.tag_rows import PostError, TagReceives, TagSends, own_breaks  # noqa: E402

HERE_BASE = 1 << 32   # where the requester's buffer lies in the fake address space
THERE_BASE = 1 << 40  # and the serving end's


class FakeNixl:
    """Copies the bytes each read names from ``there`` into ``here`` (both at fake addresses);
    counts the transfers and descriptors; a read finishes at once, or on its first poll."""

    def __init__(self, here: np.ndarray, there: np.ndarray, *, at_once: bool = True) -> None:
        self.here, self.there = here, there
        self.at_once = at_once
        self.transfers: list[tuple[np.ndarray, np.ndarray]] = []
        self.held: set[int] = set()

    def read(self, local: np.ndarray, remote: np.ndarray, peer: bytes, memories: tuple[int, int] = (-1, -1)
             ) -> tuple[Any, bool]:
        assert local.shape == remote.shape and local.shape[1] == 3
        assert (local[:, 1] == remote[:, 1]).all()
        for (to, n, _), (frm, _, _) in zip(local.tolist(), remote.tolist(), strict=True):
            src = frm - THERE_BASE
            dst = to - HERE_BASE
            assert 0 <= src and src + n <= len(self.there) and 0 <= dst and dst + n <= len(self.here)
            self.here[dst:dst + n] = self.there[src:src + n]
        self.transfers.append((local.copy(), remote.copy()))
        handle = len(self.transfers)
        if not self.at_once:
            self.held.add(handle)
        return handle, self.at_once

    def done(self, handle: Any) -> bool:
        return True

    def release(self, handle: Any) -> bool:
        self.held.discard(handle)
        return True


def group_rows(group_id: int, slot: int, cells: list[int], base: int, buffer: np.ndarray,
               tell_adjacent: bool = False) -> GroupRows:
    """``tell_adjacent``: say that the rows lie one after another when they do, as the backend's
    located rows say for a view of consecutive slots (else it is left unknown)."""
    offsets = np.asarray(cells, dtype=np.uint64) * np.uint64(slot)
    offsets.flags.writeable = False
    adjacent = tell_adjacent and bool(cells) and cells == list(range(cells[0], cells[0] + len(cells)))
    return GroupRows(group_id, slot, buffer, offsets, base, adjacent=adjacent)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, list[list[int]], list[list[int]], tuple[int, ...]]:
    """``(slot, blocks, cells there, cells here, counts)``: each end's rows are cells of one
    buffer (so groups may interleave), laid out sorted, interleaved, reversed, in runs or at
    random; the serving end offers a prefix per group."""
    groups = draw(st.integers(1, 3))
    blocks = draw(st.integers(1, 12))
    slot = draw(st.sampled_from([1, 3, 8, 64]))

    def end() -> list[list[int]]:
        n = groups * blocks
        kind = draw(st.sampled_from(["sorted", "interleaved", "reversed", "runs", "random"]))
        if kind == "sorted":
            cells = list(range(n))
        elif kind == "interleaved":
            cells = [i * groups + g for g in range(groups) for i in range(blocks)]
        elif kind == "reversed":
            cells = list(range(n))[::-1]
        elif kind == "runs":  # runs of random length placed in random order, gaps between
            cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4))))
            pieces = [list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, n], strict=True) if a < b]
            order = draw(st.permutations(range(len(pieces))))
            start, cursor = {}, 0
            for p in order:  # the pieces of rows in memory in another order, with gaps
                start[p] = cursor
                cursor += len(pieces[p]) + draw(st.integers(0, 1))
            cells = [start[p] + j for p, piece in enumerate(pieces) for j in range(len(piece))]
        else:
            cells = list(draw(st.permutations(range(2 * n))))[:n]
        return [cells[g * blocks:(g + 1) * blocks] for g in range(groups)]

    counts = tuple(draw(st.lists(st.integers(0, blocks), min_size=groups, max_size=groups)))
    return slot, blocks, end(), end(), counts


def read_through_the_wire(slot: int, blocks: int, there_cells: list[list[int]], here_cells: list[list[int]],
                          counts: tuple[int, ...], step: int, at_once: int, immediate: bool = True,
                          tell_adjacent: bool = False) -> tuple[np.ndarray, np.ndarray, FakeNixl, wire.ReadOffer]:
    """The serving end's answer encoded and decoded, then read as the requester reads it."""
    groups = len(counts)
    cells = 4 * groups * blocks + 2
    there = np.frombuffer(np.random.default_rng(7).bytes(cells * slot), dtype=np.uint8).copy()
    here = np.zeros(cells * slot, dtype=np.uint8)
    serving = tuple(group_rows(g, slot, there_cells[g], THERE_BASE, there) for g in range(groups))
    requesting = tuple(group_rows(g, slot, here_cells[g], HERE_BASE, here, tell_adjacent) for g in range(groups))
    offer = wire.ReadOffer(5, counts, b"agent", 1, b"", offer_runs(serving, counts))
    decoded = wire.decode(wire.encode(offer))
    assert isinstance(decoded, wire.ReadOffer) and decoded == offer
    nixl = FakeNixl(here, there, at_once=immediate)
    reads = RangeReads(nixl, requesting, "P")  # type: ignore[arg-type]
    reads.peer_agent = b"agent"
    reads.remote = tuple(decoded.checked_runs(g, slot) for g in range(groups))
    longest = max(counts)
    ranges = tuple((b, min(b + step, longest)) for b in range(0, longest, step))
    reads.plan(counts, ranges)
    for first in range(0, len(ranges), at_once):
        result = reads.start(first, min(len(ranges), first + at_once))
        if not immediate:
            assert result is None and reads.running
            result = reads.poll()
        assert isinstance(result, ev.ReadCompleted) and not reads.running
    return here, there, nixl, decoded


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.integers(1, 5), st.integers(1, 4), st.booleans(), st.booleans())
def test_any_layout_at_either_end_lands_every_offered_row_and_nothing_else(layout, step, at_once, immediate,
                                                                           tell_adjacent) -> None:
    slot, blocks, there_cells, here_cells, counts = layout
    if not any(counts):
        return
    here, there, nixl, offer = read_through_the_wire(slot, blocks, there_cells, here_cells, counts, step, at_once,
                                                     immediate, tell_adjacent)
    expected = np.zeros_like(here)
    for g, count in enumerate(counts):
        for i in range(count):
            src, dst = there_cells[g][i] * slot, here_cells[g][i] * slot
            expected[dst:dst + slot] = there[src:src + slot]
    assert np.array_equal(here, expected)
    # the answer names no more runs than rows, and one per run of rows adjacent there
    for g, count in enumerate(counts):
        breaks = sum(1 for i in range(1, count) if there_cells[g][i] != there_cells[g][i - 1] + 1)
        assert len(offer.runs[g]) == (breaks + 1 if count else 0)
    # and the reads name no more spans than rows adjacent at neither end... at most one per row
    assert sum(len(local) for local, _ in nixl.transfers) <= sum(counts)


@pytest.mark.parametrize("tell_adjacent", [False, True], ids=["found", "told"])
def test_an_answer_of_rows_adjacent_there_is_one_run_and_is_read_as_one_span(tell_adjacent: bool) -> None:
    """The bench's layout (block i in slot i at both ends): 1000 rows are one run on the wire
    (12 bytes, not 8000) and one descriptor of one NIXL transfer, though planned as 10 ranges;
    the same whether the requester's rows are found adjacent or said to be (located)."""
    blocks = 1000
    cells = [list(range(blocks))]
    here, there, nixl, offer = read_through_the_wire(16, blocks, cells, cells, (blocks,), step=100, at_once=64,
                                                     tell_adjacent=tell_adjacent)
    assert offer.runs[0].tolist() == [[THERE_BASE, blocks]]
    frame = wire.encode(offer)
    assert len(frame) - wire.HEADER_BYTES == wire.ReadOffer.body_bytes(1, 1, b"agent", b"") - 2  # host: no memories
    assert len(nixl.transfers) == 1 and nixl.transfers[0][0].tolist() == [[HERE_BASE, 16 * blocks, 0]]
    assert np.array_equal(here[:16 * blocks], there[:16 * blocks])


def test_rows_adjacent_at_one_end_only_are_read_row_by_row() -> None:
    """Adjacent there, reversed here: one run on the wire, but no two rows can share a span."""
    here, there, nixl, offer = read_through_the_wire(8, 6, [[0, 1, 2, 3, 4, 5]], [[5, 4, 3, 2, 1, 0]], (6,), 6, 1)
    assert len(offer.runs[0]) == 1 and len(nixl.transfers) == 1 and len(nixl.transfers[0][0]) == 6
    for i in range(6):
        assert np.array_equal(here[(5 - i) * 8:(6 - i) * 8], there[i * 8:(i + 1) * 8])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=30, unique=True), st.sampled_from([1, 8, 64]))
def test_the_runs_of_any_leading_rows_are_taken_from_runs_made_once(cells: list[int], slot: int) -> None:
    """What an offer makes once (RowRuns) gives, for every prefix of its rows, the runs a walk
    over those rows finds: each run's first row's address and how many rows follow it there."""
    addresses = np.asarray(cells, dtype=np.uint64) * np.uint64(slot) + np.uint64(THERE_BASE)
    made = RowRuns(addresses, slot)
    for count in range(len(cells) + 1):
        walked: list[list[int]] = []
        for i in range(count):
            if walked and cells[i] == cells[i - 1] + 1:
                walked[-1][1] += 1
            else:
                walked.append([THERE_BASE + cells[i] * slot, 1])
        assert made.prefix(count).tolist() == walked
        assert made.count(count) == len(walked)


def test_the_fit_counts_runs_not_rows() -> None:
    """An answer is cut to what one frame holds: by its runs, so a long pull of adjacent rows is
    never cut, and one of scattered rows is cut where its runs stop fitting."""
    blocks = wire.MAX_BLOCKS
    adjacent = (group_rows(0, 64, list(range(blocks)), THERE_BASE, np.zeros(0, np.uint8)),) * 4
    assert fit_read_offer((blocks,) * 4, adjacent, b"agent", b"") == (blocks,) * 4
    scattered = tuple(group_rows(g, 64, list(range(0, 2 * blocks, 2)), THERE_BASE, np.zeros(0, np.uint8))
                      for g in range(wire.MAX_GROUPS))
    cut = fit_read_offer((blocks,) * wire.MAX_GROUPS, scattered, b"agent", b"")
    runs = sum(cut)
    assert wire.ReadOffer.body_bytes(wire.MAX_GROUPS, runs, b"agent", b"") <= wire.MAX_MESSAGE_BYTES
    assert wire.ReadOffer.body_bytes(wire.MAX_GROUPS, runs + wire.MAX_GROUPS, b"agent", b"") > wire.MAX_MESSAGE_BYTES
    assert len(set(cut)) == 1 and 0 < cut[0] < blocks


# ---------------------------------------------------------------- the decoder's bounds on runs

def _body(counts: tuple[int, ...], nruns: tuple[int, ...], runs: list[tuple[list[int], list[int]]]) -> bytes:
    head = struct.pack("<QQBIH", 5, 1, 5, 0, len(counts)) + b"agent"
    body = head + struct.pack(f"<{len(counts)}I", *counts) + struct.pack(f"<{len(nruns)}I", *nruns)
    for addresses, rows in runs:
        body += struct.pack(f"<{len(addresses)}Q", *addresses) + struct.pack(f"<{len(rows)}I", *rows)
    return body


def test_run_lists_that_do_not_add_up_are_refused_with_their_bounds() -> None:
    decode = lambda body: wire.decode_body(wire.MessageType.READ_OFFER, body)  # noqa: E731
    good = decode(_body((3,), (2,), [([0, 64], [2, 1])]))
    assert isinstance(good, wire.ReadOffer) and good.runs[0].tolist() == [[0, 2], [64, 1]]
    for counts, nruns, runs, match in (
        ((3,), (4,), [([0, 1, 2, 3], [1, 1, 1, 0])], "4 runs for 3 rows"),       # more runs than rows
        ((3,), (0,), [([], [])], "0 runs for 3 rows"),                           # rows without a run
        ((0,), (1,), [([0], [1])], "1 runs for 0 rows"),                         # a run without rows
        ((3,), (2,), [([0, 64], [2, 2])], "hold 4 rows, not its 3"),             # rows do not add up
        ((3,), (2,), [([0, 64], [3, 0])], "1..3 rows each"),                     # an empty run
        ((3,), (1,), [([0], [2**32 - 1])], "1..3 rows each"),                    # a huge run
        ((2, 1), (1, 1), [([0], [2]), ([0], [2])], "group 1"),                   # the second group's
    ):
        with pytest.raises(wire.WireError, match=match):
            decode(_body(counts, nruns, runs))
    with pytest.raises(wire.WireError, match="ends early"):  # announces 2**31 runs: refused before it reads them
        decode(_body((wire.MAX_BLOCKS,), (wire.MAX_BLOCKS,), [([0], [wire.MAX_BLOCKS])]))
    with pytest.raises(wire.WireError, match="4294967295 runs for 3 rows"):
        decode(_body((3,), (2**32 - 1,), []))


def test_runs_past_the_address_space_are_refused_when_read() -> None:
    offer = wire.ReadOffer(5, (3,), b"agent", 1, b"", (np.array([[2**64 - 128, 3]], dtype=np.uint64),))
    assert offer.checked_runs(0, 32).tolist() == [[2**64 - 128, 3]]  # its last row ends at 2**64 - 32
    with pytest.raises(wire.WireError, match="64-bit address space"):
        offer.checked_runs(0, 64)


def test_a_frame_of_an_earlier_wire_version_is_refused_by_name() -> None:
    """Wire version 2 changed the ReadOffer, 3 the Pull and the Offer, 4 the Hello (pushed
    offers); an end of an earlier version is told at its first frame."""
    assert wire.WIRE_VERSION == 4
    for version in range(1, wire.WIRE_VERSION):
        old = struct.pack("<4sBBHI", b"KVWC", version, wire.MessageType.HELLO, 0, 0)
        with pytest.raises(wire.WireError, match=rf"version {version} is not supported \(this end speaks 4\)"):
            wire.FrameReader().feed(old)


# ================================================================ two-sided: one message per run

class FakeRequest:
    def __init__(self) -> None:
        self.completed = False
        self.error: Exception | None = None

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error


class FakeFabric:
    """Tag matching between one worker (receives) and one endpoint (sends): a send and a
    receive of one tag match, whichever comes first; their sizes must be equal (each end cut
    the same message), and the bytes are copied."""

    def __init__(self) -> None:
        self.receives: dict[int, list[tuple[Any, FakeRequest]]] = {}
        self.sends: dict[int, list[tuple[Any, FakeRequest]]] = {}
        self.messages: list[tuple[int, int]] = []  # (tag, bytes) of every matched message
        self.control: list[wire.Message] = []  # what the requester said, when a machine drives it

    def _match(self, tag: int) -> None:
        while self.receives.get(tag) and self.sends.get(tag):
            (into, received), (out, sent) = self.receives[tag].pop(0), self.sends[tag].pop(0)
            assert into.nbytes == out.nbytes, f"tag {tag:#x}: a message of {out.nbytes} bytes into {into.nbytes}"
            ctypes.memmove(into.ptr, out.ptr, out.nbytes)
            received.completed = sent.completed = True
            self.messages.append((tag, out.nbytes))

    def tag_recv(self, buffer: Any, tag: Any) -> FakeRequest:
        request = FakeRequest()
        self.receives.setdefault(tag.value, []).append((buffer, request))
        self._match(tag.value)
        return request

    def tag_send(self, buffer: Any, tag: Any) -> FakeRequest:
        request = FakeRequest()
        self.sends.setdefault(tag.value, []).append((buffer, request))
        self._match(tag.value)
        return request

    def drain(self, tags: list[int]) -> None:
        """The requester's zero-byte messages to itself: each completes one receive of its tag."""
        for tag in tags:
            _buffer, request = self.receives[tag].pop(0)
            request.completed = True

    def unmatched(self) -> tuple[list[int], list[int]]:
        return ([t for t, q in self.receives.items() for _ in q], [t for t, q in self.sends.items() for _ in q])


def _windows(counts: tuple[int, ...], credit: int, window: int) -> list[tuple[int, int]]:
    """The Go windows after the credit (block-major, ``window`` numbers each) up to the last
    offered row."""
    limit = ev.offered_limit(counts)
    return [(s, min(s + window, limit)) for s in range(credit, limit, window)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.integers(0, 40), st.integers(1, 12))
def test_two_sided_messages_agree_at_both_ends_for_any_layout(layout, credit, window) -> None:
    """The credit (one receive per row, posted before the answer), then windows cut into
    messages by both ends' breaks: every send meets a receive of its size, every offered row
    lands byte for byte, and only the credit's receives of rows not offered stay unmatched (the
    requester drains those)."""
    slot, blocks, there_cells, here_cells, counts = layout
    groups = len(counts)
    credit = min(credit, groups * blocks)
    cells = 4 * groups * blocks + 2
    there = np.frombuffer(np.random.default_rng(3).bytes(cells * slot), dtype=np.uint8).copy()
    here = np.zeros(cells * slot, dtype=np.uint8)
    serving = tuple(group_rows(g, slot, there_cells[g], 0, there) for g in range(groups))
    requesting = tuple(group_rows(g, slot, here_cells[g], 0, here) for g in range(groups))
    fabric = FakeFabric()

    pull = wire.decode(wire.encode(wire.Pull(1, 9, 100, tuple((g, slot) for g in range(groups)), 1, bytes(blocks),
                                             credit=credit, breaks=own_breaks(requesting))))
    assert isinstance(pull, wire.Pull)
    receives = TagReceives(requesting, 9, pull.breaks)
    receives.post(fabric, 0, credit, None)                       # before the Pull: one per row
    sends = TagSends(serving, 9, pull.credit, pull.breaks)
    offer = wire.decode(wire.encode(wire.Offer(1, counts, sends.offer_breaks(counts))))
    assert isinstance(offer, wire.Offer)
    sends.post(fabric, 0, credit, counts, ev.offered_limit(counts))  # the credit, right after the Offer
    receives.learn(offer.breaks)
    for start, end in _windows(counts, credit, window):
        receives.post(fabric, start, end, counts)                # then a Go names the window
        sends.post(fabric, start, end, counts, ev.offered_limit(counts))

    stuck_receives, stuck_sends = fabric.unmatched()
    assert not stuck_sends
    width = groups
    unoffered = sorted((9 << wire.TAG_ROW_BITS) | (ri * width + gi) for gi in range(groups)
                       for ri in range(blocks) if ri * width + gi < credit and ri >= counts[gi])
    assert sorted(stuck_receives) == unoffered == sorted(receives.drain_tags(counts))
    fabric.drain(receives.drain_tags(counts))
    done = receives.reap()
    offered = sum(counts)
    assert not receives.posted and (done is not None or offered + credit == 0)
    if done is not None:
        arrived = done.rows < np.asarray(counts)[done.groups]
        assert arrived.sum() == offered and not done.failures
    expected = np.zeros_like(here)
    for g, count in enumerate(counts):
        for i in range(count):
            src, dst = there_cells[g][i] * slot, here_cells[g][i] * slot
            expected[dst:dst + slot] = there[src:src + slot]
    assert np.array_equal(here, expected)
    sent = sends.reap()
    assert sent is None and offered == 0 or sent is not None and sent.ok == offered


def test_rows_adjacent_at_both_ends_go_as_one_message_per_window() -> None:
    """1000 blocks of one group in slot i at both ends, no credit, windows of 400 rows: three
    messages (one per window), not a thousand."""
    fabric = FakeFabric()
    blocks, slot = 1000, 16
    here, there = np.zeros(blocks * slot, np.uint8), np.arange(blocks * slot, dtype=np.uint64).astype(np.uint8)
    requesting = (group_rows(0, slot, list(range(blocks)), 0, here),)
    serving = (group_rows(0, slot, list(range(blocks)), 0, there),)
    receives = TagReceives(requesting, 1, own_breaks(requesting))
    sends = TagSends(serving, 1, 0, own_breaks(requesting))
    offer = wire.Offer(1, (blocks,), sends.offer_breaks((blocks,)))
    assert offer.breaks == ((),)
    receives.learn(offer.breaks)
    for start in range(0, blocks, 400):
        receives.post(fabric, start, min(start + 400, blocks), (blocks,))
        sends.post(fabric, start, min(start + 400, blocks), (blocks,), blocks)
    assert [n for _, n in fabric.messages] == [400 * slot, 400 * slot, 200 * slot]
    assert np.array_equal(here, there) and receives.reap() is not None


def test_a_message_is_never_received_into_rows_lent_apart() -> None:
    """Rows lent apart at the requester cannot share a receive: were the cuts to miss one of its
    breaks (a Pull that lied about them, say), posting refuses instead of spilling the message
    over the rows between."""
    fabric = FakeFabric()
    here = np.zeros(64, np.uint8)
    requesting = (group_rows(0, 8, [0, 1, 5, 6], 0, here),)
    assert own_breaks(requesting) == ((2,),)
    lying = TagReceives(requesting, 1, ((),))  # claims its rows are adjacent
    lying.learn(((),))
    with pytest.raises(PostError, match="not adjacent") as caught:
        lying.post(fabric, 0, 4, (4,))
    assert caught.value.unposted is not None and len(caught.value.unposted) == 4 and not lying.posted
    swapped = (group_rows(0, 8, [0, 2, 1, 3], 0, here),)  # first and last where a run would put them
    lying_too = TagReceives(swapped, 1, ((),))
    lying_too.learn(((),))
    with pytest.raises(PostError, match="not adjacent"):
        lying_too.post(fabric, 0, 4, (4,))
    honest = TagReceives(requesting, 1, own_breaks(requesting))
    honest.learn(((),))
    honest.post(fabric, 0, 4, (4,))
    assert [(ri, n) for _r, _b, _g, ri, n in honest.posted] == [(0, 2), (2, 2)]


def test_breaks_that_are_not_rows_ascending_within_the_pull_are_refused() -> None:
    pull = wire.Pull(1, 1, 1, ((0, 8), (1, 8)), 1, b"abcd", breaks=((1, 3), None))
    assert wire.decode(wire.encode(pull)) == pull
    body = wire.encode(pull)[wire.HEADER_BYTES:]
    tail = len(body) - (4 + 8 + 4)  # where the breaks begin
    for bad, match in ((struct.pack("<III", 2, 3, 1), "ascending"), (struct.pack("<III", 2, 1, 4), "ascending"),
                       (struct.pack("<II", 1, 0), "ascending"), (struct.pack("<IIIII", 4, 1, 2, 3, 3), "4 breaks"),
                       (struct.pack("<I", 5), "5 breaks")):
        with pytest.raises(wire.WireError, match=match):
            wire.decode_body(wire.MessageType.PULL, body[:tail] + bad + struct.pack("<I", wire.EVERY_ROW))
    with pytest.raises(wire.WireError, match="ends early"):
        wire.decode_body(wire.MessageType.PULL, body[:tail] + struct.pack("<II", 2, 1))
    with pytest.raises(wire.WireError):
        wire.Offer(1, (3,), ((0,),))
    with pytest.raises(wire.WireError, match="breaks for 1 groups"):
        wire.Offer(1, (3, 3), ((1,),))
    with pytest.raises(wire.WireError, match="one-sided"):
        wire.Pull(1, 1, 1, ((0, 8),), 1, b"a", one_sided=True, breaks=((),))
    offer = wire.Offer(1, (3, 0), ((2,), ()))
    assert wire.decode(wire.encode(offer)) == offer and wire.Offer(1, (3,)).breaks == (None,)


def test_breaks_too_many_for_a_frame_fall_back_to_every_row_alone() -> None:
    scattered = tuple(tuple(range(1, wire.MAX_BLOCKS)) for _ in range(64))
    room = wire.offer_breaks_room(64)
    fitted = wire.fit_breaks(scattered, room)
    assert any(b is None for b in fitted) and any(b is not None for b in fitted)
    offer = wire.Offer(1, (wire.MAX_BLOCKS,) * 64, fitted)
    assert len(wire.encode(offer)) - wire.HEADER_BYTES <= wire.MAX_MESSAGE_BYTES
    assert wire.fit_breaks(((), (1,)), room) == ((), (1,))


# ---------------------------------------------------------------- both machines over the fake fabric

def pull_through_both_machines(slot: int, blocks: int, there_cells: list[list[int]], here_cells: list[list[int]],
                               counts: tuple[int, ...], window_rows: int, credit_rows: int
                               ) -> tuple[np.ndarray, np.ndarray, Any, Any, FakeFabric]:
    """A pull run by the requesting and serving machines, their control messages through the
    codec, their actions carried out by the real row movers over :class:`FakeFabric` (a small
    engine: what the real one does with each action, minus timers and sockets)."""
    from kvwire_ucx.protocol.requester import PullRequester, PullSpec
    from kvwire_ucx.protocol.server import PullServer, ReplySpec

    groups = len(counts)
    cells = 4 * groups * blocks + 2
    there = np.frombuffer(np.random.default_rng(5).bytes(cells * slot), dtype=np.uint8).copy()
    here = np.zeros(cells * slot, dtype=np.uint8)
    serving = tuple(group_rows(g, slot, there_cells[g], 0, there) for g in range(groups))
    requesting = tuple(group_rows(g, slot, here_cells[g], 0, here) for g in range(groups))
    fabric = FakeFabric()
    spec = PullSpec(3, 11, tuple(range(groups)), (slot,) * groups, blocks, 1, bytes(blocks), 5.0, window_rows * slot,
                    breaks=own_breaks(requesting), credit_bytes=credit_rows * slot)
    r = PullRequester(spec)
    receives = TagReceives(requesting, 11, r.breaks)
    s: PullServer | None = None
    sends: TagSends | None = None
    to_server: list[wire.Message] = []
    to_requester: list[wire.Message] = []

    def wire_copy(message: wire.Message) -> wire.Message:
        return wire.decode(wire.encode(message))

    def run_r(event: Any) -> None:
        if r.state.name == "DONE":  # a finished job hears nothing more (the engine forgets it)
            return
        for action in r.handle(event):
            if isinstance(action, ev.Send):
                to_server.append(wire_copy(action.message))
                fabric.control.append(to_server[-1])
            elif isinstance(action, ev.PostReceives):
                receives.post(fabric, action.start, action.end, action.counts)
            elif isinstance(action, ev.Drain):
                fabric.drain(receives.drain_tags(action.counts))

    def run_s(event: Any) -> None:
        assert s is not None and sends is not None
        if s.state.name == "DONE":
            return
        for action in s.handle(event):
            if isinstance(action, ev.Send):
                to_requester.append(wire_copy(action.message))
            elif isinstance(action, ev.SendRows):
                sends.post(fabric, action.start, action.end, action.counts, s.limit)

    run_r(ev.Start(5000))
    for _ in range(10_000):
        progressed = False
        while to_server:
            message = to_server.pop(0)
            progressed = True
            if isinstance(message, wire.Pull):
                s = PullServer(ReplySpec(message.transfer, message.credit, groups, message.count))
                sends = TagSends(serving, message.tag_base, message.credit, message.breaks)
                run_s(ev.Answered(counts, (blocks,) * groups, None, sends.offer_breaks(counts)))
            elif isinstance(message, wire.Go):
                run_s(ev.GoReceived(message.start, message.end))
            elif isinstance(message, wire.Ack):
                run_s(ev.AckReceived(message.rows))
        while to_requester:
            message = to_requester.pop(0)
            progressed = True
            assert isinstance(message, wire.Offer)
            receives.learn(message.breaks)
            run_r(ev.Offered(message.counts, message.breaks))
        done = receives.reap()
        if done is not None:
            progressed = True
            run_r(done)
        if sends is not None and (sent := sends.reap()) is not None:
            progressed = True
            run_s(sent)
        if not progressed:
            break
    return here, there, r, s, fabric


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.integers(1, 12), st.integers(1, 12))
def test_both_machines_finish_any_layout_with_every_receive_accounted(layout, window_rows, credit_rows) -> None:
    """The requester sizes each window in receives from both ends' breaks, the mover cuts the
    same messages: the pull ends delivered at both ends with nothing posted, nothing unmatched,
    no receive counted twice or never, and every offered row in place."""
    slot, blocks, there_cells, here_cells, counts = layout
    here, there, r, s, fabric = pull_through_both_machines(slot, blocks, there_cells, here_cells, counts,
                                                           window_rows, credit_rows)
    assert r.state.name == "DONE" and r.outstanding == 0 and r.receives_out == 0 and r.received == sum(counts)
    assert s is not None and s.state.name == "DONE" and s.outstanding == 0
    assert fabric.unmatched() == ([], [])
    expected = np.zeros_like(here)
    for g, count in enumerate(counts):
        for i in range(count):
            src, dst = there_cells[g][i] * slot, here_cells[g][i] * slot
            expected[dst:dst + slot] = there[src:src + slot]
    assert np.array_equal(here, expected)
    assert [m[: c].all() and not m[c:].any() for m, c in zip(r.masks, counts, strict=True)] == [True] * len(counts)


def test_a_pull_of_adjacent_rows_takes_one_go_after_the_credit() -> None:
    """256 blocks of 2 groups adjacent at both ends, a window of 64 rows' receives, a credit of 4
    rows: after the Offer one Go names every row left, and it moves as 2 messages."""
    cells = [list(range(0, 256)), list(range(300, 556))]
    here, there, r, s, fabric = pull_through_both_machines(8, 256, cells, cells, (256, 256), 64, 4)
    gos = [m for m in fabric.control if isinstance(m, wire.Go)]
    assert r.state.name == "DONE" and gos == [wire.Go(3, 4, 512)]
    sizes = sorted(n for _, n in fabric.messages)
    assert len(sizes) == 4 + 2 and sizes[-2:] == [8 * 254, 8 * 254]  # 4 credit rows, then one run per group
