"""kvwire-memory: an in-memory blob store backend."""
