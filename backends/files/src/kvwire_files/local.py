"""What the ``kvwire`` command asks of this plugin besides backends: a private root for demos and
benches (``Plugin.local_services``), so they never write into the store a user's processes
share, and ``kvwire doctor``'s checks of the configured root (``Plugin.extra["doctor"]``)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from kvwire_files.store import default_root

__all__ = ["local_services", "doctor"]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def local_services(options: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """For demos, benches and tests: unless the configuration names a root of its own, a fresh
    private root beside the default one (in shared memory), yielded as ``{"root": path}`` and
    removed with everything in it when the block exits, however it exits. A root the
    configuration names is used as it is."""
    if os.path.abspath(options["root"]) != os.path.abspath(default_root()):
        yield {}
        return
    root = ""
    try:  # entered before the directory exists: an interrupt right after it is made still removes it
        root = tempfile.mkdtemp(prefix=f"kvwire-files-private-{os.getpid()}-", dir=os.path.dirname(default_root()))
        log.info("files store: a private root for this run, %s (removed afterwards)", root)
        yield {"root": root}
    finally:
        if root:
            shutil.rmtree(root, ignore_errors=True)


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _held_bytes(root: str) -> int:
    """The bytes of the store's files under ``root`` (they count against its capacity)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


def doctor(options: Mapping[str, Any]) -> list[tuple[str, bool, str, str]]:
    """``kvwire doctor``'s checks of the root ``options`` name: that it exists or can be
    created, that files can be written in it, and that its file system has room for
    ``capacity_bytes`` (beside what the store already holds)."""
    root = os.path.abspath(options["root"])
    capacity = int(options["capacity_bytes"])
    fix_root = "set the backend option 'root' (KVWIRE_BACKEND_ROOT) to a directory this user can write"
    found: list[tuple[str, bool, str, str]] = []
    existing = root
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = root if existing == root else f"{existing}, above {root},"
        return [("root", False, f"{what} is not a directory", fix_root)]
    here = "exists" if existing == root else f"does not exist yet; it is created under {existing}"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return [("root", False, f"{root} {here}, but a file cannot be written in {existing}: "
                 f"{exc.strerror or exc}", fix_root)]
    found.append(("root", True, f"{root} {here}; writable", ""))
    stat = os.statvfs(existing)
    free = stat.f_bavail * stat.f_frsize
    held = _held_bytes(root) if existing == root else 0
    room = free + held
    detail = f"capacity_bytes {_size(capacity)}; the file system has {_size(free)} free"
    if held:
        detail += f" and the store holds {_size(held)}"
    if room >= capacity:
        found.append(("space", True, detail, ""))
    else:
        found.append(("space", False, f"{detail}: the store cannot fill its capacity",
                      f"free space on {existing}, or set capacity_bytes to at most {room} "
                      "(KVWIRE_BACKEND_CAPACITY_BYTES)"))
    return found
