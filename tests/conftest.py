"""Checks on the test run itself, for every module under tests/."""

from __future__ import annotations

from importlib.metadata import version

import pytest

_BROKEN_PAIR = ("pytest 9.2 keeps node ids where pytest-xdist 3.8 cannot add its '@group' suffix, "
                "so --dist loadgroup silently stops grouping; scripts/bootstrap.sh pins pytest<9.2")


def _release(name: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version(name).split(".")[:2] if p.isdigit())


def pytest_configure(config: pytest.Config) -> None:
    """Under ``--dist loadgroup`` the tests of one ``xdist_group`` must share a worker: the
    vLLM modules' engines must not run two at once, and a module-wide check must see all of
    its module's cases. A pytest/xdist pair that cannot group makes a broken run, so it stops
    before it starts, with the cause."""
    if getattr(config.option, "dist", "no") == "loadgroup" \
            and _release("pytest") >= (9, 2) and _release("pytest-xdist") <= (3, 8):
        raise pytest.UsageError(f"pytest {version('pytest')} with pytest-xdist "
                                f"{version('pytest-xdist')}: {_BROKEN_PAIR}")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The same, seen on a worker for a pair the check above does not know: a marked test
    without its group's suffix fails the run."""
    if getattr(config.option, "loadgroup", False):
        ungrouped = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if ungrouped:
            raise pytest.UsageError(f"{len(ungrouped)} tests marked xdist_group are not grouped "
                                    f"(first: {ungrouped[0]})")
