"""Bytes through a blob backend and back: masks, misses, faults, declines (A5-A7, A9, S1).

Bytes are checked by reading the numpy memory directly, never through the backend."""

from __future__ import annotations

import numpy as np
import pytest
from blobkit import Slab, Waker, group, names, settle, view
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvwire_memory import MemoryDriver, MemoryStore

from kvwire.blob import BlobBackend, store_keys
from kvwire.contract import Hint
from kvwire.contract.outcome import OutcomeStatus
from kvwire.testing.faults import Decline, Evict, FailCall, FailKeys, FaultyDriver

STORE = Hint.of("store")


def run(backend: BlobBackend, op: str, v, hint: Hint = STORE):  # type: ignore[no-untyped-def]
    waker = Waker()
    attempt = getattr(backend, op)(v, hint, waker)
    return settle(attempt, waker)


def pair(store: MemoryStore, make_backend, **options):  # type: ignore[no-untyped-def]
    """Two backends, as two workers of one process, sharing one store."""
    return make_backend(MemoryDriver(store), **options), make_backend(MemoryDriver(store), **options)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    rows=st.integers(1, 24),
    slot_bytes=st.sampled_from([1, 7, 64, 1000, 4096]),
    chunk_bytes=st.integers(1, 20_000),
    workers=st.integers(1, 3),
)
def test_round_trip_delivers_exactly_the_published_rows_byte_for_byte(data, rows, slot_bytes, chunk_bytes, workers):
    published = np.array(data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows)), dtype=bool)
    order = np.array(data.draw(st.permutations(range(rows))), dtype=np.int64)
    store = MemoryStore(1 << 30)
    a = BlobBackend(MemoryDriver(store), chunk_bytes=chunk_bytes, workers=workers)
    b = BlobBackend(MemoryDriver(store), chunk_bytes=chunk_bytes, workers=workers)
    try:
        src, dst = Slab.make(rows, slot_bytes, seed=rows), Slab.make(rows, slot_bytes)
        a.register_regions([src.region])
        b.register_regions([dst.region])
        ids = np.arange(rows)
        sent = run(a, "publish", view(group(src, ids[published], ids[published])))
        assert sent.status is OutcomeStatus.DELIVERED
        assert sent.masks[0].all()
        # Fetch every name into a shuffled slot: rows never published are misses.
        got = run(b, "fetch", view(group(dst, order, ids)))
        assert got.status is OutcomeStatus.DELIVERED
        np.testing.assert_array_equal(got.masks[0], published)
        arrived = order[published]
        np.testing.assert_array_equal(dst.array[arrived], src.array[ids[published]])
    finally:
        a.close()
        b.close()


def test_store_keys_follow_the_documented_layout(store, make_backend, namespace):
    backend = make_backend(MemoryDriver(store), namespace=namespace)
    src = Slab.make(3, 32, seed=1)
    backend.register_regions([src.region])
    g = group(src, [0, 1, 2], [10, 11, 12], gid=7)
    run(backend, "publish", view(g))
    expected = [f"kvw1/{namespace}/g7/{g.name(i).hex()}" for i in range(3)]
    assert sorted(store.keys()) == sorted(expected)
    assert store_keys(namespace, 7, g.names) == expected


@settings(max_examples=60, deadline=None)
@given(
    raw=st.binary(min_size=0, max_size=400),
    width=st.integers(1, 64),
    group_id=st.integers(0, 2**31),
    namespace=st.sampled_from(["default", "a/b", "x.y:z@1+2=3-4", "n" * 128]),
    step=st.sampled_from([1, -1, 2]),
)
def test_store_keys_equal_the_layout_row_by_row_for_any_names(raw, width, group_id, namespace, step):
    rows = len(raw) // width
    names_ = np.frombuffer(raw[: rows * width], dtype=np.uint8).reshape(rows, width)[::step]
    keys = store_keys(namespace, group_id, names_)
    assert keys == [f"kvw1/{namespace}/g{group_id}/{bytes(n).hex()}" for n in names_]
    assert all(type(k) is str for k in keys)


def test_scopes_never_collide_and_the_hint_namespace_wins(store, make_backend):
    a, b = pair(store, make_backend, namespace="option-ns")
    src, dst = Slab.make(4, 64, seed=2), Slab.make(4, 64)
    a.register_regions([src.region])
    b.register_regions([dst.region])
    run(a, "publish", view(group(src, range(4), range(4), gid=0)), Hint.of("store", namespace="tenant-a"))
    assert all(k.startswith("kvw1/tenant-a/g0/") for k in store.keys())
    # Same names, another namespace (the hint's, or the option's), or another group: all misses.
    for hint, gid in ((Hint.of("store", namespace="tenant-b"), 0), (STORE, 0), (Hint.of("store", namespace="tenant-a"), 1)):
        miss = run(b, "fetch", view(group(dst, range(4), range(4), gid=gid)), hint)
        assert miss.status is OutcomeStatus.DELIVERED
        assert not miss.masks[0].any()
    hit = run(b, "fetch", view(group(dst, range(4), range(4), gid=0)), Hint.of("store", namespace="tenant-a"))
    assert hit.masks[0].all()
    np.testing.assert_array_equal(dst.array, src.array)


def test_publishing_an_existing_name_keeps_the_first_bytes_and_counts_as_held(store, make_backend):
    a, b = pair(store, make_backend)
    first, second, dst = Slab.make(3, 128, seed=3), Slab.make(3, 128, seed=4), Slab.make(3, 128)
    a.register_regions([first.region, second.region])
    b.register_regions([dst.region])
    assert run(a, "publish", view(group(first, range(3), range(3)))).masks[0].all()
    again = run(a, "publish", view(group(second, range(3), range(3))))
    assert again.status is OutcomeStatus.DELIVERED
    assert again.masks[0].all()  # ALREADY_THERE: the store holds the row
    got = run(b, "fetch", view(group(dst, range(3), range(3))))
    assert got.masks[0].all()
    np.testing.assert_array_equal(dst.array, first.array)


def test_a_store_without_space_declines_rows_instead_of_failing(make_backend):
    store = MemoryStore(3 * 256, eviction=False)
    a, b = pair(store, make_backend)
    src, dst = Slab.make(5, 256, seed=5), Slab.make(5, 256)
    a.register_regions([src.region])
    b.register_regions([dst.region])
    sent = run(a, "publish", view(group(src, range(5), range(5))))
    assert sent.status is OutcomeStatus.DELIVERED
    np.testing.assert_array_equal(sent.masks[0], [True, True, True, False, False])
    got = run(b, "fetch", view(group(dst, range(5), range(5))))
    np.testing.assert_array_equal(got.masks[0], [True, True, True, False, False])
    np.testing.assert_array_equal(dst.array[:3], src.array[:3])


def test_an_injected_decline_is_a_false_bit_not_a_failure(store, make_backend):
    backend = make_backend(FaultyDriver(MemoryDriver(store), [Decline(call=1, start=1, stop=3)]))
    src = Slab.make(4, 64, seed=6)
    backend.register_regions([src.region])
    sent = run(backend, "publish", view(group(src, range(4), range(4))))
    assert sent.status is OutcomeStatus.DELIVERED
    np.testing.assert_array_equal(sent.masks[0], [True, False, False, True])
    assert len(store) == 2


def test_a_store_fault_fails_the_fetch_with_its_reason_and_false_bits(store, make_backend):
    a = make_backend(MemoryDriver(store))
    b = make_backend(FaultyDriver(MemoryDriver(store), [FailCall("get", call=1, reason="disk on fire")]))
    src, dst = Slab.make(4, 64, seed=7), Slab.make(4, 64)
    a.register_regions([src.region])
    b.register_regions([dst.region])
    run(a, "publish", view(group(src, range(4), range(4))))
    got = run(b, "fetch", view(group(dst, range(4), range(4))))
    assert got.status is OutcomeStatus.FAILED
    assert "disk on fire" in got.reason
    assert not got.masks[0].any()


def test_a_driver_that_raises_fails_the_attempt_instead_of_raising(store, make_backend):
    backend = make_backend(FaultyDriver(MemoryDriver(store), [FailCall("put", call=1, reason="boom", raises=True)]))
    src = Slab.make(2, 64, seed=8)
    backend.register_regions([src.region])
    sent = run(backend, "publish", view(group(src, range(2), range(2))))
    assert sent.status is OutcomeStatus.FAILED
    assert "RuntimeError" in sent.reason and "boom" in sent.reason
    assert not sent.masks[0].any()


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(2, 30), per_chunk=st.integers(1, 8), data=st.data())
def test_a_fetch_whose_later_chunk_faults_marks_only_what_arrived(rows, per_chunk, data):
    chunks = -(-rows // per_chunk)
    bad = data.draw(st.integers(1, chunks), label="faulty chunk")
    store = MemoryStore(1 << 24)
    a = BlobBackend(MemoryDriver(store))
    b = BlobBackend(FaultyDriver(MemoryDriver(store), [FailCall("get", call=bad)]), workers=1,
                    chunk_bytes=per_chunk * 64)
    try:
        src, dst = Slab.make(rows, 64, seed=rows), Slab.make(rows, 64)
        a.register_regions([src.region])
        b.register_regions([dst.region])
        run(a, "publish", view(group(src, range(rows), range(rows))))
        got = run(b, "fetch", view(group(dst, range(rows), range(rows))))
        assert got.status is OutcomeStatus.FAILED
        expected = np.ones(rows, dtype=bool)
        expected[(bad - 1) * per_chunk: bad * per_chunk] = False
        np.testing.assert_array_equal(got.masks[0], expected)
        np.testing.assert_array_equal(dst.array[expected], src.array[expected])
    finally:
        a.close()
        b.close()


def test_a_fault_in_the_later_part_of_a_batch_keeps_the_earlier_rows(store, make_backend):
    a = make_backend(MemoryDriver(store))
    b = make_backend(FaultyDriver(MemoryDriver(store), [FailKeys("get", call=1, start=3)]))
    src, dst = Slab.make(6, 64, seed=9), Slab.make(6, 64)
    a.register_regions([src.region])
    b.register_regions([dst.region])
    run(a, "publish", view(group(src, range(6), range(6))))
    got = run(b, "fetch", view(group(dst, range(6), range(6))))
    assert got.status is OutcomeStatus.FAILED
    assert "injected fault" in got.reason and names([3])[0].tobytes().hex() in got.reason
    np.testing.assert_array_equal(got.masks[0], [True, True, True, False, False, False])
    np.testing.assert_array_equal(dst.array[:3], src.array[:3])


def test_objects_evicted_behind_the_backends_back_are_misses(store, make_backend):
    a = make_backend(MemoryDriver(store))
    b = make_backend(FaultyDriver(MemoryDriver(store), [Evict("get", call=1, start=2)]))
    src, dst = Slab.make(4, 64, seed=10), Slab.make(4, 64)
    a.register_regions([src.region])
    b.register_regions([dst.region])
    run(a, "publish", view(group(src, range(4), range(4))))
    got = run(b, "fetch", view(group(dst, range(4), range(4))))
    assert got.status is OutcomeStatus.DELIVERED
    np.testing.assert_array_equal(got.masks[0], [True, True, False, False])


def test_groups_of_several_regions_and_sizes_each_get_their_own_mask(store, make_backend):
    a, b = pair(store, make_backend, chunk_bytes=300)
    k_src, v_src = Slab.make(5, 96, seed=11), Slab.make(2, 1000, seed=12)
    k_dst, v_dst = Slab.make(5, 96), Slab.make(2, 1000)
    a.register_regions([k_src.region, v_src.region])
    b.register_regions([k_dst.region, v_dst.region])
    run(a, "publish", view(group(k_src, [0, 1, 2], [0, 1, 2], gid=0), group(v_src, [1], [0], gid=1)))
    got = run(b, "fetch", view(group(k_dst, [4, 3, 2, 1], [0, 1, 2, 3], gid=0), group(v_dst, [0, 1], [0, 1], gid=1)))
    assert got.status is OutcomeStatus.DELIVERED
    assert len(got.masks) == 2
    np.testing.assert_array_equal(got.masks[0], [True, True, True, False])
    np.testing.assert_array_equal(got.masks[1], [True, False])
    np.testing.assert_array_equal(k_dst.array[[4, 3, 2]], k_src.array[[0, 1, 2]])
    np.testing.assert_array_equal(v_dst.array[0], v_src.array[1])


def test_outcome_masks_are_plain_read_only_bool_arrays(store, make_backend):
    backend = make_backend(MemoryDriver(store))
    src = Slab.make(3, 16, seed=13)
    backend.register_regions([src.region])
    sent = run(backend, "publish", view(group(src, range(3), range(3))))
    (mask,) = sent.masks
    assert type(mask) is np.ndarray and mask.dtype == bool and not mask.flags.writeable


def test_an_empty_view_concludes_delivered_and_wakes(store, make_backend):
    backend = make_backend(MemoryDriver(store))
    src = Slab.make(1, 16)
    backend.register_regions([src.region])
    waker = Waker()
    attempt = backend.fetch(view(group(src, [], [])), STORE, waker)
    outcome = settle(attempt, waker)
    assert outcome.status is OutcomeStatus.DELIVERED and outcome.masks[0].size == 0
    waker.until(lambda: waker.calls >= 1)  # the wake follows the conclusion (W1.2), maybe after the return


def test_hint_timeout_and_option_timeout_both_bound_attempts(store, make_backend):
    # A generous deadline never fires on a fast store: the attempt delivers.
    backend = make_backend(MemoryDriver(store), timeout_s=0.5)
    src = Slab.make(2, 16, seed=14)
    backend.register_regions([src.region])
    assert run(backend, "publish", view(group(src, range(2), range(2))), Hint.of("store", timeout_s=60.0)).is_delivered


@pytest.mark.parametrize("workers", [1, 4])
def test_outcome_does_not_depend_on_chunking(store, make_backend, workers):
    src = Slab.make(16, 100, seed=15)
    outs = []
    for chunk_bytes in (1, 250, 1 << 20):
        dst = Slab.make(16, 100)
        backend = make_backend(MemoryDriver(store), chunk_bytes=chunk_bytes, workers=workers)
        backend.register_regions([src.region, dst.region])
        run(backend, "publish", view(group(src, range(0, 16, 2), range(0, 16, 2))))
        got = run(backend, "fetch", view(group(dst, range(16), range(16))))
        outs.append((got.status, got.masks[0].tolist(), dst.array.tobytes()))
        backend.close()
    assert outs[0] == outs[1] == outs[2]


class _BoundedDriver(MemoryDriver):
    """The memory driver with a bound on keys per call, recording each call's key count."""

    def __init__(self, store: MemoryStore, most: int) -> None:
        super().__init__(store)
        self.max_batch_keys = most
        self.calls: list[int] = []

    def put(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        self.calls.append(len(keys))
        return super().put(keys, addresses, sizes)

    def get_into(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        self.calls.append(len(keys))
        return super().get_into(keys, addresses, sizes)

    def get_into_now(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        self.calls.append(len(keys))
        return super().get_into_now(keys, addresses, sizes)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 300, 100],
                         ids=["one byte window", "byte and row cuts together", "byte windows of two rows"])
def test_no_driver_call_gets_more_keys_than_the_driver_takes(store, make_backend, chunk_bytes):
    """A driver's max_batch_keys bounds every call, small submissions moved inside the call
    (inline) included: 11 rows with a bound of 3 go in calls of at most 3, and every row is
    published and fetched whole, byte for byte."""
    writer, reader = _BoundedDriver(store, 3), _BoundedDriver(store, 3)
    a = make_backend(writer, chunk_bytes=chunk_bytes)
    b = make_backend(reader, chunk_bytes=chunk_bytes)
    src, dst = Slab.make(11, 64, seed=5), Slab.make(11, 64)
    a.register_regions([src.region])
    b.register_regions([dst.region])
    sent = run(a, "publish", view(group(src, range(11), range(11))))
    got = run(b, "fetch", view(group(dst, range(11), range(11))))
    assert sent.is_delivered and sent.masks[0].all() and got.is_delivered and got.masks[0].all()
    np.testing.assert_array_equal(dst.array, src.array)
    assert writer.calls and max(writer.calls) <= 3 and sum(writer.calls) == 11, writer.calls
    assert reader.calls and max(reader.calls) <= 3 and sum(reader.calls) == 11, reader.calls


def test_a_driver_bound_that_is_no_positive_int_is_refused(store):
    driver = MemoryDriver(store)
    driver.max_batch_keys = 0
    with pytest.raises(ValueError, match="max_batch_keys"):
        BlobBackend(driver)
