"""Block objects through a blob backend (K1): one stored object per block across a view's groups.

Each behaviour runs on two drivers: the in-memory store, and the example plugin's ``DictDriver``,
which does not override the parts calls, so its block objects go through the default bounce
buffer of :mod:`kvwire.blob.parts`. Bytes are checked by reading the numpy memory and the stores'
objects directly, never through the backend."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
from blobkit import Slab, Waker, names, settle
from hypothesis import given, settings
from hypothesis import strategies as st
from kvwire_example import DictDriver
from kvwire_example import stores as dict_stores
from kvwire_memory import MemoryDriver, MemoryStore

from kvwire.blob import BatchResult, BlobBackend, KeyStatus, StoreDriver, block_keys, parts, store_keys
from kvwire.contract import (
    BLOCK_OBJECTS,
    CacheKind,
    Cause,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Outcome,
    TokenRange,
    View,
    block_layout,
)
from kvwire.contract.outcome import OutcomeStatus
from kvwire.testing.faults import Block, Decline, FailKeys, FaultyDriver

#: A model's groups in the order a view lists them (not ascending, on purpose) and their row sizes.
SHAPE = {3: 48, 0: 100, 7: 24}
TOTAL = sum(SHAPE.values())


class Store:
    """One store the tests can look into, whichever driver reaches it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.memory = MemoryStore(1 << 30)
        self.name = f"blocks-{uuid.uuid4().hex[:8]}"

    def driver(self) -> StoreDriver:
        return MemoryDriver(self.memory) if self.kind == "memory" else DictDriver(self.name)

    def keys(self) -> list[str]:
        return self.memory.keys() if self.kind == "memory" else list(dict_stores.get(self.name, {}))

    def object(self, key: str) -> bytes | None:
        return self.memory.lookup(key) if self.kind == "memory" else dict_stores.get(self.name, {}).get(key)

    def insert(self, key: str, data: bytes) -> None:
        if self.kind == "memory":
            self.memory.insert(key, data)
        else:
            dict_stores.setdefault(self.name, {})[key] = data


@pytest.fixture(params=["memory", "dict"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    made = Store(request.param)
    yield made
    dict_stores.pop(made.name, None)


class Rows:
    """One slab per group of a shape, registered with a backend."""

    def __init__(self, backend: BlobBackend, rows: int, shape: dict[int, int] = SHAPE, seed: int | None = None) -> None:
        self.slabs = {gid: Slab.make(rows, size, seed=None if seed is None else seed + gid)
                      for gid, size in shape.items()}
        self.registration = backend.register_regions([s.region for s in self.slabs.values()])

    def view(self, slots: Sequence[int], ids: Sequence[int] | None, groups: Sequence[int] | None = None,
             width: int = 16) -> View:
        """The rows ``slots`` of each group (in ``groups`` order, default: the shape's), named
        ``ids`` in every group."""
        slots = np.asarray(slots, dtype=np.int64)
        nm = None if ids is None else names(ids, width)
        chosen = list(self.slabs) if groups is None else groups
        return View(tuple(LayerGroupRows(gid, CacheKind.PAGED, self.slabs[gid].region, slots,
                                         TokenRange(0, 16 * max(1, slots.size)), nm) for gid in chosen))

    def block(self, slot: int) -> bytes:
        """Row ``slot`` of every group, in ascending group id: a block object's bytes."""
        return b"".join(self.slabs[gid].array[slot].tobytes() for gid in sorted(self.slabs))


def blocks_hint(v: View, namespace: str = "ns", **fields: object) -> Hint:
    return Hint.of("store", namespace=namespace, blocks=block_layout(v), **fields)  # type: ignore[arg-type]


def run(backend: BlobBackend, op: str, v: View, hint: Hint) -> Outcome:
    waker = Waker()
    return settle(getattr(backend, op)(v, hint, waker), waker)


@pytest.fixture
def make_backend() -> Iterator[Callable[..., BlobBackend]]:
    made: list[BlobBackend] = []

    def make(driver: StoreDriver, **options: object) -> BlobBackend:
        backend = BlobBackend(driver, **options)  # type: ignore[arg-type]
        made.append(backend)
        return backend

    yield make
    for backend in made:
        if isinstance(backend.driver, FaultyDriver):
            backend.driver.release_all()
        backend.close(timeout_s=5.0)


def same_bits(outcome: Outcome, expected: Sequence[bool]) -> None:
    """Every group's mask is ``expected`` (K1.4, K1.5: a block is whole in every group or in none)."""
    for mask in outcome.masks:
        np.testing.assert_array_equal(mask, np.asarray(expected, dtype=bool))


# -- publish and fetch -----------------------------------------------------------------------


def test_the_backend_names_block_objects_from_contract_1_3_on(store, make_backend):
    assert BLOCK_OBJECTS in make_backend(store.driver()).capabilities().protocols
    old = make_backend(store.driver(), contract_version=(1, 2))
    assert BLOCK_OBJECTS not in old.capabilities().protocols
    rows = Rows(old, 2, seed=1)
    v = rows.view([0, 1], [0, 1])
    with pytest.raises(InvalidSubmission, match="'blocks'"):
        old.publish(v, blocks_hint(v), Waker())
    assert store.keys() == []


def test_a_publish_keeps_one_object_per_block_of_every_group_in_ascending_id(store, make_backend):
    backend = make_backend(store.driver())
    rows = Rows(backend, 5, seed=10)
    v = rows.view([4, 0, 2], [40, 0, 20])
    sent = run(backend, "publish", v, blocks_hint(v, "tenant"))
    assert sent.status is OutcomeStatus.DELIVERED
    same_bits(sent, [True, True, True])
    keys = block_keys("tenant", block_layout(v), names([40, 0, 20]))
    assert sorted(store.keys()) == sorted(keys)  # one object per block, none per group
    assert all(k.startswith("kvw1/tenant/b") for k in keys)
    for key, slot in zip(keys, [4, 0, 2], strict=True):
        assert store.object(key) == rows.block(slot)


def test_a_fetch_of_the_same_layout_reads_every_group_back(store, make_backend):
    writer, reader = make_backend(store.driver()), make_backend(store.driver())
    src = Rows(writer, 4, seed=20)
    published = src.view([0, 1, 2, 3], [0, 1, 2, 3])
    assert run(writer, "publish", published, blocks_hint(published)).status is OutcomeStatus.DELIVERED
    dst = Rows(reader, 6)
    # Groups in another order, rows in another order, an unknown name among them (A9.3, A9.4).
    asked = dst.view([5, 0, 3, 1, 4], [2, 9, 0, 3, 1], groups=[7, 3, 0])
    got = run(reader, "fetch", asked, blocks_hint(asked))
    assert got.status is OutcomeStatus.DELIVERED
    same_bits(got, [True, False, True, True, True])
    for gid in SHAPE:
        for slot, source in ((5, 2), (3, 0), (1, 3), (4, 1)):
            np.testing.assert_array_equal(dst.slabs[gid].array[slot], src.slabs[gid].array[source])


@pytest.mark.parametrize("other", ["a group fewer", "a group more", "another row size", "another group id"])
def test_a_fetch_of_another_layout_misses_in_every_group(store, make_backend, other):
    backend = make_backend(store.driver())
    src = Rows(backend, 2, seed=30)
    published = src.view([0, 1], [0, 1])
    run(backend, "publish", published, blocks_hint(published))
    shape = {
        "a group fewer": {3: 48, 0: 100},
        "a group more": {**SHAPE, 9: 8},
        "another row size": {3: 48, 0: 100, 7: 25},
        "another group id": {3: 48, 0: 100, 8: 24},
    }[other]
    dst = Rows(backend, 2, shape)
    asked = dst.view([0, 1], [0, 1])
    got = run(backend, "fetch", asked, blocks_hint(asked))
    assert got.status is OutcomeStatus.DELIVERED  # a miss, never a fault (A5.8)
    same_bits(got, [False, False])
    for slab in dst.slabs.values():  # never a part of a block (K1.5)
        assert not slab.array.any()


def test_block_objects_and_per_group_objects_never_meet(store, make_backend):
    backend = make_backend(store.driver())
    src = Rows(backend, 4, seed=40)
    run(backend, "publish", src.view([0, 1], [0, 1]), Hint.of("store", namespace="ns"))
    blocked = src.view([2, 3], [2, 3])
    run(backend, "publish", blocked, blocks_hint(blocked))
    dst = Rows(backend, 4)
    every = dst.view([0, 1, 2, 3], [0, 1, 2, 3])
    by_block = run(backend, "fetch", every, blocks_hint(every))
    same_bits(by_block, [False, False, True, True])
    by_group = run(backend, "fetch", every, Hint.of("store", namespace="ns"))
    same_bits(by_group, [True, True, False, False])


def test_namespaces_keep_block_objects_apart(store, make_backend):
    backend = make_backend(store.driver())
    src = Rows(backend, 2, seed=50)
    v = src.view([0, 1], [0, 1])
    run(backend, "publish", v, blocks_hint(v, "tenant-a"))
    dst = Rows(backend, 2)
    asked = dst.view([0, 1], [0, 1])
    same_bits(run(backend, "fetch", asked, blocks_hint(asked, "tenant-b")), [False, False])
    same_bits(run(backend, "fetch", asked, blocks_hint(asked, "tenant-a")), [True, True])


def test_repeated_names_store_one_object_and_fill_every_fetched_row(store, make_backend):
    backend = make_backend(store.driver())
    src = Rows(backend, 3, seed=60)
    v = src.view([0, 1, 2], [7, 7, 8])  # block 7 named on two rows (V4.5)
    sent = run(backend, "publish", v, blocks_hint(v))
    same_bits(sent, [True, True, True])
    assert len(store.keys()) == 2
    dst = Rows(backend, 4)
    asked = dst.view([3, 0, 2], [7, 8, 7])
    got = run(backend, "fetch", asked, blocks_hint(asked))
    same_bits(got, [True, True, True])
    held = store.object(block_keys("ns", block_layout(v), names([7]))[0])
    assert held in (src.block(0), src.block(1))
    assert dst.block(3) == held and dst.block(2) == held
    assert dst.block(0) == src.block(2)


def test_a_view_without_rows_concludes_with_empty_masks(store, make_backend):
    backend = make_backend(store.driver())
    rows = Rows(backend, 1)
    for op in ("publish", "fetch"):
        v = rows.view([], [])
        got = run(backend, op, v, blocks_hint(v))
        assert got.status is OutcomeStatus.DELIVERED
        assert [m.size for m in got.masks] == [0, 0, 0]
        no_groups = View(())
        assert run(backend, op, no_groups, blocks_hint(no_groups)).masks == ()


@settings(max_examples=20, deadline=None)
@given(data=st.data(), blocks=st.integers(1, 12), chunk_blocks=st.integers(1, 5), inline=st.booleans())
def test_chunking_moves_whole_blocks_and_changes_no_result(data, blocks, chunk_blocks, inline):
    """A9.1: the same bits and bytes whatever the chunk size, with every chunk whole blocks."""
    published = np.array(data.draw(st.lists(st.booleans(), min_size=blocks, max_size=blocks)), dtype=bool)
    calls: list[tuple[int, int]] = []

    class Counting(MemoryDriver):
        def put_parts(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
            calls.append((len(keys), int(np.asarray(sizes).sum())))
            return super().put_parts(keys, addresses, sizes)

    memory = MemoryStore(1 << 30)
    options = {"chunk_bytes": chunk_blocks * TOTAL, "inline_bytes": (1 << 20) if inline else 0}
    writer, reader = BlobBackend(Counting(memory), **options), BlobBackend(MemoryDriver(memory), **options)
    try:
        src, dst = Rows(writer, blocks, seed=blocks), Rows(reader, blocks)
        ids = np.arange(blocks)
        v = src.view(ids[published], ids[published])
        sent = run(writer, "publish", v, blocks_hint(v))
        same_bits(sent, [True] * int(published.sum()))
        assert all(n <= chunk_blocks and total == TOTAL for n, total in calls)
        assert sum(n for n, _ in calls) == published.sum()
        order = np.array(data.draw(st.permutations(range(blocks))), dtype=np.int64)
        asked = dst.view(order, ids)
        got = run(reader, "fetch", asked, blocks_hint(asked))
        same_bits(got, published)
        for slot, name in zip(order[published], ids[published], strict=True):
            assert dst.block(int(slot)) == src.block(int(name))
    finally:
        writer.close()
        reader.close()


def test_the_drivers_key_bound_counts_each_part_of_a_block(store, make_backend):
    """A driver's max_batch_keys bounds the spans of a parts call: 7 // 3 groups = 2 blocks."""
    driver = store.driver()
    driver.max_batch_keys = 7
    asked: list[int] = []
    inner_put = driver.put_parts

    def put_parts(keys, addresses, sizes):  # type: ignore[no-untyped-def]
        asked.append(len(keys))
        return inner_put(keys, addresses, sizes)

    driver.put_parts = put_parts  # type: ignore[method-assign]
    backend = make_backend(driver, inline_bytes=0)
    rows = Rows(backend, 5, seed=70)
    v = rows.view(range(5), range(5))
    same_bits(run(backend, "publish", v, blocks_hint(v)), [True] * 5)
    assert sorted(asked) == [1, 2, 2]


# -- refusals (K1.3) ---------------------------------------------------------------------------


def _refusals(rows: Rows) -> dict[str, tuple[View, object]]:
    good = rows.view([0, 1], [0, 1])
    layout = block_layout(good)
    names_differ = View((good.groups[0], good.groups[1],
                         LayerGroupRows(7, CacheKind.PAGED, rows.slabs[7].region, np.array([0, 1]),
                                        TokenRange(0, 32), names([0, 5]))))
    width_differs = View((good.groups[0], good.groups[1],
                          LayerGroupRows(7, CacheKind.PAGED, rows.slabs[7].region, np.array([0, 1]),
                                         TokenRange(0, 32), names([0, 1], width=8))))
    one_nameless = View((good.groups[0], good.groups[1],
                         LayerGroupRows(7, CacheKind.PAGED, rows.slabs[7].region, np.array([0, 1]), TokenRange(0, 32))))
    lengths_differ = View((good.groups[0], good.groups[1],
                           LayerGroupRows(7, CacheKind.PAGED, rows.slabs[7].region, np.array([0]),
                                          TokenRange(0, 16), names([0]))))
    return {
        "not a layout": (good, "all of them"),
        "a layout with a space": (good, layout.replace(",", ", ")),
        "an int": (good, 3),
        "None": (good, None),
        "another view's layout": (good, block_layout(rows.view([0], [0], groups=[3, 0]))),
        "another row size": (good, layout.replace(":24", ":25")),
        "names differ in a row": (names_differ, block_layout(names_differ)),
        "names of another width": (width_differs, block_layout(width_differs)),
        "a group without names": (one_nameless, block_layout(one_nameless)),
        "groups of different lengths": (lengths_differ, block_layout(lengths_differ)),
    }


@pytest.mark.parametrize("op", ["publish", "fetch"])
@pytest.mark.parametrize("case", [
    "not a layout", "a layout with a space", "an int", "None", "another view's layout", "another row size",
    "names differ in a row", "names of another width", "a group without names", "groups of different lengths"])
def test_a_view_that_does_not_fit_is_refused_before_anything_escapes(store, make_backend, op, case):
    faulty = FaultyDriver(store.driver())
    backend = make_backend(faulty, max_in_flight=1)
    rows = Rows(backend, 2, seed=80)
    before = {gid: slab.array.copy() for gid, slab in rows.slabs.items()}
    v, value = _refusals(rows)[case]
    waker = Waker()
    with pytest.raises(InvalidSubmission) as refused:
        getattr(backend, op)(v, Hint.of("store", namespace="ns", blocks=value), waker)  # type: ignore[arg-type]
    assert "blocks" in str(refused.value) or "K1.3" in str(refused.value) or "names" in str(refused.value)
    assert faulty.calls == {"put": 0, "get": 0, "exists": 0, "remove": 0}  # the store was told nothing
    assert store.keys() == []
    for gid, slab in rows.slabs.items():
        np.testing.assert_array_equal(slab.array, before[gid])
    good = rows.view([0, 1], [0, 1])
    assert run(backend, "publish", good, blocks_hint(good)).status is OutcomeStatus.DELIVERED  # no slot kept
    assert waker.calls == 0


def test_overlapping_fetch_rows_are_refused(store, make_backend):
    backend = make_backend(store.driver())
    rows = Rows(backend, 2)
    v = rows.view([0, 0], [0, 1])
    with pytest.raises(InvalidSubmission, match="overlap"):
        backend.fetch(v, blocks_hint(v), Waker())


# -- space, faults, cancellation and deadlines (K1.4, K1.8) --------------------------------------


def test_a_full_store_declines_whole_blocks_in_every_group(make_backend):
    memory = MemoryStore(3 * TOTAL, eviction=False)
    backend = make_backend(MemoryDriver(memory))
    rows = Rows(backend, 5, seed=90)
    v = rows.view(range(5), range(5))
    sent = run(backend, "publish", v, blocks_hint(v))
    assert sent.status is OutcomeStatus.DELIVERED  # no space is no fault (A5.11)
    same_bits(sent, [True, True, True, False, False])
    assert len(memory) == 3


def test_declined_blocks_through_the_default_bounce_are_false_in_every_group(make_backend):
    name = f"blocks-{uuid.uuid4().hex[:8]}"
    try:
        backend = make_backend(FaultyDriver(DictDriver(name), [Decline(start=1, stop=3)]))
        rows = Rows(backend, 4, seed=91)
        v = rows.view(range(4), range(4))
        sent = run(backend, "publish", v, blocks_hint(v))
        assert sent.status is OutcomeStatus.DELIVERED
        same_bits(sent, [True, False, False, True])
        assert len(dict_stores[name]) == 2
    finally:
        dict_stores.pop(name, None)


@pytest.mark.parametrize("op", ["put", "get"])
def test_a_faulty_block_fails_the_attempt_and_is_false_in_every_group(store, make_backend, op):
    writer = make_backend(store.driver())
    src = Rows(writer, 4, seed=100)
    v = src.view(range(4), range(4))
    if op == "get":
        run(writer, "publish", v, blocks_hint(v))
    backend = make_backend(FaultyDriver(store.driver(), [FailKeys(op, start=2, stop=3)]))  # type: ignore[arg-type]
    rows = Rows(backend, 4, seed=101)
    asked = rows.view(range(4), range(4))
    outcome = run(backend, "publish" if op == "put" else "fetch", asked, blocks_hint(asked))
    assert outcome.status is OutcomeStatus.FAILED and outcome.cause is Cause.FAULT
    same_bits(outcome, [True, True, False, True])


def test_cancel_and_the_deadline_hold_for_block_objects(store, make_backend):
    hold = Block("put")
    backend = make_backend(FaultyDriver(store.driver(), [hold]), inline_bytes=0)
    rows = Rows(backend, 2, seed=110)
    v = rows.view([0, 1], [0, 1])
    waker = Waker()
    attempt = backend.publish(v, blocks_hint(v), waker)
    assert backend.driver.wait_blocked()  # type: ignore[attr-defined]
    attempt.cancel()
    outcome = attempt.poll()
    assert outcome is not None and outcome.status is OutcomeStatus.CANCELLED
    assert not attempt.quiesced()  # a chunk is still inside the driver (A4.5)
    hold.release.set()
    assert settle(attempt, waker).cause is Cause.HOLDER_CANCELLED

    stuck = Block("get")
    slow = make_backend(FaultyDriver(store.driver(), [stuck]), inline_bytes=0)
    dst = Rows(slow, 2)
    asked = dst.view([0, 1], [0, 1])
    waker = Waker()
    attempt = slow.fetch(asked, blocks_hint(asked, timeout_s=0.2), waker)  # type: ignore[arg-type]
    waker.until(lambda: attempt.poll() is not None)
    outcome = attempt.poll()
    assert outcome is not None and outcome.cause is Cause.DEADLINE
    same_bits(outcome, [False, False])
    stuck.release.set()
    settle(attempt, waker)


def test_a_small_submission_has_concluded_when_the_call_returns(make_backend):
    backend = make_backend(MemoryDriver(MemoryStore(1 << 20)))
    rows = Rows(backend, 2, seed=120)
    v = rows.view([0, 1], [0, 1])
    attempt = backend.publish(v, blocks_hint(v), Waker())
    assert attempt.poll() is not None and attempt.quiesced()
    dst = Rows(backend, 2)
    asked = dst.view([1, 0], [0, 1])
    attempt = backend.fetch(asked, blocks_hint(asked), Waker())
    outcome = attempt.poll()
    assert outcome is not None and attempt.quiesced()
    same_bits(outcome, [True, True])
    assert dst.block(1) == rows.block(0)


# -- lookup (K1.7) -------------------------------------------------------------------------------


def test_a_lookup_with_blocks_answers_for_block_objects(make_backend):
    backend = make_backend(MemoryDriver(MemoryStore(1 << 20)))
    rows = Rows(backend, 4, seed=130)
    run(backend, "publish", rows.view([0], [5], groups=[0, 3, 7]), Hint.of("store", namespace="ns"))
    v = rows.view([1, 2], [1, 2])
    run(backend, "publish", v, blocks_hint(v))
    asked = names([1, 5, 2, 9])
    for groups in ([0, 3, 7], [7, 0, 3]):
        held = backend.lookup(groups, asked, blocks_hint(v))
        np.testing.assert_array_equal(held, [True, False, True, False])
        assert not held.flags.writeable
    np.testing.assert_array_equal(backend.lookup([0, 3, 7], asked, Hint.of("store", namespace="ns")),
                                  [False, True, False, False])
    np.testing.assert_array_equal(backend.lookup([0, 3, 7], asked, blocks_hint(v, "other")), [False] * 4)
    other = Rows(backend, 1, {0: 100, 3: 48, 7: 25})
    np.testing.assert_array_equal(backend.lookup([0, 3, 7], asked, blocks_hint(other.view([0], [0]))), [False] * 4)


@pytest.mark.parametrize("groups", [[0, 3], [0, 3, 7, 9], [0, 3, 7, 7], [1, 3, 7]])
def test_a_lookup_with_blocks_names_the_layouts_groups(make_backend, groups):
    backend = make_backend(MemoryDriver(MemoryStore(1 << 20)))
    rows = Rows(backend, 1)
    v = rows.view([0], [0])
    with pytest.raises(InvalidSubmission, match="K1.7"):
        backend.lookup(groups, names([0]), blocks_hint(v))


@pytest.mark.parametrize("value", ["0:4096,", "x", 7, None, "1:10,0:10"])
def test_a_lookup_refuses_a_value_that_is_no_block_layout(make_backend, value):
    backend = make_backend(MemoryDriver(MemoryStore(1 << 20)))
    with pytest.raises(InvalidSubmission, match="'blocks'"):
        backend.lookup([0, 1], names([0]), Hint.of("store", blocks=value))  # type: ignore[arg-type]


# -- the keys ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(namespace=st.sampled_from(["a", "t/x", "g1", "ns-b", "b0"]),
       gid=st.integers(0, 1 << 40),
       shape=st.lists(st.tuples(st.integers(0, 99), st.integers(1, 1 << 20)), min_size=1, max_size=6,
                      unique_by=lambda p: p[0]),
       raw=st.binary(min_size=1, max_size=32))
def test_block_keys_never_equal_per_group_keys(namespace, gid, shape, raw):
    name = np.frombuffer(raw, dtype=np.uint8).reshape(1, -1)
    layout = block_layout(shape)
    key = block_keys(namespace, layout, name)[0]
    assert key.startswith(f"kvw1/{namespace}/b") and key.endswith("/" + raw.hex())
    for other_namespace in (namespace, namespace + "/b" + key.split("/")[-2][1:]):
        assert key not in store_keys(other_namespace, gid, name)


def test_block_keys_differ_for_layouts_that_differ_in_one_size():
    name = names([1])
    assert block_keys("ns", "0:10,1:10", name) != block_keys("ns", "0:10,1:11", name)
    assert block_keys("ns", "0:10,1:10", name) != block_keys("ns", "0:10,2:10", name)
    assert block_keys("ns", "0:10,1:10", names([1, 2, 3])) == [
        block_keys("ns", "0:10,1:10", names([i]))[0] for i in (1, 2, 3)]


# -- the driver calls ----------------------------------------------------------------------------


def test_an_object_of_another_size_is_never_read_as_a_block(store, make_backend):
    backend = make_backend(store.driver())
    rows = Rows(backend, 2)
    v = rows.view([0, 1], [0, 1])
    key = block_keys("ns", block_layout(v), names([1]))[0]
    store.insert(key, b"\x01" * (TOTAL - 1))
    got = run(backend, "fetch", v, blocks_hint(v))
    assert got.status is OutcomeStatus.FAILED and got.cause is Cause.FAULT
    same_bits(got, [False, False])


@pytest.mark.parametrize("bounce", [2 * TOTAL + 5, TOTAL - 1])
def test_the_default_bounce_moves_objects_in_pieces_and_gives_its_memory_back(monkeypatch, bounce):
    """The default parts calls (a driver that does not override them): pieces of whole objects
    of at most BOUNCE_BYTES, or one object larger than it; reads of some objects among misses
    reach exactly their own parts; kept bounces stay registered, others are given back."""
    monkeypatch.setattr(parts, "BOUNCE_BYTES", bounce)
    name = f"blocks-{uuid.uuid4().hex[:8]}"
    driver = DictDriver(name)
    puts: list[int] = []
    inner_put = driver.put

    def put(keys, addresses, sizes):  # type: ignore[no-untyped-def]
        puts.append(len(keys))
        return inner_put(keys, addresses, sizes)

    driver.put = put  # type: ignore[method-assign]
    backend = BlobBackend(driver)
    try:
        src, dst = Rows(backend, 7, seed=140), Rows(backend, 7)
        registered = list(driver.spans)
        v = src.view(range(7), range(7))
        same_bits(run(backend, "publish", v, blocks_hint(v)), [True] * 7)
        assert puts == ([2, 2, 2, 1] if bounce > TOTAL else [1] * 7)
        for slot in range(7):
            assert dict_stores[name][block_keys("ns", block_layout(v), names([slot]))[0]] == src.block(slot)
        asked = dst.view([6, 5, 4, 3, 2, 1, 0], [0, 10, 2, 11, 12, 5, 6])
        got = run(backend, "fetch", asked, blocks_hint(asked))
        same_bits(got, [True, False, True, False, False, True, True])
        for slot, source in ((6, 0), (4, 2), (1, 5), (0, 6)):
            assert dst.block(slot) == src.block(source)
        for slot in (5, 3, 2):
            assert not any(dst.slabs[g].array[slot].any() for g in SHAPE)
        extra = [s for s in driver.spans if s not in registered]
        if bounce > TOTAL:
            assert len(extra) == 1 and extra[0][1] - extra[0][0] == bounce  # kept for the next call
        else:
            assert extra == []  # a bounce for one object larger than the bound is given back
    finally:
        backend.close()
        dict_stores.pop(name, None)


def test_the_default_parts_calls_refuse_arguments_that_do_not_fit():
    driver = DictDriver(f"blocks-{uuid.uuid4().hex[:8]}")
    with pytest.raises(ValueError, match="shape"):
        driver.put_parts(["a", "b"], np.zeros((2, 3), dtype=np.uint64), np.array([1, 1], dtype=np.uint64))
    with pytest.raises(ValueError, match=">= 1"):
        driver.get_parts_into(["a"], np.zeros((1, 2), dtype=np.uint64), np.array([4, 0], dtype=np.uint64))
    with pytest.raises(ValueError, match=">= 1"):
        driver.put_parts(["a"], np.zeros((1, 0), dtype=np.uint64), np.zeros(0, dtype=np.uint64))


def test_a_device_driver_without_parts_calls_does_not_name_block_objects():
    from kvwire.contract import MemoryKind

    class DeviceDriver(DictDriver):
        memory_kinds = frozenset({MemoryKind.HOST, MemoryKind.DEVICE})

    class NativeDeviceDriver(DeviceDriver):
        def put_parts(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "not used")

        def get_parts_into(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
            return BatchResult.uniform(len(keys), KeyStatus.FAILED, "not used")

    name = f"blocks-{uuid.uuid4().hex[:8]}"
    for driver, declared in ((DeviceDriver(name), False), (NativeDeviceDriver(name), True), (DictDriver(name), True)):
        assert driver.offers_parts is declared
        backend = BlobBackend(driver)
        try:
            assert (BLOCK_OBJECTS in backend.capabilities().protocols) is declared
        finally:
            backend.close()

