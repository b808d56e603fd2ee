"""Stores that several processes share, checked across processes: another process publishes,
reads, removes objects and dies while this one works (:attr:`Ends.other_process
<kvwire.testing.harness.Ends.other_process>`, a :class:`~kvwire.testing.processes.StoreProcess`).
What this process must never see: an object read half-written (A7.2), an answer from a stale
view of the store (an object removed by the other process found, or a removal turned into a
fault: A5.7, A5.8), or an object counted held after its bytes are gone (A5.6, S1.3, L1.3).

Rows carry the bytes :func:`~kvwire.testing.processes.row_bytes` derives from their names, so
both processes know every row's bytes without sending them. Every test skips, naming the hook,
for a harness without another process (a store of one process: the memory store)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import pytest

from kvwire.contract import CacheKind, LayerGroupRows, TokenRange, View
from kvwire.contract.lookup import LOOKUP, Lookup
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Harness, Unavailable
from kvwire.testing.holder import submit
from kvwire.testing.marks import checks
from kvwire.testing.processes import StoreProcess, digest, row_bytes
from kvwire.testing.regions import HostMemory

GROUP = 7


def _names(count: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 16, dtype=np.uint8).tobytes() for _ in range(count)]


class _Rows:
    """This process's memory for ``names`` (one row each, ``size`` bytes), registered with
    ``backend``, and views of it."""

    def __init__(self, ex: Exchange, names: Sequence[bytes], size: int, *, sink: bool) -> None:
        self.names = list(names)
        self.size = size
        self.backend = ex.ends.sink if sink else ex.ends.source
        self.memory = HostMemory(size, len(names))
        if not sink:
            self.memory.write(np.arange(len(names)), np.stack([row_bytes(n, size) for n in names]))
        self.registration = self.backend.register_regions([self.memory.region])

    def view(self, rows: Sequence[int] | None = None) -> View:
        rows = list(range(len(self.names))) if rows is None else list(rows)
        packed = np.frombuffer(b"".join(self.names[r] for r in rows), dtype=np.uint8).reshape(len(rows), 16)
        return View((LayerGroupRows(GROUP, CacheKind.PAGED, self.memory.region, np.asarray(rows, dtype=np.int64),
                                    TokenRange(0, 16 * max(1, len(rows))), packed),))

    def check_whole(self, mask: np.ndarray, rows: Sequence[int], clause: str, what: str) -> None:
        """Every row marked true holds the bytes its name stands for, whole."""
        for bit, row in zip(mask.tolist(), rows, strict=True):
            if bit:
                got = self.memory.read([row])[0]
                want = row_bytes(self.names[row], self.size)
                torn = np.flatnonzero(got != want)
                assert torn.size == 0, (
                    f"{clause}: {what}: row {row} is marked true, yet {torn.size} of its {self.size} bytes differ from "
                    f"those published (from byte {int(torn[0])} on): an object read half-written, or stale")

    def close(self) -> None:
        self.registration.close()


@contextmanager
def _shared(harness: Harness) -> Iterator[tuple[Exchange, StoreProcess]]:
    caps = harness.capabilities()
    needs.transfer(caps)
    needs.names(caps)
    with needs.open_exchange(harness) as ex:
        if not ex.store:
            pytest.skip("backend's other end is a peer; a store shared by processes is a store's")
        try:
            other = ex.ends.make_other_process()
        except Unavailable as exc:
            pytest.skip(f"harness cannot provide it: {exc}")
        yield ex, other


def _fetch(ex: Exchange, rows: _Rows, which: Sequence[int] | None = None):  # type: ignore[no-untyped-def]
    which = list(range(len(rows.names))) if which is None else list(which)
    return ex.settle(submit(rows.backend, "fetch", rows.view(which), ex.ends.fetch_hint)), which


@checks("A7.2", "A7.1", "A5.8", "S1.3")
def test_A7_an_object_another_process_publishes_is_read_whole_or_missed(kvwire_harness: Harness) -> None:
    """A7.2 / A7.1 / A5.8 / S1.3: while another process publishes 256 KiB objects in rounds, this
    process fetches all of them again and again: each fetch delivers (what is not there yet is a
    miss), and every row marked true holds the published bytes whole, never an object half
    written; once the other process is done, every object is found."""
    size, count = 256 << 10, 24
    names = _names(count, 4001)
    with _shared(kvwire_harness) as (ex, other):
        rows = _Rows(ex, names, size, sink=True)
        try:
            other.start_publishing(GROUP, names, size, rounds=6)
            while True:
                done = other.publishing_done()  # before the fetch: a fetch after it must find all
                out, which = _fetch(ex, rows)
                assert out.is_delivered, (
                    f"A5.8: a fetch while another process publishes must deliver (objects not there yet are misses), "
                    f"got {out!r}")
                rows.check_whole(out.masks[0], which, "A7.2", "a fetch while another process published")
                if done:
                    break
            assert out.masks[0].all(), (
                f"S1.3: once the other process published every object, a fetch found only {int(out.masks[0].sum())} "
                f"of {count}: {out!r}")
        finally:
            rows.close()


@checks("A5.7", "A5.8", "A5.6", "S1.3", "L1.3", also=("S1.2",))
def test_A5_an_object_another_process_removed_is_a_miss_never_held(kvwire_harness: Harness) -> None:
    """A5.7 / A5.8 / A5.6 / S1.3 / L1.3: objects another process published are found here; once it
    removed half of them (as an eviction does), a fetch here delivers with exactly those rows
    false (a miss, never a fault, never a stale true bit) and, where the backend declares
    ``lookup``, a lookup says exactly the rest are held; this process then publishes the removed
    ones again, each marked held, and the other process finds all of them, byte for byte (nothing
    was counted held after its bytes were gone)."""
    size, count = 4096, 12
    names = _names(count, 4003)
    gone = list(range(0, count, 2))
    with _shared(kvwire_harness) as (ex, other):
        published = other.publish(GROUP, names, size)
        assert published.all(), f"S1.2: the other process's publish to a store with room: {published.tolist()}"
        rows = _Rows(ex, names, size, sink=True)
        again = _Rows(ex, [names[r] for r in gone], size, sink=False)
        lookup = ex.ends.sink if LOOKUP in ex.caps.protocols and isinstance(ex.ends.sink, Lookup) else None
        packed = np.frombuffer(b"".join(names), dtype=np.uint8).reshape(count, 16)
        try:
            out, which = _fetch(ex, rows)
            assert out.is_delivered and out.masks[0].all(), (
                f"S1.3: objects another process published must be found here: {out!r}")
            rows.check_whole(out.masks[0], which, "A7.1", "objects another process published")
            if lookup is not None:
                held = np.asarray(lookup.lookup([GROUP], packed, ex.ends.fetch_hint))
                assert held.all(), f"L1.3: objects another process published are held: {held.astype(int).tolist()}"
            other.remove(GROUP, [names[r] for r in gone])
            rows.memory.write(np.arange(count), np.zeros((count, size), dtype=np.uint8))
            out, which = _fetch(ex, rows)
            expected = np.ones(count, dtype=bool)
            expected[gone] = False
            assert out.is_delivered, (
                f"A5.8: objects another process removed are misses, never a failure: the fetch gave {out!r}")
            assert np.array_equal(out.masks[0], expected), (
                f"A5.7: after another process removed objects {gone}, a fetch here marked "
                f"{out.masks[0].astype(int).tolist()}; a removed object is a miss (a store answering from a stale "
                "view of itself)")
            rows.check_whole(out.masks[0], which, "A7.1", "the objects another process kept")
            if lookup is not None:
                held = np.asarray(lookup.lookup([GROUP], packed, ex.ends.fetch_hint))
                assert np.array_equal(held, expected), (
                    f"L1.3: after another process removed objects {gone}, a lookup here answers "
                    f"{held.astype(int).tolist()}; a bit is true exactly when the store holds the name now")
            put = ex.settle(submit(again.backend, "publish", again.view(), ex.ends.publish_hint))
            assert put.is_delivered and put.masks[0].all(), (
                f"A5.6: a publish here of the objects another process removed: {put!r}")
            status, mask, digests = other.fetch(GROUP, names, size)
            want = [digest(row_bytes(n, size)) for n in names]
            assert status == "delivered" and mask.all() and digests == want, (
                f"A5.6/S1.3: this process's publish marked objects {gone} held, yet another process's fetch of every "
                f"object gave {status}, mask {mask.astype(int).tolist()}, "
                f"{sum(d != w for d, w in zip(digests, want, strict=True))} row(s) with other bytes: an object counted "
                "held after its bytes were gone")
        finally:
            rows.close()
            again.close()


@checks("A8.5", "A7.2", "S1.3", also=("S1.2",))
def test_A8_another_process_dying_mid_publish_leaves_the_store_working(kvwire_harness: Harness) -> None:
    """A8.5 / A7.2 / S1.3: another process is killed (SIGKILL) while it publishes 2 MiB objects,
    its store calls and locks left as they were; this process goes on: a fetch of everything the
    other process was publishing concludes by its deadline and marks only whole objects, and a
    publish and a fetch of its own rows deliver, each found byte for byte."""
    size, count = 2 << 20, 16
    names = _names(count, 4005)
    mine = _names(4, 4007)
    deadline_s = 5.0
    with _shared(kvwire_harness) as (ex, other):
        rows = _Rows(ex, names, size, sink=True)
        own = _Rows(ex, mine, 4096, sink=False)
        back = _Rows(ex, mine, 4096, sink=True)
        hint = ex.ends.fetch_hint
        timed = type(hint)(hint.kind, hint.fields, deadline_s)
        try:
            other.start_publishing(GROUP, names, size, rounds=8)
            other.wait_round(3)  # submitting its fourth round: a write of the store under way
            other.kill()
            patience = profiles.active().patience_s
            out = ex.settle(submit(rows.backend, "fetch", rows.view(), timed), purpose=(
                f"A8.5: a fetch (deadline {deadline_s:g} s) after another process died mid-publish, concluding"))
            rows.check_whole(out.masks[0], list(range(count)), "A7.2", "objects a process killed mid-publish wrote")
            put = ex.settle(submit(own.backend, "publish", own.view(), timed),
                            purpose="A8.5: a publish after another process died mid-publish, concluding")
            assert put.is_delivered and put.masks[0].all(), (
                f"S1.2: a publish after another process died mid-publish must deliver: {put!r}")
            got = ex.settle(submit(back.backend, "fetch", back.view(), timed),
                            purpose="A8.5: a fetch of this process's own rows, concluding")
            assert got.is_delivered and got.masks[0].all(), (
                f"S1.3: rows this process published after another died mid-publish must be found: {got!r} "
                f"(patience {patience:g} s)")
            back.check_whole(got.masks[0], list(range(len(mine))), "A7.1", "rows published after another process died")
        finally:
            rows.close()
            own.close()
            back.close()
