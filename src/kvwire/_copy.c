/* kvwire's one compiled helper: a host copy whose stores bypass the cache.
 *
 * glibc's memmove writes through the cache below its non-temporal threshold (on an H100 host's
 * glibc 2.39, 53.5 MiB): every destination line is first read into the cache, then written back,
 * so a copy moves each byte three times through memory. A store copying the pieces of a large
 * batch on several threads (8-32 MiB each) stays below that threshold, and ran at 36-39 GB/s on 8
 * threads where the same bytes copied with non-temporal stores ran at 57-62 GB/s
 * (bench/results/gpu-2026-12-06-night.txt). Copies whose destination is not read again soon (a
 * store's object, or a pinned slot the GPU's DMA reads next) are the ones to route here.
 *
 * Loaded with ctypes (kvwire.copying), not imported: it includes no Python header, and the
 * module init below exists only because setuptools builds it as an extension. SSE2 streaming
 * stores are part of every x86-64 CPU; elsewhere the function is plain memmove. */

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Copy n bytes from src to dst (the ranges must not overlap). */
void kvwire_stream_copy(void *dst_, const void *src_, size_t n) {
#if defined(__SSE2__)
    unsigned char *dst = (unsigned char *)dst_;
    const unsigned char *src = (const unsigned char *)src_;
    if (n < 4096) {
        memcpy(dst, src, n);
        return;
    }
    size_t head = (size_t)((16 - ((uintptr_t)dst & 15)) & 15); /* up to dst's 16-byte boundary */
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
    _mm_sfence(); /* the streamed stores are visible before the copy returns */
    memcpy(dst + body, src + body, n - body);
#else
    memmove(dst_, src_, n);
#endif
}

/* Never called: kvwire.copying loads this file with ctypes. */
void *PyInit__copy(void) { return NULL; }
