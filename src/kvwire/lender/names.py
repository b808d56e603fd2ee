"""Content names (N1): a block's name is SHA-256 of the previous block's name followed by the
block's tokens (little-endian int64); before the first block stands the chain's root, SHA-256 of
``b"kvwire-block-v2"`` followed by the scope digest. So a name commits to every token through its
block and to the scope (SHA-256's collision resistance, over fields of fixed width per layout),
and is the same in every process. The tag in the root keeps the chain apart from any other use
of SHA-256 at no cost per block.

Version 2 of the chain. Version 1 was a keyed blake2b-256 per block (key: the previous name,
person ``kvwire-block-v1``). It moved to SHA-256 because the chain is one hash call per block,
in order, and that call is the floor of ``Lender.probe(tokens)``: CPython's blake2b (keyed, with
a person) costs about 0.7 us per 16-token block, OpenSSL's SHA-256 about 0.45 us (``bench/
bench_lender.py``). Names of the two versions never match, so a store or a peer holding blocks
named by version 1 is a miss for version 2 (nothing wrong is read; the blocks are recomputed)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["NAME_BYTES", "token_array", "chain_names", "names_array", "state_name"]

NAME_BYTES = 32
_BLOCK_TAG = b"kvwire-block-v2"
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
    chained from ``parent``: the scope digest for block 0 (the root is made from it), else the
    name of block ``first_block - 1``. One hash call per block."""
    whole = len(tokens) // block_tokens
    stop = whole if count is None else min(whole, first_block + count)
    if stop <= first_block:
        return []
    if first_block == 0:
        parent = hashlib.sha256(_BLOCK_TAG + parent).digest()  # the chain's root
    # One bytes object per block, made in C (void items list as bytes, zero bytes kept).
    block = np.dtype((np.void, block_tokens * 8))
    blocks = tokens[first_block * block_tokens:stop * block_tokens].view(block).tolist()
    sha256 = hashlib.sha256
    out: list[bytes] = []
    append = out.append
    for data in blocks:
        parent = sha256(parent + data).digest()
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
