"""Faults of the files store's own files, injected on top of the real store: a write the system
cuts short, an index rewrite that finds no space, a pack file removed by hand, a root whose
files cannot be opened. Each leaves the store answering truthfully and taking work again."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from kvwire_files import FilesDriver, FileStore, plugin

from kvwire.blob import KeyStatus
from kvwire.contract import MemoryKind, SlotRegion
from kvwire.registry import ConfigError

SLOT = 1000
PACK_HEADER = 16


def _driver(root: Path, memory: np.ndarray, **kw: object) -> FilesDriver:
    options: dict[str, object] = {"capacity_bytes": 1 << 20, **kw}
    driver = FilesDriver(FileStore(str(root), **options), owns_store=True)  # type: ignore[arg-type]
    driver.register([SlotRegion(1, memory.ctypes.data, SLOT, memory.shape[0], MemoryKind.HOST)])
    return driver


def _at(memory: np.ndarray, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([memory.ctypes.data + SLOT * r for r in rows], dtype=np.uint64),
            np.full(len(rows), SLOT, dtype=np.uint64))


def _reads_back(driver: FilesDriver, keys: list[str], expected: np.ndarray) -> None:
    sink = np.zeros((len(keys), SLOT), dtype=np.uint8)
    driver.register([SlotRegion(99, sink.ctypes.data, SLOT, len(keys), MemoryKind.HOST)])
    try:
        got = driver.get_into(keys, np.arange(len(keys), dtype=np.uint64) * SLOT + sink.ctypes.data,
                              np.full(len(keys), SLOT, dtype=np.uint64))
        assert got.status.tolist() == [0] * len(keys), got
        np.testing.assert_array_equal(sink, expected)
    finally:
        driver.unregister([SlotRegion(99, sink.ctypes.data, SLOT, len(keys), MemoryKind.HOST)])


def test_writes_the_system_cuts_short_are_finished_not_committed_short(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ``pwrite`` writes at most 7 bytes (legal for any file system): the index's records
    and the ledger are still written whole. (A short write of the index used to commit a length
    whose bytes were never written, and every later call of every process failed.)"""
    real = os.pwrite

    def short(fd: int, data: bytes, offset: int) -> int:
        return real(fd, bytes(memoryview(data)[:7]), offset)

    memory = np.random.default_rng(4).integers(0, 256, size=(8, SLOT), dtype=np.uint8)
    writer = _driver(tmp_path / "s", memory)
    monkeypatch.setattr(os, "pwrite", short)
    try:
        for lo in (0, 3):
            assert writer.put([f"k{i}" for i in range(lo, lo + 3)], *_at(memory, [lo, lo + 1, lo + 2])
                              ).status.tolist() == [0] * 3
        assert writer.remove(["k1"]).status.tolist() == [0]
    finally:
        monkeypatch.setattr(os, "pwrite", real)
    reader = _driver(tmp_path / "s", memory)
    try:
        assert reader.contains([f"k{i}" for i in range(6)]).status.tolist() == [0, int(KeyStatus.MISSING), 0, 0, 0, 0]
        _reads_back(reader, ["k0", "k2", "k3", "k4", "k5"], memory[[0, 2, 3, 4, 5]])
    finally:
        writer.close()
        reader.close()


def test_an_index_rewrite_that_finds_no_space_loses_no_put(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The index is due for a rewrite (compaction) and the file system refuses the new file:
    the removal and the put that were committed stand (they used to answer FAILED, and the put's
    pack was unlinked under records that named it: its key was 'held' yet every fetch missed),
    the longer index stays in use, and a warning says so."""
    import kvwire_files.store as store_module

    caplog.set_level(logging.WARNING, logger="kvwire_files.store")
    monkeypatch.setattr(store_module, "_COMPACT_AT", 1)
    real_open = os.open

    def no_space_for_a_new_index(path: str, flags: int, *args: object) -> int:
        if os.path.basename(str(path)).startswith("index.") and flags & os.O_TRUNC:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    memory = np.random.default_rng(5).integers(0, 256, size=(8, SLOT), dtype=np.uint8)
    driver = _driver(tmp_path / "s", memory)
    monkeypatch.setattr(os, "open", no_space_for_a_new_index)
    try:
        assert driver.put([f"k{i}" for i in range(5)], *_at(memory, list(range(5)))).status.tolist() == [0] * 5
        assert driver.remove(["k0", "k1", "k2", "k3"]).status.tolist() == [0] * 4
        assert driver.put(["new"], *_at(memory, [6])).status.tolist() == [0]
    finally:
        monkeypatch.setattr(os, "open", real_open)
    assert any("could not rewrite its index" in r.getMessage() for r in caplog.records)
    assert driver.contains(["k0", "k4", "new"]).status.tolist() == [int(KeyStatus.MISSING), 0, 0]
    _reads_back(driver, ["k4", "new"], memory[[4, 6]])
    other = _driver(tmp_path / "s", memory)
    try:
        _reads_back(other, ["k4", "new"], memory[[4, 6]])
    finally:
        other.close()
        driver.close()


def test_objects_whose_pack_file_is_gone_are_dropped_at_the_next_rescan(tmp_path: Path) -> None:
    """A pack file removed by hand (or lost) left its objects in the index for good: lookups
    said held, every fetch missed, and a put of the key answered ALREADY_THERE. The next rescan
    (an eviction) drops them: the key is a miss, and can be stored again."""
    per_pack = PACK_HEADER + SLOT
    memory = np.random.default_rng(6).integers(0, 256, size=(8, SLOT), dtype=np.uint8)
    driver = _driver(tmp_path / "s", memory, capacity_bytes=3 * per_pack)
    try:
        assert driver.put(["gone"], *_at(memory, [0])).status.tolist() == [0]
        os.unlink(driver.store.locate("gone")[0])  # type: ignore[index]
        for i in range(1, 5):  # the store fills, rescans and evicts
            assert driver.put([f"k{i}"], *_at(memory, [i])).status.tolist() == [0]
        assert driver.contains(["gone"]).status.tolist() == [int(KeyStatus.MISSING)]
        assert driver.put(["gone"], *_at(memory, [5])).status.tolist() == [0], "the key could not be stored again"
        _reads_back(driver, ["gone"], memory[[5]])
    finally:
        driver.close()


def test_a_root_whose_files_cannot_be_opened_is_refused_and_nothing_stays_open(tmp_path: Path) -> None:
    """The ledger's name taken by a directory: building the backend is a ConfigError naming the
    root option and the path, and no file descriptor stays open (the lock file's used to)."""
    root = tmp_path / "s"
    FileStore(str(root), capacity_bytes=1 << 20).close()
    (root / "ledger").unlink()
    (root / "ledger").mkdir()
    before = sorted(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(ConfigError, match="option 'root' of backend 'files'") as info:
            plugin.build({"root": str(root)})
        assert str(root / "ledger") in str(info.value)
    assert sorted(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize("root", ["/tmp/a\0b", "\0"])
def test_a_nul_byte_in_the_root_names_the_option_and_the_path(root: str) -> None:
    with pytest.raises(ConfigError) as info:
        plugin.build({"root": root})
    assert "option 'root' of backend 'files'" in str(info.value) and repr(root) in str(info.value), str(info.value)
    assert "NUL" in str(info.value)
