/* crc32 of blocks (zlib's CRC-32: reflected, polynomial 0xEDB88320), folded 64 bytes at a time with carry-less
 * multiplication (PCLMULQDQ) where the CPU has it, a table elsewhere; and the landing fence's step: copy a block
 * and checksum each piece of it while it is in cache. Results equal zlib.crc32 on the same bytes (the tests
 * compare them): nodes with and without this library agree. Built by kvmesh/kv/fast_crc.py. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

static uint32_t table[256];

static void init_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[i] = c;
    }
}

static uint32_t crc_bytes(uint32_t crc, const uint8_t *p, size_t n) {  /* raw register in and out */
    while (n--) crc = table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

__attribute__((target("pclmul,sse4.1")))
static inline __m128i fold(__m128i x, __m128i k, __m128i data) {
    __m128i lo = _mm_clmulepi64_si128(x, k, 0x00), hi = _mm_clmulepi64_si128(x, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), data);
}

/* n >= 64 and a multiple of 16; raw register in and out. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc_folded(uint32_t crc, const uint8_t *p, size_t n) {
    const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x1F7011641LL, 0x1DB710641LL);
    const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
    __m128i x1 = _mm_loadu_si128((const __m128i *)p), x2 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 32)), x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    p += 64;
    n -= 64;
    while (n >= 64) {
        x1 = fold(x1, k1k2, _mm_loadu_si128((const __m128i *)p));
        x2 = fold(x2, k1k2, _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = fold(x3, k1k2, _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = fold(x4, k1k2, _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        n -= 64;
    }
    x1 = fold(x1, k3k4, x2);
    x1 = fold(x1, k3k4, x3);
    x1 = fold(x1, k3k4, x4);
    while (n >= 16) {
        x1 = fold(x1, k3k4, _mm_loadu_si128((const __m128i *)p));
        p += 16;
        n -= 16;
    }
    __m128i t = _mm_clmulepi64_si128(k3k4, x1, 0x01);  /* the last 64-bit fold: R4 x low */
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), t);
    t = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k5, 0x00);  /* to 32 bits */
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 4), t);
    t = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), poly, 0x10);  /* Barrett reduction */
    t = _mm_clmulepi64_si128(_mm_and_si128(t, mask32), poly, 0x00);
    x1 = _mm_xor_si128(x1, t);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

static int use_folding = -1;

static uint32_t crc_raw(uint32_t crc, const uint8_t *p, size_t n) {
    if (use_folding && n >= 64) {
        size_t body = n & ~(size_t)15;
        crc = crc_folded(crc, p, body);
        p += body;
        n -= body;
    }
    return crc_bytes(crc, p, n);
}

/* folding: 1 where the CPU has PCLMULQDQ and SSE4.1 (the caller checks), 0 for the table alone. */
void kvm_crc32_init(int folding) {
    init_table();
    use_folding = folding;
}

/* zlib.crc32(bytes, crc) */
uint32_t kvm_crc32(uint32_t crc, const uint8_t *p, int64_t n) {
    return ~crc_raw(~crc, p, (size_t)n);
}

/* out[i] = crc32 of the nbytes at srcs[i] */
void kvm_crc32_blocks(const int64_t *srcs, int64_t count, int64_t nbytes, uint32_t *out) {
    for (int64_t i = 0; i < count; i++) out[i] = ~crc_raw(~0u, (const uint8_t *)srcs[i], (size_t)nbytes);
}

/* copy each block srcs[i] -> dsts[i] and out[i] = crc32 of what was copied: piece by piece, each piece
 * checksummed from the destination right after its copy (still in cache). */
void kvm_copy_crc32_blocks(const int64_t *dsts, const int64_t *srcs, int64_t count, int64_t nbytes, uint32_t *out) {
    const size_t piece = 32768;
    for (int64_t i = 0; i < count; i++) {
        uint8_t *dst = (uint8_t *)dsts[i];
        const uint8_t *src = (const uint8_t *)srcs[i];
        uint32_t crc = ~0u;
        for (size_t off = 0; off < (size_t)nbytes; off += piece) {
            size_t n = (size_t)nbytes - off < piece ? (size_t)nbytes - off : piece;
            memcpy(dst + off, src + off, n);
            crc = crc_raw(crc, dst + off, n);
        }
        out[i] = ~crc;
    }
}
