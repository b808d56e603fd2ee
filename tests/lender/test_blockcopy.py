"""kvwire.lender.blockcopy, bit for bit: gathers and scatters by random block tables in the three
KV layouts (the CPU build's, FlashAttention's K/V halves, FlashInfer's HND, also as a permuted
view), with block sizes that are not multiples of 8 bytes, repeated ids, empty tables, against
a reference that reads each block's bytes straight from the tensor's storage. Each case runs on
every implementation there is here (the torch fallback always; the Triton kernel on a CUDA
device, or on the CPU under ``TRITON_INTERPRET=1``) and on CUDA where there is a device. Bad
input is refused, naming the problem, before anything is copied."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.lender import blockcopy
from kvwire.lender.blockcopy import PlaneSet, gather, scatter

HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda_only = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]


def implementations(device: str) -> list[str]:
    """The implementations that copy ``device`` tensors here."""
    triton_runs = HAS_TRITON and (device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    return ["torch", "triton"] if triton_runs else ["torch"]


CASES = [(d, i) for d in ("cpu", "cuda") for i in implementations(d)
         if d == "cpu" or torch.cuda.is_available()]


@functools.cache
def _kernel() -> object:
    return blockcopy._build_kernel()


@contextlib.contextmanager
def using(impl: str) -> Iterator[None]:
    """Copies in the block go through ``impl`` ("torch" or "triton")."""
    saved = blockcopy._choice, blockcopy._kernel
    if impl == "triton":
        blockcopy._kernel = _kernel()
        blockcopy._choice = (blockcopy._Impl.TRITON, "triton (test)")
    else:
        blockcopy._choice = (blockcopy._Impl.TORCH, "torch (test)")
    try:
        yield
    finally:
        blockcopy._choice, blockcopy._kernel = saved


# -- the reference: a block's bytes, read from its tensor's storage ----------------------------


def storage_bytes(t: torch.Tensor) -> np.ndarray:
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    return raw.cpu().numpy()


def block_of(t: torch.Tensor, b: int, raw: np.ndarray | None = None) -> np.ndarray:
    """The bytes of block ``b`` of plane ``t``, in memory order."""
    el = t.element_size()
    raw = storage_bytes(t) if raw is None else raw
    start = (t.storage_offset() + b * t.stride(0)) * el
    return raw[start:start + math.prod(t.shape[1:]) * el]


def row_of(planes: list[torch.Tensor], b: int) -> np.ndarray:
    return np.concatenate([block_of(t, b) for t in planes])


def random_bytes(t: torch.Tensor, seed: int) -> None:
    """Fills the tensor's whole storage with random bytes (NaN patterns too): only a byte copy agrees."""
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen).to(t.device))


def host_rows(buf: torch.Tensor) -> np.ndarray:
    row = math.prod(buf.shape[1:]) * buf.element_size()
    return buf.cpu().contiguous().view(torch.uint8).reshape(buf.shape[0], row).numpy()


# -- the layouts ---------------------------------------------------------------------------------

LAYOUTS = ("cpu", "flash_attn", "flashinfer_hnd", "hnd_as_nhd_view")
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8)


def make_planes(layout: str, layers: int, blocks: int, bs: int, heads: int, dim: int, dtype: torch.dtype,
                device: str, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the layers' tensors, their planes in row order) in one of vLLM's KV layouts."""
    tensors, planes = [], []
    for layer in range(layers):
        if layout == "cpu":
            t = torch.empty((blocks, 2, bs, heads * dim), dtype=dtype, device=device)
            parts = [t]
        elif layout == "flash_attn":
            t = torch.empty((2, blocks, bs, heads, dim), dtype=dtype, device=device)
            parts = [t[0], t[1]]
        elif layout == "flashinfer_hnd":
            t = torch.empty((blocks, 2, heads, bs, dim), dtype=dtype, device=device)
            parts = [t]
        else:  # HND memory seen through an NHD-shaped view (a permutation): blocks still dense
            t = torch.empty((blocks, 2, heads, bs, dim), dtype=dtype, device=device).permute(0, 1, 3, 2, 4)
            parts = [t]
        random_bytes(t, seed * 1000 + layer)
        tensors.append(t)
        planes.extend(parts)
    return tensors, planes


shapes = st.fixed_dictionaries({
    "layout": st.sampled_from(LAYOUTS),
    "layers": st.integers(1, 3),
    "blocks": st.integers(1, 12),
    "bs": st.integers(1, 5),
    "heads": st.integers(1, 3),
    "dim": st.integers(1, 9),
    "dtype": st.sampled_from(DTYPES),
})


# -- bit for bit ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "impl"), CASES)
@settings(max_examples=60, deadline=None)
@given(shape=shapes, data=st.data())
def test_gather_puts_each_listed_block_in_its_row_and_leaves_other_rows(device, impl, shape, data):
    _, planes = make_planes(**shape, device=device, seed=1)
    blocks = shape["blocks"]
    ids = data.draw(st.lists(st.integers(0, blocks - 1), max_size=2 * blocks), label="block ids")
    extra = data.draw(st.integers(0, 3), label="spare rows")
    n_rows = len(ids) + extra
    explicit = data.draw(st.booleans(), label="rows given")
    rows = (data.draw(st.permutations(range(n_rows)), label="rows")[:len(ids)] if explicit
            else list(range(len(ids))))
    buf_dtype = data.draw(st.sampled_from((torch.uint8, shape["dtype"])), label="buffer dtype")
    ps = PlaneSet(planes)
    out = torch.empty((n_rows, ps.row_bytes // torch.empty((), dtype=buf_dtype).element_size()),
                      dtype=buf_dtype, device=device)
    random_bytes(out, 7)
    expected = host_rows(out).copy()
    for b, r in zip(ids, rows, strict=True):
        expected[r] = row_of(planes, b)
    with using(impl):
        event = gather(ps, np.array(ids, dtype=np.int64), out, rows if explicit else None)
    if device == "cuda":
        event.synchronize()
    else:
        assert event is None
    assert np.array_equal(host_rows(out), expected)


@pytest.mark.parametrize(("device", "impl"), CASES)
@settings(max_examples=60, deadline=None)
@given(shape=shapes, data=st.data())
def test_scatter_writes_each_listed_block_from_its_row_and_leaves_other_blocks(device, impl, shape, data):
    tensors, planes = make_planes(**shape, device=device, seed=2)
    blocks = shape["blocks"]
    ids = data.draw(st.lists(st.integers(0, blocks - 1), unique=True, max_size=blocks), label="block ids")
    n_rows = data.draw(st.integers(max(1, len(ids)), len(ids) + 3), label="rows")
    rows = data.draw(st.lists(st.integers(0, n_rows - 1), min_size=len(ids), max_size=len(ids)), label="rows")
    ps = PlaneSet(planes)
    inp = torch.empty((n_rows, ps.row_bytes), dtype=torch.uint8, device=device)
    random_bytes(inp, 9)
    source = host_rows(inp)
    expected = [[block_of(t, b).copy() for b in range(blocks)] for t in planes]
    for b, r in zip(ids, rows, strict=True):
        for p in range(len(planes)):
            off = int(ps.offsets[p])
            expected[p][b] = source[r, off:off + int(ps.block_bytes[p])]
    with using(impl):
        event = scatter(inp, rows, ps, ids)
    if device == "cuda":
        event.synchronize()
    for p, t in enumerate(planes):
        raw = storage_bytes(t)
        for b in range(blocks):
            assert np.array_equal(block_of(t, b, raw), expected[p][b]), f"plane {p}, block {b}"
    # (the planes' blocks are every byte of these tensors, so nothing else moved either)
    assert sum(int(ps.block_bytes[p]) * blocks for p in range(len(planes))) == \
        sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize(("device", "impl"), CASES)
def test_a_saved_request_comes_back_bit_for_bit_into_other_blocks(device, impl):
    """The connector's round trip in small: gather a request's blocks of every layer into rows,
    scatter the rows into other blocks of another cache in the same layout."""
    _, source = make_planes("flash_attn", 4, 40, 16, 2, 8, torch.bfloat16, device, seed=3)
    _, sink = make_planes("flash_attn", 4, 40, 16, 2, 8, torch.bfloat16, device, seed=4)
    table = np.random.default_rng(5).permutation(40)[:17]
    other = np.random.default_rng(6).permutation(40)[:17]
    src, dst = PlaneSet(source), PlaneSet(sink)
    rows = torch.zeros((17, src.row_bytes), dtype=torch.uint8, device=device)
    with using(impl):
        gather(src, table, rows)
        event = scatter(rows, None, dst, other)
    if device == "cuda":
        event.synchronize()
    for t_src, t_dst in zip(source, sink, strict=True):
        assert torch.equal(t_dst[torch.as_tensor(other, device=device)].view(torch.uint8),
                           t_src[torch.as_tensor(table, device=device)].view(torch.uint8))
        # a row's plane part is the block in its logical order for these layouts
    assert np.array_equal(host_rows(rows)[0, :16 * 2 * 8 * 2],
                          source[0][int(table[0])].contiguous().view(torch.uint8).reshape(-1).cpu().numpy())


@pytest.mark.parametrize(("device", "impl"), CASES)
def test_odd_sizes_and_offsets_copy_exactly(device, impl):
    """Blocks of 7 bytes in a plane that starts 1 byte into its storage: no wide word fits."""
    base = torch.empty((10 * 9 + 1,), dtype=torch.uint8, device=device)
    random_bytes(base, 11)
    plane = base[1:].view(10, 9)[:, :7]  # blocks of 7 bytes, 9 apart
    other = torch.empty((10, 3, 5), dtype=torch.uint8, device=device)  # 15 bytes a block
    random_bytes(other, 12)
    ps = PlaneSet([plane, other])
    assert ps.row_bytes == 22 and ps._word == 1
    out = torch.zeros((4, 22), dtype=torch.uint8, device=device)
    with using(impl):
        ev = gather(ps, [9, 0, 9], out, [3, 0, 1])
    if ev is not None:
        ev.synchronize()
    got = host_rows(out)
    for b, r in ((9, 3), (0, 0), (9, 1)):
        assert np.array_equal(got[r], row_of([plane, other], b))
    assert not got[2].any()


@pytest.mark.parametrize(("device", "impl"), CASES)
def test_blocks_longer_than_a_kernel_chunk_copy_whole_tails_included(device, impl):
    """Planes of 20000 and 8200 bytes a block: several chunks of a program each, and a tail."""
    big = torch.empty((6, 10000), dtype=torch.int16, device=device)
    mid = torch.empty((6, 4100), dtype=torch.int16, device=device)
    for k, t in enumerate((big, mid)):
        random_bytes(t, 30 + k)
    ps = PlaneSet([big, mid])
    rows = torch.zeros((3, ps.row_bytes), dtype=torch.uint8, device=device)
    with using(impl):
        gather(ps, [5, 2, 0], rows)
        twin = PlaneSet([torch.zeros_like(big), torch.zeros_like(mid)])
        ev = scatter(rows, [2, 0, 1], twin, [1, 3, 4])
    if ev is not None:
        ev.synchronize()
    got = host_rows(rows)
    for r, b in enumerate((5, 2, 0)):
        assert np.array_equal(got[r], row_of([big, mid], b))
    for b, src in ((1, 0), (3, 5), (4, 2)):
        assert np.array_equal(row_of(list(twin.planes), b), row_of([big, mid], src))
    assert not row_of(list(twin.planes), 0).any() and not row_of(list(twin.planes), 5).any()


@pytest.mark.parametrize(("device", "impl"), CASES)
def test_an_empty_table_copies_nothing(device, impl):
    _, planes = make_planes("cpu", 2, 4, 3, 1, 5, torch.float16, device, seed=13)
    ps = PlaneSet(planes)
    buf = torch.empty((3, ps.row_bytes), dtype=torch.uint8, device=device)
    random_bytes(buf, 14)
    rows_before = host_rows(buf).copy()
    planes_before = [storage_bytes(t).copy() for t in planes]
    with using(impl):
        for ev in (gather(ps, [], buf), gather(ps, np.zeros(0, np.int64), buf, []), scatter(buf, [], ps, [])):
            assert (ev is None) == (device == "cpu")
            if ev is not None:
                ev.synchronize()
    assert np.array_equal(host_rows(buf), rows_before)
    assert all(np.array_equal(storage_bytes(t), b) for t, b in zip(planes, planes_before, strict=True))


def test_the_row_layout_is_plane_by_plane():
    planes = [torch.full((3, 2), k + 1, dtype=torch.int16) for k in range(3)]
    ps = PlaneSet(planes)
    assert ps.row_bytes == 12 and ps.block_bytes.tolist() == [4, 4, 4] and ps.offsets.tolist() == [0, 4, 8]
    out = torch.zeros((1, 6), dtype=torch.int16)
    gather(ps, [2], out)
    assert out.tolist() == [[1, 1, 2, 2, 3, 3]]
    with pytest.raises(ValueError):
        ps.block_bytes[0] = 1  # read-only description


def test_implementation_names_what_copies():
    name = blockcopy.implementation()
    assert name.startswith("triton ") or name.startswith("torch (int64 views")
    if not torch.cuda.is_available() and os.environ.get("KVWIRE_BLOCKCOPY") != "triton":
        assert name.startswith("torch")


def test_the_environment_can_force_the_fallback(monkeypatch):
    monkeypatch.setattr(blockcopy, "_choice", None)
    monkeypatch.setenv("KVWIRE_BLOCKCOPY", "torch")
    assert blockcopy.implementation() == "torch (int64 views; KVWIRE_BLOCKCOPY=torch)"
    assert blockcopy._choose()[0] is blockcopy._Impl.TORCH


# -- refusals, before any copy --------------------------------------------------------------------


@pytest.fixture
def small() -> tuple[PlaneSet, list[torch.Tensor], torch.Tensor]:
    _, planes = make_planes("flash_attn", 2, 6, 4, 2, 4, torch.bfloat16, "cpu", seed=21)
    ps = PlaneSet(planes)
    buf = torch.zeros((5, ps.row_bytes), dtype=torch.uint8)
    return ps, planes, buf


def unchanged(planes: list[torch.Tensor], buf: torch.Tensor):
    """A check that neither the planes nor the buffer changed since this call."""
    before = [storage_bytes(t).copy() for t in planes], host_rows(buf).copy()

    def check() -> None:
        assert all(np.array_equal(storage_bytes(t), b) for t, b in zip(planes, before[0], strict=True))
        assert np.array_equal(host_rows(buf), before[1])
    return check


@pytest.mark.parametrize(("call", "error", "words"), [
    (lambda ps, buf: gather(ps, [0, 6], buf), ValueError, ["block_ids", "[6]", "out of range"]),
    (lambda ps, buf: gather(ps, [-1], buf), ValueError, ["block_ids", "[-1]"]),
    (lambda ps, buf: scatter(buf, None, ps, [1, 2, 6]), ValueError, ["block_ids", "[6]"]),
    (lambda ps, buf: gather(ps, [0, 1], buf, [0, 5]), ValueError, ["out_rows", "[5]", "out of range"]),
    (lambda ps, buf: scatter(buf, [4, 7], ps, [0, 1]), ValueError, ["in_rows", "[7]"]),
    (lambda ps, buf: gather(ps, [0, 1, 2], buf, [0, 1]), ValueError, ["2 out_rows for 3 block ids"]),
    (lambda ps, buf: gather(ps, [0] * 6, buf), ValueError, ["6 block ids", "5 rows"]),
    (lambda ps, buf: gather(ps, [0, 1, 2], buf, [3, 1, 3]), ValueError, ["out_rows repeats [3]"]),
    (lambda ps, buf: scatter(buf, [0, 1, 2], ps, [4, 4, 1]), ValueError, ["block_ids of a scatter repeats [4]"]),
    (lambda ps, buf: gather(ps, [0.0, 1.0], buf), TypeError, ["block_ids", "integers", "float64"]),
    (lambda ps, buf: gather(ps, [[0, 1]], buf), ValueError, ["block_ids", "1-d"]),
    (lambda ps, buf: gather(ps, np.array([True]), buf), TypeError, ["integers", "bool"]),
    (lambda ps, buf: gather(ps, [0], buf.float()), TypeError, ["out", "float32", "uint8", "bfloat16"]),
    (lambda ps, buf: gather(ps, [0], buf[:, :-2]), ValueError, ["out", "rows of", "bytes"]),
    (lambda ps, buf: gather(ps, [0], buf.t().contiguous().t()), ValueError, ["out", "not contiguous"]),
    (lambda ps, buf: gather(ps, [0], buf.numpy()), TypeError, ["out", "ndarray"]),
    (lambda ps, buf: gather([ps], [0], buf), TypeError, ["PlaneSet"]),
    (lambda ps, buf: gather(ps, [0], buf, stream=object()), ValueError, ["stream", "cpu"]),
    (lambda ps, buf: gather(ps, [0], buf.to("meta")), ValueError, ["out", "meta"]),
])
def test_bad_calls_are_refused_naming_the_problem_and_copy_nothing(small, call, error, words):
    ps, planes, buf = small
    random_bytes(buf, 22)
    check = unchanged(planes, buf)
    with pytest.raises(error) as info:
        call(ps, buf)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    check()


def test_plane_sets_refuse_planes_that_are_not_whole_blocks():
    t = torch.zeros((2, 6, 4, 2, 4), dtype=torch.bfloat16)
    cases = [
        ([], ValueError, "at least one plane"),
        ([t[0], t[1].float()], TypeError, "plane 1 is torch.float32 but plane 0 torch.bfloat16"),
        ([t[0], t[1][:5]], ValueError, "plane 1 has 5 blocks but plane 0 6"),
        ([t[0], t[1][:, :, ::2]], ValueError, "plane 1: a block"),
        ([t[0], t.permute(1, 0, 2, 3, 4)], ValueError, "plane 1: a block"),  # K and V blocks interleaved
        ([t[0], t.new_zeros(())], ValueError, "plane 1 is a 0-d tensor"),
        ([t[0], t[1].to("meta")], ValueError, "plane 1 is on meta but plane 0 on cpu"),
        ([torch.zeros((3, 0))], ValueError, "plane 0 has empty blocks"),
        ([t[0], np.zeros((6, 32))], TypeError, "plane 1 is a ndarray"),
        ([torch.zeros(64).as_strided((6, 16), (8, 1))], ValueError, "overlap"),
    ]
    for planes, error, words in cases:
        with pytest.raises(error) as info:
            PlaneSet(planes)
        assert words in str(info.value), (words, str(info.value))


def test_device_index_tensors_are_refused_on_the_host():
    ps = PlaneSet([torch.zeros((4, 8))])
    with pytest.raises(TypeError, match="tensor on meta"):
        gather(ps, torch.zeros(1, dtype=torch.int64, device="meta"), torch.zeros((1, 8)))
    out = torch.zeros((2, 8))
    gather(ps, torch.tensor([3, 1]), out)  # a CPU tensor of ids is fine


# -- copy_spans: spans by address between a device and pinned host memory -------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("impl", implementations("cuda"))
@pytest.mark.parametrize("to_device", [False, True])
def test_copy_spans_moves_each_span_whole_and_no_byte_beside_it(impl, to_device):
    """Spans of odd sizes at odd offsets (byte words), of 16-byte multiples (wide words) and one
    longer than the kernel's chunk, between CUDA memory and pinned host memory; the bytes around
    each target span keep their guard value."""
    from kvwire.lender.blockcopy import copy_spans

    rng = np.random.default_rng(5)
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    src, dst = (host, dev) if to_device else (dev, host)
    src.copy_(torch.from_numpy(rng.integers(0, 256, 1 << 20, dtype=np.uint8)))
    dst.fill_(0x5A)
    torch.cuda.synchronize()
    spans = [(3, 1001, 1), (2048, 4096, 4096), (9000, 20000, 7), (65536, 200000, 100000 + 16 * 1000),
             (500000, 700000, 0), (600001, 800001, 333)]
    with using(impl):
        event = copy_spans([dst.data_ptr() + d for _, d, _ in spans], [src.data_ptr() + s for s, _, _ in spans],
                           [n for _, _, n in spans], device=torch.cuda.current_device(), to_device=to_device)
    event.synchronize()
    got, want = dst.cpu().numpy(), src.cpu().numpy()
    expected = np.full_like(got, 0x5A)
    for s, d, n in spans:
        expected[d:d + n] = want[s:s + n]
    np.testing.assert_array_equal(got, expected)


@pytest.mark.skipif(not (HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="runs the spans kernel on the CPU: needs Triton and TRITON_INTERPRET=1")
@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_spans_kernel_copies_each_span_whole_and_no_byte_beside_it_in_the_interpreter(data):
    """The spans kernel itself (its words, chunks, lanes and masks), run by Triton's interpreter
    on host memory: spans of sizes and offsets drawn at every alignment from bytes to 64, some
    longer than a chunk, copied in one launch; every target span holds its source's bytes and
    every byte beside them keeps its guard value."""
    align = data.draw(st.sampled_from([1, 2, 4, 8, 16, 64]), label="alignment")
    sizes = data.draw(st.lists(st.integers(0, 40000).map(lambda n: n // align * align), min_size=1, max_size=8),
                      label="sizes")
    src = np.random.default_rng(len(sizes)).integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.full((1 << 20) + 4096, 0x5A, dtype=np.uint8)
    expected = dst.copy()
    targets, sources, at = [], [], align
    for n in sizes:
        start = data.draw(st.integers(0, (len(src) - n) // align), label="source") * align
        targets.append(dst.ctypes.data + at)
        sources.append(src.ctypes.data + start)
        expected[at:at + n] = src[start:start + n]
        at += -(-(n + data.draw(st.integers(0, 100), label="gap")) // align) * align
    table = blockcopy._span_table(targets, sources, sizes)
    if table.shape[0]:
        grid, constants = blockcopy._spans_launch(table)
        blockcopy._spans_launcher()[grid](torch.from_numpy(table.reshape(-1).copy()), **constants)
    np.testing.assert_array_equal(dst, expected)


def test_a_span_table_refuses_bad_spans_naming_them():
    """The checks copy_spans makes before anything moves, on any host: one size per span, sizes
    >= 0, an address > 0 for every span that moves bytes (an empty span's address is not used),
    and the table keeps only the spans that move bytes."""
    cases = [
        (([8], [16], [8, 8]), "1 targets, 1 sources and 2 sizes"),
        (([8], [16], [-1]), "span 0 has -1 bytes"),
        (([8, 0], [16, 16], [8, 8]), "span 1 names address 0"),
        (([8, 8, 0], [16, 16, 16], [0, 4, 8]), "span 2 names address 0"),
    ]
    for args, words in cases:
        with pytest.raises(ValueError, match=words):
            blockcopy._span_table(*args)
    assert blockcopy._span_table([0, 8], [0, 16], [0, 4]).tolist() == [[8, 16, 4]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copy_spans_refuses_bad_spans_naming_them_and_copies_nothing():
    from kvwire.lender.blockcopy import copy_spans

    dev = torch.zeros(64, dtype=torch.uint8, device="cuda")
    host = torch.ones(64, dtype=torch.uint8, pin_memory=True)
    cases = [
        (([dev.data_ptr()], [host.data_ptr()], [8, 8]), "1 targets, 1 sources and 2 sizes"),
        (([dev.data_ptr()], [host.data_ptr()], [-1]), "span 0 has -1 bytes"),
        (([dev.data_ptr(), 0], [host.data_ptr(), host.data_ptr()], [8, 8]), "span 1 names address 0"),
    ]
    for args, words in cases:
        with pytest.raises(ValueError, match=words):
            copy_spans(*args, device=0, to_device=True)
    with pytest.raises(ValueError, match="not a CUDA device index"):
        copy_spans([dev.data_ptr()], [host.data_ptr()], [8], device=99, to_device=True)
    torch.cuda.synchronize()
    assert not bool(dev.any()), "a refused call copied"
