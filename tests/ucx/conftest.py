"""Fixtures of the kvwire-ucx tests: backends that are always shut down, and holders that are
always stopped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvwire.holding import drain


@pytest.fixture
def make_backend() -> Iterator[Callable[..., Any]]:
    """Build a ``UcxBackend`` (options as keywords); every one is shut down after the test and
    must quiesce within a few seconds."""
    from kvwire.testing.require import backend_module

    backend_module("ucxx._lib.libucxx", "ucx", "ucxx-cu12==0.52.0")  # skips, or fails when the run requires ucx
    from kvwire_ucx.backend import UcxBackend

    built: list[UcxBackend] = []

    def build(**options: Any) -> UcxBackend:
        options.setdefault("timeout_s", 10.0)
        options.setdefault("grace_s", 0.5)
        backend = UcxBackend(**options)
        built.append(backend)
        return backend

    yield build
    stuck = []
    for backend in built:
        if drain(backend, 5.0, close=False):
            stuck.append(backend)
    assert not stuck, f"backends still touching memory after shutdown: {stuck}"


@pytest.fixture
def holders() -> Iterator[list[Any]]:
    """Serving holders to stop after the test (append them)."""
    started: list[Any] = []
    yield started
    for holder in started:
        holder.stop()
