from __future__ import annotations

import uuid

import pytest
from kvwire_memory import MemoryDriver, MemoryStore

from kvwire.blob import BlobBackend
from kvwire.testing.faults import FaultyDriver


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore(1 << 30)


@pytest.fixture
def make_backend():
    """Build blob backends that are closed (and their blocked drivers released) at teardown."""
    made: list[BlobBackend] = []

    def make(driver, **options) -> BlobBackend:
        backend = BlobBackend(driver, **options)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        if isinstance(backend.driver, FaultyDriver):
            backend.driver.release_all()
        backend.close(timeout_s=5.0)


@pytest.fixture
def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def driver(store: MemoryStore) -> MemoryDriver:
    return MemoryDriver(store)
