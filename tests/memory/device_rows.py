"""Views over rows of one region per group, and a submission waited out: shared by the tests of
the memory plugin's option ``device`` (on a GPU and with its CUDA parts replaced)."""

from __future__ import annotations

import threading

import numpy as np

from kvwire.contract import CacheKind, Hint, LayerGroupRows, Outcome, SlotRegion, TokenRange, View

STORE = Hint.of("store")


def group(gid: int, region: SlotRegion, slots: list[int], names: np.ndarray) -> LayerGroupRows:
    return LayerGroupRows(gid, CacheKind.PAGED, region, np.asarray(slots), TokenRange(0, 16 * len(slots)), names)


def names_of(ids: list[int]) -> np.ndarray:
    out = np.zeros((len(ids), 8), dtype=np.uint8)
    out[:, :4] = np.asarray(ids, dtype="<u4").view(np.uint8).reshape(-1, 4)
    return out


def move(backend, op: str, view: View, regions: list[SlotRegion], hint: Hint = STORE,  # type: ignore[no-untyped-def]
         before=None) -> Outcome:
    """Register ``regions``, submit ``op`` and wait until it concluded and quiesced (``before``:
    called first, e.g. to let a device's queued writes land)."""
    if before is not None:
        before()
    done = threading.Event()
    with backend.register_regions(regions):
        attempt = getattr(backend, op)(view, hint, done.set)
        while not (attempt.poll() is not None and attempt.quiesced()):
            assert done.wait(10.0), "no wake within 10 s"
            done.clear()
        return attempt.poll()
