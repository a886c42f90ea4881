/* Weight-only quantized linear layers: y = x @ W^T + b with W held as int8 or int4, x and y fp32.
 *
 * Why: a CPU decode step at a small batch is bound by the bytes of weight it reads; int8 reads a quarter of
 * fp32's, int4 an eighth (plus its scales). Activations stay fp32 and every output row is computed by the same
 * sequence of operations whatever the batch (no activation quantization, no batch-dependent path), so a
 * request's tokens never depend on its batch-mates.
 *
 * Layouts (packed once at load by handlers/engine/quantize.py): output channels in blocks of 16 (N padded with
 * zero rows), each block stored k-major so one k step reads the block's 16 weights at once.
 *   int8: w[nb][k][16] signed bytes, one scale per output channel: W[n,k] = scale[n] * q; or, grouped (GGUF's
 *         Q8_0, Q5_*, Q6_K blocks as the file holds them), per group of `group` k a scale and, where the file
 *         has one, a minimum: W[n,k] = q * scale[g,n] (+ min[g,n]), stored like int4's.
 *   int4: w[nb][k][8] bytes, byte j holding channel j (low nibble) and j+8 (high nibble), unsigned 0..15; per
 *         group of `group` k and per channel a scale and a minimum: W[n,k] = q * scale[g,n] + min[g,n]
 *         (llama.cpp's Q4_1 form), stored scale[nb][K/group][16], min likewise.
 * A tile of up to MR rows of x times one block of 16 channels keeps 2*MR accumulators of 8 lanes in registers
 * (the outer-product form of a GEMM microkernel: one broadcast of x and two FMAs per row and k step); fewer rows
 * take up to 4 blocks side by side, so that enough independent FMA chains hide the FMA latency. Up to MR rows
 * the weights are converted inline (one tile reads them); more rows convert each chunk of KC inputs of 4 blocks
 * once into a per-thread fp32 buffer that every tile then reads, partial sums kept between chunks. Both paths
 * compute the same converted values and accumulate each output in the same k order, so a row's result is
 * bit-identical at any batch size. OpenMP threads take whole runs of blocks, so the thread count does not
 * change results either.
 *
 * Built at first use by handlers/engine/kernels.py (cc -O3 -march=native -fopenmp); GCC vector extensions,
 * so the same source compiles to AVX2/AVX-512/NEON code.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define MR 6 /* rows of x per tile: 12 accumulators + 2 weight vectors + 1 broadcast fit AVX2's 16 registers */
#define NB 16 /* output channels per block */
#define MAX_BLOCKS 4 /* blocks side by side in a tile of few rows */
#define BUFFERED_ROWS 7 /* from this many rows on, weights are converted once into a buffer for all tiles */
#define KC 128 /* inputs per converted chunk: 4 blocks of it fill 32 KiB, an L1 */

typedef float v8f __attribute__((vector_size(32)));
typedef int8_t v8s __attribute__((vector_size(8)));
typedef uint8_t v8u __attribute__((vector_size(8)));
typedef int32_t v8i __attribute__((vector_size(32)));

enum source { FROM_FLOAT = 0, FROM_INT8 = 8, FROM_INT4 = 4, FROM_INT8_GROUPED = 9 };

static inline v8f load8f(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8f(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* 8 fp16 values as fp32 lanes */
static inline v8f load8h(const uint16_t *p) {
#if defined(__F16C__)
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    v8f out;
    memcpy(&out, &v, sizeof out);
    return out;
#else
    v8f out;
    for (int i = 0; i < 8; i++) {
        _Float16 h;
        memcpy(&h, p + i, 2);
        out[i] = (float)h;
    }
    return out;
#endif
}

/* 8 signed / unsigned bytes as fp32 lanes. GCC's vector extensions scalarise the byte widening, so x86 gets
 * the AVX2 instructions spelled out; other CPUs the generic form. */
static inline v8f s8_to_f(const uint8_t *p) {
#if defined(__AVX2__)
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    v8f out;
    memcpy(&out, &v, sizeof out);
    return out;
#else
    v8s a;
    memcpy(&a, p, sizeof a);
    return __builtin_convertvector(__builtin_convertvector(a, v8i), v8f);
#endif
}

/* the low and the high nibbles of 8 bytes as two fp32 vectors */
static inline void nibbles_to_f(const uint8_t *p, v8f *lo, v8f *hi) {
#if defined(__AVX2__)
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p), mask = _mm_set1_epi8(15);
    __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
    memcpy(lo, &a, sizeof a);
    memcpy(hi, &b, sizeof b);
#else
    v8u bytes;
    memcpy(&bytes, p, sizeof bytes);
    const v8u mask = {15, 15, 15, 15, 15, 15, 15, 15};
    *lo = __builtin_convertvector(__builtin_convertvector(bytes & mask, v8i), v8f);
    *hi = __builtin_convertvector(__builtin_convertvector(bytes >> 4, v8i), v8f);
#endif
}

/* The block's 16 weights at step k, as fp32 (int8: the integers, scaled at the end; int4: scaled here, with
 * the scales and minimums of group gi, which the callers count along k: a division per step costs more than the
 * rest of an int4 step). */
static inline __attribute__((always_inline)) void weights_at(int src, const uint8_t *w, const float *fw,
                                                             const float *scale, const float *minv, int64_t k,
                                                             int64_t gi, v8f *lo, v8f *hi) {
    if (src == FROM_FLOAT) {
        *lo = load8f(fw + k * NB);
        *hi = load8f(fw + k * NB + 8);
    } else if (src == FROM_INT8) {
        *lo = s8_to_f(w + k * NB);
        *hi = s8_to_f(w + k * NB + 8);
    } else if (src == FROM_INT8_GROUPED) {
        const int64_t g = gi * NB;
        *lo = s8_to_f(w + k * NB) * load8f(scale + g);
        *hi = s8_to_f(w + k * NB + 8) * load8f(scale + g + 8);
        if (minv) { /* the same branch every step: predicted */
            *lo += load8f(minv + g);
            *hi += load8f(minv + g + 8);
        }
    } else {
        v8f ql, qh;
        nibbles_to_f(w + k * (NB / 2), &ql, &qh);
        const int64_t g = gi * NB;
        *lo = ql * load8f(scale + g) + load8f(minv + g);
        *hi = qh * load8f(scale + g + 8) + load8f(minv + g + 8);
    }
}

/* A quantized layer as the kernel reads it. */
struct layer {
    const uint8_t *w;
    const float *scale, *minv, *bias;
    int64_t K, N, group, wstride, sstride; /* bytes per block of w; floats per block of scale and minv (fp16
                                              tables: half as many floats as values) */
    int bits, grouped, half; /* grouped: int8 with a scale per group (int4 always is); half: fp16 tables */
};

/* Where a tile's sums start and end: k in [k0, k1); partial sums (ldp floats a row, 16 a block) loaded unless
 * this is the first chunk, stored unless it is the last, when the output is written instead. */
struct span {
    int64_t k0, k1;
    float *part;
    int64_t ldp;
    int first, last;
};

/* Rows [0, mr) of x times blocks [nb, nb + nbk): weights of kind src (FROM_FLOAT: fw holds the blocks converted,
 * fw_stride floats apart, from k0 on). Each output is one chain of FMAs over k in order, whatever mr, nbk and the
 * chunking: the tile's shape only decides how many chains run side by side (a single row needs several blocks
 * at once, or the FMA latency, not the weights, sets its speed). */
static inline __attribute__((always_inline)) void tile(int mr, int nbk, int src, const struct layer *L, int64_t nb,
                                                       const float *fw, int64_t fw_stride, struct span sp,
                                                       const float *x, int64_t ldx, float *y, int64_t ldy) {
    v8f acc[MR][MAX_BLOCKS][2];
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < nbk; b++) {
            if (sp.first) {
                acc[r][b][0] = acc[r][b][1] = (v8f){0};
            } else {
                acc[r][b][0] = load8f(sp.part + r * sp.ldp + b * NB);
                acc[r][b][1] = load8f(sp.part + r * sp.ldp + b * NB + 8);
            }
        }
    int64_t gi = sp.k0 / L->group, left = L->group - sp.k0 % L->group; /* int4: k's group, its steps left */
    for (int64_t k = sp.k0; k < sp.k1; k++) {
        v8f lo[MAX_BLOCKS], hi[MAX_BLOCKS];
        for (int b = 0; b < nbk; b++)
            weights_at(src, L->w + (nb + b) * L->wstride, fw + b * fw_stride, L->scale + (nb + b) * L->sstride,
                       L->minv ? L->minv + (nb + b) * L->sstride : NULL, src == FROM_FLOAT ? k - sp.k0 : k, gi,
                       &lo[b], &hi[b]);
        if (--left == 0) {
            gi++;
            left = L->group;
        }
        for (int r = 0; r < mr; r++) {
            const float xv = x[r * ldx + k];
            const v8f bx = {xv, xv, xv, xv, xv, xv, xv, xv};
            for (int b = 0; b < nbk; b++) {
                acc[r][b][0] += bx * lo[b];
                acc[r][b][1] += bx * hi[b];
            }
        }
    }
    if (!sp.last) {
        for (int r = 0; r < mr; r++)
            for (int b = 0; b < nbk; b++) {
                store8f(sp.part + r * sp.ldp + b * NB, acc[r][b][0]);
                store8f(sp.part + r * sp.ldp + b * NB + 8, acc[r][b][1]);
            }
        return;
    }
    for (int b = 0; b < nbk; b++) {
        const int64_t n0 = (nb + b) * NB;
        const int valid = L->N - n0 < NB ? (int)(L->N - n0) : NB;
        const float *chan = L->bits == 8 && !L->grouped ? L->scale + (nb + b) * L->sstride : NULL;
        for (int r = 0; r < mr; r++) {
            float out[NB];
            v8f lo = acc[r][b][0], hi = acc[r][b][1];
            if (chan) { /* int8: the per-channel scale, once per output */
                lo *= load8f(chan);
                hi *= load8f(chan + 8);
            }
            store8f(out, lo);
            store8f(out + 8, hi);
            float *row = y + r * ldy + n0;
            for (int j = 0; j < valid; j++) row[j] = out[j] + (L->bias ? L->bias[n0 + j] : 0.0f);
        }
    }
}

/* Up to MR rows over `count` blocks from nb: as many blocks side by side as keep about 8-12
 * chains of FMAs in flight. */
static inline __attribute__((always_inline)) void last_rows(int src, const struct layer *L, int64_t nb, int64_t count,
                                                            const float *fw, int64_t fw_stride, struct span sp,
                                                            const float *x, int64_t ldx, int64_t rows, float *y,
                                                            int64_t ldy) {
    int64_t b = 0;
#define RUN(mr, nbk)                                                                                                \
    for (; count - b >= nbk; b += nbk) {                                                                            \
        struct span s = sp;                                                                                         \
        s.part = sp.part ? sp.part + b * NB : NULL;                                                                 \
        tile(mr, nbk, src, L, nb + b, fw + b * fw_stride, fw_stride, s, x, ldx, y, ldy);                            \
    }                                                                                                               \
    for (; b < count; b++) {                                                                                        \
        struct span s = sp;                                                                                         \
        s.part = sp.part ? sp.part + b * NB : NULL;                                                                 \
        tile(mr, 1, src, L, nb + b, fw + b * fw_stride, fw_stride, s, x, ldx, y, ldy);                              \
    }                                                                                                               \
    break;
    switch (rows) {
        case 1: RUN(1, 4)
        case 2: RUN(2, 3)
        case 3: RUN(3, 2)
        case 4: RUN(4, 1)
        case 5: RUN(5, 1)
        case 6: RUN(6, 1)
        default: break;
    }
#undef RUN
}

/* Few rows: every tile converts its weights inline (nothing to share the conversion with). */
static inline __attribute__((always_inline)) void few_rows(int src, const struct layer *L, int64_t nb, int64_t count,
                                                           const float *x, int64_t ldx, int64_t M, float *y,
                                                           int64_t ldy) {
    const struct span whole = {0, L->K, NULL, 0, 1, 1};
    last_rows(src, L, nb, count, NULL, 0, whole, x, ldx, M, y, ldy);
}

/* More rows: for each group of up to MAX_BLOCKS blocks and each chunk of KC inputs, the chunk's weights are
 * converted once into buf (L1-sized) and every row tile runs over it, partial sums kept in part (M rows of
 * MAX_BLOCKS * 16). The arithmetic is the inline path's, so a row's result does not depend on M. */
static inline __attribute__((always_inline)) void many_rows(int src, const struct layer *L, int64_t nb, int64_t count,
                                                            const float *x, int64_t ldx, int64_t M, float *y,
                                                            int64_t ldy, float *buf, float *part) {
    const int64_t ldp = MAX_BLOCKS * NB;
    for (int64_t g = nb; g < nb + count; g += MAX_BLOCKS) {
        const int64_t blocks = nb + count - g < MAX_BLOCKS ? nb + count - g : MAX_BLOCKS;
        for (int64_t k0 = 0; k0 < L->K; k0 += KC) {
            const int64_t k1 = k0 + KC < L->K ? k0 + KC : L->K;
            for (int64_t b = 0; b < blocks; b++) {
                int64_t gi = k0 / L->group, left = L->group - k0 % L->group;
                for (int64_t k = k0; k < k1; k++) {
                    v8f lo, hi;
                    weights_at(src, L->w + (g + b) * L->wstride, NULL, L->scale + (g + b) * L->sstride,
                               L->minv ? L->minv + (g + b) * L->sstride : NULL, k, gi, &lo, &hi);
                    store8f(buf + b * KC * NB + (k - k0) * NB, lo);
                    store8f(buf + b * KC * NB + (k - k0) * NB + 8, hi);
                    if (--left == 0) {
                        gi++;
                        left = L->group;
                    }
                }
            }
            const int first = k0 == 0, last = k1 == L->K;
            int64_t m = 0;
            for (; m + MR <= M; m += MR)
                for (int64_t b = 0; b < blocks; b++) {
                    const struct span sp = {k0, k1, part + m * ldp + b * NB, ldp, first, last};
                    tile(MR, 1, FROM_FLOAT, L, g + b, buf + b * KC * NB, KC * NB, sp, x + m * ldx, ldx, y + m * ldy,
                         ldy);
                }
            if (m < M) {
                const struct span sp = {k0, k1, part + m * ldp, ldp, first, last};
                last_rows(FROM_FLOAT, L, g, blocks, buf, KC * NB, sp, x + m * ldx, ldx, M - m, y + m * ldy, ldy);
            }
        }
    }
}

static void run_blocks(const struct layer *L, int64_t nb, int64_t count, const float *x, int64_t ldx, int64_t M,
                       float *y, int64_t ldy, float *buf, float *part);

/* The float path reads fp32 tables: a run of blocks with fp16 ones gets them converted into `tables` first (a
 * fraction of the weights' bytes; the integer path reads fp16 directly) and runs on a layer that points there. */
static int run_half_blocks(const struct layer *L, int64_t nb, int64_t count, const float *x, int64_t ldx, int64_t M,
                           float *y, int64_t ldy, float *buf, float *part) {
    const int64_t per = 2 * L->sstride; /* values per block */
    float *tables = malloc((size_t)(count * per * (L->minv ? 2 : 1)) * sizeof(float));
    if (tables == NULL) return -1;
    for (int64_t i = 0; i < count * per; i += 8) {
        store8f(tables + i, load8h((const uint16_t *)(L->scale + nb * L->sstride) + i));
        if (L->minv) store8f(tables + count * per + i, load8h((const uint16_t *)(L->minv + nb * L->sstride) + i));
    }
    struct layer F = *L; /* the run as a layer of its own: its first block is block 0 */
    F.half = 0;
    F.sstride = per;
    F.scale = tables;
    F.minv = L->minv ? tables + count * per : NULL;
    F.w = L->w + nb * L->wstride;
    F.bias = L->bias ? L->bias + nb * NB : NULL;
    F.N = L->N - nb * NB;
    run_blocks(&F, 0, count, x, ldx, M, y + nb * NB, ldy, buf, part);
    free(tables);
    return 0;
}

static void run_blocks(const struct layer *L, int64_t nb, int64_t count, const float *x, int64_t ldx, int64_t M,
                       float *y, int64_t ldy, float *buf, float *part) {
    if (M < BUFFERED_ROWS) {
        if (L->grouped && L->bits == 8) few_rows(FROM_INT8_GROUPED, L, nb, count, x, ldx, M, y, ldy);
        else if (L->bits == 8) few_rows(FROM_INT8, L, nb, count, x, ldx, M, y, ldy);
        else few_rows(FROM_INT4, L, nb, count, x, ldx, M, y, ldy);
    } else if (L->grouped && L->bits == 8) {
        many_rows(FROM_INT8_GROUPED, L, nb, count, x, ldx, M, y, ldy, buf, part);
    } else if (L->bits == 8) {
        many_rows(FROM_INT8, L, nb, count, x, ldx, M, y, ldy, buf, part);
    } else {
        many_rows(FROM_INT4, L, nb, count, x, ldx, M, y, ldy, buf, part);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define INT8_DOT 1
#include "quant_dot.h"
#else
#define INT8_DOT 0
#endif

/* Whether this build has the int8-activation path (quant_dot.h), and whether it takes a layer of K inputs in
 * groups of `group` (0: int8 per channel). */
int rollserve_quant_int8_dot(int64_t K, int64_t group) {
#if INT8_DOT
    return K % 16 == 0 && group % 16 == 0; /* quant_dot.h's act_group */
#else
    (void)K;
    (void)group;
    return 0;
#endif
}

#if INT8_DOT
static int int8_dot_linear(const struct layer *L, const float *x, int64_t ldx, int64_t M, int parts, float *y,
                           int64_t ldy, int nthreads) {
    const int64_t ag = act_group(L->K, L->group), groups = L->K / ag, blocks = (L->N + NB - 1) / NB;
    int8_t *q = malloc((size_t)(parts * M * L->K));
    float *xs = malloc((size_t)(parts * M * groups) * sizeof(float));
    int32_t *qs = malloc((size_t)(parts * M * groups) * sizeof(int32_t));
    if (q == NULL || xs == NULL || qs == NULL) {
        free(q);
        free(xs);
        free(qs);
        return -1;
    }
    quantize_rows(x, ldx, M, L->K, ag, parts, q, xs, qs, nthreads);
    const struct dot_rows X = {q, xs, qs, L->K, M * L->K, M * groups};
    const int64_t per = ((blocks + nthreads - 1) / nthreads + DNB - 1) / DNB * DNB;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t first = 0; first < blocks; first += per) {
        const int64_t count = blocks - first < per ? blocks - first : per;
        dot_blocks(parts, ag, L, first, count, X, M, y, ldy);
    }
    free(q);
    free(xs);
    free(qs);
    return 0;
}
#endif

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T + bias; int8 with group > 0 is grouped, with 0 per
 * channel; int8_x: 0 for fp32 activations, else each row quantized in int8_x parts of int8 (1 or 2: quant_dot.h;
 * only where rollserve_quant_int8_dot says so); half: the scale and minimum tables are fp16 (grouped layers).
 * Returns 0, or -1 for arguments it does not take (the caller refuses the layer at load, so this is a guard, not
 * a path). */
int rollserve_quant_linear(const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *w, int bits,
                           const float *scale, const float *minv, int64_t group, const float *bias, float *y,
                           int64_t ldy, int64_t N, int threads, int int8_x, int half) {
    const int grouped = bits == 4 || group > 0;
    if ((bits != 8 && bits != 4) || M < 0 || K <= 0 || N <= 0 || group < 0 || (grouped && (group <= 0 || K % group))
        || (bits == 4 && minv == NULL) || (half && !grouped))
        return -1;
    if (M == 0) return 0;
    /* per-channel int8 has no groups: one that spans K keeps the callers' group counting well defined */
    const struct layer L = {w, scale, minv, bias, K, N, grouped ? group : K, bits == 8 ? K * NB : K * (NB / 2),
                            grouped ? (K / group) * NB / (half ? 2 : 1) : NB, bits, grouped, half};
    const int64_t blocks = (N + NB - 1) / NB;
    /* threads take runs of blocks of equal size (a multiple of 4, so 4-block tiles and groups stay whole) */
    const int nthreads = threads > 0 ? threads : 1;
    if (int8_x) {
        if (!rollserve_quant_int8_dot(K, grouped ? group : 0) || int8_x > 2) return -1;
#if INT8_DOT
        return int8_dot_linear(&L, x, ldx, M, int8_x, y, ldy, nthreads);
#endif
    }
    const int64_t per = ((blocks + nthreads - 1) / nthreads + 3) / 4 * 4;
    const int buffered = M >= BUFFERED_ROWS;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = buffered ? malloc((size_t)MAX_BLOCKS * KC * NB * sizeof(float)) : NULL;
        float *part = buffered ? malloc((size_t)M * MAX_BLOCKS * NB * sizeof(float)) : NULL;
        if (buffered && (buf == NULL || part == NULL)) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t first = 0; first < blocks; first += per) {
                const int64_t count = blocks - first < per ? blocks - first : per;
                if (!L.half) run_blocks(&L, first, count, x, ldx, M, y, ldy, buf, part);
                else if (run_half_blocks(&L, first, count, x, ldx, M, y, ldy, buf, part) != 0) {
#pragma omp atomic write
                    failed = 1;
                }
            }
        }
        free(buf);
        free(part);
    }
    return failed ? -1 : 0;
}
