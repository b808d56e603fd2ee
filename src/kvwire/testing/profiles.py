"""How hard the suite tries: ``quick`` for a developer (the whole suite on the memory backend in
seconds), ``thorough`` for CI. Selected with ``--kvwire-profile``; the pytest plugin activates
one before the suite's modules are imported."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Profile", "PROFILES", "activate", "active", "examples"]


@dataclass(frozen=True, slots=True)
class Profile:
    """``examples``: hypothesis examples per property test; ``machine_examples`` and
    ``machine_steps``: runs and steps of the stateful holder model; ``max_rows`` and
    ``max_groups``: the largest views drawn; ``patience_s``: how long the suite waits for a
    backend to make a change it owes (conclude, quiesce, wake) before failing the test;
    ``shrink``: whether hypothesis shrinks a failing example (off: report the first found)."""

    name: str
    examples: int
    machine_examples: int
    machine_steps: int
    max_rows: int
    max_groups: int
    patience_s: float
    shrink: bool = True


PROFILES: dict[str, Profile] = {
    "quick": Profile("quick", examples=10, machine_examples=10, machine_steps=30, max_rows=8, max_groups=3,
                     patience_s=10.0),
    "thorough": Profile("thorough", examples=100, machine_examples=100, machine_steps=60, max_rows=32,
                        max_groups=4, patience_s=20.0),
}

_active: Profile = PROFILES["quick"]


def activate(name: str, patience_s: float | None = None, shrink: bool = True) -> Profile:
    """Make ``name`` the active profile (``patience_s`` overrides its patience; ``shrink=False``
    reports failing examples unshrunk)."""
    global _active
    if name not in PROFILES:
        raise ValueError(f"unknown kvwire profile {name!r}; choose one of: {', '.join(PROFILES)}")
    profile = PROFILES[name]
    if patience_s is not None:
        profile = replace(profile, patience_s=float(patience_s))
    if not shrink:
        profile = replace(profile, shrink=False)
    _active = profile
    return profile


def active() -> Profile:
    """The profile in force."""
    return _active


def examples(**overrides: Any) -> Any:
    """Hypothesis ``settings`` for a property test under the active profile."""
    from hypothesis import HealthCheck, Phase, settings

    options: dict[str, Any] = {
        "max_examples": _active.examples,
        "deadline": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
        "print_blob": True,
    }
    if not _active.shrink:
        options["phases"] = (Phase.explicit, Phase.reuse, Phase.generate)
    options.update(overrides)
    return settings(**options)
