"""Fixtures for the Mooncake backend's tests: real ``mooncake_master`` processes on free loopback
ports, started once per session (a client's ``close()`` costs 1-2 s, so clients are shared too),
and stopped afterwards."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest
from kvwire_mooncake.driver import MooncakeDriver
from kvwire_mooncake.library import problem as library_problem
from kvwire_mooncake.master import MasterProcess
from kvwire_mooncake.options import ClientSettings
from mooncake_support import Rows

# Before any client exists: quiet glog, fail fast against an absent master, and bound how long a
# call waits for a master that stopped answering.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
os.environ.setdefault("MC_RPC_TIMEOUT_MS", "3000")

@pytest.fixture(scope="session")
def mooncake_ready() -> None:
    problem = library_problem()
    if problem:
        pytest.skip(f"the Mooncake library cannot load here: {problem}")


@pytest.fixture(scope="session")
def master(mooncake_ready: None) -> Iterator[MasterProcess]:
    """One master for the session's shared clients (reads lease objects for 1 s)."""
    with MasterProcess(lease_ttl_ms=1000) as process:
        yield process


@pytest.fixture(scope="session")
def settings(master: MasterProcess) -> ClientSettings:
    return ClientSettings(master=master.address, segment_bytes=64 << 20, setup_retries=1)


@pytest.fixture(scope="session")
def driver(settings: ClientSettings) -> Iterator[MooncakeDriver]:
    d = MooncakeDriver.connect(settings)
    yield d
    d.close()


@pytest.fixture(scope="session")
def other_driver(settings: ClientSettings) -> Iterator[MooncakeDriver]:
    """A second client of the same master, as another worker would hold."""
    d = MooncakeDriver.connect(settings)
    yield d
    d.close()


@pytest.fixture
def rows_factory(request: pytest.FixtureRequest) -> Callable[..., Rows]:
    """Rows registered with a driver for one test, unregistered afterwards."""

    def make(driver: MooncakeDriver, slot_bytes: int, slot_count: int) -> Rows:
        rows = Rows(slot_bytes, slot_count)
        driver.register([rows.region])
        request.addfinalizer(lambda: driver.unregister([rows.region]))
        return rows

    return make


_keys = iter(range(1 << 40))


@pytest.fixture
def keys() -> Callable[[int], list[str]]:
    """Fresh keys no other test uses."""
    prefix = f"t{os.getpid()}-{time.monotonic_ns()}"

    def make(n: int) -> list[str]:
        return [f"{prefix}/{next(_keys)}" for _ in range(n)]

    return make
