/* Paged attention for decode rows on the CPU, float32: each row has one query token that sees
 * every key of its sequence (no window cut, no bias, no soft cap).
 *
 * One task per (row, KV head): the query heads that share the KV head are scored against the
 * row's keys, read in place from the paged cache through the row's cache slots, then softmaxed
 * and applied to the values. One call serves all decode rows of a layer, where the torch
 * reference issues four ops per row. A row's result depends on nothing else in the batch, nor
 * on the thread count.
 *
 *   q, out   [num_tokens, H, D]
 *   k, v     [num_slots, KVH, D] (the two halves of the paged cache, blocks flattened)
 *   rows     [R, 3] int64: the row's token index in q/out, the start of its keys in key_slots,
 *            its number of keys
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static inline float dot(const float *a, const float *b, int64_t n) {
    float lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) lanes[j] += a[i + j] * b[i + j];
    float s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

int sr_decode_attention(const float *q, const float *k, const float *v, const int64_t *key_slots,
                        const int64_t *rows, int64_t num_rows, int64_t H, int64_t KVH, int64_t D,
                        float scale, int64_t max_seq_len, float *out, int threads) {
    const int64_t G = H / KVH;
    float *scratch = malloc(sizeof(float) * G * max_seq_len * (threads > 1 ? threads : 1));
    if (!scratch) return 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#ifdef _OPENMP
        float *scores = scratch + G * max_seq_len * omp_get_thread_num();
#else
        float *scores = scratch;
#endif
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_rows * KVH; task++) {
            const int64_t r = task / KVH, kh = task % KVH;
            const int64_t token = rows[3 * r], first = rows[3 * r + 1], len = rows[3 * r + 2];
            const float *qg = q + (token * H + kh * G) * D;  /* the G query heads of this KV head */
            float *og = out + (token * H + kh * G) * D;
            for (int64_t t = 0; t < len; t++) {
                const float *kt = k + (key_slots[first + t] * KVH + kh) * D;
                for (int64_t g = 0; g < G; g++) scores[g * len + t] = dot(qg + g * D, kt, D) * scale;
            }
            for (int64_t g = 0; g < G; g++) {
                float *s = scores + g * len, top = -INFINITY, sum = 0.0f;
                for (int64_t t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
                for (int64_t t = 0; t < len; t++) sum += (s[t] = expf(s[t] - top));
                for (int64_t t = 0; t < len; t++) s[t] /= sum;
                float *o = og + g * D;
                for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
                for (int64_t t = 0; t < len; t++) {
                    const float *vt = v + (key_slots[first + t] * KVH + kh) * D, p = s[t];
                    for (int64_t d = 0; d < D; d++) o[d] += p * vt[d];
                }
            }
        }
    }
    free(scratch);
    return 0;
}
