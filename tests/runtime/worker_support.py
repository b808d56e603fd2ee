"""What the worker tests share: whether a backend is usable here, and a pool of workers that
closes every worker it made and checks that none kept a pin."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from kvwire.registry import ConfigError, PluginError, load
from kvwire.runtime import Worker


def backend_problem(name: str) -> str | None:
    """Why backend ``name`` cannot be used here (not installed, broken, missing a library), or ``None``."""
    try:
        plugin = load(name)
        return plugin.check() if plugin.check else None
    except (ConfigError, PluginError) as exc:
        return str(exc)


@contextlib.contextmanager
def worker_pool(build: Callable[..., Worker], *, wait_served: bool = False) -> Iterator[Callable[..., Worker]]:
    """``make(name, **kw)``: a worker from ``build(name, **kw)``. At the end every worker is
    closed (after its replies were served, with ``wait_served``) and must hold no pin."""
    made: list[Worker] = []

    def make(name: str, **kw: object) -> Worker:
        worker = build(name, **kw)
        made.append(worker)
        return worker

    yield make
    if wait_served:
        for w in made:
            assert w.wait_served(10)
    for w in made:
        w.close()
    for w in made:
        assert w.pins() == 0, f"{w.name} kept pins"
