"""Whole-block copies between paged KV caches and row buffers, on a CUDA device or the CPU: the one
gather/scatter every device path of kvwire uses (the lender's staging, the vLLM connector's).

Words. A *plane* is a tensor whose dim 0 is the block index and whose every block ``plane[b]`` is
one contiguous span of bytes, in any dimension order (a layer of the CPU layout ``[blocks, 2,
bs, heads*dim]``; ``t[0]`` or ``t[1]``, the K or V half of FlashAttention's ``(2, blocks, bs,
heads, dim)``; FlashInfer's ``(blocks, 2, heads, bs, dim)``; a lender pool). A :class:`PlaneSet`
is the planes of one registration, all of one device, dtype and block count, checked and
described once (the device pointer table, each plane's block bytes and its offset in a row). A
*row* is one block across all planes of a set: plane 0's block bytes, then plane 1's, ... in
memory order (``row_bytes`` in all). A *row buffer* is a contiguous tensor ``[rows, ...]`` whose
row holds ``row_bytes`` bytes, of dtype uint8 or the planes' dtype, on the planes' device or,
for CUDA planes, in pinned host memory.

The API::

    planes = PlaneSet([k0, v0, k1, v1, ...])          # once per registration
    gather(planes, block_ids, out, out_rows=None)     # row out_rows[i] of out  := block block_ids[i]
    scatter(inp, in_rows, planes, block_ids)          # block block_ids[i]      := row in_rows[i] of inp
    implementation()                                  # e.g. "triton 3.6.0", for ``kvwire doctor``
    copy_spans(targets, sources, sizes, device=0, to_device=True)   # spans by address (a store's)

:func:`copy_spans` is for a store that keeps objects in pinned host memory and takes rows of a
CUDA device by address (``kvwire-memory`` with ``device`` on): one launch copies every span of a
batch between device memory and the pinned objects, the kernel reading or writing host memory
over the bus itself, so there is no staging buffer and no DMA per object.

Rows default to ``0, 1, ...`` when ``None``. Indices are host integers (a sequence, numpy array or
CPU tensor). A gather may read one block into several rows but must write each row once; a
scatter may read one row into several blocks but must write each block once.

Promises. Every argument is checked before anything is copied: bad input raises ``TypeError``
or ``ValueError`` naming the plane, index or buffer and what is wrong, and copies nothing. On a
CUDA device the copy is queued on ``stream`` (default: the device's current stream) behind the
work already queued there, and the returned ``torch.cuda.Event`` completes with it; the caller
keeps the buffer and the planes unchanged until then, and nothing here waits for the device. On
the CPU the copy is done on return (``None``).

How. On CUDA, a Triton kernel where Triton imports (one launch per call for every block and plane:
programs over (block, plane, chunk) read a pointer table); otherwise torch ops on int64 views of
the bytes (int32, int16 or uint8 where the block bytes or addresses are not multiples of 8),
``index_select`` then ``index_copy_`` per plane, never element-typed copies (a bf16
``index_copy_`` runs at a quarter of a plain copy). The choice is made once, at first use. A CUDA
gather into pinned host rows goes through a bounded device scratch buffer (gather there, then one
DMA per run of consecutive rows), a scatter from host rows the other way (one DMA of a span of
rows, then the scatter). Measured on an H200 (``bench/bench_gpu.py``, results in
``bench/results/gpu-h200-2026-12-04.txt``): the kernel runs at 0.90-0.96 of a contiguous copy of
the same bytes, a call costs 0.1-0.3 ms of host time besides, and the scratch path reaches
0.94-0.95 of the pinned-copy ceiling from 512 MiB a call up, where the kernel on host memory
reaches 0.89-0.94. The scratch buffer is one per device, :data:`SCRATCH_BYTES` (or one row, if
larger), reused by every call, and ordered across streams with events.

Why one file of this size: every device copy of kvwire is here, and the block copies and the span
copies share the choice of implementation, the kernel's word widths and tuning, and the upload of
their tables; split, each half would reach into the other's."""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["PlaneSet", "gather", "scatter", "copy_spans", "implementation", "SCRATCH_BYTES"]

log = logging.getLogger(__name__)

#: The device scratch buffer a copy between CUDA planes and host rows goes through, per device.
SCRATCH_BYTES = 64 << 20

# Tuning of the Triton kernel (bench/bench_gpu.py sweeps them): bytes per program, warps.
_CHUNK_BYTES = 16384
_NUM_WARPS = 4
# Whether a CUDA copy to or from pinned host rows runs the kernel on host memory directly (True)
# or through the device scratch buffer and DMA (False, measured faster from 512 MiB a call up);
# bench/bench_gpu.py measures both.
_HOST_DIRECT = False

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


class _Impl(enum.Enum):
    TRITON = "triton"
    TORCH = "torch"


# -- the implementation, chosen once ------------------------------------------------------------

_choice_lock = threading.Lock()
_choice: tuple[_Impl, str] | None = None
_kernel: Any = None


def _choose() -> tuple[_Impl, str]:
    """The implementation CUDA copies use: Triton where it imports and a device is there (or the
    environment asks for it, ``KVWIRE_BLOCKCOPY=triton``, with ``TRITON_INTERPRET=1`` on a CPU),
    else torch; ``KVWIRE_BLOCKCOPY=torch`` forces torch."""
    global _choice, _kernel
    with _choice_lock:
        if _choice is not None:
            return _choice
        asked = os.environ.get("KVWIRE_BLOCKCOPY", "").strip().lower()
        if asked not in ("", "torch", "triton"):
            log.warning("KVWIRE_BLOCKCOPY=%r is neither 'torch' nor 'triton'; ignored", asked)
            asked = ""
        if asked == "torch":
            _choice = (_Impl.TORCH, "torch (int64 views; KVWIRE_BLOCKCOPY=torch)")
        elif not torch.cuda.is_available() and not (asked == "triton" and _interpreting()):
            _choice = (_Impl.TORCH, "torch (int64 views)")
        else:
            try:
                import triton

                _kernel = _build_kernel()
                _choice = (_Impl.TRITON, f"triton {triton.__version__}")
            except Exception as exc:  # an absent or broken Triton: the fallback serves
                log.info("block copies use torch: Triton is not usable here (%s)", exc)
                _choice = (_Impl.TORCH, f"torch (int64 views; triton not usable: {type(exc).__name__})")
        log.debug("block copies: %s", _choice[1])
        return _choice


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def implementation() -> str:
    """What copies blocks here, as ``kvwire doctor`` shows it: ``"triton <version>"`` or
    ``"torch (int64 views...)"``."""
    return _choose()[1]


def _build_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def blocks_kernel(table, pairs, buf, row_stride, n_planes,
                      TO_ROWS: tl.constexpr, WORD: tl.constexpr, WTYPE: tl.constexpr,
                      CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
        # program (block i x plane p, chunk c): words [c*CHUNK, (c+1)*CHUNK) of block
        # pairs[i][0] of plane p <-> the same words of plane p's part of row pairs[i][1].
        # table[p] = (plane address, bytes between blocks, block bytes, offset in a row).
        pid = tl.program_id(0).to(tl.int64)
        i = pid // n_planes
        p = pid - i * n_planes
        words = tl.load(table + p * 4 + 2) // WORD
        start = tl.program_id(1).to(tl.int64) * CHUNK
        if start < words:
            block = tl.load(pairs + 2 * i)
            row = tl.load(pairs + 2 * i + 1)
            plane_at = tl.load(table + p * 4) + block * tl.load(table + p * 4 + 1)
            row_at = buf + row * row_stride + tl.load(table + p * 4 + 3)
            plane_ptr = plane_at.to(tl.pointer_type(WTYPE))
            row_ptr = row_at.to(tl.pointer_type(WTYPE))
            if ALIGNED:  # every address and size is a multiple of 16: 16-byte accesses
                plane_ptr = tl.multiple_of(plane_ptr, 16)
                row_ptr = tl.multiple_of(row_ptr, 16)
            if TO_ROWS:
                src, dst = plane_ptr, row_ptr
            else:
                src, dst = row_ptr, plane_ptr
            offs = start + tl.arange(0, CHUNK)
            if start + CHUNK <= words:  # a whole chunk: no mask, so the accesses stay wide
                tl.store(dst + offs, tl.load(src + offs))
            else:
                mask = offs < words
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    global _word_types
    _word_types = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}
    return blocks_kernel


_word_types: dict[int, Any] = {}


# -- the planes ----------------------------------------------------------------------------------


def _dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether elements of these sizes and strides fill one span exactly, in some order."""
    dims = sorted((st, sz) for sz, st in zip(sizes, strides, strict=True) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _word(*values: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides every value."""
    for w in (8, 4, 2):
        if all(v % w == 0 for v in values):
            return w
    return 1


class PlaneSet:
    """The planes of one registration, checked once: same device, dtype and number of blocks,
    each block one contiguous span of bytes, blocks not overlapping. The planes must keep their
    storage while the set is used. ``block_bytes[p]`` and ``offsets[p]`` say where plane ``p``'s
    block lies in a row of ``row_bytes``."""

    __slots__ = ("planes", "device", "dtype", "num_blocks", "block_bytes", "offsets", "row_bytes",
                 "_bases", "_strides", "_starts", "_word", "_aligned16", "_longest", "_table", "_views")

    def __init__(self, planes: Sequence[torch.Tensor]) -> None:
        planes = tuple(planes)
        if not planes:
            raise ValueError("a PlaneSet needs at least one plane")
        for k, t in enumerate(planes):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"plane {k} is a {type(t).__name__}, not a torch.Tensor")
        first = planes[0]
        if first.device.type not in ("cpu", "cuda"):
            raise ValueError(f"plane 0 is on {first.device}; planes live on the CPU or a CUDA device")
        sizes: list[int] = []
        bases: list[int] = []
        strides: list[int] = []
        starts: list[int] = []
        for k, t in enumerate(planes):
            if t.device != first.device:
                raise ValueError(f"plane {k} is on {t.device} but plane 0 on {first.device}: one set, one device")
            if t.dtype != first.dtype:
                raise TypeError(f"plane {k} is {t.dtype} but plane 0 {first.dtype}: one set, one dtype")
            if t.dim() < 1:
                raise ValueError(f"plane {k} is a 0-d tensor; dim 0 of a plane is the block index")
            if t.shape[0] != first.shape[0]:
                raise ValueError(f"plane {k} has {t.shape[0]} blocks but plane 0 {first.shape[0]}")
            el = t.element_size()
            block = int(math.prod(t.shape[1:])) * el
            if block == 0:
                raise ValueError(f"plane {k} has empty blocks (shape {tuple(t.shape)})")
            if not _dense(t.shape[1:], t.stride()[1:]) or any(s < 0 for s in t.stride()):
                raise ValueError(f"plane {k}: a block (shape {tuple(t.shape[1:])}, strides {t.stride()[1:]}) "
                                 "is not one contiguous span of bytes")
            stride = int(t.stride(0)) * el
            if t.shape[0] > 1 and stride < block:
                raise ValueError(f"plane {k}: blocks of {block} bytes lie {stride} bytes apart, so they overlap")
            sizes.append(block)
            bases.append(t.data_ptr())
            strides.append(stride)
            starts.append(int(t.storage_offset()) * el)
        self.planes = planes
        self.device = first.device
        self.dtype = first.dtype
        self.num_blocks = int(first.shape[0])
        self.block_bytes = np.array(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.block_bytes)[:-1]]).astype(np.int64)
        self.block_bytes.flags.writeable = False
        self.offsets.flags.writeable = False
        self.row_bytes = int(self.block_bytes.sum())
        self._bases, self._strides, self._starts = bases, strides, starts
        self._word = _word(*bases, *strides, *sizes, *starts, *self.offsets.tolist())
        self._aligned16 = all(v % 16 == 0 for v in (*bases, *strides, *sizes, *self.offsets.tolist()))
        self._longest = max(sizes)
        self._table: torch.Tensor | None = None
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}
        if self.device.type == "cuda" or _interpreting():
            table = np.stack([np.array(bases), np.array(strides), self.block_bytes, self.offsets], axis=1)
            self._table = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int64)).to(self.device)

    def __len__(self) -> int:
        return len(self.planes)

    def __repr__(self) -> str:
        return (f"PlaneSet({len(self.planes)} planes of {self.num_blocks} blocks, {self.row_bytes} bytes a row, "
                f"{self.dtype}, {self.device})")

    def views(self, word: int) -> tuple[torch.Tensor, ...]:
        """Each plane as ``[blocks, block_bytes / word]`` words of ``word`` bytes (which must
        divide the set's own alignment), for the torch ops."""
        got = self._views.get(word)
        if got is None:
            got = tuple(
                torch.empty(0, dtype=_WORD_DTYPES[word], device=self.device).set_(
                    t.untyped_storage(), start // word, (self.num_blocks, size // word), (stride // word, 1))
                for t, start, size, stride in zip(self.planes, self._starts, self.block_bytes.tolist(),
                                                  self._strides, strict=True))
            self._views[word] = got
        return got


# -- checks --------------------------------------------------------------------------------------


def _indices(value: object, what: str, limit: int, limit_what: str) -> np.ndarray:
    """``value`` as a 1-d int64 array of values in ``[0, limit)``; raises naming ``what``."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(f"{what} is a tensor on {value.device}; pass host integers (checking a device "
                            "tensor's range would wait for the device)")
        value = value.numpy()
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-d, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what} must be integers, got {arr.dtype}")
    if arr.dtype == np.uint64 and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{what} holds {int(arr.max())}, out of range [0, {limit}) ({limit_what})")
    arr = arr.astype(np.int64, copy=False)
    if int(arr.min()) < 0 or int(arr.max()) >= limit:
        bad = arr[(arr < 0) | (arr >= limit)]
        raise ValueError(f"{what} holds {bad[:8].tolist()}, out of range [0, {limit}) ({limit_what})")
    return arr


def _distinct(arr: np.ndarray, limit: int, what: str) -> None:
    """Raises unless the values of ``arr`` (all in ``[0, limit)``) are distinct."""
    if arr.size < 2:
        return
    if limit <= 16 * arr.size + 65536:  # a mark per value: linear, no sort
        seen = np.zeros(limit, dtype=bool)
        seen[arr] = True
        if int(np.count_nonzero(seen)) == arr.size:
            return
    s = np.sort(arr)
    twice = s[1:][s[1:] == s[:-1]]
    if twice.size:
        raise ValueError(f"{what} repeats {np.unique(twice)[:8].tolist()}; each may be written once per call")


def _rows(buf: object, planes: PlaneSet, what: str) -> torch.Tensor:
    """``buf`` checked as a row buffer for ``planes``."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{what} is a {type(buf).__name__}, not a torch.Tensor")
    if buf.dtype not in (torch.uint8, planes.dtype):
        raise TypeError(f"{what} is {buf.dtype}; a row buffer is uint8 or the planes' dtype ({planes.dtype})")
    if buf.dim() < 1:
        raise ValueError(f"{what} is a 0-d tensor; dim 0 of a row buffer is the row index")
    row = math.prod(buf.shape[1:]) * buf.element_size()
    if row != planes.row_bytes:
        raise ValueError(f"{what} has rows of {row} bytes (shape {tuple(buf.shape)}, {buf.dtype}); "
                         f"a row of these planes is {planes.row_bytes} bytes")
    if not buf.is_contiguous():
        raise ValueError(f"{what} is not contiguous (strides {buf.stride()}); a row buffer's rows are packed")
    if planes.device.type == "cuda":
        if buf.device.type == "cpu":
            if buf.numel() and not buf.is_pinned():
                raise ValueError(f"{what} is in pageable host memory; CUDA planes copy to pinned host rows only "
                                 "(allocate it with pin_memory=True)")
        elif buf.device != planes.device:
            raise ValueError(f"{what} is on {buf.device} but the planes on {planes.device}")
    elif buf.device != planes.device:
        raise ValueError(f"{what} is on {buf.device} but the planes on {planes.device}")
    return buf


def _check(planes: object, block_ids: object, buf: object, rows: object, to_rows: bool,
           stream: object) -> tuple[np.ndarray, np.ndarray | None, torch.Tensor]:
    """The call's arguments, checked: block ids, rows (``None``: 0, 1, ...) and the buffer."""
    if not isinstance(planes, PlaneSet):
        raise TypeError(f"planes must be a PlaneSet, got {type(planes).__name__}")
    side, rows_name = ("out", "out_rows") if to_rows else ("inp", "in_rows")
    tensor = _rows(buf, planes, side)
    ids = _indices(block_ids, "block_ids", planes.num_blocks, "the planes' blocks")
    n_rows = int(tensor.shape[0])
    picked = None
    if rows is None:
        if ids.size > n_rows:
            raise ValueError(f"{ids.size} block ids but {side} has {n_rows} rows")
    else:
        picked = _indices(rows, rows_name, n_rows, f"the rows of {side}")
        if picked.size != ids.size:
            raise ValueError(f"{picked.size} {rows_name} for {ids.size} block ids; one row per block")
        if to_rows:
            _distinct(picked, n_rows, "out_rows")
    if not to_rows:
        _distinct(ids, planes.num_blocks, "block_ids of a scatter")
    if stream is not None:
        if planes.device.type != "cuda":
            raise ValueError(f"a stream orders CUDA copies; these planes are on {planes.device}")
        if not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
        if stream.device != planes.device:
            raise ValueError(f"stream is on {stream.device} but the planes on {planes.device}")
    return ids, picked, tensor


# -- the copies ----------------------------------------------------------------------------------


def gather(planes: PlaneSet, block_ids: Any, out: torch.Tensor, out_rows: Any = None, *,
           stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Row ``out_rows[i]`` (``i`` when ``None``) of ``out`` := block ``block_ids[i]`` of every
    plane. Only the listed rows of ``out`` change. On CUDA returns the event that completes with
    the copy (queued on ``stream``); on the CPU the copy is done on return."""
    ids, rows, tensor = _check(planes, block_ids, out, out_rows, True, stream)
    return _run(planes, ids, rows, tensor, True, stream)


def scatter(inp: torch.Tensor, in_rows: Any, planes: PlaneSet, block_ids: Any, *,
            stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Block ``block_ids[i]`` of every plane := row ``in_rows[i]`` (``i`` when ``None``) of
    ``inp``. Only the listed blocks change. On CUDA returns the event that completes with the
    copy (queued on ``stream``); on the CPU the copy is done on return."""
    ids, rows, tensor = _check(planes, block_ids, inp, in_rows, False, stream)
    return _run(planes, ids, rows, tensor, False, stream)


def _pairs(ids: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """``[n, 2]`` int64: block id, row."""
    pairs = np.empty((ids.size, 2), dtype=np.int64)
    pairs[:, 0] = ids
    pairs[:, 1] = np.arange(ids.size) if rows is None else rows
    return pairs


def _run(planes: PlaneSet, ids: np.ndarray, rows: np.ndarray | None, buf: torch.Tensor, to_rows: bool,
         stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    impl = _choose()[0]
    if planes.device.type != "cuda":
        if ids.size:
            pairs = torch.from_numpy(_pairs(ids, rows))
            if impl is _Impl.TRITON and _interpreting():
                _launch(planes, pairs, ids.size, buf.data_ptr(), to_rows)
            else:
                _torch_copy(planes, pairs[:, 0], pairs[:, 1], buf, to_rows)
        return None
    # Each context costs microseconds a call: entered only when the call needs it.
    index = planes.device.index
    with contextlib.ExitStack() as scope:
        if index is not None and index != torch.cuda.current_device():
            scope.enter_context(torch.cuda.device(index))
        if stream is not None:
            scope.enter_context(torch.cuda.stream(stream))
        if ids.size:
            if buf.device.type == "cuda":
                _device_copy(planes, _upload(_pairs(ids, rows), planes.device), ids.size, buf, 0, to_rows, impl)
            elif _HOST_DIRECT and impl is _Impl.TRITON:
                _device_copy(planes, _upload(_pairs(ids, rows), planes.device), ids.size, buf, 0, to_rows, impl)
            else:
                _SCRATCH.through(planes, ids, rows, buf, to_rows, impl)
        event = torch.cuda.Event()
        event.record()
    return event


def _upload(pairs: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device, queued on the current stream: through pinned memory, so the
    copy neither waits for the stream nor lets the host buffer be reused before it ran."""
    return torch.from_numpy(pairs).pin_memory().to(device, non_blocking=True)


def _device_copy(planes: PlaneSet, pairs: torch.Tensor, n: int, buf: torch.Tensor, shift: int, to_rows: bool,
                 impl: _Impl) -> None:
    """Between CUDA planes and rows ``pairs[:, 1] - shift`` of ``buf`` (device rows, or pinned
    host rows for the kernel), on the current stream; ``pairs`` is on the device."""
    if impl is _Impl.TRITON:
        _launch(planes, pairs, n, buf.data_ptr() - shift * planes.row_bytes, to_rows)
    else:
        _torch_copy(planes, pairs[:, 0], pairs[:, 1] - shift if shift else pairs[:, 1], buf, to_rows)


def _torch_copy(planes: PlaneSet, ids: torch.Tensor, rows: torch.Tensor, buf: torch.Tensor, to_rows: bool) -> None:
    word = _word(planes._word, buf.data_ptr(), planes.row_bytes)
    flat = torch.empty(0, dtype=_WORD_DTYPES[word], device=buf.device).set_(
        buf.untyped_storage(), buf.storage_offset() * buf.element_size() // word,
        (int(buf.shape[0]), planes.row_bytes // word), (planes.row_bytes // word, 1))
    for view, off, size in zip(planes.views(word), planes.offsets.tolist(), planes.block_bytes.tolist(), strict=True):
        part = flat[:, off // word:(off + size) // word]
        if to_rows:
            part.index_copy_(0, rows, view.index_select(0, ids))
        else:
            view.index_copy_(0, ids, part.index_select(0, rows))


def _launch(planes: PlaneSet, pairs: torch.Tensor, n: int, addr: int, to_rows: bool) -> None:
    """One launch of the Triton kernel for ``n`` pairs, every plane, rows at ``addr``."""
    assert planes._table is not None and _kernel is not None
    word = _word(planes._word, addr, planes.row_bytes)
    aligned = word == 8 and planes._aligned16 and addr % 16 == 0 and planes.row_bytes % 16 == 0
    # A chunk no longer than a block, so blocks of a power-of-two size copy without masks; not
    # under 512 bytes, so few variants are compiled.
    chunk = max(512, min(_CHUNK_BYTES, 1 << (planes._longest.bit_length() - 1))) // word
    grid = (n * len(planes.planes), -(-(planes._longest // word) // chunk))
    _kernel[grid](planes._table, pairs, addr, planes.row_bytes, len(planes.planes),
                  TO_ROWS=to_rows, WORD=word, WTYPE=_word_types[word], CHUNK=chunk, ALIGNED=aligned,
                  num_warps=_NUM_WARPS)


def _runs(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and stops (positions in ``rows``) of the runs of consecutive values in ``rows``."""
    cuts = np.flatnonzero(np.diff(rows) != 1) + 1
    return np.concatenate([[0], cuts]), np.concatenate([cuts, [rows.size]])


class _Scratch:
    """The device buffers a copy between CUDA planes and host rows goes through, one per device,
    allocated on first use and kept. A call holds the lock while it queues its work; a call on
    another stream first waits (on the device) for the event of the last call's work."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffers: dict[int, torch.Tensor] = {}
        self._last: dict[int, torch.cuda.Event] = {}
        self._retired: list[torch.Tensor] = []

    def through(self, planes: PlaneSet, ids: np.ndarray, rows: np.ndarray | None, host: torch.Tensor,
                to_rows: bool, impl: _Impl) -> None:
        """The copy, on the current stream, in chunks of rows whose span fits the scratch: a
        gather fills scratch rows (row - the chunk's first row), then one DMA per run of
        consecutive rows; a scatter takes one DMA of the chunk's span, then scatters."""
        row = planes.row_bytes
        index = planes.device.index if planes.device.index is not None else torch.cuda.current_device()
        if rows is None:
            rows = np.arange(ids.size, dtype=np.int64)
        else:
            order = np.argsort(rows, kind="stable")
            ids, rows = ids[order], rows[order]
        host_bytes = torch.empty(0, dtype=torch.uint8).set_(
            host.untyped_storage(), host.storage_offset() * host.element_size(), (int(host.shape[0]), row), (row, 1))
        pairs = _upload(_pairs(ids, rows), planes.device)  # one upload; each chunk reads its slice
        stream = torch.cuda.current_stream()
        with self._lock:
            scratch = self._buffers.get(index)
            if scratch is None or scratch.numel() < row:  # grows to one row, for rows over the bound
                if scratch is not None:
                    # kept: work queued on other streams may still use it, unknown to the allocator
                    self._retired.append(scratch)
                scratch = self._buffers[index] = torch.empty(max(SCRATCH_BYTES, row), dtype=torch.uint8,
                                                             device=planes.device)
            capacity = scratch.numel() // row
            rows_view = scratch[:capacity * row].view(capacity, row)
            last = self._last.get(index)
            if last is not None:
                stream.wait_event(last)
            a = 0
            while a < rows.size:
                # the next chunk: the rows whose span from the chunk's first row fits the scratch
                b = int(np.searchsorted(rows, rows[a] + capacity, side="left"))
                low = int(rows[a])
                if to_rows:
                    _device_copy(planes, pairs[a:b], b - a, rows_view, low, True, impl)
                    starts, stops = _runs(rows[a:b])
                    for s, e in zip(starts.tolist(), stops.tolist(), strict=True):
                        first = int(rows[a + s]) - low
                        host_bytes[low + first:low + first + e - s].copy_(rows_view[first:first + e - s],
                                                                          non_blocking=True)
                else:
                    span = int(rows[b - 1]) - low + 1
                    rows_view[:span].copy_(host_bytes[low:low + span], non_blocking=True)
                    _device_copy(planes, pairs[a:b], b - a, rows_view, low, False, impl)
                a = b
            event = torch.cuda.Event()
            event.record(stream)
            self._last[index] = event


_SCRATCH = _Scratch()


# -- spans by address: between a device's memory and pinned host memory ---------------------------

_spans_lock = threading.Lock()
_spans_kernel: Any = None


def _build_spans_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def spans_kernel(table, WORD: tl.constexpr, WTYPE: tl.constexpr, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
        # program (span i, lane c): words c*CHUNK, (c + lanes)*CHUNK, ... of span i, where
        # table[i] = (target address, source address, bytes).
        i = tl.program_id(0).to(tl.int64)
        words = tl.load(table + 3 * i + 2) // WORD
        dst = tl.load(table + 3 * i).to(tl.pointer_type(WTYPE))
        src = tl.load(table + 3 * i + 1).to(tl.pointer_type(WTYPE))
        if ALIGNED:  # every address and size is a multiple of 16: 16-byte accesses
            dst = tl.multiple_of(dst, 16)
            src = tl.multiple_of(src, 16)
        step = tl.num_programs(1).to(tl.int64) * CHUNK
        for start in range(tl.program_id(1).to(tl.int64) * CHUNK, words, step):
            offs = start + tl.arange(0, CHUNK)
            if start + CHUNK <= words:  # a whole chunk: no mask, so the accesses stay wide
                tl.store(dst + offs, tl.load(src + offs))
            else:
                mask = offs < words
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    global _word_types
    _word_types = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}
    return spans_kernel


def _spans_launcher() -> Any:
    global _spans_kernel
    with _spans_lock:
        if _spans_kernel is None:
            _spans_kernel = _build_spans_kernel()
        return _spans_kernel


class _CudaBytes:
    """``bytes`` bytes at a CUDA address, as ``torch.as_tensor`` takes them (the CUDA array
    interface): for the fallback, which copies span by span."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def _span_table(targets: Any, sources: Any, sizes: Any) -> np.ndarray:
    """(target, source, bytes) of each span that moves bytes, after the checks of ``copy_spans``."""
    if not len(targets) == len(sources) == len(sizes):
        raise ValueError(f"copy_spans: {len(targets)} targets, {len(sources)} sources and {len(sizes)} sizes; "
                         "give one of each per span")
    table = np.empty((len(sizes), 3), dtype=np.int64)
    try:
        table[:, 0], table[:, 1], table[:, 2] = targets, sources, sizes
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"copy_spans: {len(targets)} targets, {len(sources)} sources and {len(sizes)} sizes: "
                         f"give one int each per span ({exc})") from None
    if table.size and (table[:, 2] < 0).any():
        i = int(np.argmax(table[:, 2] < 0))
        raise ValueError(f"copy_spans: span {i} has {int(table[i, 2])} bytes; a size is >= 0")
    moving = table[:, 2] > 0
    bad = moving & (table[:, :2] <= 0).any(axis=1)
    if bad.any():
        i = int(np.argmax(bad))  # the span's index in the call, empty spans counted
        raise ValueError(f"copy_spans: span {i} names address {int(table[i, :2].min())}; addresses are > 0")
    return table if moving.all() else np.ascontiguousarray(table[moving])


def copy_spans(targets: Sequence[int] | np.ndarray, sources: Sequence[int] | np.ndarray,
               sizes: Sequence[int] | np.ndarray, *, device: int, to_device: bool,
               stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    """Copy ``sizes[i]`` bytes from address ``sources[i]`` to ``targets[i]`` for every span, between
    memory of CUDA device ``device`` and pinned host memory (``to_device``: the targets are the
    device's, the sources pinned host memory; else the other way). The spans must not overlap
    each other's targets. Queued on ``stream`` (default: the device's current stream); the event
    returned completes with the copy, and the caller keeps both sides' memory until then.

    With Triton, one launch for the whole batch: each program copies a chunk of one span in words
    as wide as every address and size allows, the kernel reaching host memory through the bus
    (pinned memory is mapped for the device). Without it, one torch copy per span (correct,
    slow). Bad arguments raise ``ValueError`` and copy nothing."""
    if not torch.cuda.is_available():
        raise ValueError("copy_spans: no CUDA device here; it copies between a device and pinned host memory")
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < torch.cuda.device_count():
        raise ValueError(f"copy_spans: device {device!r} is not a CUDA device index here "
                         f"(0-{torch.cuda.device_count() - 1})")
    table = _span_table(targets, sources, sizes)
    impl = _choose()[0]
    with torch.cuda.device(device):
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if table.shape[0]:
                if impl is _Impl.TRITON:
                    _launch_spans(table, torch.device("cuda", device))
                else:
                    _torch_spans(table, device, to_device)
            event = torch.cuda.Event()
            event.record()
    return event


def _launch_spans(table: np.ndarray, device: torch.device) -> None:
    kernel = _spans_launcher()
    grid, constants = _spans_launch(table)
    kernel[grid](_upload(table, device), **constants)


def _spans_launch(table: np.ndarray) -> tuple[tuple[int, int], dict[str, Any]]:
    """The spans kernel's grid and constants for a table of non-empty spans: the widest word
    every address and size allows, chunks of at most ``_CHUNK_BYTES``, lanes enough for the
    longest span (the tests launch it with these on the CPU under ``TRITON_INTERPRET=1``)."""
    _spans_launcher()  # defines the word types
    bits = int(np.bitwise_or.reduce(table, axis=None))
    word = _word(bits)
    longest = int(table[:, 2].max())
    chunk = max(512, min(_CHUNK_BYTES, 1 << (longest.bit_length() - 1))) // word
    lanes = min(65535, -(-(longest // word) // chunk))
    return (table.shape[0], lanes), {"WORD": word, "WTYPE": _word_types[word], "CHUNK": chunk,
                                     "ALIGNED": bits % 16 == 0, "num_warps": _NUM_WARPS}


def _torch_spans(table: np.ndarray, device: int, to_device: bool) -> None:
    import ctypes

    for target, source, size in table.tolist():
        dev, host = (target, source) if to_device else (source, target)
        on_device = torch.as_tensor(_CudaBytes(dev, size), device=f"cuda:{device}")
        on_host = torch.frombuffer((ctypes.c_char * size).from_address(host), dtype=torch.uint8)
        if to_device:
            on_device.copy_(on_host)
        else:
            on_host.copy_(on_device)
