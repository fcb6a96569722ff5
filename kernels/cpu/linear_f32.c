/* A float32 linear layer on the CPU: y [m, n] = x [m, k] W^T (+ bias), W packed once in panels of 16 columns.
 *
 * A decode step multiplies a handful of rows (one per running sequence) by every weight of the model, so its time
 * is the time to stream the weights from memory; a prompt's many rows make it the time to multiply. The weight is
 * packed once (`linear_pack_f32`) into panels of PANEL output columns, each panel's k rows contiguous:
 *
 *   packed[p][kk][j] = W[p * PANEL + j][kk]          zero past the last output column
 *
 * so a thread reads one sequential stream per panel, prefetching PREFETCH_ROWS rows ahead of its loads. Rows of x
 * go through a register tile of at most MAX_TILE_ROWS rows x PANEL columns (two 8-lane accumulators per row, named
 * variables: broadcast x[r][kk], multiply-add the panel's row kk); more rows split into balanced tiles, each tile
 * taken across a group of panels that stay in the core's L2 while it is in L1 (one tile: no groups, each panel
 * streamed once). Groups of panels are shared out among OpenMP threads (torch's pool, as in the other kernels).
 * Each output sums over kk in order, one fused multiply-add at a time, so results differ from a BLAS's (another
 * order) by rounding only.
 *
 * Built where the compiler targets AVX2 with FMA (`linear_f32_available`); elsewhere the calls return -2 and the
 * model keeps oneDNN. Returns 0, or -2 for shapes it does not take.
 */
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_PANEL_LINEAR 1
#endif

#define PANEL 16
#define MAX_TILE_ROWS 6
#define PREFETCH_ROWS 64           /* 4 KiB of a panel ahead */
#define PARALLEL_MIN_WEIGHTS (1 << 15)
#define MAX_GROUP_PANELS 8          /* 8 panels of k = 576: 288 KiB, within a core's L2 */

int linear_f32_available(void) {
#ifdef HAVE_PANEL_LINEAR
    return 1;
#else
    return 0;
#endif
}

int64_t linear_packed_numel(int64_t n, int64_t k) { return (n + PANEL - 1) / PANEL * PANEL * k; }

/* w [n, k] row-major -> packed [ceil(n / PANEL)][k][PANEL] (linear_packed_numel floats) */
int linear_pack_f32(const float *restrict w, int64_t n, int64_t k, float *restrict packed) {
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

#ifdef HAVE_PANEL_LINEAR
/* one output row's PANEL sums (+ bias), `cols` of them kept */
static inline __attribute__((always_inline)) void store_row(__m256 lo, __m256 hi, const float *restrict bias,
                                                            float *restrict y, int cols) {
    float out[PANEL];
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
    if (bias)
        for (int j = 0; j < cols; j++) out[j] += bias[j];
    memcpy(y, out, (size_t)cols * sizeof(float));
}

/* rows x[0..rows) (ldx apart) times one panel -> y (ldy apart), `cols` of its PANEL columns kept; `rows` is a
 * compile-time constant at each call below (the register tile: common.h) */
static inline __attribute__((always_inline)) void panel_tile(const float *restrict x, int64_t ldx, const int rows,
                                                             const float *restrict panel, int64_t k,
                                                             const float *restrict bias, float *restrict y,
                                                             int64_t ldy, int cols) {
    TILE6X16_ZERO();
    for (int64_t kk = 0; kk < k; kk++) {
        _mm_prefetch((const char *)(panel + (kk + PREFETCH_ROWS) * PANEL), _MM_HINT_T0);
        __m256 w_lo = _mm256_loadu_ps(panel + kk * PANEL), w_hi = _mm256_loadu_ps(panel + kk * PANEL + 8);
        TILE6X16_FMA(rows, x, ldx, kk, w_lo, w_hi)
    }
#define STORE_ROW(r) if (rows > r) store_row(lo##r, hi##r, bias, y + r * ldy, cols);
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
#undef STORE_ROW
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

/* every row of x through panels [first, last): row tiles outer, so a tile of x stays in L1 while the group's
 * panels (in L2) go by, and x is read from further out once per group rather than once per panel */
static void panel_group(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias,
                        float *y, int64_t first, int64_t last) {
    int64_t tiles = (m + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS, per_tile = (m + tiles - 1) / tiles;
    for (int64_t r = 0; r < m; r += per_tile) {
        int rows = (int)(m - r < per_tile ? m - r : per_tile);
        for (int64_t p = first; p < last; p++) {
            int cols = (p + 1) * PANEL <= n ? PANEL : (int)(n - p * PANEL);
            tile(x + r * k, k, rows, packed + p * k * PANEL, k, bias ? bias + p * PANEL : NULL,
                 y + r * n + p * PANEL, n, cols);
        }
    }
}
#endif

/* y [m, n] = x [m, k] W^T + bias (bias may be NULL), W packed by linear_pack_f32; x, y contiguous */
int linear_f32(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias, float *y,
               int num_threads) {
#ifdef HAVE_PANEL_LINEAR
    if (m <= 0 || n <= 0 || k <= 0) return -2;
    int64_t panels = (n + PANEL - 1) / PANEL;
    int threads = num_threads > 1 && n * k >= PARALLEL_MIN_WEIGHTS ? num_threads : 1;
    /* one tile of rows streams each panel once: no groups; more share each tile over a group of panels, small
     * enough that every thread still gets several */
    int64_t group = m <= MAX_TILE_ROWS ? 1 : panels / (4 * threads);
    group = group < 1 ? 1 : group > MAX_GROUP_PANELS ? MAX_GROUP_PANELS : group;
    int64_t groups = (panels + group - 1) / group;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t g = 0; g < groups; g++)
        panel_group(x, m, k, packed, n, bias, y, g * group, g * group + group < panels ? g * group + group : panels);
    return 0;
#else
    (void)x, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y, (void)num_threads;
    return -2;
#endif
}
