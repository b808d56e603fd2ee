"""The Mooncake store driver against a real master: round trips through registered memory, and
the status every Mooncake answer becomes."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from kvwire_mooncake.driver import MooncakeDriver, MooncakeSetupError
from kvwire_mooncake.master import MasterProcess, free_port
from kvwire_mooncake.options import ClientSettings
from mooncake_support import DEAD_MASTER_BOUND_S, Rows, until_serving, wait_for

from kvwire.blob.driver import BatchResult, KeyStatus
from kvwire.contract import MemoryKind, SlotRegion

pytestmark = pytest.mark.usefixtures("mooncake_ready")

ROW = 64 << 10


def statuses(result: BatchResult) -> list[KeyStatus]:
    return [KeyStatus(int(s)) for s in result.status]


def test_rows_round_trip_through_registered_memory(driver: MooncakeDriver, rows_factory: Callable[..., Rows],
                                                   keys: Callable[[int], list[str]]) -> None:
    src, dst = rows_factory(driver, ROW, 8), rows_factory(driver, ROW, 8)
    expected = src.fill_random(1)
    names = keys(8)

    stored = driver.put(names, src.addresses(), src.sizes())
    assert statuses(stored) == [KeyStatus.OK] * 8 and not stored.reasons
    assert driver.exists(names).all()
    got = driver.get_into(names, dst.addresses(), dst.sizes())
    assert statuses(got) == [KeyStatus.OK] * 8
    assert np.array_equal(dst.array, expected)


def test_rows_stored_by_one_client_are_read_by_another(
        driver: MooncakeDriver, other_driver: MooncakeDriver, rows_factory: Callable[..., Rows],
        keys: Callable[[int], list[str]]) -> None:
    src, dst = rows_factory(driver, ROW, 4), rows_factory(other_driver, ROW, 4)
    expected = src.fill_random(2)
    names = keys(4)
    assert statuses(driver.put(names, src.addresses(), src.sizes())) == [KeyStatus.OK] * 4
    # Read back in another order into other slots: each row lands where it is asked to.
    order = np.array([2, 0, 3, 1])
    got = other_driver.get_into([names[i] for i in order], dst.addresses(), dst.sizes())
    assert statuses(got) == [KeyStatus.OK] * 4
    assert np.array_equal(dst.array, expected[order])


def test_a_row_larger_than_the_local_buffer_moves_whole(
        driver: MooncakeDriver, other_driver: MooncakeDriver, rows_factory: Callable[..., Rows],
        keys: Callable[[int], list[str]], settings: ClientSettings) -> None:
    # Rows move zero-copy from registered memory; Mooncake's staging buffer does not bound them.
    big = settings.local_buffer_bytes + (8 << 20)
    src, dst = rows_factory(driver, big, 1), rows_factory(other_driver, big, 1)
    expected = src.fill_random(10)
    names = keys(1)
    stored = driver.put(names, src.addresses(), src.sizes())
    assert statuses(stored) == [KeyStatus.OK], stored.reasons
    got = other_driver.get_into(names, dst.addresses(), dst.sizes())
    assert statuses(got) == [KeyStatus.OK], got.reasons
    assert np.array_equal(dst.array, expected)


def test_a_missing_object_is_a_miss_not_a_failure(driver: MooncakeDriver, rows_factory: Callable[..., Rows],
                                                  keys: Callable[[int], list[str]]) -> None:
    dst = rows_factory(driver, ROW, 3)
    names = keys(3)
    got = driver.get_into(names, dst.addresses(), dst.sizes())
    assert statuses(got) == [KeyStatus.MISSING] * 3 and not got.reasons
    assert not driver.exists(names).any()
    assert statuses(driver.remove(names)) == [KeyStatus.MISSING] * 3


def test_a_second_put_keeps_the_first_object_and_says_already_there(
        driver: MooncakeDriver, rows_factory: Callable[..., Rows], keys: Callable[[int], list[str]]) -> None:
    first, second, dst = (rows_factory(driver, ROW, 2) for _ in range(3))
    kept = first.fill_random(3)
    second.fill_random(4)
    old, new = keys(2)
    assert statuses(driver.put([old], first.addresses([0]), first.sizes(1))) == [KeyStatus.OK]

    again = driver.put([old, new], second.addresses(), second.sizes())

    assert statuses(again) == [KeyStatus.ALREADY_THERE, KeyStatus.OK]
    assert statuses(driver.get_into([old], dst.addresses([0]), dst.sizes(1))) == [KeyStatus.OK]
    assert np.array_equal(dst.array[0], kept[0])


def test_without_the_existence_check_a_second_put_is_ok_and_still_keeps_the_first_object(
        driver: MooncakeDriver, rows_factory: Callable[..., Rows], keys: Callable[[int], list[str]]) -> None:
    unchecked = MooncakeDriver(driver.client, master=driver.master, close_client=False, check_existing=False)
    first, second, dst = (rows_factory(unchecked, ROW, 1) for _ in range(3))
    kept = first.fill_random(8)
    second.fill_random(9)
    names = keys(1)
    assert statuses(unchecked.put(names, first.addresses(), first.sizes())) == [KeyStatus.OK]
    assert statuses(unchecked.put(names, second.addresses(), second.sizes())) == [KeyStatus.OK]
    assert statuses(unchecked.get_into(names, dst.addresses(), dst.sizes())) == [KeyStatus.OK]
    assert np.array_equal(dst.array, kept)


def test_a_removed_object_is_gone(driver: MooncakeDriver, rows_factory: Callable[..., Rows],
                                  keys: Callable[[int], list[str]]) -> None:
    src, dst = rows_factory(driver, ROW, 2), rows_factory(driver, ROW, 2)
    src.fill_random(5)
    names = keys(2)
    driver.put(names, src.addresses(), src.sizes())
    # A removal may meet a lease (BUSY) for up to the master's lease TTL, then succeeds.
    removed = wait_for(lambda: (r := driver.remove(names[:1])).status[0] != KeyStatus.BUSY and r, 5.0,
                       "the object's lease to expire")
    assert statuses(removed) == [KeyStatus.OK]
    assert driver.exists(names).tolist() == [False, True]
    got = driver.get_into(names, dst.addresses(), dst.sizes())
    assert statuses(got) == [KeyStatus.MISSING, KeyStatus.OK]


def test_a_get_into_a_row_of_another_size_fails_as_a_size_mismatch(
        driver: MooncakeDriver, rows_factory: Callable[..., Rows], keys: Callable[[int], list[str]]) -> None:
    src = rows_factory(driver, ROW, 1)
    bigger, smaller = rows_factory(driver, 2 * ROW, 1), rows_factory(driver, ROW // 2, 1)
    src.fill_random(6)
    (name,) = keys(1)
    driver.put([name], src.addresses(), src.sizes())

    into_bigger = driver.get_into([name], bigger.addresses(), bigger.sizes())
    into_smaller = driver.get_into([name], smaller.addresses(), smaller.sizes())

    for result, row in ((into_bigger, 2 * ROW), (into_smaller, ROW // 2)):
        assert statuses(result) == [KeyStatus.FAILED]
        reason = result.reasons[0]
        assert "size mismatch" in reason and str(ROW) in reason and str(row) in reason
    assert "-600" in into_smaller.reasons[0]


def test_an_overlapping_registration_is_refused_and_leaves_nothing_registered(
        driver: MooncakeDriver, rows_factory: Callable[..., Rows]) -> None:
    held = rows_factory(driver, ROW, 2)
    fresh = Rows(ROW, 2)
    clash = SlotRegion(held.region.region_id + 10_000, held.region.base, ROW, 1, MemoryKind.HOST)
    with pytest.raises(RuntimeError, match=f"region {clash.region_id}"):
        driver.register([fresh.region, clash])
    # Nothing of the refused batch stayed: the first region registers again cleanly.
    driver.register([fresh.region])
    driver.unregister([fresh.region])


def test_setup_against_an_absent_master_fails_in_seconds(mooncake_ready: None) -> None:
    address = f"127.0.0.1:{free_port()}"
    began = time.monotonic()
    with pytest.raises(MooncakeSetupError, match=address.replace(".", r"\.")):
        MooncakeDriver.connect(ClientSettings(master=address, segment_bytes=0, setup_retries=1))
    assert time.monotonic() - began < 10


# -- a store with little space and long leases -----------------------------------------------


@pytest.fixture(scope="module")
def tight(mooncake_ready: None) -> Iterator[MooncakeDriver]:
    """The only client of its master, contributing the smallest segment Mooncake takes (16 MiB);
    what it reads stays leased for 10 s."""
    with MasterProcess(lease_ttl_ms=10_000) as master:
        d = MooncakeDriver.connect(ClientSettings(master=master.address, segment_bytes=16 << 20, setup_retries=1))
        yield d
        d.close()


def test_a_store_without_space_declines_puts(tight: MooncakeDriver, rows_factory: Callable[..., Rows],
                                             keys: Callable[[int], list[str]]) -> None:
    src = rows_factory(tight, 1 << 20, 24)
    expected = src.fill_random(7)
    names = keys(24)
    try:
        stored = tight.put(names, src.addresses(), src.sizes())
        ok, declined = stored.where(KeyStatus.OK), stored.where(KeyStatus.DECLINED)
        assert ok.any() and declined.any()
        assert (ok | declined).all(), stored.reasons
        assert all("-200" in stored.reasons[i] and "NO_AVAILABLE_HANDLE" in stored.reasons[i]
                   for i in np.flatnonzero(declined))
        dst = rows_factory(tight, 1 << 20, int(ok.sum()))
        kept = [n for n, good in zip(names, ok, strict=True) if good]
        read = np.array(statuses(tight.get_into(kept, dst.addresses(), dst.sizes())))
        # above its high watermark the master evicts a share of the objects in the background,
        # so an object it took may be gone by the read (seen under CPU load): a miss, never a fault
        assert set(read.tolist()) <= {KeyStatus.OK, KeyStatus.MISSING} and (read == KeyStatus.OK).any(), read
        whole = read == KeyStatus.OK
        assert np.array_equal(dst.array[whole], expected[ok][whole])
    finally:
        tight.client.remove_all(True)


def test_two_puts_of_the_same_keys_at_once_both_say_the_store_holds_them(
        tight: MooncakeDriver, rows_factory: Callable[..., Rows], keys: Callable[[int], list[str]]) -> None:
    # Two attempts publishing the same names at once: Mooncake answers the later put 0 while the
    # earlier one still writes, and holds the object a moment later. Neither put may call its
    # rows not stored (a publish to a store with room holds every row, A5). Its own store, emptied
    # first, holds every round (8 MiB of 16): the session's shared one may be full.
    tight.client.remove_all(True)
    a, b = rows_factory(tight, 64 << 10, 16), rows_factory(tight, 64 << 10, 16)
    a.fill_random(11)
    b.array[:] = a.array
    answers: list[tuple[list[KeyStatus], dict[int, str]]] = []
    for _ in range(8):
        names = keys(16)
        start = threading.Barrier(2)

        def put(rows: Rows, names: list[str] = names, start: threading.Barrier = start) -> None:
            start.wait()
            result = tight.put(names, rows.addresses(), rows.sizes())
            answers.append((statuses(result), result.reasons))

        threads = [threading.Thread(target=put, args=(rows,)) for rows in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert tight.exists(names).all()
    held = {KeyStatus.OK, KeyStatus.ALREADY_THERE}
    tight.client.remove_all(True)
    wrong = [(answer, reasons) for answer, reasons in answers if not set(answer) <= held]
    assert not wrong, wrong


def test_removing_a_leased_object_is_busy(tight: MooncakeDriver, rows_factory: Callable[..., Rows],
                                          keys: Callable[[int], list[str]]) -> None:
    src = rows_factory(tight, ROW, 1)
    names = keys(1)
    assert statuses(tight.put(names, src.addresses(), src.sizes())) == [KeyStatus.OK]
    # A read leases the object for the master's lease TTL (here 10 s).
    assert statuses(tight.get_into(names, src.addresses(), src.sizes())) == [KeyStatus.OK]
    removed = tight.remove(names)
    assert statuses(removed) == [KeyStatus.BUSY]
    assert "-706" in removed.reasons[0] and "OBJECT_HAS_LEASE" in removed.reasons[0]
    assert tight.exists(names).all()
    tight.client.remove_all(True)


# -- a master that dies or hangs -------------------------------------------------------------


@pytest.fixture(scope="module")
def fragile(mooncake_ready: None) -> Iterator[tuple[MasterProcess, MooncakeDriver]]:
    master = MasterProcess().start()
    d = MooncakeDriver.connect(ClientSettings(master=master.address, segment_bytes=16 << 20, setup_retries=1))
    try:
        yield master, d
    finally:
        # A client whose master is gone takes ~11 s to close: bring the master back first.
        if not master.running():
            master.start()
        until_serving(d.client)
        d.close()
        master.stop()


@pytest.fixture
def doomed(fragile: tuple[MasterProcess, MooncakeDriver]) -> tuple[MasterProcess, MooncakeDriver]:
    """The fragile master, running and reachable by its client at the start of the test."""
    master, d = fragile
    if not master.running():
        master.start()
    until_serving(d.client)
    return master, d


def test_calls_against_a_killed_master_fail_within_the_bound(
        doomed: tuple[MasterProcess, MooncakeDriver], rows_factory: Callable[..., Rows],
        keys: Callable[[int], list[str]]) -> None:
    master, d = doomed
    rows = rows_factory(d, ROW, 2)
    names = keys(2)
    master.kill()
    calls = {
        "put": lambda: d.put(names, rows.addresses(), rows.sizes()),
        "get": lambda: d.get_into(names, rows.addresses(), rows.sizes()),
        "remove": lambda: d.remove(names),
    }
    for op, call in calls.items():
        began = time.monotonic()
        result = call()
        took = time.monotonic() - began
        assert statuses(result) == [KeyStatus.FAILED] * 2, op
        assert "-900" in result.reasons[0] and "RPC_FAIL" in result.reasons[0], (op, result.reasons[0])
        assert took < DEAD_MASTER_BOUND_S, (op, took)
    assert not d.exists(names).any()
    # Once the client has noticed, calls fail at once instead of waiting for a connect timeout.
    wait_for(lambda: d.client.health_check() == 2, 10.0, "the client to notice the dead master")
    began = time.monotonic()
    assert statuses(d.get_into(names, rows.addresses(), rows.sizes())) == [KeyStatus.FAILED] * 2
    assert time.monotonic() - began < 0.5


def test_a_call_in_flight_when_the_master_dies_fails(
        doomed: tuple[MasterProcess, MooncakeDriver], rows_factory: Callable[..., Rows],
        keys: Callable[[int], list[str]]) -> None:
    master, d = doomed
    rows = rows_factory(d, ROW, 2)
    names = keys(2)
    answers: list[BatchResult] = []
    master.freeze()  # the call will wait for an answer that never comes...
    caller = threading.Thread(target=lambda: answers.append(d.get_into(names, rows.addresses(), rows.sizes())))
    caller.start()
    wait_for(lambda: d.in_progress == 1, 5.0, "the get to be inside the Mooncake client")
    began = time.monotonic()
    master.kill()  # ...until the master dies under it
    caller.join(DEAD_MASTER_BOUND_S)
    assert not caller.is_alive(), "the call did not return after the master died"
    assert time.monotonic() - began < DEAD_MASTER_BOUND_S
    (result,) = answers
    assert statuses(result) == [KeyStatus.FAILED] * 2
    assert "-900" in result.reasons[0] or "-901" in result.reasons[0], result.reasons[0]


def test_a_call_to_a_hung_master_fails_after_the_rpc_timeout(
        doomed: tuple[MasterProcess, MooncakeDriver], rows_factory: Callable[..., Rows],
        keys: Callable[[int], list[str]]) -> None:
    master, d = doomed
    rows = rows_factory(d, ROW, 1)
    master.freeze()
    try:
        began = time.monotonic()
        result = d.get_into(keys(1), rows.addresses(), rows.sizes())
        took = time.monotonic() - began
    finally:
        master.kill()
    assert statuses(result) == [KeyStatus.FAILED]
    assert "-901" in result.reasons[0] and "RPC_TIMEOUT" in result.reasons[0], result.reasons[0]
    assert took < 3.0 + 1.5  # MC_RPC_TIMEOUT_MS=3000, set by conftest


@pytest.mark.parametrize("part_bytes", [16 << 10, 128 << 10], ids=["small-parts-bounced", "large-parts-direct"])
def test_block_objects_read_by_another_client_land_part_by_part(
        driver: MooncakeDriver, other_driver: MooncakeDriver, rows_factory: Callable[..., Rows],
        keys: Callable[[int], list[str]], part_bytes: int) -> None:
    # A block object of 4 parts (4 layers' rows of one block), put from one client's regions and
    # read by another client into other slots of its own regions: small parts of an object in
    # another segment go through a bounce buffer, parts of 64 KiB and more straight into place
    # (an 8B-class model's block is 32 parts of 128 KiB). Either way each part lands in its row.
    layers, blocks = 4, 6
    src = [rows_factory(driver, part_bytes, blocks) for _ in range(layers)]
    dst = [rows_factory(other_driver, part_bytes, blocks + 2) for _ in range(layers)]
    expected = [rows.fill_random(40 + i) for i, rows in enumerate(src)]
    names = keys(blocks)
    at = np.stack([rows.addresses() for rows in src], axis=1)
    sizes = np.full(layers, part_bytes, dtype=np.int64)
    assert statuses(driver.put_parts(names, at, sizes)) == [KeyStatus.OK] * blocks
    slots = [7, 2, 5, 0, 3, 6]
    into = np.stack([rows.addresses(slots) for rows in dst], axis=1)
    assert statuses(other_driver.get_parts_into(names, into, sizes)) == [KeyStatus.OK] * blocks
    for layer in range(layers):
        assert np.array_equal(dst[layer].array[slots], expected[layer]), layer
    # A read with another layout of the same object fails its keys, and writes nothing.
    before = [rows.array.copy() for rows in dst]
    wrong = other_driver.get_parts_into(names[:1], into[:1, :2], np.full(2, part_bytes, dtype=np.int64))
    assert statuses(wrong) != [KeyStatus.OK]
    assert all(np.array_equal(rows.array, old) for rows, old in zip(dst, before, strict=True))


class _LeaseRunsOut:
    """The real client, except that its first read of the chosen keys reports Mooncake's -707
    (LEASE_EXPIRED: the lease ran out before the transfer was done) after scribbling over what
    landed in their rows, as a read outlived by its lease may leave them. Fault injection on top
    of a real client and master."""

    def __init__(self, client: object, doomed: set[str]) -> None:
        self._client, self._doomed, self.reads = client, doomed, []

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def _read(self, call: str, keys: list[str], addresses: list, sizes: list) -> list[int]:
        self.reads.append(list(keys))
        answer = list(getattr(self._client, call)(keys, addresses, sizes))
        for i, key in enumerate(keys):
            if key in self._doomed:
                self._doomed.discard(key)
                at = addresses[i] if isinstance(addresses[i], list) else [addresses[i]]
                lengths = sizes[i] if isinstance(sizes[i], list) else [sizes[i]]
                for address, length in zip(at, lengths, strict=True):
                    ctypes.memset(address, 0xEE, length)
                answer[i] = -707
        return answer

    def batch_get_into(self, keys: list[str], addresses: list, sizes: list) -> list[int]:
        return self._read("batch_get_into", keys, addresses, sizes)

    def batch_get_into_multi_buffers(self, keys: list[str], addresses: list, sizes: list) -> list[int]:
        return self._read("batch_get_into_multi_buffers", keys, addresses, sizes)


@pytest.mark.parametrize("objects", ["rows", "blocks"])
def test_objects_whose_read_lease_ran_out_are_read_again_whole(
        driver: MooncakeDriver, rows_factory: Callable[..., Rows], keys: Callable[[int], list[str]],
        objects: str) -> None:
    """A long read on a busy host can outlive the master's lease on some of its objects (seen as
    -707 in a 16k-token load: 31 of 511 blocks lost, and vLLM recomputed the whole prompt). The
    objects are still stored: only those are read again, and every row holds its object whole."""
    layers, count = (1, 6) if objects == "rows" else (3, 6)
    src = [rows_factory(driver, ROW, count) for _ in range(layers)]
    expected = [rows.fill_random(60 + i) for i, rows in enumerate(src)]
    names = keys(count)
    sizes = np.full(layers, ROW, dtype=np.int64)
    if objects == "rows":
        assert statuses(driver.put(names, src[0].addresses(), src[0].sizes())) == [KeyStatus.OK] * count
    else:
        at = np.stack([rows.addresses() for rows in src], axis=1)
        assert statuses(driver.put_parts(names, at, sizes)) == [KeyStatus.OK] * count
    client = _LeaseRunsOut(driver.client, {names[1], names[4]})
    reader = MooncakeDriver(client, master=driver.master, close_client=False)
    dst = [rows_factory(reader, ROW, count) for _ in range(layers)]
    if objects == "rows":
        got = reader.get_into(names, dst[0].addresses(), dst[0].sizes())
    else:
        got = reader.get_parts_into(names, np.stack([rows.addresses() for rows in dst], axis=1), sizes)
    assert statuses(got) == [KeyStatus.OK] * count, got.reasons
    for layer in range(layers):
        assert np.array_equal(dst[layer].array, expected[layer]), layer
    assert client.reads[1:] == [[names[1], names[4]]]  # once more, those two alone
