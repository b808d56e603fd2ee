"""Fixtures for the vLLM connector tests: the vLLM venv (or a clear reason it is missing), a real
``mooncake_master`` on free loopback ports, a tiny dummy-weight model folder, and the test-only
``gated`` store plugin installed into a folder of its own (:mod:`gated_store`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from engines import VLLM_PYTHON, write_model  # noqa: E402


def need_vllm_venv() -> None:
    """Fail under CI, skip elsewhere, when .venv-vllm is missing."""
    if VLLM_PYTHON.exists():
        return
    reason = f"{VLLM_PYTHON} is missing: run scripts/bootstrap_vllm.sh (./dev.sh test does)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    need_vllm_venv()
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("vllm") / "tiny-llama")


@pytest.fixture(scope="session")
def master(vllm_venv: Path) -> Iterator[object]:
    from kvwire_mooncake.master import MasterProcess

    with MasterProcess(lease_ttl_ms=200) as m:
        yield m


@pytest.fixture(scope="session")
def gated_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the ``kvwire-vllm-gated`` distribution, for the PYTHONPATH of the engines
    that use it (nothing else sees it)."""
    from gated_store import install

    return install(tmp_path_factory.mktemp("gated-site"))
