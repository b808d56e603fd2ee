"""Large batches copied on several threads (the ``copy_threads`` option, :class:`CopyPool`):
the same bytes as one thread copies, for any layout of rows; the threads start only when a
large batch comes and are joined at close; a copy that fails or an attempt cancelled mid-copy
leaves the store as it was or whole. No timing is asserted here."""

from __future__ import annotations

import threading

import kvwire_memory.store as store_module
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvwire_memory import CopyPool, MemoryDriver, MemoryStore
from kvwire_memory.store import PARALLEL_COPY_BYTES, split_runs

from kvwire.blob import KeyStatus
from kvwire.blob.results import all_ok
from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View
from kvwire.registry import load

STORE = Hint.of("store")


def _layout(draw: st.DrawFn, arena: int) -> list[tuple[int, int]]:
    """Disjoint (offset, size) rows inside ``arena`` bytes, in a drawn order: sizes of 0 to a
    few KiB (so 4 KiB split points fall inside rows), some rows back to back, some apart."""
    rows = []
    at = 0
    for _ in range(draw(st.integers(1, 24))):
        at += draw(st.sampled_from([0, 0, 0, 1, 64, 4096, 5000]))
        size = draw(st.sampled_from([0, 1, 7, 4096, 4097, 8192, 12345, 3 * 4096 + 5]))
        if at + size > arena:
            break
        rows.append((at, size))
        at += size
    return draw(st.permutations(rows)) if rows else [(0, 1)]


@st.composite
def copies(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    arena = 1 << 18
    targets = _layout(draw, arena)
    sizes = [size for _, size in targets]
    # Sources: the same sizes, laid out afresh (adjacent, scattered, or in another order).
    offsets = [0] * len(sizes)
    at = 0
    for i in draw(st.permutations(range(len(sizes)))):
        at += draw(st.sampled_from([0, 0, 3, 4096]))
        offsets[i] = at
        at += sizes[i]
    return targets, list(zip(offsets, sizes, strict=True)), draw(st.integers(1, 9))


@settings(max_examples=150, deadline=None)
@given(copies())
def test_split_runs_cover_every_byte_once_in_pieces_of_about_equal_bytes(case):
    targets, sources, parts = case
    t = [o for o, _ in targets]
    f = [o for o, _ in sources]
    z = [s for _, s in targets]
    pieces = split_runs(t, f, z, parts)
    total = sum(z)
    assert len(pieces) <= parts
    sent = [(a, b, n) for piece in pieces for a, b, n in zip(*piece, strict=True)]
    assert all(n > 0 for _, _, n in sent)
    assert sum(n for _, _, n in sent) == total
    # Byte by byte, the pieces pair the same target and source bytes as the runs, in order.
    want = [(a + k, b + k) for a, b, n in zip(t, f, z, strict=True) for k in range(n)]
    got = [(a + k, b + k) for a, b, n in sent for k in range(n)]
    assert got == want
    if total:
        step = max(4096, -(-total // parts // 4096) * 4096)
        assert all(sum(piece[2]) <= step for piece in pieces)


@settings(max_examples=80, deadline=None)
@given(copies())
def test_a_pool_copies_the_same_bytes_as_one_thread(case):
    targets, sources, threads = case
    src = np.random.default_rng(threads).integers(0, 256, 1 << 19, dtype=np.uint8)
    want = np.zeros(1 << 18, dtype=np.uint8)
    got = np.zeros_like(want)
    for (a, n), (b, _) in zip(targets, sources, strict=True):
        want[a:a + n] = src[b:b + n]
    pool = CopyPool(threads, min_bytes=1)
    try:
        pool.copy([got.ctypes.data + a for a, _ in targets], [src.ctypes.data + b for b, _ in sources],
                  [n for _, n in targets])
    finally:
        pool.close()
    np.testing.assert_array_equal(got, want)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.sampled_from([1, 4096, 5000, 8192, 65536, 70000])),
                min_size=1, max_size=40),
       st.integers(2, 6), st.booleans())
def test_stored_with_threads_reads_back_equal(rows, threads, scatter):
    """Puts and gets through a store with a pool whose threshold every batch passes: rows of one
    size in a row (one memmove cut in pieces), scattered, of mixed sizes, read back into other
    scattered memory; the same bytes come back, through the batch and the one-row paths."""
    sizes = [size for _, size in rows]
    src = np.random.default_rng(len(rows)).integers(0, 256, 64 * 70000 + sum(sizes), dtype=np.uint8)
    if scatter:
        offsets = [slot * 70000 for slot, _ in rows]
        offsets = list(dict.fromkeys(offsets))[:len(rows)]
        sizes = sizes[:len(offsets)]
    else:
        offsets = list(np.cumsum([0, *sizes[:-1]]).tolist())
    keys = [f"k{i}" for i in range(len(offsets))]
    store = MemoryStore(1 << 26)
    pool = CopyPool(threads, min_bytes=1)
    try:
        assert store.write_batch(keys, [src.ctypes.data + o for o in offsets], sizes, pool=pool) is None
        dst = np.zeros(sum(sizes) + 4096 * len(sizes), dtype=np.uint8)
        back = [0] * len(sizes)  # apart, last row first
        at = 0
        for i in reversed(range(len(sizes))):
            back[i] = at
            at += sizes[i] + 4096
        status, reasons = store.read_batch(keys, [dst.ctypes.data + o for o in back], sizes, pool=pool)
        assert status is None and not reasons
        for o, b, n in zip(offsets, back, sizes, strict=True):
            np.testing.assert_array_equal(dst[b:b + n], src[o:o + n])
        one = np.zeros(sizes[0], dtype=np.uint8)
        assert store.read_batch([keys[0]], [one.ctypes.data], [sizes[0]], pool=pool)[0] is None
        np.testing.assert_array_equal(one, src[offsets[0]:offsets[0] + sizes[0]])
    finally:
        pool.close()


def test_block_objects_with_threads_read_back_equal():
    """write_parts / read_parts (one object of several groups' rows) through a pool."""
    groups, blocks, row = 5, 12, 3000
    src = np.random.default_rng(3).integers(0, 256, (groups, blocks, row), dtype=np.uint8)
    dst = np.zeros_like(src)
    order = np.random.default_rng(4).permutation(blocks)
    at = np.array([[src.ctypes.data + (g * blocks + b) * row for g in range(groups)] for b in range(blocks)],
                  dtype=np.uint64)
    back = np.array([[dst.ctypes.data + (g * blocks + b) * row for g in range(groups)] for b in order],
                    dtype=np.uint64)
    lengths = np.full(groups, row, dtype=np.uint64)
    store = MemoryStore(1 << 24)
    pool = CopyPool(3, min_bytes=1)
    try:
        keys = [f"b{b}" for b in range(blocks)]
        assert store.write_parts(keys, at, lengths, pool=pool) is None
        status, _ = store.read_parts([keys[b] for b in order], back, lengths, pool=pool)
        assert status is None
    finally:
        pool.close()
    np.testing.assert_array_equal(dst, src)


def test_small_batches_and_one_thread_start_no_thread():
    before = threading.active_count()
    store = MemoryStore(1 << 26)
    src = np.ones(1 << 20, dtype=np.uint8)
    small = CopyPool(4)  # the default threshold: a 1 MiB batch is below it
    single = CopyPool(1, min_bytes=1)
    assert store.write_batch(["a"], [src.ctypes.data], [src.size], pool=small) is None
    assert store.write_batch(["b", "c"], [src.ctypes.data, src.ctypes.data + 4096], [4096, 8192],
                             pool=single) is None
    assert threading.active_count() == before
    small.close()
    single.close()


def test_the_pool_starts_on_a_large_batch_and_close_joins_it():
    before = threading.active_count()
    store = MemoryStore(1 << 26)
    src = np.random.default_rng(5).integers(0, 256, 4 << 20, dtype=np.uint8)
    region = SlotRegion(0, src.ctypes.data, 1 << 20, 4, MemoryKind.HOST)
    dst = np.zeros_like(src)
    out = SlotRegion(1, dst.ctypes.data, 1 << 20, 4, MemoryKind.HOST)
    driver = MemoryDriver(store, copy_threads=4)
    driver.pool.min_bytes = 1 << 20
    driver.register([region, out])
    keys = [f"r{i}" for i in range(4)]
    sizes = np.full(4, 1 << 20, dtype=np.uint64)
    assert all_ok(driver.put(keys, region.addresses(np.arange(4)), sizes).status)
    assert threading.active_count() > before  # the pool's threads copied pieces
    assert all_ok(driver.get_into(keys, out.addresses(np.arange(4)), sizes).status)
    np.testing.assert_array_equal(dst, src)
    driver.close()
    assert threading.active_count() == before
    driver.close()  # idempotent
    # A pool closed copies on the caller's thread alone, and starts nothing.
    dst[:] = 0
    status, _ = store.read_batch(keys, out.addresses(np.arange(4)).tolist(), sizes.tolist(), pool=driver.pool)
    assert status is None
    np.testing.assert_array_equal(dst, src)
    assert threading.active_count() == before


@pytest.mark.parametrize("bad", [0, 65, -1, 2.0, True, "4", None])
def test_a_bad_thread_count_is_refused_naming_the_option(bad):
    with pytest.raises(ValueError, match="copy_threads"):
        CopyPool(bad)
    with pytest.raises(ValueError, match="copy_threads"):
        MemoryDriver(MemoryStore(1), copy_threads=bad)


def test_a_copy_that_fails_in_a_piece_waits_for_every_piece_and_stores_nothing(monkeypatch):
    """A piece that raises (on a pool thread): the put raises only after every piece ended,
    gives back its reserved bytes and memory, and stores none of its objects; the store then
    takes the same keys whole."""
    real = store_module._copy_piece
    calls: list[int] = []
    lock = threading.Lock()

    def failing(targets, sources, sizes):  # type: ignore[no-untyped-def]
        with lock:
            calls.append(len(calls))
            mine = len(calls)
        if mine == 2:
            raise OSError("a piece failed")
        real(targets, sources, sizes)

    store = MemoryStore(1 << 24)
    pool = CopyPool(4, min_bytes=1)
    src = np.random.default_rng(6).integers(0, 256, 1 << 20, dtype=np.uint8)
    keys = [f"k{i}" for i in range(8)]
    addresses = [src.ctypes.data + i * (128 << 10) for i in range(8)]
    sizes = [128 << 10] * 8
    try:
        monkeypatch.setattr(store_module, "_copy_piece", failing)
        with pytest.raises(OSError, match="a piece failed"):
            store.write_batch(keys, addresses, sizes, pool=pool)
        assert len(calls) == 4  # every piece ran: none was left writing after the raise
        assert store.used_bytes == 0 and len(store) == 0
        with pytest.raises(OSError, match="a piece failed"):  # one row: the same
            calls.clear()
            store.write_batch(["one"], [src.ctypes.data], [1 << 20], pool=pool)
        assert store.used_bytes == 0 and len(store) == 0
        monkeypatch.setattr(store_module, "_copy_piece", real)
        assert store.write_batch(keys, addresses, sizes, pool=pool) is None
        dst = np.zeros_like(src)
        assert store.read_batch(keys, [dst.ctypes.data + i * (128 << 10) for i in range(8)], sizes)[0] is None
        np.testing.assert_array_equal(dst, src)
        assert store.used_bytes == src.size
        # A read whose piece fails raises after every piece, and the store stays readable.
        calls.clear()
        monkeypatch.setattr(store_module, "_copy_piece", failing)
        with pytest.raises(OSError, match="a piece failed"):
            store.read_batch(keys, [dst.ctypes.data + i * (128 << 10) for i in range(8)], sizes, pool=pool)
        assert len(calls) == 4
        assert store._reading == 0
    finally:
        pool.close()


def _view(region: SlotRegion, n: int) -> View:
    names = np.zeros((n, 8), dtype=np.uint8)
    names[:, 0] = np.arange(n)
    return View((LayerGroupRows(0, CacheKind.PAGED, region, np.arange(n), TokenRange(0, 16 * n), names),))


def _settle(attempt, woken: threading.Event) -> None:  # type: ignore[no-untyped-def]
    while not (attempt.poll() is not None and attempt.quiesced()):
        assert woken.wait(10.0), "no wake within 10 s"
        woken.clear()


def test_through_the_plugin_a_failing_or_cancelled_copy_returns_everything(store_name, monkeypatch):
    """Through the ``memory`` plugin with ``copy_threads`` 3: a publish whose piece fails
    concludes FAILED and stores nothing; a publish cancelled while its pieces copy concludes
    cancelled, quiesces once the copy ends, and the store counts exactly what it holds; close
    joins the pool's threads."""
    before = threading.active_count()
    row, n = PARALLEL_COPY_BYTES // 4, 5  # one chunk above the threshold
    src = np.random.default_rng(7).integers(0, 256, (n, row), dtype=np.uint8)
    region = SlotRegion(0, src.ctypes.data, row, n, MemoryKind.HOST)
    backend = load("memory").build({"store": store_name, "copy_threads": 3, "capacity_bytes": 4 * n * row})
    store = store_module._named[store_name]
    real = store_module._copy_piece
    try:
        with backend.register_regions([region]):
            def failing(targets, sources, sizes):  # type: ignore[no-untyped-def]
                real(targets, sources, sizes)
                if threading.current_thread().name.startswith("kvwire-memory-copy"):
                    raise OSError("a piece failed")

            monkeypatch.setattr(store_module, "_copy_piece", failing)
            woken = threading.Event()
            attempt = backend.publish(_view(region, n), STORE, woken.set)
            _settle(attempt, woken)
            assert attempt.poll().is_failed
            assert store.used_bytes == 0 and len(store) == 0

            entered, release = threading.Event(), threading.Event()

            def held(targets, sources, sizes):  # type: ignore[no-untyped-def]
                entered.set()
                assert release.wait(30.0)
                real(targets, sources, sizes)

            monkeypatch.setattr(store_module, "_copy_piece", held)
            woken.clear()
            attempt = backend.publish(_view(region, n), STORE, woken.set)
            assert entered.wait(30.0)
            attempt.cancel()
            assert not attempt.quiesced()  # the copy is still in the driver
            release.set()
            _settle(attempt, woken)
            assert attempt.poll().is_cancelled
            monkeypatch.setattr(store_module, "_copy_piece", real)
            assert store.used_bytes == len(store) * row
            dst = np.zeros_like(src)
            held_keys = store.keys()
            for i, key in enumerate(held_keys):
                assert store.read_into(key, dst[i].ctypes.data, row)[0] is KeyStatus.OK
                assert any(np.array_equal(dst[i], r) for r in src)
    finally:
        backend.close()
    assert threading.active_count() == before
