"""A writer stopped (SIGSTOP) while it holds the files store's lock, a real second process in the
middle of a put: everyone else's waits for that lock end by their deadline. Opening the store
does not wait at all; a publish fails at its deadline with cause DEADLINE and quiesces within the
harness's grace; a call without a deadline of its own gives up after ``lock_timeout_s`` with an
error naming the stopped process; gets go on. Once the writer is continued, everything works."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from kvwire_files import FileStore, plugin
from kvwire_files.fs import LockBusy
from kvwire_files.harness import FilesHarness

from kvwire.contract import CacheKind, Cause, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View
from kvwire.runtime import ModelConfig, TransferStatus, Worker
from kvwire.testing.holder import wait_for

SLOT = 4096
ROWS = 4
GRACE_S = FilesHarness.quiesce_grace_s

#: Publishes one batch of rows; stops itself (SIGSTOP) at its first write into a file of the
#: store's own (the ledger, as it reserves room for the pack), which it makes holding the lock.
STOPPED_WRITER = textwrap.dedent('''
    import os, signal, sys, threading
    import numpy as np
    from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View
    from kvwire.registry import load

    real = os.pwrite
    def stop_inside_the_lock(fd, data, offset):
        os.pwrite = real
        print("holding", flush=True)
        # At this thread: a SIGSTOP sent to the process may be taken by another thread, and this
        # one would run on (out of the lock) until the stop reached it.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        return real(fd, data, offset)
    os.pwrite = stop_inside_the_lock

    backend = load("files").build({"root": sys.argv[1]})
    memory = np.full((4, 4096), 7, dtype=np.uint8)
    names = np.arange(64, dtype=np.uint8).reshape(4, 16) + 100
    region = SlotRegion(1, memory.ctypes.data, 4096, 4, MemoryKind.HOST)
    view = View((LayerGroupRows(0, CacheKind.PAGED, region, np.arange(4), TokenRange(0, 64), names),))
    woken = threading.Event()
    with backend.register_regions([region]):
        attempt = backend.publish(view, Hint.of("store", namespace="lock", timeout_s=120), woken.set)
        while not (attempt.poll() is not None and attempt.quiesced()):
            woken.wait(1)
            woken.clear()
    print("published", attempt.poll().is_delivered, flush=True)
    backend.close()
''')


def _line(proc: subprocess.Popen[str], seconds: float) -> str:
    """The next line the process prints, waited for ``seconds`` at most ("" if none came)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(seconds):
            return ""
    return proc.stdout.readline().strip()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        return stat.read().rpartition(b")")[2].split()[0].decode()


def _lock_is_held(root: Path) -> bool:
    import fcntl

    fd = os.open(root / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing the only descriptor of this open file lets go of a lock taken
    return False


def _rows(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, size=(ROWS, SLOT), dtype=np.uint8),
            rng.integers(0, 256, size=(ROWS, 16), dtype=np.uint8))


def _view(memory: np.ndarray, names: np.ndarray) -> tuple[SlotRegion, View]:
    region = SlotRegion(1, memory.ctypes.data, SLOT, ROWS, MemoryKind.HOST)
    return region, View((LayerGroupRows(0, CacheKind.PAGED, region, np.arange(ROWS), TokenRange(0, 16 * ROWS),
                                        names),))


def _in_a_thread(call: object, seconds: float) -> tuple[bool, object]:
    """Run ``call()`` on a thread; whether it returned within ``seconds``, and what it returned
    or raised. A call that hangs is left running (the test then fails saying so)."""
    answer: list[object] = []

    def run() -> None:
        try:
            answer.append(call())  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            answer.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return (not thread.is_alive()), (answer[0] if answer else None)


@pytest.fixture
def stopped_writer(tmp_path: Path):
    """A second process stopped inside the store's lock, mid-put; continued (and reaped) at the
    end, or killed if it does not end."""
    root = tmp_path / "store"
    script = tmp_path / "stopped_writer.py"
    script.write_text(STOPPED_WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert _line(proc, 60) == "holding", proc.stderr.read() if proc.poll() is not None else "no line"  # type: ignore[union-attr]
        wait_for(lambda: _state(proc.pid) == "T", 10, "the writer stopping")
        assert _lock_is_held(root), "the stopped writer does not hold the store's lock"
        yield root, proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def test_a_writer_stopped_inside_the_lock_stalls_nobody_past_their_deadline(stopped_writer) -> None:
    root, proc = stopped_writer
    # Opening the store takes no lock: it does not wait for the stopped process.
    opened, backend = _in_a_thread(lambda: plugin.build({"root": str(root)}), 20)
    assert opened, "opening the store waited for the stopped process"
    assert not isinstance(backend, BaseException), backend
    try:
        data, names = _rows(1)
        region, view = _view(data, names)
        woken = threading.Event()
        with backend.register_regions([region]):  # type: ignore[union-attr]
            submitted = time.monotonic()
            attempt = backend.publish(view, Hint.of("store", namespace="lock", timeout_s=2.0),  # type: ignore[union-attr]
                                      woken.set)
            # Concludes by its deadline, and quiesces within the grace after it (A8.2, A8.3).
            while not (attempt.poll() is not None and attempt.quiesced()):
                left = submitted + 2.0 + GRACE_S - time.monotonic()
                assert left > 0, f"the publish had not quiesced {GRACE_S} s after its deadline: {attempt!r}"
                woken.wait(left)
                woken.clear()
        outcome = attempt.poll()
        assert not outcome.is_delivered and outcome.cause is Cause.DEADLINE, outcome
        assert not outcome.masks[0].any()

        # Gets take no lock: the rows the stopped writer has not committed are misses, not a wait.
        sink = np.zeros_like(data)
        region, view = _view(sink, np.arange(64, dtype=np.uint8).reshape(4, 16) + 100)
        with backend.register_regions([region]):  # type: ignore[union-attr]
            fetched = backend.fetch(view, Hint.of("store", namespace="lock", timeout_s=5.0), woken.set)  # type: ignore[union-attr]
            wait_for(lambda: fetched.poll() is not None and fetched.quiesced(), 10, "the fetch ending")
        assert fetched.poll().is_delivered and not fetched.poll().masks[0].any()
    finally:
        backend.close()  # type: ignore[union-attr]

    # A call with no deadline of its own gives up after lock_timeout_s, naming the stopped process.
    store = FileStore(str(root), capacity_bytes=1 << 20, lock_timeout_s=0.5)
    try:
        with pytest.raises(LockBusy) as info:
            store.used_bytes  # noqa: B018 - the property takes the lock
        assert f"held by process {proc.pid} (stopped)" in str(info.value), str(info.value)
        assert f"{root}/lock" in str(info.value)
    finally:
        store.close()

    # Continued, the writer finishes its put, and this process's puts land again.
    os.kill(proc.pid, signal.SIGCONT)
    assert _line(proc, 60) == "published True"
    assert proc.wait(60) == 0
    backend = plugin.build({"root": str(root)})
    try:
        region, view = _view(data, names)
        with backend.register_regions([region]):
            attempt = backend.publish(view, Hint.of("store", namespace="lock", timeout_s=10.0), woken.set)
            wait_for(lambda: attempt.poll() is not None and attempt.quiesced(), 30, "the publish ending")
        assert attempt.poll().is_delivered and attempt.poll().masks[0].all()
    finally:
        backend.close()


def test_a_worker_opens_and_its_publish_fails_at_its_deadline_while_a_writer_is_stopped(stopped_writer) -> None:
    """``Worker(backend="files")`` used to block until the stopped process was killed, and a
    publish with a 2 s deadline raised after 12 s ("did not quiesce ... its lease is kept").
    Now the worker opens, the publish returns a failed result whose reason says the deadline
    passed, no pin is left, and the lease came back (nothing kept)."""
    root, _ = stopped_writer
    model = ModelConfig(layers=2, layers_per_group=1, heads=2, head_dim=8, block_tokens=16, max_tokens=256, seed=1)
    opened, worker = _in_a_thread(lambda: Worker(model, backend="files", options={"root": str(root)},
                                                 num_blocks=16, timeout_s=10), 20)
    assert opened, "Worker(backend='files') waited for the stopped process"
    assert isinstance(worker, Worker), worker
    try:
        prompt = np.arange(48) % model.vocab
        worker.generate(prompt)
        result = worker.publish(prompt, timeout_s=2.0)
        assert result.status is TransferStatus.FAILED and "deadline passed" in (result.reason or ""), result
        assert worker.pins() == 0 and not worker._kept
    finally:
        worker.close()
    assert worker.pins() == 0


def test_the_holder_of_the_lock_is_named_as_the_kernel_lists_it(tmp_path: Path) -> None:
    """A call that gives up names the process holding the lock and its state: another process
    (here sleeping), or this process through another open file of the lock."""
    import fcntl

    store = FileStore(str(tmp_path / "s"), capacity_bytes=1 << 20, lock_timeout_s=0.2)
    lock = os.path.join(store.root, "lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", lock],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert _line(holder, 60) == "held"
        wait_for(lambda: _state(holder.pid) == "S", 10, "the holder sleeping")
        with pytest.raises(LockBusy, match=f"held by process {holder.pid} \\(sleeping\\)"):
            store.discard_batch(["k"])
    finally:
        holder.communicate("", timeout=30)
    own = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(own, fcntl.LOCK_EX)
        with pytest.raises(LockBusy, match=f"held by this process \\(pid {os.getpid()}\\)"):
            store.discard_batch(["k"])
    finally:
        os.close(own)
    assert store.discard_batch(["k"]) == [False]  # free again: it answers
    store.close()


def test_closing_a_store_waits_for_its_writer_waiting_for_the_lock(tmp_path: Path) -> None:
    """A put of this process waits for the lock another open file holds when the store is
    closed: the put gives up at once, failing with a reason that says the store is closed, and
    close() returns only after it did, never while the put still polls the lock through a file
    number close() frees for reuse."""
    import fcntl

    from kvwire_files import FilesDriver

    memory = np.zeros((1, SLOT), dtype=np.uint8)
    driver = FilesDriver(FileStore(str(tmp_path / "s"), capacity_bytes=1 << 20, lock_timeout_s=60.0), owns_store=True)
    driver.register([SlotRegion(1, memory.ctypes.data, SLOT, 1, MemoryKind.HOST)])
    holder = os.open(os.path.join(driver.store.root, "lock"), os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    answers: list[object] = []
    put = threading.Thread(target=lambda: answers.append(
        driver.put(["k"], np.array([memory.ctypes.data], np.uint64), np.array([SLOT], np.uint64))))
    try:
        put.start()
        wait_for(lambda: driver.store._writers.locked(), 10, "the put waiting for the lock")
        driver.close()
        # The put holds this process's writers' lock while it waits for the file lock.
        assert not driver.store._writers.locked(), "close() returned while the put still waited for the lock"
        put.join(30)
        assert answers[0].status.tolist() == [5] and "the file store is closed" in answers[0].reasons[0], answers
    finally:
        os.close(holder)
        put.join(30)
