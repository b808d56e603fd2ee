"""Store keys: how a row's content name and a namespace become the name of a stored object.

``kvw1/{namespace}/g{group_id}/{name.hex()}``: equal names in one namespace and group mean the
same object (N1); different namespaces or groups never share a key.

``kvw1/{namespace}/b{layout digest}/{name.hex()}``: the block object of a name (K1), holding the
row of that name of every group of a block layout (:func:`block_keys`). The layout digest is 32
hex digits, never a ``g`` followed by decimal digits, so a block key never equals a per-group
key (K1.6). The last two parts never hold ``/``, so a key splits back into its parts
unambiguously, and a namespace's keys of both kinds share the head ``kvw1/{namespace}/``."""

from __future__ import annotations

import hashlib
import re

import numpy as np

__all__ = ["KEY_PREFIX", "check_namespace", "store_keys", "block_keys", "layout_digest"]

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


def layout_digest(layout: str) -> str:
    """The 32 hex digits that stand for a block layout (K1.2) in its block keys: BLAKE2b-128 of
    the layout's text. K1.5 wants "the same layout" exactly, and the digest keeps it: two layouts
    meet only if their digests collide, which takes about 2**64 tries even for someone choosing
    layouts on purpose (a 64-bit digest would take 2**32, an afternoon of hashing)."""
    return hashlib.blake2b(layout.encode(), digest_size=16).hexdigest()


#: ``(namespace, layout)`` -> the block keys' common head and the same after a newline.
_block_heads: dict[tuple[str, str], tuple[str, str]] = {}


def _block_head(namespace: str, layout: str) -> tuple[str, str]:
    head = _block_heads.get((namespace, layout))
    if head is None:
        text = f"{KEY_PREFIX}/{check_namespace(namespace)}/b{layout_digest(layout)}/"  # a bad namespace raises
        if len(_block_heads) >= 256:
            _block_heads.clear()
        head = _block_heads[(namespace, layout)] = (text, "\n" + text)
    return head


def store_keys(namespace: str, group_id: int, names: np.ndarray) -> list[str]:
    """One key per row of ``names`` (shape ``(rows, width)`` uint8), built without a per-row
    Python loop: ``f"kvw1/{namespace}/g{group_id}/{name.hex()}"``."""
    names = np.ascontiguousarray(names, dtype=np.uint8)
    if names.ndim != 2:
        raise ValueError(f"names must have shape (rows, width), got {names.shape}")
    if not isinstance(namespace, str):
        check_namespace(namespace)  # raises ValueError, as for any namespace it refuses
    return _keys(_head(namespace, int(group_id)), names)


def block_keys(namespace: str, layout: str, names: np.ndarray) -> list[str]:
    """One block key per row of ``names`` (shape ``(rows, width)`` uint8), for block objects of
    the block layout ``layout`` (the text of :func:`kvwire.contract.block_layout`, K1.2), built
    without a per-row Python loop: ``f"kvw1/{namespace}/b{layout_digest(layout)}/{name.hex()}"``."""
    names = np.ascontiguousarray(names, dtype=np.uint8)
    if names.ndim != 2:
        raise ValueError(f"names must have shape (rows, width), got {names.shape}")
    if not isinstance(namespace, str):
        check_namespace(namespace)  # raises ValueError, as for any namespace it refuses
    if not isinstance(layout, str):
        raise ValueError(f"a block layout is a str such as '0:4096,1:4096', got {type(layout).__name__}")
    return _keys(_block_head(namespace, layout), names)


def _keys(heads: tuple[str, str], names: np.ndarray) -> list[str]:
    head, next_head = heads
    rows, width = names.shape
    if rows <= 1:
        return [head + names.tobytes().hex()] if rows else []
    if not width:
        return [head] * rows
    # One hex string with a newline after every name, each newline then followed by the head,
    # split at the newlines: every step runs in C over the whole batch (no key has a newline:
    # a namespace cannot hold one, and hex digits are not one).
    lines = names.tobytes().hex("\n", width)
    return (head + lines.replace("\n", next_head)).split("\n")
