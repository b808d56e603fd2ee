"""kvwire: move LLM KV-cache blocks between inference workers and stores."""

__version__ = "0.1.0"
