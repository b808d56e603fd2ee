"""Large host copies: :func:`stream_copy`, a copy whose stores bypass the cache where kvwire's
compiled helper was built (``kvwire._copy``, from ``src/kvwire/_copy.c``), else ``memmove``.

Why: glibc's memmove writes through the cache below its non-temporal threshold (53.5 MiB with
glibc 2.39 on an H100 host with 105 MiB of L3), so the pieces a store copies on several threads
(8-32 MiB) each cost a read of the destination too. Eight threads copying 4 GiB ran at 36-39 GB/s
in calls of 2-32 MiB and at 57-62 GB/s with streaming stores; the connector's staged save of a
32-layer model through the memory store went from 0.45x to 0.69x of the pinned copy
(bench/results/gpu-2026-12-06-night.txt). For copies whose destination is not read again soon
(a store's object, a pinned slot the GPU's DMA reads next); a small copy, or one read back at
once, is better served by memmove, which leaves the bytes in the cache.

Both copy without the GIL (a ctypes call) and take addresses; the ranges must not overlap."""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable
from typing import Final

__all__ = ["stream_copy", "STREAMING", "COPY_NAME"]


def _load() -> Callable[[int, int, int], object] | None:
    spec = importlib.util.find_spec("kvwire._copy")
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        fn = lib.kvwire_stream_copy
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = None
    return fn  # type: ignore[no-any-return]


_stream = _load()

#: Whether :func:`stream_copy` uses the compiled streaming copy (else it is memmove).
STREAMING: Final = _stream is not None
#: What :func:`stream_copy` is, for ``kvwire doctor``.
COPY_NAME: Final = ("non-temporal stores (kvwire._copy)" if STREAMING
                    else "memmove (kvwire._copy was not built: no C compiler at install?)")

#: ``stream_copy(dst, src, n)``: copy ``n`` bytes from address ``src`` to address ``dst``.
stream_copy: Callable[[int, int, int], object] = _stream if _stream is not None else ctypes.memmove
