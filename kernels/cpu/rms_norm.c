/* RMSNorm on the CPU, optionally with the residual add before it, in one pass per row.
 *
 * The formula and roundings of kernels/reference/norm.py (Hugging Face Llama's), for rows of x
 * [rows, dim] in the model dtype (round = to that dtype, identity for fp32):
 *
 *   x      = round(x + residual)                      only when residual is given; x is updated in place
 *   normed = round(x * (1 / sqrt(mean(x^2) + eps)))   mean in float32
 *   out    = round(weight * normed)
 *
 * The float32 sum of squares is added in another order than torch's, so a row's scale can differ from
 * torch's in its last bit, and an element then in one rounding. Rows are shared among OpenMP threads only
 * when there are many (a prefill); a decode step's few rows cost less than waking a thread. Returns 0.
 */
#include "common.h"

INLINE void norm_row(void *x, const void *residual, const void *weight, int64_t dim, float eps, void *out, int bf16) {
    float part[LANES] = {0};
    int64_t full = dim - dim % LANES;
    if (residual)
        for (int64_t i = 0; i < dim; i++) store(x, i, load(x, i, bf16) + load(residual, i, bf16), bf16);
    for (int64_t i = 0; i < full; i += LANES)
        for (int j = 0; j < LANES; j++) {
            float v = load(x, i + j, bf16);
            part[j] += v * v;
        }
    for (int64_t i = full; i < dim; i++) {
        float v = load(x, i, bf16);
        part[0] += v * v;
    }
    float inv = 1.0f / sqrtf(sum_lanes(part) / (float)dim + eps);
    for (int64_t i = 0; i < dim; i++)
        store(out, i, load(weight, i, bf16) * round_to(load(x, i, bf16) * inv, bf16), bf16);
}

/* row r of x, residual and out */
INLINE void norm_row_at(void *x, const void *residual, const void *weight, int64_t r, int64_t dim, float eps, void *out,
                        int bf16) {
    size_t offset = (size_t)r * dim * (bf16 ? 2 : 4);
    norm_row((char *)x + offset, residual ? (const char *)residual + offset : NULL, weight, dim, eps,
             (char *)out + offset, bf16);
}

INLINE int rms_norm(void *x, const void *residual, const void *weight, int64_t rows, int64_t dim, float eps,
                    void *out, int num_threads, int bf16) {
    if (rows * dim >= PARALLEL_MIN_ELEMENTS && num_threads > 1) {
#pragma omp parallel for num_threads(num_threads)
        for (int64_t r = 0; r < rows; r++)
            bf16 ? norm_row_at(x, residual, weight, r, dim, eps, out, 1)
                 : norm_row_at(x, residual, weight, r, dim, eps, out, 0);
    } else {
        for (int64_t r = 0; r < rows; r++) norm_row_at(x, residual, weight, r, dim, eps, out, bf16);
    }
    return 0;
}

int rms_norm_bf16(void *x, const void *residual, const void *weight, int64_t rows, int64_t dim, float eps, void *out,
                  int num_threads) {
    return rms_norm(x, residual, weight, rows, dim, eps, out, num_threads, 1);
}

int rms_norm_f32(void *x, const void *residual, const void *weight, int64_t rows, int64_t dim, float eps, void *out,
                 int num_threads) {
    return rms_norm(x, residual, weight, rows, dim, eps, out, num_threads, 0);
}
