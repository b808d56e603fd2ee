"""What kvwire tells vLLM about CUDA graphs, asked the way vLLM asks while it builds its
configuration (``requires_piecewise_for_cudagraph``, before any model loads; on a GPU engine whose
graphs capture whole forward passes). vLLM's CPU build captures no graphs, so it never asks: the
class methods are called here in vLLM's venv, directly and through vLLM's own ``MultiConnector``."""

from __future__ import annotations

import json
import subprocess

import pytest
from engines import VLLM_PYTHON

pytestmark = [pytest.mark.usefixtures("vllm_venv"), pytest.mark.xdist_group("vllm")]

SCRIPT = r'''
import json, sys
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from kvwire_vllm import KvwireConnector

def asked(extra):
    try:
        return KvwireConnector.requires_piecewise_for_cudagraph(extra)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"

def child(extra):
    return {"kv_connector": "KvwireConnector", "kv_connector_module_path": "kvwire_vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}

example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"shared_storage_path": sys.argv[1]}}
print(json.dumps({
    "default": asked({"backend": "memory"}),
    "async": asked({"backend": "memory", "load_async": True}),
    "in_step": asked({"backend": "memory", "load_async": False}),
    "bad_backend": asked({"backend": "no-such-store"}),
    "bad_option": asked({"backend": "memory", "options": {"capacty": 1}}),
    "multi_in_step": MultiConnector.requires_piecewise_for_cudagraph(
        {"connectors": [example, child({"backend": "memory", "load_async": False})]}),
    "multi_async": MultiConnector.requires_piecewise_for_cudagraph(
        {"connectors": [child({"backend": "memory"}), example]}),
}))
'''


def test_loads_inside_the_step_ask_for_piecewise_graphs_and_a_bad_configuration_is_refused_then(tmp_path) -> None:
    done = subprocess.run([str(VLLM_PYTHON), "-c", SCRIPT, str(tmp_path / "example")], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    # Layer waits inside the forward (load_async false) need piecewise graphs; loads beside the
    # steps (the default) put nothing of kvwire in the forward, so full graphs stay.
    assert (answers["default"], answers["async"], answers["in_step"]) == (False, False, True)
    # Through vLLM's MultiConnector, as a child among others, in either position.
    assert (answers["multi_in_step"], answers["multi_async"]) == (True, False)
    # A bad configuration is refused at this first question, with the message a start would give.
    assert answers["bad_backend"].startswith("ConfigError: ") and "unknown backend 'no-such-store'" in \
        answers["bad_backend"], answers
    assert "backend 'memory' has no option 'capacty'" in answers["bad_option"], answers
