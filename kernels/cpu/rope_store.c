/* Rotary embedding of a fused QKV projection, with its keys and values stored straight into the cache.
 *
 * qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] is the projection's output; per token
 * its row holds the query heads, then the key heads, then the value heads. cos and signed_sin
 * [num_tokens, head_dim] are RotaryEmbedding.lookup's tables in the model dtype. For every query and
 * key head vector x (half = head_dim / 2, round = to the model dtype):
 *
 *   rotated[d] = round(round(x[d] * cos[d]) + round(x[d +- half] * signed_sin[d]))
 *
 * which is kvmesh/model/rope.py::rotate, rounding for rounding. Rotated queries go to q_out
 * [num_tokens, num_heads, head_dim]; rotated keys and the values go to the caches at
 *
 *   cache + block_ids[t] * block_stride + offsets[t] * row_stride + kv_head * head_dim
 *
 * like kernels/reference/cache_ops.py::store_kv_at. Returns 0, or -2 for an odd head_dim or rows that overlap.
 */
#include "common.h"

INLINE void rotate_head(const void *x, const void *cos, const void *signed_sin, int head_dim, void *out, int bf16) {
    int half = head_dim / 2;
    for (int d = 0; d < head_dim; d++) {
        float swapped = load(x, d < half ? d + half : d - half, bf16);
        float a = round_to(load(x, d, bf16) * load(cos, d, bf16), bf16);
        float b = round_to(swapped * load(signed_sin, d, bf16), bf16);
        store(out, d, a + b, bf16);
    }
}

INLINE void rope_store_token(const void *qkv, int64_t t, int num_heads, int num_kv_heads, int head_dim,
                             const void *cos, const void *signed_sin, void *k_cache, void *v_cache,
                             int64_t block_stride, int64_t row_stride, const int64_t *block_ids,
                             const int64_t *offsets, void *q_out, int bf16) {
    size_t elem = bf16 ? 2 : 4, d = (size_t)head_dim;
    size_t width = (size_t)(num_heads + 2 * num_kv_heads) * d;
    const char *row = (const char *)qkv + t * width * elem;
    const char *c = (const char *)cos + t * d * elem, *s = (const char *)signed_sin + t * d * elem;
    int64_t slot = block_ids[t] * block_stride + offsets[t] * row_stride;
    for (int h = 0; h < num_heads; h++)
        rotate_head(row + h * d * elem, c, s, head_dim, (char *)q_out + (t * num_heads + h) * d * elem, bf16);
    for (int h = 0; h < num_kv_heads; h++) {
        rotate_head(row + (num_heads + h) * d * elem, c, s, head_dim, (char *)k_cache + (slot + h * d) * elem, bf16);
        memcpy((char *)v_cache + (slot + h * d) * elem, row + (num_heads + num_kv_heads + h) * d * elem, d * elem);
    }
}

INLINE int rope_store(const void *qkv, int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                      const void *cos, const void *signed_sin, void *k_cache, void *v_cache, int64_t block_stride,
                      int64_t row_stride, const int64_t *block_ids, const int64_t *offsets, void *q_out,
                      int num_threads, int bf16) {
    if (head_dim % 2 || row_stride < (int64_t)num_kv_heads * head_dim) return -2;
    if (num_tokens * (num_heads + 2 * num_kv_heads) * head_dim >= PARALLEL_MIN_ELEMENTS && num_threads > 1) {
#pragma omp parallel for num_threads(num_threads)
        for (int64_t t = 0; t < num_tokens; t++)
            bf16 ? rope_store_token(qkv, t, num_heads, num_kv_heads, head_dim, cos, signed_sin, k_cache, v_cache,
                                    block_stride, row_stride, block_ids, offsets, q_out, 1)
                 : rope_store_token(qkv, t, num_heads, num_kv_heads, head_dim, cos, signed_sin, k_cache, v_cache,
                                    block_stride, row_stride, block_ids, offsets, q_out, 0);
    } else {
        for (int64_t t = 0; t < num_tokens; t++)
            rope_store_token(qkv, t, num_heads, num_kv_heads, head_dim, cos, signed_sin, k_cache, v_cache,
                             block_stride, row_stride, block_ids, offsets, q_out, bf16);
    }
    return 0;
}

int rope_store_bf16(const void *qkv, int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                    const void *cos, const void *signed_sin, void *k_cache, void *v_cache, int64_t block_stride,
                    int64_t row_stride, const int64_t *block_ids, const int64_t *offsets, void *q_out, int num_threads) {
    return rope_store(qkv, num_tokens, num_heads, num_kv_heads, head_dim, cos, signed_sin, k_cache, v_cache,
                      block_stride, row_stride, block_ids, offsets, q_out, num_threads, 1);
}

int rope_store_f32(const void *qkv, int64_t num_tokens, int num_heads, int num_kv_heads, int head_dim,
                   const void *cos, const void *signed_sin, void *k_cache, void *v_cache, int64_t block_stride,
                   int64_t row_stride, const int64_t *block_ids, const int64_t *offsets, void *q_out, int num_threads) {
    return rope_store(qkv, num_tokens, num_heads, num_kv_heads, head_dim, cos, signed_sin, k_cache, v_cache,
                      block_stride, row_stride, block_ids, offsets, q_out, num_threads, 0);
}
