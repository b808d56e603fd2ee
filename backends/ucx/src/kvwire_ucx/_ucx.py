"""The one place that imports ucxx, after setting this plugin's environment defaults.

``import ucxx`` itself sets ``UCX_MEMTYPE_CACHE``, ``UCX_RNDV_THRESH``, ``UCX_RNDV_FRAG_MEM_TYPE``
and ``UCX_MAX_RNDV_RAILS`` in ``os.environ`` when they are unset. Left there, they reach every
UCX that starts later in the process: with ``UCX_RNDV_THRESH=8192`` NIXL's UCX moves a one-sided
READ over TCP rendezvous instead of cma zero-copy (measured: 0.8 GB/s instead of 12 GB/s). So
the values ucxx added are taken back out of the environment and given to each of this plugin's
ucxx contexts in its config instead (:func:`context_config`); a value the user set stays.

``UCX_MEMTYPE_CACHE=n`` is the exception, left in the environment: it is a process-wide UCX
option (read when a UCX library loads, never from a context's config), and NIXL's own UCX needs
it too, or it takes GPU memory that torch allocated for host memory (see
:mod:`kvwire_ucx.cuda`). On a host without CUDA it changes nothing. UCX warns about variables
a library did not read unless ``UCX_WARN_UNUSED_ENV_VARS=n``, which is why that default is set
first.

``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`` is set too, when unset: UCX turns cuda_ipc's zero-copy get off
where NVML finds no active NVLink (a single GPU, or GPUs on PCIe), and a one-sided READ of device
rows then falls back to software emulation over TCP. Measured between two processes on one H100
(bench/bench_gpu_ucx.py, rows of 64 KiB): 0.08 GB/s without it, 18.6 GB/s at 16 MiB and 67.9 GB/s
at 64 MiB with it. Like the memory-type cache it is read from the environment by NIXL's UCX, so
it stays there; a value the user set stays."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
_before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}

import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

#: What ``import ucxx`` added to the environment (without the ``UCX_`` prefix), for our contexts.
UCXX_DEFAULTS: dict[str, str] = {}
for _key in [k for k in os.environ if k.startswith("UCX_") and k not in _before]:
    if _key != "UCX_MEMTYPE_CACHE":  # a global option: it would be refused in a context's config
        UCXX_DEFAULTS[_key[4:]] = os.environ.pop(_key)


__all__ = ["Array", "ucx_api", "UCXError", "UCXX_DEFAULTS", "context_config"]

UCXError: type[Exception] = ucx_api.UCXError


def context_config(net_devices: str) -> dict[str, str]:
    """The config of a ucxx context of this plugin: ucxx's defaults, then the network devices."""
    return {**UCXX_DEFAULTS, "NET_DEVICES": net_devices}
