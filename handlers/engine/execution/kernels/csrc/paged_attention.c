/* Paged attention for decode rows, reading K/V where they sit in the pool (no gather, no padding).
 *
 * One call per layer serves every decode row of the step. The work items are (sequence, KV head) pairs, spread
 * over OpenMP threads; the g query heads that share a KV head are processed together, and so are the rows of one
 * sequence that read the same keys from the same first position (a decode row and its speculative guesses: row i
 * reads one key more than row i - 1), so each key and value row is read once per item, not once per guess.
 * Every query keeps its own key range, softmax and sum, in the order a lone row would use: the outputs are those
 * of one row at a time, bit for bit. Per item, two passes walk the sequence's block table
 * block by block (a block's rows of one head are contiguous in the pool, so there is no per-key index
 * arithmetic): pass 1 computes every score (sixteen keys at a time with AVX-512, else four), then the softmax is
 * taken over the whole row (fp32, max-subtracted), and pass 2 sums the value rows weighted by it (with AVX-512 and
 * a head size of 64 or 128 each head's accumulator in registers for a whole block, else four keys at a time).
 * Each pass prefetches the next block while it works on one. Scores live in a per-thread buffer sized by the
 * longest sequence of the call.
 * Optional: logit soft-capping (tanh), a per-head sink logit, and a key range [kv_lo, kv_end) for sliding
 * windows. Layouts: q and out [T, H, D] with any row/head strides; the pool is [Hkv, S, D] (head-major) with D
 * contiguous; fp32 or bf16 pool, query and output (bf16 is converted to fp32 on load; all arithmetic is fp32;
 * bf16 output rounds to nearest even).
 *
 * Built at first use by handlers/engine/kernels.py (cc -O3 -march=native -fopenmp) and called through
 * ctypes; plain C with no torch headers, so it compiles in about a second.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#define MAX_GROUP 64
#define MAX_DIM 512
#define ROWS 4 /* keys per inner iteration */

static inline float bf16_to_float(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* n rows of the pool starting at row `row` of head base `head`, as fp32: in place for an fp32 pool, else
 * converted into buf (n x d). */
static inline const float* rows_f32(const void* pool, int is_bf16, int64_t head, int64_t row, int64_t stride_s,
                                    int64_t n, int64_t d, float* buf) {
    if (!is_bf16) return (const float*)pool + head + row * stride_s;
    const uint16_t* p = (const uint16_t*)pool + head + row * stride_s;
    for (int64_t t = 0; t < n; t++)
        for (int64_t i = 0; i < d; i++) buf[t * d + i] = bf16_to_float(p[t * stride_s + i]);
    return buf;
}

/* Scores of n contiguous key rows (row stride ks) against g query rows: sc[j * ld + t]. */
static inline void prefetch_rows(const float* next, int64_t ks, int64_t d, int64_t t, int64_t n) {
    if (next == 0) return;
    for (int64_t r = t; r < t + ROWS && r < n; r++)
        for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(next + r * ks + i, 0, 3);
}


#if defined(__AVX512F__)
#include <immintrin.h>
/* The transpose-and-add tree that turns 16 keys' partial-sum vectors (16 lanes each) into one vector of their 16
 * scores: 15 adds and 30 shuffles where 16 horizontal sums take about twice that. */
static inline __m512 pair_sum(__m512 a, __m512 b) { /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
static inline __m512 quad_sum(__m512 x, __m512 y) { /* per 128-bit lane: four keys' partial sums */
    const __m512d xd = _mm512_castps_pd(x), yd = _mm512_castps_pd(y);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(xd, yd)), _mm512_castpd_ps(_mm512_unpackhi_pd(xd, yd)));
}
static inline __m512 lane_sum(__m512 x, __m512 y) { /* lanes [x0+x1, x2+x3, y0+y1, y2+y3] */
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline __m512 reduce16(const __m512* a) {
    const __m512 p0 = pair_sum(a[0], a[1]), p1 = pair_sum(a[2], a[3]), p2 = pair_sum(a[4], a[5]), p3 = pair_sum(a[6], a[7]);
    const __m512 p4 = pair_sum(a[8], a[9]), p5 = pair_sum(a[10], a[11]), p6 = pair_sum(a[12], a[13]), p7 = pair_sum(a[14], a[15]);
    const __m512 q0 = quad_sum(p0, p1), q1 = quad_sum(p2, p3), q2 = quad_sum(p4, p5), q3 = quad_sum(p6, p7);
    return lane_sum(lane_sum(q0, q1), lane_sum(q2, q3));
}
#endif

static inline void score_rows(const float* restrict qv, int64_t g, int64_t d, const float* restrict k, int64_t ks,
                              int64_t n, float* restrict sc, int64_t ld, const float* next, int64_t next_n) {
    int64_t t = 0;
#if defined(__AVX512F__)
    if (d % 16 == 0) { /* sixteen keys at a time, one partial-sum vector each, reduced together */
        for (; t < n; t += 16) {
            const int64_t m = n - t < 16 ? n - t : 16;
            const __mmask16 keep = (__mmask16)((1u << m) - 1u);
            const float* rows[16];
            for (int r = 0; r < 16; r++) rows[r] = k + (t + (r < m ? r : m - 1)) * ks;
            if (next != 0) /* the next block's rows, as far as this chunk's */
                for (int64_t r = t; r < t + 16 && r < next_n; r++)
                    for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(next + r * ks + i, 0, 3);
            for (int64_t j = 0; j < g; j++) {
                const float* qj = qv + j * d;
                __m512 acc[16];
                for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                for (int64_t i = 0; i < d; i += 16) {
                    const __m512 qc = _mm512_loadu_ps(qj + i);
                    for (int r = 0; r < 16; r++) acc[r] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(rows[r] + i), acc[r]);
                }
                _mm512_mask_storeu_ps(sc + j * ld + t, keep, reduce16(acc));
            }
        }
        return;
    }
#endif
    /* Four keys at a time; a last group of fewer repeats its last key (its extra scores are not stored), so key t
     * is always the (t % 4)-th sum of the same four-way loop, whatever the block's length: a row alone reads fewer
     * keys of its last block than beside its guesses, and must get the same bits. */
    for (; t < n; t += ROWS) {
        prefetch_rows(next, ks, d, t, next_n);
        const int64_t m = n - t < ROWS ? n - t : ROWS;
        const float* k0 = k + t * ks;
        const float* k1 = k0 + (m > 1 ? 1 : 0) * ks;
        const float* k2 = k0 + (m > 2 ? 2 : m - 1) * ks;
        const float* k3 = k0 + (m > 3 ? 3 : m - 1) * ks;
        for (int64_t j = 0; j < g; j++) {
            const float* restrict qj = qv + j * d;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t i = 0; i < d; i++) {
                s0 += qj[i] * k0[i];
                s1 += qj[i] * k1[i];
                s2 += qj[i] * k2[i];
                s3 += qj[i] * k3[i];
            }
            float* sj = sc + j * ld + t;
            sj[0] = s0;
            if (m > 1) sj[1] = s1;
            if (m > 2) sj[2] = s2;
            if (m > 3) sj[3] = s3;
        }
    }
}

#if defined(__AVX512F__)
/* accumulate_rows for a head size known at compile time (64 or 128): each query head's accumulator stays in
 * registers across the block, one broadcast weight and d/16 fused multiply-adds per value row. */
static inline __attribute__((always_inline)) void accumulate_fixed(float* restrict acc, int64_t g, const int64_t d,
        const float* restrict v, int64_t vs, const int64_t* lim, const float* restrict p, int64_t ld,
        const float* next, int64_t next_n) {
    if (next != 0)
        for (int64_t r = 0; r < next_n; r++)
            for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(next + r * vs + i, 0, 3);
    for (int64_t j = 0; j < g; j++) {
        __m512 a[8];
        for (int64_t c = 0; c < d / 16; c++) a[c] = _mm512_loadu_ps(acc + j * d + 16 * c);
        const float* pj = p + j * ld;
        for (int64_t t = 0; t < lim[j]; t++) {
            const __m512 w = _mm512_set1_ps(pj[t]);
            const float* vr = v + t * vs;
            for (int64_t c = 0; c < d / 16; c++) a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * c), a[c]);
        }
        for (int64_t c = 0; c < d / 16; c++) _mm512_storeu_ps(acc + j * d + 16 * c, a[c]);
    }
}
#endif

/* acc[j] += sum_t p[j * ld + t] * v[t] over the first lim[j] of n contiguous value rows (row stride vs). A query
 * adds its rows four at a time while four remain in its own range, then one at a time: the order a lone row
 * with n = lim[j] uses. */
static inline void accumulate_rows(float* restrict acc, int64_t g, int64_t d, const float* restrict v, int64_t vs,
                                   int64_t n, const int64_t* lim, const float* restrict p, int64_t ld,
                                   const float* next, int64_t next_n) {
#if defined(__AVX512F__)
    if (d == 64) {
        accumulate_fixed(acc, g, 64, v, vs, lim, p, ld, next, next_n);
        return;
    }
    if (d == 128) {
        accumulate_fixed(acc, g, 128, v, vs, lim, p, ld, next, next_n);
        return;
    }
#endif
    for (int64_t t = 0; t < n; t += ROWS) {
        prefetch_rows(next, vs, d, t, next_n);
        const float* restrict v0 = v + t * vs;
        for (int64_t j = 0; j < g; j++) {
            const float* pj = p + j * ld + t;
            float* restrict aj = acc + j * d;
            if (t + ROWS <= lim[j]) {
                const float* restrict v1 = v0 + vs;
                const float* restrict v2 = v1 + vs;
                const float* restrict v3 = v2 + vs;
                const float p0 = pj[0], p1 = pj[1], p2 = pj[2], p3 = pj[3];
#pragma omp simd
                for (int64_t i = 0; i < d; i++) aj[i] += p0 * v0[i] + p1 * v1[i] + p2 * v2[i] + p3 * v3[i];
                continue;
            }
            for (int64_t u = 0; t + u < lim[j] && u < ROWS; u++) {
                const float pt = pj[u];
                const float* restrict vr = v0 + u * vs;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) aj[i] += pt * vr[i];
            }
        }
    }
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    void* out;
    const int64_t* meta;
    const int32_t* tables;
    int64_t q_stride_t, q_stride_h, c_stride_h, c_stride_s, o_stride_t, o_stride_h, group, d, block_size;
    int q_bf16, is_bf16;
    float scale, softcap;
    const float* sinks;
} Call;

/* One (sequence, KV head) over `nrows` consecutive meta rows of that sequence with the same first key position:
 * gq = g x nrows queries (query j: row j / g, head j % g), each with its own end. sc holds gq x (longest end -
 * kv_lo) scores, rows 2 x block_size x d floats. */
static void attend_one(const Call* c, const int64_t* meta, int64_t nrows, int64_t kvh, float* sc, float* rows) {
    const int64_t kv_lo = meta[1];
    const int32_t* table = c->tables + meta[3];
    const int64_t g = c->group, gq = g * nrows, d = c->d, bs = c->block_size;
    const int64_t head = kvh * c->c_stride_h, ks = c->is_bf16 ? d : c->c_stride_s;
    float qv[MAX_GROUP * MAX_DIM];
    float acc[MAX_GROUP * MAX_DIM];
    int64_t lens[MAX_GROUP], lim[MAX_GROUP];
    int64_t kv_end = kv_lo;
    for (int64_t j = 0; j < gq; j++) {
        const int64_t* m = meta + 4 * (j / g);
        const int64_t q_off = m[0] * c->q_stride_t + (kvh * g + j % g) * c->q_stride_h;
        for (int64_t i = 0; i < d; i++) {
            const float x = c->q_bf16 ? bf16_to_float(((const uint16_t*)c->q)[q_off + i]) : ((const float*)c->q)[q_off + i];
            qv[j * d + i] = x * c->scale;
            acc[j * d + i] = 0.0f;
        }
        lens[j] = m[2] - kv_lo;
        kv_end = m[2] > kv_end ? m[2] : kv_end;
    }
    const int64_t len = kv_end - kv_lo;
    /* pass 1: scores, block by block (a query's scores past its own end are computed and never read) */
    for (int64_t pos = kv_lo; pos < kv_end;) {
        const int64_t off = pos % bs, n = bs - off < kv_end - pos ? bs - off : kv_end - pos;
        const int64_t row = (int64_t)table[pos / bs] * bs + off;
        const float* k = rows_f32(c->k_cache, c->is_bf16, head, row, c->c_stride_s, n, d, rows);
        const int64_t nxt = pos + n, nn = kv_end - nxt < bs ? kv_end - nxt : bs;
        const float* next = nxt < kv_end && !c->is_bf16 ? (const float*)c->k_cache + head + (int64_t)table[nxt / bs] * bs * c->c_stride_s : 0;
        score_rows(qv, gq, d, k, ks, n, sc + (pos - kv_lo), len, next, nn);
        pos += n;
    }
    /* softmax over each query's own keys (the sink, when given, joins the max and the sum) */
    float denom[MAX_GROUP];
    for (int64_t j = 0; j < gq; j++) {
        float* sj = sc + j * len;
        const int64_t lj = lens[j];
        if (c->softcap > 0.0f)
            for (int64_t t = 0; t < lj; t++) sj[t] = tanhf(sj[t] / c->softcap) * c->softcap;
        float m = -INFINITY;
        #pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < lj; t++) m = sj[t] > m ? sj[t] : m;
        const float sink = c->sinks != 0 ? c->sinks[kvh * g + j % g] : -INFINITY;
        m = sink > m ? sink : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < lj; t++) {
            sj[t] = exp_nonpositive(sj[t] - m);
            sum += sj[t];
        }
        if (c->sinks != 0) sum += expf(sink - m);
        denom[j] = sum;
    }
    /* pass 2: weighted sum of the value rows, each query over its own range */
    for (int64_t pos = kv_lo; pos < kv_end;) {
        const int64_t off = pos % bs, n = bs - off < kv_end - pos ? bs - off : kv_end - pos;
        const int64_t row = (int64_t)table[pos / bs] * bs + off;
        const float* v = rows_f32(c->v_cache, c->is_bf16, head, row, c->c_stride_s, n, d, rows);
        const int64_t nxt = pos + n, nn = kv_end - nxt < bs ? kv_end - nxt : bs;
        const float* next = nxt < kv_end && !c->is_bf16 ? (const float*)c->v_cache + head + (int64_t)table[nxt / bs] * bs * c->c_stride_s : 0;
        for (int64_t j = 0; j < gq; j++) {
            const int64_t left = lens[j] - (pos - kv_lo);
            lim[j] = left < 0 ? 0 : (left < n ? left : n);
        }
        accumulate_rows(acc, gq, d, v, ks, n, lim, sc + (pos - kv_lo), len, next, nn);
        pos += n;
    }
    for (int64_t j = 0; j < gq; j++) {
        const int64_t o_off = meta[4 * (j / g)] * c->o_stride_t + (kvh * g + j % g) * c->o_stride_h;
        const float inv = denom[j] > 0.0f ? 1.0f / denom[j] : 0.0f;
        if (c->q_bf16) {
            for (int64_t i = 0; i < d; i++) ((uint16_t*)c->out)[o_off + i] = float_to_bf16(acc[j * d + i] * inv);
        } else {
            for (int64_t i = 0; i < d; i++) ((float*)c->out)[o_off + i] = acc[j * d + i] * inv;
        }
    }
}

/* meta: num_seqs x 4 int64 (query row, first key position, end key position, offset of its block table in
 * tables); consecutive rows with the same table and first key position (a decode row and its guesses) form one
 * work item, up to MAX_GROUP / group rows. Returns 0, or -1 when the shapes exceed the kernel's fixed buffers or
 * memory runs out (the caller falls back). */
int rollserve_paged_decode(const void* q, int q_bf16, int64_t q_stride_t, int64_t q_stride_h, const void* k_cache,
                           const void* v_cache, int is_bf16, int64_t c_stride_h, int64_t c_stride_s, void* out,
                           int64_t o_stride_t, int64_t o_stride_h, const int64_t* meta, const int32_t* tables,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                           int64_t block_size, float scale, float softcap, const float* sinks, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || d > MAX_DIM || block_size <= 0 || num_seqs <= 0) return -1;
    for (int64_t s = 0; s < num_seqs; s++)
        if (meta[4 * s + 2] < meta[4 * s + 1]) return -1;
    int64_t* starts = (int64_t*)malloc((size_t)(num_seqs + 1) * sizeof(int64_t));
    if (starts == 0) return -1;
    const int64_t max_rows = MAX_GROUP / group;
    int64_t items = 0, most = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t* m = meta + 4 * s;
        if (items > 0 && s - starts[items - 1] < max_rows && m[3] == m[3 - 4] && m[1] == m[1 - 4]) continue;
        starts[items++] = s;
    }
    starts[items] = num_seqs;
    for (int64_t it = 0; it < items; it++) { /* the score buffer: queries x the item's longest range */
        int64_t end = meta[4 * starts[it] + 1];
        for (int64_t s = starts[it]; s < starts[it + 1]; s++) end = meta[4 * s + 2] > end ? meta[4 * s + 2] : end;
        const int64_t need = group * (starts[it + 1] - starts[it]) * (end - meta[4 * starts[it] + 1]);
        most = need > most ? need : most;
    }
    const Call c = {q, k_cache, v_cache, out, meta, tables, q_stride_t, q_stride_h, c_stride_h, c_stride_s,
                    o_stride_t, o_stride_h, group, d, block_size, q_bf16, is_bf16, scale, softcap, sinks};
    const int64_t work = items * num_kv_heads;
    const size_t floats = (size_t)(most + (is_bf16 ? block_size * d : 0) + 16);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && work > 1)
    {
        float* buf = (float*)malloc(floats * sizeof(float));
        if (buf == 0) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < work; w++) {
            const int64_t it = w / num_kv_heads;
            if (buf != 0)
                attend_one(&c, meta + 4 * starts[it], starts[it + 1] - starts[it], w % num_kv_heads, buf, buf + most);
        }
        free(buf);
    }
    free(starts);
    return failed ? -1 : 0;
}

/* Write a step's new keys and values into their pool slots: key/value [T, Hkv, D] with any token and head
 * strides (D contiguous), pools [Hkv, S, D] with D contiguous; token t goes to slot slots[t] of every head.
 * One memcpy of a D-element row per (token, head), spread over OpenMP threads when there are many; what
 * torch's index_copy_ does element by element. elem_bytes: 4 (fp32) or 2 (bf16), the same in source and pool.
 * Returns 0, or -1 for a slot outside the pool (nothing is written then). */
int rollserve_write_kv(const void* key, int64_t k_stride_t, int64_t k_stride_h, const void* value,
                       int64_t v_stride_t, int64_t v_stride_h, void* k_cache, void* v_cache, int64_t c_stride_h,
                       int64_t c_stride_s, int64_t num_slots, const int64_t* slots, int64_t num_tokens,
                       int64_t num_kv_heads, int64_t d, int64_t elem_bytes, int num_threads) {
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    }
    const int64_t work = num_tokens * num_kv_heads;
    const size_t row = (size_t)(d * elem_bytes);
    char* kc = (char*)k_cache;
    char* vc = (char*)v_cache;
    const char* ks = (const char*)key;
    const char* vs = (const char*)value;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && work >= 256) schedule(static)
    for (int64_t w = 0; w < work; w++) {
        const int64_t t = w / num_kv_heads, h = w % num_kv_heads;
        const int64_t dst = (h * c_stride_h + slots[t] * c_stride_s) * elem_bytes;
        memcpy(kc + dst, ks + (t * k_stride_t + h * k_stride_h) * elem_bytes, row);
        memcpy(vc + dst, vs + (t * v_stride_t + h * v_stride_h) * elem_bytes, row);
    }
    return 0;
}
