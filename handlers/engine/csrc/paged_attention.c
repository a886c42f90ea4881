/* Paged attention for decode rows, reading K/V where they sit in the pool (no gather, no padding).
 *
 * One call per layer serves every sequence of the step that has exactly one query row. For each
 * (sequence, KV head) the g query heads that share the KV head are processed together, so each key and
 * value row is read once; an online softmax (running max and sum, fp32) walks the keys block by block of
 * the sequence's block table. Optional: logit soft-capping (tanh), a per-head sink logit, and a key range
 * [kv_lo, kv_end) for sliding windows. Layouts: q and out [T, H, D] with any row/head strides; the pool is
 * [Hkv, S, D] (head-major) with D contiguous; fp32 or bf16 pool, query and output (bf16 is converted to fp32
 * on load; all arithmetic is fp32; bf16 output rounds to nearest even).
 *
 * Built at first use by handlers/engine/kernels.py (cc -O3 -march=native -fopenmp) and called through
 * ctypes; plain C with no torch headers, so it compiles in about a second.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 64
#define MAX_DIM 512

static inline float bf16_to_float(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A pointer to the row's fp32 values: in place for an fp32 pool, converted into dst for bf16. */
static inline const float* load_row(const void* base, int is_bf16, int64_t offset, int64_t d, float* dst) {
    if (!is_bf16) return (const float*)base + offset;
    const uint16_t* p = (const uint16_t*)base + offset;
    for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_float(p[i]);
    return dst;
}

static inline uint16_t float_to_bf16(float f) {  /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define KEY_CHUNK 32

/* exp(x) for x <= 0 (softmax arithmetic), written so that the compiler vectorizes a loop of it:
 * 2^(x log2 e) split into integer and fraction, degree-6 polynomial for 2^f (relative error ~2e-7). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.4426950408889634f;
    const float fi = floorf(t);
    const float f = t - fi;
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.0f;
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += ((int32_t)fi) << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

static void attend_one(const void* q, int q_bf16, int64_t q_stride_t, int64_t q_stride_h, const void* k_cache,
                       const void* v_cache, int is_bf16, int64_t c_stride_h, int64_t c_stride_s, void* out,
                       int64_t o_stride_t, int64_t o_stride_h, const int64_t* meta, const int32_t* tables,
                       int64_t kvh, int64_t group, int64_t d, int64_t block_size, float scale, float softcap,
                       const float* sinks) {
    const int64_t q_row = meta[0], kv_lo = meta[1], kv_end = meta[2], table_off = meta[3];
    const int32_t* table = tables + table_off;
    float qv[MAX_GROUP][MAX_DIM];
    float acc[MAX_GROUP][MAX_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float sc[MAX_GROUP][KEY_CHUNK];
    float kbuf[KEY_CHUNK][MAX_DIM], vbuf[KEY_CHUNK][MAX_DIM];
    const float* krows[KEY_CHUNK];
    const float* vrows[KEY_CHUNK];
    for (int64_t j = 0; j < group; j++) {
        const int64_t q_off = q_row * q_stride_t + (kvh * group + j) * q_stride_h;
        for (int64_t i = 0; i < d; i++) {
            const float x = q_bf16 ? bf16_to_float(((const uint16_t*)q)[q_off + i]) : ((const float*)q)[q_off + i];
            qv[j][i] = x * scale;
            acc[j][i] = 0.0f;
        }
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    for (int64_t c0 = kv_lo; c0 < kv_end; c0 += KEY_CHUNK) {
        const int64_t n = kv_end - c0 < KEY_CHUNK ? kv_end - c0 : KEY_CHUNK;
        for (int64_t t = 0; t < n; t++) {
            const int64_t pos = c0 + t;
            const int64_t slot = (int64_t)table[pos / block_size] * block_size + pos % block_size;
            const int64_t off = kvh * c_stride_h + slot * c_stride_s;
            krows[t] = load_row(k_cache, is_bf16, off, d, kbuf[t]);
            vrows[t] = load_row(v_cache, is_bf16, off, d, vbuf[t]);
        }
        for (int64_t j = 0; j < group; j++) {
            const float* restrict qj = qv[j];
            float cmax = m[j];
            for (int64_t t = 0; t < n; t++) {
                const float* restrict kr = krows[t];
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < d; i++) s += qj[i] * kr[i];
                if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
                sc[j][t] = s;
                cmax = s > cmax ? s : cmax;
            }
            const float c = m[j] == -INFINITY ? 0.0f : exp_nonpositive(m[j] - cmax);
            m[j] = cmax;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                sc[j][t] = exp_nonpositive(sc[j][t] - cmax);
                sum += sc[j][t];
            }
            l[j] = l[j] * c + sum;
            float* restrict aj = acc[j];
            if (c != 1.0f) {
#pragma omp simd
                for (int64_t i = 0; i < d; i++) aj[i] *= c;
            }
            for (int64_t t = 0; t < n; t++) {
                const float p = sc[j][t];
                const float* restrict vr = vrows[t];
#pragma omp simd
                for (int64_t i = 0; i < d; i++) aj[i] += p * vr[i];
            }
        }
    }
    for (int64_t j = 0; j < group; j++) {
        float denom = l[j];
        if (sinks != 0) {
            const float sink = sinks[kvh * group + j];
            if (sink > m[j]) {  /* rescale to the larger max before adding the sink's share */
                const float c = expf(m[j] - sink);
                denom = l[j] * c + 1.0f;
                for (int64_t i = 0; i < d; i++) acc[j][i] *= c;
            } else {
                denom = l[j] + expf(sink - m[j]);
            }
        }
        const int64_t o_off = q_row * o_stride_t + (kvh * group + j) * o_stride_h;
        const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
        if (q_bf16) {
            for (int64_t i = 0; i < d; i++) ((uint16_t*)out)[o_off + i] = float_to_bf16(acc[j][i] * inv);
        } else {
            for (int64_t i = 0; i < d; i++) ((float*)out)[o_off + i] = acc[j][i] * inv;
        }
    }
}

/* meta: num_seqs x 4 int64 (query row, first key position, end key position, offset of its block table in
 * tables). Returns 0, or -1 when the shapes exceed the kernel's fixed buffers (the caller falls back). */
int rollserve_paged_decode(const void* q, int q_bf16, int64_t q_stride_t, int64_t q_stride_h, const void* k_cache,
                           const void* v_cache, int is_bf16, int64_t c_stride_h, int64_t c_stride_s, void* out,
                           int64_t o_stride_t, int64_t o_stride_h, const int64_t* meta, const int32_t* tables,
                           int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t d,
                           int64_t block_size, float scale, float softcap, const float* sinks, int num_threads) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return -1;
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || d > MAX_DIM) return -1;
    const int64_t work = num_seqs * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t w = 0; w < work; w++) {
        const int64_t s = w / num_kv_heads, kvh = w % num_kv_heads;
        attend_one(q, q_bf16, q_stride_t, q_stride_h, k_cache, v_cache, is_bf16, c_stride_h, c_stride_s, out, o_stride_t,
                   o_stride_h, meta + 4 * s, tables, kvh, group, d, block_size, scale, softcap, sinks);
    }
    return 0;
}
