"""What :meth:`UcxBackend.address` returns: how another end reaches this backend's listener.

Layout (big-endian where it matters to nobody but us; 14 bytes plus the host):
magic ``KVUA`` (4), version (1), instance id (8), port (2), host length (1), host (UTF-8).
The instance id lets a requester notice that another process now answers at that port."""

from __future__ import annotations

import ipaddress
import re
import struct
from dataclasses import dataclass

__all__ = ["AddressError", "PeerAddress", "MAX_ADDRESS_BYTES", "is_host"]

_MAGIC = b"KVUA"
_VERSION = 1
_HEAD = struct.Struct(">4sBQHB")
MAX_ADDRESS_BYTES = _HEAD.size + 255
#: A DNS host name in ASCII (an international one in its IDNA form): dot-separated labels of
#: letters, digits, '-' and '_', each 1..63 characters.
_ZONE = re.compile(r"[A-Za-z0-9_.-]+")
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?:\.(?!-)[A-Za-z0-9_-]{1,63})*\.?")


#: Addresses decoded lately, by their bytes: a requester names the same few peers in every
#: fetch's hint, and the checks of a host (an IP parse, a pattern) cost ~15 us a fetch.
#: PeerAddress is frozen, so one object serves every caller.
_decoded: dict[bytes, PeerAddress] = {}
_DECODED_KEPT = 256


class AddressError(ValueError):
    """Bytes that are not a kvwire-ucx address; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """A backend's control listener (``host``, ``port``) and its ``instance`` id."""

    host: str
    port: int
    instance: int

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not 1 <= len(self.host.encode()) <= 255:
            raise AddressError(f"address host must be 1..255 bytes of text, got {self.host!r}")
        if not is_host(self.host):
            raise AddressError(f"address host {self.host!r} is neither an IP address nor an ASCII host name; "
                               "give an international name in its IDNA (xn--) form")
        if not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise AddressError(f"address port must be 1..65535, got {self.port!r}")
        if not isinstance(self.instance, int) or not 0 <= self.instance < 1 << 64:
            raise AddressError(f"address instance must be an unsigned 64-bit int, got {self.instance!r}")

    def to_bytes(self) -> bytes:
        raw = self.host.encode()
        return _HEAD.pack(_MAGIC, _VERSION, self.instance, self.port, len(raw)) + raw

    @classmethod
    def from_bytes(cls, data: object) -> PeerAddress:
        """Decode :meth:`to_bytes` output; anything else raises :class:`AddressError`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise AddressError(f"a kvwire-ucx address is bytes, got {type(data).__name__}")
        data = bytes(data)
        known = _decoded.get(data)
        if known is not None:  # a peer's address, decoded before: the same answer, minus the checks
            return known
        if len(data) > MAX_ADDRESS_BYTES:
            raise AddressError(f"a kvwire-ucx address is at most {MAX_ADDRESS_BYTES} bytes, got {len(data)}")
        if len(data) < _HEAD.size:
            raise AddressError(f"a kvwire-ucx address is at least {_HEAD.size} bytes, got {len(data)}")
        magic, version, instance, port, size = _HEAD.unpack(data[: _HEAD.size])
        if magic != _MAGIC:
            raise AddressError(f"not a kvwire-ucx address: bad magic {magic!r} (was it made by another backend?)")
        if version != _VERSION:
            raise AddressError(f"kvwire-ucx address version {version} is not supported (this end reads {_VERSION})")
        if len(data) != _HEAD.size + size:
            raise AddressError(f"kvwire-ucx address announces a {size}-byte host but carries {len(data) - _HEAD.size}")
        try:
            host = data[_HEAD.size :].decode()
        except UnicodeDecodeError:
            raise AddressError("kvwire-ucx address host is not valid UTF-8") from None
        address = cls(host, port, instance)
        if len(_decoded) >= _DECODED_KEPT:
            _decoded.clear()
        _decoded[data] = address
        return address

    @property
    def is_loopback(self) -> bool:
        return is_loopback(self.host)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def is_host(host: str) -> bool:
    """Whether a socket can be asked to reach ``host``: an IP address (an IPv6 one with a
    ``%zone`` of letters, digits, ``_ . -``) or an ASCII host name of at most 253 characters
    (254 with its trailing dot). Text with a NUL, spaces or non-ASCII characters would fail
    inside the connect, on the progress thread, not at submission."""
    if not host.isascii():
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return _HOST_NAME.fullmatch(host) is not None and len(host.removesuffix(".")) <= 253
    return "%" not in host or _ZONE.fullmatch(host.partition("%")[2]) is not None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
