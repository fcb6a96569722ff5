/* Paged decode attention on the CPU, read straight from the block-major KV buffer.
 *
 * Built on first use by kernels/cpu/library.py (cc -O3 -march=native -fopenmp) and called through
 * ctypes, one call per layer; the (sequence, KV head) pairs are shared out among num_threads OpenMP
 * threads (torch's own pool: the library links the libgomp torch has loaded; the caller passes
 * torch's intra-op thread count, since OpenMP's default is per calling thread). It computes what
 * kernels/reference/attention.py::decode_attention does without gathering the context into new
 * tensors first, and with the same roundings:
 *
 *   scores[g, t] = round(q[g] . k[t]) * scale        round = to the model dtype (identity for fp32)
 *   p[g, t]      = round(softmax_t(scores[g, t]))     in float32, then rounded
 *   out[g]       = round(sum_t p[g, t] * v[t])        float32 accumulation
 *
 * Key t of sequence b sits in block block_tables[b][t / block_size] at offset t % block_size:
 *
 *   k_cache + block_id * block_stride + (t % block_size) * row_stride + kv_head * head_dim
 *             `-- one layer's K of one block: [block_size, num_kv_heads, head_dim], rows row_stride
 *                 apart (num_kv_heads * head_dim, or more for a tensor-parallel rank's heads of a whole buffer)
 *
 * A query head h reads KV head h / (num_heads / num_kv_heads) (grouped-query attention); the group's
 * query rows are processed together so every key row is loaded once per KV head. Keys are read in one pass
 * and values in a second, each prefetching the next block of what it reads; on AVX2 machines (AVX-512 ones too),
 * eight key rows are dotted at a time (one horizontal sum per eight scores) and value rows are summed into
 * accumulators held in registers over a block's rows.
 * Returns 0, -1 when scratch space cannot be allocated, -2 for shapes it does not take.
 */
#include "common.h"

#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#ifdef __AVX512BF16__
#define HAVE_AVX512_BF16 1
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__) /* AVX-512 machines too: the block paths below beat a row at a time */
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#ifdef HAVE_AVX2
/* the sums of a[0..7]'s lanes, in one register (lane r: a[r]'s sum) */
INLINE __m256 sum8x8(const __m256 *a) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* scores[g * n] = round(q[g] . k) * scale for the group's query rows q [group, head_dim] (q_raw: the
 * same rows in the model dtype, which the AVX512-BF16 path multiplies directly, two pairs a lane) */
INLINE void dot_group(const float *restrict q, const void *restrict q_raw, const void *restrict k, int group,
                      int head_dim, float scale, float *restrict scores, int64_t n, int bf16) {
#ifdef HAVE_AVX512_BF16
    if (bf16 && head_dim % 32 == 0) {
        for (int g = 0; g < group; g++) {
            __m512 acc = _mm512_setzero_ps();
            const uint16_t *qg = (const uint16_t *)q_raw + g * head_dim, *kk = k;
            for (int d = 0; d < head_dim; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qg + d), (__m512bh)_mm512_loadu_si512(kk + d));
            scores[g * n] = round_to(_mm512_reduce_add_ps(acc), bf16) * scale;
        }
        return;
    }
#endif
#ifdef __AVX512F__
    if (!bf16 && head_dim % 16 == 0) {
        for (int g = 0; g < group; g++) {
            __m512 acc = _mm512_setzero_ps();
            const float *qg = q + g * head_dim, *kk = k;
            for (int d = 0; d < head_dim; d += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), _mm512_loadu_ps(kk + d), acc);
            scores[g * n] = _mm512_reduce_add_ps(acc) * scale;
        }
        return;
    }
#endif
    for (int g = 0; g < group; g++) {
        float part[LANES] = {0};
        const float *qg = q + g * head_dim;
        for (int d = 0; d < head_dim; d += LANES)
            for (int j = 0; j < LANES; j++) part[j] += qg[d + j] * load(k, d + j, bf16);
        scores[g * n] = round_to(sum_lanes(part), bf16) * scale;
    }
}

/* acc[g] += p[g * n] * v for the group's rows */
INLINE void axpy_group(const float *restrict p, int64_t n, const void *restrict v, int group, int head_dim,
                       float *restrict acc, int bf16) {
#ifdef HAVE_AVX512_BF16
    if (bf16) {
        const uint16_t *vv = v;
        for (int d = 0; d < head_dim; d += 16) {
            __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vv + d))), 16));
            for (int g = 0; g < group; g++) {
                float *a = acc + g * head_dim + d;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(p[g * n]), x, _mm512_loadu_ps(a)));
            }
        }
        return;
    }
#endif
#ifdef __AVX512F__
    if (!bf16) {
        const float *vv = v;
        for (int d = 0; d < head_dim; d += 16) {
            __m512 x = _mm512_loadu_ps(vv + d);
            for (int g = 0; g < group; g++) {
                float *a = acc + g * head_dim + d;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(p[g * n]), x, _mm512_loadu_ps(a)));
            }
        }
        return;
    }
#endif
    for (int g = 0; g < group; g++) {
        float pg = p[g * n];
        for (int d = 0; d < head_dim; d++) acc[g * head_dim + d] += pg * load(v, d, bf16);
    }
}

/* Brings a block's rows [first, first + bytes) towards the cache while the previous one is used. */
INLINE void prefetch_block(const char *rows, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(rows + off, 0, 3);
}

/* scores[g * n + i] = round(q[g] . k_i) * scale for one KV head's key rows i < end of a block (k: its first
 * row, rows `row` elements apart). With AVX2, eight rows at a time: one horizontal sum per eight scores. */
INLINE void dot_block(const float *restrict q, const void *restrict q_raw, const char *k, int64_t end, int64_t row,
                      int group, int head_dim, float scale, float *restrict scores, int64_t n, int bf16) {
    size_t elem = bf16 ? 2 : 4;
    int64_t i = 0;
#ifdef HAVE_AVX2
    if (head_dim % 8 == 0) {
        for (; i + 8 <= end; i += 8)
            for (int g = 0; g < group; g++) {
                __m256 acc[8];
                for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
                for (int d = 0; d < head_dim; d += 8) {
                    __m256 qd = _mm256_loadu_ps(q + g * head_dim + d);
                    for (int r = 0; r < 8; r++)
                        acc[r] = _mm256_fmadd_ps(qd, load8(k, (i + r) * row + d, bf16), acc[r]);
                }
                __m256 sums = sum8x8(acc);
                float *out = scores + g * n + i;
                if (bf16) {
                    float lanes[8];
                    _mm256_storeu_ps(lanes, sums);
                    for (int r = 0; r < 8; r++) out[r] = round_to(lanes[r], 1) * scale;
                } else {
                    _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
                }
            }
    }
#endif
    for (; i < end; i++)
        dot_group(q, q_raw, k + i * row * elem, group, head_dim, scale, scores + i, n, bf16);
}

/* acc[g] += p[g * n + i] * v_i for one KV head's value rows i < end of a block (v: its first row). With AVX2,
 * 32 accumulator columns at a time stay in registers over the block's rows. */
INLINE void axpy_block(const float *restrict p, int64_t n, const char *v, int64_t end, int64_t row, int group,
                       int head_dim, float *restrict acc, int bf16) {
    size_t elem = bf16 ? 2 : 4;
#ifdef HAVE_AVX2
    if (head_dim % 32 == 0) {
        for (int g = 0; g < group; g++)
            for (int d = 0; d < head_dim; d += 32) {
                float *a = acc + g * head_dim + d;
                __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8), a2 = _mm256_loadu_ps(a + 16),
                       a3 = _mm256_loadu_ps(a + 24);
                for (int64_t i = 0; i < end; i++) {
                    __m256 pg = _mm256_set1_ps(p[g * n + i]);
                    int64_t at = i * row + d;
                    a0 = _mm256_fmadd_ps(pg, load8(v, at, bf16), a0);
                    a1 = _mm256_fmadd_ps(pg, load8(v, at + 8, bf16), a1);
                    a2 = _mm256_fmadd_ps(pg, load8(v, at + 16, bf16), a2);
                    a3 = _mm256_fmadd_ps(pg, load8(v, at + 24, bf16), a3);
                }
                _mm256_storeu_ps(a, a0);
                _mm256_storeu_ps(a + 8, a1);
                _mm256_storeu_ps(a + 16, a2);
                _mm256_storeu_ps(a + 24, a3);
            }
        return;
    }
#endif
    for (int64_t i = 0; i < end; i++)
        axpy_group(p + i, n, v + i * row * elem, group, head_dim, acc, bf16);
}

/* One sequence, KV heads [h0, h1): the rows of every block are walked in memory order (all heads of a
 * row are adjacent), the next block prefetched. scratch holds (h1 - h0) * group * (n + 2 * head_dim)
 * floats: scores [heads * group, n], then the queries and the accumulators [heads * group, head_dim]. */
INLINE void attend(const void *query, const void *k_cache, const void *v_cache, int64_t block_stride,
                   int64_t row, const int32_t *table, int n, int h0, int h1, int group, int head_dim,
                   int block_size, float scale, float *scratch, void *out, int bf16) {
    size_t elem = bf16 ? 2 : 4, rows = (size_t)(h1 - h0) * group;
    int64_t num_blocks = (n + block_size - 1) / block_size;
    size_t block_bytes = (size_t)block_size * row * elem;
    float *scores = scratch, *q = scores + rows * n, *acc = q + rows * head_dim;
    const char *qh = (const char *)query + (size_t)h0 * group * head_dim * elem;
    for (size_t i = 0; i < rows * head_dim; i++) q[i] = load(qh, i, bf16);
    for (int64_t blk = 0; blk < num_blocks; blk++) {  /* keys: each pass prefetches only what it reads next */
        int64_t t0 = blk * block_size, end = n - t0 < block_size ? n - t0 : block_size;
        const char *k = (const char *)k_cache + table[blk] * block_stride * elem;
        if (blk + 1 < num_blocks)
            prefetch_block((const char *)k_cache + table[blk + 1] * block_stride * elem, block_bytes);
        for (int h = h0; h < h1; h++) {
            size_t r = (size_t)(h - h0) * group;
            dot_block(q + r * head_dim, qh + r * head_dim * elem, k + h * head_dim * elem, end, row, group, head_dim,
                      scale, scores + r * n + t0, n, bf16);
        }
    }
    softmax_rows(scores, (int)rows, n, bf16);
    memset(acc, 0, sizeof(float) * rows * head_dim);
    for (int64_t blk = 0; blk < num_blocks; blk++) {  /* values */
        int64_t t0 = blk * block_size, end = n - t0 < block_size ? n - t0 : block_size;
        const char *v = (const char *)v_cache + table[blk] * block_stride * elem;
        if (blk + 1 < num_blocks)
            prefetch_block((const char *)v_cache + table[blk + 1] * block_stride * elem, block_bytes);
        for (int h = h0; h < h1; h++) {
            size_t r = (size_t)(h - h0) * group;
            axpy_block(scores + r * n + t0, n, v + h * head_dim * elem, end, row, group, head_dim, acc + r * head_dim,
                       bf16);
        }
    }
    char *o = (char *)out + (size_t)h0 * group * head_dim * elem;
    for (size_t i = 0; i < rows * head_dim; i++) store(o, i, acc[i], bf16);
}

/* Work items are whole sequences when there are enough of them to keep every thread busy, else
 * (sequence, KV head) pairs, so a single long sequence still uses every thread. */
INLINE int decode_attention(const void *query, const void *k_cache, const void *v_cache, int64_t block_stride,
                            int64_t row_stride, const int32_t *block_tables, int64_t table_stride,
                            const int32_t *seq_lens, int batch, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, float scale, void *out, int num_threads, int bf16) {
    if (head_dim % LANES || num_kv_heads <= 0 || num_heads % num_kv_heads ||
        row_stride < (int64_t)num_kv_heads * head_dim)
        return -2;
    int group = num_heads / num_kv_heads, max_len = 0, failed = 0;
    for (int b = 0; b < batch; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int split = batch < num_threads ? num_kv_heads : 1;
    int items = batch * split, heads_per_item = num_kv_heads / split;
    size_t floats = (size_t)heads_per_item * group * (max_len + 2 * head_dim), elem = bf16 ? 2 : 4;
#pragma omp parallel num_threads(num_threads) if (items > 1 && num_threads > 1)
    {
        float *scratch = malloc(sizeof(float) * floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            int b = item / split, h0 = item % split * heads_per_item;
            const char *q = (const char *)query + (size_t)b * num_heads * head_dim * elem;
            const int32_t *table = block_tables + b * table_stride;
            char *o = (char *)out + (size_t)b * num_heads * head_dim * elem;
            if (!scratch) continue;
            if (bf16) /* a literal per branch: the outlined region would otherwise compile a generic copy */
                attend(q, k_cache, v_cache, block_stride, row_stride, table, seq_lens[b], h0, h0 + heads_per_item,
                       group, head_dim, block_size, scale, scratch, o, 1);
            else
                attend(q, k_cache, v_cache, block_stride, row_stride, table, seq_lens[b], h0, h0 + heads_per_item,
                       group, head_dim, block_size, scale, scratch, o, 0);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

int decode_attention_bf16(const void *query, const void *k_cache, const void *v_cache, int64_t block_stride,
                          int64_t row_stride, const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                          int batch, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, void *out,
                          int num_threads) {
    return decode_attention(query, k_cache, v_cache, block_stride, row_stride, block_tables, table_stride, seq_lens,
                            batch, num_heads, num_kv_heads, head_dim, block_size, scale, out, num_threads, 1);
}

int decode_attention_f32(const void *query, const void *k_cache, const void *v_cache, int64_t block_stride,
                         int64_t row_stride, const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                         int batch, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, void *out,
                         int num_threads) {
    return decode_attention(query, k_cache, v_cache, block_stride, row_stride, block_tables, table_stride, seq_lens,
                            batch, num_heads, num_kv_heads, head_dim, block_size, scale, out, num_threads, 0);
}
