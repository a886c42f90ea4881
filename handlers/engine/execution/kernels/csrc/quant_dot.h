/* Integer dot products for quant_linear.c's layouts: int8 activations times int4/int8 weights (llama.cpp's way).
 *
 * Why: converting every 4-bit weight to fp32 before an FMA costs several instructions per weight, which is what
 * sets a one-user decode step's time on a CPU; VNNI's vpdpbusd multiplies 64 byte pairs and sums them by fours in
 * one instruction. Each row of x is quantized by itself, per group of 32 inputs (16 where a weight group is 16; symmetric int8, scale max|x|/127,
 * as llama.cpp's Q8 activations), so a row's result never depends on its batch-mates or the thread count.
 * With two parts, what the first int8 part leaves (at most half its step) is quantized again at 1/254 of that step
 * and multiplied too, from the same unpacked weights: inputs to about 1e-5 of their largest value, so a model's
 * answers stay those of the fp32-input kernel where one part (llama.cpp's precision) flips a knife-edge token.
 *   y[n] = sum over groups g of  wscale[g,n] * xs[g] * sum_k(qw * qx)  (+ wmin[g,n] * xs[g] * sum_k(qx))
 * int8 weights enter vpdpbusd as unsigned (q + 128), and 128 * sum_k(qx) is taken off again.
 * A block's 4 k steps of 16 channels (32 bytes of nibbles, or 64 bytes) are put in vpdpbusd's order (a channel's 4
 * k in one 32-bit lane) by one vpermb. Up to four rows convert the weights inline (tiles); from MANY_ROWS rows on, each
 * group's weights are converted once into registers and every row runs over them (the conversion, not the dot
 * products, set the cost of a batch of 8 when each row tile converted them again). Needs AVX-512 VNNI and VBMI; quant_linear.c keeps its float path otherwise.
 */
#include <immintrin.h>
#include <stdint.h>

#define DMR 4 /* rows of x per tile of the few-rows path */
#define DNB 4 /* blocks side by side there */
#define MANY_ROWS 5 /* from this many rows on, a group's weights are converted once and used by every row */
#define MANY_ROWS_INT8 24 /* int8 weights with one part: their conversion is cheap, the tiles' registers win longer */
#define ROW_CHUNK 64 /* rows per pass of the many-rows path: their int8 inputs stay in L2 */

/* Inputs per int8 scale: 32 (llama.cpp's Q8_0 block) where it divides every weight group, else 16 (K-quants'
 * sub-blocks). Per layer, never per call: a row's result must not depend on how many rows came with it. */
static inline int64_t act_group(int64_t K, int64_t group) { return (group > 0 ? group : K) % 32 == 0 ? 32 : 16; }

/* Rows of x quantized per ag inputs, in `parts` parts (1 or 2): part p of row m is q[(p*M + m)*K ...], its scales
 * xs[(p*M + m)*groups + g] and sums of its integers qs[...] likewise. */
static void quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t ag, int parts, int8_t *q,
                          float *xs, int32_t *qs, int threads) {
    const int64_t groups = K / ag;
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            __m512 v0 = _mm512_loadu_ps(x + m * ldx + g * ag);
            __m512 v1 = ag == 32 ? _mm512_loadu_ps(x + m * ldx + g * ag + 16) : _mm512_setzero_ps();
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int p = 0; p < parts; p++) {
                int8_t *dst = q + (p * M + m) * K + g * ag;
                const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id))); /* nearest, even */
                const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
                _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(i0));
                if (ag == 32) _mm_storeu_si128((__m128i *)(dst + 16), _mm512_cvtsepi32_epi8(i1));
                xs[(p * M + m) * groups + g] = d;
                qs[(p * M + m) * groups + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
                v0 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_set1_ps(d), v0); /* what is left: <= d/2 */
                v1 = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_set1_ps(d), v1);
                d /= 254.0f;
                id *= 254.0f;
            }
        }
}

/* A block's weights at k..k+3 as 16 lanes of 4 bytes (unsigned: int4 as stored, int8 plus 128). */
static inline __attribute__((always_inline)) __m512i dot_weights(int bits, const uint8_t *w, int64_t k) {
    if (bits == 4) {
        static const uint8_t order[64] = {
            0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27, 4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30,
            7, 15, 23, 31, 32, 40, 48, 56, 33, 41, 49, 57, 34, 42, 50, 58, 35, 43, 51, 59, 36, 44, 52, 60, 37, 45,
            53, 61, 38, 46, 54, 62, 39, 47, 55, 63};
        const __m256i b = _mm256_loadu_si256((const __m256i *)(w + k * 8)), low = _mm256_set1_epi8(15);
        const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        return _mm512_permutexvar_epi8(_mm512_loadu_si512(order), z);
    }
    static const uint8_t order8[64] = {
        0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53, 6, 22, 38, 54,
        7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45,
        61, 14, 30, 46, 62, 15, 31, 47, 63};
    const __m512i z = _mm512_loadu_si512(w + k * 16);
    return _mm512_xor_si512(_mm512_permutexvar_epi8(_mm512_loadu_si512(order8), z), _mm512_set1_epi8((char)0x80));
}

/* A block's 16 scales (or minimums) of weight group wg, from an fp16 or fp32 table */
static inline __m512 load16s(const struct layer *L, const float *table, int64_t block, int64_t wg) {
    const float *base = table + block * L->sstride;
    if (L->half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + wg * NB)));
    return _mm512_loadu_ps(base + wg * NB);
}

/* One group's integer sums of a row and a block folded into its float sums (both paths call this, so a row's
 * result is bit-identical whichever path and batch computed it). */
static inline __attribute__((always_inline)) __m512 fold_group(__m512 facc, __m512i a, const struct layer *L,
                                                               __m512 ws, __m512 wm, float s, int32_t qsum) {
    if (L->bits == 8) a = _mm512_sub_epi32(a, _mm512_set1_epi32(128 * qsum));
    facc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(ws, _mm512_set1_ps(s)), facc);
    if (L->minv) facc = _mm512_fmadd_ps(wm, _mm512_set1_ps(s * (float)qsum), facc);
    return facc;
}

/* A block's sums as outputs: the per-channel scale (int8 per channel) and the bias. */
static inline __attribute__((always_inline)) void store_block(const struct layer *L, int64_t block, __m512 facc,
                                                              float *row) {
    const int64_t n0 = block * NB;
    const int valid = L->N - n0 < NB ? (int)(L->N - n0) : NB;
    const __m512 chan = L->grouped ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(L->scale + block * L->sstride);
    float out[NB];
    _mm512_storeu_ps(out, _mm512_mul_ps(facc, chan));
    for (int j = 0; j < valid; j++) row[n0 + j] = out[j] + (L->bias ? L->bias[n0 + j] : 0.0f);
}

struct dot_rows {
    const int8_t *q;
    const float *xs;
    const int32_t *qs;
    int64_t K, part_q, part_s; /* the second part's offsets (elements) from the first's, in q and in xs/qs */
};

/* Few rows: rows [0, mr) of the quantized x times blocks [nb, nb + nbk), each tile converting the weights it
 * reads (with one or two rows there is nothing to share the conversion with). */
static inline __attribute__((always_inline)) void dot_tile(int mr, int nbk, int parts, int64_t ag,
                                                           const struct layer *L, int64_t nb, struct dot_rows X,
                                                           float *y, int64_t ldy) {
    const int64_t groups = X.K / ag;
    __m512 facc[DMR][DNB];
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < nbk; b++) facc[r][b] = _mm512_setzero_ps();
    const uint8_t *wb[DNB];
    for (int b = 0; b < nbk; b++) wb[b] = L->w + (nb + b) * L->wstride;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * ag;
        __m512i acc[2][DMR][DNB];
        for (int p = 0; p < parts; p++)
            for (int r = 0; r < mr; r++)
                for (int b = 0; b < nbk; b++) acc[p][r][b] = _mm512_setzero_si512();
        for (int kk = 0; kk < ag; kk += 4) {
            __m512i w[DNB];
            for (int b = 0; b < nbk; b++) w[b] = dot_weights(L->bits, wb[b], k0 + kk);
            for (int p = 0; p < parts; p++)
                for (int r = 0; r < mr; r++) {
                    int32_t four;
                    memcpy(&four, X.q + p * X.part_q + r * X.K + k0 + kk, 4);
                    const __m512i xb = _mm512_set1_epi32(four);
                    for (int b = 0; b < nbk; b++) acc[p][r][b] = _mm512_dpbusd_epi32(acc[p][r][b], w[b], xb);
                }
        }
        const int64_t wg = L->grouped ? k0 / L->group : 0;
        for (int b = 0; b < nbk; b++) {
            const __m512 ws = L->grouped ? load16s(L, L->scale, nb + b, wg) : _mm512_set1_ps(1.0f);
            const __m512 wm = L->minv ? load16s(L, L->minv, nb + b, wg) : _mm512_setzero_ps();
            for (int p = 0; p < parts; p++)
                for (int r = 0; r < mr; r++)
                    facc[r][b] = fold_group(facc[r][b], acc[p][r][b], L, ws, wm, X.xs[p * X.part_s + r * groups + g],
                                            X.qs[p * X.part_s + r * groups + g]);
        }
    }
    for (int b = 0; b < nbk; b++)
        for (int r = 0; r < mr; r++) store_block(L, nb + b, facc[r][b], y + r * ldy);
}

/* Rows [0, M) over `count` blocks from nb in tiles of up to DMR rows by DNB blocks. */
static inline __attribute__((always_inline)) void few_rows_dot(int parts, int64_t ag, const struct layer *L,
                                                               int64_t nb, int64_t count, struct dot_rows X,
                                                               int64_t M, float *y, int64_t ldy) {
    const int64_t groups = X.K / ag;
    for (int64_t m = 0; m < M; m += DMR) {
        const int mr = M - m < DMR ? (int)(M - m) : DMR;
        const struct dot_rows R = {X.q + m * X.K, X.xs + m * groups, X.qs + m * groups, X.K, X.part_q, X.part_s};
        int64_t b = 0;
#define DOT_RUN(rows, nbk)                                                                                          \
    for (; count - b >= nbk; b += nbk) dot_tile(rows, nbk, parts, ag, L, nb + b, R, y + m * ldy, ldy);               \
    for (; b < count; b++) dot_tile(rows, 1, parts, ag, L, nb + b, R, y + m * ldy, ldy);                             \
    break;
        switch (mr) {
            case 1: DOT_RUN(1, 4)
            case 2: DOT_RUN(2, 2)
            case 3: DOT_RUN(3, 2)
            default: DOT_RUN(4, 2)
        }
#undef DOT_RUN
    }
}

/* Rows [r, r + rr) of one group against the group's converted weights w (of nbk blocks), folded into facc. */
static inline __attribute__((always_inline)) void group_rows(int rr, int nbk, int parts, int64_t ag,
                                                             const struct layer *L, struct dot_rows X, int64_t g,
                                                             int64_t r, const __m512i w[2][8], const __m512 ws[2],
                                                             const __m512 wm[2], float *facc) {
    const int64_t groups = X.K / ag, k0 = g * ag;
    for (int p = 0; p < parts; p++) {
        __m512i acc[2][2];
        for (int i = 0; i < rr; i++)
            for (int b = 0; b < nbk; b++) acc[i][b] = _mm512_setzero_si512();
        for (int j = 0; j < ag / 4; j++)
            for (int i = 0; i < rr; i++) {
                int32_t four;
                memcpy(&four, X.q + p * X.part_q + (r + i) * X.K + k0 + 4 * j, 4);
                const __m512i xb = _mm512_set1_epi32(four);
                for (int b = 0; b < nbk; b++) acc[i][b] = _mm512_dpbusd_epi32(acc[i][b], w[b][j], xb);
            }
        for (int i = 0; i < rr; i++) {
            const float s = X.xs[p * X.part_s + (r + i) * groups + g];
            const int32_t qsum = X.qs[p * X.part_s + (r + i) * groups + g];
            for (int b = 0; b < nbk; b++) {
                float *f = facc + ((r + i) * 2 + b) * NB;
                _mm512_storeu_ps(f, fold_group(_mm512_loadu_ps(f), acc[i][b], L, ws[b], wm[b], s, qsum));
            }
        }
    }
}

/* Many rows: per group, the weights of nbk (1 or 2) blocks are converted once into registers and every row of
 * the chunk runs over them; the rows' float sums wait in facc (L1). Same fold as dot_tile, in the same order. */
static inline __attribute__((always_inline)) void many_rows_dot(int nbk, int parts, int64_t ag, const struct layer *L,
                                                                int64_t nb, struct dot_rows X, int64_t M, float *y,
                                                                int64_t ldy, float *facc) {
    const int64_t groups = X.K / ag;
    const uint8_t *wb[2] = {L->w + nb * L->wstride, nbk == 2 ? L->w + (nb + 1) * L->wstride : NULL};
    memset(facc, 0, (size_t)(M * 2 * NB) * sizeof(float));
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * ag, wg = L->grouped ? k0 / L->group : 0;
        __m512i w[2][8];
        __m512 ws[2], wm[2];
        for (int b = 0; b < nbk; b++) {
            for (int j = 0; j < ag / 4; j++) w[b][j] = dot_weights(L->bits, wb[b], k0 + 4 * j);
            ws[b] = L->grouped ? load16s(L, L->scale, nb + b, wg) : _mm512_set1_ps(1.0f);
            wm[b] = L->minv ? load16s(L, L->minv, nb + b, wg) : _mm512_setzero_ps();
        }
        /* rows two at a time: four chains of dot products in flight hide vpdpbusd's latency (four spill) */
        int64_t r = 0;
        for (; r + 2 <= M; r += 2) group_rows(2, nbk, parts, ag, L, X, g, r, w, ws, wm, facc);
        if (r < M) group_rows(1, nbk, parts, ag, L, X, g, r, w, ws, wm, facc);
    }
    for (int64_t r = 0; r < M; r++)
        for (int b = 0; b < nbk; b++) store_block(L, nb + b, _mm512_loadu_ps(facc + (r * 2 + b) * NB), y + r * ldy);
}

static inline __attribute__((always_inline)) void many_rows_of(int parts, int64_t ag, const struct layer *L,
                                                               int64_t nb, int64_t count, struct dot_rows X,
                                                               int64_t M, float *y, int64_t ldy) {
    const int64_t groups = X.K / ag;
    float facc[ROW_CHUNK * 2 * NB];
    for (int64_t m = 0; m < M; m += ROW_CHUNK) {
        const int64_t rows = M - m < ROW_CHUNK ? M - m : ROW_CHUNK;
        const struct dot_rows R = {X.q + m * X.K, X.xs + m * groups, X.qs + m * groups, X.K, X.part_q, X.part_s};
        int64_t b = 0;
        for (; count - b >= 2; b += 2) many_rows_dot(2, parts, ag, L, nb + b, R, rows, y + m * ldy, ldy, facc);
        if (b < count) many_rows_dot(1, parts, ag, L, nb + b, R, rows, y + m * ldy, ldy, facc);
    }
}

static void dot_blocks(int parts, int64_t ag, const struct layer *L, int64_t nb, int64_t count, struct dot_rows X,
                       int64_t M, float *y, int64_t ldy) {
#define DOT_PATH(p, a)                                                                                              \
    if (M >= (L->bits == 8 && p == 1 ? MANY_ROWS_INT8 : MANY_ROWS)) many_rows_of(p, a, L, nb, count, X, M, y, ldy);                                              \
    else few_rows_dot(p, a, L, nb, count, X, M, y, ldy);                                                             \
    return;
    if (parts == 2 && ag == 32) { DOT_PATH(2, 32) }
    if (parts == 2) { DOT_PATH(2, 16) }
    if (ag == 32) { DOT_PATH(1, 32) }
    DOT_PATH(1, 16)
#undef DOT_PATH
}
