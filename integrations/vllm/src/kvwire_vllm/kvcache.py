"""vLLM's paged KV tensors as kvwire sees them: planes, the regions registered with a backend, and
what a store holds per block. Imports no vLLM.

vLLM 0.32 hands ``register_kv_caches`` one tensor per attention layer, the logical view
``[blocks, kv_heads, block_size, 2 * head_dim]`` (K and V of a head side by side in the last
dimension), laid out in memory as the engine's resolved ``KVCacheLayout`` says (its name is
``cache_config.kv_cache_layout``): ``LBNHC`` (FlashAttention's and FlashInfer's default on CUDA,
tokens before heads), ``LBHNC`` (the CPU build's, heads before tokens), the block-outer ``BLNHC``
/ ``BLHNC`` (a block of every layer side by side), ``LHBNC`` and ``BHLNC``. Older CUDA
backends gave per-layer tensors with K and V apart: FlashAttention's ``(2, blocks, block_size,
kv_heads, head_dim)`` and FlashInfer's HND ``(blocks, 2, kv_heads, block_size, head_dim)``.

Each layer's tensor is cut into *planes* (:mod:`kvwire.lender.blockcopy`'s word): tensors whose
dim 0 is the block and whose block is one contiguous span. A layer whose block is one span is one
plane; otherwise it is cut along its outermost in-block dimension until every piece is (K and V
of the K/V-split layout, the heads of ``LHBNC`` and ``BHLNC``). The planes in layer order, and
within a layer in index order of the cut dimensions, make a block's *row*: plane 0's block bytes,
then plane 1's, and so on.

What a store holds per block (:class:`Grouping`) follows from how the cache reaches the backend:

- ``PLANE``: the backend moves vLLM's memory itself (the CPU build's host tensors, or CUDA
  tensors with a backend that declares DEVICE memory) and every plane's blocks lie at a stride of
  their own size: one region per plane, its slots vLLM's blocks; group ``g`` of a name is plane
  ``g``'s block (for the 0.32 layouts but ``LHBNC``, one group per layer).
- ``BLOCK``: one group whose row is the whole row above. Either vLLM's memory already holds
  each row as one span (the block-outer layouts, moved directly), or the cache is staged through
  pinned host slots (:mod:`kvwire_vllm.staging`), one slot per block across every layer.

With ``PLANE`` rows the store would keep one object per block and plane (64 for a 32-layer model).
A store that names the ``block-objects`` protocol (contract K1) keeps them as one object per block
instead: every store hint then carries the block layout of the groups
(:meth:`StoreRows.block_layout`), and a fetch reads all groups of a block or none.

Both sides of the connector derive the grouping from vLLM's config (:func:`store_rows`), the
scheduler to ask the store about the right groups, the worker to check that the tensors it got
are what the config says; the grouping and the layout's name are part of the names' scope, so
two engines find each other's blocks only where the bytes mean the same."""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvwire.contract import MemoryKind, SlotRegion
from kvwire.contract.blocks import BLOCK_OBJECTS, block_layout

__all__ = ["Grouping", "StoreRows", "PagedCache", "store_rows", "LAYOUTS", "MAX_PLANES_PER_LAYER"]

#: vLLM 0.32's ``KVCacheLayout`` names, with how vLLM's own memory can be registered: one region per
#: plane (``PLANE``, with one plane per layer, or per layer and KV head: ``"heads"``), one region of
#: whole rows (``BLOCK``), or not at all (``None``: only through staging).
LAYOUTS: Mapping[str, tuple[str | None, str]] = {
    "LBNHC": ("plane", "1"),
    "LBHNC": ("plane", "1"),
    "LHBNC": ("plane", "heads"),
    "BLNHC": ("block", "1"),
    "BLHNC": ("block", "1"),
    "BHLNC": (None, "heads"),  # a block's bytes are one span, but heads-major: not in row order
}

#: A layer cut into more planes than this is refused (a layout kvwire-vllm does not know).
MAX_PLANES_PER_LAYER = 64


class Grouping(enum.StrEnum):
    """What one store object holds: a plane's block (``PLANE``) or a whole row (``BLOCK``)."""

    PLANE = "plane"
    BLOCK = "block"


@dataclass(frozen=True, slots=True)
class StoreRows:
    """How a cache's blocks are grouped at the store, and whether the worker stages them.
    ``row_bytes`` is each group's row size (``()``: not known); ``block_objects``: the store
    keeps all groups of a block as one object (contract K1), asked for by the block layout
    :meth:`block_layout` in every store hint."""

    grouping: Grouping
    groups: tuple[int, ...]
    staged: bool
    row_bytes: tuple[int, ...] = ()
    block_objects: bool = False

    def describe(self) -> str:
        """What goes into the names' scope (staged and direct ``BLOCK`` rows are the same bytes)."""
        return self.grouping.value

    def block_layout(self) -> str:
        """The K1 block layout of these groups (``"0:4096,1:4096,..."``)."""
        if len(self.row_bytes) != len(self.groups):
            raise ValueError(f"the row size of each of the {len(self.groups)} group(s) is not known")
        return block_layout(zip(self.groups, self.row_bytes, strict=True))

    def with_block_objects(self, protocols: Collection[str], other_end_is_store: bool) -> StoreRows:
        """These rows, keeping a block's groups as one object where that means fewer objects (more
        than one group) and the backend is a store that names the ``block-objects`` protocol."""
        use = other_end_is_store and BLOCK_OBJECTS in protocols and len(self.groups) > 1
        return replace(self, block_objects=use)


def store_rows(layout: str | None, *, cuda: bool, memory_kinds: Collection[MemoryKind], num_layers: int,
               num_kv_heads: int, page_bytes: int = 0) -> StoreRows:
    """The grouping a cache of ``layout`` (vLLM's resolved layout name; ``None``: one plane per
    layer, as vLLM before 0.32) gets with a backend moving ``memory_kinds``; ``page_bytes`` (one
    layer's block, vLLM's ``page_size_bytes``; 0: not known) gives each group's row size. Raises
    ``ValueError`` for a layout name it does not know or a backend that can reach neither the
    cache's memory nor host staging slots."""
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"KV cache layout {layout!r} is not one kvwire-vllm knows ({', '.join(LAYOUTS)})")
    direct, per_layer = LAYOUTS[layout] if layout is not None else ("plane", "1")
    direct_kind = MemoryKind.DEVICE if cuda else MemoryKind.HOST
    whole = (page_bytes * num_layers,) if page_bytes > 0 else ()
    if direct is not None and direct_kind in memory_kinds:
        if direct == "block":
            return StoreRows(Grouping.BLOCK, (0,), staged=False, row_bytes=whole)
        per = num_kv_heads if per_layer == "heads" else 1
        planes = num_layers * per
        sizes = (page_bytes // per,) * planes if page_bytes > 0 and page_bytes % per == 0 else ()
        return StoreRows(Grouping.PLANE, tuple(range(planes)), staged=False, row_bytes=sizes)
    if MemoryKind.HOST not in memory_kinds:
        raise ValueError(f"the backend moves {sorted(k.name for k in memory_kinds)} memory only; a KV cache on "
                         f"{'a CUDA device' if cuda else 'the host'} in layout {layout} needs "
                         f"{direct_kind.name} memory, or HOST memory for staging slots")
    return StoreRows(Grouping.BLOCK, (0,), staged=True, row_bytes=whole)


def _dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether elements of these sizes and strides fill one span exactly, in some order."""
    dims = sorted((st, sz) for sz, st in zip(sizes, strides, strict=True) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _cut(t: torch.Tensor, limit: int) -> list[torch.Tensor]:
    """``t`` (dim 0 the block) as planes whose block is one span: cut along the outermost
    in-block dimension until each piece is dense; ``[]`` once more than ``limit`` pieces."""
    if _dense(t.shape[1:], t.stride()[1:]):
        return [t]
    dims = [d for d in range(1, t.dim()) if t.shape[d] != 1]
    d = max(dims, key=lambda k: t.stride(k))
    if t.stride(d) <= 0:
        return []
    pieces: list[torch.Tensor] = []
    for i in range(t.shape[d]):
        more = _cut(t.select(d, i), limit - len(pieces))
        if not more or len(pieces) + len(more) > limit:
            return []
        pieces += more
    return pieces


def _block_dim(t: torch.Tensor, num_blocks: int | None) -> int:
    """Dim 0, except FlashAttention's K/V-split ``(2, blocks, ...)``, whose blocks are dim 1."""
    if t.dim() == 5 and t.shape[0] == 2:
        zero_fits = num_blocks is not None and t.shape[0] % num_blocks == 0
        if not zero_fits and (num_blocks is None or t.shape[1] % num_blocks == 0):
            return 1
    return 0


def _describe(name: str, t: torch.Tensor) -> str:
    return f"layer {name}: KV cache of shape {tuple(t.shape)}, strides {t.stride()}, {t.dtype} on {t.device}"


class PagedCache:
    """vLLM's KV cache of one worker, as planes (:mod:`kvwire.lender.blockcopy`) in row order,
    checked once: one device and dtype, every layer's blocks in planes of contiguous spans, no two
    layers sharing memory. The tensors must keep their storage while it is used."""

    __slots__ = ("layers", "planes", "plane_layer", "num_blocks", "device", "dtype", "plane_bytes", "row_bytes")

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], layers: Sequence[str],
                 num_blocks: int | None = None) -> None:
        missing = [name for name in layers if name not in kv_caches]
        if missing:
            raise ValueError(f"vLLM registered no KV cache for layer(s) {missing}; it registered {sorted(kv_caches)}")
        if not layers:
            raise ValueError("a KV cache needs at least one layer")
        planes: list[torch.Tensor] = []
        owner: list[int] = []
        first = kv_caches[layers[0]]
        for index, name in enumerate(layers):
            t = kv_caches[name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"layer {name}: KV cache is a {type(t).__name__}, not a torch.Tensor")
            if t.device != first.device or t.dtype != first.dtype:
                raise ValueError(f"{_describe(name, t)}; layer {layers[0]} is {first.dtype} on {first.device}: "
                                 "kvwire-vllm needs one device and dtype for every layer")
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{_describe(name, t)}: kvwire-vllm moves host and CUDA memory only")
            if t.dim() < 2 or t.numel() == 0:
                raise ValueError(f"{_describe(name, t)}: not a paged cache of blocks")
            bdim = _block_dim(t, num_blocks)
            view = t.movedim(bdim, 0)
            blocks = view.shape[0]
            if num_blocks is not None and blocks != num_blocks:
                if blocks % num_blocks:
                    raise ValueError(f"{_describe(name, t)}: {blocks} blocks in dim {bdim}, but vLLM allocated "
                                     f"{num_blocks}")
                view = view.unflatten(0, (num_blocks, blocks // num_blocks))  # kernel blocks of one block
            pieces = _cut(view, MAX_PLANES_PER_LAYER)
            if not pieces:
                raise ValueError(f"{_describe(name, t)}: a block (dim {bdim}) is neither one contiguous span nor "
                                 f"at most {MAX_PLANES_PER_LAYER} planes of contiguous spans (K and V, or heads); "
                                 "kvwire-vllm does not know this layout")
            planes += pieces
            owner += [index] * len(pieces)
        self.layers = tuple(layers)
        self.planes = tuple(planes)
        self.plane_layer = tuple(owner)
        self.num_blocks = int(planes[0].shape[0])
        self.device = first.device
        self.dtype = first.dtype
        el = first.element_size()
        self.plane_bytes = tuple(math.prod(p.shape[1:]) * el for p in planes)
        self.row_bytes = sum(self.plane_bytes)
        self._check_disjoint()

    def _strides(self) -> list[int]:
        return [p.stride(0) * p.element_size() for p in self.planes]

    def _check_disjoint(self) -> None:
        """No byte in two (plane, block) spans: a shared byte means two layers share KV memory."""
        strides = self._strides()
        bases = np.array([p.data_ptr() for p in self.planes], dtype=np.int64)
        sizes = np.array(self.plane_bytes, dtype=np.int64)
        for k, (s, b) in enumerate(zip(strides, self.plane_bytes, strict=True)):
            if self.num_blocks > 1 and s < b:
                name = self.layers[self.plane_layer[k]]
                raise ValueError(f"layer {name}: blocks of {b} bytes lie {s} bytes apart, so they overlap")
        ends = bases + (self.num_blocks - 1) * np.array(strides, dtype=np.int64) + sizes
        order = np.argsort(bases, kind="stable")
        if np.all(bases[order][1:] >= ends[order][:-1]):
            return  # every plane's extent apart from the others (layer-outer layouts): done
        starts = (bases[None, :] + np.arange(self.num_blocks, dtype=np.int64)[:, None] * np.array(strides)).ravel()
        lengths = np.broadcast_to(sizes, (self.num_blocks, len(self.planes))).ravel()
        owners = np.broadcast_to(np.arange(len(self.planes)), (self.num_blocks, len(self.planes))).ravel()
        by = np.argsort(starts, kind="stable")
        clash = np.flatnonzero(starts[by][1:] < (starts + lengths)[by][:-1])
        if clash.size:
            a, b = owners[by][clash[0]], owners[by][clash[0] + 1]
            raise ValueError(f"layers {self.layers[self.plane_layer[a]]} and {self.layers[self.plane_layer[b]]} "
                             "share KV memory; kvwire-vllm needs one cache per layer")

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def describe(self) -> str:
        """The layers' shapes and strides, for messages."""
        return f"{len(self.planes)} planes of {self.num_blocks} blocks, {self.row_bytes} bytes a row, " \
               f"{self.dtype} on {self.device}"

    def grouping(self) -> Grouping | None:
        """How vLLM's own memory can be registered: a region per plane, one region of whole rows,
        or ``None`` (only through staging)."""
        strides = self._strides()
        if all(s == b for s, b in zip(strides, self.plane_bytes, strict=True)):
            return Grouping.PLANE
        base = self.planes[0].data_ptr()
        offsets = np.concatenate([[0], np.cumsum(self.plane_bytes)[:-1]])
        if all(s == self.row_bytes for s in strides) and all(
                p.data_ptr() == base + int(off) for p, off in zip(self.planes, offsets, strict=True)):
            return Grouping.BLOCK
        return None

    def regions(self) -> tuple[SlotRegion, ...]:
        """vLLM's memory as the regions :meth:`grouping` says (region id = group id); raises
        ``ValueError`` where it can only be staged."""
        grouping = self.grouping()
        kind = MemoryKind.DEVICE if self.on_cuda else MemoryKind.HOST
        device = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if self.on_cuda else None
        if grouping is Grouping.PLANE:
            return tuple(SlotRegion(i, p.data_ptr(), b, self.num_blocks, kind, device)
                         for i, (p, b) in enumerate(zip(self.planes, self.plane_bytes, strict=True)))
        if grouping is Grouping.BLOCK:
            return (SlotRegion(0, self.planes[0].data_ptr(), self.row_bytes, self.num_blocks, kind, device),)
        raise ValueError(f"the KV cache ({self.describe()}) keeps no plane's blocks, nor whole rows, at a stride of "
                         "their own size: it can only be staged")
