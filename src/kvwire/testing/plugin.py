"""The pytest plugin (entry point ``pytest11: kvwire``). Imports only pytest at load time, so an
environment without hypothesis still runs its own tests, and it changes nothing in a test run
that does not use the suite.

Run the suite against an installed backend::

    pytest --pyargs kvwire.testing.suite --kvwire-backend NAME [--kvwire-profile thorough]

Options: ``--kvwire-backend NAME`` (repeatable; default: every installed backend with a
harness), ``--kvwire-harness module:object`` (a harness not installed as a distribution),
``--kvwire-profile quick|thorough``, ``--kvwire-require NAME[,NAME...]`` (backends that must load:
a run fails before any test when one cannot, and tests needing its library fail instead of
skipping), ``--kvwire-patience SECONDS`` (how long to wait for a change
a backend owes), ``--kvwire-no-shrink`` (report failing examples unshrunk), ``--kvwire-report
PATH`` (a JSON record of every suite test, for tools).

Fixtures: ``kvwire_target`` (parametrized, one per backend), ``kvwire_harness`` (its
:class:`~kvwire.testing.harness.Harness`), ``kvwire_profile`` (the active profile)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

_SUITE_HINTS = ("kvwire.testing", "kvwire/testing")
_TARGETS = pytest.StashKey[list]()
_RESULTS = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvwire", "kvwire conformance suite")
    group.addoption(
        "--kvwire-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the kvwire conformance suite against this installed backend (repeatable)",
    )
    group.addoption(
        "--kvwire-harness",
        action="append",
        default=[],
        metavar="MODULE:OBJECT",
        help="also run the suite against the harness named by module:object or path/to/file.py:object",
    )
    group.addoption(
        "--kvwire-profile",
        default=os.environ.get("KVWIRE_PROFILE", "quick"),
        choices=("quick", "thorough"),
        help="quick (a developer's run, default) or thorough (CI)",
    )
    group.addoption(
        "--kvwire-patience",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long the suite waits for a change a backend owes before failing (default: the profile's)",
    )
    group.addoption(
        "--kvwire-no-shrink",
        action="store_true",
        default=False,
        help="report a failing example as found, without shrinking it (faster; for testing the suite itself)",
    )
    group.addoption(
        "--kvwire-require",
        action="append",
        default=[],
        metavar="NAME[,NAME...]",
        help="fail the run, before any test, when one of these backends cannot load or be tested "
             "(also KVWIRE_REQUIRE); tests that need its library fail instead of skipping",
    )
    group.addoption(
        "--kvwire-report",
        default=None,
        metavar="PATH",
        help="write a JSON record of every suite test (rule, backend, outcome, skip reason) to PATH",
    )


def _uses_suite(config: pytest.Config) -> bool:
    opt = config.option
    if opt.kvwire_backend or opt.kvwire_harness or opt.kvwire_report:
        return True
    return any(any(h in str(arg) for h in _SUITE_HINTS) for arg in config.args)


def pytest_configure(config: pytest.Config) -> None:
    from kvwire.testing import profiles

    profiles.activate(config.option.kvwire_profile, config.option.kvwire_patience,
                      shrink=not config.option.kvwire_no_shrink)
    if config.option.kvwire_report:
        config.stash[_RESULTS] = {}
    from kvwire.testing import require

    names = require.parse(config.option.kvwire_require)
    require.set_required(names)
    if names:
        found = require.problems(names)
        if found:
            raise pytest.UsageError("kvwire: " + "\nkvwire: ".join(found))
    if config.option.kvwire_backend or config.option.kvwire_harness:
        _targets(config)  # a backend asked for by name that cannot be tested is a usage error


def _targets(config: pytest.Config) -> list[Any]:
    if _TARGETS not in config.stash:
        from kvwire.testing.targets import select_targets

        try:
            config.stash[_TARGETS] = select_targets(config.option.kvwire_backend, config.option.kvwire_harness)
        except (ValueError, TypeError, ImportError) as exc:
            raise pytest.UsageError(str(exc)) from None
    return config.stash[_TARGETS]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvwire_target" not in metafunc.fixturenames:
        return
    targets = _targets(metafunc.config)
    if not targets:
        metafunc.parametrize("kvwire_target", [pytest.param(None, marks=pytest.mark.skip(
            reason="no installed backend registers a conformance harness (entry-point group kvwire.harnesses)"))],
            ids=["no-backend"], scope="session")
        return
    metafunc.parametrize("kvwire_target", targets, ids=[t.name for t in targets], scope="session")


@pytest.fixture(scope="session")
def kvwire_harness(kvwire_target: Any) -> Any:
    """The harness of the backend under test."""
    if kvwire_target.problem is not None:
        pytest.fail(f"backend {kvwire_target.name!r} ({kvwire_target.origin}): {kvwire_target.problem}",
                    pytrace=False)
    return kvwire_target.harness


#: A clause id as a suite test's docstring names it ("A8.2").
_CLAUSE_ID = re.compile(r"\b([A-Z][0-9]+\.[0-9]+)\b")


def named_clauses(function: Any) -> list[str]:
    """The clauses a suite test is about, which gate it by version and protocol: those it is
    marked with (``@checks(...)``, :mod:`kvwire.testing.marks`; not its ``also`` clauses). A test
    without the mark (one of a plugin's own, say) falls back to those its docstring's first line
    names before its first ``": "`` (``"A8.1 / A8.2: ..."``)."""
    marked = getattr(function, "kvwire_checks", None)
    if marked is not None:
        return list(marked)
    doc = (getattr(function, "__doc__", None) or "").strip()
    if not doc:
        return []
    head, colon, _ = doc.splitlines()[0].partition(": ")
    return _CLAUSE_ID.findall(head) if colon else []


@pytest.fixture(autouse=True)
def _kvwire_clauses_in_force(request: pytest.FixtureRequest) -> None:
    """Skip a suite test that checks a clause the backend's declared version does not bind
    (docs/contract.md, Versions): a backend is checked against the clauses of the version it
    declares, never later ones."""
    if "kvwire_harness" not in request.fixturenames or request.function is None:
        return
    named = named_clauses(request.function)
    if not named:
        return
    harness = request.getfixturevalue("kvwire_harness")
    try:
        caps = harness.capabilities()
    except Exception:  # B4's tests report a backend whose capabilities cannot be read
        return
    from kvwire.contract.clauses import binds, clause

    for clause_id in named:
        found = clause(clause_id)
        if found.protocol is not None and found.protocol not in caps.protocols:
            pytest.skip(f"backend does not declare the {found.protocol} protocol ({clause_id})")
        if not binds(caps, clause_id):
            declared = ".".join(map(str, caps.contract_version))
            pytest.skip(f"{clause_id} arrived in contract {found.since[0]}.{found.since[1]}; the backend declares "
                        f"contract {declared}")


@pytest.fixture(scope="session")
def kvwire_profile() -> Any:
    """The active :class:`~kvwire.testing.profiles.Profile`."""
    from kvwire.testing import profiles

    return profiles.active()


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not _uses_suite(config):
        return None
    from kvwire import __version__
    from kvwire.contract import CONTRACT_VERSION
    from kvwire.testing import profiles

    profile = profiles.active()
    lines = [f"kvwire {__version__}, contract {CONTRACT_VERSION[0]}.{CONTRACT_VERSION[1]}, profile {profile.name} "
             f"({profile.examples} examples per property, patience {profile.patience_s:g} s)"]
    try:
        targets = _targets(config)
    except pytest.UsageError as exc:
        return lines + [f"kvwire: {exc}"]
    if not targets:
        lines.append("kvwire backends: none installed with a conformance harness")
    for target in targets:
        if target.problem is not None:
            lines.append(f"kvwire backend {target.name}: {target.problem}")
            continue
        try:
            caps = target.harness.capabilities()
            dist = target.harness.distribution()
        except Exception as exc:  # the tests will fail with the same cause; the header says it once
            lines.append(f"kvwire backend {target.name}: capabilities unavailable: {type(exc).__name__}: {exc}")
            continue
        version = f"{caps.contract_version[0]}.{caps.contract_version[1]}"
        lines.append(f"kvwire backend {target.name}: {dist}, speaks contract {version}; {caps.summary()}")
    return lines


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if _results is None:
        return
    for item in items:
        callspec = getattr(item, "callspec", None)
        target = callspec.params.get("kvwire_target") if callspec is not None else None
        _results[item.nodeid] = {
            "test": getattr(item, "originalname", item.name),
            "backend": getattr(target, "name", "") or "",
            "outcome": "passed", "reason": "", "duration": 0.0,
        }


#: A failure message names the clause it enforces first: "A7: ...", "S3.1/H1: ...".
_BROKEN = re.compile(r"^\s*(?:AssertionError: )?((?:[AMVHSWBNLKO][0-9]{1,2})(?:\.[0-9]+)?)(?=[:/ ])")


def _failures(exc: BaseException) -> list[BaseException]:
    """The leaf exceptions of ``exc``: a hypothesis ``ExceptionGroup`` holds one per distinct
    failing example."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _failures(inner)]
    return [exc]


def broken_rules(exc: BaseException) -> tuple[list[str], str]:
    """The clauses a suite failure names (from each leaf's message) and the first leaf's
    message, so a report says which rule broke even when a test of another rule tripped on it."""
    rules: list[str] = []
    first = ""
    for leaf in _failures(exc):
        text = str(leaf).strip()
        if not first and text:
            first = f"{type(leaf).__name__}: {text.splitlines()[0]}" if not isinstance(leaf, AssertionError) \
                else text.splitlines()[0]
        match = _BROKEN.match(text)
        if match and match.group(1) not in rules:
            rules.append(match.group(1))
    return rules, first


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if call.excinfo is None or not report.failed or "kvwire_target" not in getattr(item, "fixturenames", ()):
        return
    rules, first = broken_rules(call.excinfo.value)
    report.user_properties.append(("kvwire_rules", rules))
    report.user_properties.append(("kvwire_reason", first))
    test_rule = item.name.removeprefix("test_").split("_")[0]
    if rules:
        where = "" if rules[0].split(".")[0] == test_rule else f" (found by {getattr(item, 'originalname', item.name)})"
        report.sections.append(("kvwire: rule broken", f"{', '.join(rules)}{where}: {first}"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    results = _results
    if results is None:
        return
    entry = results.setdefault(report.nodeid, {"test": report.nodeid.split("::")[-1].split("[")[0], "backend": "",
                                               "outcome": "passed", "reason": "", "duration": 0.0})
    entry["duration"] += report.duration
    if report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        entry["reason"] = reason.removeprefix("Skipped: ")
    elif report.failed:
        entry["outcome"] = "failed"
        props: dict[str, Any] = dict(report.user_properties)  # values: what the suite's tests recorded
        entry["reason"] = props.get("kvwire_reason") or _first_line(report.longreprtext)
        entry["broken"] = list(props.get("kvwire_rules", []))


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("E "):
            return line[1:].strip()[:300]
    return text.strip().splitlines()[-1][:300] if text.strip() else ""


_results: dict[str, Any] | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    global _results
    _results = session.config.stash.get(_RESULTS, None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _results
    # Harnesses end their session-wide servers and clients here, before the summary is printed,
    # so that nothing they log lands after it.
    for target in session.config.stash.get(_TARGETS, []):
        if target.harness is not None:
            try:
                target.harness.finish()
            except Exception as exc:  # a harness that fails to finish must not hide the results
                session.config.get_terminal_writer().line(f"kvwire: harness {target.name!r} failed to finish: {exc}")
    path = session.config.option.kvwire_report
    if not path or _results is None:
        return
    rows = [{"nodeid": nodeid, **entry} for nodeid, entry in _results.items() if entry["duration"] or
            entry["outcome"] != "passed"]
    Path(path).write_text(json.dumps({"exitstatus": int(exitstatus), "tests": rows}, indent=1))
    _results = None
