/* The small per-layer ops of a decoder on the CPU, float32: RMSNorm (with the residual add),
 * rotary embedding of q and k, and the write of new keys and values into the paged cache. Each is one call where the torch reference issues eight to
 * fifteen ops, whose dispatch costs more than their arithmetic at decode sizes.
 *
 * Rounding follows the reference (models/layers/norm.py `rms_norm_ref`, rotary_qk.py
 * `rotary_qk_ref`) operation by operation, with no fused multiply-adds: the rotation gives the
 * reference's bits exactly; RMSNorm sums its squares in one fixed order (eight lanes, then a
 * fixed pairwise sum) where torch's mean has its own, so it agrees with the reference to
 * float32 rounding of that sum. Rows are independent: results depend neither on the batch nor
 * on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* out = norm(x (+ residual)) * weight; with a residual, res_out = x + residual (rounded first,
 * as the reference rounds it) and the norm reads it. unit_offset (Gemma): h * (1 + w).
 * x and residual rows at their own strides; out and res_out contiguous [rows, n]. */
void sr_rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                 const float *weight, float eps, int unit_offset, int64_t rows, int64_t n,
                 float *out, float *res_out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * n;
        if (residual) {
            const float *rr = residual + r * res_stride;
            float *s = res_out + r * n;
            for (int64_t i = 0; i < n; i++) s[i] = xr[i] + rr[i];
            xr = s;
        }
        float lanes[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) {
                const float sq = xr[i + j] * xr[i + j];
                lanes[j] += sq;
            }
        float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        for (; i < n; i++) {
            const float sq = xr[i] * xr[i];
            sum += sq;
        }
        const float mean = sum / (float)n;
        const float inv = 1.0f / sqrtf(mean + eps);
        if (unit_offset) {
            for (i = 0; i < n; i++) {
                const float h = xr[i] * inv, scale = 1.0f + weight[i];
                o[i] = h * scale;
            }
        } else {
            for (i = 0; i < n; i++) {
                const float h = xr[i] * inv;
                o[i] = weight[i] * h;
            }
        }
    }
}

/* Neox RoPE in place on the first 2 * half channels of each head of x [tokens, heads, head_dim]
 * (token and head strides given, channels contiguous): x1' = x1 cos - x2 sin,
 * x2' = x2 cos + x1 sin, each product rounded on its own. cos_sin [max_position, 2 * half]:
 * cos half | sin half. */
static void rotate(float *x, int64_t token_stride, int64_t head_stride, int64_t heads, const int64_t *positions,
                   int64_t tokens, const float *cos_sin, int64_t half) {
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_sin + positions[t] * 2 * half, *s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * token_stride + h * head_stride, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
                x1[i] = ac - bs;
                x2[i] = bc + as;
            }
        }
    }
}

void sr_rotary_qk(const int64_t *positions, int64_t tokens, float *q, int64_t q_token_stride, int64_t q_head_stride,
                  int64_t q_heads, float *k, int64_t k_token_stride, int64_t k_head_stride, int64_t k_heads,
                  const float *cos_sin, int64_t half) {
    rotate(q, q_token_stride, q_head_stride, q_heads, positions, tokens, cos_sin, half);
    rotate(k, k_token_stride, k_head_stride, k_heads, positions, tokens, cos_sin, half);
}

/* Keys and values of `tokens` tokens (rows of `width` contiguous floats at their own strides)
 * copied to flat cache slots (block * block_size + offset) of the two halves of the cache, as
 * the reference's two index_copy_ calls do. A negative slot (none is scheduled) is skipped. */
void sr_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *slots,
                 int64_t tokens, int64_t width, float *k_cache, float *v_cache) {
    for (int64_t t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * width, k + t * k_stride, sizeof(float) * width);
        memcpy(v_cache + slots[t] * width, v + t * v_stride, sizeof(float) * width);
    }
}
