"""``kv_connector_extra_config``: which kvwire backend, with which options, and how long to wait.

::

    {"backend": "mooncake", "options": {"master": "127.0.0.1:50051"}, "timeout_s": 10.0}

The backend is found by name through :mod:`kvwire.registry` and its options are validated by its
plugin, so an unknown name or a misspelt option raises kvwire's :class:`ConfigError`, which stops
the engine at start."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvwire.registry import DEFAULT_BACKEND, ConfigError, Plugin, load

__all__ = ["ConnectorConfig", "KEYS"]

#: The keys ``kv_connector_extra_config`` may hold, with what each means.
KEYS: Mapping[str, str] = {
    "backend": f"name of an installed kvwire backend (default {DEFAULT_BACKEND!r})",
    "options": "the backend's options, validated by its plugin",
    "timeout_s": "deadline of each load, save and lookup in seconds (default 10)",
    "load_failure_policy": "'recompute' (default: vLLM recomputes blocks a load missed) or 'fail'",
    "lookup": "ask the store which blocks it holds before loading (default true, where the backend "
              "declares 'lookup'); false: load every whole block and let vLLM recompute what misses",
    "load_async": "true (default): a load runs beside the engine's steps and the request waits for it; "
                  "false: the load runs inside the step that computes the rest of the prompt, each layer "
                  "waited for just before its attention (one step fewer; the step waits for the store)",
    "staging_mib": "MiB of pinned host memory for staging slots (default 1024), used when the KV cache is on a "
                   "GPU and the backend moves host memory only; one slot holds one block of every layer",
    "hold_s": "disaggregated prefill: seconds a producer keeps a finished request's prompt blocks pinned for "
              "its consumer's pull (default 30); released as soon as the consumer's pull of them ended",
}


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """What the connector was configured with, validated."""

    backend: str = DEFAULT_BACKEND
    options: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = 10.0
    load_failure_policy: str = "recompute"
    lookup: bool = True
    load_async: bool = True
    staging_mib: float = 1024.0
    hold_s: float = 30.0

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Validate ``extra`` (vLLM's ``kv_connector_extra_config``) and the backend it names.
        Raises :class:`ConfigError` naming the bad key and what is allowed."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            allowed = "; ".join(f"{k}: {v}" for k, v in KEYS.items())
            raise ConfigError(f"kv_connector_extra_config of KvwireConnector has unknown key(s) "
                              f"{', '.join(map(repr, unknown))}; allowed: {allowed}")
        backend = extra.get("backend", DEFAULT_BACKEND)
        if not isinstance(backend, str) or not backend:
            raise ConfigError(f"kv_connector_extra_config 'backend' must name a kvwire backend, got {backend!r}")
        options = extra.get("options", {})
        if not isinstance(options, Mapping):
            raise ConfigError(f"kv_connector_extra_config 'options' must be a mapping, got {type(options).__name__}")
        timeout = extra.get("timeout_s", 10.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                math.isfinite(timeout) and timeout > 0):
            raise ConfigError(f"kv_connector_extra_config 'timeout_s' must be a number of seconds > 0, got {timeout!r}")
        policy = extra.get("load_failure_policy", "recompute")
        if policy not in ("recompute", "fail"):
            raise ConfigError(f"kv_connector_extra_config 'load_failure_policy' must be 'recompute' or 'fail', "
                              f"got {policy!r}")
        lookup = extra.get("lookup", True)
        if not isinstance(lookup, bool):
            raise ConfigError(f"kv_connector_extra_config 'lookup' must be true or false, got {lookup!r}")
        load_async = extra.get("load_async", True)
        if not isinstance(load_async, bool):
            raise ConfigError(f"kv_connector_extra_config 'load_async' must be true or false, got {load_async!r}")
        staging = extra.get("staging_mib", 1024)
        if isinstance(staging, bool) or not isinstance(staging, (int, float)) or not (
                math.isfinite(staging) and staging > 0):
            raise ConfigError(f"kv_connector_extra_config 'staging_mib' must be a number of MiB > 0, got {staging!r}")
        hold = extra.get("hold_s", 30.0)
        if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not (math.isfinite(hold) and hold > 0):
            raise ConfigError(f"kv_connector_extra_config 'hold_s' must be a number of seconds > 0, got {hold!r}")
        config = cls(backend, dict(options), float(timeout), policy, lookup, load_async, float(staging), float(hold))
        config.plugin().resolve(config.options)  # unknown backend or option: kvwire's ConfigError
        return config

    @property
    def waits_inside_the_forward(self) -> bool:
        """Whether a step's forward pass waits on kvwire: with ``load_async`` false each layer's
        load is waited for just before its attention (``wait_for_layer_load``). That wait is Python
        between the layers; a CUDA graph captured over a whole forward pass replays without it, and
        attention would read blocks still loading. So such an engine must run piecewise graphs
        (``KvwireConnector.requires_piecewise_for_cudagraph``). With ``load_async`` true nothing of
        kvwire runs inside the forward: loads end before the request is scheduled, and saves are
        submitted after the forward (``wait_for_save``)."""
        return not self.load_async

    def plugin(self) -> Plugin:
        return load(self.backend)

    def namespace(self) -> str:
        """The store namespace the backend's options name (``"default"`` when it has none), as
        :class:`kvwire.runtime.Worker` reads it."""
        return str(self.plugin().resolve(self.options).get("namespace", "default"))
