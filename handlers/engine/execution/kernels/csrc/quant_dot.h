/* Integer dot products for quant_linear.c's layouts: int8 activations times int4/int8 weights (llama.cpp's way).
 *
 * Why: converting every 4-bit weight to fp32 before an FMA costs several instructions per weight, which is what
 * sets a one-user decode step's time on a CPU; VNNI's vpdpbusd multiplies 64 byte pairs and sums them by fours in
 * one instruction. Each row of x is quantized by itself, per group of AG inputs (symmetric int8, scale max|x|/127,
 * as llama.cpp's Q8 activations), so a row's result never depends on its batch-mates or the thread count.
 * With two parts, what the first int8 part leaves (at most half its step) is quantized again at 1/254 of that step
 * and multiplied too, from the same unpacked weights: inputs to about 1e-5 of their largest value, so a model's
 * answers stay those of the fp32-input kernel where one part (llama.cpp's precision) flips a knife-edge token.
 *   y[n] = sum over groups g of  wscale[g,n] * xs[g] * sum_k(qw * qx)  (+ wmin[g,n] * xs[g] * sum_k(qx))
 * int8 weights enter vpdpbusd as unsigned (q + 128), and 128 * sum_k(qx) is taken off again.
 * A block's 4 k steps of 16 channels (32 bytes of nibbles, or 64 bytes) are put in vpdpbusd's order (a channel's 4
 * k in one 32-bit lane) by one vpermb. Needs AVX-512 VNNI and VBMI; quant_linear.c keeps its float path otherwise.
 */
#include <immintrin.h>
#include <stdint.h>

#define AG 16 /* activations per int8 scale: divides every weight group (16, 32) */
#define DMR 4 /* rows of x per tile */
#define DNB 4 /* blocks side by side */

/* Rows of x quantized per AG, in `parts` parts (1 or 2): part p of row m is q[(p*M + m)*K ...], its scales
 * xs[(p*M + m)*groups + g] and sums of its integers qs[...] likewise. */
static void quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int parts, int8_t *q, float *xs,
                          int32_t *qs, int threads) {
    const int64_t groups = K / AG;
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K > 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            __m512 v = _mm512_loadu_ps(x + m * ldx + g * AG);
            const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
            float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int p = 0; p < parts; p++) {
                const __m512i iv = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(id))); /* nearest, even */
                _mm_storeu_si128((__m128i *)(q + (p * M + m) * K + g * AG), _mm512_cvtsepi32_epi8(iv));
                xs[(p * M + m) * groups + g] = d;
                qs[(p * M + m) * groups + g] = _mm512_reduce_add_epi32(iv);
                v = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(iv), _mm512_set1_ps(d), v); /* what is left: |v| <= d/2 */
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

struct dot_rows {
    const int8_t *q;
    const float *xs;
    const int32_t *qs;
    int64_t K, part_q, part_s; /* the second part's offsets (elements) from the first's, in q and in xs/qs */
};

/* Rows [0, mr) of the quantized x times blocks [nb, nb + nbk): written to y with bias. */
static inline __attribute__((always_inline)) void dot_tile(int mr, int nbk, int parts, const struct layer *L,
                                                           int64_t nb, struct dot_rows X, float *y, int64_t ldy) {
    const int64_t groups = X.K / AG;
    __m512 facc[DMR][DNB];
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < nbk; b++) facc[r][b] = _mm512_setzero_ps();
    const uint8_t *wb[DNB];
    for (int b = 0; b < nbk; b++) wb[b] = L->w + (nb + b) * L->wstride;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t k0 = g * AG;
        __m512i acc[2][DMR][DNB];
        for (int p = 0; p < parts; p++)
            for (int r = 0; r < mr; r++)
                for (int b = 0; b < nbk; b++) acc[p][r][b] = _mm512_setzero_si512();
        for (int kk = 0; kk < AG; kk += 4) {
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
                for (int r = 0; r < mr; r++) {
                    const float s = X.xs[p * X.part_s + r * groups + g];
                    const int32_t qsum = X.qs[p * X.part_s + r * groups + g];
                    __m512i a = acc[p][r][b];
                    if (L->bits == 8) a = _mm512_sub_epi32(a, _mm512_set1_epi32(128 * qsum));
                    facc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(ws, _mm512_set1_ps(s)),
                                                 facc[r][b]);
                    if (L->minv) facc[r][b] = _mm512_fmadd_ps(wm, _mm512_set1_ps(s * (float)qsum), facc[r][b]);
                }
        }
    }
    for (int b = 0; b < nbk; b++) {
        const int64_t n0 = (nb + b) * NB;
        const int valid = L->N - n0 < NB ? (int)(L->N - n0) : NB;
        const __m512 chan = L->grouped ? _mm512_set1_ps(1.0f) : _mm512_loadu_ps(L->scale + (nb + b) * L->sstride);
        for (int r = 0; r < mr; r++) {
            float out[NB];
            _mm512_storeu_ps(out, _mm512_mul_ps(facc[r][b], chan));
            float *row = y + r * ldy + n0;
            for (int j = 0; j < valid; j++) row[j] = out[j] + (L->bias ? L->bias[n0 + j] : 0.0f);
        }
    }
}

/* All M rows over `count` blocks from nb, in tiles of up to DMR rows by DNB blocks. */
static inline __attribute__((always_inline)) void dot_rows_of(int parts, const struct layer *L, int64_t nb,
                                                              int64_t count, struct dot_rows X, int64_t M, float *y,
                                                              int64_t ldy) {
    const int64_t groups = X.K / AG;
    for (int64_t m = 0; m < M; m += DMR) {
        const int mr = M - m < DMR ? (int)(M - m) : DMR;
        const struct dot_rows R = {X.q + m * X.K, X.xs + m * groups, X.qs + m * groups, X.K, X.part_q, X.part_s};
        int64_t b = 0;
#define DOT_RUN(rows, nbk)                                                                                          \
    for (; count - b >= nbk; b += nbk) dot_tile(rows, nbk, parts, L, nb + b, R, y + m * ldy, ldy);                   \
    for (; b < count; b++) dot_tile(rows, 1, parts, L, nb + b, R, y + m * ldy, ldy);                                 \
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

static void dot_blocks(int parts, const struct layer *L, int64_t nb, int64_t count, struct dot_rows X, int64_t M,
                       float *y, int64_t ldy) {
    if (parts == 2) dot_rows_of(2, L, nb, count, X, M, y, ldy);
    else dot_rows_of(1, L, nb, count, X, M, y, ldy);
}
