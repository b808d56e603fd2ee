"""Block objects (K1) through a real ``mooncake_master``: one Mooncake object per block across
every group, moved with the client's multi-buffer batch calls.

Bytes are checked by reading numpy memory, and the store's objects by asking the Mooncake
client directly, never through the backend."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from kvwire_mooncake.driver import MooncakeDriver
from kvwire_mooncake.master import MasterProcess
from mooncake_support import Rows, names_for

from kvwire.blob import BlobBackend, block_keys, store_keys
from kvwire.contract import (
    BLOCK_OBJECTS,
    CacheKind,
    Hint,
    LayerGroupRows,
    Outcome,
    TokenRange,
    View,
    block_layout,
)
from kvwire.registry import load

pytestmark = pytest.mark.usefixtures("mooncake_ready")

NAMESPACE = "block-tests"
GROUPS = 32
ROW = 512


def build(master: str, **options: Any) -> BlobBackend:
    backend = load("mooncake").build({"master": master, "segment_bytes": 64 << 20, "setup_retries": 1,
                                      "timeout_s": 20.0, "namespace": NAMESPACE, **options})
    assert isinstance(backend, BlobBackend)
    return backend


@pytest.fixture(scope="module")
def holder(master: MasterProcess) -> Iterator[BlobBackend]:
    """A client whose segment holds the objects, contributed at once: the plugin's default waits for
    the first registration, and a test that registers rows only with ``client`` (run alone, or
    first on its pytest-xdist worker) would find no segment anywhere and every put declined."""
    backend = build(master.address, segment_when="setup")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def client(master: MasterProcess) -> Iterator[BlobBackend]:
    """A client without a segment: every byte it moves crosses TCP to another client's segment."""
    backend = build(master.address, segment_bytes=0)
    yield backend
    backend.close()


class Model:
    """``groups`` regions of ``blocks`` rows, registered with a backend for one test."""

    def __init__(self, backend: BlobBackend, request: pytest.FixtureRequest, blocks: int,
                 sizes: Sequence[int] = (ROW,) * GROUPS, seed: int | None = None) -> None:
        self.rows = [Rows(size, blocks) for size in sizes]
        if seed is not None:
            for g, rows in enumerate(self.rows):
                rows.fill_random(seed + g)
        registration = backend.register_regions([r.region for r in self.rows])
        request.addfinalizer(registration.close)

    def view(self, names: np.ndarray, slots: Sequence[int] | np.ndarray | None = None) -> View:
        slots = np.arange(len(names)) if slots is None else np.asarray(slots)
        return View(tuple(LayerGroupRows(g, CacheKind.PAGED, rows.region, slots, TokenRange(0, 16 * len(slots)), names)
                          for g, rows in enumerate(self.rows)))

    def block(self, slot: int) -> bytes:
        return b"".join(rows.array[slot].tobytes() for rows in self.rows)


def settle(submit: Callable[[Callable[[], None]], Any], limit_s: float = 30.0) -> Outcome:
    woken = threading.Event()
    attempt = submit(woken.set)
    deadline = time.monotonic() + limit_s
    while not (attempt.poll() is not None and attempt.quiesced()):
        assert time.monotonic() < deadline, f"the attempt did not conclude and quiesce within {limit_s:g} s"
        woken.wait(0.05)
        woken.clear()
    outcome: Outcome = attempt.poll()
    return outcome


def hint(v: View) -> Hint:
    return Hint.of("store", namespace=NAMESPACE, blocks=block_layout(v))


def run(backend: BlobBackend, op: str, v: View, h: Hint | None = None) -> Outcome:
    return settle(lambda wake: getattr(backend, op)(v, hint(v) if h is None else h, wake))


def mooncake(backend: BlobBackend) -> Any:
    driver = backend.driver
    assert isinstance(driver, MooncakeDriver)
    return driver.client


def test_the_plugin_names_block_objects(holder: BlobBackend) -> None:
    assert BLOCK_OBJECTS in holder.capabilities().protocols
    assert BLOCK_OBJECTS in load("mooncake").capabilities.protocols


def test_a_block_of_every_group_is_one_mooncake_object_read_back_by_another_client(
        holder: BlobBackend, client: BlobBackend, request: pytest.FixtureRequest) -> None:
    src = Model(holder, request, 8, seed=1)
    names = names_for(8)
    published = src.view(names)
    sent = run(holder, "publish", published)
    assert sent.is_delivered and all(m.all() for m in sent.masks)
    store = mooncake(holder)
    keys = block_keys(NAMESPACE, block_layout(published), names)
    assert store.batch_is_exist(keys) == [1] * 8
    assert [store.get_size(k) for k in keys] == [GROUPS * ROW] * 8
    assert store.batch_is_exist(store_keys(NAMESPACE, 0, names)) == [0] * 8  # no object per group

    dst = Model(client, request, 10)
    order = np.array([9, 0, 4, 2, 7, 5, 1, 3])
    got = run(client, "fetch", dst.view(names, order))
    assert got.is_delivered and all(m.all() for m in got.masks)
    for slot, source in zip(order.tolist(), range(8), strict=True):
        assert dst.block(slot) == src.block(source)


@pytest.fixture(scope="module")
def second_holder(master: MasterProcess) -> Iterator[BlobBackend]:
    """Another client with a segment (contributed at once): the master places objects in either."""
    backend = build(master.address, segment_when="setup")
    yield backend
    backend.close()


def test_blocks_in_the_readers_own_segment_and_in_anothers_both_arrive_whole(
        holder: BlobBackend, second_holder: BlobBackend, client: BlobBackend,
        request: pytest.FixtureRequest) -> None:
    """A block in the reader's own segment is read straight into its rows; one in another
    client's segment whole into a bounce buffer and scattered: bytes, bits and misses alike."""
    sinks = {reader: Model(reader, request, 66) for reader in (holder, second_holder, client)}  # segments mounted
    src = Model(client, request, 64, seed=7)
    names = names_for(65)
    sent = run(client, "publish", src.view(names[:64]))
    assert sent.is_delivered and all(m.all() for m in sent.masks), sent
    store = mooncake(second_holder)
    keys = block_keys(NAMESPACE, block_layout(src.view(names[:64])), names[:64])
    places = {_place(r) for key in keys for r in store.get_replica_desc(key)}
    assert len(places) >= 2, "the master put every block in one segment; the test needs several"
    for reader in (second_holder, client):  # some blocks in its own segment / none
        dst = sinks[reader]
        # Name j (64: the unknown one, asked among the others) into slot order[j].
        asked = np.r_[np.arange(30), 64, np.arange(30, 64)]
        order = np.arange(65)[::-1] + 1
        got = run(reader, "fetch", dst.view(names[asked], order))
        assert got.is_delivered, got
        expected = asked != 64
        assert all(np.array_equal(m, expected) for m in got.masks)
        for name, slot in zip(asked.tolist(), order.tolist(), strict=True):
            if name != 64:
                assert dst.block(slot) == src.block(name)


def _place(replica: Any) -> str:
    return str(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)


def test_many_blocks_cross_tcp_whole_within_the_clients_queue(
        holder: BlobBackend, client: BlobBackend, request: pytest.FixtureRequest) -> None:
    """256 blocks of 32 groups (8192 buffers) from a client without a segment, and back: one
    multi-buffer call of 128 such blocks failed most of them with -800 (the client's transfer
    queue), so the driver's key bound counts each part and the calls stay below it."""
    src = Model(client, request, 256, seed=2)
    names = names_for(256)
    sent = run(client, "publish", src.view(names))
    assert sent.is_delivered and all(m.all() for m in sent.masks), sent
    dst = Model(client, request, 256)
    got = run(client, "fetch", dst.view(names))
    assert got.is_delivered and all(m.all() for m in got.masks), got
    assert all(np.array_equal(d.array, s.array) for d, s in zip(dst.rows, src.rows, strict=True))


def test_another_layout_and_per_group_fetches_miss_in_every_group(
        holder: BlobBackend, request: pytest.FixtureRequest) -> None:
    src = Model(holder, request, 3, seed=3)
    names = names_for(3)
    run(holder, "publish", src.view(names))
    fewer = Model(holder, request, 3, sizes=(ROW,) * (GROUPS - 1))
    wider = Model(holder, request, 3, sizes=(ROW,) * (GROUPS - 1) + (ROW * 2,))
    for dst in (fewer, wider):
        got = run(holder, "fetch", dst.view(names))
        assert got.is_delivered and not any(m.any() for m in got.masks), got
    same = Model(holder, request, 3)
    per_group = run(holder, "fetch", same.view(names), Hint.of("store", namespace=NAMESPACE))
    assert per_group.is_delivered and not any(m.any() for m in per_group.masks)


def test_a_name_on_several_rows_fills_each_of_them(holder: BlobBackend, client: BlobBackend,
                                                    request: pytest.FixtureRequest) -> None:
    """Mooncake's multi-buffer get writes one destination of a repeated key and reports all of
    them read; the driver reads each object once and copies it to the other rows."""
    src = Model(holder, request, 2, seed=4)
    names = names_for(2)
    run(holder, "publish", src.view(names))
    dst = Model(client, request, 4)
    asked = names[[0, 1, 0, 0]]
    got = run(client, "fetch", dst.view(asked))
    assert got.is_delivered and all(m.all() for m in got.masks)
    assert [dst.block(s) for s in range(4)] == [src.block(0), src.block(1), src.block(0), src.block(0)]


def test_a_lookup_with_blocks_asks_for_block_objects(holder: BlobBackend, request: pytest.FixtureRequest) -> None:
    src = Model(holder, request, 2, seed=5)
    names = names_for(3)
    published = src.view(names[:2])
    run(holder, "publish", published)
    held = holder.lookup(list(range(GROUPS))[::-1], names, hint(published))
    assert held.tolist() == [True, True, False]
    assert holder.lookup(list(range(GROUPS)), names, Hint.of("store", namespace=NAMESPACE)).tolist() == [False] * 3


def test_a_full_store_declines_whole_blocks(request: pytest.FixtureRequest) -> None:
    # The only client of its master, with the smallest segment Mooncake takes (16 MiB): 24
    # blocks of 1 MiB (32 rows of 32 KiB) do not all fit.
    with MasterProcess(lease_ttl_ms=10_000) as small:
        backend = build(small.address, segment_bytes=16 << 20)
        try:
            src = Model(backend, request, 24, sizes=(32 << 10,) * GROUPS, seed=6)
            names = names_for(24)
            sent = run(backend, "publish", src.view(names))
            assert sent.is_delivered, sent
            held = sent.masks[0]
            assert held.any() and not held.all()
            assert all(np.array_equal(m, held) for m in sent.masks)  # whole blocks in every group
            dst = Model(backend, request, 24, sizes=(32 << 10,) * GROUPS)
            got = run(backend, "fetch", dst.view(names))
            found = got.masks[0]
            assert got.is_delivered and found.any() and not (found & ~held).any()
            assert all(np.array_equal(m, found) for m in got.masks)
            for slot in np.flatnonzero(found).tolist():
                assert dst.block(slot) == src.block(slot)
        finally:
            backend.close()
