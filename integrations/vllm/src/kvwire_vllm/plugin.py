"""vLLM's ``vllm.general_plugins`` entry point: registers ``KvwireConnector`` by name.

vLLM 0.32 has no entry-point group for connectors; its general plugins run in every vLLM
process before a connector is built, and its factory takes registrations by name."""

from __future__ import annotations

__all__ = ["register", "NAME"]

NAME = "KvwireConnector"


def register() -> None:
    """Register the connector with vLLM's factory (lazily: nothing of kvwire is imported here).
    Idempotent."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "kvwire_vllm.connector", NAME)
