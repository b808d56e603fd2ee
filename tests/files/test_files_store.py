"""The files backend as a user meets it: one process publishes, another fetches the same bytes
and its lookups see them; a writer killed mid-object leaves nothing visible; a full store
evicts (or declines); a bad root is refused at creation, naming the path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from kvwire_files import FilesDriver, FileStore, default_root, plugin

from kvwire.blob import KeyStatus
from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View
from kvwire.registry import ConfigError

SLOT = 4096
ROWS = 6
HINT = Hint.of("store", namespace="tenant-a")

#: Builds the same rows and names from a seed in any process, and moves them through a backend.
HELPERS = textwrap.dedent('''
    import threading, numpy as np
    from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View

    def rows(seed, rows, slot):
        rng = np.random.default_rng(seed)
        return rng.integers(0, 256, size=(rows, slot), dtype=np.uint8), rng.integers(0, 256, size=(rows, 16), dtype=np.uint8)

    def view(memory, names, group=0, region_id=1):
        region = SlotRegion(region_id, memory.ctypes.data, memory.shape[1], memory.shape[0], MemoryKind.HOST)
        return region, View((LayerGroupRows(group, CacheKind.PAGED, region, np.arange(memory.shape[0]),
                                            TokenRange(0, 16 * memory.shape[0]), names),))

    def settle(backend, op, v, hint):
        woken = threading.Event()
        attempt = getattr(backend, op)(v, hint, woken.set)
        while not (attempt.poll() is not None and attempt.quiesced()):
            assert woken.wait(30), op + " did not conclude"
            woken.clear()
        return attempt.poll()
''')


def _helpers() -> dict[str, object]:
    scope: dict[str, object] = {}
    exec(compile(HELPERS, "helpers", "exec"), scope)  # noqa: S102 - the test's own code
    return scope


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "other_process.py"
    script.write_text(HELPERS + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)


def test_one_process_publishes_another_fetches_the_same_bytes_and_looks_them_up(tmp_path: Path) -> None:
    root = tmp_path / "store"
    published = _run(tmp_path, f'''
        from kvwire.registry import load
        backend = load("files").build({{"root": {str(root)!r}}})
        data, names = rows(11, {ROWS}, {SLOT})
        region, v = view(data, names)
        registration = backend.register_regions([region])
        out = settle(backend, "publish", v, Hint.of("store", namespace="tenant-a"))
        assert out.is_delivered and out.masks[0].all(), out
        registration.close()
        backend.close()
        print("published")
    ''')
    assert published.returncode == 0 and "published" in published.stdout, published.stderr

    h = _helpers()
    data, names = h["rows"](11, ROWS, SLOT)  # type: ignore[operator]
    backend = plugin.build({"root": str(root)})
    try:
        held = backend.lookup([0], names, HINT)  # type: ignore[attr-defined]
        assert held.tolist() == [True] * ROWS
        strangers = names.copy()
        strangers[:, -1] ^= 0xFF
        assert backend.lookup([0], strangers, HINT).tolist() == [False] * ROWS  # type: ignore[attr-defined]
        assert backend.lookup([1], names, HINT).tolist() == [False] * ROWS  # type: ignore[attr-defined]

        sink = np.zeros_like(data)
        region, v = h["view"](sink, names)  # type: ignore[operator]
        with backend.register_regions([region]):
            out = h["settle"](backend, "fetch", v, HINT)  # type: ignore[operator]
        assert out.is_delivered and out.masks[0].all(), out
        np.testing.assert_array_equal(sink, data)
    finally:
        backend.close()


def test_a_writer_killed_mid_object_leaves_no_visible_object(tmp_path: Path) -> None:
    """The writing process is killed (SIGKILL) after writing half of an object's file: no object
    is visible, a fetch misses, a lookup says not held, and the next store to open the directory
    removes the dead writer's temp file."""
    root = tmp_path / "store"
    killed = _run(tmp_path, f'''
        import os, signal
        import kvwire_files.store as store_module
        from kvwire.registry import load

        real = store_module._write_all
        def write_half_then_die(fd, buffers):
            payload = b"".join(bytes(b) for b in buffers)
            os.write(fd, payload[: len(payload) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        store_module._write_all = write_half_then_die

        backend = load("files").build({{"root": {str(root)!r}}})
        data, names = rows(12, 1, {SLOT})
        region, v = view(data, names)
        backend.register_regions([region])
        settle(backend, "publish", v, Hint.of("store", namespace="tenant-a"))
        print("not killed")
    ''')
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stdout, killed.stderr)
    temps = list((root / "tmp").iterdir())
    assert temps and all(0 < t.stat().st_size < SLOT for t in temps), "the writer died before writing half an object"
    assert not [p for p in (root / "objects").rglob("*") if p.is_file()], "a torn object became visible"

    h = _helpers()
    data, names = h["rows"](12, 1, SLOT)  # type: ignore[operator]
    backend = plugin.build({"root": str(root)})  # opening the store sweeps the dead writer's temp file
    try:
        assert not list((root / "tmp").iterdir())
        assert backend.lookup([0], names, HINT).tolist() == [False]  # type: ignore[attr-defined]
        sink = np.zeros_like(data)
        region, v = h["view"](sink, names)  # type: ignore[operator]
        with backend.register_regions([region]):
            out = h["settle"](backend, "fetch", v, HINT)  # type: ignore[operator]
        assert out.is_delivered and not out.masks[0].any(), out
        assert not sink.any(), "a miss wrote into the row"
    finally:
        backend.close()


def _store(tmp_path: Path, **kw: object) -> tuple[FileStore, FilesDriver, np.ndarray]:
    store = FileStore(str(tmp_path / "s"), **kw)  # type: ignore[arg-type]
    driver = FilesDriver(store, owns_store=True)
    memory = np.random.default_rng(3).integers(0, 256, size=(8, 1000), dtype=np.uint8)
    driver.register([SlotRegion(1, memory.ctypes.data, 1000, 8, MemoryKind.HOST)])
    return store, driver, memory


def _addresses(memory: np.ndarray, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    base = memory.ctypes.data
    return (np.array([base + 1000 * r for r in rows], dtype=np.uint64),
            np.full(len(rows), 1000, dtype=np.uint64))


def test_a_full_store_evicts_the_least_recently_used_or_declines(tmp_path: Path) -> None:
    per_object = 1000 + 20 + len("k0")  # payload, header, key
    store, driver, memory = _store(tmp_path, capacity_bytes=4 * per_object, eviction=True)
    for i in range(4):
        assert driver.put([f"k{i}"], *_addresses(memory, [i])).status.tolist() == [0]
    # k0 is read (so it is the most recently used), then a fifth object needs room.
    assert driver.get_into(["k0"], *_addresses(memory, [7])).status.tolist() == [0]
    assert driver.put(["k4"], *_addresses(memory, [4])).status.tolist() == [0]
    held = driver.exists([f"k{i}" for i in range(5)]).tolist()
    assert held[0] and held[4] and not held[1], f"least recently used first: {held}"
    assert store.used_bytes <= store.capacity_bytes
    driver.close()

    store, driver, memory = _store(tmp_path / "off", capacity_bytes=2 * per_object, eviction=False)
    result = driver.put(["k0", "k1", "k2"], *_addresses(memory, [0, 1, 2]))
    assert result.status.tolist() == [0, 0, 2], "beyond the capacity a put is declined"
    assert "full" in result.reasons[2]
    driver.close()


def test_an_object_larger_than_the_store_is_declined_without_evicting_anything(tmp_path: Path) -> None:
    store, driver, memory = _store(tmp_path, capacity_bytes=1500, eviction=True)
    assert driver.put(["small"], *_addresses(memory, [0])).status.tolist() == [0]
    big = driver.put(["big"], np.array([memory.ctypes.data], np.uint64), np.array([2000], np.uint64))
    assert big.status.tolist() == [int(KeyStatus.DECLINED)] and "exceeds" in big.reasons[0]
    assert driver.exists(["small", "big"]).tolist() == [True, False]
    driver.close()


def test_an_object_file_that_is_not_that_object_whole_fails_naming_it(tmp_path: Path) -> None:
    """A destination of another size, a file cut short, one grown by a byte, a foreign header:
    each read fails with a reason naming the key, and nothing past the destination is written."""
    store, driver, memory = _store(tmp_path, capacity_bytes=1 << 20)
    assert driver.put(["k"], *_addresses(memory, [0])).status.tolist() == [0]
    sink = np.full(1100, 7, dtype=np.uint8)
    driver.register([SlotRegion(2, sink.ctypes.data, 1100, 1, MemoryKind.HOST)])

    def read(size: int) -> tuple[int, str]:
        result = driver.get_into(["k"], np.array([sink.ctypes.data], np.uint64), np.array([size], np.uint64))
        return int(result.status[0]), result.reasons.get(0, "")

    failed = int(KeyStatus.FAILED)
    assert read(999) == (failed, "object 'k' holds 1000 bytes, the destination 999")
    assert (sink[999:] == 7).all(), "a read wrote past its destination"
    assert read(1001) == (failed, "object 'k' holds 1000 bytes, the destination 1001")
    sink[:] = 7
    assert read(1000) == (int(KeyStatus.OK), "")
    assert (sink[:1000] == memory[0]).all() and (sink[1000:] == 7).all()
    path = store.path("k")
    whole = Path(path).read_bytes()
    Path(path).write_bytes(whole + b"x")
    assert read(1000) == (failed, "object 'k' holds 1001 bytes, the destination 1000")
    Path(path).write_bytes(whole[:10])
    assert read(1000) == (failed, "object file of 'k' is torn")
    Path(path).write_bytes(b"NOTKVWF1" + whole[8:])
    status, reason = read(1000)
    assert status == failed and "object file of 'k'" in reason and "is not that object whole" in reason
    driver.close()


def test_removing_an_object_never_tears_a_read_in_progress(tmp_path: Path) -> None:
    """Eviction unlinks; a reader that opened the object already reads it whole."""
    store, driver, memory = _store(tmp_path, capacity_bytes=1 << 20)
    driver.put(["k"], *_addresses(memory, [0]))
    reader = os.open(store.path("k"), os.O_RDONLY)
    try:
        assert driver.remove(["k"]).status.tolist() == [0]
        assert not driver.exists(["k"]).any()
        whole = os.pread(reader, 1 << 20, 0)
        assert whole[-1000:] == memory[0].tobytes()
    finally:
        os.close(reader)
        driver.close()


def test_keys_never_name_paths_outside_the_store(tmp_path: Path) -> None:
    store, driver, _ = _store(tmp_path, capacity_bytes=1 << 20)
    objects = os.path.join(store.root, "objects")
    for key in ("../../etc/passwd", "/abs/path", "kvw1/ns/g0/" + "a" * 5000, "\x00nul"):
        path = store.path(key)
        assert os.path.commonpath([path, objects]) == objects
        assert all(c in "0123456789abcdef" for c in os.path.basename(path))
    driver.close()


def test_concurrent_puts_of_one_key_keep_the_first_bytes(tmp_path: Path) -> None:
    store, driver, memory = _store(tmp_path, capacity_bytes=1 << 20)
    answers: list[int] = []
    lock = threading.Lock()

    def put(row: int) -> None:
        status = driver.put(["same"], *_addresses(memory, [row])).status.tolist()
        with lock:
            answers.extend(status)

    threads = [threading.Thread(target=put, args=(r,)) for r in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers).count(0) == 1 and answers.count(1) == 5, answers  # one OK, the rest ALREADY_THERE
    sink = np.zeros(1000, dtype=np.uint8)
    driver.register([SlotRegion(2, sink.ctypes.data, 1000, 1, MemoryKind.HOST)])
    assert driver.get_into(["same"], np.array([sink.ctypes.data], np.uint64), np.array([1000], np.uint64)).status[0] == 0
    assert any((sink == memory[r]).all() for r in range(6))
    assert store.used_bytes == 1000 + 20 + len("same")
    driver.close()


def test_a_root_that_is_not_a_directory_is_refused_naming_it(tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("x")
    for root in (file, file / "below"):
        with pytest.raises(ConfigError, match="root") as info:
            plugin.build({"root": str(root)})
        assert str(root) in str(info.value)
        with pytest.raises(NotADirectoryError) as raw:
            FileStore(str(root), capacity_bytes=1 << 20)
        assert str(root) in str(raw.value)


def test_a_root_that_cannot_be_written_is_refused_naming_it(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        root = Path("/sys/kvwire-files-test-root")  # sysfs refuses new folders even to root
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        root = locked / "store"
    with pytest.raises(ConfigError) as info:
        plugin.build({"root": str(root)})
    assert str(root) in str(info.value) and "written" in str(info.value)
    with pytest.raises(PermissionError):
        FileStore(str(root), capacity_bytes=1 << 20)


def test_the_default_root_is_per_user_shared_memory() -> None:
    root = default_root()
    assert root.endswith(f"kvwire-files-{os.getuid()}")
    if os.path.isdir("/dev/shm"):
        assert root.startswith("/dev/shm/")
    assert plugin.option("root").default == root


def test_lookup_answers_in_the_plugin_backend(tmp_path: Path) -> None:
    """A view's rows published in two groups answer true for both; the plugin declares lookup."""
    backend = plugin.build({"root": str(tmp_path / "s")})
    try:
        assert "lookup" in backend.capabilities().protocols == plugin.capabilities.protocols
        memory = np.arange(2 * 64, dtype=np.uint8).reshape(2, 64)
        names = np.array([[1] * 8, [2] * 8], dtype=np.uint8)
        region = SlotRegion(1, memory.ctypes.data, 64, 2, MemoryKind.HOST)
        view = View(tuple(LayerGroupRows(g, CacheKind.PAGED, region, np.array([g]), TokenRange(0, 16), names[:1])
                          for g in (0, 1)))
        with backend.register_regions([region]):
            out = _helpers()["settle"](backend, "publish", view, HINT)  # type: ignore[operator]
        assert out.is_delivered
        assert backend.lookup([0, 1], names, HINT).tolist() == [True, False]  # type: ignore[attr-defined]
    finally:
        backend.close()
