"""What kvwire-ucx needs of CUDA to move device rows, through the driver library alone (no CUDA
Python package, no torch): whether this process's UCX reaches GPU memory, and the device's
primary context made current on the thread that calls UCX and NIXL.

UCX takes a pointer for GPU memory only where its ``cuda`` module loaded (it needs the host's
``libcuda``) and its memory-type cache is off: torch's CUDA 12.x/13 runtime allocates through
driver entry points that UCX's allocation hooks do not see, so a cache left on calls every such
pointer host memory (seen on an H100 host: NIXL refused VRAM registration as "detected as host",
and a ucxx send of device rows read them as host memory and crashed). ``import ucxx`` turns the
cache off in the environment before UCX loads (``UCX_MEMTYPE_CACHE=n``), and kvwire-ucx leaves
that there for NIXL's own UCX (see :mod:`kvwire_ucx._ucx`)."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

__all__ = ["CudaError", "reaches_cuda", "make_current"]


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names it and its status."""


_lock = threading.Lock()
_driver: Any = None
_current = threading.local()


def reaches_cuda(context: Any) -> bool:
    """Whether the ucxx ``context`` has a memory domain for CUDA memory: its cuda module loaded
    (ucxx's ``cuda_support`` says only how UCX was built: it is true on a host with no GPU)."""
    try:
        info = str(context.info)
    except Exception:
        return False
    return any(line.split(":")[-1].strip().startswith("cuda") for line in info.splitlines() if "component" in line)


def _load() -> Any:
    global _driver
    with _lock:
        if _driver is None:
            try:
                driver = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CudaError(f"the CUDA driver library cannot be loaded: {exc}") from None
            _check(driver.cuInit(0), "cuInit")
            _driver = driver
        return _driver


def _check(status: int, call: str) -> None:
    if status != 0:
        raise CudaError(f"{call} failed with CUDA status {status}")


def make_current(device: int) -> None:
    """Make ``device``'s primary context current on the calling thread (once per thread and
    device; the context is retained for the life of the process, as CUDA runtimes do)."""
    if getattr(_current, "device", None) == device:
        return
    driver = _load()
    handle = ctypes.c_int()
    _check(driver.cuDeviceGet(ctypes.byref(handle), ctypes.c_int(device)), f"cuDeviceGet({device})")
    context = ctypes.c_void_p()
    _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
    _check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    _current.device = device
