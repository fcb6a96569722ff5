/* What the native CPU kernels share: bf16 <-> float32, loads and stores by element type, the
 * rounding to the model dtype, pairwise lane sums, a vectorisable e^x, the rounded softmax of score rows, and
 * (AVX2 with FMA) eight elements loaded as float32 and a register tile of six rows x 16 float32 columns.
 *
 * Kernels are written once for both element types: the always-inline functions take `bf16` as a
 * compile-time constant at each exported entry point, so the compiler emits one specialised copy each.
 */
#ifndef KVMESH_CPU_COMMON_H
#define KVMESH_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define LANES 16 /* float32 lanes of one AVX-512 register; narrower machines split it */
/* Element-wise kernels share rows among OpenMP threads from this size on; below it a thread's wake-up
 * costs more than it saves. The serial loop is a separate copy, and inside a region each call passes
 * `bf16` as a literal: the region is outlined before inlining, where `bf16` would be a variable and
 * the compiler would emit one slow generic copy (an if clause alone keeps that copy too). */
#define PARALLEL_MIN_ELEMENTS (1 << 16)

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Sums LANES partial sums pairwise (a fixed order, so results do not depend on the vector width). */
INLINE float sum_lanes(float *part) {
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; j++) part[j] += part[j + width];
    return part[0];
}

INLINE float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store(void *p, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

INLINE float round_to(float x, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(x)) : x; }

/* e^x written so the compiler vectorises it: x = k ln2 + r with |r| <= ln2 / 2 (ln2 split in two
 * for precision), e^r by a degree-6 polynomial (Cephes' expf coefficients, within 2 ulp of expf),
 * 2^k put into the exponent bits. x is clamped to [-87, 88]: below, ~1e-38 instead of a denormal. */
INLINE float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float k = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* each row of scores [rows, n] becomes round(softmax(row)) */
INLINE void softmax_rows(float *restrict scores, int rows, int n, int bf16) {
    int full = n - n % LANES;
    for (int g = 0; g < rows; g++) {
        float *s = scores + (int64_t)g * n, part[LANES], max = -INFINITY;
        for (int j = 0; j < LANES; j++) part[j] = -INFINITY;
        for (int t = 0; t < full; t += LANES)
            for (int j = 0; j < LANES; j++) part[j] = s[t + j] > part[j] ? s[t + j] : part[j];
        for (int t = full; t < n; t++) max = s[t] > max ? s[t] : max;
        for (int j = 0; j < LANES; j++) max = part[j] > max ? part[j] : max;
        for (int t = 0; t < n; t++) s[t] = exp_clamped(s[t] - max);
        for (int j = 0; j < LANES; j++) part[j] = 0.0f;
        for (int t = 0; t < full; t += LANES)
            for (int j = 0; j < LANES; j++) part[j] += s[t + j];
        for (int t = full; t < n; t++) part[0] += s[t];
        float inv = 1.0f / sum_lanes(part);
        for (int t = 0; t < n; t++) s[t] = round_to(s[t] * inv, bf16);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* 8 elements from p[i] on, as float32 */
INLINE __m256 load8(const void *p, int64_t i, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    return _mm256_loadu_ps((const float *)p + i);
}

/* A register tile of up to six rows x 16 float32 columns in named variables lo0..lo5, hi0..hi5 (an array of
 * accumulators GCC keeps in memory, storing every one of them on every iteration). TILE6X16_ZERO declares them;
 * TILE6X16_FMA(n, a, lda, k, b_lo, b_hi) adds a[r * lda + k] times the 16 columns (b_lo, b_hi) to rows r < n,
 * with n a literal where it is used (the other rows' code folds away). */
#define TILE6X16_ZERO()                                                                                \
    __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0, lo3 = lo0, \
           hi3 = lo0, lo4 = lo0, hi4 = lo0, lo5 = lo0, hi5 = lo0
#define TILE6X16_ROW(n, r, a, lda, k, b_lo, b_hi)                        \
    if ((n) > r) {                                                       \
        __m256 a_r = _mm256_broadcast_ss((a) + r * (lda) + (k));         \
        lo##r = _mm256_fmadd_ps(a_r, (b_lo), lo##r);                     \
        hi##r = _mm256_fmadd_ps(a_r, (b_hi), hi##r);                     \
    }
#define TILE6X16_FMA(n, a, lda, k, b_lo, b_hi)                                                            \
    TILE6X16_ROW(n, 0, a, lda, k, b_lo, b_hi) TILE6X16_ROW(n, 1, a, lda, k, b_lo, b_hi)                  \
    TILE6X16_ROW(n, 2, a, lda, k, b_lo, b_hi) TILE6X16_ROW(n, 3, a, lda, k, b_lo, b_hi)                  \
    TILE6X16_ROW(n, 4, a, lda, k, b_lo, b_hi) TILE6X16_ROW(n, 5, a, lda, k, b_lo, b_hi)
#endif

#endif
