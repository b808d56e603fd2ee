"""Discovery through real distributions: a working plugin, a broken one, one of another contract
major. They are built and installed (with pip, as real dist-info) into a throwaway target folder
that only the subprocesses of these tests put on their path, so the shared venv never changes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvwire.contract import CONTRACT_VERSION

GOOD = '''
from kvwire.contract import CONTRACT_VERSION, MemoryKind, Capabilities
from kvwire.contract.capabilities import OtherEnd
from kvwire.registry import Option, Plugin

CAPS = Capabilities(CONTRACT_VERSION, True, False, frozenset({MemoryKind.HOST}), OtherEnd.STORE, True, 4, False)

def _create(options):
    raise RuntimeError("not needed by these tests")

plugin = Plugin("good", CONTRACT_VERSION, CAPS, _create,
                options=(Option("size", int, 8, "rows", minimum=1),
                         Option("mode", str, "fast", "how", choices=("fast", "safe"))))
'''

BROKEN = '''
raise ImportError("libfoo.so.1: cannot open shared object file")
'''

FUTURE = '''
from kvwire.contract import MemoryKind, Capabilities
from kvwire.contract.capabilities import OtherEnd
from kvwire.registry import Plugin
plugin = Plugin("future", (2, 0), Capabilities((2, 0), True, True, frozenset({MemoryKind.HOST}), OtherEnd.PEER, True, 1, True),
                lambda options: None)
'''

NEWER = '''
from kvwire.contract import MemoryKind, Capabilities
from kvwire.contract.capabilities import OtherEnd
from kvwire.registry import Plugin
plugin = Plugin("newer", (1, 99), Capabilities((1, 99), True, True, frozenset({MemoryKind.HOST}), OtherEnd.PEER, True, 1,
                True), lambda options: None)
'''

TWOFACED = '''
from kvwire.contract import MemoryKind, Capabilities
from kvwire.contract.capabilities import OtherEnd
from kvwire.registry import Plugin
plugin = Plugin("twofaced", (1, 0), Capabilities((1, 1), True, True, frozenset({MemoryKind.HOST}), OtherEnd.PEER, True, 1,
                True), lambda options: None)
'''


def _project(root: Path, dist: str, module: str, name: str, source: str) -> Path:
    proj = root / dist
    (proj / module).mkdir(parents=True)
    (proj / module / "__init__.py").write_text(textwrap.dedent(source))
    (proj / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{dist}"
        version = "1.2.3"
        [project.entry-points."kvwire.backends"]
        {name} = "{module}:plugin"
        [tool.setuptools]
        packages = ["{module}"]
    """))
    return proj


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dists")
    projects = [
        _project(root, "kvwire-good", "kvwire_good", "good", GOOD),
        _project(root, "kvwire-broken", "kvwire_broken", "broken", BROKEN),
        _project(root, "kvwire-future", "kvwire_future", "future", FUTURE),
        _project(root, "kvwire-newer", "kvwire_newer", "newer", NEWER),
        _project(root, "kvwire-twofaced", "kvwire_twofaced", "twofaced", TWOFACED),
    ]
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), *map(str, projects)],
        check=True,
    )
    return target


def run(site: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(site), COLUMNS="200")
    cmd = [sys.executable, "-c", textwrap.dedent(code), *args] if code else [sys.executable, "-m", "kvwire.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_listing_imports_no_plugin(site):
    r = run(site, """
        import sys
        from kvwire.registry import available
        names = {e.name: e for e in available()}
        assert {"good", "broken", "future"} <= set(names), names
        assert names["good"].distribution == "kvwire-good" and names["good"].version == "1.2.3"
        loaded = [m for m in sys.modules if m.startswith("kvwire_")]
        assert not loaded, loaded
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_loading_imports_only_the_one_asked_for(site):
    r = run(site, """
        import sys
        from kvwire.registry import load
        p = load("good")
        assert p.name == "good"
        loaded = sorted(m for m in sys.modules if m.startswith("kvwire_"))
        assert loaded == ["kvwire_good"], loaded
        assert load("good") is p   # cached
        print("ok")
    """)
    assert r.returncode == 0, r.stderr


def test_broken_plugin_is_explained_and_the_others_still_load(site):
    r = run(site, """
        from kvwire.registry import load, survey, PluginError
        try:
            load("broken")
        except PluginError as exc:
            msg = str(exc)
        else:
            raise SystemExit("no error")
        assert "kvwire-broken" in msg and "libfoo.so.1" in msg, msg
        rows = {row.entry.name: row for row in survey()}
        assert rows["broken"].plugin is None and "kvwire-broken" in rows["broken"].problem
        assert rows["good"].plugin is not None and rows["good"].problem is None
        print("ok")
    """)
    assert r.returncode == 0, r.stderr


def test_other_contract_major_is_refused_with_a_clear_error(site):
    r = run(site, """
        from kvwire.registry import load, PluginError
        try:
            load("future")
        except PluginError as exc:
            print(exc)
        else:
            raise SystemExit("accepted a contract 2 plugin")
    """)
    assert r.returncode == 0, r.stderr
    assert "contract 2.0" in r.stdout and f"{CONTRACT_VERSION[0]}.{CONTRACT_VERSION[1]}" in r.stdout and "kvwire-future" in r.stdout


def test_a_newer_minor_or_two_versions_are_refused_naming_both(site):
    """Versions: a plugin written for a newer minor than this kvwire's, or declaring one version in
    its Plugin and another in its capabilities, is refused with both versions named."""
    r = run(site, """
        from kvwire.registry import load, PluginError
        for name in ("newer", "twofaced"):
            try:
                load(name)
            except PluginError as exc:
                print(exc)
            else:
                raise SystemExit(f"accepted {name}")
    """)
    assert r.returncode == 0, r.stderr
    newer, twofaced = r.stdout.strip().splitlines()
    assert "contract 1.99" in newer and "newer than this kvwire's" in newer and "kvwire-newer" in newer
    assert "{}.{}".format(*CONTRACT_VERSION) in newer
    assert "1.0 in its Plugin but 1.1 in its capabilities" in twofaced


def test_cli_backends_lists_all_and_explains_broken_without_traceback(site):
    r = run(site, "", "backends")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for name in ("good", "broken", "future", "kvwire-good"):
        assert name in out
    assert "libfoo.so.1" in out and "speaks contract 2.0" in out
    assert "Traceback" not in out + r.stderr


def test_options_are_validated_and_explained(site):
    r = run(site, """
        from kvwire.registry import load, ConfigError
        p = load("good")
        assert p.resolve({"size": "12"}) == {"size": 12, "mode": "fast"}
        for bad, needle in (({"size": 0}, "'size'"), ({"size": "x"}, "not a int"),
                            ({"mode": "slow"}, "one of 'fast', 'safe'"), ({"colour": 1}, "no option 'colour'")):
            try:
                p.resolve(bad)
            except ConfigError as exc:
                assert needle in str(exc), (needle, str(exc))
            else:
                raise SystemExit(f"accepted {bad}")
        print("ok")
    """)
    assert r.returncode == 0, r.stderr + r.stdout
