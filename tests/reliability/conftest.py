"""Fixtures of the reliability tests on simulated hosts (``hosts.py``): a network of namespaces
per module, removed afterwards also when a test fails; tests that need one skip, saying why, on a
machine that refuses namespaces (not root, no ``ip``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hosts import Network, namespaces_problem

_problem: list[str | None] = []


def hosts_problem() -> str | None:
    """Why simulated hosts cannot be made here, asked once per run."""
    if not _problem:
        _problem.append(namespaces_problem())
    return _problem[0]


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    """Three simulated hosts (h0, h1, h2) for the module's tests."""
    problem = hosts_problem()
    if problem:
        pytest.skip(f"simulated hosts are not available here: {problem}")
    with Network(3) as net:
        yield net
