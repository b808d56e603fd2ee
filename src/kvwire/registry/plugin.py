"""What a backend plugin's entry point names: a :class:`Plugin` with declared options."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields
from typing import Any

from kvwire.contract import Backend, Capabilities

__all__ = ["Option", "Plugin", "ConfigError", "REQUIRED", "option_field", "options_of", "check_options"]

_TYPES: dict[type, str] = {bool: "bool", int: "int", float: "float", str: "str"}


class _Required:
    """The type of :data:`REQUIRED`: one instance, falsy, shown as its name."""

    _instance: _Required | None = None

    def __new__(cls) -> _Required:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REQUIRED"

    def __bool__(self) -> bool:
        return False


#: ``Option(name, type, REQUIRED, help)``: the option has no default; a configuration that
#: leaves it out is refused with a :class:`ConfigError` naming the option and the backend.
REQUIRED: Any = _Required()


class ConfigError(ValueError):
    """Configuration names an unknown backend or key, or a value of the wrong type or range.
    The message names the key and the allowed values."""


@dataclass(frozen=True, slots=True)
class Option:
    """One documented option of a backend: its type, default, and allowed values or range. A
    default of :data:`REQUIRED` makes the option required: it has no default, and a
    configuration that omits it is refused."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise TypeError(f"Option {self.name!r}: type must be one of {sorted(_TYPES.values())}")

    @property
    def required(self) -> bool:
        """Whether a configuration must give this option (its default is :data:`REQUIRED`)."""
        return self.default is REQUIRED

    def describe(self) -> str:
        allowed = ""
        if self.choices is not None:
            allowed = " one of " + ", ".join(repr(c) for c in self.choices)
        elif self.minimum is not None or self.maximum is not None:
            lo = "" if self.minimum is None else f">= {self.minimum:g}"
            hi = "" if self.maximum is None else f"<= {self.maximum:g}"
            allowed = " " + " and ".join(x for x in (lo, hi) if x)
        given = "required" if self.required else f"default {self.default!r}"
        return f"{self.name} ({_TYPES[self.type]}{allowed}, {given})"

    def coerce(self, value: Any, backend: str) -> Any:
        """``value`` as this option's type, from a TOML value or an environment string."""
        where = f"option {self.name!r} of backend {backend!r}"
        if isinstance(value, str) and self.type is not str:
            text = value.strip()
            try:
                if self.type is bool:
                    lowered = text.lower()
                    if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                        raise ValueError(text)
                    value = lowered in ("1", "true", "yes", "on")
                elif self.type is int:
                    value = int(text.replace("_", ""), 0)
                else:
                    value = float(text)
            except ValueError:
                raise ConfigError(f"{where}: {value!r} is not a {_TYPES[self.type]}; expected {self.describe()}") from None
        return self.check(value, backend)

    def check(self, value: Any, backend: str) -> Any:
        """``value`` if it is of this option's type (an int for a float, as a float) and within
        its choices and bounds; else :class:`ConfigError` naming the option, ``backend`` and what
        is allowed. Unlike :meth:`coerce`, it parses no text: for values given in Python (a
        plugin's own settings type checks its fields with it, so both paths refuse alike)."""
        where = f"option {self.name!r} of backend {backend!r}"
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.type) or (self.type is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: {value!r} is a {type(value).__name__}; expected {self.describe()}")
        if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison
            raise ConfigError(f"{where}: {value!r} is not a finite number; expected {self.describe()}")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{where}: {value!r} is not allowed; expected {self.describe()}")
        number = value if isinstance(value, (int, float)) else None  # bounds are declared for numbers only
        if self.minimum is not None and number is not None and number < self.minimum:
            raise ConfigError(f"{where}: {value!r} is too small; expected {self.describe()}")
        if self.maximum is not None and number is not None and number > self.maximum:
            raise ConfigError(f"{where}: {value!r} is too large; expected {self.describe()}")
        return value


def option_field(default: Any, help: str, *, choices: tuple[Any, ...] | None = None, minimum: float | None = None,
                 maximum: float | None = None) -> Any:
    """A field of a plugin's settings dataclass that declares its option once: default, help,
    choices and bounds. :func:`options_of` makes the registry's :class:`Option` of each such
    field, and :func:`check_options` checks an instance's fields by those same options, so the
    registry and the settings type refuse a value alike, with the same message."""
    return field(default=default, metadata={"option": (help, choices, minimum, maximum)})


_TYPE_NAMES = {name: t for t, name in _TYPES.items()}


def options_of(settings: type) -> tuple[Option, ...]:
    """The :class:`Option` of every :func:`option_field` of the dataclass ``settings``, in order."""
    found = []
    for f in fields(settings):
        if "option" not in f.metadata:
            continue
        help, choices, minimum, maximum = f.metadata["option"]
        kind = f.type if isinstance(f.type, type) else _TYPE_NAMES[str(f.type)]
        found.append(Option(f.name, kind, f.default, help, choices=choices, minimum=minimum, maximum=maximum))
    return tuple(found)


def check_options(settings: Any, options: tuple[Option, ...], backend: str) -> None:
    """Check each of ``options`` on the field of that name of the (frozen) dataclass instance
    ``settings``, keeping the checked value (an int given for a float becomes a float); the first
    value refused raises :class:`ConfigError`, as the registry would for it."""
    for option in options:
        object.__setattr__(settings, option.name, option.check(getattr(settings, option.name), backend))


@dataclass(frozen=True, slots=True)
class Plugin:
    """What the entry point ``kvwire.backends:NAME`` names.

    ``create(options)`` builds a backend from validated options. ``capabilities`` is what every
    backend it builds declares. ``check()``, if given, reports why the plugin's own library cannot
    load (or ``None``), without raising, so a plugin with a missing library is still listed."""

    name: str
    contract_version: tuple[int, int]
    capabilities: Capabilities
    create: Callable[[Mapping[str, Any]], Backend]
    options: tuple[Option, ...] = ()
    summary: str = ""
    check: Callable[[], str | None] | None = None
    install_hint: str = ""
    local_services: Callable[[Mapping[str, Any]], AbstractContextManager[Mapping[str, Any]]] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def option(self, name: str) -> Option:
        for opt in self.options:
            if opt.name == name:
                return opt
        allowed = ", ".join(o.name for o in self.options) or "none"
        raise ConfigError(f"backend {self.name!r} has no option {name!r}; its options are: {allowed}")

    def resolve(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Every option's value: the defaults, overridden by ``options``, each validated. A
        required option that ``options`` leaves out raises :class:`ConfigError` naming it."""
        resolved = {o.name: o.default for o in self.options if not o.required}
        for key, value in options.items():
            resolved[key] = self.option(key).coerce(value, self.name)
        missing = [o for o in self.options if o.required and o.name not in resolved]
        if missing:
            names = ", ".join(repr(o.name) for o in missing)
            how = "; ".join(
                f"{o.describe()}: {o.help} (set it in [backend.options] or KVWIRE_BACKEND_{o.name.upper()})"
                for o in missing)
            raise ConfigError(f"backend {self.name!r} needs option(s) {names}, which the configuration does not "
                              f"give: {how}")
        return resolved

    def describe_options(self) -> list[str]:
        """One line per option: name, type, allowed values, ``required`` or its default, help."""
        return [f"{o.describe()}: {o.help}" for o in self.options]

    def build(self, options: Mapping[str, Any] | None = None) -> Backend:
        """A backend built from ``options`` after validation. A value the plugin's own checks
        refuse (its ``create`` raising ``ValueError``: a namespace of the wrong form, options that
        contradict each other) is a :class:`ConfigError` too, naming the backend."""
        resolved = self.resolve(options or {})
        try:
            return self.create(resolved)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(f"backend {self.name!r}: {exc}") from exc
