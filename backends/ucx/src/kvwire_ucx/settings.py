"""The options of a kvwire-ucx backend, as frozen data, their declarations for the registry, and
what a backend built with them declares (:func:`capabilities_for`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvwire.contract import Capabilities, MemoryKind
from kvwire.contract.capabilities import OFFER_PULLS, SERVE_PULLS, OtherEnd
from kvwire.registry.plugin import Option
from kvwire_ucx.address import is_host

__all__ = ["UcxSettings", "OPTIONS", "MODES", "MEMORY_KINDS", "WITH_DEVICE", "capabilities_for"]

#: What a backend reaches without UCX's CUDA transports; with them, DEVICE too (:data:`WITH_DEVICE`).
MEMORY_KINDS = frozenset({MemoryKind.HOST})
WITH_DEVICE = frozenset({MemoryKind.HOST, MemoryKind.DEVICE})

#: "two-sided" (default): rows travel as UCX tag messages into the rows the requester lent.
#: "one-sided": pulls are answered with where the rows lie, and the requester reads them itself
#: through NIXL; for trusted clusters only (see the README's trust model).
MODES = ("two-sided", "one-sided")


@dataclass(frozen=True, slots=True)
class UcxSettings:
    """How one backend listens, how long its attempts may take, and how much it keeps in flight.

    ``timeout_s`` is the default deadline of an attempt (a hint's ``timeout_s`` overrides it);
    ``grace_s`` is how long rows already in flight may take to stop after a deadline, a cancel or
    a shutdown before the connection to that peer is forced closed (A8's bounded grace)."""

    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    advertise_host: str = ""
    timeout_s: float = 30.0
    grace_s: float = 1.0
    max_in_flight: int = 256
    window_bytes: int = 64 << 20
    max_pending_pulls: int = 1024
    max_connections: int = 1024
    net_devices: str = ""
    mode: str = "two-sided"
    spin_us: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")
        if not isinstance(self.listen_host, str) or not self.listen_host:
            raise ValueError(f"listen_host must be a host name or IP address, got {self.listen_host!r}")
        if not isinstance(self.advertise_host, str):
            raise ValueError(f"advertise_host must be a host name or IP address (or empty), got {self.advertise_host!r}")
        for name in ("listen_host", "advertise_host"):
            host = getattr(self, name)
            if host and not is_host(host):
                raise ValueError(f"{name} {host!r} is neither an IP address nor an ASCII host name (give an "
                                 "international name in its IDNA xn-- form)")
        if not self.advertise_host and self.listen_host in ("0.0.0.0", "::"):
            raise ValueError(f"listening on the wildcard {self.listen_host!r} needs advertise_host: the address "
                             "peers are given must name this host")
        if not isinstance(self.listen_port, int) or not 0 <= self.listen_port <= 65535:
            raise ValueError(f"listen_port must be 0..65535 (0 picks a free port), got {self.listen_port!r}")
        for name in ("timeout_s", "grace_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.spin_us, int) or isinstance(self.spin_us, bool) or not 0 <= self.spin_us <= 10_000_000:
            raise ValueError(f"spin_us must be an int from 0 to 10000000, got {self.spin_us!r}")
        for name in ("max_in_flight", "window_bytes", "max_pending_pulls", "max_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.net_devices, str):
            raise ValueError(f"net_devices must be a string, got {self.net_devices!r}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> UcxSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown kvwire-ucx option(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(options))


_DEFAULTS = UcxSettings()

OPTIONS: tuple[Option, ...] = (
    Option("listen_host", str, _DEFAULTS.listen_host,
           "address the control listener binds; peers connect to it (loopback by default)"),
    Option("listen_port", int, _DEFAULTS.listen_port, "control listener port; 0 picks a free one",
           minimum=0, maximum=65535),
    Option("advertise_host", str, _DEFAULTS.advertise_host,
           "host put in address() for peers to connect to; empty: listen_host"),
    Option("timeout_s", float, _DEFAULTS.timeout_s, "default deadline of an attempt; a hint's timeout_s wins",
           minimum=0.001),
    Option("grace_s", float, _DEFAULTS.grace_s,
           "after a deadline, cancel or shutdown: how long rows in flight may take before the connection is "
           "forced closed", minimum=0.001),
    Option("max_in_flight", int, _DEFAULTS.max_in_flight, "attempts that may be unfinished at once",
           minimum=1, maximum=1 << 20),
    Option("window_bytes", int, _DEFAULTS.window_bytes, "bytes a pull keeps posted for receiving at once",
           minimum=1),
    Option("max_pending_pulls", int, _DEFAULTS.max_pending_pulls,
           "pulls waiting for the serving holder before more are declined as busy", minimum=1),
    Option("max_connections", int, _DEFAULTS.max_connections, "control connections accepted at once",
           minimum=1),
    Option("net_devices", str, _DEFAULTS.net_devices,
           "UCX_NET_DEVICES for this backend's UCX context; empty: 'lo' when listening on loopback, else all"),
    Option("mode", str, _DEFAULTS.mode,
           "two-sided: rows move as tag messages into lent rows only; one-sided: pulls read the serving end's "
           "registered memory through NIXL (faster; exposes every registered region to peers: trusted clusters "
           "only; needs kvwire-ucx[nixl])", choices=MODES),
    Option("spin_us", int, _DEFAULTS.spin_us,
           "after a message or a submission, how long (us) the progress thread keeps polling for the next "
           "instead of sleeping: no wake-up per hop, at the cost of a busy core meanwhile; 0 (default) sleeps "
           "at once", minimum=0, maximum=10_000_000),
)


#: The contract version kvwire-ucx implements, a literal (docs/contract.md, Versions): the suite
#: checks the clauses of this version and of no later one; raised only after reading a newer
#: version's clauses and keeping them (kvwire.contract.CONTRACT_VERSION would claim each new one).
CONTRACT = (1, 3)


def capabilities_for(settings: UcxSettings, memory_kinds: frozenset[MemoryKind] = MEMORY_KINDS) -> Capabilities:
    """What a backend built with ``settings`` declares, reaching ``memory_kinds`` (DEVICE only
    where its UCX has the CUDA transports: :attr:`Engine.memory_kinds`)."""
    return Capabilities(
        contract_version=CONTRACT,
        fetch=True,
        publish=True,
        memory_kinds=memory_kinds,

        other_end=OtherEnd.PEER,
        content_addressed=True,
        max_in_flight=settings.max_in_flight,
        cancellation=True,
        protocols=frozenset({SERVE_PULLS, OFFER_PULLS}),
    )
