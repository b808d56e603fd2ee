"""Checks on the test run itself, for every module under tests/."""

from __future__ import annotations

from importlib.metadata import version

import pytest

#: Tests that each keep an xdist worker busy for half a minute to five minutes, longest first
#: (seconds of a ``./dev.sh test`` run, -n 3, 29 min). ``--dist loadgroup`` hands out the
#: xdist groups first (largest first) and then single tests in collection order, so a long one
#: collected late starts late: the one-sided suite run started 1411 s into a 1755 s run and
#: ended it alone while the other two workers had finished. These go to the front of the
#: collection, so they start as the first workers free up; the rest keeps its order.
LONG_FIRST = (
    "tests/ucx/test_ucx_one_sided.py::test_the_conformance_suite_passes_in_the_one_sided_mode",  # 290
    "tests/runtime/test_hybrid_peer.py::test_the_one_sided_cases_in_their_own_process",  # 73
    "tests/runtime/test_worker_processes.py::test_a_sender_killed_mid_pull_fails_within_the_deadline",  # 57
    "tests/files/test_files_store.py::test_the_conformance_suite_passes_on_a_root_on_a_disk",  # 55
    "tests/conformance/test_runner.py::test_the_third_party_template_passes_with_one_command",  # 49
    "tests/cli/test_files_root.py::test_the_bench_of_files_runs_on_a_private_root_it_removes",  # 42
    "tests/frozen/test_frozen.py::test_a_frozen_plugin_passes_the_suite_of_its_version",  # 27-36 each
    "tests/conformance/test_variants.py::test_suite_passes_a_correct_backend_that_uses_a_freedom",  # 20-37 each
    "tests/runtime/test_worker_processes.py::test_pull_from_another_process_then_decode",  # 31
    "tests/reliability/test_load.py::test_a_thousand_pulls_from_eight_receivers",  # 30
    "tests/cli/test_bench.py::test_bench_at_80_columns_prints_whole_tables_and_writes_the_run",  # 28
    "tests/frozen/test_frozen.py::test_the_same_plugin_claiming_the_next_version_fails_its_clauses",  # 28
    "tests/ucx/test_ucx_one_sided.py::test_pushed_offer_cases",  # 26
)

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


def _long_rank(item: pytest.Item) -> int:
    for rank, prefix in enumerate(LONG_FIRST):
        if item.nodeid.startswith(prefix):
            return rank
    return len(LONG_FIRST)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The long tests of ``LONG_FIRST`` go first (a stable sort: every worker collects the same
    order, and the other tests keep theirs). And the check above, seen on a worker for a pair it
    does not know: a marked test without its group's suffix fails the run."""
    items.sort(key=_long_rank)
    if getattr(config.option, "loadgroup", False):
        ungrouped = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if ungrouped:
            raise pytest.UsageError(f"{len(ungrouped)} tests marked xdist_group are not grouped "
                                    f"(first: {ungrouped[0]})")
