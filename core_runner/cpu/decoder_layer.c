/* The attention half and the MLP's up projection of a pre-norm decoder layer, in one call, for
 * a step whose every row is a decode (or a decode with a few drafts) on the CPU, float32, packed
 * weights: input RMSNorm (with the residual add), fused q/k/v, optional per-head q/k RMSNorm,
 * rotary, the KV-cache write, paged decode attention, o, post-attention RMSNorm (with the
 * residual add), fused gate/up. The caller applies the activation (torch's, whose bits the C
 * library's exp would not give) and the down projection.
 *
 * It only sequences the kernels the layer's modules call one by one (packed_linear.c,
 * layer_ops.c, decode_attention.c) on the same inputs in the same order, so every output has
 * the bits of the module path; what it removes is ~40 Python-level calls a layer, most of a
 * decode step's time on a small model.
 */
#include <stdint.h>
#include <string.h>

typedef void (*linear_fn)(const float *, int64_t, int64_t, const uint8_t *, const float *, const float *,
                          int64_t, const float *, float *, int);
void sr_linear_q4_1(const float *, int64_t, int64_t, const uint8_t *, const float *, const float *, int64_t,
                    const float *, float *, int);
void sr_linear_q8_0(const float *, int64_t, int64_t, const uint8_t *, const float *, const float *, int64_t,
                    const float *, float *, int);
void sr_linear_q8_16(const float *, int64_t, int64_t, const uint8_t *, const float *, const float *, int64_t,
                     const float *, float *, int);
void sr_rms_norm(const float *, int64_t, const float *, int64_t, const float *, float, int, int64_t, int64_t,
                 float *, float *);
void sr_rotary_qk(const int64_t *, int64_t, float *, int64_t, int64_t, int64_t, float *, int64_t, int64_t,
                  int64_t, const float *, int64_t);
void sr_write_kv(const float *, int64_t, const float *, int64_t, const int64_t *, int64_t, int64_t, float *,
                 float *);
int sr_decode_attention(const float *, const float *, const float *, const int64_t *, const int64_t *, int64_t,
                        int64_t, int64_t, int64_t, float, int64_t, float *, int);

/* A packed weight [n, k]; format: 0 q4_1, 1 q8_0, 2 q8_16 (LINEAR_FORMATS' order). */
typedef struct {
    int64_t format, n, k;
    const uint8_t *qs;
    const float *d, *m, *bias;
} sr_packed;

typedef struct {  /* what a layer keeps: weights and its cache, fixed after loading */
    const float *norm1, *norm2;
    float eps1, eps2;
    int64_t unit_offset;
    const float *q_norm, *k_norm;  /* per-head RMSNorm of q and k before RoPE (Qwen3), or NULL */
    float q_eps, k_eps;
    sr_packed qkv, o, gate_up;
    int64_t heads, kv_heads, head_dim, rotary_half;
    const float *cos_sin;
    float *k_cache, *v_cache;
    float scale;
} sr_layer;

typedef struct {  /* what a step shares across layers: its rows and scratch */
    int64_t tokens, hidden;
    const int64_t *positions, *slots, *key_slots, *rows;
    int64_t num_rows, longest, threads;
    float *h, *qkv, *q, *k, *attn, *o;  /* [tokens, hidden | q+2kv | q | kv | q | hidden] */
} sr_step;

static void linear(const sr_packed *w, const float *x, int64_t rows, float *y, int threads) {
    static const linear_fn fns[3] = {sr_linear_q4_1, sr_linear_q8_0, sr_linear_q8_16};
    fns[w->format](x, rows, w->k, w->qs, w->d, w->m, w->n, w->bias, y, threads);
}

/* x [tokens, hidden]; residual [tokens, hidden] or NULL in the first layer (x is the residual
 * then). residual_out (may be residual itself): x + residual, the layer's new residual;
 * gate_up [tokens, 2 * intermediate]. Returns sr_decode_attention's status. */
int sr_decode_layer(const sr_layer *L, const sr_step *S, const float *x, const float *residual,
                          float *residual_out, float *gate_up) {
    const int64_t T = S->tokens, H = S->hidden, D = L->head_dim, threads = S->threads;
    const int64_t qn = L->heads * D, kvn = L->kv_heads * D, width = qn + 2 * kvn;
    if (residual) {
        sr_rms_norm(x, H, residual, H, L->norm1, L->eps1, (int)L->unit_offset, T, H, S->h, residual_out);
    } else {
        sr_rms_norm(x, H, 0, 0, L->norm1, L->eps1, (int)L->unit_offset, T, H, S->h, 0);
        memcpy(residual_out, x, sizeof(float) * T * H);
    }
    linear(&L->qkv, S->h, T, S->qkv, (int)threads);
    /* q and k into their own contiguous buffers, normed per head where the layer norms them
     * (each head a row, as the module path's norm of the copied heads sees it) */
    for (int64_t t = 0; t < T; t++) {
        const float *qt = S->qkv + t * width, *kt = qt + qn;
        if (L->q_norm) {
            sr_rms_norm(qt, D, 0, 0, L->q_norm, L->q_eps, (int)L->unit_offset, L->heads, D, S->q + t * qn, 0);
            sr_rms_norm(kt, D, 0, 0, L->k_norm, L->k_eps, (int)L->unit_offset, L->kv_heads, D, S->k + t * kvn, 0);
        } else {
            memcpy(S->q + t * qn, qt, sizeof(float) * qn);
            memcpy(S->k + t * kvn, kt, sizeof(float) * kvn);
        }
    }
    sr_rotary_qk(S->positions, T, S->q, qn, D, L->heads, S->k, kvn, D, L->kv_heads, L->cos_sin, L->rotary_half);
    sr_write_kv(S->k, kvn, S->qkv + qn + kvn, width, S->slots, T, kvn, L->k_cache, L->v_cache);
    const int status = sr_decode_attention(S->q, L->k_cache, L->v_cache, S->key_slots, S->rows, S->num_rows,
                                           L->heads, L->kv_heads, D, L->scale, S->longest, S->attn, (int)threads);
    if (status) return status;
    linear(&L->o, S->attn, T, S->o, (int)threads);
    sr_rms_norm(S->o, H, residual_out, H, L->norm2, L->eps2, (int)L->unit_offset, T, H, S->h, residual_out);
    linear(&L->gate_up, S->h, T, gate_up, (int)threads);
    return 0;
}
