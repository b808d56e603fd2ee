"""Content names for vLLM's blocks: vLLM's block hash, bound to kvwire's scope.

vLLM's ``request.block_hashes`` already chain over the token prefix and carry ``cache_salt`` and
LoRA extra keys; the scope adds what vLLM leaves out of them and what makes two caches' bytes
differ for the same tokens: the model and its weights, the KV layout and dtype, and the tensor-
parallel shard. A name is blake2b of the block hash keyed by the scope digest, cut to :data:`NAME_BYTES`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["NAME_BYTES", "scope_digest", "block_names"]

#: Width of every content name (N1: fixed-width, opaque to backends).
NAME_BYTES = 16
_SCOPE_VERSION = "kvwire-vllm/1"


def scope_digest(scope: Mapping[str, Any]) -> bytes:
    """A 32-byte digest of ``scope``: plain JSON values, keys sorted, so equal scopes in any
    process give equal digests."""
    text = json.dumps({"v": _SCOPE_VERSION, **scope}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=32).digest()


def block_names(scope: bytes, hashes: Sequence[bytes]) -> np.ndarray:
    """One name per block hash, shape ``(len(hashes), NAME_BYTES)`` uint8."""
    out = np.empty((len(hashes), NAME_BYTES), dtype=np.uint8)
    if not hashes:
        return out
    base = hashlib.blake2b(key=scope, digest_size=NAME_BYTES, person=b"kvwire-vllm")
    joined = bytearray()
    for block_hash in hashes:
        h = base.copy()
        h.update(bytes(block_hash))
        joined += h.digest()
    out[:] = np.frombuffer(bytes(joined), dtype=np.uint8).reshape(len(hashes), NAME_BYTES)
    return out
