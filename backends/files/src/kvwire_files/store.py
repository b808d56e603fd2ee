"""A store of named, immutable objects in one directory, shared by every process that opens it.

Layout under ``root``::

    objects/ab/ab12...ef   one file per object, named by a hash of its key (never by the key)
    tmp/                   objects being written: ``{pid}.{thread}.{n}.tmp``
    ledger                 8 bytes: the object bytes the store counts against its capacity
    lock                   flock'd around every change to the ledger and every eviction

An object file is a header (magic, payload size, the key itself) followed by the payload. It is
written whole under ``tmp/`` and then hard-linked to its name in ``objects/``: ``link`` is atomic
and never replaces an existing name, so a reader sees a whole object or none, a put under an
existing key keeps the first object's bytes, and a writer killed mid-object leaves only a temp
file nobody reads (removed once its process is gone). The header names the key, so a file that
is not the object asked for (a hash collision, a torn file after power loss) is never taken for
it.

**Eviction never removes an object mid-read.** Removing (or evicting) an object unlinks its name;
a reader that already opened the file keeps reading the same, whole, unchanged bytes, and the
space is freed when the last reader closes it (POSIX unlink semantics). A reader that comes
after the unlink finds no object: a miss. So eviction needs no reader counts across processes.
When a put would exceed the capacity, the store rescans its files (repairing the ledger) and,
with eviction on, unlinks least-recently-used objects (a fetch touches its object's mtime) until
the store is at most 90 % full; with eviction off the put is declined."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import itertools
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from kvwire.blob import KeyStatus

_blake2b = hashlib.blake2b

__all__ = ["FileStore", "default_root"]

_MAGIC = b"KVWFILE1"
_HEADER = struct.Struct("<8sQI")  # magic, payload bytes, key bytes; the key follows
_U64 = struct.Struct("<Q")
#: After an eviction the store holds at most this share of its capacity, so one scan of the
#: directory pays for many puts.
_EVICT_TO = 0.9
_counter = itertools.count(1)


def default_root() -> str:
    """``/dev/shm/kvwire-files-{uid}`` (shared memory on Linux), else under the temp directory."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else __import__("tempfile").gettempdir()
    return os.path.join(base, f"kvwire-files-{os.getuid()}")


def _view(address: int, size: int) -> memoryview:
    """``size`` bytes of memory at ``address`` as a writable byte view (no copy)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def _header(key: bytes, size: int) -> bytes:
    return _HEADER.pack(_MAGIC, size, len(key)) + key


@dataclass(frozen=True, slots=True)
class _Entry:
    path: str
    size: int
    mtime: float


class FileStore:
    """The directory ``root`` as a store of at most ``capacity_bytes`` object bytes (file sizes,
    headers included). Thread-safe, and safe to share with other processes on this machine.

    Raises ``NotADirectoryError`` or ``PermissionError`` naming the path when ``root`` is not a
    directory, or cannot be created or written; a missing root is created (mode 0700)."""

    def __init__(self, root: str, *, capacity_bytes: int, eviction: bool = True, fsync: bool = False) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be an int >= 1, got {capacity_bytes!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.capacity_bytes = capacity_bytes
        self.eviction = bool(eviction)
        self.fsync = bool(fsync)
        self._objects = os.path.join(self.root, "objects")
        self._tmp = os.path.join(self.root, "tmp")
        _prepare(self.root, self._objects, self._tmp)
        self._lock = threading.Lock()  # flock excludes processes, not threads sharing one fd
        self._lock_fd = os.open(os.path.join(self.root, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._ledger_fd = os.open(os.path.join(self.root, "ledger"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._closed = False
        self._sweep_temp()

    # -- names ------------------------------------------------------------------------------------

    def path(self, key: str) -> str:
        """The object file of ``key``: a hash of it, so no key can name a path outside ``root``."""
        digest = _blake2b(key.encode(), digest_size=20).hexdigest()
        return f"{self._objects}/{digest[:2]}/{digest}"

    # -- objects ----------------------------------------------------------------------------------

    def holds(self, key: str) -> bool:
        """Whether an object is stored under ``key`` now. Raises ``OSError`` when the directory
        cannot say (not for a missing object)."""
        try:
            os.stat(self.path(key))
        except FileNotFoundError:
            return False
        return True

    def write_from(self, keys: list[str], addresses: list[int], sizes: list[int]) -> tuple[list[KeyStatus], dict[int, str]]:
        """Store ``sizes[i]`` bytes at ``addresses[i]`` as ``keys[i]``: ``OK``, ``ALREADY_THERE``
        (the first bytes stay), ``DECLINED`` (no space) or ``FAILED``, with reasons."""
        status: list[KeyStatus] = [KeyStatus.OK] * len(keys)
        reasons: dict[int, str] = {}
        encoded = [k.encode() for k in keys]
        todo = []
        for i, key in enumerate(keys):
            if os.path.exists(self.path(key)):
                status[i] = KeyStatus.ALREADY_THERE
            else:
                todo.append(i)
        costs = [_HEADER.size + len(encoded[i]) + sizes[i] for i in todo]
        granted = self._reserve(costs)
        for j, i in enumerate(todo):
            if j >= granted:
                status[i] = KeyStatus.DECLINED
                reasons[i] = self._no_space(costs[j])
                continue
            try:
                written = self._write_one(self.path(keys[i]), _header(encoded[i], sizes[i]), addresses[i], sizes[i])
            except OSError as exc:
                self._release(costs[j])
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    status[i] = KeyStatus.DECLINED
                    reasons[i] = f"the file store at {self.root} is out of space: {exc.strerror}"
                else:
                    status[i] = KeyStatus.FAILED
                    reasons[i] = f"writing {keys[i]!r} under {self.root} failed: {exc}"
                continue
            if not written:
                self._release(costs[j])
                status[i] = KeyStatus.ALREADY_THERE
        return status, reasons

    def _write_one(self, final: str, header: bytes, address: int, size: int) -> bool:
        """Write one object to a temp file and link it into place; False if one was there."""
        temp = os.path.join(self._tmp, f"{os.getpid()}.{threading.get_ident()}.{next(_counter)}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                _write_all(fd, [header, _view(address, size)] if size else [header])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.makedirs(os.path.dirname(final), mode=0o700, exist_ok=True)
            try:
                os.link(temp, final)
            except FileExistsError:
                return False
            return True
        finally:
            try:
                os.unlink(temp)
            except FileNotFoundError:
                pass

    def read_into(self, key: str, address: int, size: int) -> tuple[KeyStatus, str | None]:
        """Read object ``key`` straight into ``size`` bytes at ``address`` (one ``preadv``, no
        copy through Python bytes): ``OK``, ``MISSING``, or ``FAILED`` with a reason when the
        file is not a whole object of exactly that size."""
        return self.read_batch([key], [address], [size])[0]

    def read_batch(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[tuple[KeyStatus, str | None]]:
        """:meth:`read_into` for each key in turn. Per object: open, one ``preadv`` of the header,
        the payload and one byte more (a file of any other length reads short or fills that
        byte, so no ``fstat`` is needed on the way), the LRU touch, close."""
        out: list[tuple[KeyStatus, str | None]] = []
        ok = (KeyStatus.OK, None)
        missing = (KeyStatus.MISSING, None)
        probe = bytearray(1)
        flags = os.O_RDONLY | os.O_CLOEXEC
        for key, address, size in zip(keys, addresses, sizes, strict=True):
            try:
                fd = os.open(self.path(key), flags)
            except FileNotFoundError:
                out.append(missing)
                continue
            except OSError as exc:
                out.append((KeyStatus.FAILED, f"opening {key!r} under {self.root} failed: {exc}"))
                continue
            try:
                want = _header(key.encode(), size)
                head = bytearray(len(want))
                got = os.preadv(fd, [head, _view(address, size), probe] if size else [head, probe], 0)
                if got != len(want) + size:
                    out.append((KeyStatus.FAILED, self._misfit(fd, key, len(want), size)))
                elif head != want:
                    out.append((KeyStatus.FAILED, f"object file of {key!r} under {self.root} is not that object whole"))
                else:
                    try:
                        os.utime(fd)  # least recently used goes first when the store evicts
                    except OSError:
                        pass
                    out.append(ok)
            except OSError as exc:
                out.append((KeyStatus.FAILED, f"reading {key!r} under {self.root} failed: {exc}"))
            finally:
                os.close(fd)
        return out

    def _misfit(self, fd: int, key: str, header: int, size: int) -> str:
        """Why an object file's length is not its header and ``size`` bytes (a slow path)."""
        stored = os.fstat(fd).st_size
        if stored >= header:
            return f"object {key!r} holds {stored - header} bytes, the destination {size}"
        return f"object file of {key!r} is torn"

    def discard(self, key: str) -> bool:
        """Unlink the object under ``key``; whether there was one. A reader that opened it
        already still reads it whole."""
        path = self.path(key)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return False
        self._release(size)
        return True

    # -- capacity ---------------------------------------------------------------------------------

    def _reserve(self, costs: list[int]) -> int:
        """Count the leading ``costs`` against the capacity; how many fit (evicting if allowed)."""
        if not costs:
            return 0
        # Room is made only for the leading objects that fit in the store at all: an object
        # larger than the capacity is declined without evicting anything for it.
        need = 0
        for cost in costs:
            if need + cost > self.capacity_bytes:
                break
            need += cost
        with self._locked():
            used = self._read_ledger()
            if used + sum(costs) > self.capacity_bytes and need:
                used = self._rescan(need)
            granted, taken = 0, 0
            for cost in costs:
                if used + taken + cost > self.capacity_bytes:
                    break
                taken += cost
                granted += 1
            self._write_ledger(used + taken)
        return granted

    def _release(self, cost: int) -> None:
        with self._locked():
            self._write_ledger(max(0, self._read_ledger() - cost))

    def _rescan(self, need: int) -> int:
        """Under the lock: the bytes the directory really holds (objects and live temp files),
        after evicting least-recently-used objects to make room for ``need`` when allowed."""
        self._sweep_temp()
        entries = list(self._entries())
        used = sum(e.size for e in entries) + self._temp_bytes()
        if self.eviction and used + need > self.capacity_bytes:
            target = max(0, min(self.capacity_bytes - need, int(self.capacity_bytes * _EVICT_TO)))
            for entry in sorted(entries, key=lambda e: e.mtime):
                if used <= target:
                    break
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue
                used -= entry.size
        return used

    def _entries(self) -> Iterator[_Entry]:
        for top in os.scandir(self._objects):
            if not top.is_dir(follow_symlinks=False):
                continue
            for item in os.scandir(top.path):
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                yield _Entry(item.path, st.st_size, st.st_mtime)

    def _temp_bytes(self) -> int:
        total = 0
        for item in os.scandir(self._tmp):
            try:
                total += item.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
        return total

    def _sweep_temp(self) -> None:
        """Remove temp files whose writing process is gone (a writer killed mid-object)."""
        for item in os.scandir(self._tmp):
            pid = item.name.split(".", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                try:
                    os.unlink(item.path)
                except FileNotFoundError:
                    pass

    def _no_space(self, cost: int) -> str:
        if cost > self.capacity_bytes:
            return f"an object of {cost} bytes exceeds the file store's capacity of {self.capacity_bytes} bytes"
        return (f"the file store at {self.root} is full ({self.capacity_bytes} bytes"
                f"{'' if self.eviction else ', eviction off'}); {cost} bytes do not fit")

    @property
    def used_bytes(self) -> int:
        """The bytes the ledger counts now (objects, and objects being written)."""
        with self._locked():
            return self._read_ledger()

    def _locked(self) -> _FileLock:
        return _FileLock(self._lock, self._lock_fd)

    def _read_ledger(self) -> int:
        raw = os.pread(self._ledger_fd, _U64.size, 0)
        return _U64.unpack(raw)[0] if len(raw) == _U64.size else 0

    def _write_ledger(self, used: int) -> None:
        os.pwrite(self._ledger_fd, _U64.pack(used), 0)

    def close(self) -> None:
        """Close the store's files; its objects stay for other processes. Idempotent."""
        if not self._closed:
            self._closed = True
            os.close(self._lock_fd)
            os.close(self._ledger_fd)

    def __repr__(self) -> str:
        return f"FileStore({self.root!r}, capacity {self.capacity_bytes} bytes, eviction {'on' if self.eviction else 'off'})"


class _FileLock:
    __slots__ = ("_lock", "_fd")

    def __init__(self, lock: threading.Lock, fd: int) -> None:
        self._lock = lock
        self._fd = fd

    def __enter__(self) -> None:
        self._lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()


def _write_all(fd: int, buffers: list[bytes | memoryview]) -> None:
    total = sum(len(b) for b in buffers)
    done = os.writev(fd, buffers)
    if done == total:
        return
    flat = [memoryview(b).cast("B") for b in buffers]
    offset = 0
    for buf in flat:  # a short write (rare): finish it piece by piece
        end = offset + len(buf)
        if done < end:
            rest = buf[max(0, done - offset):]
            while len(rest):
                n = os.write(fd, rest)
                rest = rest[n:]
            done = end
        offset = end


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _prepare(root: str, *dirs: str) -> None:
    """Create ``root`` (0700) and its folders, and prove it writable; errors name the path."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotADirectoryError(errno.ENOTDIR, "the file store's root is not a directory", root)
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        for folder in dirs:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        probe = os.path.join(dirs[-1], f"{os.getpid()}.probe.{next(_counter)}.tmp")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        os.unlink(probe)
    except NotADirectoryError:
        raise NotADirectoryError(errno.ENOTDIR, "the file store's root lies under a path that is not a directory",
                                 root) from None
    except OSError as exc:
        raise PermissionError(exc.errno, f"the file store's root cannot be written ({exc.strerror})", root) from None
