"""The option ``device``'s plumbing on a host without CUDA: which spans of a batch go to the device
copy and which to the host copy, with what direction, and what a failed device copy leaves.

The CUDA parts are replaced here (and only here): ``copy_spans`` by a recorder that copies with
memmove, the pinned allocator by ordinary memory, and "DEVICE" regions are host arrays declared
DEVICE. Everything else is the real plugin: the blob backend, the driver, the store. The same
paths on a real GPU are in ``test_memory_device.py``."""

from __future__ import annotations

import ctypes
import uuid
from collections.abc import Iterator

import kvwire_memory
import kvwire_memory.driver as memory_driver
import kvwire_memory.store as memory_store
import numpy as np
import pytest
from device_rows import group, move, names_of
from kvwire_memory import forget_store

from kvwire.contract import Hint, MemoryKind, SlotRegion, View
from kvwire.contract.blocks import BLOCKS_FIELD, block_layout
from kvwire.lender import blockcopy
from kvwire.registry import load


class Recorder:
    """``copy_spans`` as a memmove per span, remembering each call; ``fail`` makes the next call
    raise as a CUDA error would."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, list[tuple[int, int, int]]]] = []
        self.fail = False

    def __call__(self, targets, sources, sizes, *, device, to_device, stream=None):  # type: ignore[no-untyped-def]
        if self.fail:
            self.fail = False
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        spans = list(zip(np.asarray(targets).tolist(), np.asarray(sources).tolist(), np.asarray(sizes).tolist(),
                         strict=True))
        self.calls.append((device, to_device, spans))
        for target, source, size in spans:
            ctypes.memmove(target, source, size)
        return _Done()


class _Done:
    def synchronize(self) -> None:
        pass


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(blockcopy, "copy_spans", rec)
    monkeypatch.setattr(memory_store, "_pinned_slab", memory_store._slab)
    monkeypatch.setattr(memory_driver.MemoryDriver, "stream", lambda self, device: None)
    monkeypatch.setattr(kvwire_memory, "cuda_problem", lambda: None)
    return rec


@pytest.fixture
def backend(recorder: Recorder) -> Iterator[object]:
    name = f"test-plumbing-{uuid.uuid4().hex[:10]}"
    made = load("memory-device").build({"store": name})
    yield made
    made.close()
    forget_store(name)


def region(rows: np.ndarray, region_id: int, kind: MemoryKind, device: int | None = None) -> SlotRegion:
    return SlotRegion(region_id, rows.ctypes.data, rows.shape[1], rows.shape[0], kind,
                      (device or 0) if kind is MemoryKind.DEVICE else None)


def rows(count: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)


def device_spans(rec: Recorder, to_device: bool) -> set[int]:
    """The device-side addresses of every span the device copy was given in that direction."""
    return {(t if to_device else s) for _, d, spans in rec.calls if d is to_device for t, s, _ in spans}


def test_the_backend_declares_device_memory_and_device_spans_go_to_the_device_copy(backend, recorder):
    assert MemoryKind.DEVICE in backend.capabilities().memory_kinds
    dev, host = rows(8, 1000, 1), rows(8, 1000, 2)
    regions = [region(dev, 0, MemoryKind.DEVICE), region(host, 1, MemoryKind.HOST)]
    names = names_of([1, 2, 3])
    view = View((group(0, regions[0], [1, 3, 5], names), group(1, regions[1], [0, 2, 4], names)))
    assert move(backend, "publish", view, regions).is_delivered
    # one call for the batch, reading the device rows (to_device false), and none of the host rows
    assert {d for d, _, _ in recorder.calls} == {0}
    assert device_spans(recorder, False) == {dev.ctypes.data + 1000 * i for i in (1, 3, 5)}
    assert not device_spans(recorder, True)

    recorder.calls.clear()
    dev_back, host_back = np.zeros_like(dev), np.zeros_like(host)
    back_regions = [region(dev_back, 0, MemoryKind.DEVICE), region(host_back, 1, MemoryKind.HOST)]
    back = View((group(0, back_regions[0], [0, 1, 2], names), group(1, back_regions[1], [5, 6, 7], names)))
    got = move(backend, "fetch", back, back_regions)
    assert got.is_delivered and all(m.all() for m in got.masks)
    assert device_spans(recorder, True) == {dev_back.ctypes.data + 1000 * i for i in (0, 1, 2)}
    assert not device_spans(recorder, False)
    np.testing.assert_array_equal(dev_back[:3], dev[[1, 3, 5]])
    np.testing.assert_array_equal(host_back[5:], host[[0, 2, 4]])
    assert not dev_back[3:].any() and not host_back[:5].any()


def test_block_objects_of_device_planes_copy_each_part_on_the_device(backend, recorder):
    planes = [rows(6, 512, p) for p in range(3)]
    regions = [region(t, p, MemoryKind.DEVICE) for p, t in enumerate(planes)]
    names = names_of([7, 8])
    view = View(tuple(group(p, r, [4, 1], names) for p, r in enumerate(regions)))
    hint = Hint.of("store", **{BLOCKS_FIELD: block_layout(view)})
    assert move(backend, "publish", view, regions, hint).is_delivered
    assert device_spans(recorder, False) == {t.ctypes.data + 512 * i for t in planes for i in (4, 1)}
    targets = [np.zeros_like(t) for t in planes]
    back_regions = [region(t, p, MemoryKind.DEVICE) for p, t in enumerate(targets)]
    back = View(tuple(group(p, r, [0, 5], names) for p, r in enumerate(back_regions)))
    got = move(backend, "fetch", back, back_regions, hint)
    assert got.is_delivered and all(m.all() for m in got.masks)
    for plane, target in zip(planes, targets, strict=True):
        np.testing.assert_array_equal(target[[0, 5]], plane[[4, 1]])


def test_a_failed_device_copy_fails_the_attempt_naming_it_and_stores_nothing(backend, recorder):
    dev = rows(4, 256, 3)
    reg = region(dev, 0, MemoryKind.DEVICE)
    view = View((group(0, reg, [0, 1, 2], names_of([1, 2, 3])),))
    recorder.fail = True
    failed = move(backend, "publish", view, [reg])
    assert failed.status.name == "FAILED" and "GPU" in (failed.reason or ""), failed
    assert not any(m.any() for m in failed.masks)
    back = np.zeros_like(dev)
    breg = region(back, 0, MemoryKind.DEVICE)
    miss = move(backend, "fetch", View((group(0, breg, [0, 1, 2], names_of([1, 2, 3])),)), [breg])
    assert miss.is_delivered and not miss.masks[0].any(), "a put whose copy failed left objects behind"
    assert move(backend, "publish", view, [reg]).is_delivered  # the next try stores them
    got = move(backend, "fetch", View((group(0, breg, [0, 1, 2], names_of([1, 2, 3])),)), [breg])
    assert got.masks[0].all()
    np.testing.assert_array_equal(back[:3], dev[:3])


def test_a_failed_device_copy_into_a_fetch_fails_it(backend, recorder):
    dev = rows(2, 128, 4)
    reg = region(dev, 0, MemoryKind.DEVICE)
    assert move(backend, "publish", View((group(0, reg, [0, 1], names_of([5, 6])),)), [reg]).is_delivered
    recorder.fail = True
    back = np.zeros_like(dev)
    breg = region(back, 0, MemoryKind.DEVICE)
    failed = move(backend, "fetch", View((group(0, breg, [0, 1], names_of([5, 6])),)), [breg])
    assert failed.status.name == "FAILED" and "GPU" in (failed.reason or ""), failed
    assert not any(m.any() for m in failed.masks)


def test_without_device_regions_nothing_goes_to_the_device_copy(backend, recorder):
    host = rows(4, 64, 5)
    reg = region(host, 0, MemoryKind.HOST)
    assert move(backend, "publish", View((group(0, reg, [0, 1], names_of([1, 2])),)), [reg]).is_delivered
    assert recorder.calls == []
