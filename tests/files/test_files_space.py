"""The files store on a file system smaller than its capacity, or filled by other files: out of
space counts as full. The store evicts and writes again, declines with a reason (and a log line)
what still finds no room, and never counts more capacity than the file system holds. Each test
mounts its own 8 MiB tmpfs (root only) and unmounts it afterwards, also when it fails."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from kvwire_files import FilesDriver, FileStore, plugin

from kvwire.blob import KeyStatus
from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View

MIB = 1 << 20
ROW = 16 << 10          # a vLLM block of one layer of a small model
ROWS = 64               # one publish: 1 MiB
HINT = Hint.of("store", namespace="small")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted at a fresh directory, unmounted (lazily if busy) at the end."""
    mount = tmp_path / "small"
    mount.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mount)],
                              capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no mount command here: an 8 MiB file system cannot be made")
    if done.returncode != 0:
        pytest.skip(f"mounting an 8 MiB tmpfs was refused (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def _settle(backend: object, op: str, view: View) -> object:
    woken = threading.Event()
    attempt = getattr(backend, op)(view, HINT, woken.set)
    while not (attempt.poll() is not None and attempt.quiesced()):
        assert woken.wait(30), f"{op} did not conclude"
        woken.clear()
    return attempt.poll()


def _view(memory: np.ndarray, names: np.ndarray) -> tuple[SlotRegion, View]:
    region = SlotRegion(1, memory.ctypes.data, memory.shape[1], memory.shape[0], MemoryKind.HOST)
    return region, View((LayerGroupRows(0, CacheKind.PAGED, region, np.arange(memory.shape[0]),
                                        TokenRange(0, 16 * memory.shape[0]), names),))


def _batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, size=(ROWS, ROW), dtype=np.uint8),
            rng.integers(0, 256, size=(ROWS, 16), dtype=np.uint8))


def _publish_many(backend: object, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` publishes of 1 MiB each, every one storing every row (asserted)."""
    batches = []
    for seed in range(count):
        data, names = _batch(seed)
        region, view = _view(data, names)
        with backend.register_regions([region]):  # type: ignore[attr-defined]
            out = _settle(backend, "publish", view)
        assert out.is_delivered and out.masks[0].all(), (  # type: ignore[attr-defined]
            f"publish {seed} stored {int(out.masks[0].sum())} of {ROWS} rows: {out}")  # type: ignore[attr-defined]
        batches.append((data, names))
    return batches


def _fetch_matches_masks(backend: object, batches: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """Fetch every batch back: each true bit's row equals what was published, and the lookup
    agrees with the bits; the rows delivered."""
    delivered = 0
    for data, names in batches:
        sink = np.zeros_like(data)
        region, view = _view(sink, names)
        held = backend.lookup([0], names, HINT)  # type: ignore[attr-defined]
        with backend.register_regions([region]):  # type: ignore[attr-defined]
            out = _settle(backend, "fetch", view)
        assert out.is_delivered, out  # type: ignore[attr-defined]
        mask = out.masks[0]  # type: ignore[attr-defined]
        np.testing.assert_array_equal(sink[mask], data[mask])
        assert held.tolist() == mask.tolist(), "a lookup and the fetch right after it disagree"
        delivered += int(mask.sum())
    return delivered


def test_a_store_on_a_small_file_system_clamps_its_capacity_and_keeps_storing(
        small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Under the default 1 GiB capacity on 8 MiB: the capacity is cut to the file system's size
    (logged with both figures), and after many more publishes than fit, every publish still
    stores its blocks; a fetch gets exactly what its bits say, the latest publishes whole."""
    caplog.set_level(logging.WARNING, logger="kvwire_files.store")
    backend = plugin.build({"root": str(small_fs / "store")})
    try:
        store = backend.driver.store  # type: ignore[attr-defined]
        size = os.statvfs(small_fs).f_blocks * os.statvfs(small_fs).f_frsize
        assert store.capacity_bytes == size
        assert any(str(1 << 30) in r.getMessage() and str(size) in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
        batches = _publish_many(backend, 30)
        assert _fetch_matches_masks(backend, batches[-3:]) == 3 * ROWS, "a recent publish was evicted"
        assert 0 < _fetch_matches_masks(backend, batches) < 30 * ROWS
        assert store.used_bytes <= store.capacity_bytes
    finally:
        backend.close()


def test_space_other_files_take_counts_as_full_the_store_evicts_and_writes_again(
        small_fs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another tenant's 3 MiB on the same file system: the store's own count never reaches its
    capacity, so only ENOSPC says it is full. Publishes still store every row (the store evicts
    for the space and writes the pack again), and what fetches deliver is what was published."""
    caplog.set_level(logging.INFO, logger="kvwire_files.store")
    (small_fs / "other-tenant").write_bytes(b"\1" * (3 * MIB))
    backend = plugin.build({"root": str(small_fs / "store")})
    try:
        batches = _publish_many(backend, 20)
        assert any("found its file system full and evicted" in r.getMessage() for r in caplog.records)
        assert _fetch_matches_masks(backend, batches[-2:]) == 2 * ROWS
        assert 0 < _fetch_matches_masks(backend, batches) < 20 * ROWS
    finally:
        backend.close()


def _driver(root: Path, **kw: object) -> tuple[FilesDriver, np.ndarray]:
    driver = FilesDriver(FileStore(str(root), capacity_bytes=1 << 30, **kw), owns_store=True)  # type: ignore[arg-type]
    memory = np.random.default_rng(9).integers(0, 256, size=(ROWS, ROW), dtype=np.uint8)
    driver.register([SlotRegion(1, memory.ctypes.data, ROW, ROWS, MemoryKind.HOST)])
    return driver, memory


def _rows(memory: np.ndarray, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    base = memory.ctypes.data
    return (np.arange(start, start + count, dtype=np.uint64) * ROW + base, np.full(count, ROW, dtype=np.uint64))


@pytest.mark.parametrize("eviction", [True, False], ids=["eviction-on", "eviction-off"])
def test_with_nothing_left_to_evict_a_full_file_system_declines_with_a_reason_and_a_log_line(
        small_fs: Path, caplog: pytest.LogCaptureFixture, eviction: bool) -> None:
    """The file system is nearly all another tenant's: a put finds no room even after evicting
    all it may (or may not evict), so its rows are DECLINED (not FAILED, not silently dropped),
    each with a reason naming the file system, and a warning says so, once for many puts; the
    store takes puts again once there is room."""
    caplog.set_level(logging.WARNING, logger="kvwire_files.store")
    driver, memory = _driver(small_fs / "store", eviction=eviction)
    try:
        assert driver.put(["k0"], *_rows(memory, 0, 1)).status.tolist() == [int(KeyStatus.OK)]
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        filler = small_fs / "other-tenant"
        filler.write_bytes(b"\1" * (free - 64 * 1024))
        caplog.clear()
        for i in range(5):
            result = driver.put([f"big{i}-{j}" for j in range(8)], *_rows(memory, 8, 8))
            assert result.status.tolist() == [int(KeyStatus.DECLINED)] * 8, result
            assert all(f"the file system under {small_fs / 'store'} is full" in why
                       for why in result.reasons.values()), result.reasons
        lines = [r.getMessage() for r in caplog.records if "declines rows" in r.getMessage()]
        assert 1 <= len(lines) < 5, lines  # logged, and not once per put
        assert "is full" in lines[0]
        assert driver.exists(["k0"]).tolist() == [not eviction], "eviction off must keep what it holds"
        filler.unlink()
        assert driver.put(["after"], *_rows(memory, 1, 1)).status.tolist() == [int(KeyStatus.OK)]
        sink = np.zeros(ROW, dtype=np.uint8)
        driver.register([SlotRegion(2, sink.ctypes.data, ROW, 1, MemoryKind.HOST)])
        got = driver.get_into(["after"], np.array([sink.ctypes.data], np.uint64), np.array([ROW], np.uint64))
        assert got.status.tolist() == [0]
        np.testing.assert_array_equal(sink, memory[1])
    finally:
        driver.close()
