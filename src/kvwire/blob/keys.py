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


#: ``(namespace, group_id)`` -> the keys' common head ``kvw1/{namespace}/g{group_id}/``, and
#: the same after a newline (only namespaces that passed :func:`check_namespace` get here).
_heads: dict[tuple[str, int], tuple[str, str]] = {}


def _head(namespace: str, group_id: int) -> tuple[str, str]:
    head = _heads.get((namespace, group_id))
    if head is None:
        text = f"{KEY_PREFIX}/{check_namespace(namespace)}/g{group_id}/"  # a bad namespace raises
        if len(_heads) >= 256:
            _heads.clear()
        head = _heads[(namespace, group_id)] = (text, "\n" + text)
    return head


def store_keys(namespace: str, group_id: int, names: np.ndarray) -> list[str]:
    """One key per row of ``names`` (shape ``(rows, width)`` uint8), built without a per-row
    Python loop: ``f"kvw1/{namespace}/g{group_id}/{name.hex()}"``."""
    names = np.ascontiguousarray(names, dtype=np.uint8)
    if names.ndim != 2:
        raise ValueError(f"names must have shape (rows, width), got {names.shape}")
    rows, width = names.shape
    if not isinstance(namespace, str):
        check_namespace(namespace)  # raises ValueError, as for any namespace it refuses
    head, next_head = _head(namespace, int(group_id))
    if rows <= 1:
        return [head + names.tobytes().hex()] if rows else []
    if not width:
        return [head] * rows
    # One hex string with a newline after every name, each newline then followed by the head,
    # split at the newlines: every step runs in C over the whole batch (no key has a newline:
    # a namespace cannot hold one, and hex digits are not one).
    lines = names.tobytes().hex("\n", width)
    return (head + lines.replace("\n", next_head)).split("\n")
