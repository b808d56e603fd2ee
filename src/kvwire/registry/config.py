"""Selecting a backend by name plus options, from a TOML file and ``KVWIRE_*`` variables.

File (``kvwire.toml``, or the path in ``KVWIRE_CONFIG``)::

    [backend]
    name = "memory"

    [backend.options]
    capacity_bytes = 1073741824

Environment (wins over the file): ``KVWIRE_BACKEND=memory`` and one
``KVWIRE_BACKEND_<OPTION>=value`` per option, e.g. ``KVWIRE_BACKEND_CAPACITY_BYTES=1e9``."""

from __future__ import annotations

import contextlib
import os
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwire.contract import Backend
from kvwire.registry.discovery import load
from kvwire.registry.plugin import ConfigError, Plugin

__all__ = ["BackendConfig", "load_config", "DEFAULT_BACKEND"]

DEFAULT_BACKEND = "memory"
_SECTIONS = ("backend", "worker")
_BACKEND_KEYS = ("name", "options")
ENV_PREFIX = "KVWIRE_BACKEND_"


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """A backend name plus its options, validated against the plugin's declared options."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)
    source: str = "defaults"
    worker: Mapping[str, Any] = field(default_factory=dict)

    def plugin(self) -> Plugin:
        return load(self.name)

    def resolved(self) -> dict[str, Any]:
        """Every option's validated value; raises :class:`ConfigError` naming a bad key."""
        return self.plugin().resolve(self.options)

    def build(self) -> Backend:
        return self.plugin().build(self.options)

    @contextlib.contextmanager
    def services(self) -> Iterator[BackendConfig]:
        """Start on loopback what the backend needs (the plugin's ``local_services``, e.g. a
        store master) and yield this config pointed at it; stop it on exit. A plugin that needs
        nothing yields this config unchanged."""
        plugin = self.plugin()
        if plugin.local_services is None:
            yield self
            return
        with plugin.local_services(plugin.resolve(self.options)) as extra:
            yield BackendConfig(self.name, {**self.options, **dict(extra)}, self.source, self.worker)


def _read_file(path: Path) -> dict[str, Any]:
    """The file's tables; any file that cannot be opened, read or decoded is a :class:`ConfigError`
    naming the file and why."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {str(path)!r} is a directory; name a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:  # tomllib decodes the bytes as UTF-8 before parsing
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    except ValueError as exc:  # after its subclasses above: a NUL byte in the path, which os refuses
        raise ConfigError(f"config file {str(path)!r} cannot be opened: {exc}") from None
    for key in data:
        if key not in _SECTIONS:
            raise ConfigError(f"config file {str(path)!r}: unknown section [{key}]; allowed: {', '.join(_SECTIONS)}")
    backend = data.get("backend", {})
    if not isinstance(backend, dict):
        raise ConfigError(f"config file {str(path)!r}: 'backend' must be a table")
    for key in backend:
        if key not in _BACKEND_KEYS:
            raise ConfigError(
                f"config file {str(path)!r}: unknown key backend.{key}; allowed: "
                + ", ".join(f"backend.{k}" for k in _BACKEND_KEYS)
            )
    if "options" in backend and not isinstance(backend["options"], dict):
        raise ConfigError(f"config file {str(path)!r}: 'backend.options' must be a table")
    if "name" in backend and not isinstance(backend["name"], str):
        raise ConfigError(f"config file {str(path)!r}: 'backend.name' must be a string")
    if not isinstance(data.get("worker", {}), dict):
        raise ConfigError(f"config file {str(path)!r}: 'worker' must be a table")
    return data


def load_config(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    backend: str | None = None,
    validate: bool = True,
) -> BackendConfig:
    """The backend configuration from ``path`` (or ``KVWIRE_CONFIG``), then the environment,
    then ``backend`` if given; validated against the chosen plugin unless ``validate`` is false."""
    env = os.environ if environ is None else environ
    name, options, worker, sources = DEFAULT_BACKEND, {}, {}, []
    file = path if path is not None else env.get("KVWIRE_CONFIG")
    if file:
        data = _read_file(Path(file))
        section = data.get("backend", {})
        if "name" in section:
            name = section["name"]
        options.update(section.get("options", {}))
        worker = dict(data.get("worker", {}))
        sources.append(str(file))
    if env.get("KVWIRE_BACKEND"):
        if env["KVWIRE_BACKEND"] != name:
            options = {}
        name = env["KVWIRE_BACKEND"]
        sources.append("KVWIRE_BACKEND")
    if backend is not None:
        if backend != name:
            options = {}
        name = backend
    for key, value in env.items():
        if key.startswith(ENV_PREFIX) and key != "KVWIRE_BACKEND":
            options[key[len(ENV_PREFIX):].lower()] = value
            sources.append(key)
    config = BackendConfig(name, options, ", ".join(sources) or "defaults", worker)
    if validate:
        config.resolved()
    return config
