"""Selecting a backend by name plus options from a TOML file and the environment."""

from __future__ import annotations

import pytest

from kvwire.registry import ConfigError, load, load_config


def write(tmp_path, text):
    path = tmp_path / "kvwire.toml"
    path.write_text(text)
    return path


def test_defaults_to_the_embedded_memory_backend():
    cfg = load_config(environ={}, validate=False)
    assert cfg.name == "memory" and dict(cfg.options) == {}


def test_file_then_environment_then_argument(tmp_path):
    path = write(tmp_path, '[backend]\nname = "alpha"\n[backend.options]\nsize = 3\n')
    cfg = load_config(path, environ={}, validate=False)
    assert (cfg.name, dict(cfg.options)) == ("alpha", {"size": 3})
    cfg = load_config(path, environ={"KVWIRE_BACKEND_SIZE": "5"}, validate=False)
    assert dict(cfg.options) == {"size": "5"}
    cfg = load_config(environ={"KVWIRE_CONFIG": str(path), "KVWIRE_BACKEND": "beta"}, validate=False)
    assert cfg.name == "beta" and dict(cfg.options) == {}  # the file's options were alpha's
    assert load_config(path, environ={}, backend="gamma", validate=False).name == "gamma"


@pytest.mark.parametrize("text,needle", [
    ("[backend\n", "not valid TOML"),
    ("[bakend]\nname='x'\n", "unknown section [bakend]"),
    ("[backend]\nnmae='x'\n", "unknown key backend.nmae"),
    ("[backend]\nname=3\n", "'backend.name' must be a string"),
    ("[backend]\noptions=3\n", "'backend.options' must be a table"),
])
def test_bad_files_name_the_problem(tmp_path, text, needle):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), environ={}, validate=False)
    assert needle in str(info.value)


def test_missing_file_and_unknown_backend(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})
    with pytest.raises(ConfigError, match="unknown backend 'nope'; installed backends:"):
        load_config(environ={"KVWIRE_BACKEND": "nope"})


# --- fuzzing: any file or environment gives a config or a ConfigError, never anything else -----

import json  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_values = st.one_of(st.integers(-10, 1 << 40), st.text(max_size=12), st.booleans(), st.floats(allow_nan=True))
_keys = st.sampled_from(["capacity_bytes", "eviction", "timeout_s", "max_in_flight", "namespace", "store", "bogus"])


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return repr(value) if value == value else "nan"


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(text=st.text(max_size=200))
def test_any_file_text_gives_a_config_or_a_config_error(tmp_path, text):
    try:
        load_config(write(tmp_path, text), environ={})
    except ConfigError as exc:
        assert str(exc)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(options=st.dictionaries(_keys, _values, max_size=4), env=st.dictionaries(_keys, st.text(max_size=10), max_size=3))
def test_any_options_give_validated_values_or_a_config_error_naming_the_key(tmp_path, options, env):
    body = "[backend]\nname = \"memory\"\n[backend.options]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in options.items())
    environ = {f"KVWIRE_BACKEND_{k.upper()}": v for k, v in env.items()}
    try:
        cfg = load_config(write(tmp_path, body), environ=environ)
    except ConfigError as exc:
        assert any(k in str(exc) for k in (*options, *env)) or "TOML" in str(exc), str(exc)
    else:
        resolved = cfg.resolved()
        assert set(resolved) >= {"capacity_bytes", "eviction", "timeout_s", "max_in_flight", "namespace", "store"}



@pytest.mark.parametrize(("backend", "options", "needle"), [
    ("memory", {"timeout_s": float("nan")}, "timeout_s"),
    ("memory", {"timeout_s": "inf"}, "timeout_s"),
    ("ucx", {"timeout_s": float("-inf")}, "timeout_s"),
    ("files", {"root": ""}, "root"),
    ("files", {"root": "   "}, "root"),
    ("example", {"namespace": "/starts-with-a-slash"}, "namespace"),
    ("example", {"max_in_flight": 2**70}, "max_in_flight"),
    ("mooncake", {"max_in_flight": 2**70}, "max_in_flight"),
    ("ucx", {"listen_host": "0.0.0.0"}, "advertise_host"),
])
def test_values_a_backend_cannot_use_are_config_errors_naming_them(tmp_path, monkeypatch, backend, options, needle):
    """A number that is not finite (NaN passes every range check), an empty store directory (it
    would be the current one), a namespace the plugin's own check refuses, a queue bound no
    machine can hold, options that contradict each other: each is a ConfigError naming the
    option, raised by build() before anything is made (no store files in the working directory)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=needle):
        load(backend).build(options)
    assert not list(tmp_path.iterdir()), f"building {backend} with {options} left {list(tmp_path.iterdir())}"


# --- files that cannot be read or decoded ------------------------------------------------------


def _file(directory, name, data):
    path = directory / name
    path.write_bytes(data)
    return path


def _loop(path):
    path.symlink_to(path.name)
    return path


@pytest.mark.parametrize(("make", "needle"), [
    (lambda d: d, "is a directory"),
    (lambda d: _file(d, "latin1.toml", b'[backend]\nname = "caf\xe9"\n'), "is not UTF-8 text (byte 21"),
    (lambda d: _file(d, "utf16.toml", "[backend]".encode("utf-16")), "is not UTF-8 text (byte 0"),
    (lambda d: d / "nul\0.toml", "cannot be opened: embedded null byte"),
    (lambda d: _file(d, "plain", b"") / "under-a-file.toml", "cannot be read: Not a directory"),
    (lambda d: _loop(d / "loop.toml"), "cannot be read: Too many levels of symbolic links"),
    (lambda d: _file(d, "worker.toml", b"worker = 3\n"), "'worker' must be a table"),
    (lambda d: _file(d, "worker2.toml", b'worker = "ab"\n'), "'worker' must be a table"),
], ids=["directory", "latin-1", "utf-16", "nul-byte", "under-a-file", "symlink-loop", "worker-int", "worker-str"])
def test_a_file_that_cannot_be_read_or_decoded_is_a_config_error_naming_it(tmp_path, make, needle):
    """A directory, a path the system cannot open, bytes that are not UTF-8, a NUL byte in the
    path, a [worker] that is no table: each is a ConfigError naming the file and why (given as an
    argument or in KVWIRE_CONFIG), never an OSError, ValueError or TypeError."""
    path = make(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={}, validate=False)
    assert f"config file {str(path)!r}" in str(info.value) and needle in str(info.value), str(info.value)
    if "\0" not in str(path):  # an environment cannot hold a NUL byte
        with pytest.raises(ConfigError) as info:
            load_config(environ={"KVWIRE_CONFIG": str(path)}, validate=False)
        assert f"config file {str(path)!r}" in str(info.value) and needle in str(info.value), str(info.value)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(data=st.binary(max_size=200))
def test_any_file_bytes_give_a_config_or_a_config_error_naming_the_file(tmp_path, data):
    path = tmp_path / "kvwire.toml"
    path.write_bytes(data)
    try:
        load_config(path, environ={})
    except ConfigError as exc:
        assert str(path) in str(exc) or "option" in str(exc) or "backend" in str(exc), str(exc)
