/* A linear layer of a few rows on the CPU in float32: y [m, n] = x [m, k] W^T (+ bias), W read once from memory.
 *
 * A decode step multiplies a handful of rows (one per running sequence) by every weight of the model, so its time
 * is the time to stream the weights from memory. The weight is packed once (`skinny_pack_f32`) into panels of
 * PANEL output columns, each panel's k rows contiguous:
 *
 *   packed[p][kk][j] = W[p * PANEL + j][kk]          zero past the last output column
 *
 * so one thread reads one sequential stream per panel, prefetching PREFETCH_ROWS rows ahead of its loads. For each
 * panel the rows of x go through a register tile of at most MAX_TILE_ROWS rows x PANEL columns (two 8-lane
 * accumulators per row: broadcast x[r][kk], multiply-add the panel's row kk); more rows split into balanced tiles
 * that re-read the panel from the core's cache. Panels are shared out among OpenMP threads (torch's pool, as in
 * the other kernels). Each output sums over kk in order, one fused multiply-add at a time, so results differ from
 * a BLAS's (another order) by rounding only.
 *
 * Built where the compiler targets AVX2 with FMA (`skinny_linear_available`); elsewhere the calls return -2 and
 * the caller keeps oneDNN. Returns 0, or -2 for shapes it does not take.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_SKINNY 1
#endif

#define PANEL 16
#define MAX_TILE_ROWS 6
#define PREFETCH_ROWS 64           /* 4 KiB of a panel ahead */
#define PARALLEL_MIN_WEIGHTS (1 << 15)

int skinny_linear_available(void) {
#ifdef HAVE_SKINNY
    return 1;
#else
    return 0;
#endif
}

int64_t skinny_packed_numel(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * PANEL * k; }

/* w [n, k] row-major -> packed [ceil(n / PANEL)][k][PANEL] (skinny_packed_numel floats) */
int skinny_pack_f32(const float *restrict w, int64_t n, int64_t k, float *restrict packed) {
    if (n <= 0 || k <= 0) return -2;
    int64_t panels = (n + PANEL - 1) / PANEL;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < PANEL; j++) {
                int64_t col = p * PANEL + j;
                packed[(p * k + kk) * PANEL + j] = col < n ? w[col * k + kk] : 0.0f;
            }
    return 0;
}

#ifdef HAVE_SKINNY
/* rows x[0..rows) (ldx apart) times one panel -> y (ldy apart), `cols` of its PANEL columns kept; `rows` is a
 * compile-time constant at each call below, so the accumulators live in registers */
static inline __attribute__((always_inline)) void panel_tile(const float *restrict x, int64_t ldx, const int rows,
                                                             const float *restrict panel, int64_t k,
                                                             const float *restrict bias, float *restrict y,
                                                             int64_t ldy, int cols) {
    __m256 lo[MAX_TILE_ROWS], hi[MAX_TILE_ROWS];
    for (int r = 0; r < rows; r++) lo[r] = _mm256_setzero_ps(), hi[r] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        _mm_prefetch((const char *)(panel + (kk + PREFETCH_ROWS) * PANEL), _MM_HINT_T0);
        __m256 w_lo = _mm256_loadu_ps(panel + kk * PANEL), w_hi = _mm256_loadu_ps(panel + kk * PANEL + 8);
        for (int r = 0; r < rows; r++) {
            __m256 xr = _mm256_broadcast_ss(x + r * ldx + kk);
            lo[r] = _mm256_fmadd_ps(xr, w_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(xr, w_hi, hi[r]);
        }
    }
    float out[PANEL];
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out, lo[r]);
        _mm256_storeu_ps(out + 8, hi[r]);
        if (bias)
            for (int j = 0; j < cols; j++) out[j] += bias[j];
        memcpy(y + r * ldy, out, (size_t)cols * sizeof(float));
    }
}

static void tile(const float *x, int64_t ldx, int rows, const float *panel, int64_t k, const float *bias, float *y,
                 int64_t ldy, int cols) {
    switch (rows) {
    case 1: panel_tile(x, ldx, 1, panel, k, bias, y, ldy, cols); break;
    case 2: panel_tile(x, ldx, 2, panel, k, bias, y, ldy, cols); break;
    case 3: panel_tile(x, ldx, 3, panel, k, bias, y, ldy, cols); break;
    case 4: panel_tile(x, ldx, 4, panel, k, bias, y, ldy, cols); break;
    case 5: panel_tile(x, ldx, 5, panel, k, bias, y, ldy, cols); break;
    default: panel_tile(x, ldx, 6, panel, k, bias, y, ldy, cols); break;
    }
}

/* every row of x through panel p */
static void one_panel(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                      float *y, int64_t p) {
    int cols = (p + 1) * PANEL <= n ? PANEL : (int)(n - p * PANEL);
    int64_t tiles = (m + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS, per_tile = (m + tiles - 1) / tiles;
    for (int64_t r = 0; r < m; r += per_tile) {
        int rows = (int)(m - r < per_tile ? m - r : per_tile);
        tile(x + r * k, k, rows, packed + p * k * PANEL, k, bias ? bias + p * PANEL : NULL, y + r * n + p * PANEL,
             n, cols);
    }
}
#endif

/* y [m, n] = x [m, k] W^T + bias (bias may be NULL), W packed by skinny_pack_f32; x, y contiguous */
int skinny_linear_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                      float *y, int num_threads) {
#ifdef HAVE_SKINNY
    if (m <= 0 || n <= 0 || k <= 0) return -2;
    int64_t panels = (n + PANEL - 1) / PANEL;
    if (num_threads > 1 && n * k >= PARALLEL_MIN_WEIGHTS) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t p = 0; p < panels; p++) one_panel(x, m, k, packed, n, bias, y, p);
    } else {
        for (int64_t p = 0; p < panels; p++) one_panel(x, m, k, packed, n, bias, y, p);
    }
    return 0;
#else
    (void)x, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y, (void)num_threads;
    return -2;
#endif
}
