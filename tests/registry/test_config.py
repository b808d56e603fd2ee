"""Selecting a backend by name plus options from a TOML file and the environment."""

from __future__ import annotations

import pytest

from kvwire.registry import ConfigError, load_config


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
