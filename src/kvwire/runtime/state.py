"""A worker's transceiver state (N3): what a receiver needs to pull from it — the backend and
how to reach the other end, the cache layout and the scope — as opaque, versioned, bounded bytes.

The encoding is a magic, a version byte and a UTF-8 JSON object of plain fields (bytes as hex).
Decoding executes nothing, refuses more than :data:`MAX_STATE_BYTES`, and checks every field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["TransceiverState", "StateError", "MAX_STATE_BYTES"]

MAX_STATE_BYTES = 16 * 1024
_MAGIC = b"KVWS"
_VERSION = 1


class StateError(ValueError):
    """Transceiver state bytes that cannot be decoded, or that describe a cache this worker cannot
    pull from (another layout or scope). The message says which."""


@dataclass(frozen=True, slots=True)
class TransceiverState:
    """Who to pull from and what their cache is. ``address`` reaches a peer backend (empty for a
    store); ``namespace`` selects the store's namespace (empty for a peer)."""

    worker: str
    backend: str
    other_end: str
    address: bytes
    namespace: str
    model_id: str
    layout_digest: bytes
    scope_digest: bytes
    block_tokens: int

    def to_bytes(self) -> bytes:
        body = {
            "worker": self.worker,
            "backend": self.backend,
            "other_end": self.other_end,
            "address": self.address.hex(),
            "namespace": self.namespace,
            "model_id": self.model_id,
            "layout_digest": self.layout_digest.hex(),
            "scope_digest": self.scope_digest.hex(),
            "block_tokens": self.block_tokens,
        }
        raw = _MAGIC + bytes([_VERSION]) + json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
        if len(raw) > MAX_STATE_BYTES:
            raise StateError(f"transceiver state would be {len(raw)} bytes, more than {MAX_STATE_BYTES}")
        return raw

    @classmethod
    def from_bytes(cls, data: bytes) -> TransceiverState:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise StateError(f"transceiver state must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_STATE_BYTES:
            raise StateError(f"transceiver state is {len(data)} bytes, more than the {MAX_STATE_BYTES} allowed")
        if len(data) < 5 or data[:4] != _MAGIC:
            raise StateError("not a kvwire transceiver state (bad magic); pass the bytes of Worker.transceiver_state()")
        if data[4] != _VERSION:
            raise StateError(f"transceiver state version {data[4]} is not supported (this kvwire reads {_VERSION})")
        try:
            body = json.loads(data[5:].decode())
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise StateError(f"transceiver state body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise StateError("transceiver state body must be an object")
        expected = {
            "worker": str, "backend": str, "other_end": str, "address": str, "namespace": str,
            "model_id": str, "layout_digest": str, "scope_digest": str, "block_tokens": int,
        }
        if set(body) != set(expected):
            missing = sorted(set(expected) - set(body))
            extra = sorted(set(body) - set(expected))
            raise StateError(f"transceiver state fields differ: missing {missing}, unexpected {extra}")
        for key, typ in expected.items():
            if not isinstance(body[key], typ) or isinstance(body[key], bool):
                raise StateError(f"transceiver state field {key!r} must be {typ.__name__}")
        if body["other_end"] not in ("peer", "store"):
            raise StateError(f"transceiver state other_end must be 'peer' or 'store', got {body['other_end']!r}")
        if body["block_tokens"] <= 0:
            raise StateError("transceiver state block_tokens must be positive")
        fields: dict[str, Any] = dict(body)
        for key in ("address", "layout_digest", "scope_digest"):
            try:
                fields[key] = bytes.fromhex(body[key])
            except ValueError:
                raise StateError(f"transceiver state field {key!r} is not hex") from None
        return cls(**fields)
