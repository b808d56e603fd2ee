"""kvwire-ucx's options have one source: :class:`~kvwire_ucx.settings.UcxSettings`'s fields. The
registry's ``OPTIONS`` are made from them and the settings check themselves by those options, so
a value is refused alike whichever way it comes (issue 41: the two disagreed on bounds)."""

from __future__ import annotations

import dataclasses

import pytest
from kvwire_ucx import plugin
from kvwire_ucx.settings import OPTIONS, UcxSettings

from kvwire.registry import ConfigError

BAD = [
    ("max_in_flight", 0),
    ("max_in_flight", (1 << 20) + 1),  # the registry's bound, which the settings did not have
    ("timeout_s", 0.0005),  # below the registry's minimum, which the settings let through
    ("grace_s", float("nan")),
    ("grace_s", -1.0),
    ("listen_port", 70000),
    ("spin_us", True),
    ("spin_us", 10_000_001),
    ("window_bytes", 0),
    ("mode", "both-sided"),
    ("net_devices", 3),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_a_bad_value_is_refused_with_the_same_message_through_the_registry_and_the_settings(name, value) -> None:
    with pytest.raises(ConfigError) as by_registry:
        plugin.resolve({name: value})
    with pytest.raises(ConfigError) as by_settings:
        UcxSettings(**{name: value})
    assert str(by_settings.value) == str(by_registry.value)
    assert name in str(by_registry.value)


def test_the_registry_declares_every_setting_with_its_default() -> None:
    defaults = UcxSettings()
    assert [o.name for o in OPTIONS] == [f.name for f in dataclasses.fields(UcxSettings)]
    assert plugin.options == OPTIONS
    for option in OPTIONS:
        assert option.default == getattr(defaults, option.name)
        assert option.help


def test_a_large_grace_within_the_bounds_is_taken_both_ways() -> None:
    assert plugin.resolve({"grace_s": 1e10})["grace_s"] == UcxSettings(grace_s=1e10).grace_s == 1e10
    assert UcxSettings(timeout_s=2).timeout_s == 2.0 and isinstance(UcxSettings(timeout_s=2).timeout_s, float)
