"""The pytest plugin (entry point ``pytest11: kvwire``). Imports only pytest at load time, so an
environment without hypothesis still runs its own tests."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvwire", "kvwire conformance suite")
    group.addoption(
        "--kvwire-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the kvwire conformance suite against this installed backend (repeatable)",
    )
