/* The chained block hash of docs/design.md §4 over a whole token buffer in one call:
 *
 *   h[i] = BLAKE2b(h[i-1] || data[i * step : (i + 1) * step], digest 16 bytes, personalisation person)
 *
 * with h[-1] = parent. BLAKE2b is implemented here from RFC 7693 (unkeyed, no salt, sequential
 * mode); kvmesh/kv/block_hash.py checks it against hashlib's and falls back to hashlib when this
 * library is not there, so every node computes the same digests either way. Returns 0, or -2 when
 * a message (16 + step bytes) is empty or the digest size is not 1..64.
 */
#include <stdint.h>
#include <string.h>

#define BLOCK_BYTES 128

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load64(const uint8_t *p) { /* little-endian, whatever the host order */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
#endif
}

#define MIX(a, b, c, d, x, y)                                                                                 \
    do {                                                                                                      \
        v[a] = v[a] + v[b] + (x);                                                                             \
        v[d] = rotr64(v[d] ^ v[a], 32);                                                                       \
        v[c] = v[c] + v[d];                                                                                   \
        v[b] = rotr64(v[b] ^ v[c], 24);                                                                       \
        v[a] = v[a] + v[b] + (y);                                                                             \
        v[d] = rotr64(v[d] ^ v[a], 16);                                                                       \
        v[c] = v[c] + v[d];                                                                                   \
        v[b] = rotr64(v[b] ^ v[c], 63);                                                                       \
    } while (0)

/* F: one 128-byte block into the state h; bytes = message bytes so far, last = final block */
static void compress(uint64_t h[8], const uint8_t block[BLOCK_BYTES], uint64_t bytes, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= bytes; /* the counter's high word stays 0: messages here are far below 2^64 bytes */
    if (last) v[14] = ~v[14];
#pragma GCC unroll 12
    for (int r = 0; r < 12; r++) { /* unrolled: SIGMA's entries become constants, m stays in registers */
        const uint8_t *s = SIGMA[r];
        MIX(0, 4, 8, 12, m[s[0]], m[s[1]]);
        MIX(1, 5, 9, 13, m[s[2]], m[s[3]]);
        MIX(2, 6, 10, 14, m[s[4]], m[s[5]]);
        MIX(3, 7, 11, 15, m[s[6]], m[s[7]]);
        MIX(0, 5, 10, 15, m[s[8]], m[s[9]]);
        MIX(1, 6, 11, 12, m[s[10]], m[s[11]]);
        MIX(2, 7, 8, 13, m[s[12]], m[s[13]]);
        MIX(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b of prefix (prefix_len bytes) || body (body_len bytes) into out (digest bytes), from the
 * parameter-block state `start` (IV already mixed with digest size and personalisation). */
static void hash_two(const uint64_t start[8], const uint8_t *prefix, size_t prefix_len, const uint8_t *body,
                     size_t body_len, int digest, uint8_t *out) {
    uint64_t h[8];
    uint8_t block[BLOCK_BYTES];
    memcpy(h, start, sizeof h);
    size_t total = prefix_len + body_len, done = 0;
    while (done < total) {
        size_t take = total - done < BLOCK_BYTES ? total - done : BLOCK_BYTES;
        size_t from_prefix = done < prefix_len ? (prefix_len - done < take ? prefix_len - done : take) : 0;
        memcpy(block, prefix + done, from_prefix);
        memcpy(block + from_prefix, body + (done + from_prefix - prefix_len), take - from_prefix);
        memset(block + take, 0, BLOCK_BYTES - take);
        done += take;
        compress(h, block, done, done == total);
    }
    for (int i = 0; i < digest; i++) out[i] = (uint8_t)(h[i / 8] >> (8 * (i % 8)));
}

int blake2b_chain(const uint8_t *parent, const uint8_t *data, int64_t num_blocks, int64_t step,
                  const uint8_t *person, int digest, uint8_t *out) {
    if (digest < 1 || digest > 64 || digest + step <= 0) return -2;
    uint64_t start[8];
    memcpy(start, IV, sizeof start);
    start[0] ^= 0x01010000ULL ^ (uint64_t)digest; /* fanout 1, depth 1, no key */
    start[6] ^= load64(person);
    start[7] ^= load64(person + 8);
    const uint8_t *prev = parent;
    for (int64_t i = 0; i < num_blocks; i++) {
        hash_two(start, prev, (size_t)digest, data + i * step, (size_t)step, digest, out + i * digest);
        prev = out + i * digest;
    }
    return 0;
}
