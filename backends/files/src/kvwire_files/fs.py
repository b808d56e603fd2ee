"""System calls on a file store's directory: locks, vectored reads and writes, unlinks, the
checks of a root, its file system's size, and whether a path lies in memory (tmpfs). No store
logic: that is :mod:`kvwire_files.store`'s."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import os
import re
import threading
import time
from collections.abc import Callable

from kvwire.waiting import LONGEST_WAIT_S

__all__ = ["NO_SPACE", "FileLock", "LockBusy", "WouldWait", "acquire_until", "alive", "fs_bytes", "free_bytes", "fsync_dir",
           "lock_holder", "memory_backed", "now_ns", "open_cached", "open_file", "pread", "pread_all", "prepare", "pwrite_all",
           "readv", "reads_without_waiting", "unlink", "unlink_sized", "view", "write_all"]

#: The errors that say a file system (or the user's quota on it) is full.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})

_counter = itertools.count(1)


def view(address: int, size: int) -> memoryview:
    """``size`` bytes of memory at ``address`` as a writable byte view (no copy)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class LockBusy(TimeoutError):
    """The store's lock stayed held past the caller's deadline; the message names its holder."""


#: Between two tries of a lock another process holds, at first this long, doubling up to
#: ``_MOST_BETWEEN_TRIES_S``: ``flock`` cannot wait with a timeout, and a writer holds the lock
#: for well under a millisecond, so a waiter looks often at first and seldom later.
_FIRST_BETWEEN_TRIES_S = 50e-6
_MOST_BETWEEN_TRIES_S = 2e-3


class FileLock:
    """The store's lock across processes (``flock`` on ``fd``) and this process's share of it;
    :meth:`acquire` waits until a deadline at most, then raises :class:`LockBusy` naming the
    holder (the kernel records it: ``/proc/locks``), and gives up at once (``EBADF``) once
    ``closed()`` says the store is closing, so that its close need not wait for the deadline.

    ``writers`` (a thread lock) queues this process's writers before the ``flock``, since threads
    sharing one open file share its ``flock``; ``state`` (the thread lock readers take for the
    index held in memory) is taken only once the ``flock`` is held. So a reader never waits for a
    writer of its own process that is waiting for another process."""

    __slots__ = ("_writers", "_fd", "_state", "_path", "_closed")

    def __init__(self, writers: threading.Lock, fd: int, state: threading.Lock, path: str,
                 closed: Callable[[], bool]) -> None:
        self._writers = writers
        self._fd = fd
        self._state = state
        self._path = path
        self._closed = closed

    def acquire(self, deadline: float) -> None:
        """Hold the lock, waiting until ``deadline`` (``time.monotonic()``) at most."""
        if not self._writers.acquire(blocking=False) and not acquire_until(self._writers, deadline):
            raise self._busy()
        try:
            if self._closed():
                raise self._gone()
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._flock(deadline)
            try:
                # Readers hold it for a look at memory only.
                if not self._state.acquire(blocking=False) and not acquire_until(self._state, deadline):
                    raise self._busy()
            except BaseException:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                raise
        except BaseException:
            self._writers.release()
            raise

    def release(self) -> None:
        try:
            self._state.release()
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._writers.release()

    def _flock(self, deadline: float) -> None:
        pause = _FIRST_BETWEEN_TRIES_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._busy()
            time.sleep(min(pause, left))
            pause = min(2 * pause, _MOST_BETWEEN_TRIES_S)
            if self._closed():
                raise self._gone()
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass

    def _gone(self) -> OSError:
        return OSError(errno.EBADF, "the file store is closed", self._path)

    def _busy(self) -> LockBusy:
        return LockBusy(errno.ETIMEDOUT, f"the file store's lock is held by {lock_holder(self._fd)}; gave up "
                        "waiting for it at the deadline", self._path)


def acquire_until(lock: threading.Lock, deadline: float) -> bool:
    """``lock.acquire`` until ``deadline`` (any distance away: kvwire.waiting's pieces)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return lock.acquire(blocking=False)
        if lock.acquire(timeout=min(left, LONGEST_WAIT_S)):
            return True


_STATES = {"R": "running", "S": "sleeping", "D": "waiting for a device", "T": "stopped", "t": "stopped by a debugger",
           "Z": "exited, not yet reaped", "X": "exiting", "I": "idle"}


def lock_holder(fd: int) -> str:
    """Who holds the ``flock`` of the open file ``fd``, as the kernel lists it (/proc/locks),
    and that process's state: e.g. ``"process 1234 (stopped)"``."""
    try:
        st = os.fstat(fd)
        name = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            pids = [int(f[4]) for f in (line.split() for line in locks)
                    if len(f) > 5 and f[1] == "FLOCK" and f[5] == name]
    except (OSError, ValueError):
        return "another process (/proc/locks cannot be read here)"
    if not pids:
        return "another process (it let go as this one gave up)"
    pid = pids[0]
    if pid <= 0:
        return "a process of another pid namespace"
    if pid == os.getpid():
        return f"this process (pid {pid}), through another of its open files of the lock"
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            letter = stat.read().rpartition(b")")[2].split()[0].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return f"process {pid}"
    return f"process {pid} ({_STATES.get(letter, letter)})"


def now_ns() -> tuple[int, int]:
    """Now, to the nanosecond, for a pack's times: a file system's own clock for them (tmpfs's)
    may tick only every few milliseconds, too coarse to order a pack read since it was written."""
    now = time.time_ns()
    return now, now


class WouldWait(Exception):
    """A read asked not to wait (``RWF_NOWAIT``, ``RESOLVE_CACHED``) would have waited for the
    disk: the bytes or the path are not in memory."""


_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_OPENAT2 = 437  # the same number on every Linux architecture (it postdates their split)
_RESOLVE_CACHED = 0x20
_AT_FDCWD = -100


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_syscall = None
_HOWS = {flags: _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE_CACHED) for flags in (os.O_RDONLY, os.O_RDWR)}
_HOW_REFS = {flags: ctypes.byref(how) for flags, how in _HOWS.items()}


def open_cached(path: str, flags: int = os.O_RDONLY) -> int:
    """Open ``path`` (``flags``: ``O_RDONLY`` or ``O_RDWR``) if its lookup needs nothing but
    cached directory entries (``openat2`` with ``RESOLVE_CACHED``, Linux 5.12); ``WouldWait``
    otherwise. A missing file is ``FileNotFoundError`` or ``WouldWait`` (when the kernel would
    have to look on the disk)."""
    global _syscall
    if _syscall is None:
        libc = ctypes.CDLL(None, use_errno=True)
        _syscall = libc.syscall
        _syscall.restype = ctypes.c_long
    fd = _syscall(_OPENAT2, _AT_FDCWD, path.encode(), _HOW_REFS[flags], ctypes.sizeof(_OpenHow))
    if fd >= 0:
        return int(fd)
    code = ctypes.get_errno()
    if code == errno.EAGAIN:
        raise WouldWait(path)
    raise OSError(code, os.strerror(code), path)


def open_file(path: str, flags: int, nowait: bool = False) -> int:
    """``os.open`` of an existing file (``flags``: ``O_RDONLY`` or ``O_RDWR``, close-on-exec);
    ``nowait``: :func:`open_cached`."""
    return open_cached(path, flags) if nowait else os.open(path, flags | os.O_CLOEXEC)


def reads_without_waiting(fd: int, path: str) -> bool:
    """Whether reads here can be asked not to wait for the disk: ``RWF_NOWAIT`` reads of the
    open file ``fd`` and ``RESOLVE_CACHED`` opens of ``path`` (a file in the same directory) are
    both offered. tmpfs refuses ``RWF_NOWAIT`` (EOPNOTSUPP), which needs none: its reads are
    memory."""
    if not _RWF_NOWAIT:  # defined on Linux only
        return False
    try:
        os.preadv(fd, [bytearray(1)], 0, _RWF_NOWAIT)
    except BlockingIOError:
        pass
    except OSError:
        return False
    try:
        os.close(open_cached(path))
    except (WouldWait, FileNotFoundError):
        pass
    except (OSError, AttributeError):
        return False
    return True


def readv(fd: int, buffers: list[memoryview], offset: int, nowait: bool = False) -> int:
    """``preadv`` until the buffers are full or the file ends; the bytes read. ``nowait``: one
    ``preadv`` that takes only what is in memory, and ``WouldWait`` unless it filled every
    buffer (a short read cannot tell the file's end from pages not read yet)."""
    total = sum(len(b) for b in buffers)
    if nowait:
        try:
            done = os.preadv(fd, buffers, offset, _RWF_NOWAIT) if buffers else 0
        except BlockingIOError:
            raise WouldWait() from None
        if done != total:
            raise WouldWait()
        return done
    done = os.preadv(fd, buffers, offset) if buffers else 0
    while 0 < done < total:  # a short read (rare): go on from where it stopped
        k, at = 0, 0
        while at + len(buffers[k]) <= done:  # buffers[k] is the first not yet full
            at += len(buffers[k])
            k += 1
        more = os.preadv(fd, [buffers[k][done - at:], *buffers[k + 1:]], offset + done)
        if not more:
            break
        done += more
    return done


def pread(fd: int, size: int, offset: int, nowait: bool = False) -> bytes:
    """``os.pread``; ``nowait``: only what is in memory (fewer bytes at the file's end), else
    ``WouldWait``."""
    if not nowait:
        return os.pread(fd, size, offset)
    buffer = bytearray(size)
    try:
        got = os.preadv(fd, [buffer], offset, _RWF_NOWAIT)
    except BlockingIOError:
        raise WouldWait() from None
    return bytes(buffer[:got])


def pread_all(fd: int, size: int, offset: int, nowait: bool = False) -> bytes:
    """``size`` bytes at ``offset``; ``nowait``: from memory, else ``WouldWait`` (a short read
    then cannot tell the file's end from pages not read yet)."""
    if nowait:
        data = pread(fd, size, offset, nowait=True)
        if len(data) != size:
            raise WouldWait()
        return data
    parts = []
    while size:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            raise OSError(errno.EIO, "the file store's index is shorter than its ledger says")
        parts.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def write_all(fd: int, buffers: list[bytes | memoryview]) -> None:
    """``writev`` every byte of ``buffers``; a short write is finished piece by piece, and one
    that writes nothing (the file system is full) raises ``ENOSPC``."""
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
                if not n:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                rest = rest[n:]
            done = end
        offset = end


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """``pwrite`` every byte of ``data`` at ``offset``: a short write goes on where it stopped,
    and one that writes nothing (the file system is full) raises ``ENOSPC``. (A short write left
    unchecked would commit bytes never written.)"""
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, offset)
        if not n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]
        offset += n


def fs_bytes(path: str) -> int | None:
    """The bytes the file system holding ``path`` offers an unprivileged user in all (its size,
    less blocks reserved for root); None where it cannot be asked."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return (st.f_blocks - st.f_bfree + st.f_bavail) * st.f_frsize


def free_bytes(path: str) -> int | None:
    """The bytes still free on the file system holding ``path`` for an unprivileged user."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def unlink_sized(path: str) -> int:
    """Unlink ``path``; the bytes it held (0 if it was gone)."""
    try:
        size = os.stat(path).st_size
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return size


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def memory_backed(path: str) -> bool:
    """Whether ``path`` lies on tmpfs or ramfs, by the mount that holds it in /proc/self/mountinfo
    (False where that cannot be read)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                left, sep, right = line.partition(" - ")
                fields = left.split()
                if not sep or len(fields) < 5 or not right.split():
                    continue
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):  # the deepest mount, the latest of equals
                    best, kind = point, right.split()[0]
    except OSError:
        return False
    return kind in ("tmpfs", "ramfs")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prepare(root: str, *dirs: str, layout: bytes) -> None:
    """Create ``root`` (0700), its folders and its FORMAT file (``layout``), and prove it
    writable; errors name the path. A root of another layout is refused."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotADirectoryError(errno.ENOTDIR, "the file store's root is not a directory", root)
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except NotADirectoryError:
        raise NotADirectoryError(errno.ENOTDIR, "the file store's root lies under a path that is not a directory",
                                 root) from None
    except OSError as exc:
        raise PermissionError(exc.errno, f"the file store's root cannot be written ({exc.strerror})", root) from None
    marker = os.path.join(root, "FORMAT")
    try:
        with open(marker, "rb") as f:
            found = f.read(64)
    except FileNotFoundError:
        found = None
    except OSError as exc:
        raise PermissionError(exc.errno, f"the file store's root cannot be read ({exc.strerror})", root) from None
    if found is not None and found != layout:
        raise FileExistsError(errno.EEXIST, f"the file store's root holds another layout ({found[:32]!r}); "
                              "remove it or choose another root", root)
    if found is None and os.path.exists(os.path.join(root, "objects")):
        raise FileExistsError(errno.EEXIST, "the file store's root holds a store of an older layout (objects/); "
                              "remove it or choose another root", root)
    try:
        for folder in dirs:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        probe = os.path.join(dirs[-1], f"{os.getpid()}.probe.{next(_counter)}.tmp")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        os.unlink(probe)
        if found is None:
            temp = f"{marker}.{os.getpid()}.{next(_counter)}"
            with open(temp, "wb") as f:
                f.write(layout)
            os.replace(temp, marker)
    except OSError as exc:
        raise PermissionError(exc.errno, f"the file store's root cannot be written ({exc.strerror})", root) from None
