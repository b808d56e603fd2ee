"""Block objects (K1) in the files store: one entry of a pack per block, holding the block's row
of every group, written with one iovec per part and read back with one ``preadv`` iovec per part.

Bytes are checked by reading numpy memory and the pack files themselves, never through the
backend under test; a second backend on the same root stands for another process's view (it keeps
its own index, read from the directory)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvwire_files import FilesDriver, FileStore, plugin

from kvwire.blob import BlobBackend, block_keys, store_keys
from kvwire.contract import (
    BLOCK_OBJECTS,
    CacheKind,
    Hint,
    LayerGroupRows,
    MemoryKind,
    Outcome,
    SlotRegion,
    TokenRange,
    View,
    block_layout,
)

NAMESPACE = "blocks"
_ids = iter(range(1, 1 << 30))


def build(root: Path, **options: Any) -> BlobBackend:
    backend = plugin.build({"root": str(root), "namespace": NAMESPACE, **options})
    assert isinstance(backend, BlobBackend)
    return backend


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def backends(root: Path) -> Iterator[list[BlobBackend]]:
    made = [build(root), build(root)]
    yield made
    for backend in made:
        backend.close()


class Model:
    """One array per group (``blocks`` rows of that group's size), registered with a backend."""

    def __init__(self, backend: BlobBackend, blocks: int, sizes: Sequence[int], seed: int | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.arrays = [rng.integers(0, 256, (blocks, size), dtype=np.uint8) if seed is not None
                       else np.zeros((blocks, size), dtype=np.uint8) for size in sizes]
        self.regions = [SlotRegion(next(_ids), a.ctypes.data, a.shape[1], blocks, MemoryKind.HOST) for a in self.arrays]
        self.registration = backend.register_regions(self.regions)

    def view(self, names: np.ndarray, slots: Sequence[int] | np.ndarray | None = None) -> View:
        slots = np.arange(len(names)) if slots is None else np.asarray(slots)
        return View(tuple(LayerGroupRows(g, CacheKind.PAGED, r, slots, TokenRange(0, 16 * len(slots)), names)
                          for g, r in enumerate(self.regions)))

    def block(self, slot: int) -> bytes:
        return b"".join(a[slot].tobytes() for a in self.arrays)


def names_for(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    out = np.zeros((len(ids), 16), dtype=np.uint8)
    out[:, :8] = np.asarray(ids, dtype="<u8").view(np.uint8).reshape(-1, 8)
    out[:, 15] = 0x5A
    return out


def hint(v: View) -> Hint:
    return Hint.of("store", namespace=NAMESPACE, blocks=block_layout(v))


def run(backend: BlobBackend, op: str, v: View, h: Hint | None = None) -> Outcome:
    woken = threading.Event()
    attempt = getattr(backend, op)(v, hint(v) if h is None else h, woken.set)
    while not (attempt.poll() is not None and attempt.quiesced()):
        assert woken.wait(30), f"the {op} did not conclude and quiesce within 30 s"
        woken.clear()
    outcome: Outcome = attempt.poll()
    return outcome


def test_the_plugin_names_block_objects_at_its_literal_contract(root: Path) -> None:
    assert plugin.contract_version == (1, 3)
    assert BLOCK_OBJECTS in plugin.capabilities.protocols
    backend = build(root)
    try:
        assert backend.capabilities() == plugin.capabilities
    finally:
        backend.close()


def test_a_block_is_one_entry_of_a_pack_read_back_by_another_view_of_the_root(
        root: Path, backends: list[BlobBackend]) -> None:
    writer, reader = backends
    sizes = [4096, 100, 4096, 7]
    src = Model(writer, 6, sizes, seed=1)
    names = names_for(range(6))
    published = src.view(names)
    sent = run(writer, "publish", published)
    assert sent.is_delivered and all(m.all() for m in sent.masks)
    store = FileStore(str(root), capacity_bytes=1 << 30)
    try:
        keys = block_keys(NAMESPACE, block_layout(published), names)
        assert sorted(store.keys()) == sorted(keys)  # one entry per block, none per group
        for slot, key in enumerate(keys):
            place = store.locate(key)
            assert place is not None
            path, offset, size = place
            assert size == sum(sizes)
            with open(path, "rb") as pack:
                pack.seek(offset)
                assert pack.read(size) == src.block(slot)
    finally:
        store.close()
    dst = Model(reader, 8, sizes)
    order = [7, 0, 3, 5, 1, 6]
    got = run(reader, "fetch", dst.view(names, order))
    assert got.is_delivered and all(m.all() for m in got.masks)
    for slot, source in zip(order, range(6), strict=True):
        assert dst.block(slot) == src.block(source)


def test_blocks_of_many_parts_read_back_whole(root: Path, backends: list[BlobBackend]) -> None:
    """200 blocks of 32 groups lie back to back (6400 iovecs: more than one preadv takes), and a
    block of 1100 groups is more parts than one preadv takes by itself."""
    writer, reader = backends
    kept = []  # alive while registered
    for blocks, groups in ((200, 32), (3, 1100)):
        sizes = [64 + g % 3 for g in range(groups)]
        src = Model(writer, blocks, sizes, seed=blocks)
        kept.append(src)
        names = names_for(np.arange(blocks) + 1000 * groups)
        assert run(writer, "publish", src.view(names)).is_delivered
        dst = Model(reader, blocks, sizes)
        kept.append(dst)
        got = run(reader, "fetch", dst.view(names))
        assert got.is_delivered and all(m.all() for m in got.masks), got
        assert all(np.array_equal(d, s) for d, s in zip(dst.arrays, src.arrays, strict=True))


def test_a_small_fetch_moves_inside_the_call(root: Path, backends: list[BlobBackend]) -> None:
    writer, reader = backends
    assert isinstance(reader.driver, FilesDriver) and reader.driver.store.reads_without_waiting  # a tmpfs root
    src = Model(writer, 2, [1024] * 8, seed=2)
    names = names_for([1, 2])
    run(writer, "publish", src.view(names))
    dst = Model(reader, 2, [1024] * 8)
    v = dst.view(names, [1, 0])
    attempt = reader.fetch(v, hint(v), lambda: None)
    outcome = attempt.poll()
    assert outcome is not None and attempt.quiesced() and all(m.all() for m in outcome.masks)
    assert dst.block(1) == src.block(0) and dst.block(0) == src.block(1)


def test_another_layout_and_per_group_fetches_miss(root: Path, backends: list[BlobBackend]) -> None:
    writer, reader = backends
    src = Model(writer, 3, [512, 512, 512], seed=3)
    names = names_for([7, 8, 9])
    run(writer, "publish", src.view(names))
    kept = [Model(reader, 3, sizes) for sizes in ([512, 512], [512, 512, 513])]  # alive while registered
    for dst in kept:
        got = run(reader, "fetch", dst.view(names))
        assert got.is_delivered and not any(m.any() for m in got.masks)
    same = Model(reader, 3, [512, 512, 512])
    per_group = run(reader, "fetch", same.view(names), Hint.of("store", namespace=NAMESPACE))
    assert per_group.is_delivered and not any(m.any() for m in per_group.masks)
    store = FileStore(str(root), capacity_bytes=1 << 30)
    try:
        assert not any(k in store.keys() for k in store_keys(NAMESPACE, 0, names))
    finally:
        store.close()


def test_a_full_store_declines_whole_blocks(root: Path) -> None:
    backend = build(root, capacity_bytes=3 * 4 * 1024 + 64, eviction=False)
    try:
        src = Model(backend, 5, [1024] * 4, seed=4)
        names = names_for(range(5))
        sent = run(backend, "publish", src.view(names))
        assert sent.is_delivered
        held = sent.masks[0]
        assert 0 < held.sum() < 5 and all(np.array_equal(m, held) for m in sent.masks)
        dst = Model(backend, 5, [1024] * 4)
        got = run(backend, "fetch", dst.view(names))
        assert all(np.array_equal(m, held) for m in got.masks)
        for slot in np.flatnonzero(held).tolist():
            assert dst.block(slot) == src.block(slot)
    finally:
        backend.close()
