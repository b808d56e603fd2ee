"""An option can be required: ``Option(name, type, REQUIRED, help)``. A configuration that leaves
it out is refused naming the option and the backend; listings show it as required."""

from __future__ import annotations

from typing import Any

import pytest

import kvwire.registry.config as config_module
from kvwire.cli import main
from kvwire.contract import CONTRACT_VERSION
from kvwire.registry import REQUIRED, ConfigError, Option, Plugin, load, load_config


@pytest.fixture
def plugin() -> Plugin:
    memory = load("memory")
    return Plugin(
        name="needs-path",
        contract_version=CONTRACT_VERSION,
        capabilities=memory.capabilities,
        create=lambda options: memory.create({**memory.resolve({}), "store": f"required-{options['path']}"}),
        options=(Option("path", str, REQUIRED, "where the store lives"), Option("size", int, 4, "how many", minimum=1)),
    )


def test_a_config_without_the_required_option_is_refused_naming_it_and_the_backend(plugin: Plugin) -> None:
    with pytest.raises(ConfigError) as info:
        plugin.resolve({"size": 2})
    message = str(info.value)
    assert "'path'" in message and "'needs-path'" in message and "KVWIRE_BACKEND_PATH" in message
    with pytest.raises(ConfigError, match="'path'"):
        plugin.build({})


def test_a_config_that_gives_it_resolves_and_builds(plugin: Plugin) -> None:
    assert plugin.resolve({"path": "/x"}) == {"path": "/x", "size": 4}
    backend = plugin.build({"path": "here"})
    try:
        assert backend.capabilities() == plugin.capabilities
    finally:
        backend.close()  # type: ignore[attr-defined]


def test_a_required_option_is_still_type_checked(plugin: Plugin) -> None:
    with pytest.raises(ConfigError, match="'path'.*required"):
        plugin.resolve({"path": 3})


def test_listings_show_it_as_required(plugin: Plugin) -> None:
    path, size = plugin.options
    assert path.required and not size.required
    assert path.describe() == "path (str, required)"
    assert size.describe() == "size (int >= 1, default 4)"
    assert plugin.describe_options()[0] == "path (str, required): where the store lives"
    assert repr(REQUIRED) == "REQUIRED"


def test_load_config_refuses_a_file_and_environment_that_omit_it(plugin: Plugin, tmp_path: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "load", lambda name: plugin)
    file = tmp_path / "kvwire.toml"
    file.write_text('[backend]\nname = "needs-path"\n\n[backend.options]\nsize = 3\n')
    with pytest.raises(ConfigError, match="needs option.*'path'"):
        load_config(file, environ={})
    config = load_config(file, environ={"KVWIRE_BACKEND_PATH": "/from/env"})
    assert config.resolved() == {"path": "/from/env", "size": 3}


def test_kvwire_backends_verbose_lists_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-v", "backends"]) == 0
    out = capsys.readouterr().out
    assert "memory options:" in out and "capacity_bytes (int >= 1, default" in out
