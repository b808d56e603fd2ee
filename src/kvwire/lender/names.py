"""Content names (N1): a block's name is a keyed blake2b-256 of the block's tokens (little-endian
int64) whose key is the previous block's name, the first keyed by the scope digest. So a name
commits to every token through its block and to the scope, and is the same in every process."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["NAME_BYTES", "token_array", "chain_names", "names_array", "state_name"]

NAME_BYTES = 32
_BLOCK_PERSON = b"kvwire-block-v1"
_STATE_PERSON = b"kvwire-state-v1"


def token_array(tokens: object) -> np.ndarray:
    """``tokens`` as a 1-D, contiguous little-endian int64 array (a copy only when needed)."""
    if hasattr(tokens, "detach"):  # a torch tensor: go through CPU numpy once
        tokens = tokens.detach().cpu().numpy()  # type: ignore[union-attr]
    array = np.ascontiguousarray(tokens, dtype="<i8")
    if array.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
    return array


def chain_names(tokens: np.ndarray, block_tokens: int, parent: bytes, first_block: int = 0,
                count: int | None = None) -> list[bytes]:
    """Names of whole blocks ``first_block ..`` of ``tokens`` (``count`` of them, default all),
    chained from ``parent``: the scope digest for block 0, else the name of block
    ``first_block - 1``. One hash call per block."""
    whole = len(tokens) // block_tokens
    stop = whole if count is None else min(whole, first_block + count)
    if stop <= first_block:
        return []
    step = block_tokens * 8
    buf = memoryview(tokens.data).cast("B")
    blake = hashlib.blake2b
    person = _BLOCK_PERSON
    out: list[bytes] = []
    append = out.append
    for start in range(first_block * step, stop * step, step):
        parent = blake(buf[start:start + step], digest_size=NAME_BYTES, key=parent, person=person).digest()
        append(parent)
    return out


def names_array(names: Sequence[bytes]) -> np.ndarray:
    """``names`` as a ``(len, 32)`` uint8 array (writable, a fresh buffer)."""
    if not names:
        return np.zeros((0, NAME_BYTES), dtype=np.uint8)
    return np.frombuffer(bytearray(b"".join(names)), dtype=np.uint8).reshape(len(names), NAME_BYTES)


def name_keys(names: np.ndarray) -> list[bytes]:
    """A ``(n, 32)`` uint8 array as a list of ``n`` 32-byte keys; refuses another shape."""
    if not isinstance(names, np.ndarray):
        if isinstance(names, (list, tuple)) and all(isinstance(n, (bytes, bytearray)) for n in names):
            bad = [len(n) for n in names if len(n) != NAME_BYTES]
            if bad:
                raise ValueError(f"names are {NAME_BYTES} bytes each, got lengths {sorted(set(bad))}")
            return [bytes(n) for n in names]
        raise TypeError(f"names must be a (n, {NAME_BYTES}) uint8 array, got {type(names).__name__}")
    if names.dtype != np.uint8:
        raise TypeError(f"names must have dtype uint8, got {names.dtype}")
    if names.ndim != 2 or names.shape[1] != NAME_BYTES:
        raise ValueError(f"names must have shape (n, {NAME_BYTES}), got {names.shape}")
    # one 32-byte void item per name: tolist() makes the bytes keys in C, not a Python loop
    keys = np.ascontiguousarray(names).view(np.dtype((np.void, NAME_BYTES))).ravel().tolist()
    return keys  # type: ignore[return-value]  # void items list as bytes


def state_name(tokens: np.ndarray, block_tokens: int, checkpoint: int, group_id: int,
               parent: bytes) -> bytes:
    """The name of a STATE group's slot at the exact ``checkpoint``: commits to every token before
    it, the group and the scope. ``parent`` is the name of the last whole block before the
    checkpoint (the scope digest when there is none)."""
    start = (checkpoint // block_tokens) * block_tokens
    head = np.array([group_id, checkpoint], dtype="<i8").tobytes()
    return hashlib.blake2b(head + tokens[start:checkpoint].tobytes(), digest_size=NAME_BYTES,
                           key=parent, person=_STATE_PERSON).digest()
