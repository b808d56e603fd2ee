"""Large batches on several threads (the ``copy_threads`` option): a put of many bytes is several
packs written at once and committed together, a get of many bytes reads its runs on several
threads. The same bytes and answers as one thread, all of a put visible or none of it, nothing
left behind when a write, a commit or the writer fails, and the threads joined at close. No
timing is asserted here."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvwire_files import FileStore, plugin

from kvwire.blob import KeyStatus
from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View
from kvwire.registry import ConfigError

HINT = Hint.of("store")


def _store(root: str | Path, threads: int, **kw: object) -> FileStore:
    """A store whose every batch of a byte or more goes to its threads."""
    store = FileStore(str(root), capacity_bytes=kw.pop("capacity_bytes", 1 << 26), copy_threads=threads,  # type: ignore[arg-type]
                      **kw)  # type: ignore[arg-type]
    store.parallel_bytes = 1
    return store


def _packs(root: str | Path) -> list[Path]:
    return sorted((Path(root) / "packs").iterdir())


def _consistent(store: FileStore) -> None:
    """The ledger counts exactly the pack files there (no temp file left)."""
    root = Path(store.root)
    assert not list((root / "tmp").iterdir())
    assert store.used_bytes == sum(p.stat().st_size for p in _packs(root))


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[int], list[int], int]:
    sizes = draw(st.lists(st.sampled_from([0, 1, 100, 4096, 5000, 65536]), min_size=1, max_size=30))
    groups = draw(st.lists(st.integers(0, 3), min_size=len(sizes), max_size=len(sizes)))
    return sizes, groups, draw(st.integers(2, 6))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.randoms(use_true_random=False))
def test_a_large_put_is_several_packs_that_read_back_equal(case, rnd):
    """Objects of mixed sizes and groups (the pack's layout sorts by group): up to
    ``copy_threads`` packs, every object read back equal in any order (a reader of one thread and
    one of several), the ledger counting exactly the packs."""
    sizes, groups, threads = case
    rng = np.random.default_rng(len(sizes))
    data = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    keys = [f"kvw1/ns/g{g}/{i:04x}" for i, g in enumerate(groups)]
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
        writer = _store(root, threads)
        one = _store(root, 1)
        try:
            status, reasons = writer.write_from(keys, [memoryview(d) for d in data])
            assert status == [KeyStatus.OK] * len(keys) and not reasons
            packs = _packs(root)
            assert 1 <= len(packs) <= min(threads, len(keys))  # fewer where bytes gather in a few objects
            _consistent(writer)
            order = list(range(len(keys)))
            rnd.shuffle(order)
            for reader in (writer, one):
                out = [np.zeros(sizes[i], dtype=np.uint8) for i in order]
                answers = reader.read_batch([keys[i] for i in order], [memoryview(o) for o in out])
                assert answers == [(KeyStatus.OK, None)] * len(order)
                for o, i in zip(out, order, strict=True):
                    np.testing.assert_array_equal(o, data[i])
        finally:
            writer.close()
            one.close()


def test_a_threaded_get_answers_as_one_thread_does(tmp_path: Path) -> None:
    """One pack written by a store of one thread, read by one of four: its runs are cut into
    pieces. Misses, objects of another size and a pack cut short answer as the one-thread
    store answers, and block objects (several parts) read back whole."""
    root = tmp_path / "store"
    one, four = _store(root, 1), _store(root, 4)
    try:
        rng = np.random.default_rng(1)
        data = [rng.integers(0, 256, 3000 + 100 * i, dtype=np.uint8) for i in range(24)]
        keys = [f"k{i:02d}" for i in range(24)]
        assert one.write_from(keys, [memoryview(d) for d in data])[0] == [KeyStatus.OK] * 24
        parts = (rng.integers(0, 256, 700, dtype=np.uint8), rng.integers(0, 256, 900, dtype=np.uint8))
        assert one.write_from(["block"], [tuple(memoryview(p) for p in parts)])[0] == [KeyStatus.OK]
        assert len(_packs(root)) == 2

        asked = [*keys[::-1], "absent", "block"]
        sizes = [len(data[int(k[1:])]) if k.startswith("k") else 0 for k in asked[:-1]]
        sizes[3] += 1  # another size: FAILED, nothing written

        def read(store: FileStore):  # type: ignore[no-untyped-def]
            out = [np.zeros(n, dtype=np.uint8) for n in sizes]
            back = (np.zeros(700, dtype=np.uint8), np.zeros(900, dtype=np.uint8))
            answers = store.read_batch(asked, [*map(memoryview, out), tuple(map(memoryview, back))])
            return answers, out, back

        want, out_one, _ = read(one)
        got, out_four, back = read(four)
        assert got == want
        assert [a[0] for a in got].count(KeyStatus.OK) == 24 and got[24][0] is KeyStatus.MISSING
        assert got[3][0] is KeyStatus.FAILED
        for a, b in zip(out_one, out_four, strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(back, parts, strict=True):
            np.testing.assert_array_equal(a, b)

        # The big pack cut in the middle: objects past the cut are torn, the others whole.
        big = max(_packs(root), key=lambda p: p.stat().st_size)
        os.truncate(big, big.stat().st_size // 2)
        want, _, _ = read(one)
        got, _, _ = read(four)
        assert got == want
        assert {a[0] for a in got[:24]} >= {KeyStatus.OK, KeyStatus.FAILED}
    finally:
        one.close()
        four.close()


def test_small_batches_stay_one_pack_on_the_calling_thread(tmp_path: Path) -> None:
    before = threading.active_count()
    store = FileStore(str(tmp_path / "store"), capacity_bytes=1 << 26, copy_threads=4)  # the default threshold
    try:
        data = [np.ones(1 << 20, dtype=np.uint8) for _ in range(4)]
        assert store.write_from([f"k{i}" for i in range(4)], [memoryview(d) for d in data])[0] == [KeyStatus.OK] * 4
        assert len(_packs(tmp_path / "store")) == 1
        assert threading.active_count() == before
    finally:
        store.close()


def test_threads_start_on_a_large_batch_and_close_joins_them(tmp_path: Path) -> None:
    before = threading.active_count()
    store = _store(tmp_path / "store", 4)
    data = [np.full(5000, i, dtype=np.uint8) for i in range(8)]
    assert store.write_from([f"k{i}" for i in range(8)], [memoryview(d) for d in data])[0] == [KeyStatus.OK] * 8
    assert threading.active_count() > before
    store.close()
    assert threading.active_count() == before
    store.close()  # idempotent


@pytest.mark.parametrize("bad", [0, 65, -1, 2.0, True, "4", None])
def test_a_bad_thread_count_is_refused_naming_the_option(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="copy_threads"):
        FileStore(str(tmp_path / "store"), capacity_bytes=1 << 20, copy_threads=bad)  # type: ignore[arg-type]
    if bad != "4":  # the registry reads "4" as 4, as it reads every int option given as text
        with pytest.raises(ConfigError, match="copy_threads"):
            plugin.build({"root": str(tmp_path / "store"), "copy_threads": bad})


def test_the_option_reaches_the_store(tmp_path: Path) -> None:
    assert "copy_threads" in {o.name for o in plugin.options}
    before = threading.active_count()
    backend = plugin.build({"root": str(tmp_path / "store"), "copy_threads": 3})
    try:
        assert backend._core.driver.store.copy_threads == 3  # type: ignore[attr-defined]
    finally:
        backend.close()
    assert threading.active_count() == before


def test_a_pack_that_fails_to_write_fails_the_batch_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One of the packs fails (EIO) while the others are written: every row FAILED, no temp file
    and no pack left, the ledger back where it was; the same put then succeeds."""
    store = _store(tmp_path / "store", 3)
    real = FileStore._write_pack
    calls: list[int] = []
    lock = threading.Lock()

    def second_fails(self, temp, pack, parts):  # type: ignore[no-untyped-def]
        real(self, temp, pack, parts)
        with lock:
            calls.append(pack)
            mine = len(calls)
        if mine == 2:
            raise OSError(errno.EIO, "the disk said no")

    keys = [f"k{i}" for i in range(9)]
    data = [np.full(4096, i, dtype=np.uint8) for i in range(9)]
    try:
        monkeypatch.setattr(FileStore, "_write_pack", second_fails)
        status, reasons = store.write_from(keys, [memoryview(d) for d in data])
        assert status == [KeyStatus.FAILED] * 9 and "the disk said no" in reasons[0]
        assert len(calls) == 3  # every pack's write ended before the put answered
        assert not _packs(tmp_path / "store")
        _consistent(store)
        assert store.holds_batch(keys) == [False] * 9
        monkeypatch.setattr(FileStore, "_write_pack", real)
        assert store.write_from(keys, [memoryview(d) for d in data])[0] == [KeyStatus.OK] * 9
        _consistent(store)
    finally:
        store.close()


def test_a_commit_that_fails_after_the_renames_unlinks_every_pack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path / "store", 3)
    keys = [f"k{i}" for i in range(6)]
    data = [np.full(4096, i, dtype=np.uint8) for i in range(6)]
    renamed: list[int] = []
    real_rename = os.rename

    def counting(src, dst):  # type: ignore[no-untyped-def]
        real_rename(src, dst)
        renamed.append(1)

    def no_index(self, records, *, ahead=False):  # type: ignore[no-untyped-def]
        raise OSError(errno.EIO, "the index said no")

    try:
        monkeypatch.setattr(os, "rename", counting)
        monkeypatch.setattr(FileStore, "_append", no_index)
        status, reasons = store.write_from(keys, [memoryview(d) for d in data])
        monkeypatch.undo()
        assert len(renamed) == 3
        assert status == [KeyStatus.FAILED] * 6 and "the index said no" in reasons[5]
        assert not _packs(tmp_path / "store")
        _consistent(store)
        assert store.holds_batch(keys) == [False] * 6
    finally:
        store.close()


def test_packs_of_objects_another_writer_committed_first_are_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the packs are written, another store commits the keys of the first pack: that pack
    is not placed (its bytes leave the ledger), the rest are, and those keys answer
    ALREADY_THERE with the other writer's bytes."""
    root = tmp_path / "store"
    store, other = _store(root, 3), _store(root, 1)
    keys = [f"k{i}" for i in range(6)]  # one group: the layout keeps this order, two a pack
    mine = [np.full(4096, i, dtype=np.uint8) for i in range(6)]
    theirs = [np.full(4096, 100 + i, dtype=np.uint8) for i in range(2)]
    real = FileStore._write_packs

    def racing(self, temps, packs, objects):  # type: ignore[no-untyped-def]
        real(self, temps, packs, objects)
        if self is store:
            assert other.write_from(keys[:2], [memoryview(t) for t in theirs])[0] == [KeyStatus.OK] * 2

    try:
        monkeypatch.setattr(FileStore, "_write_packs", racing)
        status, _ = store.write_from(keys, [memoryview(d) for d in mine])
        monkeypatch.undo()
        assert status == [KeyStatus.ALREADY_THERE] * 2 + [KeyStatus.OK] * 4
        assert len(_packs(root)) == 3  # the other writer's, and two of this put's three
        _consistent(store)
        out = [np.zeros(4096, dtype=np.uint8) for _ in keys]
        assert store.read_batch(keys, [memoryview(o) for o in out]) == [(KeyStatus.OK, None)] * 6
        assert [int(o[0]) for o in out] == [100, 101, 2, 3, 4, 5]
    finally:
        store.close()
        other.close()


def test_a_writer_killed_between_the_renames_and_the_commit_leaves_nothing_visible(tmp_path: Path) -> None:
    """The writing process is killed (SIGKILL) after its packs are renamed into place and before
    their records are committed: no object is visible, and the next rescan removes the packs."""
    root = tmp_path / "store"
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(f'''
        import os, signal
        import numpy as np
        from kvwire_files import FileStore
        def die(self, records, *, ahead=False):
            os.kill(os.getpid(), signal.SIGKILL)
        FileStore._append = die
        store = FileStore({str(root)!r}, capacity_bytes=1 << 26, copy_threads=3)
        store.parallel_bytes = 1
        store.write_from([f"k{{i}}" for i in range(6)], [memoryview(np.ones(4096, dtype=np.uint8))] * 6)
        print("not killed")
    '''))
    killed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stdout, killed.stderr)
    assert len(_packs(root)) == 3  # renamed, never committed
    store = _store(root, 3)
    try:
        keys = [f"k{i}" for i in range(6)]
        assert store.holds_batch(keys) == [False] * 6
        out = np.zeros(4096, dtype=np.uint8)
        assert store.read_batch(keys[:1], [memoryview(out)]) == [(KeyStatus.MISSING, None)]
        with store._locked():
            store._refresh()
            store._rescan(0)
        assert not _packs(root)
    finally:
        store.close()


def _view(region: SlotRegion, n: int) -> View:
    names = np.zeros((n, 8), dtype=np.uint8)
    names[:, 0] = np.arange(n)
    return View((LayerGroupRows(0, CacheKind.PAGED, region, np.arange(n), TokenRange(0, 16 * n), names),))


def test_through_the_plugin_a_publish_cancelled_mid_write_returns_everything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish of 20 MiB (above the threshold) with copy_threads 3, cancelled while its packs
    are being written: it concludes cancelled, quiesces once the writes end, and the store holds
    all of its rows or none, counted exactly; a fetch then reads them on the threads; close joins
    every thread."""
    before = threading.active_count()
    row, n = 4 << 20, 5
    src = np.random.default_rng(9).integers(0, 256, (n, row), dtype=np.uint8)
    region = SlotRegion(0, src.ctypes.data, row, n, MemoryKind.HOST)
    root = tmp_path / "store"
    backend = plugin.build({"root": str(root), "copy_threads": 3, "capacity_bytes": 1 << 28})
    store = backend._core.driver.store  # type: ignore[attr-defined]
    real = FileStore._write_pack
    entered, release = threading.Event(), threading.Event()

    def held(self, temp, pack, parts):  # type: ignore[no-untyped-def]
        entered.set()
        assert release.wait(30.0)
        real(self, temp, pack, parts)

    try:
        with backend.register_regions([region]):
            monkeypatch.setattr(FileStore, "_write_pack", held)
            woken = threading.Event()
            attempt = backend.publish(_view(region, n), HINT, woken.set)
            assert entered.wait(30.0)
            attempt.cancel()
            assert not attempt.quiesced()
            release.set()
            while not (attempt.poll() is not None and attempt.quiesced()):
                assert woken.wait(30.0)
                woken.clear()
            assert attempt.poll().is_cancelled
            monkeypatch.setattr(FileStore, "_write_pack", real)
            assert len(_packs(root)) == 3
            _consistent(store)
            dst = np.zeros_like(src)
            out = SlotRegion(1, dst.ctypes.data, row, n, MemoryKind.HOST)
            with backend.register_regions([out]):
                woken.clear()
                attempt = backend.fetch(_view(out, n), HINT, woken.set)
                while not (attempt.poll() is not None and attempt.quiesced()):
                    assert woken.wait(30.0)
                    woken.clear()
            assert attempt.poll().is_delivered and attempt.poll().masks[0].all()
            np.testing.assert_array_equal(dst, src)
    finally:
        release.set()
        backend.close()
    assert threading.active_count() == before
