"""Fixtures for the vLLM connector's worker core, run without vLLM: the device (the CPU always, a
CUDA device where there is one), real store backends on fresh stores, and a factory of cores that
shuts every core down at the end of the test and checks nothing was left behind."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvwire_vllm.core import WorkerCore

from kvwire.contract import Backend
from kvwire.registry import load

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is false here)"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_backend(tmp_path: Path) -> Iterator[Callable[[str], Backend]]:
    """``make(name)``: a new backend instance on this test's store of that backend ("memory":
    one in-process store; "memory-device": one in pinned memory, backend ``memory-device``;
    "files": one folder), as separate engines' workers each build their own."""
    from kvwire_memory import forget_store

    store = f"vllm-core-{uuid.uuid4().hex}"

    def make(name: str) -> Backend:
        if name == "memory":
            return load("memory").build({"store": store})
        if name == "memory-device":  # rows of a CUDA cache straight into a pinned store, no staging
            if not torch.cuda.is_available():
                pytest.skip(NO_CUDA)
            return load("memory-device").build({"store": f"{store}-device"})
        if name == "files":
            return load("files").build({"root": str(tmp_path / "files-store")})
        raise ValueError(name)

    yield make
    forget_store(store)
    forget_store(f"{store}-device")


@pytest.fixture
def make_core() -> Iterator[Callable[..., WorkerCore]]:
    """``make_core(backend, layers, **options)``: a core (block size 4, namespace "t") shut down at
    the end; each must then hold nothing: no registration, no open backend, no staging slot, no
    attempt kept."""
    cores: list[WorkerCore] = []

    def make(backend: Backend, layers: list[str], **options: Any) -> WorkerCore:
        options.setdefault("block_size", 4)
        options.setdefault("namespace", "t")
        options.setdefault("staging_mib", 1)
        core = WorkerCore(backend, layers=layers, **options)
        cores.append(core)
        return core

    yield make
    for core in cores:
        assert core.shutdown(timeout_s=30), core.state()
        state = core.state()
        assert not state["registered"] and not state["backend_open"], state
        assert state["staging_in_use"] == 0 and state["kept"] == 0, state
        assert not state["loads"] and not state["saves"] and not state["draining"], state
