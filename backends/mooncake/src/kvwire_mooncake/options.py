"""The options of the ``mooncake`` backend and the client settings they resolve to."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvwire.blob.options import STORE_OPTIONS
from kvwire.registry import ConfigError, Option

__all__ = ["OPTIONS", "ClientSettings", "MIN_SEGMENT_BYTES", "MASTER_ENV"]

#: Mooncake refuses a contributed segment smaller than this (``0``, contribute none, is fine).
MIN_SEGMENT_BYTES = 16 << 20
#: Where the master address is read from when the ``master`` option is empty (Mooncake's own).
MASTER_ENV = "MOONCAKE_MASTER"

OPTIONS: tuple[Option, ...] = (
    Option(
        "master", str, "",
        "host:port of a running mooncake_master. Empty: $MOONCAKE_MASTER if set, else the backend "
        "starts a private master on free loopback ports and stops it when closed (tests, demos).",
    ),
    Option("protocol", str, "tcp", "Mooncake transport between clients: tcp, or rdma where an RDMA NIC is present.",
           choices=("tcp", "rdma")),
    Option("rdma_devices", str, "", "RDMA devices for protocol rdma (e.g. 'mlx5_0,mlx5_1'); empty for tcp."),
    Option("metadata_server", str, "P2PHANDSHAKE",
           "Transfer-engine metadata: P2PHANDSHAKE (no service needed), or an http:// or etcd:// URL."),
    Option("local_hostname", str, "",
           "Address peers reach this client at. Empty: the local address that routes to the master "
           "(127.0.0.1 for a loopback master)."),
    Option("segment_bytes", int, 256 << 20,
           "Memory this client contributes to the store's pool: 0 (a pure client) or at least 16 MiB. "
           "Stored objects live in some client's segment and vanish when that client closes.",
           minimum=0),
    Option("segment_when", str, "registered",
           "When the client contributes its segment: 'registered', once the backend registers its first "
           "region (a backend that moves no rows, such as a vLLM scheduler's lookup-only one, then holds no "
           "objects: every object lives with a worker, where its readers on that worker copy it locally); "
           "'setup', at once, for a backend that only lends memory to the pool.",
           choices=("registered", "setup")),
    Option("local_buffer_bytes", int, 16 << 20,
           "Mooncake's staging buffer. Rows move zero-copy from registered memory and do not pass "
           "through it (measured with 0.3.13), so the default suffices for any row size.",
           minimum=0),
    *STORE_OPTIONS,  # timeout_s, max_in_flight, namespace: every blob store's (kvwire.blob.options)
    Option("check_existing", bool, True,
           "Ask which keys already exist before a put, to report them ALREADY_THERE (Mooncake's put of an "
           "existing key answers 0 and keeps the first object, moving no bytes). Costs one master round "
           "trip per store call (~0.1 ms for 16 keys, ~0.5 ms for 1024) and saves re-putting keys already "
           "stored; false: every stored key reports OK. Either way the first object's bytes stay and a "
           "publish marks the row held."),
    Option("workers", int, 2, "Threads that call the store.", minimum=1, maximum=64),
    Option("chunk_bytes", int, 64 << 20, "Bytes moved per store call at most.", minimum=1),
    Option("setup_retries", int, 2,
           "Connection attempts to the master, ~4.4 s each (Mooncake's default, 20, waits 90 s for an absent "
           "master). Sets MC_STORE_CLIENT_SETUP_RETRIES unless the environment already does.",
           minimum=1, maximum=100),
    Option("rpc_timeout_s", float, 10.0,
           "How long a call waits for a master that stopped answering (a hung master otherwise blocks "
           "forever). Sets MC_RPC_TIMEOUT_MS unless the environment already does.",
           minimum=0.1),
    Option("log_level", str, "ERROR", "Mooncake's own log level (MC_LOG_LEVEL unless the environment sets it).",
           choices=("INFO", "WARNING", "ERROR")),
)


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """What one Mooncake client is set up with. ``master`` empty means "start a private one"."""

    master: str = ""
    protocol: str = "tcp"
    rdma_devices: str = ""
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = ""
    segment_bytes: int = 256 << 20
    #: ``"setup"``: contribute the segment at setup; ``"registered"``: at the first registration.
    segment_when: str = "setup"
    local_buffer_bytes: int = 16 << 20
    setup_retries: int = 2
    rpc_timeout_s: float = 10.0
    log_level: str = "ERROR"

    def __post_init__(self) -> None:
        if 0 < self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ConfigError(
                f"option 'segment_bytes' of backend 'mooncake': {self.segment_bytes} is too small; "
                f"Mooncake needs 0 (contribute no memory) or at least {MIN_SEGMENT_BYTES} bytes"
            )
        if self.segment_when not in ("setup", "registered"):
            raise ConfigError(
                f"option 'segment_when' of backend 'mooncake': {self.segment_when!r} is neither 'setup' nor 'registered'"
            )
        if self.master and not _is_host_port(self.master):
            raise ConfigError(
                f"option 'master' of backend 'mooncake': {self.master!r} is not host:port "
                "(e.g. '127.0.0.1:50051')"
            )

    @classmethod
    def from_options(cls, options: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ClientSettings:
        """Settings from resolved backend options; an empty ``master`` falls back to
        ``$MOONCAKE_MASTER``."""
        env = os.environ if environ is None else environ
        master = options.get("master") or env.get(MASTER_ENV, "")
        return cls(
            master=master.strip(),
            protocol=options.get("protocol", "tcp"),
            rdma_devices=options.get("rdma_devices", ""),
            metadata_server=options.get("metadata_server", "P2PHANDSHAKE"),
            local_hostname=options.get("local_hostname", ""),
            segment_bytes=int(options.get("segment_bytes", 256 << 20)),
            segment_when=options.get("segment_when", "setup"),
            local_buffer_bytes=int(options.get("local_buffer_bytes", 16 << 20)),
            setup_retries=int(options.get("setup_retries", 2)),
            rpc_timeout_s=float(options.get("rpc_timeout_s", 10.0)),
            log_level=options.get("log_level", "ERROR"),
        )

    def hostname_for(self, master: str) -> str:
        """``local_hostname``, or the local address that routes to ``master``."""
        if self.local_hostname:
            return self.local_hostname
        host = master.rsplit(":", 1)[0].strip("[]")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))  # a UDP connect sends nothing; it only picks a route
                return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"

    def environment(self) -> dict[str, str]:
        """The ``MC_*`` variables these settings ask for (the client reads them at setup)."""
        return {
            "MC_STORE_CLIENT_SETUP_RETRIES": str(self.setup_retries),
            "MC_RPC_TIMEOUT_MS": str(max(1, round(self.rpc_timeout_s * 1000))),
            "MC_LOG_LEVEL": self.log_level,
        }


def _is_host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
