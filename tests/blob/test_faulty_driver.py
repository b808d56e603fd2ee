"""FaultyDriver: each fault record does what it says, on the call it names, and nothing else."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from blobkit import Slab
from hypothesis import given, settings
from hypothesis import strategies as st
from kvwire_memory import MemoryDriver, MemoryStore

from kvwire.blob import BatchResult, KeyStatus, StoreDriver
from kvwire.testing.faults import Block, Decline, Evict, FailCall, FailKeys, FaultyDriver, Slow


def batch(slab: Slab, n: int, prefix: str = "k"):  # type: ignore[no-untyped-def]
    keys = [f"{prefix}{i}" for i in range(n)]
    return keys, slab.region.addresses(np.arange(n)), np.full(n, slab.region.slot_bytes, dtype=np.uint64)


@pytest.fixture
def slab(driver) -> Slab:  # type: ignore[no-untyped-def]
    s = Slab.make(16, 32, seed=1)
    driver.register([s.region])
    return s


def test_fail_call_hits_only_the_numbered_call_of_its_operation(driver, slab, store):
    faulty = FaultyDriver(driver, [FailCall("put", call=2, reason="nope")])
    keys, addrs, sizes = batch(slab, 4)
    assert faulty.put(keys[:2], addrs[:2], sizes[:2]).where(KeyStatus.OK).all()
    second = faulty.put(keys[2:], addrs[2:], sizes[2:])
    assert second.where(KeyStatus.FAILED).all() and second.first_reason() == "nope"
    assert sorted(store.keys()) == ["k0", "k1"]  # the failed call never reached the store
    assert faulty.get_into(keys[:2], slab.region.addresses(np.array([8, 9])), sizes[:2]).where(KeyStatus.OK).all()
    assert faulty.calls == {"put": 2, "get": 1, "exists": 0, "remove": 0}


def test_fail_call_can_raise_like_a_broken_driver(driver, slab):
    faulty = FaultyDriver(driver, [FailCall("get", call=None, reason="wire cut", raises=True)])
    keys, addrs, sizes = batch(slab, 2)
    with pytest.raises(RuntimeError, match="wire cut"):
        faulty.get_into(keys, addrs, sizes)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 16), start=st.integers(0, 16), width=st.integers(0, 16) | st.none(),
       kind=st.sampled_from(["fail", "decline"]))
def test_keyed_faults_hit_exactly_their_slice_and_the_rest_reaches_the_store(n, start, width, kind):
    store = MemoryStore(1 << 20)
    driver = MemoryDriver(store)
    slab = Slab.make(16, 32, seed=n)
    driver.register([slab.region])
    stop = None if width is None else start + width
    fault = FailKeys("put", start=start, stop=stop) if kind == "fail" else Decline(start=start, stop=stop)
    keys, addrs, sizes = batch(slab, n)
    result = FaultyDriver(driver, [fault]).put(keys, addrs, sizes)
    hit = np.zeros(n, dtype=bool)
    hit[start:stop] = True
    code = KeyStatus.FAILED if kind == "fail" else KeyStatus.DECLINED
    np.testing.assert_array_equal(result.where(code), hit)
    np.testing.assert_array_equal(result.where(KeyStatus.OK), ~hit)
    assert sorted(store.keys()) == sorted(k for k, h in zip(keys, hit, strict=True) if not h)
    assert set(result.reasons) == set(np.flatnonzero(hit).tolist())


def test_evict_removes_objects_behind_the_callers_back(driver, slab, store):
    keys, addrs, sizes = batch(slab, 4)
    driver.put(keys, addrs, sizes)
    faulty = FaultyDriver(driver, [Evict("get", call=1, start=1, stop=3)])
    got = faulty.get_into(keys, addrs, sizes)
    np.testing.assert_array_equal(got.status, [KeyStatus.OK, KeyStatus.MISSING, KeyStatus.MISSING, KeyStatus.OK])
    assert sorted(store.keys()) == ["k0", "k3"]


def test_block_holds_a_call_inside_the_driver_until_released(driver, slab, store):
    gate = Block("put", call=1)
    faulty = FaultyDriver(driver, [gate])
    keys, addrs, sizes = batch(slab, 2)
    results = []
    caller = threading.Thread(target=lambda: results.append(faulty.put(keys, addrs, sizes)))
    caller.start()
    assert faulty.wait_blocked(1)
    assert faulty.blocked == 1 and len(store) == 0 and not results
    gate.release.set()
    caller.join(timeout=5.0)
    assert results and results[0].where(KeyStatus.OK).all() and faulty.blocked == 0
    assert not faulty.wait_blocked(1, timeout_s=0.01)


def test_close_releases_every_block(driver):
    gate = Block("get", call=None)
    FaultyDriver(driver, [gate]).close()
    assert gate.release.is_set()


def test_slow_delays_the_call(driver, slab):
    faulty = FaultyDriver(driver, [Slow("put", call=None, delay_s=0.05)])
    keys, addrs, sizes = batch(slab, 1)
    started = time.perf_counter()
    faulty.put(keys, addrs, sizes)
    assert time.perf_counter() - started >= 0.05


def test_exists_and_remove_take_faults_too(driver, slab, store):
    keys, addrs, sizes = batch(slab, 3)
    driver.put(keys, addrs, sizes)
    faulty = FaultyDriver(driver, [FailKeys("exists", start=2), FailCall("remove", call=1)])
    np.testing.assert_array_equal(faulty.exists(keys), [True, True, False])
    assert faulty.remove(keys).where(KeyStatus.FAILED).all()
    assert len(store) == 3
    assert faulty.remove(keys).where(KeyStatus.OK).all()


def test_fault_records_are_plain_comparable_data_and_checked():
    assert FailKeys("get", call=2, start=1) == FailKeys("get", call=2, start=1)
    assert Block("put") == Block("put")  # the release event is not part of the record's value
    with pytest.raises(ValueError, match="op must be one of"):
        FailCall("get_into")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="counts calls from 1"):
        FailCall("put", call=0)
    with pytest.raises(ValueError, match="start <= stop"):
        FailKeys("put", start=3, stop=1)
    with pytest.raises(ValueError, match="delay_s"):
        Slow(delay_s=-1.0)
    with pytest.raises(TypeError, match="not a fault record"):
        FaultyDriver(MemoryDriver(MemoryStore(10)), ["fail"])  # type: ignore[list-item]


@pytest.mark.parametrize("n", [0, 1, 7, 1024])
def test_an_all_ok_batch_result_is_read_only_and_equals_a_uniform_one(n):
    ok, uniform = BatchResult.ok(n), BatchResult.uniform(n, KeyStatus.OK)
    np.testing.assert_array_equal(ok.status, uniform.status)
    assert ok.status.dtype == np.uint8 and not ok.status.flags.writeable
    assert ok.reasons == {} and ok.first_reason() is None
    assert ok.where(KeyStatus.OK).all()
    with pytest.raises(ValueError):
        ok.status[:1] = int(KeyStatus.FAILED)
    assert BatchResult.ok(n).where(KeyStatus.OK).sum() == n  # a shared array nobody could change


class _DeviceStore(MemoryDriver):
    """A driver that says it reaches DEVICE memory and gathers block objects itself (as the
    memory-device plugin's does); every parts call it gets is recorded. Host memory stands in
    for the device here: only what the wrappers pass on is under test."""

    memory_kinds = MemoryDriver.device_memory_kinds

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self.parts_calls: list[tuple[str, list[str], tuple[int, ...]]] = []

    def put_parts(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        self.parts_calls.append(("put", list(keys), tuple(int(s) for s in sizes)))
        return super().put_parts(keys, addresses, sizes)

    def get_parts_into(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        self.parts_calls.append(("get", list(keys), tuple(int(s) for s in sizes)))
        return super().get_parts_into(keys, addresses, sizes)


class _BareDeviceStore(StoreDriver):
    """Says it reaches DEVICE memory and has only put/get_into: no block objects."""

    memory_kinds = MemoryDriver.device_memory_kinds

    def __init__(self, store: MemoryStore) -> None:
        self.inner = MemoryDriver(store)

    def put(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        return self.inner.put(keys, addresses, sizes)

    def get_into(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        return self.inner.get_into(keys, addresses, sizes)

    def exists(self, keys):  # type: ignore[no-untyped-def]
        return self.inner.exists(keys)

    def remove(self, keys):  # type: ignore[no-untyped-def]
        return self.inner.remove(keys)


@pytest.mark.parametrize("wrap", ["faulty", "controlled"])
def test_wrappers_pass_block_objects_on_to_a_device_driver_that_gathers_them(wrap):
    # A DEVICE driver's parts cannot go through the host bounce buffer: a wrapper that dropped
    # them (or offers_parts) would make its backend stop declaring block-objects under the suite.
    from kvwire.testing.stores import ControlledDriver, StoreControl

    store = MemoryStore(1 << 20)
    inner = _DeviceStore(store)
    wrapped = (FaultyDriver(inner, [FailKeys("put", start=1, stop=2, reason="injected")]) if wrap == "faulty"
               else ControlledDriver(inner, StoreControl(None)))
    assert wrapped.offers_parts and wrapped.memory_kinds == inner.memory_kinds
    # and a DEVICE driver without parts calls of its own offers none through the wrapper either
    bare = _BareDeviceStore(store)
    assert not bare.offers_parts
    assert not (FaultyDriver(bare) if wrap == "faulty" else ControlledDriver(bare, StoreControl(None))).offers_parts
    slab = Slab.make(8, 32, seed=3)
    original = slab.array.copy()
    wrapped.register([slab.region])
    keys = ["b0", "b1", "b2"]
    addresses = np.stack([slab.region.addresses(np.array([0, 1, 2])), slab.region.addresses(np.array([3, 4, 5]))], axis=1)
    sizes = np.array([32, 32], dtype=np.uint64)
    put = wrapped.put_parts(keys, addresses, sizes)
    want_put = [True, wrap != "faulty", True]
    assert put.where(KeyStatus.OK).tolist() == want_put, put
    assert inner.parts_calls[0][0] == "put" and inner.parts_calls[0][2] == (32, 32), inner.parts_calls
    back = np.stack([slab.region.addresses(np.array([6, 7, 6])), slab.region.addresses(np.array([7, 6, 7]))], axis=1)
    got = wrapped.get_parts_into(keys[:1], back[:1], sizes)
    assert got.where(KeyStatus.OK).all() and inner.parts_calls[-1] == ("get", ["b0"], (32, 32))
    np.testing.assert_array_equal(slab.array[6], original[0])
    np.testing.assert_array_equal(slab.array[7], original[3])
