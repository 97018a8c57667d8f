/* y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with W kept in GGUF block formats.
 *
 * Two paths, one arithmetic. Few input rows (decode): weight blocks are dequantized in
 * registers (32 values = four 8-wide vectors) and multiplied into tiles of R input rows x C
 * weight rows, so a decode batch reads each packed weight byte once. Many rows (prefill, from
 * PANEL_MIN_ROWS): a panel of weight rows is dequantized once into float32 and reused by every
 * row chunk that fits in L2.
 *
 * Formats (row-major over N, blocks of 32 along K):
 *   Q4_1: qs uint8 [N, K/2] in ggml order (byte j of a block holds value j in its low nibble and
 *         value j + 16 in its high nibble), d and m float32 [N, K/32]; w = d * q + m.
 *   Q8_0: qs int8 [N, K], d float32 [N, K/32]; w = d * q.
 *   Q8_16: qs int8 [N, K], d float32 [N, K/16]; w = d * q (Q6_K's sub-blocks of 16).
 * These are exactly the float32 values gguf's dequantize produces (d * q is exact in float32,
 * and a fused multiply-add rounds d * q + m once, as the unfused sum of an exact product does).
 *
 * Every output is reduced in the same order whatever M, the row's place in the batch, or the
 * thread count: eight lanes accumulate K in order, then a fixed pairwise sum. So the result for
 * one request does not depend on the batch it runs in.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define BLOCK 32
#define MAX_ROWS 8

#ifdef __AVX2__
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VSET1(v) _mm256_set1_ps(v)

static inline float hsum(vec a) {
    __m128 lo = _mm256_castps256_ps128(a), hi = _mm256_extractf128_ps(a, 1);
    __m128 s = _mm_add_ps(lo, hi);                /* lanes (0+4, 1+5, 2+6, 3+7) */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));       /* (0+4)+(2+6), (1+5)+(3+7) */
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* Q4_1 nibbles to 32-bit lanes without the shuffle port's vpmovzxbd/vpsrldq chain: the 16
 * bytes are loaded into both 128-bit halves (a broadcast load), then an in-lane byte shuffle
 * puts byte i of a group of eight into the low byte of 32-bit lane i -- the values vpmovzxbd
 * gives, about 1.1x faster for a decode row here. (For int8 blocks the sign extension this way
 * costs a shift per vector and measured slower: they keep vpmovsxbd.) */
#define SHUF_LOW(a, b, c, d, e, f, g, h) \
    _mm256_setr_epi8(a, -1, -1, -1, b, -1, -1, -1, c, -1, -1, -1, d, -1, -1, -1, \
                     e, -1, -1, -1, f, -1, -1, -1, g, -1, -1, -1, h, -1, -1, -1)

static inline __m256i broadcast16(const void *p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)); }

/* The 32 values of one Q4_1 block as four vectors. */
static inline void dequant_q4_1(const uint8_t *q, float d, float m, vec w[4]) {
    const __m256i bytes = broadcast16(q), mask = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(bytes, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
    const __m256i first = SHUF_LOW(0, 1, 2, 3, 4, 5, 6, 7), second = SHUF_LOW(8, 9, 10, 11, 12, 13, 14, 15);
    vec vd = VSET1(d), vm = VSET1(m);
    w[0] = VFMA(vd, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, first)), vm);
    w[1] = VFMA(vd, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(lo, second)), vm);
    w[2] = VFMA(vd, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, first)), vm);
    w[3] = VFMA(vd, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(hi, second)), vm);
}

static inline void dequant_q8_0(const int8_t *q, float d, vec w[4]) {
    __m128i a = _mm_loadu_si128((const __m128i *)q), b = _mm_loadu_si128((const __m128i *)(q + 16));
    vec vd = VSET1(d);
    w[0] = VMUL(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)));
    w[1] = VMUL(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))));
    w[2] = VMUL(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    w[3] = VMUL(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
}
/* Int8 values with one scale per 16 (Q6_K's sub-blocks). */
static inline void dequant_q8_16(const int8_t *q, const float *d, vec w[4]) {
    __m128i a = _mm_loadu_si128((const __m128i *)q), b = _mm_loadu_si128((const __m128i *)(q + 16));
    vec d0 = VSET1(d[0]), d1 = VSET1(d[1]);
    w[0] = VMUL(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)));
    w[1] = VMUL(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))));
    w[2] = VMUL(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    w[3] = VMUL(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
}
#else
/* Portable fallback with the same lane structure (and so the same reduction order). */
#include <math.h>
typedef struct { float v[8]; } vec;
static inline vec VZERO(void) { vec r; memset(&r, 0, sizeof r); return r; }
static inline vec VLOAD(const float *p) { vec r; memcpy(r.v, p, sizeof r.v); return r; }
static inline vec VFMA(vec a, vec b, vec c) { vec r; for (int i = 0; i < 8; i++) r.v[i] = fmaf(a.v[i], b.v[i], c.v[i]); return r; }
static inline vec VMUL(vec a, vec b) { vec r; for (int i = 0; i < 8; i++) r.v[i] = a.v[i] * b.v[i]; return r; }
static inline vec VSET1(float x) { vec r; for (int i = 0; i < 8; i++) r.v[i] = x; return r; }
static inline float hsum(vec a) {
    float s0 = a.v[0] + a.v[4], s1 = a.v[1] + a.v[5], s2 = a.v[2] + a.v[6], s3 = a.v[3] + a.v[7];
    return (s0 + s2) + (s1 + s3);
}
static inline void dequant_q4_1(const uint8_t *q, float d, float m, vec w[4]) {
    for (int j = 0; j < 16; j++) {
        w[j / 8].v[j % 8] = fmaf(d, (float)(q[j] & 0x0F), m);
        w[2 + j / 8].v[j % 8] = fmaf(d, (float)(q[j] >> 4), m);
    }
}
static inline void dequant_q8_0(const int8_t *q, float d, vec w[4]) {
    for (int j = 0; j < 32; j++) w[j / 8].v[j % 8] = d * (float)q[j];
}
static inline void dequant_q8_16(const int8_t *q, const float *d, vec w[4]) {
    for (int j = 0; j < 32; j++) w[j / 8].v[j % 8] = d[j / 16] * (float)q[j];
}
#endif

static inline void q4_1_block(const uint8_t *qs, const float *d, const float *m, int64_t n,
                              int64_t nb, int64_t b, vec w[4]) {
    dequant_q4_1(qs + (n * nb + b) * (BLOCK / 2), d[n * nb + b], m[n * nb + b], w);
}
static inline void q8_0_block(const uint8_t *qs, const float *d, const float *m, int64_t n,
                              int64_t nb, int64_t b, vec w[4]) {
    (void)m;
    dequant_q8_0((const int8_t *)qs + (n * nb + b) * BLOCK, d[n * nb + b], w);
}
static inline void q8_16_block(const uint8_t *qs, const float *d, const float *m, int64_t n,
                               int64_t nb, int64_t b, vec w[4]) {
    (void)m;
    dequant_q8_16((const int8_t *)qs + (n * nb + b) * BLOCK, d + (n * nb + b) * 2, w);
}

/* Software prefetch of the next tile's weight rows, at the block being read (one tile ahead):
 * int8 rows are twice Q4_1's bytes and the hardware prefetchers lag on their many parallel
 * row streams -- 1.5-1.7x for a decode row of a Q8_0 matrix read from memory (a 200-matrix
 * A/B); Q4_1 measured no gain, so it prefetches nothing. A hint only: results do not change. */
static inline void q4_1_prefetch(const uint8_t *qs, const float *d, const float *m, int64_t n, int64_t nb, int64_t b) {
    (void)qs, (void)d, (void)m, (void)n, (void)nb, (void)b;
}
static inline void q8_0_prefetch(const uint8_t *qs, const float *d, const float *m, int64_t n, int64_t nb, int64_t b) {
    (void)m;
    if ((b & 1) == 0) __builtin_prefetch(qs + (n * nb + b) * BLOCK);
    if ((b & 15) == 0) __builtin_prefetch(d + n * nb + b);
}
static inline void q8_16_prefetch(const uint8_t *qs, const float *d, const float *m, int64_t n, int64_t nb, int64_t b) {
    (void)m;
    if ((b & 1) == 0) __builtin_prefetch(qs + (n * nb + b) * BLOCK);
    if ((b & 7) == 0) __builtin_prefetch(d + (n * nb + b) * 2);
}

/* One tile: input rows i0 .. i0+R-1 times weight rows n0 .. n0+C-1, with R * C <= 8
 * accumulators so the tile's independent FMA chains cover the FMA latency whatever M is (a
 * decode row alone takes 1 x 8, a batch of 8 rows 8 x 1). R and C are constants in each
 * instantiation, so the accumulators stay in registers. Each output's arithmetic is the same
 * in every tile shape. */
#define DEFINE_TILE(FMT, R, C)                                                                    \
    static void FMT##_tile_##R##x##C(const float *x, int64_t K, const uint8_t *qs, const float *d, \
                                     const float *m, int64_t n0, const float *bias, float *y,     \
                                     int64_t N) {                                                 \
        vec acc[R][C], w[4];                                                                      \
        for (int i = 0; i < R; i++)                                                               \
            for (int c = 0; c < C; c++) acc[i][c] = VZERO();                                      \
        const int64_t nb = K / BLOCK;                                                             \
        for (int64_t b = 0; b < nb; b++) {                                                        \
            const float *xb = x + b * BLOCK;                                                      \
            for (int c = 0; c < C; c++) {                                                         \
                FMT##_prefetch(qs, d, m, n0 + c + C, nb, b);                                      \
                FMT##_block(qs, d, m, n0 + c, nb, b, w);                                          \
                for (int i = 0; i < R; i++) {                                                     \
                    acc[i][c] = VFMA(VLOAD(xb + i * K), w[0], acc[i][c]);                         \
                    acc[i][c] = VFMA(VLOAD(xb + i * K + 8), w[1], acc[i][c]);                     \
                    acc[i][c] = VFMA(VLOAD(xb + i * K + 16), w[2], acc[i][c]);                    \
                    acc[i][c] = VFMA(VLOAD(xb + i * K + 24), w[3], acc[i][c]);                    \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        for (int i = 0; i < R; i++)                                                               \
            for (int c = 0; c < C; c++)                                                           \
                y[i * N + n0 + c] = hsum(acc[i][c]) + (bias ? bias[n0 + c] : 0.0f);               \
    }

typedef void (*tile_fn)(const float *, int64_t, const uint8_t *, const float *, const float *,
                        int64_t, const float *, float *, int64_t);

/* Columns per tile for R rows: the widest of 8, 4, 2, 1 with R * C <= 8. */
static inline int tile_cols(int64_t rows) { return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 2 : 1; }

/* The panel path, for many input rows (prefill): PANEL weight rows are dequantized once into a
 * float32 panel, then tiles of 4 input rows x 3 weight rows (12 accumulators, 7 loads per 12
 * FMAs) multiply it. Each output sees the same products in the same order as in the register
 * tiles above (the panel holds the very values the registers would), so the path a call takes
 * changes its speed, never its result. */
#define PANEL 12
#define PANEL_MIN_ROWS 32

#if !(defined(__AVX512F__) && defined(__AVX512DQ__))  /* AVX-512: the paired panel below */
#define DEFINE_PANEL_TILE(R, C)                                                                   \
    static void panel_tile_##R##x##C(const float *x, int64_t K, const float *panel, int64_t n0,   \
                                     const float *bias, float *y, int64_t N) {                    \
        vec acc[R][C];                                                                            \
        for (int i = 0; i < R; i++)                                                               \
            for (int c = 0; c < C; c++) acc[i][c] = VZERO();                                      \
        for (int64_t k = 0; k < K; k += 8) {                                                      \
            vec w[C];                                                                             \
            for (int c = 0; c < C; c++) w[c] = VLOAD(panel + c * K + k);                          \
            for (int i = 0; i < R; i++) {                                                         \
                vec xv = VLOAD(x + i * K + k);                                                    \
                for (int c = 0; c < C; c++) acc[i][c] = VFMA(xv, w[c], acc[i][c]);                \
            }                                                                                     \
        }                                                                                         \
        for (int i = 0; i < R; i++)                                                               \
            for (int c = 0; c < C; c++)                                                           \
                y[i * N + n0 + c] = hsum(acc[i][c]) + (bias ? bias[n0 + c] : 0.0f);               \
    }

DEFINE_PANEL_TILE(1, 1) DEFINE_PANEL_TILE(2, 1) DEFINE_PANEL_TILE(3, 1) DEFINE_PANEL_TILE(4, 1)
DEFINE_PANEL_TILE(1, 3) DEFINE_PANEL_TILE(2, 3) DEFINE_PANEL_TILE(3, 3) DEFINE_PANEL_TILE(4, 3)

typedef void (*panel_tile_fn)(const float *, int64_t, const float *, int64_t, const float *, float *,
                              int64_t);
static const panel_tile_fn panel_tiles[5][2] = {
    {0, 0},
    {panel_tile_1x1, panel_tile_1x3},
    {panel_tile_2x1, panel_tile_2x3},
    {panel_tile_3x1, panel_tile_3x3},
    {panel_tile_4x1, panel_tile_4x3}};

static void panel_strip(const float *x, int64_t M, int64_t K, const float *panel, int64_t n0,
                        int64_t cols, const float *bias, float *y, int64_t N) {
    for (int64_t i0 = 0; i0 < M; i0 += 4) {
        const int64_t rows = M - i0 < 4 ? M - i0 : 4;
        int64_t c = 0;
        for (; c + 3 <= cols; c += 3)
            panel_tiles[rows][1](x + i0 * K, K, panel + c * K, n0 + c, bias, y + i0 * N, N);
        for (; c < cols; c++)
            panel_tiles[rows][0](x + i0 * K, K, panel + c * K, n0 + c, bias, y + i0 * N, N);
    }
}
#endif


#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* With AVX-512 the panel keeps its weight rows in pairs, interleaved by 8 values ([pair][K / 8]
 * [row of the pair][8]), so one 512-bit load brings 8 values of two rows and one FMA advances
 * two outputs, each in its own 256-bit half with exactly the 8-lane accumulation of the AVX2
 * tiles: the same bits at twice the width. Tiles of PAIR_R input rows x PAIR_P pairs (18
 * accumulators, 9 loads per 18 FMAs, within 32 registers). */
#define PAIRED 1
#define PAIR_R 6
#define PAIR_P 3
/* Where value k of panel row c goes. */
#define PANEL_AT(c, k, K) ((((c) / 2) * 2 * (K)) + ((k) / 8) * 16 + ((c) % 2) * 8 + (k) % 8)

#define DEFINE_PAIR_TILE(R, P)                                                                    \
    static void pair_tile_##R##x##P(const float *x, int64_t K, const float *panel, int64_t n0,    \
                                    int64_t cols, const float *bias, float *y, int64_t N) {       \
        __m512 acc[R][P];                                                                         \
        for (int i = 0; i < R; i++)                                                               \
            for (int p = 0; p < P; p++) acc[i][p] = _mm512_setzero_ps();                          \
        for (int64_t k = 0; k < K; k += 8) {                                                      \
            __m512 w[P];                                                                          \
            for (int p = 0; p < P; p++) w[p] = _mm512_loadu_ps(panel + p * 2 * K + 2 * k);        \
            for (int i = 0; i < R; i++) {                                                         \
                __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i * K + k));               \
                for (int p = 0; p < P; p++) acc[i][p] = _mm512_fmadd_ps(xv, w[p], acc[i][p]);     \
            }                                                                                     \
        }                                                                                         \
        for (int i = 0; i < R; i++)                                                               \
            for (int p = 0; p < P; p++) {                                                         \
                const int64_t c = n0 + 2 * p;                                                     \
                y[i * N + c] = hsum(_mm512_castps512_ps256(acc[i][p])) + (bias ? bias[c] : 0.0f); \
                if (2 * p + 1 < cols)                                                             \
                    y[i * N + c + 1] = hsum(_mm512_extractf32x8_ps(acc[i][p], 1)) + (bias ? bias[c + 1] : 0.0f); \
            }                                                                                     \
    }

DEFINE_PAIR_TILE(1, 1) DEFINE_PAIR_TILE(2, 1) DEFINE_PAIR_TILE(3, 1)
DEFINE_PAIR_TILE(4, 1) DEFINE_PAIR_TILE(5, 1) DEFINE_PAIR_TILE(6, 1)
DEFINE_PAIR_TILE(1, 3) DEFINE_PAIR_TILE(2, 3) DEFINE_PAIR_TILE(3, 3)
DEFINE_PAIR_TILE(4, 3) DEFINE_PAIR_TILE(5, 3) DEFINE_PAIR_TILE(6, 3)

typedef void (*pair_tile_fn)(const float *, int64_t, const float *, int64_t, int64_t, const float *,
                             float *, int64_t);
static const pair_tile_fn pair_tiles[PAIR_R + 1][2] = {
    {0, 0},
    {pair_tile_1x1, pair_tile_1x3},
    {pair_tile_2x1, pair_tile_2x3},
    {pair_tile_3x1, pair_tile_3x3},
    {pair_tile_4x1, pair_tile_4x3},
    {pair_tile_5x1, pair_tile_5x3},
    {pair_tile_6x1, pair_tile_6x3}};

/* The panel's `cols` rows (an odd last one paired with a row never stored) times M inputs. */
static void pair_strip(const float *x, int64_t M, int64_t K, const float *panel, int64_t n0,
                       int64_t cols, const float *bias, float *y, int64_t N) {
    const int64_t pairs = (cols + 1) / 2;
    for (int64_t i0 = 0; i0 < M; i0 += PAIR_R) {
        const int64_t rows = M - i0 < PAIR_R ? M - i0 : PAIR_R;
        int64_t p = 0;
        for (; p + PAIR_P <= pairs; p += PAIR_P)
            pair_tiles[rows][1](x + i0 * K, K, panel + p * 2 * K, n0 + 2 * p, cols - 2 * p, bias, y + i0 * N, N);
        for (; p < pairs; p++)
            pair_tiles[rows][0](x + i0 * K, K, panel + p * 2 * K, n0 + 2 * p, cols - 2 * p, bias, y + i0 * N, N);
    }
}
#define PANEL_STRIP pair_strip
#else
#define PAIRED 0
#define PANEL_AT(c, k, K) ((c) * (K) + (k))
#define PANEL_STRIP panel_strip
#endif

static inline int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Input rows per chunk of the panel path: inputs of a chunk (rows x K floats) fit in 192 KB. */
static inline int64_t chunk_rows(int64_t K) {
    const int64_t rows = (192 * 1024 / 4) / K / 4 * 4;
    return rows > 4 ? rows : 4;
}

#if PAIRED
/* Decode tiles on AVX-512: blocks of two weight rows are dequantized side by side into 512-bit
 * registers (row n in the low halves), straight from their packed bytes, so every conversion,
 * dequantizing FMA and accumulating FMA serves two outputs. Each half computes exactly what the
 * AVX2 tiles compute for its row: the same values (one FMA d * q + m, or d * q), the same 8-lane
 * accumulation in K order, the same final sum -- the same bits, about half the instructions. */
static inline __m512 pair_set(float a, float b) {
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}
static inline void q4_1_block2(const uint8_t *qs, const float *d, const float *m, int64_t n,
                               int64_t nb, int64_t b, __m512 w[4]) {
    const int64_t ia = n * nb + b, ib = ia + nb;
    const __m128i a = _mm_loadu_si128((const __m128i *)(qs + ia * (BLOCK / 2)));
    const __m128i c = _mm_loadu_si128((const __m128i *)(qs + ib * (BLOCK / 2)));
    const __m512i lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(a, c)); /* bytes 0-7 of each row */
    const __m512i hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(a, c)); /* bytes 8-15 */
    const __m512i mask = _mm512_set1_epi32(0x0F);
    const __m512 vd = pair_set(d[ia], d[ib]), vm = pair_set(m[ia], m[ib]);
    w[0] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(_mm512_and_si512(lo, mask)), vm); /* values 0-7 */
    w[1] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(_mm512_and_si512(hi, mask)), vm); /* 8-15 */
    w[2] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(_mm512_srli_epi32(lo, 4)), vm);   /* 16-23 */
    w[3] = _mm512_fmadd_ps(vd, _mm512_cvtepi32_ps(_mm512_srli_epi32(hi, 4)), vm);   /* 24-31 */
}
/* Int8 blocks of two rows, values 8j .. 8j + 7 of each, sign-extended, times d[0] (values 0-15)
 * and d[1] (16-31): the same scale twice for Q8_0, the sub-blocks' scales for Q8_16. */
static inline void int8_block2(const int8_t *qa, const int8_t *qb, __m512 d0, __m512 d1, __m512 w[4]) {
    const __m128i a0 = _mm_loadu_si128((const __m128i *)qa), a1 = _mm_loadu_si128((const __m128i *)(qa + 16));
    const __m128i b0 = _mm_loadu_si128((const __m128i *)qb), b1 = _mm_loadu_si128((const __m128i *)(qb + 16));
    w[0] = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(a0, b0))));
    w[1] = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(a0, b0))));
    w[2] = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(a1, b1))));
    w[3] = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(a1, b1))));
}
static inline void q8_0_block2(const uint8_t *qs, const float *d, const float *m, int64_t n,
                               int64_t nb, int64_t b, __m512 w[4]) {
    (void)m;
    const int64_t ia = n * nb + b, ib = ia + nb;
    const __m512 vd = pair_set(d[ia], d[ib]);
    int8_block2((const int8_t *)qs + ia * BLOCK, (const int8_t *)qs + ib * BLOCK, vd, vd, w);
}
static inline void q8_16_block2(const uint8_t *qs, const float *d, const float *m, int64_t n,
                                int64_t nb, int64_t b, __m512 w[4]) {
    (void)m;
    const int64_t ia = n * nb + b, ib = ia + nb;
    int8_block2((const int8_t *)qs + ia * BLOCK, (const int8_t *)qs + ib * BLOCK,
                pair_set(d[2 * ia], d[2 * ib]), pair_set(d[2 * ia + 1], d[2 * ib + 1]), w);
}

/* R input rows x P pairs of weight rows (columns n0 .. n0 + 2P - 1). Two pairs for up to four
 * rows: wider tiles (8 pairs for one row) measured slower, their many weight-row streams and
 * broadcasts outweighing the longer FMA chains. */
#define DEFINE_PAIR_TILE_2(FMT, R, P)                                                             \
    static void FMT##_ptile_##R##x##P(const float *x, int64_t K, const uint8_t *qs, const float *d, \
                                      const float *m, int64_t n0, const float *bias, float *y,    \
                                      int64_t N) {                                                \
        __m512 acc[R][P];                                                                         \
        for (int i = 0; i < R; i++)                                                               \
            for (int p = 0; p < P; p++) acc[i][p] = _mm512_setzero_ps();                          \
        const int64_t nb = K / BLOCK;                                                             \
        for (int64_t b = 0; b < nb; b++) {                                                        \
            const float *xb = x + b * BLOCK;                                                      \
            for (int p = 0; p < P; p++) {                                                         \
                __m512 w[4];                                                                      \
                FMT##_prefetch(qs, d, m, n0 + 2 * P + 2 * p, nb, b);                              \
                FMT##_prefetch(qs, d, m, n0 + 2 * P + 2 * p + 1, nb, b);                          \
                FMT##_block2(qs, d, m, n0 + 2 * p, nb, b, w);                                     \
                for (int i = 0; i < R; i++)                                                       \
                    for (int j = 0; j < 4; j++)                                                   \
                        acc[i][p] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(xb + i * K + 8 * j)), \
                                                    w[j], acc[i][p]);                             \
            }                                                                                     \
        }                                                                                         \
        for (int i = 0; i < R; i++)                                                               \
            for (int p = 0; p < P; p++) {                                                         \
                const int64_t c = n0 + 2 * p;                                                     \
                y[i * N + c] = hsum(_mm512_castps512_ps256(acc[i][p])) + (bias ? bias[c] : 0.0f); \
                y[i * N + c + 1] = hsum(_mm512_extractf32x8_ps(acc[i][p], 1)) + (bias ? bias[c + 1] : 0.0f); \
            }                                                                                     \
    }
/* [rows][0]: the widest tile for that many rows (pairs_per_tile of them), [rows][1]: one pair. */
#define DEFINE_PAIR_ROWS(FMT)                                                                     \
    DEFINE_PAIR_TILE_2(FMT, 1, 2) DEFINE_PAIR_TILE_2(FMT, 1, 1)                                   \
    DEFINE_PAIR_TILE_2(FMT, 2, 2) DEFINE_PAIR_TILE_2(FMT, 2, 1)                                   \
    DEFINE_PAIR_TILE_2(FMT, 3, 2) DEFINE_PAIR_TILE_2(FMT, 3, 1)                                   \
    DEFINE_PAIR_TILE_2(FMT, 4, 2) DEFINE_PAIR_TILE_2(FMT, 4, 1)                                   \
    DEFINE_PAIR_TILE_2(FMT, 5, 1) DEFINE_PAIR_TILE_2(FMT, 6, 1)                                   \
    DEFINE_PAIR_TILE_2(FMT, 7, 1) DEFINE_PAIR_TILE_2(FMT, 8, 1)                                   \
    static const tile_fn FMT##_ptiles[MAX_ROWS + 1][2] = {                                        \
        {0, 0},                                                                                   \
        {FMT##_ptile_1x2, FMT##_ptile_1x1}, {FMT##_ptile_2x2, FMT##_ptile_2x1},                   \
        {FMT##_ptile_3x2, FMT##_ptile_3x1}, {FMT##_ptile_4x2, FMT##_ptile_4x1},                   \
        {FMT##_ptile_5x1, FMT##_ptile_5x1}, {FMT##_ptile_6x1, FMT##_ptile_6x1},                   \
        {FMT##_ptile_7x1, FMT##_ptile_7x1}, {FMT##_ptile_8x1, FMT##_ptile_8x1}};
static inline int pairs_per_tile(int64_t rows) { return rows <= 4 ? 2 : 1; }
#else
#define DEFINE_PAIR_ROWS(FMT) static const tile_fn FMT##_ptiles[MAX_ROWS + 1][2] = {{0, 0}};
static inline int pairs_per_tile(int64_t rows) { (void)rows; return 0; }
#endif

#define DEFINE_FORMAT(FMT)                                                                        \
    DEFINE_PAIR_ROWS(FMT)                                                                         \
    DEFINE_TILE(FMT, 1, 8) DEFINE_TILE(FMT, 1, 4) DEFINE_TILE(FMT, 1, 2) DEFINE_TILE(FMT, 1, 1)   \
    DEFINE_TILE(FMT, 2, 4) DEFINE_TILE(FMT, 2, 2) DEFINE_TILE(FMT, 2, 1)                          \
    DEFINE_TILE(FMT, 3, 2) DEFINE_TILE(FMT, 3, 1) DEFINE_TILE(FMT, 4, 2) DEFINE_TILE(FMT, 4, 1)   \
    DEFINE_TILE(FMT, 5, 1) DEFINE_TILE(FMT, 6, 1) DEFINE_TILE(FMT, 7, 1) DEFINE_TILE(FMT, 8, 1)   \
    /* [rows][log2 cols] */                                                                       \
    static const tile_fn FMT##_tiles[MAX_ROWS + 1][4] = {                                         \
        {0, 0, 0, 0},                                                                             \
        {FMT##_tile_1x1, FMT##_tile_1x2, FMT##_tile_1x4, FMT##_tile_1x8},                         \
        {FMT##_tile_2x1, FMT##_tile_2x2, FMT##_tile_2x4, 0},                                      \
        {FMT##_tile_3x1, FMT##_tile_3x2, 0, 0},                                                   \
        {FMT##_tile_4x1, FMT##_tile_4x2, 0, 0},                                                   \
        {FMT##_tile_5x1, 0, 0, 0},                                                                \
        {FMT##_tile_6x1, 0, 0, 0},                                                                \
        {FMT##_tile_7x1, 0, 0, 0},                                                                \
        {FMT##_tile_8x1, 0, 0, 0}};                                                               \
    static void FMT##_dequant_rows(const uint8_t *qs, const float *d, const float *m, int64_t n0, \
                                   int64_t cols, int64_t K, float *panel) {                       \
        const int64_t nb = K / BLOCK;                                                             \
        vec w[4];                                                                                 \
        for (int64_t c = 0; c < cols; c++)                                                        \
            for (int64_t b = 0; b < nb; b++) {                                                    \
                FMT##_block(qs, d, m, n0 + c, nb, b, w);                                          \
                for (int j = 0; j < 4; j++) memcpy(panel + PANEL_AT(c, b * BLOCK + j * 8, K), &w[j], 32); \
            }                                                                                     \
        if (PAIRED && cols % 2) /* the partner of an odd last row: zeros, never stored */         \
            for (int64_t k = 0; k < K; k += 8) memset(panel + PANEL_AT(cols, k, K), 0, 32);       \
    }                                                                                             \
    void sr_linear_##FMT(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d, \
                         const float *m, int64_t N, const float *bias, float *y, int threads) {   \
        float *panels = M >= PANEL_MIN_ROWS ? malloc(sizeof(float) * PANEL * K * threads) : 0; \
        if (panels) {                                                                             \
            const int64_t strips = (N + PANEL - 1) / PANEL, chunk = chunk_rows(K);                \
            _Pragma("omp parallel num_threads(threads) if(threads > 1)")                          \
            {                                                                                     \
                float *panel = panels + PANEL * K * thread_index();                               \
                for (int64_t c0 = 0; c0 < M; c0 += chunk) {                                       \
                    const int64_t rows = M - c0 < chunk ? M - c0 : chunk;                         \
                    _Pragma("omp for schedule(static)")                                           \
                    for (int64_t s = 0; s < strips; s++) {                                        \
                        const int64_t cols = N - s * PANEL < PANEL ? N - s * PANEL : PANEL;       \
                        FMT##_dequant_rows(qs, d, m, s * PANEL, cols, K, panel);                  \
                        PANEL_STRIP(x + c0 * K, rows, K, panel, s * PANEL, cols, bias, y + c0 * N, N); \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            free(panels);                                                                         \
            return;                                                                               \
        }                                                                                         \
        /* Columns in strips of 16 so a strip's packed rows stay in L1 across row groups. */      \
        const int64_t strips = (N + 15) / 16;                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if(threads > 1)")         \
        for (int64_t s = 0; s < strips; s++) {                                                    \
            const int64_t n_end = (s + 1) * 16 < N ? (s + 1) * 16 : N;                            \
            for (int64_t i0 = 0; i0 < M; i0 += MAX_ROWS) {                                        \
                const int64_t rows = M - i0 < MAX_ROWS ? M - i0 : MAX_ROWS;                       \
                int64_t n = s * 16;                                                               \
                if (PAIRED) {                                                                     \
                    const int64_t wide = 2 * pairs_per_tile(rows);                                \
                    for (; n + wide <= n_end; n += wide)                                          \
                        FMT##_ptiles[rows][0](x + i0 * K, K, qs, d, m, n, bias, y + i0 * N, N);   \
                    for (; n + 2 <= n_end; n += 2)                                                \
                        FMT##_ptiles[rows][1](x + i0 * K, K, qs, d, m, n, bias, y + i0 * N, N);   \
                }                                                                                 \
                for (int lc = 3; lc >= 0; lc--) {                                                 \
                    const int cols = 1 << lc;                                                     \
                    if (cols > tile_cols(rows)) continue;                                         \
                    for (; n + cols <= n_end; n += cols)                                          \
                        FMT##_tiles[rows][lc](x + i0 * K, K, qs, d, m, n, bias, y + i0 * N, N);   \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_FORMAT(q4_1)
DEFINE_FORMAT(q8_0)
DEFINE_FORMAT(q8_16)

int sr_simd_width(void) {
#ifdef __AVX2__
    return 8;
#else
    return 0;
#endif
}
