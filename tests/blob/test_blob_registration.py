"""Region registration (M3, M4) and the submissions a blob backend refuses (S3, V4, H1)."""

from __future__ import annotations

import numpy as np
import pytest
from blobkit import Slab, Waker, group, settle, view
from hypothesis import given, settings
from hypothesis import strategies as st
from kvwire_memory import MemoryDriver, MemoryStore

from kvwire.blob import BlobBackend
from kvwire.contract import (
    CacheKind,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    MemoryKind,
    SlotRegion,
    TokenRange,
    View,
)
from kvwire.testing.faults import FaultyDriver

STORE = Hint.of("store")


def fake_region(region_id: int, base: int, nbytes: int, kind: MemoryKind = MemoryKind.HOST) -> SlotRegion:
    """A region at a made-up address: registering it touches no memory."""
    return SlotRegion(region_id, base, nbytes, 1, kind, device=0 if kind is MemoryKind.DEVICE else None)


def test_an_overlap_within_the_batch_refuses_it_and_registers_nothing(driver, make_backend):
    backend = make_backend(driver)
    a, b = fake_region(1, 4096, 100), fake_region(2, 4096 + 99, 10)
    with pytest.raises(InvalidSubmission, match="regions 1 and 2 of one batch overlap"):
        backend.register_regions([a, b])
    assert driver.registered_bytes == 0
    backend.register_regions([a])  # a was not left registered: no overlap with itself now
    backend.register_regions([SlotRegion(2, 4096 + 100, 10, 1, MemoryKind.HOST)])  # adjacent is fine


def test_an_overlap_with_a_registered_region_is_refused_and_the_old_one_stays(driver, make_backend, store):
    backend = make_backend(driver)
    src = Slab.make(4, 64, seed=1)
    backend.register_regions([src.region])
    inside = SlotRegion(99, src.region.base + 64, 64, 1, MemoryKind.HOST)
    fresh = fake_region(5, 1 << 40, 64)
    with pytest.raises(InvalidSubmission, match="overlaps registered region"):
        backend.register_regions([fresh, inside])
    assert driver.registered_bytes == 256  # fresh was not registered either
    waker = Waker()
    assert settle(backend.publish(view(group(src, range(4), range(4))), STORE, waker), waker).is_delivered


def test_close_is_idempotent_and_never_revokes_a_later_registration(driver, make_backend):
    backend = make_backend(driver)
    src = Slab.make(2, 64, seed=2)
    old = backend.register_regions([src.region])
    old.close()
    old.close()
    assert driver.registered_bytes == 0
    new = backend.register_regions([src.region])
    old.close()  # an old handle of the same span
    assert not new.closed and driver.registered_bytes == 128
    waker = Waker()
    assert settle(backend.publish(view(group(src, range(2), range(2))), STORE, waker), waker).is_delivered
    with new:
        pass
    assert new.closed and driver.registered_bytes == 0


def test_the_driver_is_told_about_every_registration(store, make_backend):
    driver = MemoryDriver(store)
    backend = make_backend(driver)
    a, b = Slab.make(2, 64), Slab.make(3, 32)
    reg = backend.register_regions([a.region, b.region])
    assert driver.registered_bytes == 128 + 96
    reg.close()
    assert driver.registered_bytes == 0


def test_a_driver_that_refuses_registration_leaves_nothing_registered(store, make_backend):
    class Refusing(MemoryDriver):
        refuse = True

        def register(self, regions):  # type: ignore[no-untyped-def]
            if self.refuse:
                raise RuntimeError(f"region {regions[0].region_id} refused by the store")
            super().register(regions)

    driver = Refusing(store)
    backend = make_backend(driver)
    src = Slab.make(1, 64, seed=3)
    with pytest.raises(RuntimeError, match="refused by the store"):
        backend.register_regions([src.region])
    with pytest.raises(InvalidSubmission, match="outside every registered region"):
        backend.publish(view(group(src, [0], [0])), STORE, Waker())
    driver.refuse = False
    backend.register_regions([src.region])


def test_a_device_region_is_refused_by_a_host_only_driver(driver, make_backend):
    backend = make_backend(driver)
    gpu = fake_region(7, 1 << 44, 4096, MemoryKind.DEVICE)
    with pytest.raises(InvalidSubmission, match="device memory"):
        backend.register_regions([gpu])
    rows = LayerGroupRows(0, CacheKind.PAGED, gpu, [0], TokenRange(0, 16), np.zeros((1, 16), np.uint8))
    with pytest.raises(InvalidSubmission, match="device memory"):
        backend.fetch(View((rows,)), STORE, Waker())
    assert MemoryKind.DEVICE not in backend.capabilities().memory_kinds


def test_rows_inside_a_registered_span_are_recognized(store, make_backend):
    backend = make_backend(MemoryDriver(store))
    src = Slab.make(8, 64, seed=4)
    backend.register_regions([src.region])
    half = SlotRegion(50, src.region.base + 4 * 64, 64, 4, MemoryKind.HOST)
    rows = LayerGroupRows(0, CacheKind.PAGED, half, [0, 1], TokenRange(0, 32), np.arange(32, dtype=np.uint8).reshape(2, 16))
    waker = Waker()
    assert settle(backend.publish(View((rows,)), STORE, waker), waker).is_delivered


@pytest.fixture
def spied(store, make_backend):  # type: ignore[no-untyped-def]
    """A backend over a driver that counts calls, with one registered slab."""
    driver = FaultyDriver(MemoryDriver(store))
    backend = make_backend(driver)
    src = Slab.make(4, 64, seed=5)
    registration = backend.register_regions([src.region])
    return backend, driver, src, registration


def refused(store, driver) -> None:  # type: ignore[no-untyped-def]
    """Nothing escaped: the store was never called and holds nothing."""
    assert sum(driver.calls.values()) == 0
    assert len(store) == 0


def test_rows_of_an_unregistered_region_are_refused_whole(spied, store):
    backend, driver, src, _ = spied
    stranger = Slab.make(2, 64)
    both = view(group(src, [0], [0], gid=0), group(stranger, [0], [1], gid=1))
    for op in (backend.fetch, backend.publish):
        with pytest.raises(InvalidSubmission, match="outside every registered region"):
            op(both, STORE, Waker())
    refused(store, driver)


def test_rows_of_a_closed_registration_are_refused(spied, store):
    backend, driver, src, registration = spied
    registration.close()
    with pytest.raises(InvalidSubmission, match="outside every registered region"):
        backend.publish(view(group(src, [0], [0])), STORE, Waker())
    refused(store, driver)


@pytest.mark.parametrize("hint,message", [
    (Hint.of("peer", address=b"x"), "kind 'peer'"),
    (Hint.of("store", bucket="b"), "'bucket' are not understood"),
    (Hint.of("store", namespace=3), "namespace.*str"),
    (Hint.of("store", namespace="has space"), "not allowed"),
    (Hint.of("store", namespace="/root"), "not allowed"),
    ("store", "must be a kvwire Hint"),
])
def test_a_hint_the_backend_cannot_use_is_refused(spied, store, hint, message):
    backend, driver, src, _ = spied
    with pytest.raises(InvalidSubmission, match=message):
        backend.publish(view(group(src, [0], [0])), hint, Waker())
    refused(store, driver)


def test_rows_without_content_names_are_refused(spied, store):
    backend, driver, src, _ = spied
    with pytest.raises(InvalidSubmission, match="no content names"):
        backend.publish(view(group(src, [0, 1], None)), STORE, Waker())
    refused(store, driver)


def test_overlapping_fetch_rows_are_refused_but_a_publish_may_read_a_row_twice(spied, store):
    backend, driver, src, _ = spied
    with pytest.raises(InvalidSubmission, match="overlap"):
        backend.fetch(view(group(src, [1, 2, 1], [0, 1, 2])), STORE, Waker())
    with pytest.raises(InvalidSubmission, match="overlap"):
        backend.fetch(view(group(src, [0], [0], gid=0), group(src, [0], [1], gid=1)), STORE, Waker())
    refused(store, driver)
    waker = Waker()
    assert settle(backend.publish(view(group(src, [1, 1], [0, 1])), STORE, waker), waker).is_delivered


def test_a_wake_that_is_not_callable_and_a_non_view_are_refused(spied, store):
    backend, driver, src, _ = spied
    with pytest.raises(InvalidSubmission, match="wake must be callable"):
        backend.publish(view(group(src, [0], [0])), STORE, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidSubmission, match="View"):
        backend.publish(group(src, [0], [0]), STORE, Waker())  # type: ignore[arg-type]
    refused(store, driver)


def test_constructor_arguments_are_checked_by_name(driver):
    for kwargs, name in (({"timeout_s": 0}, "timeout_s"), ({"max_in_flight": 0}, "max_in_flight"),
                         ({"workers": 0}, "workers"), ({"chunk_bytes": 0}, "chunk_bytes"),
                         ({"namespace": ""}, "namespace")):
        with pytest.raises(ValueError, match=name):
            BlobBackend(driver, **kwargs)
    with pytest.raises(TypeError, match="StoreDriver"):
        BlobBackend(object())  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), min_size=1, max_size=6))
def test_a_batch_registers_iff_no_two_spans_overlap(spans):
    store = MemoryStore(1 << 20)
    driver = MemoryDriver(store)
    backend = BlobBackend(driver, workers=1)
    try:
        regions = [fake_region(i, 4096 + start, size) for i, (start, size) in enumerate(spans)]
        clash = any(a.overlaps(b) for i, a in enumerate(regions) for b in regions[i + 1:])
        if clash:
            with pytest.raises(InvalidSubmission):
                backend.register_regions(regions)
            assert driver.registered_bytes == 0
        else:
            registration = backend.register_regions(regions)
            assert driver.registered_bytes == sum(size for _, size in spans)
            registration.close()
        assert driver.registered_bytes == 0
    finally:
        backend.close()
