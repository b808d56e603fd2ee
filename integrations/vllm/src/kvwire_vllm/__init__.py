"""kvwire-vllm: a vLLM KV connector that is a kvwire lease holder.

Select it as any external connector::

    kv_transfer_config={"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire_vllm",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"backend": "mooncake", "options": {...}}}

or, with this distribution installed, by name alone (``"kv_connector": "KvwireConnector"``):
its ``vllm.general_plugins`` entry point registers the name with vLLM's connector factory.

Importing the package imports no vLLM: ``KvwireConnector`` is loaded on first access, so the
worker core (:mod:`kvwire_vllm.core`) and its parts run where vLLM is not installed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvwire_vllm.connector import KvwireConnector

__all__ = ["KvwireConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvwireConnector":
        from kvwire_vllm.connector import KvwireConnector

        return KvwireConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
