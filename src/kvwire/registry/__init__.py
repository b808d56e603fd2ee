"""Discovery and selection of backends: entry-point group ``kvwire.backends``.

Listing imports nothing; loading imports only the backend asked for; a broken plugin is
explained with its distribution's name and never stops the others."""

from kvwire.registry.config import DEFAULT_BACKEND, BackendConfig, load_config
from kvwire.registry.discovery import (
    GROUP,
    HARNESS_GROUP,
    Entry,
    PluginError,
    Survey,
    available,
    load,
    refresh,
    survey,
)
from kvwire.registry.plugin import (
    REQUIRED,
    ConfigError,
    Option,
    Plugin,
    check_options,
    option_field,
    options_of,
)

__all__ = [
    "GROUP",
    "HARNESS_GROUP",
    "DEFAULT_BACKEND",
    "BackendConfig",
    "ConfigError",
    "Entry",
    "Option",
    "Plugin",
    "check_options",
    "option_field",
    "options_of",
    "PluginError",
    "REQUIRED",
    "Survey",
    "available",
    "load",
    "load_config",
    "refresh",
    "survey",
]
