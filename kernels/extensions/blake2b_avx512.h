/* The block hash chain's common case in AVX-512 registers: 16-byte digests of 80-byte messages (a 16-byte
 * parent digest and 64 bytes of tokens, one BLAKE2b compression each), included by blake2b_chain.c after
 * its IV and SIGMA. Defines BLAKE2B_CHAIN_VECTOR to 1 where the compiler targets AVX-512F+VL, else to 0
 * (and nothing else).
 *
 * The chain is latency-bound: every compression waits for the previous digest. The scalar compression
 * runs out of registers (16 state words and 16 message words in 15 free registers); here the state is
 * four 4-lane rows and the message two 8-lane registers, so the digest goes from one compression into
 * the next without touching memory. Rows a, b, c, d hold v[0..3], v[4..7], v[8..11], v[12..15]: a column
 * step mixes lane k of every row; for the diagonal step b stays in place and a, c, d turn (lane k holds
 * a[k-1], b[k], c[k+1], d[k+2], which is diagonal k-1), so the row the next step needs first (b) never
 * waits on a lane permute. Each step's xor-and-rotate costs the chain a shift and a three-way xor
 * (B2_XOR_ROTR), and each add of a message word happens off the chain.
 */
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define BLAKE2B_CHAIN_VECTOR 1
#include <immintrin.h>

/* rotr(early ^ late, n) as rotr(early, n) ^ (late >> n) ^ (late << (64 - n)): rotation distributes over xor,
 * and the row just computed (late) is two cycles from the result (a shift, then one three-way xor) instead
 * of a xor and a rotate (two cycles here). */
#define B2_XOR_ROTR(early, late, n)                                                                         \
    _mm256_ternarylogic_epi64(_mm256_ror_epi64(early, n), _mm256_srli_epi64(late, n),                      \
                              _mm256_slli_epi64(late, 64 - (n)), 0x96)

/* a + m + b with a + m first (m is ready long before b): the empty asm keeps the compiler from adding b
 * first, which would put both adds on the chain */
static inline __m256i b2_add3(__m256i a, __m256i m, __m256i b) {
    __m256i am = _mm256_add_epi64(a, m);
    __asm__("" : "+v"(am));
    return _mm256_add_epi64(am, b);
}

/* RFC 7693's G on four columns (or diagonals) at once; x, y: the message words of each lane */
#define B2_G4(a, b, c, d, x, y)                                                                             \
    do {                                                                                                    \
        a = b2_add3(a, x, b);                                                                               \
        d = B2_XOR_ROTR(d, a, 32);                                                                          \
        c = _mm256_add_epi64(c, d);                                                                         \
        b = B2_XOR_ROTR(b, c, 24);                                                                          \
        a = b2_add3(a, y, b);                                                                               \
        d = B2_XOR_ROTR(d, a, 16);                                                                          \
        c = _mm256_add_epi64(c, d);                                                                         \
        b = B2_XOR_ROTR(b, c, 63);                                                                          \
    } while (0)

/* What every link of one chain shares: the parameter-block state and the counter block of an 80-byte message. */
typedef struct {
    __m256i h_lo, h_hi, iv_lo, iv_hi;
} B2ChainKey;

static inline B2ChainKey b2_chain_key(const uint64_t start[8]) {
    B2ChainKey key;
    key.h_lo = _mm256_loadu_si256((const __m256i *)start);
    key.h_hi = _mm256_loadu_si256((const __m256i *)(start + 4));
    key.iv_lo = _mm256_loadu_si256((const __m256i *)IV);
    /* v[12] ^= the 80 bytes counted, v[14] inverted: every message is one final block */
    key.iv_hi = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(IV + 4)),
                                 _mm256_set_epi64x(0, -1LL, 0, DIGEST + 64));
    return key;
}

/* The message of one link: words 0-1 the previous digest (lanes 0-1 of prev), 2-9 the 64 bytes at tokens,
 * 10-15 zero. */
#define B2_MESSAGE(m_lo, m_hi, prev, tokens)                                                                  \
    __m512i m_lo = _mm512_mask_blend_epi64(0x03, _mm512_maskz_loadu_epi64(0xFC, (tokens) - 16),             \
                                           _mm512_castsi256_si512(prev));                                   \
    __m512i m_hi = _mm512_maskz_loadu_epi64(0x03, (tokens) + 48)

/* Round r of the compression of state a, b, c, d (the columns, then the diagonals with b in place). */
#define B2_ROUND(r, a, b, c, d, m_lo, m_hi)                                                                   \
    do {                                                                                                     \
        const uint8_t *s = SIGMA[r];                                                                         \
        __m512i x = _mm512_permutex2var_epi64(                                                              \
            m_lo, _mm512_set_epi64(s[12], s[10], s[8], s[14], s[6], s[4], s[2], s[0]), m_hi);               \
        __m512i y = _mm512_permutex2var_epi64(                                                              \
            m_lo, _mm512_set_epi64(s[13], s[11], s[9], s[15], s[7], s[5], s[3], s[1]), m_hi);               \
        B2_G4(a, b, c, d, _mm512_castsi512_si256(x), _mm512_castsi512_si256(y));                            \
        a = _mm256_permute4x64_epi64(a, _MM_SHUFFLE(2, 1, 0, 3));                                           \
        c = _mm256_permute4x64_epi64(c, _MM_SHUFFLE(0, 3, 2, 1));                                           \
        d = _mm256_permute4x64_epi64(d, _MM_SHUFFLE(1, 0, 3, 2));                                           \
        B2_G4(a, b, c, d, _mm512_extracti64x4_epi64(x, 1), _mm512_extracti64x4_epi64(y, 1));               \
        a = _mm256_permute4x64_epi64(a, _MM_SHUFFLE(0, 3, 2, 1));                                           \
        c = _mm256_permute4x64_epi64(c, _MM_SHUFFLE(2, 1, 0, 3));                                           \
        d = _mm256_permute4x64_epi64(d, _MM_SHUFFLE(1, 0, 3, 2));                                           \
    } while (0)

/* BLAKE2b(prev's 16-byte digest (lanes 0-1) || the 64 bytes at tokens): the new digest in lanes 0-1. */
static inline __m256i b2_next_digest(const B2ChainKey *key, __m256i prev, const uint8_t *tokens) {
    B2_MESSAGE(m_lo, m_hi, prev, tokens);
    __m256i a = key->h_lo, b = key->h_hi, c = key->iv_lo, d = key->iv_hi;
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++)
        B2_ROUND(r, a, b, c, d, m_lo, m_hi);
    return _mm256_xor_si256(key->h_lo, _mm256_xor_si256(a, c));
}

/* Digest i (16 bytes at out + 16 * i) = BLAKE2b(digest i-1 || data[64 i : 64 i + 64]) from the parameter-block
 * state `start`, digest -1 = parent. Same digests as the scalar chain_digests with step 64. */
static void chain_digests_64_avx512(const uint64_t start[8], const uint8_t *parent, const uint8_t *data,
                                    Py_ssize_t num_blocks, uint8_t *out) {
    const B2ChainKey key = b2_chain_key(start);
    __m256i prev = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)parent));
    for (Py_ssize_t i = 0; i < num_blocks; i++) {
        prev = b2_next_digest(&key, prev, data + 64 * i);
        _mm_storeu_si128((__m128i *)(out + DIGEST * i), _mm256_castsi256_si128(prev));
    }
}
#else
#define BLAKE2B_CHAIN_VECTOR 0
#endif
