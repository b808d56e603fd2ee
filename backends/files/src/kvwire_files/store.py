"""A store of named, immutable objects in one directory, shared by every process that opens it.

Why one file of this size: the packs, the index and the ledger change together under
one lock, and every method reads the same in-memory index; split apart, each part would reach
into the others' state. The system calls it makes are :mod:`kvwire_files.fs`.

Layout under ``root``::

    FORMAT         "kvwire-files 2": the layout below (a root of another layout is refused)
    packs/0000...  one file per put batch (a large one: several, see below): a header (magic,
                   pack number), then the objects' bytes back to back
    index.{gen}    what is where: an append-only log of records (an object added at an offset
                   of a pack; an object removed; a pack removed)
    ledger         36 bytes: the bytes the store counts against its capacity, the next pack
                   number, the index's generation and its committed length, and their CRC-32
    lock           flock'd around every change to the ledger, the index and the packs
    tmp/           packs being written: ``{pid}.{thread}.{n}.tmp``

**Why packs.** A put or a get of a batch costs a few system calls per pack, not per object: a
vLLM block of one layer is 16 KiB, and the opening, closing and touching of one file per object
cost as much as copying its bytes. A batch of one put is written whole to a temp file, then
renamed into ``packs/`` and its records appended to the index, both under the lock; a get opens
each pack its keys lie in once and reads each run of adjacent objects with one ``preadv``
straight into the rows.

**The index.** Every process keeps the index in memory (about 270 bytes per object for keys of a
16-byte name) and, before each call, reads the records committed since it last looked. Records
are committed by writing them past the committed length and then raising that length in the
ledger, both under the lock, so a reader never sees a half-written record, and a writer killed
mid-record leaves bytes that the next writer overwrites. Readers (gets and lookups) take no lock
another process could hold: the committed part of a log never changes, and a read of the ledger
that overlapped a write fails its checksum and is read again. So a process stopped while it
holds the lock delays only other writers (this process's writers wait for it on a thread lock of
their own, and take the readers' only once they hold the ``flock``). Asked with ``now``, a read
also waits for no disk: on a disk it reads with ``RWF_NOWAIT`` and opens with
``RESOLVE_CACHED``, and gives up (``None``) where the page cache or the dentry cache would not
do. A put under a key the index holds keeps the first object's bytes (``ALREADY_THERE``), also
when two writers race: the later one finds the key held when it commits. When the log has grown
to four times what its live records need, the writer that notices writes them to
``index.{gen + 1}``; readers that see the new generation read it from its start.

**Large batches.** A put of :data:`PARALLEL_IO_BYTES` or more is written as up to
``copy_threads`` packs of about equal bytes at once (writes into one file take turns on its
inode's lock), each a temp file; all are renamed into ``packs/`` and their records appended to
the index in one commit under the lock, so a reader sees all of the batch's objects or none, and
a writer killed between the renames and the commit leaves packs the next rescan removes, as for
one pack. A get of as many bytes reads its runs of adjacent objects, cut into pieces, on as many
threads (``preadv`` of one open pack from several threads needs no order). The threads are the
store's, started on the first such batch and joined by :meth:`FileStore.close`.

**Block objects.** An object may be given as several byte views, its parts (a block's row of
every group, K1): they are written back to back as one entry of the pack, and read back with one
``preadv`` iovec per part, so a block of 32 layers is one index record and one run of a read.

**Eviction never removes an object mid-read.** Removing a pack unlinks its file; a reader that
already opened it keeps reading the same whole bytes (POSIX keeps an unlinked file until its last
reader closes it), and a reader that comes later misses. A pack is removed when its last object
is removed, or whole when the store evicts: when a put would exceed the capacity, the store
rescans ``packs/`` (repairing the ledger after a writer was killed) and, with eviction on, removes
least-recently-used packs (a get touches the packs it reads) until the store is at most 90 %
full; with eviction off the put is declined. Packs an eviction removes are chosen, dropped from
the index and uncounted in the ledger under the lock, and their files unlinked just after it is
let go (:class:`_Held`), so gets and puts wait for the choice, never for the file system's
unlinks; a pack dropped and not yet unlinked is no object's, and a rescan removes it if its
remover died first.

**Faults.** A file system full before the capacity is (``ENOSPC``) counts as a full store: the
put evicts until the pack fits and writes it again, or declines with a reason; a capacity
beyond the file system's size is cut to it at open. A wait for the lock ends at the caller's
deadline with :class:`~kvwire_files.fs.LockBusy` naming the holder (opening takes no lock). A
damaged ledger is rebuilt from the index and the packs by the next holder of the lock."""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import math
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TypeVar

from kvwire.blob import KeyStatus
from kvwire_files import fs

__all__ = ["FileStore", "default_root"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: An object's memory: one byte view, or a block object's parts, one after another.
Memory = memoryview | tuple[memoryview, ...]

_FORMAT = b"kvwire-files 2\n"
_PACK_MAGIC = b"KVWPACK2"
_PACK_HEADER = struct.Struct("<8sQ")  # magic, pack number
#: Used bytes, next pack number, index generation, committed length, and a CRC-32 of them.
_LEDGER = struct.Struct("<QQQQI")
#: How often a reader reads the ledger or opens the index again when a writer changed them under it.
_RETRIES = 1000
_RECORD = struct.Struct("<BQQQH")  # kind, pack, offset, size, key bytes; the key follows
_ADD, _DROP_KEY, _DROP_PACK = 1, 2, 3
_MAX_KEY = 0xFFFF
#: At most this many buffers per ``preadv``/``writev`` (Linux's IOV_MAX is 1024).
_IOV_MAX = 1024
#: After an eviction the store holds at most this share of its capacity, so one scan of the
#: directory pays for many puts.
_EVICT_TO = 0.9
#: The index is rewritten once it is this long and four times what its live records need.
_COMPACT_AT = 4 << 20
#: How often a put whose pack finds the file system full evicts and writes it again.
_NO_SPACE_TRIES = 3
#: A rebuilt ledger's next pack number lies this far past every number the directory shows, so
#: a writer that took a number from the damaged ledger and has not yet renamed its pack into
#: place never shares it with a later one (same-numbered packs would pass each other's check).
_PACK_GAP = 1 << 32
#: Declined rows and lock waits that gave up are logged at most once per this many seconds per
#: store, each line with a count of those since the last.
_LOGGED_EVERY_S = 10.0
_counter = itertools.count(1)
#: A put or get of at least this many bytes is written to (or read from) several files at once
#: by the store's ``copy_threads`` threads: the hand-off costs tens of microseconds, well under
#: the ~4 ms a 16 MiB write into tmpfs takes at 3.9 GB/s (issue 33's bench); smaller batches
#: are one pack, written and read on the calling thread as before.
PARALLEL_IO_BYTES = 16 << 20
#: The option's default: one thread per core, at most 8.
DEFAULT_COPY_THREADS = max(1, min(8, os.cpu_count() or 1))


class _Pool:
    """Up to ``threads`` tasks of one call at once: the caller runs the first, a pool of
    ``threads - 1`` threads (started on first use, joined by :meth:`close`) the others. A
    call returns only once every task of it has ended, with each task's result or exception;
    after :meth:`close` every task runs on the caller's thread."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    def run(self, tasks: Sequence[Callable[[], _T]]) -> list[_T | BaseException]:
        futures: list[Future[_T] | None] = []
        executor = self._start() if len(tasks) > 1 else None
        for task in tasks[1:]:
            future = None
            if executor is not None:
                try:
                    future = executor.submit(task)
                except RuntimeError:  # closed meanwhile: the caller runs what is left
                    executor = None
            futures.append(future)
        out: list[_T | BaseException] = []
        try:
            for task, future in zip(tasks, [None, *futures], strict=True):
                if future is None:
                    try:
                        out.append(task())
                    except Exception as exc:
                        out.append(exc)
        finally:
            wait_futures([f for f in futures if f is not None])  # no task outlives the call
        results = iter(out)
        done: list[_T | BaseException] = []
        for future in [None, *futures]:
            if future is None:
                done.append(next(results))
            else:
                error = future.exception()
                done.append(future.result() if error is None else error)
        return done

    def _start(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._executor is None and not self._closed:
                self._executor = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvwire-files-io")
            return self._executor

    def close(self) -> None:
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def _balanced(costs: list[int], parts: int) -> list[int]:
    """Where to cut ``costs`` (in order) into at most ``parts`` runs of about equal sum: the
    start of each run after the first."""
    total = sum(costs)
    cuts: list[int] = []
    at = 0
    for i, cost in enumerate(costs):
        if i and at * parts >= total * (len(cuts) + 1):
            cuts.append(i)
            if len(cuts) == parts - 1:
                break
        at += cost
    return cuts


class _Reports:
    """Warnings of one kind, at most one line per ``_LOGGED_EVERY_S``, each saying how many
    happened since the last line (a store declining every row of a busy server logs a line,
    not a flood). Counts are approximate across threads; nothing depends on them."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._count = 0
        self._logged = -math.inf

    def note(self, count: int, message: str, *args: object) -> None:
        self._count += count
        now = time.monotonic()
        if now - self._logged >= _LOGGED_EVERY_S:
            count, self._count, self._logged = self._count, 0, now
            log.warning(f"{message} ({count} {self._what} since the last such line)", *args)


class _Held:
    """One hold of a store's lock (``with store._locked(deadline):``): the thread holding it is
    the store's ``_owner`` meanwhile (a damaged ledger is rebuilt only under the lock). Packs
    the hold dropped from the committed index (``store._dropped``) are unlinked once the lock is
    let go: nobody finds them any more, and nobody waits for the unlinks."""

    __slots__ = ("_store", "_deadline")

    def __init__(self, store: FileStore, deadline: float | None) -> None:
        self._store = store
        self._deadline = deadline

    def __enter__(self) -> None:
        store = self._store
        deadline = self._deadline
        try:
            store._file_lock.acquire(time.monotonic() + store.lock_timeout_s if deadline is None else deadline)
        except fs.LockBusy as exc:
            store._lock_waits.note(1, "the file store at %s: %s", store.root, exc.strerror)
            raise
        store._owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        store = self._store
        dropped, store._dropped = store._dropped, []
        store._owner = None
        store._file_lock.release()
        for pack in dropped:
            fs.unlink(store.pack_path(pack))


class _LedgerDamaged(OSError):
    """The ledger does not hold a whole checksummed record: rebuilt by the next holder of the lock."""


def default_root() -> str:
    """``/dev/shm/kvwire-files-{uid}`` (shared memory on Linux), else under the temp directory."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else __import__("tempfile").gettempdir()
    return os.path.join(base, f"kvwire-files-{os.getuid()}")


class FileStore:
    """The directory ``root`` as a store of at most ``capacity_bytes`` bytes (pack files, headers
    included). Thread-safe, and safe to share with other processes on this machine.

    Raises ``NotADirectoryError`` or ``PermissionError`` naming the path when ``root`` is not a
    directory, or cannot be created or written; ``FileExistsError`` naming it when it holds a
    store of another layout. A missing root is created (mode 0700). A capacity beyond what the
    file system holds is cut to its size (and logged). Opening takes no lock, so it never waits
    for another process; a call waits for the store's lock until its ``deadline``
    (``time.monotonic()``), or ``lock_timeout_s`` when it has none, and then raises
    :class:`~kvwire_files.fs.LockBusy` naming the holder."""

    def __init__(self, root: str, *, capacity_bytes: int, eviction: bool = True, fsync: bool = False,
                 lock_timeout_s: float = 10.0, copy_threads: int = DEFAULT_COPY_THREADS) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) or not 1 <= copy_threads <= 64:
            raise ValueError(f"copy_threads must be an int from 1 to 64, got {copy_threads!r}")
        if isinstance(lock_timeout_s, bool) or not isinstance(lock_timeout_s, (int, float)) or not (
                math.isfinite(lock_timeout_s) and lock_timeout_s > 0):
            raise ValueError(f"lock_timeout_s must be a finite number of seconds > 0, got {lock_timeout_s!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.eviction = bool(eviction)
        self.fsync = bool(fsync)
        self.lock_timeout_s = float(lock_timeout_s)
        #: Threads that write or read one large batch's files at once (the caller's among them).
        self.copy_threads = copy_threads
        #: Batches of at least this many bytes use them (:data:`PARALLEL_IO_BYTES`).
        self.parallel_bytes = PARALLEL_IO_BYTES
        self._pool = _Pool(copy_threads)
        self._packs = os.path.join(self.root, "packs")
        self._tmp = os.path.join(self.root, "tmp")
        fs.prepare(self.root, self._packs, self._tmp, layout=_FORMAT)
        held = fs.fs_bytes(self.root)
        if held is not None and capacity_bytes > held:
            # Beyond it the file system fills before the store counts itself full, and a put that
            # finds no space would only find out by failing (out of space is also handled, for
            # space other files take).
            log.warning("the file store at %s: capacity_bytes %d exceeds the %d bytes its file system holds; "
                        "the store holds at most %d", self.root, capacity_bytes, held, held)
            capacity_bytes = held
        self.capacity_bytes = capacity_bytes
        #: Whether the root lies on a file system held in memory (tmpfs, ramfs): then a read only
        #: copies memory (unless the machine swapped the pages out).
        self.in_memory = fs.memory_backed(self.root)
        # flock excludes processes, not threads sharing one fd: this process's writers queue on
        # _writers before it, and the index held in memory is _lock's (readers take only that).
        self._writers = threading.Lock()
        self._lock = threading.Lock()
        self._lock_fd = self._ledger_fd = self._log_fd = -1
        self._lock_fd = os.open(os.path.join(self.root, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._file_lock = fs.FileLock(self._writers, self._lock_fd, self._lock, os.path.join(self.root, "lock"),
                                      lambda: self._closed)
        try:
            self._ledger_fd = os.open(os.path.join(self.root, "ledger"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                      0o600)
        except BaseException:
            os.close(self._lock_fd)
            raise
        # On a disk, reads asked not to wait take what is in memory or give up at once
        # (read_batch and holds_batch with ``now``); on tmpfs every read is memory already.
        self._nowait = not self.in_memory and fs.reads_without_waiting(self._ledger_fd, os.path.join(self.root, "lock"))
        #: Whether read_batch and holds_batch can be asked to answer waiting for nothing but
        #: memory (``now``): on tmpfs, and on a disk whose kernel offers reads that do not wait.
        self.reads_without_waiting = self.in_memory or self._nowait
        self._touch_later: set[int] = set()  # packs read with ``now`` on a disk, touched by the next put
        # The index as this process last read it; changed only under the lock.
        self._gen = -1
        self._log_fd = -1
        self._read_to = 0
        self._where: dict[str, tuple[int, int, int]] = {}  # key -> (pack, offset, size)
        self._members: dict[int, set[str]] = {}  # pack -> its live keys
        self._live_record_bytes = 0
        self._closed = False
        self._owner: int | None = None  # the thread that holds the store's lock now
        self._dropped: list[int] = []  # packs to unlink once the lock is let go (_Held)
        self._declines = _Reports("row(s) declined")
        self._lock_waits = _Reports("wait(s) for the lock given up")
        try:
            # No lock: a dead writer's temp file is nobody's (its name holds its pid), and
            # opening must not wait for a process that holds the lock and is stopped.
            self._sweep_temp()
        except BaseException:
            self.close()
            raise

    # -- where objects are ----------------------------------------------------------------------

    def pack_path(self, pack: int) -> str:
        """The file of pack number ``pack``. Paths never derive from keys."""
        return f"{self._packs}/{pack:016x}"

    def locate(self, key: str) -> tuple[str, int, int] | None:
        """Where the object of ``key`` lies now: its pack file, offset and size; None if none."""
        place = self._look(lambda: self._where.get(key))
        return None if place is None else (self.pack_path(place[0]), place[1], place[2])

    def keys(self) -> list[str]:
        """Every key the store holds now."""
        return self._look(lambda: list(self._where))

    def _look(self, answer: Callable[[], _T], deadline: float | None = None) -> _T:
        """``answer()`` from the index as it stands now, read without the store's lock, unless
        the ledger is damaged: then under the lock (waited for until ``deadline``), which
        rebuilds it."""
        try:
            with self._reading():
                self._refresh()
                return answer()
        except _LedgerDamaged:
            with self._locked(deadline):
                self._refresh()
                return answer()

    def holds_batch(self, keys: Sequence[str], *, now: bool = False, deadline: float | None = None
                    ) -> list[bool] | None:
        """For each key, whether an object is stored under it now (one look at the index). Raises
        ``OSError`` when the index cannot be read. ``now``: ``None`` instead of waiting for
        anything but memory (another thread of this process reading the index, or index pages
        on the disk). ``deadline``: for rebuilding a damaged ledger, which takes the lock."""
        places = self._places(keys, now, deadline)
        return None if places is None else [place is not None for place in places]

    def _places(self, keys: Sequence[str], now: bool, deadline: float | None = None
                ) -> list[tuple[int, int, int] | None] | None:
        """Each key's (pack, offset, size) in the index as it stands now, or None for a key not
        held; with ``now``, ``None`` instead of waiting for anything but memory."""
        if not now:
            return self._look(lambda: [self._where.get(key) for key in keys], deadline)
        if not self._lock.acquire(blocking=False):
            return None
        try:
            self._check_open()
            self._refresh(now=True)
            get = self._where.get
            return [get(key) for key in keys]
        except (fs.WouldWait, _LedgerDamaged):  # a worker reads it (and rebuilds a damaged ledger)
            return None
        finally:
            self._lock.release()

    # -- objects ----------------------------------------------------------------------------------

    def write_from(self, keys: Sequence[str], buffers: Sequence[Memory], *, deadline: float | None = None
                   ) -> tuple[list[KeyStatus], dict[int, str]]:
        """Store the bytes of ``buffers[i]`` (a byte view, or a tuple of them: the object's
        parts, one after another) as ``keys[i]``, all in one pack:
        ``OK``, ``ALREADY_THERE`` (the first bytes stay), ``DECLINED`` (no space: the store is
        full and cannot evict, or the file system is full) or ``FAILED``, with reasons. Waits for
        the store's lock until ``deadline`` at most, then raises
        :class:`~kvwire_files.fs.LockBusy` (or answers ``FAILED`` for what it had begun)."""
        if len(keys) != len(buffers):
            raise ValueError(f"write_from: {len(keys)} keys and {len(buffers)} buffers")
        if deadline is None:
            deadline = time.monotonic() + self.lock_timeout_s
        status: list[KeyStatus] = [KeyStatus.OK] * len(keys)
        reasons: dict[int, str] = {}
        with self._locked(deadline):
            self._refresh()
            first: dict[str, int] = {}
            twins: list[tuple[int, int]] = []
            todo = []
            for i, key in enumerate(keys):
                if key in self._where:
                    status[i] = KeyStatus.ALREADY_THERE
                elif key in first:
                    twins.append((i, first[key]))
                elif len(key.encode()) > _MAX_KEY:
                    status[i] = KeyStatus.FAILED
                    reasons[i] = f"a key of {len(key.encode())} bytes is longer than the file store's {_MAX_KEY}"
                else:
                    first[key] = i
                    todo.append(i)
        if todo:
            self._write_batch(keys, buffers, todo, status, reasons, deadline)
        for i, j in twins:  # a key twice in one batch: the second answers as the first did
            status[i] = KeyStatus.ALREADY_THERE if status[j] in (KeyStatus.OK, KeyStatus.ALREADY_THERE) else status[j]
            if j in reasons:
                reasons[i] = reasons[j]
        return status, reasons

    def _write_batch(self, keys: Sequence[str], buffers: Sequence[Memory], todo: list[int],
                     status: list[KeyStatus], reasons: dict[int, str], deadline: float) -> None:
        """Write the objects ``todo`` (indices into the batch) as one pack (a batch of
        :attr:`parallel_bytes` or more: up to ``copy_threads`` packs written at once and
        committed together), filling in their status and reasons. A file system that is full
        counts as a full store: the put evicts and writes again (when eviction is on), and
        declines what still finds no space."""
        costs = [_size(buffers[i]) for i in todo]
        # A large batch is several packs of about equal bytes, written at once (one file each:
        # writes into one file take its inode's lock in turn), renamed and committed together.
        packs = (min(self.copy_threads, len(todo))
                 if self.copy_threads > 1 and sum(costs) >= self.parallel_bytes else 1)
        granted, pack, reserved = self._reserve(costs, deadline, packs)
        for j in range(granted, len(todo)):
            status[todo[j]] = KeyStatus.DECLINED
            reasons[todo[j]] = self._no_space(costs[j])
        if granted < len(todo):
            self._note_declines(len(todo) - granted, reasons[todo[granted]])
        if not granted:
            return
        # Lay the pack out group by group (keys that differ only past their last "/", in the
        # order given), so the rows of one layer lie back to back: a get of one layer's rows,
        # the way a load inside the step asks, is then one read, not one read per row.
        todo = sorted(todo[:granted], key=lambda i: keys[i].rpartition("/")[0])
        costs = [_size(buffers[i]) for i in todo]
        cuts = _balanced(costs, packs) if packs > 1 else []
        if len(cuts) + 1 < packs:  # fewer objects granted than packs reserved: their headers go back
            unused = (packs - len(cuts) - 1) * _PACK_HEADER.size
            self._release(unused, deadline)
            reserved -= unused
        bounds = [0, *cuts, len(todo)]
        # Pack k holds todo[bounds[k]:bounds[k + 1]], numbered pack + k.
        numbers = [pack + k for k in range(len(bounds) - 1)]
        temps = [f"{self._tmp}/{os.getpid()}.{threading.get_ident()}.{next(_counter)}.tmp" for _ in numbers]
        pack_of = []
        offsets = []
        sizes_of = []
        for k in range(len(numbers)):
            at = _PACK_HEADER.size
            for cost in costs[bounds[k]:bounds[k + 1]]:
                pack_of.append(k)
                offsets.append(at)
                at += cost
            sizes_of.append(at)
        at = sum(sizes_of)
        for tries in itertools.count(1):
            try:
                self._write_packs(temps, numbers, [[buffers[i] for i in todo[bounds[k]:bounds[k + 1]]]
                                                   for k in range(len(numbers))])
                break
            except OSError as exc:
                for temp in temps:
                    fs.unlink(temp)
                full = exc.errno in fs.NO_SPACE
                if full and self.eviction and tries <= _NO_SPACE_TRIES:
                    try:
                        if self._make_room(at, deadline):
                            continue
                    except OSError as why:  # the lock stayed held, or the index cannot be read
                        log.debug("the file store at %s: no room made for a pack: %s", self.root, why)
                self._release(reserved, deadline)
                for i in todo:
                    status[i] = KeyStatus.DECLINED if full else KeyStatus.FAILED
                    reasons[i] = (self._out_of_space(exc) if full
                                  else f"writing {keys[i]!r} under {self.root} failed: {exc}")
                if full:
                    self._note_declines(len(todo), reasons[todo[0]])
                return
        placed: list[int] = []
        try:
            with self._locked(deadline):
                self._refresh()
                fresh = [j for j, i in enumerate(todo) if keys[i] not in self._where]
                for i in todo:
                    if keys[i] in self._where:  # another writer committed it first
                        status[i] = KeyStatus.ALREADY_THERE
                # A pack none of whose objects is fresh is not placed (all of them, often).
                wanted = sorted({pack_of[j] for j in fresh})
                dropped = sum(sizes_of[k] for k in range(len(numbers)) if k not in wanted)
                for k in range(len(numbers)):
                    if k not in wanted:
                        fs.unlink(temps[k])
                if dropped:
                    self._write_ledger(used=max(0, self._read_ledger()[0] - dropped))
                    reserved -= dropped
                if not fresh:
                    return
                for k in wanted:
                    os.rename(temps[k], self.pack_path(numbers[k]))
                    placed.append(k)
                if self.fsync:
                    fs.fsync_dir(self._packs)
                # One commit for every pack: a reader sees all the batch's objects or none.
                self._append(b"".join(_record(_ADD, numbers[pack_of[j]], offsets[j], costs[j], keys[todo[j]])
                                      for j in fresh))
        except OSError as exc:
            for k in range(len(numbers)):
                fs.unlink(self.pack_path(numbers[k]) if k in placed else temps[k])
            self._release(reserved, deadline)
            full = exc.errno in fs.NO_SPACE  # the index could not grow
            for i in todo:
                if status[i] is KeyStatus.OK:
                    status[i] = KeyStatus.DECLINED if full else KeyStatus.FAILED
                    reasons[i] = (self._out_of_space(exc) if full
                                  else f"committing {keys[i]!r} under {self.root} failed: {exc}")
            if full:
                self._note_declines(len(todo), self._out_of_space(exc))

    def _write_packs(self, temps: list[str], packs: list[int], objects: list[list[Memory]]) -> None:
        """Write pack ``packs[k]`` of ``objects[k]`` to ``temps[k]`` for each ``k``: one on the
        calling thread, several at once on the store's threads. Returns once every write has
        ended; raises the first error (the caller unlinks every temp file)."""
        if len(temps) == 1:
            self._write_pack(temps[0], packs[0], objects[0])
            return
        tasks = [functools.partial(self._write_pack, temp, pack, group)
                 for temp, pack, group in zip(temps, packs, objects, strict=True)]
        for result in self._pool.run(tasks):
            if isinstance(result, BaseException):
                raise result

    def _write_pack(self, temp: str, pack: int, parts: list[Memory]) -> None:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            buffers: list[bytes | memoryview] = [_PACK_HEADER.pack(_PACK_MAGIC, pack)]
            buffers.extend(part for part in _views(parts) if len(part))
            for lo in range(0, len(buffers), _IOV_MAX):
                fs.write_all(fd, buffers[lo:lo + _IOV_MAX])
            os.utime(fd, ns=fs.now_ns())
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read_batch(self, keys: Sequence[str], buffers: Sequence[Memory], *, now: bool = False,
                   deadline: float | None = None) -> list[tuple[KeyStatus, str | None]] | None:
        """Read object ``keys[i]`` straight into ``buffers[i]``, a writable byte view or a tuple
        of them (its parts, filled one after another; no copy through Python bytes): ``OK``, ``MISSING``, or ``FAILED`` with a reason when the store
        holds it at another size or its pack is not whole. Per pack the keys lie in: open, a
        check of its header, one ``preadv`` per run of adjacent objects (in the order they lie in
        the pack), the LRU touch, close.

        ``now`` (only where :attr:`reads_without_waiting`): ``None`` instead of waiting for
        anything but memory: another thread of this process reading the index, or on a disk a
        path, index page or object page that is not in memory (the buffers may then hold
        anything). On a disk the LRU touch of such a read waits for this process's next put.
        ``deadline``: for rebuilding a damaged ledger, which takes the lock."""
        n = len(keys)
        if n != len(buffers):
            raise ValueError(f"read_batch: {n} keys and {len(buffers)} buffers")
        try:
            return self._read_batch(keys, buffers, now, deadline)
        except fs.WouldWait:  # raised with ``now`` only
            return None

    def _read_batch(self, keys: Sequence[str], buffers: Sequence[Memory], now: bool, deadline: float | None
                    ) -> list[tuple[KeyStatus, str | None]] | None:
        n = len(keys)
        sizes = [_size(b) for b in buffers]
        missing = (KeyStatus.MISSING, None)
        out: list[tuple[KeyStatus, str | None]] = [missing] * n
        places = self._places(keys, now, deadline)
        if places is None:
            return None
        nowait = now and self._nowait
        by_pack: dict[int, list[int]] = {}
        ok = (KeyStatus.OK, None)
        for i, place in enumerate(places):
            if place is None:
                continue
            if place[2] != sizes[i]:
                out[i] = (KeyStatus.FAILED, f"object {keys[i]!r} holds {place[2]} bytes, the destination {sizes[i]}")
                continue
            by_pack.setdefault(place[0], []).append(i)
        if self.copy_threads > 1 and by_pack and sum(
                sizes[i] for members in by_pack.values() for i in members) >= self.parallel_bytes:
            self._read_at_once(keys, buffers, sizes, places, by_pack, out, nowait)
            return out
        for pack, members in by_pack.items():
            try:
                fd = fs.open_file(self.pack_path(pack), os.O_RDONLY, nowait)
            except FileNotFoundError:  # evicted since the index was read: a miss
                continue
            except OSError as exc:
                for i in members:
                    out[i] = (KeyStatus.FAILED, f"opening the pack of {keys[i]!r} under {self.root} failed: {exc}")
                continue
            try:
                if fs.pread_all(fd, _PACK_HEADER.size, 0, nowait) != _PACK_HEADER.pack(_PACK_MAGIC, pack):
                    for i in members:
                        out[i] = (KeyStatus.FAILED, f"the pack file of {keys[i]!r} under {self.root} is not that pack")
                    continue
                members.sort(key=lambda i: places[i][1])  # type: ignore[index]
                for run in _runs(members, places, _parts(buffers[members[0]])):
                    start = places[run[0]][1]  # type: ignore[index]
                    got = _readv(fd, [v for v in _views([buffers[i] for i in run]) if len(v)], start, nowait)
                    for i in run:
                        end = places[i][1] + sizes[i]  # type: ignore[index]
                        out[i] = ok if end - start <= got else (
                            KeyStatus.FAILED, f"the pack file of {keys[i]!r} under {self.root} is torn (cut short)")
                if nowait:  # a change of the inode may wait for the file system's journal
                    self._touch_later.add(pack)
                else:
                    try:  # least recently used goes first when the store evicts
                        os.utime(fd, ns=fs.now_ns())
                    except OSError:
                        pass
            except OSError as exc:
                for i in members:
                    if out[i] is missing:
                        out[i] = (KeyStatus.FAILED, f"reading {keys[i]!r} under {self.root} failed: {exc}")
            finally:
                os.close(fd)
        return out

    def _read_at_once(self, keys: Sequence[str], buffers: Sequence[Memory], sizes: list[int],
                      places: list[tuple[int, int, int] | None], by_pack: dict[int, list[int]],
                      out: list[tuple[KeyStatus, str | None]], nowait: bool) -> None:
        """:meth:`_read_batch`'s reads of a large batch on the store's threads: each pack opened
        and its header checked here, as there; its runs of adjacent objects cut at object
        boundaries into pieces of about a thread's share of the bytes, read by ``preadv`` at
        once (positioned reads of one open file need no order); then the LRU touches and the
        closes. The answers are those of the one-thread loop, but for an error of a read: it
        fails the objects of its piece, where the loop fails the rest of the pack."""
        ok = (KeyStatus.OK, None)
        opened: list[tuple[int, int, list[int]]] = []  # (pack, fd, members by offset)
        try:
            for pack, members in by_pack.items():
                try:
                    fd = fs.open_file(self.pack_path(pack), os.O_RDONLY, nowait)
                except FileNotFoundError:  # evicted since the index was read: a miss
                    continue
                except OSError as exc:
                    for i in members:
                        out[i] = (KeyStatus.FAILED, f"opening the pack of {keys[i]!r} under {self.root} failed: {exc}")
                    continue
                opened.append((pack, fd, members))
                try:
                    header = fs.pread_all(fd, _PACK_HEADER.size, 0, nowait)
                except OSError as exc:
                    for i in members:
                        out[i] = (KeyStatus.FAILED, f"reading {keys[i]!r} under {self.root} failed: {exc}")
                    members[:] = []
                    continue
                if header != _PACK_HEADER.pack(_PACK_MAGIC, pack):
                    for i in members:
                        out[i] = (KeyStatus.FAILED, f"the pack file of {keys[i]!r} under {self.root} is not that pack")
                    members[:] = []
                    continue
                members.sort(key=lambda i: places[i][1])  # type: ignore[index]
            share = max(1, -(-sum(sizes[i] for _, _, m in opened for i in m) // self.copy_threads))
            pieces: list[tuple[int, int, list[int]]] = []  # (pack, fd, objects back to back)
            for pack, fd, members in opened:
                if not members:
                    continue
                for run in _runs(members, places, _parts(buffers[members[0]])):
                    piece: list[int] = []
                    held = 0
                    for i in run:
                        if piece and held + sizes[i] > share:
                            pieces.append((pack, fd, piece))
                            piece, held = [], 0
                        piece.append(i)
                        held += sizes[i]
                    pieces.append((pack, fd, piece))
            # Pieces in order, handed to the threads in runs of about equal bytes.
            cuts = [0, *_balanced([sum(sizes[i] for i in p[2]) for p in pieces], self.copy_threads), len(pieces)]

            def read(lo: int, hi: int) -> None:
                for _, fd, piece in pieces[lo:hi]:
                    start = places[piece[0]][1]  # type: ignore[index]
                    try:
                        got = _readv(fd, [v for v in _views([buffers[i] for i in piece]) if len(v)], start, nowait)
                    except OSError as exc:  # (fs.WouldWait is no OSError: it ends the whole batch)
                        for i in piece:
                            out[i] = (KeyStatus.FAILED, f"reading {keys[i]!r} under {self.root} failed: {exc}")
                        continue
                    for i in piece:
                        end = places[i][1] + sizes[i]  # type: ignore[index]
                        out[i] = ok if end - start <= got else (
                            KeyStatus.FAILED, f"the pack file of {keys[i]!r} under {self.root} is torn (cut short)")

            tasks = [functools.partial(read, lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]
            errors = [e for e in self._pool.run(tasks) if isinstance(e, BaseException)]
            if errors:
                raise errors[0]  # WouldWait (the batch answers None), or a fault of the store's own
            for pack, fd, members in opened:
                if not members:  # its header did not check
                    continue
                if nowait:  # a change of the inode may wait for the file system's journal
                    self._touch_later.add(pack)
                else:
                    try:  # least recently used goes first when the store evicts
                        os.utime(fd, ns=fs.now_ns())
                    except OSError:
                        pass
        finally:
            for _, fd, _ in opened:
                os.close(fd)

    def discard_batch(self, keys: Sequence[str], *, deadline: float | None = None) -> list[bool]:
        """Remove the objects under ``keys``; for each, whether there was one. A pack whose last
        object goes is unlinked; a reader that opened it already still reads it whole. Waits for
        the store's lock until ``deadline`` (or ``lock_timeout_s``) at most."""
        done: list[bool] = []
        with self._locked(deadline):
            self._refresh()
            records = []
            emptied = []
            for key in keys:
                place = self._where.get(key)
                done.append(place is not None)
                if place is None:
                    continue
                records.append(_record(_DROP_KEY, place[0], 0, 0, key))
                members = self._members[place[0]]
                if len(members) == 1 and key in members:
                    emptied.append(place[0])
                self._forget_key(key)
            freed = 0
            for pack in emptied:
                freed += fs.unlink_sized(self.pack_path(pack))
                records.append(_record(_DROP_PACK, pack, 0, 0, ""))
            if records:
                self._append(b"".join(records), ahead=True)
            if freed:
                self._write_ledger(used=max(0, self._read_ledger()[0] - freed))
        return done

    # -- the index --------------------------------------------------------------------------------

    def _refresh(self, now: bool = False) -> None:
        """Apply the index records committed since this process last read it. Needs the thread
        lock only: the committed part of a log never changes (writers append past it, and a
        rewrite goes to the next generation's file), so a reader takes no lock other processes
        could hold it up with. ``now``: ``WouldWait`` rather than wait for the disk."""
        nowait = now and self._nowait
        for _ in range(_RETRIES):
            _, _, gen, length = self._read_ledger(nowait)
            if gen != self._gen:
                try:
                    # read and write: this process's writers append through it
                    fd = fs.open_file(f"{self.root}/index.{gen}", os.O_RDWR, nowait)
                except FileNotFoundError:
                    if length:  # rewritten again since the ledger was read: read it again
                        continue
                    if now:
                        raise fs.WouldWait() from None  # a new store's first index: a worker makes it
                    fd = os.open(f"{self.root}/index.{gen}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                if self._log_fd >= 0:
                    os.close(self._log_fd)
                self._log_fd, self._gen, self._read_to = fd, gen, 0
                self._where.clear()
                self._members.clear()
                self._live_record_bytes = 0
            if length > self._read_to:
                data = fs.pread_all(self._log_fd, length - self._read_to, self._read_to, nowait)
                self._apply(data)
                self._read_to = length
            return
        raise OSError(errno.EAGAIN, f"the file store's index under {self.root} was rewritten {_RETRIES} times "
                      "while this process read it")

    def _apply(self, data: bytes, *, to_damage: bool = False) -> int:
        """Apply the records of ``data``; the bytes applied. Bytes that are no record raise
        (naming the index), or with ``to_damage`` end the records (a rebuild keeps what lies
        before them)."""
        unpack = _RECORD.unpack_from
        head = _RECORD.size
        at, end = 0, len(data)
        where, members = self._where, self._members
        while at < end:
            damage = None
            if at + head > end:
                damage = "a record cut short"
            else:
                kind, pack, offset, size, key_len = unpack(data, at)
                if kind not in (_ADD, _DROP_KEY, _DROP_PACK):
                    damage = f"a record of unknown kind {kind}"
                elif at + head + key_len > end:
                    damage = "a record cut short"
                else:
                    try:
                        key = data[at + head:at + head + key_len].decode()
                    except UnicodeDecodeError:
                        damage = "a key that is not UTF-8"
            if damage is not None:
                if to_damage:
                    return at
                raise self._corrupt(at, damage)
            at += head + key_len
            if kind == _ADD:
                if key not in where:  # the first record of a key wins
                    where[key] = (pack, offset, size)
                    members.setdefault(pack, set()).add(key)
                    self._live_record_bytes += head + key_len
            elif kind == _DROP_KEY:
                place = where.get(key)
                if place is not None and place[0] == pack:
                    self._forget_key(key)
            elif kind == _DROP_PACK:
                for gone in list(members.get(pack, ())):
                    self._forget_key(gone)
                members.pop(pack, None)
        return at

    def _corrupt(self, at: int, what: str) -> OSError:
        return OSError(errno.EIO, f"the file store's index {self.root}/index.{self._gen} holds {what} at offset "
                       f"{self._read_to + at}; remove the store's directory to start it afresh")

    def _forget_key(self, key: str) -> None:
        pack = self._where.pop(key)[0]
        keys = self._members[pack]
        keys.discard(key)
        if not keys:
            del self._members[pack]
        self._live_record_bytes -= _RECORD.size + len(key.encode())

    def _append(self, records: bytes, *, ahead: bool = False) -> None:
        """Under the lock, after :meth:`_refresh`: commit ``records``, then apply them here (or,
        with ``ahead``, they were applied already)."""
        used, next_pack, gen, length = self._read_ledger()
        fs.pwrite_all(self._log_fd, records, length)
        if self.fsync:
            os.fsync(self._log_fd)
        length += len(records)
        self._write_ledger(length=length)
        if not ahead:
            self._apply(records)
        self._read_to = length
        if length >= _COMPACT_AT and length > 4 * self._live_record_bytes:
            try:
                self._compact()
            except OSError as exc:  # the records are committed: the put stands, on the longer log
                log.warning("the file store at %s could not rewrite its index (it stays %d bytes long): %s",
                            self.root, length, exc)

    def _compact(self) -> None:
        """Under the lock: write the live records to the next generation's index and switch to it."""
        _, _, gen, _ = self._read_ledger()
        fd, records = self._write_index(gen + 1)
        try:
            self._write_ledger(gen=gen + 1, length=len(records))
        except BaseException:
            os.close(fd)
            fs.unlink(f"{self.root}/index.{gen + 1}")
            raise
        os.close(self._log_fd)
        self._log_fd, self._gen, self._read_to = fd, gen + 1, len(records)
        fs.unlink(f"{self.root}/index.{gen}")

    def _write_index(self, gen: int) -> tuple[int, bytes]:
        """Under the lock: the live records written whole to ``index.{gen}`` (not yet named by
        the ledger); its open file and the records. On failure nothing is left of it."""
        path = f"{self.root}/index.{gen}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            records = b"".join(_record(_ADD, pack, offset, size, key)
                               for key, (pack, offset, size) in self._where.items())
            fs.pwrite_all(fd, records, 0)
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            fs.unlink(path)
            raise
        return fd, records

    # -- capacity ---------------------------------------------------------------------------------

    def _reserve(self, costs: list[int], deadline: float, packs: int = 1) -> tuple[int, int, int]:
        """Count ``packs`` packs of the leading ``costs`` against the capacity (evicting if
        allowed): how many fit, the first pack's number (the packs take it and the numbers
        after it), and the bytes reserved."""
        overhead = _PACK_HEADER.size * packs
        # Room is made only for the leading objects that fit in the store at all: an object
        # larger than the capacity is declined without evicting anything for it.
        need = overhead
        fitting = 0
        for cost in costs:
            if need + cost > self.capacity_bytes:
                break
            need += cost
            fitting += 1
        with self._locked(deadline):
            self._refresh()
            self._touch_deferred()
            used, next_pack, _, _ = self._read_ledger()
            if used + overhead + sum(costs) > self.capacity_bytes and fitting:
                used = self._rescan(need)
            granted, taken = 0, overhead
            for cost in costs:
                if used + taken + cost > self.capacity_bytes:
                    break
                taken += cost
                granted += 1
            if not granted:
                self._write_ledger(used=used)
                return 0, 0, 0
            self._write_ledger(used=used + taken, next_pack=next_pack + packs)
        return granted, next_pack, taken

    def _release(self, cost: int, deadline: float) -> None:
        """Give back bytes reserved for a pack that was not placed. Best effort: while the lock
        stays held past ``deadline`` the ledger over-counts, until a rescan counts the directory."""
        try:
            with self._locked(deadline):
                self._write_ledger(used=max(0, self._read_ledger()[0] - cost))
        except OSError as exc:
            log.debug("the file store at %s keeps %d bytes counted until its next rescan: %s", self.root, cost, exc)

    def _make_room(self, need: int, deadline: float) -> bool:
        """For a pack of ``need`` bytes the file system had no room for, remove least-recently-used
        packs (chosen under the lock, unlinked once it is let go) until it has that and a tenth
        of the capacity more free (so the next puts fit too); whether it has room for ``need`` now."""
        with self._locked(deadline):
            self._refresh()
            self._touch_deferred()
            free = fs.free_bytes(self.root)
            if free is None:
                return False
            want = need + int(self.capacity_bytes * (1 - _EVICT_TO))
            packs = sorted((mtime, pack, size) for pack, size, mtime in self._pack_files() if pack in self._members)
            victims = []
            freed = 0
            for _, pack, size in packs:
                if free + freed >= want:
                    break
                victims.append(pack)
                freed += size
            if victims:
                self._append(b"".join(_record(_DROP_PACK, pack, 0, 0, "") for pack in victims))
                self._dropped.extend(victims)
                self._write_ledger(used=max(0, self._read_ledger()[0] - freed))
                log.info("the file store at %s found its file system full and evicted %d pack(s), %d bytes",
                         self.root, len(victims), freed)
        # Unlinked once the lock was let go; packs a reader still has open free their space only
        # when it closes them.
        return (fs.free_bytes(self.root) or 0) >= need

    def _rescan(self, need: int) -> int:
        """Under the lock, after :meth:`_refresh`: the bytes the directory really holds (packs and
        live temp files), after evicting least-recently-used packs to make room for ``need`` when
        allowed. A pack the index has no live object of (its writer died committing, or its
        remover before unlinking it) goes, and so do the index's objects whose pack is gone. The
        packs that go are unlinked once the lock is let go (:class:`_Held`), and not counted."""
        self._sweep_temp()
        packs = []
        records: list[bytes] = []
        victims = []
        used = self._temp_bytes()
        for pack, size, mtime in self._pack_files():
            if pack in self._members:
                packs.append((mtime, pack, size))
                used += size
            else:
                victims.append(pack)
        # Objects whose pack file is gone (removed by hand, or a commit whose rename stood and
        # whose records did not) would be held forever: lookups say held, fetches miss, and a
        # put of the key answers ALREADY_THERE.
        on_disk = {pack for _, pack, _ in packs}
        records.extend(_record(_DROP_PACK, pack, 0, 0, "") for pack in self._members if pack not in on_disk)
        if self.eviction and used + need > self.capacity_bytes:
            target = max(0, min(self.capacity_bytes - need, int(self.capacity_bytes * _EVICT_TO)))
            for _, pack, size in sorted(packs):
                if used <= target:
                    break
                victims.append(pack)
                records.append(_record(_DROP_PACK, pack, 0, 0, ""))
                used -= size
        if records:
            self._append(b"".join(records))
        self._dropped.extend(victims)  # only once the index no longer names them
        return used

    def _touch_deferred(self) -> None:
        """Under the lock: the LRU touches of packs read with ``now`` on a disk (before an
        eviction reads the packs' times)."""
        while self._touch_later:
            pack = self._touch_later.pop()
            try:
                os.utime(self.pack_path(pack), ns=fs.now_ns())
            except OSError:
                pass

    def _pack_files(self) -> Iterator[tuple[int, int, float]]:
        for item in os.scandir(self._packs):
            try:
                pack = int(item.name, 16)
                st = item.stat(follow_symlinks=False)
            except (ValueError, FileNotFoundError):
                continue
            yield pack, st.st_size, st.st_mtime

    def _temp_bytes(self) -> int:
        total = 0
        for item in os.scandir(self._tmp):
            try:
                total += item.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
        return total

    def _sweep_temp(self) -> None:
        """Remove temp files whose writing process is gone (a writer killed mid-pack)."""
        for item in os.scandir(self._tmp):
            pid = item.name.split(".", 1)[0]
            if pid.isdigit() and not fs.alive(int(pid)):
                fs.unlink(item.path)

    def _out_of_space(self, exc: OSError) -> str:
        return (f"the file system under {self.root} is full ({exc.strerror or exc})"
                f"{'' if self.eviction else ', and eviction is off'}")

    def _note_declines(self, rows: int, why: str) -> None:
        self._declines.note(rows, "the file store at %s declines rows (not stored): %s", self.root, why)

    def _no_space(self, cost: int) -> str:
        if cost + _PACK_HEADER.size > self.capacity_bytes:
            return f"an object of {cost} bytes exceeds the file store's capacity of {self.capacity_bytes} bytes"
        return (f"the file store at {self.root} is full ({self.capacity_bytes} bytes"
                f"{'' if self.eviction else ', eviction off'}); {cost} bytes do not fit")

    @property
    def used_bytes(self) -> int:
        """The bytes the ledger counts now (packs, and packs being written)."""
        with self._locked():
            self._refresh()
            return self._read_ledger()[0]

    def _reading(self) -> threading.Lock:
        """The lock a reader takes: this process's threads only (see :meth:`_refresh`)."""
        self._check_open()
        return self._lock

    def _check_open(self) -> None:
        if self._closed:
            raise OSError(errno.EBADF, f"the file store at {self.root} is closed")

    def _locked(self, deadline: float | None = None) -> _Held:
        """The store's lock, waited for until ``deadline`` (``time.monotonic()``; None: for
        ``lock_timeout_s``), then :class:`~kvwire_files.fs.LockBusy` naming its holder."""
        self._check_open()
        return _Held(self, deadline)

    def _read_ledger(self, nowait: bool = False) -> tuple[int, int, int, int]:
        """The ledger's four numbers. A reader holds no lock, so its read may overlap a writer's
        and see part of each: the checksum tells, and it reads again. ``nowait``: ``WouldWait``
        rather than wait for the disk."""
        why = "it does not hold a whole record whose checksum matches"
        for _ in range(_RETRIES):
            raw = fs.pread(self._ledger_fd, _LEDGER.size, 0, nowait)
            if not raw:
                if nowait:
                    raise fs.WouldWait()  # a new store, or an emptied ledger: a worker looks
                if not self._holds_objects():
                    return 0, 0, 0, 0  # a new store
                why = "it is empty, though the store holds objects"
                break
            if len(raw) == _LEDGER.size:
                *values, crc = _LEDGER.unpack(raw)
                if zlib.crc32(raw[:-4]) == crc:
                    return values[0], values[1], values[2], values[3]
        if self._owner == threading.get_ident():
            return self._rebuild_ledger(why)
        raise _LedgerDamaged(errno.EIO, f"the file store's ledger {self.root}/ledger is damaged ({why})")

    def _holds_objects(self) -> bool:
        """Whether an index with records, or a pack, is in the directory (an empty ledger then
        is damage, not a new store: the first put writes the ledger before either)."""
        with os.scandir(self.root) as items:
            if any(i.name.startswith("index.") and i.stat(follow_symlinks=False).st_size for i in items):
                return True
        with os.scandir(self._packs) as items:
            return any(True for _ in items)

    def _rebuild_ledger(self, why: str) -> tuple[int, int, int, int]:
        """Under the lock: a new ledger from what the directory holds, and the index rewritten
        to what it can still serve. The newest index's records up to the first bytes that are no
        record are kept whose object lies whole in a pack on disk; every other object is lost
        (and logged). The next pack number skips far past every number in sight (see
        ``_PACK_GAP``); the bytes used are counted from the directory."""
        gens = sorted(int(name[6:]) for name in os.listdir(self.root)
                      if name.startswith("index.") and name[6:].isdigit())
        gen = gens[-1] if gens else 0
        try:
            with open(f"{self.root}/index.{gen}", "rb") as index:
                data = index.read()
        except FileNotFoundError:
            data = b""
        self._where.clear()
        self._members.clear()
        self._live_record_bytes = 0
        self._read_to = 0
        applied = self._apply(data, to_damage=True)
        sizes = {pack: size for pack, size, _ in self._pack_files()}
        listed = len(self._where)
        for key, (pack, offset, size) in list(self._where.items()):
            if offset < _PACK_HEADER.size or offset + size > sizes.get(pack, -1):
                self._forget_key(key)
        lost = listed - len(self._where)
        used = self._temp_bytes()
        for pack, size in sizes.items():
            if pack in self._members:
                used += size
            else:  # no object of it is listed: nobody can read it
                fs.unlink(self.pack_path(pack))
        next_pack = max([*sizes, *self._members, -1]) + 1 + _PACK_GAP
        fd, records = self._write_index(gen + 1)
        values = (used, next_pack, gen + 1, len(records))
        try:
            fs.pwrite_all(self._ledger_fd, _ledger_bytes(*values), 0)
            os.ftruncate(self._ledger_fd, _LEDGER.size)
            if self.fsync:
                os.fsync(self._ledger_fd)
        except BaseException:
            os.close(fd)
            fs.unlink(f"{self.root}/index.{gen + 1}")
            self._gen = -1  # read again from the start, whatever the ledger names
            raise
        if self._log_fd >= 0:
            os.close(self._log_fd)
        self._log_fd, self._gen, self._read_to = fd, gen + 1, len(records)
        for old in gens:
            fs.unlink(f"{self.root}/index.{old}")
        log.warning("the file store's ledger %s/ledger was damaged (%s): rebuilt from index.%d and packs/. Kept "
                    "%d object(s) in %d pack(s); lost %d object(s) whose pack is gone or cut short%s",
                    self.root, why, gen, len(self._where), len(self._members), lost,
                    f", and {len(data) - applied} bytes of the index past its last whole record"
                    if applied < len(data) else "")
        return values

    def _write_ledger(self, *, used: int | None = None, next_pack: int | None = None, gen: int | None = None,
                      length: int | None = None) -> None:
        """Under the lock: change some of the ledger's numbers (one ``pwrite`` of all of them)."""
        old = self._read_ledger()
        new = tuple(o if v is None else v for o, v in zip(old, (used, next_pack, gen, length), strict=True))
        fs.pwrite_all(self._ledger_fd, _ledger_bytes(*new), 0)

    def close(self) -> None:
        """Close the store's files; its objects stay for other processes. Idempotent. Waits for
        this process's writer in flight (one waiting for the lock gives up at once), so that no
        call uses a file number after it was closed (and perhaps given to another file); one
        still in after ``lock_timeout_s`` leaves the files open (logged) rather than risk that."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no call begins from here on
        self._pool.close()  # after the tasks queued now; a call in flight runs the rest itself
        if not fs.acquire_until(self._writers, time.monotonic() + self.lock_timeout_s):
            log.error("the file store at %s: a writer of this process is still in after %g s; its files stay open",
                      self.root, self.lock_timeout_s)
            return
        try:
            with self._lock:
                for fd in (self._lock_fd, self._ledger_fd, self._log_fd):
                    if fd >= 0:
                        os.close(fd)
                self._lock_fd = self._ledger_fd = self._log_fd = -1
        finally:
            self._writers.release()

    def __repr__(self) -> str:
        return f"FileStore({self.root!r}, capacity {self.capacity_bytes} bytes, eviction {'on' if self.eviction else 'off'})"


def _ledger_bytes(used: int, next_pack: int, gen: int, length: int) -> bytes:
    raw = struct.pack("<QQQQ", used, next_pack, gen, length)
    return raw + struct.pack("<I", zlib.crc32(raw))


def _record(kind: int, pack: int, offset: int, size: int, key: str) -> bytes:
    raw = key.encode()
    return _RECORD.pack(kind, pack, offset, size, len(raw)) + raw


def _runs(members: list[int], places: list[tuple[int, int, int] | None], parts: int = 1) -> Iterator[list[int]]:
    """Split ``members`` (sorted by offset) into runs of objects that lie back to back, of at
    most ``_IOV_MAX`` buffers (objects of ``parts`` buffers each) to a run."""
    most = max(1, _IOV_MAX // parts)
    run: list[int] = []
    end = -1
    for i in members:
        _, offset, size = places[i]  # type: ignore[misc]
        if run and (offset != end or len(run) == most):
            yield run
            run = []
        run.append(i)
        end = offset + size
    if run:
        yield run


def _size(memory: Memory) -> int:
    """The bytes of an object's memory."""
    return len(memory) if isinstance(memory, memoryview) else sum(map(len, memory))


def _parts(memory: Memory) -> int:
    """How many byte views an object's memory is."""
    return 1 if isinstance(memory, memoryview) else len(memory)


def _views(memories: Sequence[Memory]) -> list[memoryview]:
    """The byte views of objects' memories, object after object, part after part."""
    if all(isinstance(m, memoryview) for m in memories):
        return list(memories)  # type: ignore[arg-type]
    return list(itertools.chain.from_iterable((m,) if isinstance(m, memoryview) else m for m in memories))


def _readv(fd: int, views: list[memoryview], offset: int, nowait: bool) -> int:
    """:func:`fs.readv` of consecutive bytes into ``views``, in pieces of at most ``_IOV_MAX``
    views (one object of more parts than that still reads whole); the bytes read."""
    if len(views) <= _IOV_MAX:
        return fs.readv(fd, views, offset, nowait)
    done = 0
    for lo in range(0, len(views), _IOV_MAX):
        piece = views[lo:lo + _IOV_MAX]
        got = fs.readv(fd, piece, offset + done, nowait)
        done += got
        if got < sum(map(len, piece)):
            break
    return done
