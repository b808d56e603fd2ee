"""kvwire's conformance kit, shipped in the wheel: the pytest plugin, hypothesis strategies,
the harness API that plugins implement, and fault-injecting wrappers."""
