"""kvwire.copying.stream_copy: the compiled copy with non-temporal stores copies exactly the
bytes memmove would, whatever the alignment and length (its head up to a 16-byte boundary, its
64-byte body, its tail), writes nothing outside the destination, and is the one built here."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire.copying as copying

#: Lengths around each of the helper's branches: below its 4 KiB cut to memcpy, a body of whole
#: 64-byte blocks, a tail of 1..63 bytes.
LENGTHS = st.one_of(st.integers(0, 4200), st.integers(4096, 1 << 20),
                    st.sampled_from([4095, 4096, 4097, 4096 + 63, 4096 + 64, 4096 + 65, (1 << 20) - 1]))


def test_the_streaming_copy_is_built_where_a_c_compiler_is():
    """The core's install builds kvwire._copy wherever a C compiler is on PATH (the README's
    commands install with one); a build that failed silently would leave every store copy on
    memmove, which only this test would notice."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: kvwire._copy is optional and kvwire copies with memmove")
    assert copying.STREAMING, f"kvwire._copy is not loaded: {copying.COPY_NAME}"
    assert copying.stream_copy is not copying.ctypes.memmove


@settings(max_examples=300, deadline=None)
@given(LENGTHS, st.integers(0, 63), st.integers(0, 63), st.integers(0, 2**32 - 1))
def test_stream_copy_copies_exactly_the_bytes(n, dst_off, src_off, seed):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, n + 64 + 128, dtype=np.uint8)
    guard = 64
    dst = np.full(n + 2 * guard + 64, 0xA5, dtype=np.uint8)
    before = dst.copy()
    copying.stream_copy(dst.ctypes.data + guard + dst_off, src.ctypes.data + src_off, n)
    got = dst[guard + dst_off: guard + dst_off + n]
    np.testing.assert_array_equal(got, src[src_off: src_off + n])
    # nothing written before or after the destination
    np.testing.assert_array_equal(dst[:guard + dst_off], before[:guard + dst_off])
    np.testing.assert_array_equal(dst[guard + dst_off + n:], before[guard + dst_off + n:])


def test_stream_copy_of_large_pieces_on_threads_at_once():
    """As the memory store's copy pool calls it: pieces of one batch on several threads at once,
    each without the GIL; every byte arrives (the stores are fenced before each call returns)."""
    n, parts = 48 << 20, 4
    src = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    step = n // parts
    threads = [threading.Thread(target=copying.stream_copy,
                                args=(dst.ctypes.data + i * step, src.ctypes.data + i * step, step))
               for i in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(dst, src)
