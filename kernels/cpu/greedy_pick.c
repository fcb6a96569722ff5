/* Greedy picks on the CPU: for each row of logits x [rows, vocab] (float32), the index of its first maximum and
 * that token's logprob under log_softmax, in one read of the row instead of a log_softmax written out and read
 * back.
 *
 *   logprob = -log(sum_j e^(x_j - max))      e^ in float32 (within 2 ulp), summed in float64
 *
 * (nearer the exact value than torch's float32 log_softmax, which it matches to float32 rounding). A row
 * holding a NaN or an infinity of either sign gets ids[r] = -1 (the sampler's NON_FINITE) and a NaN logprob:
 * x * 0 is 0 for every finite x and NaN otherwise, so one running sum of those flags the row in the same
 * vectorised pass as its maximum. Rows are shared among OpenMP threads from PICK_PARALLEL_MIN_ELEMENTS logits;
 * fewer cost less than waking a thread. Returns 0.
 */
#include "common.h"

#define CHUNK 512 /* a multiple of LANES */
/* every logit costs an e^x, several times an element of the element-wise kernels: threads pay off sooner */
#define PICK_PARALLEL_MIN_ELEMENTS (1 << 13)

static void pick_row(const float *restrict x, int64_t n, int64_t *id, double *logprob) {
    float max_part[LANES], flag_part[LANES], max = -INFINITY, flag = 0.0f;
    double sum_part[LANES], sum = 0.0;
    int64_t full = n - n % LANES;
    for (int j = 0; j < LANES; j++) max_part[j] = -INFINITY, flag_part[j] = 0.0f, sum_part[j] = 0.0;
    for (int64_t t = 0; t < full; t += LANES)
        for (int j = 0; j < LANES; j++) {
            float v = x[t + j];
            max_part[j] = v > max_part[j] ? v : max_part[j];
            flag_part[j] += v * 0.0f;
        }
    for (int64_t t = full; t < n; t++) {
        max = x[t] > max ? x[t] : max;
        flag += x[t] * 0.0f;
    }
    for (int j = 0; j < LANES; j++) {
        max = max_part[j] > max ? max_part[j] : max;
        flag += flag_part[j];
    }
    if (flag != 0.0f || n == 0) { /* NaN (or no logits at all): the row is broken */
        *id = -1;
        *logprob = NAN;
        return;
    }
    int64_t first = 0;
    while (x[first] != max) first++;
    float e[CHUNK]; /* e^(x - max) of a chunk, summed into the lanes: two loops the compiler vectorises */
    for (int64_t c = 0; c < full; c += CHUNK) {
        int64_t len = full - c < CHUNK ? full - c : CHUNK;
        for (int64_t t = 0; t < len; t++) e[t] = exp_clamped(x[c + t] - max);
        for (int64_t t = 0; t < len; t += LANES)
            for (int j = 0; j < LANES; j++) sum_part[j] += e[t + j];
    }
    for (int64_t t = full; t < n; t++) sum += exp_clamped(x[t] - max);
    for (int j = 0; j < LANES; j++) sum += sum_part[j];
    *id = first;
    *logprob = -log(sum);
}

int greedy_pick_f32(const float *x, int64_t rows, int64_t vocab, int64_t *ids, double *logprobs, int num_threads) {
    if (rows * vocab >= PICK_PARALLEL_MIN_ELEMENTS && num_threads > 1 && rows > 1) {
#pragma omp parallel for num_threads(num_threads)
        for (int64_t r = 0; r < rows; r++) pick_row(x + r * vocab, vocab, ids + r, logprobs + r);
    } else {
        for (int64_t r = 0; r < rows; r++) pick_row(x + r * vocab, vocab, ids + r, logprobs + r);
    }
    return 0;
}
