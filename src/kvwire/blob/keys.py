"""Store keys: how a row's content name and a namespace become the name of a stored object.

``kvw1/{namespace}/g{group_id}/{name.hex()}``: equal names in one namespace and group mean the
same object (N1); different namespaces or groups never share a key. The last two parts never
hold ``/``, so a key splits back into its parts unambiguously."""

from __future__ import annotations

import functools
import re

import numpy as np

__all__ = ["KEY_PREFIX", "check_namespace", "store_keys"]

#: The key layout's version: a change of layout gets a new prefix, never a silent collision.
KEY_PREFIX = "kvw1"

_NAMESPACE = re.compile(r"^[A-Za-z0-9._:@+=-][A-Za-z0-9._:@+=/-]{0,127}$")
_NEWLINE = ord("\n")


def check_namespace(namespace: object) -> str:
    """``namespace`` if it is a usable store namespace: 1-128 ASCII letters, digits or
    ``. _ : @ + = - /``, not starting with ``/``. Raises ``ValueError`` saying what is wrong."""
    if not isinstance(namespace, str):
        raise ValueError(f"a store namespace is a str, got {type(namespace).__name__}")
    if not _NAMESPACE.match(namespace):
        raise ValueError(
            f"store namespace {namespace!r} is not allowed: use 1-128 ASCII letters, digits or "
            "'._:@+=-/', not starting with '/'"
        )
    return namespace


@functools.lru_cache(maxsize=256)
def _prefix(namespace: str, group_id: int) -> np.ndarray:
    """``kvw1/{namespace}/g{group_id}/`` as read-only ASCII codes (a bad namespace raises, and
    is not cached)."""
    prefix = np.frombuffer(f"{KEY_PREFIX}/{check_namespace(namespace)}/g{group_id}/".encode("ascii"),
                           dtype=np.uint8)
    prefix.setflags(write=False)
    return prefix


@functools.lru_cache(maxsize=256)
def _prefix_text(namespace: str, group_id: int) -> str:
    return _prefix(namespace, group_id).tobytes().decode("ascii")


#: Up to this many rows, keys are cut from one hex string.
_FEW_ROWS = 8


def store_keys(namespace: str, group_id: int, names: np.ndarray) -> list[str]:
    """One key per row of ``names`` (shape ``(rows, width)`` uint8), built without a per-row
    Python loop: ``f"kvw1/{namespace}/g{group_id}/{name.hex()}"``."""
    names = np.ascontiguousarray(names, dtype=np.uint8)
    if names.ndim != 2:
        raise ValueError(f"names must have shape (rows, width), got {names.shape}")
    rows, width = names.shape
    if not isinstance(namespace, str):
        check_namespace(namespace)  # raises ValueError, as for any namespace it refuses
    prefix = _prefix(namespace, int(group_id))
    if rows == 0:
        return []
    if rows <= _FEW_ROWS:  # a few keys: string slicing costs less than the buffer's fixed numpy calls
        head, step = _prefix_text(namespace, int(group_id)), 2 * width
        text = names.tobytes().hex()
        return [head + text[i:i + step] for i in range(0, rows * step, step)]
    start, end = prefix.size, prefix.size + 2 * width
    # One line per key, "prefix + hex + \n", laid out in one buffer; bytes.hex, the decode and
    # the split each run in C over the whole batch.
    buf = np.empty((rows, end + 1), dtype=np.uint8)
    buf[:, :start] = prefix
    buf[:, start:end] = np.frombuffer(names.tobytes().hex().encode("ascii"), dtype=np.uint8).reshape(rows, 2 * width)
    buf[:, end] = _NEWLINE
    return buf.tobytes()[:-1].decode("ascii").split("\n")
