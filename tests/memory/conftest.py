from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kvwire_memory import forget_store


@pytest.fixture
def store_name() -> Iterator[str]:
    """A process-wide store name of this test's own, forgotten afterwards."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    forget_store(name)
