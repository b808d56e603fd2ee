"""kv_connector_extra_config as a vLLM user writes it: every key checked, a bad value refused with
kvwire's ConfigError naming the key and what it got (kvwire_vllm.config, without vLLM)."""

from __future__ import annotations

import importlib.util

import pytest
from kvwire_vllm.config import KEYS, ConnectorConfig

from kvwire.registry import ConfigError


def test_the_defaults() -> None:
    config = ConnectorConfig.parse({"backend": "memory"})
    assert (config.timeout_s, config.load_async, config.lookup, config.hold_s) == (10.0, True, True, 30.0)
    assert "hold_s" in KEYS


def test_a_producers_hold_is_set_in_seconds() -> None:
    assert ConnectorConfig.parse({"backend": "memory", "hold_s": 2.5}).hold_s == 2.5


@pytest.mark.parametrize("extra, needle", [
    ({"hold_s": 0}, "'hold_s' must be a number of seconds > 0, got 0"),
    ({"hold_s": -1}, "'hold_s'"),
    ({"hold_s": True}, "'hold_s'"),
    ({"hold_s": "30"}, "'hold_s'"),
    ({"hold_s": float("inf")}, "'hold_s'"),
    ({"timeout_s": 0}, "'timeout_s'"),
    ({"hold": 30}, "unknown key(s) 'hold'"),
    ({"load_sync": True}, "kv_connector_extra_config of KvwireConnector has unknown key(s) 'load_sync'; allowed: backend:"),
    ({"load_async": "no"}, "kv_connector_extra_config 'load_async' must be true or false, got 'no'"),
    ({"lookup": 1}, "kv_connector_extra_config 'lookup' must be true or false, got 1"),
    ({"backend": "no-such-store"}, "unknown backend 'no-such-store'; installed backends:"),
    ({"backend": "memory", "options": {"capacty": 1 << 20}}, "backend 'memory' has no option 'capacty'"),
    pytest.param({"backend": "mooncake", "options": {"mastr": "127.0.0.1:1"}}, "backend 'mooncake' has no option 'mastr'",
                 marks=pytest.mark.skipif(importlib.util.find_spec("kvwire_mooncake") is None,
                                          reason="kvwire-mooncake is not installed here (the GPU host has only "
                                                 "the packages carried to it)")),
])
def test_bad_values_are_refused_naming_the_key(extra: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorConfig.parse({"backend": "memory", **extra})
    assert needle in str(info.value)


def test_only_loads_inside_the_step_wait_inside_the_forward() -> None:
    """A full CUDA graph replays a forward pass without kvwire's layer waits: only ``load_async``
    false puts a wait there (the connector then asks vLLM for piecewise graphs)."""
    assert not ConnectorConfig.parse({"backend": "memory"}).waits_inside_the_forward
    assert not ConnectorConfig.parse({"backend": "memory", "load_async": True}).waits_inside_the_forward
    assert ConnectorConfig.parse({"backend": "memory", "load_async": False}).waits_inside_the_forward
