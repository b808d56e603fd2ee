"""kvwire-vllm: a vLLM KV connector that is a kvwire lease holder.

Select it as any external connector::

    kv_transfer_config={"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire_vllm",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"backend": "mooncake", "options": {...}}}

or, with this distribution installed, by name alone (``"kv_connector": "KvwireConnector"``):
its ``vllm.general_plugins`` entry point registers the name with vLLM's connector factory."""

from kvwire_vllm.connector import KvwireConnector

__all__ = ["KvwireConnector"]
