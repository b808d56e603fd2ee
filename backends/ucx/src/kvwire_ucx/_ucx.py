"""The one place that imports ucxx, after setting this plugin's environment defaults.

``import ucxx`` itself sets ``UCX_MEMTYPE_CACHE``, ``UCX_RNDV_THRESH``, ``UCX_RNDV_FRAG_MEM_TYPE``
and ``UCX_MAX_RNDV_RAILS`` in ``os.environ`` when they are unset; UCX 1.21 then warns about the
first unless ``UCX_WARN_UNUSED_ENV_VARS=n``, which is why that default is set first. Settings
that belong to one backend (network devices) travel in its context's config instead of the
environment."""

from __future__ import annotations

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

__all__ = ["Array", "ucx_api", "UCXError"]

UCXError: type[Exception] = ucx_api.UCXError
