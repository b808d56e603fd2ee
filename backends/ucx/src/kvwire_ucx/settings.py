"""The options of a kvwire-ucx backend, as frozen data, their declarations for the registry, and
what a backend built with them declares (:func:`capabilities_for`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvwire.contract import Capabilities, MemoryKind
from kvwire.contract.capabilities import OFFER_PULLS, SERVE_PULLS, OtherEnd
from kvwire.registry.plugin import Option, check_options, option_field, options_of
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

    Each field declares its option once (:func:`~kvwire.registry.option_field`): the registry's
    :data:`OPTIONS` are made from these fields, and the constructor checks every field by those
    same options, so a value is refused alike, with the same message, whether it comes through
    the registry or is given here.

    ``timeout_s`` is the default deadline of an attempt (a hint's ``timeout_s`` overrides it);
    ``grace_s`` is how long rows already in flight may take to stop after a deadline, a cancel or
    a shutdown before the connection to that peer is forced closed (A8's bounded grace)."""

    listen_host: str = option_field(
        "127.0.0.1", "address the control listener binds; peers connect to it (loopback by default)")
    listen_port: int = option_field(0, "control listener port; 0 picks a free one", minimum=0, maximum=65535)
    advertise_host: str = option_field("", "host put in address() for peers to connect to; empty: listen_host")
    timeout_s: float = option_field(30.0, "default deadline of an attempt; a hint's timeout_s wins", minimum=0.001)
    grace_s: float = option_field(
        1.0, "after a deadline, cancel or shutdown: how long rows in flight may take before the connection is "
        "forced closed", minimum=0.001)
    max_in_flight: int = option_field(256, "attempts that may be unfinished at once", minimum=1, maximum=1 << 20)
    window_bytes: int = option_field(
        64 << 20, "bytes a pull keeps posted for receiving at once, counted as the receives rows of the smallest "
        "size would take (a run of rows adjacent at both ends is one receive)", minimum=1)
    max_pending_pulls: int = option_field(
        1024, "pulls waiting for the serving holder before more are declined as busy", minimum=1)
    max_connections: int = option_field(1024, "control connections accepted at once", minimum=1)
    net_devices: str = option_field(
        "", "UCX_NET_DEVICES for this backend's UCX context; empty: 'lo' when listening on loopback, else all")
    mode: str = option_field(
        "two-sided", "two-sided: rows move as tag messages into lent rows only; one-sided: pulls read the serving "
        "end's registered memory through NIXL (faster; exposes every registered region to peers: trusted clusters "
        "only; needs kvwire-ucx[nixl])", choices=MODES)
    spin_us: int = option_field(
        0, "after a message or a submission, how long (us) the progress thread keeps polling for the next instead "
        "of sleeping: no wake-up per hop, at the cost of a busy core meanwhile; 0 (default) sleeps at once",
        minimum=0, maximum=10_000_000)

    def __post_init__(self) -> None:
        check_options(self, OPTIONS, "ucx")  # types, choices and bounds: the registry's own checks
        if not self.listen_host:
            raise ValueError(f"listen_host must be a host name or IP address, got {self.listen_host!r}")
        for name in ("listen_host", "advertise_host"):
            host = getattr(self, name)
            if host and not is_host(host):
                raise ValueError(f"{name} {host!r} is neither an IP address nor an ASCII host name (give an "
                                 "international name in its IDNA xn-- form)")
        if not self.advertise_host and self.listen_host in ("0.0.0.0", "::"):
            raise ValueError(f"listening on the wildcard {self.listen_host!r} needs advertise_host: the address "
                             "peers are given must name this host")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> UcxSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown kvwire-ucx option(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(options))


#: The registry's declaration of the options: made from :class:`UcxSettings`'s fields, the one
#: source of their defaults, help, choices and bounds.
OPTIONS: tuple[Option, ...] = options_of(UcxSettings)


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
