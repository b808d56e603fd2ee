"""A worker's transceiver state (N3): what a receiver needs to pull from it — the backend and
how to reach the other end, the cache layout and the scope — as opaque, versioned, bounded bytes.

The encoding is a magic, a version byte and a UTF-8 JSON object of plain fields (bytes as hex).
Decoding executes nothing, refuses more than :data:`MAX_STATE_BYTES`, and checks every field.

``facts`` (optional, written only when there are some) are the plain facts the scope digest is
made of, such as the model, its dtype or the tensor-parallel size, so that a receiver whose
digest differs can say which fact differs rather than only that one does."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvwire.contract.capabilities import OtherEnd

__all__ = ["TransceiverState", "StateError", "MAX_STATE_BYTES"]

MAX_STATE_BYTES = 16 * 1024
_MAGIC = b"KVWS"
_VERSION = 1
_DIGEST_BYTES = 32
_MAX_ADDRESS_BYTES = 4096
_MAX_TEXT = 256
_MAX_FACTS = 32
_FACT_KEY = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
#: A registry name (``kvwire.backends`` entry point): lower-case letters, digits, ``-``, ``_``.
_BACKEND = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")
#: A store namespace, as the blob store family (``kvwire.blob.keys``) reads one.
_NAMESPACE = re.compile(r"^[A-Za-z0-9._:@+=-][A-Za-z0-9._:@+=/-]{0,127}$")


class StateError(ValueError):
    """Transceiver state bytes that cannot be decoded, whose fields are not valid, or that
    describe a cache this worker cannot pull from (another layout or scope). The message names
    the field."""


def _text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > _MAX_TEXT or not value.isprintable():
        raise StateError(f"transceiver state field {name!r} must be 1-{_MAX_TEXT} printable characters, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class TransceiverState:
    """Who to pull from and what their cache is. ``address`` reaches a peer backend (empty for a
    store); ``namespace`` selects the store's namespace (empty for a peer). Every field is
    checked at construction, so a decoded state is a valid one (N3)."""

    worker: str
    backend: str
    other_end: OtherEnd
    address: bytes
    namespace: str
    model_id: str
    layout_digest: bytes
    scope_digest: bytes
    block_tokens: int
    facts: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        _text("worker", self.worker)
        if not isinstance(self.backend, str) or not _BACKEND.match(self.backend):
            raise StateError(f"transceiver state field 'backend' must be a backend's registry name, got {self.backend!r}")
        if not isinstance(self.other_end, OtherEnd):
            raise StateError(f"transceiver state field 'other_end' must be an OtherEnd, got {self.other_end!r}")
        if not isinstance(self.address, bytes) or len(self.address) > _MAX_ADDRESS_BYTES:
            raise StateError(f"transceiver state field 'address' must be at most {_MAX_ADDRESS_BYTES} bytes")
        if not isinstance(self.namespace, str):
            raise StateError("transceiver state field 'namespace' must be a str")
        if self.other_end is OtherEnd.PEER:
            if not self.address:
                raise StateError("transceiver state field 'address' is empty, but a peer is reached by its address")
            if self.namespace:
                raise StateError("transceiver state field 'namespace' must be empty for a peer")
        else:
            if self.address:
                raise StateError("transceiver state field 'address' must be empty for a store")
            if not _NAMESPACE.match(self.namespace):
                raise StateError(f"transceiver state field 'namespace' is not a store namespace: {self.namespace!r} "
                                 "(1-128 ASCII letters, digits or '._:@+=-/', not starting with '/')")
        _text("model_id", self.model_id)
        for name in ("layout_digest", "scope_digest"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != _DIGEST_BYTES:
                raise StateError(f"transceiver state field {name!r} must be {_DIGEST_BYTES} bytes")
        if not isinstance(self.block_tokens, int) or isinstance(self.block_tokens, bool) or not 0 < self.block_tokens <= 1 << 20:
            raise StateError(f"transceiver state field 'block_tokens' must be an int in [1, {1 << 20}], "
                             f"got {self.block_tokens!r}")
        if not isinstance(self.facts, tuple) or len(self.facts) > _MAX_FACTS:
            raise StateError(f"transceiver state field 'facts' must be a tuple of at most {_MAX_FACTS} pairs")
        for pair in self.facts:
            if (not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[0], str)
                    or not _FACT_KEY.match(pair[0]) or not isinstance(pair[1], str) or len(pair[1]) > _MAX_TEXT
                    or not pair[1].isprintable()):
                raise StateError(f"transceiver state field 'facts' holds {pair!r}: each fact is a name (lower-case "
                                 f"letters, digits, '_', at most 32) and printable text of at most {_MAX_TEXT}")
        if len({k for k, _ in self.facts}) != len(self.facts):
            raise StateError("transceiver state field 'facts' names a fact twice")

    def fact_map(self) -> dict[str, str]:
        return dict(self.facts)

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "worker": self.worker,
            "backend": self.backend,
            "other_end": self.other_end.value,
            "address": self.address.hex(),
            "namespace": self.namespace,
            "model_id": self.model_id,
            "layout_digest": self.layout_digest.hex(),
            "scope_digest": self.scope_digest.hex(),
            "block_tokens": self.block_tokens,
        }
        if self.facts:
            body["facts"] = dict(self.facts)
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
        facts = body.pop("facts", {})
        if not isinstance(facts, dict) or len(facts) > _MAX_FACTS:
            raise StateError(f"transceiver state field 'facts' must be an object of at most {_MAX_FACTS} entries")
        if set(body) != set(expected):
            missing = sorted(set(expected) - set(body))
            extra = sorted(set(body) - set(expected))
            raise StateError(f"transceiver state fields differ: missing {missing}, unexpected {extra}")
        for key, typ in expected.items():
            if not isinstance(body[key], typ) or isinstance(body[key], bool):
                raise StateError(f"transceiver state field {key!r} must be {typ.__name__}")
        try:
            other_end = OtherEnd(body["other_end"])
        except ValueError:
            raise StateError(f"transceiver state field 'other_end' must be 'peer' or 'store', "
                             f"got {body['other_end']!r}") from None
        fields: dict[str, Any] = dict(body, other_end=other_end,
                                      facts=tuple(sorted((k, v) for k, v in facts.items())))
        for key in ("address", "layout_digest", "scope_digest"):
            text = body[key]
            if not text.isascii() or text != text.lower() or len(text) % 2 or " " in text:
                raise StateError(f"transceiver state field {key!r} is not lower-case hex")
            try:
                fields[key] = bytes.fromhex(text)
            except ValueError:
                raise StateError(f"transceiver state field {key!r} is not hex") from None
        return cls(**fields)
