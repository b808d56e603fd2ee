"""What a submission says about the other end (H1), with a bounded, versioned byte encoding."""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Hint", "HintValue", "MAX_HINT_BYTES"]

HintValue = None | bool | int | float | str | bytes

#: The encoded form of a hint never exceeds this many bytes; decoding refuses longer input.
MAX_HINT_BYTES = 64 * 1024
MAX_FIELDS = 64
_MAGIC = b"KVWH"
_VERSION = 1
_KEY = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_TAG_NONE, _TAG_FALSE, _TAG_TRUE, _TAG_INT, _TAG_FLOAT, _TAG_STR, _TAG_BYTES = range(7)
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_U32 = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class Hint:
    """Describes only the other end: a peer's transceiver state, a store namespace, a reply
    ticket. ``kind`` says which; ``fields`` are sorted ``(key, value)`` pairs of plain values;
    ``timeout_s`` bounds the submission (A8) when given. Which rows move comes from the view."""

    kind: str
    fields: tuple[tuple[str, HintValue], ...] = ()
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not _KEY.match(self.kind):
            raise ValueError(f"Hint.kind must match {_KEY.pattern}, got {self.kind!r}")
        items = self.fields.items() if isinstance(self.fields, Mapping) else self.fields
        fields = tuple(sorted((str(k), v) for k, v in items))
        if len(fields) > MAX_FIELDS:
            raise ValueError(f"a Hint holds at most {MAX_FIELDS} fields, got {len(fields)}")
        keys = [k for k, _ in fields]
        if len(set(keys)) != len(keys):
            raise ValueError(f"Hint field keys must be unique, got {keys}")
        for key, value in fields:
            if not _KEY.match(key):
                raise ValueError(f"Hint field key must match {_KEY.pattern}, got {key!r}")
            if not (value is None or isinstance(value, (bool, int, float, str, bytes))):
                raise TypeError(
                    f"Hint field {key!r} must be None, bool, int, float, str or bytes; "
                    f"got {type(value).__name__}"
                )
            if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
                raise ValueError(f"Hint field {key!r} is outside the signed 64-bit range")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"Hint field {key!r} must be a finite float, got {value!r}")
        object.__setattr__(self, "fields", fields)
        if self.timeout_s is not None:
            timeout = float(self.timeout_s)
            if not math.isfinite(timeout) or timeout <= 0:
                raise ValueError(f"Hint.timeout_s must be a finite number > 0, got {self.timeout_s!r}")
            object.__setattr__(self, "timeout_s", timeout)
        size = self._encoded_size()
        if size > MAX_HINT_BYTES:
            raise ValueError(f"a Hint encodes to at most {MAX_HINT_BYTES} bytes, this one to {size}")

    def _encoded_size(self) -> int:
        """``len(self.to_bytes())`` without building the bytes (kind and keys are ASCII by
        their pattern, so a character is a byte)."""
        size = len(_MAGIC) + 1 + 1 + len(self.kind) + 1 + (0 if self.timeout_s is None else _F64.size) + 1
        for key, value in self.fields:
            size += 1 + len(key) + 1
            if value is None or value is True or value is False:
                continue
            if isinstance(value, (int, float)):
                size += 8
            else:
                size += _U32.size + len(value.encode() if isinstance(value, str) else value)
        return size

    @classmethod
    def of(cls, kind: str, *, timeout_s: float | None = None, **fields: HintValue) -> Hint:
        """``Hint.of("store", namespace="tenant-a")``."""
        return cls(kind, tuple(fields.items()), timeout_s)

    def get(self, key: str, default: HintValue = None) -> HintValue:
        for k, v in self.fields:
            if k == key:
                return v
        return default

    def __getitem__(self, key: str) -> HintValue:
        for k, v in self.fields:
            if k == key:
                return v
        raise KeyError(f"hint of kind {self.kind!r} has no field {key!r}")

    def to_bytes(self) -> bytes:
        """The versioned encoding; :meth:`from_bytes` of it gives an equal hint."""
        out = bytearray(_MAGIC)
        out.append(_VERSION)
        _put_text(out, self.kind)
        if self.timeout_s is None:
            out.append(0)
        else:
            out.append(1)
            out += _F64.pack(self.timeout_s)
        out.append(len(self.fields))
        for key, value in self.fields:
            _put_text(out, key)
            if value is None:
                out.append(_TAG_NONE)
            elif value is True or value is False:
                out.append(_TAG_TRUE if value else _TAG_FALSE)
            elif isinstance(value, int):
                out.append(_TAG_INT)
                out += _I64.pack(value)
            elif isinstance(value, float):
                out.append(_TAG_FLOAT)
                out += _F64.pack(value)
            else:
                raw = value.encode() if isinstance(value, str) else value
                out.append(_TAG_STR if isinstance(value, str) else _TAG_BYTES)
                out += _U32.pack(len(raw))
                out += raw
        return bytes(out)

    @classmethod
    def from_bytes(cls, data: bytes) -> Hint:
        """Decode :meth:`to_bytes` output. Executes nothing; every length is bounded; anything
        malformed raises ``ValueError`` saying what is wrong."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"Hint.from_bytes takes bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_HINT_BYTES:
            raise ValueError(f"hint bytes exceed {MAX_HINT_BYTES} bytes ({len(data)})")
        reader = _Reader(data)
        if reader.take(len(_MAGIC)) != _MAGIC:
            raise ValueError("not a kvwire hint: bad magic")
        version = reader.byte()
        if version != _VERSION:
            raise ValueError(f"hint encoding version {version} is not supported (this kvwire reads {_VERSION})")
        kind = reader.text()
        timeout = _F64.unpack(reader.take(8))[0] if reader.flag() else None
        count = reader.byte()
        fields: list[tuple[str, HintValue]] = []
        for _ in range(count):
            key = reader.text()
            tag = reader.byte()
            value: HintValue
            if tag == _TAG_NONE:
                value = None
            elif tag in (_TAG_FALSE, _TAG_TRUE):
                value = tag == _TAG_TRUE
            elif tag == _TAG_INT:
                value = _I64.unpack(reader.take(8))[0]
            elif tag == _TAG_FLOAT:
                value = _F64.unpack(reader.take(8))[0]
            elif tag in (_TAG_STR, _TAG_BYTES):
                raw = reader.take(_U32.unpack(reader.take(4))[0])
                value = reader.decode(raw) if tag == _TAG_STR else raw
            else:
                raise ValueError(f"hint field {key!r} has unknown type tag {tag}")
            fields.append((key, value))
        if reader.left():
            raise ValueError(f"hint bytes have {reader.left()} trailing bytes")
        try:
            return cls(kind, tuple(fields), timeout)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"hint bytes decode to an invalid hint: {exc}") from None


def _put_text(out: bytearray, text: str) -> None:
    raw = text.encode()
    if len(raw) > 255:
        raise ValueError(f"hint text {text[:20]!r}... exceeds 255 bytes")
    out.append(len(raw))
    out += raw


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n > len(self.data) - self.pos:
            raise ValueError(f"hint bytes end early: wanted {n} bytes at offset {self.pos}")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def byte(self) -> int:
        return self.take(1)[0]

    def flag(self) -> bool:
        value = self.byte()
        if value > 1:
            raise ValueError(f"hint flag byte must be 0 or 1, got {value}")
        return value == 1

    def text(self) -> str:
        return self.decode(self.take(self.byte()))

    @staticmethod
    def decode(raw: bytes) -> str:
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise ValueError("hint text is not valid UTF-8") from None

    def left(self) -> int:
        return len(self.data) - self.pos
