"""The conformance harness of the Mooncake backend (entry point ``kvwire.harnesses: mooncake``).

One ``mooncake_master`` on free loopback ports serves the whole test session, with a pool of
clients: setting a client up is cheap, but closing one takes 1-2 s, far too slow for one per
test. Every end gets a client no other live end uses (as every backend the plugin builds has
its own), so the two ends of a pair talk through the transfer engine, and memory registered
with two ends is registered with two clients. Each pair's store is a key prefix of its own,
dropped (objects removed, leases or not) when the pair closes. The master and the clients stop
at interpreter exit.

Run the suite with::

    pytest --pyargs kvwire.testing.suite --kvwire-backend mooncake"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwire.blob import BatchResult, StoreDriver
from kvwire.testing.harness import Unavailable
from kvwire.testing.stores import StoreHarness
from kvwire_mooncake.driver import MooncakeDriver
from kvwire_mooncake.library import problem
from kvwire_mooncake.master import MasterProcess
from kvwire_mooncake.options import ClientSettings

__all__ = ["harness", "MooncakeHarness"]

log = logging.getLogger(__name__)

#: Each client's share of the pool: more than the 32 MiB the suite may store through one pair.
SEGMENT_BYTES = 64 << 20
_PREFIX = "kvwire-conformance"


class _PairDriver(MooncakeDriver):
    """A driver over a pooled client for one end of one pair: every key lives under the pair's
    prefix, and closing it unregisters its regions and hands the client back to the pool."""

    def __init__(self, slot: MooncakeDriver, prefix: str, release: Any) -> None:
        super().__init__(slot.client, master=slot.master, close_client=False)
        self._prefix = prefix
        self._release = release
        self._slot = slot

    def _scoped(self, keys: Sequence[str]) -> list[str]:
        prefix = self._prefix
        return [prefix + key for key in keys]

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return super().put(self._scoped(keys), addresses, sizes)

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return super().get_into(self._scoped(keys), addresses, sizes)

    def put_parts(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return super().put_parts(self._scoped(keys), addresses, sizes)

    def get_parts_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return super().get_parts_into(self._scoped(keys), addresses, sizes)

    def exists(self, keys: Sequence[str]) -> np.ndarray:
        return super().exists(self._scoped(keys))

    def contains(self, keys: Sequence[str]) -> BatchResult:
        return super().contains(self._scoped(keys))

    def remove(self, keys: Sequence[str]) -> BatchResult:
        return super().remove(self._scoped(keys))

    def close(self) -> None:
        try:
            super().close()
        finally:
            release, self._release = self._release, None
            if release is not None:
                release(self._slot)


class MooncakeHarness(StoreHarness):
    name = "mooncake"
    #: An attempt concludes at its deadline at once and quiesces when the chunk inside the client
    #: returns: one transfer of at most ``chunk_bytes`` (milliseconds on loopback).
    quiesce_grace_s = 5.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._master: MasterProcess | None = None
        self._free: list[MooncakeDriver] = []
        self._busy: list[MooncakeDriver] = []
        self._stores = itertools.count(1)

    # -- the session: one master, a pool of clients ---------------------------------------------

    def _master_address(self) -> str:
        with self._lock:
            if self._master is None:
                reason = problem()
                if reason:
                    raise Unavailable(f"the Mooncake library cannot load here: {reason}")
                os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
                self._master = MasterProcess(lease_ttl_ms=1000).start()
                atexit.register(self.stop)
            return self._master.address

    def _take(self) -> MooncakeDriver:
        address = self._master_address()
        with self._lock:
            if self._free:
                slot = self._free.pop()
                self._busy.append(slot)
                return slot
        slot = MooncakeDriver.connect(ClientSettings(master=address, segment_bytes=SEGMENT_BYTES, setup_retries=1))
        with self._lock:
            self._busy.append(slot)
        return slot

    def _give_back(self, slot: MooncakeDriver) -> None:
        with self._lock:
            if slot in self._busy:
                self._busy.remove(slot)
                self._free.append(slot)

    def finish(self) -> None:
        self.stop()

    def stop(self) -> None:
        """Close every pooled client (at once: each takes 1-2 s), then the master; clients
        first, since a client whose master is gone takes ~11 s to close. Idempotent."""
        with self._lock:
            slots, self._free, self._busy = self._free + self._busy, [], []
            master, self._master = self._master, None
        closers = [threading.Thread(target=slot.close, name="kvwire-mooncake-harness-close") for slot in slots]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join()
        if master is not None:
            master.stop()

    # -- StoreHarness ---------------------------------------------------------------------------

    def new_store(self) -> str:
        self._master_address()
        return f"{_PREFIX}/{next(self._stores)}/"

    def driver(self, store: Any) -> StoreDriver:
        return _PairDriver(self._take(), str(store), self._give_back)

    def drop_store(self, store: Any) -> None:
        with self._lock:
            slots = self._free + self._busy
        if not slots:
            return
        removed = slots[0].client.remove_by_regex("^" + re.escape(str(store)), True)
        if removed < 0:
            log.warning("dropping conformance store %s: remove_by_regex answered %d", store, removed)


harness = MooncakeHarness()
