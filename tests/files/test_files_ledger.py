"""A damaged ledger (a torn write, simulated at several offsets) while the index and the packs
are whole: the next store to look rebuilds it from them, logs what it kept and lost, and goes
on. Every object still held reads back whole, lookups agree, new puts never reuse a pack number,
and a store that had the index in memory before the damage reads the same."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
from kvwire_files import FilesDriver, FileStore

from kvwire.blob import KeyStatus
from kvwire.contract import MemoryKind, SlotRegion

SLOT = 1000
ROWS = 12
PACK_HEADER = 16
LEDGER_BYTES = 36


def _driver(root: Path, memory: np.ndarray) -> FilesDriver:
    driver = FilesDriver(FileStore(str(root), capacity_bytes=1 << 20), owns_store=True)
    driver.register([SlotRegion(1, memory.ctypes.data, SLOT, memory.shape[0], MemoryKind.HOST)])
    return driver


def _at(memory: np.ndarray, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([memory.ctypes.data + SLOT * r for r in rows], dtype=np.uint64),
            np.full(len(rows), SLOT, dtype=np.uint64))


def _tear(ledger: Path, damage: str) -> None:
    raw = bytearray(ledger.read_bytes())
    assert len(raw) == LEDGER_BYTES
    kind, _, where = damage.partition("@")
    if kind == "byte":  # one byte of a record written halfway
        raw[int(where)] ^= 0x5A
        ledger.write_bytes(bytes(raw))
    elif kind == "tail":  # the record's last bytes never written (zeros from that offset on)
        ledger.write_bytes(bytes(raw[:int(where)]) + bytes(LEDGER_BYTES - int(where)))
    elif kind == "cut":  # the file cut short at that offset
        ledger.write_bytes(bytes(raw[:int(where)]))
    else:
        raise AssertionError(damage)


DAMAGES = ["byte@0", "byte@7", "byte@8", "byte@17", "byte@24", "byte@31", "byte@33",
           "tail@4", "tail@20", "tail@32", "cut@0", "cut@9", "cut@35"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_torn_ledger_is_rebuilt_from_the_index_and_the_packs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str) -> None:
    caplog.set_level(logging.WARNING, logger="kvwire_files.store")
    root = tmp_path / "store"
    memory = np.random.default_rng(7).integers(0, 256, size=(ROWS + 4, SLOT), dtype=np.uint8)
    writer = _driver(root, memory)
    keys = [f"k{i}" for i in range(ROWS)]
    for lo in range(0, ROWS, 4):  # three packs
        assert writer.put(keys[lo:lo + 4], *_at(memory, list(range(lo, lo + 4)))).status.tolist() == [0] * 4
    assert writer.remove(["k5"]).status.tolist() == [0]  # a removal in the index too
    held = [k for k in keys if k != "k5"]
    packs_before = sorted(os.listdir(root / "packs"))

    # A store that read the index before the damage (it holds it in memory).
    earlier = _driver(root, memory)
    assert earlier.contains(held).status.tolist() == [0] * len(held)

    _tear(root / "ledger", damage)

    # A store opened afterwards: every call works, and the objects read back whole.
    later = _driver(root, memory)
    try:
        assert later.contains([*held, "k5"]).status.tolist() == [0] * len(held) + [int(KeyStatus.MISSING)]
        for driver in (later, earlier, writer):
            sink = np.zeros((len(held), SLOT), dtype=np.uint8)
            driver.register([SlotRegion(9, sink.ctypes.data, SLOT, len(held), MemoryKind.HOST)])
            got = driver.get_into(held, np.arange(len(held), dtype=np.uint64) * SLOT + sink.ctypes.data,
                                  np.full(len(held), SLOT, dtype=np.uint64))
            assert got.status.tolist() == [0] * len(held), (damage, got)
            np.testing.assert_array_equal(sink, memory[[keys.index(k) for k in held]])
        rebuilt = [r.getMessage() for r in caplog.records if "ledger" in r.getMessage()]
        assert len(rebuilt) == 1 and "rebuilt" in rebuilt[0] and f"Kept {len(held)} object(s) in 3 pack(s)" in \
            rebuilt[0] and "lost 0 object(s)" in rebuilt[0], rebuilt

        # New puts take pack numbers no pack had, from every store, and nothing old changes.
        assert later.put(["new0"], *_at(memory, [ROWS])).status.tolist() == [0]
        assert earlier.put(["new1"], *_at(memory, [ROWS + 1])).status.tolist() == [0]
        packs_after = sorted(os.listdir(root / "packs"))
        assert set(packs_before) < set(packs_after) and len(packs_after) == len(packs_before) + 2
        for driver in (later, earlier):
            sink = np.zeros((len(held) + 2, SLOT), dtype=np.uint8)
            driver.register([SlotRegion(10, sink.ctypes.data, SLOT, len(held) + 2, MemoryKind.HOST)])
            got = driver.get_into([*held, "new0", "new1"],
                                  np.arange(len(held) + 2, dtype=np.uint64) * SLOT + sink.ctypes.data,
                                  np.full(len(held) + 2, SLOT, dtype=np.uint64))
            assert got.status.tolist() == [0] * (len(held) + 2)
            np.testing.assert_array_equal(sink, memory[[keys.index(k) for k in held] + [ROWS, ROWS + 1]])
        sizes = sum(os.path.getsize(root / "packs" / name) for name in packs_after)
        assert later.store.used_bytes == sizes, "the rebuilt ledger counts another size than the packs'"
    finally:
        for driver in (writer, earlier, later):
            driver.close()


def test_a_rebuild_keeps_what_it_can_and_logs_what_was_lost(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The ledger torn, and besides one pack gone and the index's last record cut short: the
    objects of the missing pack and of the cut record are lost (misses, not faults, and logged
    by count), the rest read back whole, and the store goes on."""
    caplog.set_level(logging.WARNING, logger="kvwire_files.store")
    root = tmp_path / "store"
    memory = np.random.default_rng(8).integers(0, 256, size=(ROWS + 1, SLOT), dtype=np.uint8)
    writer = _driver(root, memory)
    keys = [f"k{i}" for i in range(ROWS)]
    for lo in range(0, ROWS, 4):
        assert writer.put(keys[lo:lo + 4], *_at(memory, list(range(lo, lo + 4)))).status.tolist() == [0] * 4
    first_pack = writer.store.locate("k0")[0]  # type: ignore[index]
    writer.close()
    os.unlink(first_pack)
    index = root / "index.0"
    index.write_bytes(index.read_bytes()[:-3])  # k11's record cut short
    _tear(root / "ledger", "byte@12")

    store = _driver(root, memory)
    try:
        status = store.contains(keys).status.tolist()
        assert status == [int(KeyStatus.MISSING)] * 4 + [0] * 7 + [int(KeyStatus.MISSING)], status
        sink = np.zeros((7, SLOT), dtype=np.uint8)
        store.register([SlotRegion(9, sink.ctypes.data, SLOT, 7, MemoryKind.HOST)])
        got = store.get_into(keys[4:11], np.arange(7, dtype=np.uint64) * SLOT + sink.ctypes.data,
                             np.full(7, SLOT, dtype=np.uint64))
        assert got.status.tolist() == [0] * 7
        np.testing.assert_array_equal(sink, memory[4:11])
        lines = [r.getMessage() for r in caplog.records if "rebuilt" in r.getMessage()]
        assert len(lines) == 1 and "Kept 7 object(s) in 2 pack(s); lost 4 object(s)" in lines[0], lines
        assert "bytes of the index past its last whole record" in lines[0]
        assert store.put(["k0"], *_at(memory, [0])).status.tolist() == [0], "a lost key could not be stored again"
    finally:
        store.close()
