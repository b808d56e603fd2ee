"""Store keys: how a row's content name and a namespace become the name of a stored object.

``kvw1/{namespace}/g{group_id}/{name.hex()}``: equal names in one namespace and group mean the
same object (N1); different namespaces or groups never share a key. The last two parts never
hold ``/``, so a key splits back into its parts unambiguously."""

from __future__ import annotations

import re

import numpy as np

__all__ = ["KEY_PREFIX", "check_namespace", "store_keys"]

#: The key layout's version: a change of layout gets a new prefix, never a silent collision.
KEY_PREFIX = "kvw1"

_NAMESPACE = re.compile(r"^[A-Za-z0-9._:@+=-][A-Za-z0-9._:@+=/-]{0,127}$")
#: Byte value -> its two lowercase hex digits, as two uint8 (one table lookup per name byte).
_HEX_PAIRS = np.frombuffer(b"".join(f"{b:02x}".encode() for b in range(256)), dtype=np.uint8).reshape(256, 2)


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


def store_keys(namespace: str, group_id: int, names: np.ndarray) -> list[str]:
    """One key per row of ``names`` (shape ``(rows, width)`` uint8), built without a per-row
    Python loop: ``f"kvw1/{namespace}/g{group_id}/{name.hex()}"``."""
    names = np.asarray(names, dtype=np.uint8)
    if names.ndim != 2:
        raise ValueError(f"names must have shape (rows, width), got {names.shape}")
    rows, width = names.shape
    prefix = f"{KEY_PREFIX}/{check_namespace(namespace)}/g{int(group_id)}/".encode("ascii")
    length = len(prefix) + 2 * width
    if rows == 0:
        return []
    buf = np.empty((rows, length), dtype=np.uint8)
    buf[:, : len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    buf[:, len(prefix):] = _HEX_PAIRS[names].reshape(rows, 2 * width)
    # Each row is one fixed-width ASCII string; numpy turns them into str objects in C.
    return buf.view(f"S{length}").ravel().astype(f"U{length}").tolist()  # type: ignore[no-any-return]
