/* Causal attention of one sequence's new tokens over its whole paged context, on the CPU, read
 * straight from the block-major KV buffer (no gathered copy of the context).
 *
 * The case it is for: a prompt whose prefix is cached (a local hit, KV pulled from a peer), so a few
 * dozen new tokens attend to thousands of cached ones. torch spends ~2.9 ms a layer there (SmolLM2,
 * 32 tokens over 2,048, one thread) in two GEMMs whose [rows, keys] scores do not fit in L2; here the
 * GQA group's query rows of a tile of tokens share every key block while it is in L1.
 *
 * Token i of the query sits at position context_len + i and sees keys [0, context_len + i]:
 *
 *   keys       0 ............................ context_len ........ context_len + q_len
 *   token i    [ visible ...................................... i ]  (masked: exact zeros)
 *
 * Per KV head h and tile of tokens [i0, i1), rows r = (i - i0) * group + g (query head h * group + g):
 *
 *   q[r]       = round(query[i, h * group + g] * scale)      round = to the model dtype (identity in fp32)
 *   scores[r,t]= round(q[r] . k[t])                          fp32 accumulation
 *   p[r, t]    = round(softmax_t<=context_len+i(scores[r]))  in fp32, masked keys 0
 *   out[r]     = round(sum_t p[r, t] * v[t])                 fp32 accumulation
 *
 * which are the roundings of kernels/reference/attention.py::chunked_causal_attention (the bf16 path;
 * fp32 differs from the SDPA reference only by accumulation order). Items (KV head, token tile) are
 * shared out among num_threads OpenMP threads (torch's pool, as in decode_attention.c).
 * Returns 0, -1 when scratch space cannot be allocated, -2 for shapes it does not take.
 */
#include "common.h"

#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#endif

#define TILE_TOKENS 32 /* tokens per work item: 96 rows for SmolLM2's groups of 3 */
#define KEYS 16        /* keys per score tile: one float32 register */
#define ROWS 8         /* query rows per score pass (independent accumulators) */
#define PV_ROWS 6      /* query rows per value pass: 6 x 4 accumulators for head_dim 64 */

/* kt[d * KEYS + j] = key j of [0, count) at dim d, as float32; keys past count are zero. */
INLINE void transpose_keys(const char *k, int64_t row_stride, int count, int head_dim, float *restrict kt, int bf16) {
    size_t elem = bf16 ? 2 : 4;
    for (int j = 0; j < KEYS; j++)
        for (int d = 0; d < head_dim; d++)
            kt[d * KEYS + j] = j < count ? load(k + j * row_stride * elem, d, bf16) : 0.0f;
}

#ifdef __AVX512F__
/* n (<= ROWS, a literal at each call: registers, no branches) rows of scores against one transposed tile. */
INLINE void score_rows(const float *restrict q, int n, int head_dim, const float *restrict kt,
                       float *restrict scores, int64_t stride, int64_t t0, int bf16) {
    __m512 acc[ROWS];
    for (int r = 0; r < n; r++) acc[r] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        __m512 k = _mm512_loadu_ps(kt + d * KEYS);
        for (int r = 0; r < n; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * head_dim + d]), k, acc[r]);
    }
    for (int r = 0; r < n; r++) {
        float *s = scores + (int64_t)r * stride + t0;
        _mm512_storeu_ps(s, acc[r]);
        if (bf16)
            for (int j = 0; j < KEYS; j++) s[j] = round_to(s[j], 1);
    }
}
#endif

#ifdef HAVE_AVX2
#define ROWS_AVX2 6 /* 6 rows x 2 registers of keys: the tile of common.h */
/* n (<= ROWS_AVX2, a literal at each call) rows of scores against one transposed tile, 8 keys a register. */
INLINE void score_rows_avx2(const float *restrict q, const int n, int head_dim, const float *restrict kt,
                            float *restrict scores, int64_t stride, int64_t t0, int bf16) {
    TILE6X16_ZERO();
    for (int d = 0; d < head_dim; d++) {
        __m256 k_lo = _mm256_loadu_ps(kt + d * KEYS), k_hi = _mm256_loadu_ps(kt + d * KEYS + 8);
        TILE6X16_FMA(n, q, head_dim, d, k_lo, k_hi)
    }
#define STORE(r)                                                                  \
    if (n > r) {                                                                  \
        float *s = scores + (int64_t)r * stride + t0;                             \
        _mm256_storeu_ps(s, lo##r);                                               \
        _mm256_storeu_ps(s + 8, hi##r);                                           \
        if (bf16)                                                                 \
            for (int j = 0; j < KEYS; j++) s[j] = round_to(s[j], 1);             \
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
}
#endif

/* scores[r * stride + t0 .. + KEYS) = round(q[r] . keys) for rows [0, rows) against one transposed tile. */
INLINE void score_tile(const float *restrict q, int rows, int head_dim, const float *restrict kt,
                       float *restrict scores, int64_t stride, int64_t t0, int bf16) {
#ifdef __AVX512F__
    int r0 = 0;
    for (; r0 + ROWS <= rows; r0 += ROWS)
        score_rows(q + r0 * head_dim, ROWS, head_dim, kt, scores + (int64_t)r0 * stride, stride, t0, bf16);
    for (; r0 < rows; r0++)
        score_rows(q + r0 * head_dim, 1, head_dim, kt, scores + (int64_t)r0 * stride, stride, t0, bf16);
#elif defined(HAVE_AVX2)
    int r0 = 0;
    for (; r0 + ROWS_AVX2 <= rows; r0 += ROWS_AVX2)
        score_rows_avx2(q + r0 * head_dim, ROWS_AVX2, head_dim, kt, scores + (int64_t)r0 * stride, stride, t0, bf16);
    for (; r0 < rows; r0++)
        score_rows_avx2(q + r0 * head_dim, 1, head_dim, kt, scores + (int64_t)r0 * stride, stride, t0, bf16);
#else
    for (int r = 0; r < rows; r++) {
        float acc[KEYS] = {0};
        const float *qr = q + r * head_dim;
        for (int d = 0; d < head_dim; d++)
            for (int j = 0; j < KEYS; j++) acc[j] += qr[d] * kt[d * KEYS + j];
        float *s = scores + (int64_t)r * stride + t0;
        for (int j = 0; j < KEYS; j++) s[j] = round_to(acc[j], bf16);
    }
#endif
}

#ifdef __AVX512F__
INLINE __m512 load16(const char *row, int64_t at, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + at))), 16));
    return _mm512_loadu_ps((const float *)row + at);
}

/* n rows x chunks * LANES dims from d0 (both literals at each call: the accumulators stay in registers). */
INLINE void value_rows(const float *restrict p, int n, int64_t stride, int64_t t0, const char *v, int64_t row_bytes,
                       int count, int d0, int chunks, int head_dim, float *restrict acc, int bf16) {
    __m512 a[PV_ROWS][4];
    for (int r = 0; r < n; r++)
        for (int c = 0; c < chunks; c++) a[r][c] = _mm512_loadu_ps(acc + r * head_dim + d0 + c * LANES);
    for (int j = 0; j < count; j++) {
        __m512 x[4];
        for (int c = 0; c < chunks; c++) x[c] = load16(v + j * row_bytes, d0 + c * LANES, bf16);
        for (int r = 0; r < n; r++) {
            __m512 pr = _mm512_set1_ps(p[(int64_t)r * stride + t0 + j]);
            for (int c = 0; c < chunks; c++) a[r][c] = _mm512_fmadd_ps(pr, x[c], a[r][c]);
        }
    }
    for (int r = 0; r < n; r++)
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(acc + r * head_dim + d0 + c * LANES, a[r][c]);
}
#endif

#ifdef HAVE_AVX2
#define PV_ROWS_AVX2 2 /* 2 rows x 4 registers (32 dims): 8 accumulators, named, and the 4 value registers */
/* n (1 or 2, a literal at each call) rows x 32 dims from d0: acc += p . v over keys [0, count). */
INLINE void value_rows_avx2(const float *restrict p, const int n, int64_t stride, int64_t t0, const char *v,
                            int64_t row_bytes, int count, int d0, int head_dim, float *restrict acc, int bf16) {
    float *a0 = acc + d0, *a1 = acc + head_dim + d0;
    __m256 r0c0 = _mm256_loadu_ps(a0), r0c1 = _mm256_loadu_ps(a0 + 8), r0c2 = _mm256_loadu_ps(a0 + 16),
           r0c3 = _mm256_loadu_ps(a0 + 24);
    __m256 r1c0 = _mm256_setzero_ps(), r1c1 = r1c0, r1c2 = r1c0, r1c3 = r1c0;
    if (n > 1)
        r1c0 = _mm256_loadu_ps(a1), r1c1 = _mm256_loadu_ps(a1 + 8), r1c2 = _mm256_loadu_ps(a1 + 16),
        r1c3 = _mm256_loadu_ps(a1 + 24);
    for (int j = 0; j < count; j++) {
        const char *row = v + j * row_bytes;
        __m256 x0 = load8(row, d0, bf16), x1 = load8(row, d0 + 8, bf16), x2 = load8(row, d0 + 16, bf16),
               x3 = load8(row, d0 + 24, bf16);
        __m256 p0 = _mm256_broadcast_ss(p + t0 + j);
        r0c0 = _mm256_fmadd_ps(p0, x0, r0c0), r0c1 = _mm256_fmadd_ps(p0, x1, r0c1);
        r0c2 = _mm256_fmadd_ps(p0, x2, r0c2), r0c3 = _mm256_fmadd_ps(p0, x3, r0c3);
        if (n > 1) {
            __m256 p1 = _mm256_broadcast_ss(p + stride + t0 + j);
            r1c0 = _mm256_fmadd_ps(p1, x0, r1c0), r1c1 = _mm256_fmadd_ps(p1, x1, r1c1);
            r1c2 = _mm256_fmadd_ps(p1, x2, r1c2), r1c3 = _mm256_fmadd_ps(p1, x3, r1c3);
        }
    }
    _mm256_storeu_ps(a0, r0c0), _mm256_storeu_ps(a0 + 8, r0c1), _mm256_storeu_ps(a0 + 16, r0c2);
    _mm256_storeu_ps(a0 + 24, r0c3);
    if (n > 1)
        _mm256_storeu_ps(a1, r1c0), _mm256_storeu_ps(a1 + 8, r1c1), _mm256_storeu_ps(a1 + 16, r1c2),
        _mm256_storeu_ps(a1 + 24, r1c3);
}
#endif

/* acc[r] += sum over keys [0, count) of p[r * stride + t0 + j] * v[j], rows [0, rows); v rows row_stride apart. */
INLINE void value_tile(const float *restrict p, int rows, int64_t stride, int64_t t0, const char *v,
                       int64_t row_stride, int count, int head_dim, float *restrict acc, int bf16) {
    size_t elem = bf16 ? 2 : 4;
#ifdef __AVX512F__
    int64_t row_bytes = row_stride * elem;
    for (int d0 = 0; d0 < head_dim; d0 += 4 * LANES) {
        int r0 = 0;
        if (head_dim - d0 >= 4 * LANES)
            for (; r0 + PV_ROWS <= rows; r0 += PV_ROWS)
                value_rows(p + (int64_t)r0 * stride, PV_ROWS, stride, t0, v, row_bytes, count, d0, 4, head_dim,
                           acc + r0 * head_dim, bf16);
        for (; r0 < rows; r0++) /* the rows left, and head dims past the last multiple of 64: one at a time */
            for (int c = 0; c < 4 && d0 + c * LANES < head_dim; c++)
                value_rows(p + (int64_t)r0 * stride, 1, stride, t0, v, row_bytes, count, d0 + c * LANES, 1, head_dim,
                           acc + r0 * head_dim, bf16);
    }
#else
#ifdef HAVE_AVX2
    if (head_dim % 32 == 0) {
        int64_t row_bytes = row_stride * elem;
        for (int d0 = 0; d0 < head_dim; d0 += 32) {
            int r0 = 0;
            for (; r0 + PV_ROWS_AVX2 <= rows; r0 += PV_ROWS_AVX2)
                value_rows_avx2(p + (int64_t)r0 * stride, PV_ROWS_AVX2, stride, t0, v, row_bytes, count, d0, head_dim,
                                acc + r0 * head_dim, bf16);
            if (r0 < rows)
                value_rows_avx2(p + (int64_t)r0 * stride, 1, stride, t0, v, row_bytes, count, d0, head_dim,
                                acc + r0 * head_dim, bf16);
        }
        return;
    }
#endif
    for (int j = 0; j < count; j++) {
        const char *vj = v + j * row_stride * elem;
        for (int r = 0; r < rows; r++) {
            float pr = p[(int64_t)r * stride + t0 + j];
            for (int d = 0; d < head_dim; d++) acc[r * head_dim + d] += pr * load(vj, d, bf16);
        }
    }
#endif
}

/* One item: KV head h, tokens [i0, i1). scratch: q [rows, D], acc [rows, D], kt [D, KEYS], scores [rows, n + KEYS]. */
INLINE void attend_tile(const void *query, const void *k_cache, const void *v_cache, int64_t block_stride,
                        int64_t row_stride, const int32_t *table, int context_len, int i0, int i1, int h, int num_heads,
                        int num_kv_heads, int head_dim, int block_size, float scale, float *scratch, void *out,
                        int bf16) {
    size_t elem = bf16 ? 2 : 4;
    int group = num_heads / num_kv_heads, rows = (i1 - i0) * group;
    int64_t n = context_len + i1, stride = n + KEYS;
    float *q = scratch, *acc = q + rows * head_dim, *kt = acc + rows * head_dim, *scores = kt + head_dim * KEYS;
    for (int i = i0; i < i1; i++)
        for (int g = 0; g < group; g++)
            for (int d = 0; d < head_dim; d++) {
                int64_t at = ((int64_t)i * num_heads + h * group + g) * head_dim + d;
                q[((i - i0) * group + g) * head_dim + d] = round_to(load(query, at, bf16) * scale, bf16);
            }
    for (int64_t t0 = 0, count; t0 < n; t0 += count) { /* up to KEYS keys at a time, within one block */
        int64_t blk = t0 / block_size, off = t0 % block_size;
        count = n - t0 < KEYS ? n - t0 : KEYS;
        count = count < block_size - off ? count : block_size - off;
        const char *k = (const char *)k_cache + (table[blk] * block_stride + off * row_stride + h * head_dim) * elem;
        transpose_keys(k, row_stride, (int)count, head_dim, kt, bf16);
        score_tile(q, rows, head_dim, kt, scores, stride, t0, bf16); /* writes KEYS columns: stride has room */
    }
    for (int r = 0; r < rows; r++) {
        int visible = context_len + i0 + r / group + 1;
        softmax_rows(scores + (int64_t)r * stride, 1, visible, bf16);
        memset(scores + (int64_t)r * stride + visible, 0, sizeof(float) * (n - visible));
    }
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        int64_t blk = t0 / block_size;
        int count = (int)(n - t0 < block_size ? n - t0 : block_size);
        const char *v = (const char *)v_cache + (table[blk] * block_stride + h * head_dim) * elem;
        value_tile(scores, rows, stride, t0, v, row_stride, count, head_dim, acc, bf16);
    }
    for (int i = i0; i < i1; i++)
        for (int g = 0; g < group; g++)
            for (int d = 0; d < head_dim; d++) {
                int64_t at = ((int64_t)i * num_heads + h * group + g) * head_dim + d;
                store(out, at, acc[((i - i0) * group + g) * head_dim + d], bf16);
            }
}

INLINE int prefill_attention(const void *query, const void *k_cache, const void *v_cache, int64_t block_stride,
                             int64_t row_stride, const int32_t *table, int context_len, int q_len, int num_heads, int num_kv_heads,
                             int head_dim, int block_size, float scale, void *out, int num_threads, int bf16) {
    if (head_dim % LANES || num_kv_heads <= 0 || num_heads % num_kv_heads || q_len <= 0 || context_len < 0 ||
        block_size <= 0 || row_stride < (int64_t)num_kv_heads * head_dim)
        return -2;
    int group = num_heads / num_kv_heads, tiles = (q_len + TILE_TOKENS - 1) / TILE_TOKENS;
    int items = num_kv_heads * tiles, rows = TILE_TOKENS * group, failed = 0;
    int64_t stride = (int64_t)context_len + q_len + KEYS; /* the longest row of scores, plus a tile's overhang */
    size_t floats = (size_t)rows * (2 * head_dim + stride) + (size_t)head_dim * KEYS;
#pragma omp parallel num_threads(num_threads) if (items > 1 && num_threads > 1)
    {
        float *scratch = malloc(sizeof(float) * floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            int h = item % num_kv_heads, i0 = item / num_kv_heads * TILE_TOKENS;
            int i1 = i0 + TILE_TOKENS < q_len ? i0 + TILE_TOKENS : q_len;
            if (!scratch) continue;
            if (bf16) /* a literal per branch (see decode_attention.c) */
                attend_tile(query, k_cache, v_cache, block_stride, row_stride, table, context_len, i0, i1, h,
                            num_heads, num_kv_heads, head_dim, block_size, scale, scratch, out, 1);
            else
                attend_tile(query, k_cache, v_cache, block_stride, row_stride, table, context_len, i0, i1, h,
                            num_heads, num_kv_heads, head_dim, block_size, scale, scratch, out, 0);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

int prefill_attention_bf16(const void *query, const void *k_cache, const void *v_cache, int64_t block_stride,
                           int64_t row_stride, const int32_t *table, int context_len, int q_len, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, float scale, void *out, int num_threads) {
    return prefill_attention(query, k_cache, v_cache, block_stride, row_stride, table, context_len, q_len, num_heads,
                             num_kv_heads, head_dim, block_size, scale, out, num_threads, 1);
}

int prefill_attention_f32(const void *query, const void *k_cache, const void *v_cache, int64_t block_stride,
                          int64_t row_stride, const int32_t *table, int context_len, int q_len, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, float scale, void *out, int num_threads) {
    return prefill_attention(query, k_cache, v_cache, block_stride, row_stride, table, context_len, q_len, num_heads,
                             num_kv_heads, head_dim, block_size, scale, out, num_threads, 0);
}
