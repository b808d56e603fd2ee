"""The in-memory store and its driver: capacity, LRU eviction, whole objects, checked addresses."""

from __future__ import annotations

import threading
from itertools import compress

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvwire_memory import MemoryDriver, MemoryStore, forget_store, named_store

from kvwire.blob import KeyStatus
from kvwire.contract import MemoryKind, SlotRegion


def slab(rows: int, size: int, seed: int | None = None) -> tuple[np.ndarray, SlotRegion]:
    array = (np.zeros((rows, size), dtype=np.uint8) if seed is None
             else np.random.default_rng(seed).integers(0, 256, (rows, size), dtype=np.uint8))
    return array, SlotRegion(0, array.ctypes.data, size, rows, MemoryKind.HOST)


def addrs(region: SlotRegion, slots) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[no-untyped-def]
    slots = np.asarray(slots)
    return region.addresses(slots), np.full(slots.size, region.slot_bytes, dtype=np.uint64)


def test_capacity_counts_object_bytes_and_lru_evicts_the_least_recently_used():
    store = MemoryStore(300)
    assert store.insert("a", b"x" * 100) is KeyStatus.OK
    assert store.insert("b", b"y" * 100) is KeyStatus.OK
    assert store.insert("c", b"z" * 100) is KeyStatus.OK
    assert store.lookup("a") == b"x" * 100  # a is now the most recently used
    assert store.insert("d", b"w" * 100) is KeyStatus.OK
    assert store.keys() == ["c", "a", "d"] and store.used_bytes == 300 and store.evicted == 1
    assert store.insert("a", b"other") is KeyStatus.ALREADY_THERE
    assert store.lookup("a") == b"x" * 100
    assert store.insert("huge", b"h" * 301) is KeyStatus.DECLINED  # never fits, even with eviction


def test_without_eviction_a_full_store_declines_and_keeps_what_it_has():
    store = MemoryStore(200, eviction=False)
    store.insert("a", b"1" * 150)
    assert store.insert("b", b"2" * 100) is KeyStatus.DECLINED
    assert store.keys() == ["a"] and store.used_bytes == 150
    assert store.discard("a") and not store.discard("a") and store.used_bytes == 0


def test_removed_objects_memory_is_reused_and_never_while_a_reader_copies():
    store = MemoryStore(1000)
    store.insert("a", b"1" * 100)
    store.discard("a")
    store.insert("b", b"2" * 100)  # takes a's memory
    assert store.lookup("b") == b"2" * 100
    # Objects plus kept memory never exceed the capacity.
    for i in range(30):
        store.insert(f"k{i}", bytes([i]) * 90)
    assert store.used_bytes + store._spare_bytes <= 1000
    assert all(store.lookup(k) == bytes([int(k[1:])]) * 90 for k in store.keys() if k.startswith("k"))


def test_named_stores_are_shared_per_name():
    a = named_store("test-store-shared", capacity_bytes=10, eviction=True)
    try:
        assert named_store("test-store-shared", capacity_bytes=10, eviction=True) is a
        with pytest.raises(ValueError, match="capacity_bytes=10"):
            named_store("test-store-shared", capacity_bytes=11, eviction=True)
    finally:
        forget_store("test-store-shared")
    assert named_store("test-store-shared", capacity_bytes=11, eviction=True) is not a
    forget_store("test-store-shared")


def test_driver_round_trip_and_statuses():
    driver = MemoryDriver(MemoryStore(1 << 20))
    src, rs = slab(4, 64, seed=1)
    dst, rd = slab(4, 64)
    driver.register([rs])
    driver.register([rd])
    keys = ["k0", "k1", "k2", "k3"]
    assert driver.put(keys[:3], *addrs(rs, [0, 1, 2])).where(KeyStatus.OK).all()
    assert driver.put(keys[:1], *addrs(rs, [3])).where(KeyStatus.ALREADY_THERE).all()
    got = driver.get_into(keys, *addrs(rd, [0, 1, 2, 3]))
    np.testing.assert_array_equal(got.status, [KeyStatus.OK] * 3 + [KeyStatus.MISSING])
    np.testing.assert_array_equal(dst[:3], src[:3])
    np.testing.assert_array_equal(driver.exists(keys), [True, True, True, False])
    np.testing.assert_array_equal(driver.remove(["k0", "k3"]).status, [KeyStatus.OK, KeyStatus.MISSING])


def test_an_object_of_another_size_is_a_fault_not_a_partial_copy():
    driver = MemoryDriver(MemoryStore(1 << 20))
    small, rs = slab(1, 32, seed=2)
    big, rb = slab(1, 64)
    driver.register([rs, rb])
    driver.put(["k"], *addrs(rs, [0]))
    got = driver.get_into(["k"], *addrs(rb, [0]))
    assert got.where(KeyStatus.FAILED).all() and "32 bytes" in got.first_reason()
    assert not big.any()


def test_addresses_outside_registered_regions_are_refused_before_any_copy():
    store = MemoryStore(1 << 20)
    driver = MemoryDriver(store)
    src, region = slab(2, 64, seed=3)
    with pytest.raises(ValueError, match="no region registered"):
        driver.put(["k"], *addrs(region, [0]))
    driver.register([region])
    address, size = addrs(region, [1])
    with pytest.raises(ValueError, match="no region registered"):
        driver.put(["k"], address + np.uint64(1), size)  # runs one byte past the region
    driver.unregister([region])
    with pytest.raises(ValueError, match="no region registered"):
        driver.get_into(["k"], *addrs(region, [0]))
    assert len(store) == 0
    with pytest.raises(RuntimeError, match="host memory only"):
        driver.register([SlotRegion(1, 1 << 40, 64, 1, MemoryKind.DEVICE, device=0)])


def test_racing_puts_of_one_name_store_one_whole_object():
    store = MemoryStore(1 << 24)
    driver = MemoryDriver(store)
    sources = [np.full((1, 1 << 16), i, dtype=np.uint8) for i in range(8)]
    regions = [SlotRegion(i, s.ctypes.data, s.shape[1], 1, MemoryKind.HOST) for i, s in enumerate(sources)]
    driver.register(regions)
    answers: list[int] = []
    barrier = threading.Barrier(len(regions))

    def put(region: SlotRegion) -> None:
        barrier.wait()
        answers.append(int(driver.put(["same"], *addrs(region, [0])).status[0]))

    threads = [threading.Thread(target=put, args=(r,)) for r in regions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=5.0)
    assert sorted(answers) == [KeyStatus.OK] + [KeyStatus.ALREADY_THERE] * 7
    data = store.lookup("same")
    assert data is not None and len(set(data)) == 1  # one writer's bytes, whole


def test_readers_never_see_a_torn_object_while_memory_is_reused():
    """Readers copy while a writer keeps removing and storing same-sized objects (whose memory
    the store reuses): every read is one object's bytes, whole, or a miss."""
    size, rounds = 1 << 20, 300
    store = MemoryStore(4 * size)
    fills = [np.full(size, i, dtype=np.uint8) for i in range(8)]
    torn: list[str] = []
    done = threading.Event()

    def write() -> None:
        for i in range(rounds):
            fill = fills[i % len(fills)]
            store.write_from("hot", fill.ctypes.data, size)
            store.write_from(f"cold{i}", fill.ctypes.data, size)  # churn: eviction hands memory back
            store.discard("hot")
        done.set()

    def read() -> None:
        out = np.empty(size, dtype=np.uint8)
        while not done.is_set():
            status, _ = store.read_into("hot", out.ctypes.data, size)
            if status is KeyStatus.OK and (out != out[0]).any():
                torn.append(f"mixed bytes {np.unique(out)[:4]}")

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30.0)
    assert not torn


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "read", "discard"]), st.integers(1, 700), st.integers(0, 9),
                          st.integers(0, 1000)),
                min_size=1, max_size=25))
# A batch too large to fit at once goes row by row; it touched the keys it held first, so the one
# held (k558, the oldest) outlived the rows before it that needed room, unlike row by row.
@example(steps=[("put", 1, 0, 558), ("put", 115, 8, 0), ("put", 573, 7, 117)])
def test_batches_evict_exactly_as_a_plain_lru_model(steps):
    """Batch puts, reads and removals of many sizes (evictions of 1 to several hundred objects at
    once, so the eviction's search runs past any run length; stores of one size and of several)
    hold the same keys in the same order, and the same bytes, as a plain list-based LRU model."""
    capacity = 4000
    store = MemoryStore(capacity)
    model: dict[str, bytes] = {}  # insertion order = least recently used first
    source = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    base = source.ctypes.data
    for op, rows, size, first in steps:
        keys = [f"k{first + i}" for i in range(rows)]
        if op == "discard":
            for key in keys:
                assert store.discard(key) == (model.pop(key, None) is not None)
        elif op == "put":
            offsets = [(7 * (first + i)) % 1000 for i in range(rows)]
            status = store.write_batch(keys, [base + o for o in offsets], [size] * rows)
            codes = [KeyStatus.OK if status is None else KeyStatus(int(c)) for c in (status if status is not None else keys)]
            there = [key in model for key in keys]
            if size * there.count(False) <= capacity:
                # A batch touches the keys it finds first, then evicts once for all the new bytes.
                assert codes == [KeyStatus.ALREADY_THERE if t else KeyStatus.OK for t in there]
                for key in compress(keys, there):
                    model[key] = model.pop(key)
                while sum(map(len, model.values())) + size * there.count(False) > capacity:
                    del model[next(iter(model))]
                for i, key in enumerate(keys):
                    if not there[i]:
                        model[key] = source[offsets[i]:offsets[i] + size].tobytes()
            else:  # the new bytes never fit at once: row by row, each evicting for itself
                for i, key in enumerate(keys):
                    if key in model:
                        assert codes[i] is KeyStatus.ALREADY_THERE
                        model[key] = model.pop(key)
                        continue
                    assert codes[i] is KeyStatus.OK
                    while sum(map(len, model.values())) + size > capacity:
                        del model[next(iter(model))]
                    model[key] = source[offsets[i]:offsets[i] + size].tobytes()
        else:
            for key in keys:
                if key in model:
                    assert store.lookup(key) == model[key]
                    model[key] = model.pop(key)
                else:
                    assert store.lookup(key) is None
        assert store.keys() == list(model)
        assert store.used_bytes == sum(map(len, model.values()))
