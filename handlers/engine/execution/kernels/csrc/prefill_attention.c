/* Causal attention of one sequence's prompt chunk against its keys, blocked so that everything stays in cache.
 *
 * torch's CPU flash attention runs each block's two products through a general GEMM call, with the scores copied
 * and masked around them, per query head: for a small head size (64) the calls and copies cost as much as the
 * arithmetic. Here one work item is a (KV head, tile of query rows) pair: the g query heads that share the KV head
 * are processed together (GQA), so every key and value tile is loaded and packed once for all of them. Per key
 * tile: scores = Q K^T through a register-blocked micro-kernel (R query rows x 4 vectors of keys), the online
 * softmax (running max and sum, fp32, max-subtracted), then O += P V through a second micro-kernel (R rows x 4
 * vectors of the head size); O is divided by the sum at the end. Tiles wholly above the causal diagonal, or
 * before a sliding window, are never visited; the one that crosses the diagonal is masked per row.
 *
 * Vectors are vec_math.h's VW floats: one AVX-512 register (VW 16, R 6: 24 accumulators of 32 registers), else
 * two AVX2 halves (VW 8, R 2). Needs the head size to be a multiple of VW and fp32 tensors; the
 * caller uses SDPA otherwise. Layouts: q [n, H, D] and out [n, H, D] with any row/head strides, k and v [Hkv, L, D]
 * with any head/row strides, D contiguous. Built at first use by handlers/engine/execution/kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#if defined(__AVX512F__)
#define R 6
#else
#define R 2
#endif
#define BK (4 * VW)   /* keys per tile */
#define ROWS_PER_ITEM 48 /* query vectors (rows x heads of a group) per work item */
#define MAX_DIM 512
#define PACK_BYTES (16 << 20) /* transposed keys packed at once, at most (unless one head needs more) */

typedef struct {
    const float *q, *k, *v;
    float* out;
    int64_t q_st, q_sh, k_sh, k_ss, v_sh, v_ss, o_st, o_sh;
    int64_t n, kv_len, q_rel0, window, group, d, tile;
    float scale;
} Call;

/* S[j][0..BK) = sum_i Q[j][i] * KT[i][0..BK) for rows j of [0, rows), rows a multiple of R. */
static void scores(const float* restrict Q, int64_t rows, int64_t d, const float* restrict KT, float* restrict S) {
    for (int64_t j0 = 0; j0 < rows; j0 += R) {
        vf acc[R][4];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = splat(0.0f);
        for (int64_t i = 0; i < d; i++) {
            const float* kt = KT + i * BK;
            const vf k0 = load(kt), k1 = load(kt + VW), k2 = load(kt + 2 * VW), k3 = load(kt + 3 * VW);
            for (int r = 0; r < R; r++) {
                const vf b = splat(Q[(j0 + r) * d + i]);
                acc[r][0] += b * k0;
                acc[r][1] += b * k1;
                acc[r][2] += b * k2;
                acc[r][3] += b * k3;
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < 4; c++) store(S + (j0 + r) * BK + c * VW, acc[r][c]);
    }
}

/* O[j] = O[j] * alpha[j] + sum_{t < nk} P[j][t] * V[t] for rows j of [0, rows), rows a multiple of R. */
static void accumulate(float* restrict O, int64_t rows, int64_t d, const float* restrict alpha,
                       const float* restrict P, const float* restrict V, int64_t vs, int64_t nk) {
    for (int64_t j0 = 0; j0 < rows; j0 += R) {
        int64_t c0 = 0;
        for (; c0 + 4 * VW <= d; c0 += 4 * VW) {
            vf acc[R][4];
            for (int r = 0; r < R; r++) {
                const vf a = splat(alpha[j0 + r]);
                for (int c = 0; c < 4; c++) acc[r][c] = load(O + (j0 + r) * d + c0 + c * VW) * a;
            }
            for (int64_t t = 0; t < nk; t++) {
                const float* vr = V + t * vs + c0;
                const vf v0 = load(vr), v1 = load(vr + VW), v2 = load(vr + 2 * VW), v3 = load(vr + 3 * VW);
                for (int r = 0; r < R; r++) {
                    const vf b = splat(P[(j0 + r) * BK + t]);
                    acc[r][0] += b * v0;
                    acc[r][1] += b * v1;
                    acc[r][2] += b * v2;
                    acc[r][3] += b * v3;
                }
            }
            for (int r = 0; r < R; r++)
                for (int c = 0; c < 4; c++) store(O + (j0 + r) * d + c0 + c * VW, acc[r][c]);
        }
        for (; c0 < d; c0 += VW) { /* a head size that is not a multiple of 4 vectors: the rest one at a time */
            vf acc[R];
            for (int r = 0; r < R; r++) acc[r] = load(O + (j0 + r) * d + c0) * splat(alpha[j0 + r]);
            for (int64_t t = 0; t < nk; t++) {
                const vf v0 = load(V + t * vs + c0);
                for (int r = 0; r < R; r++) acc[r] += splat(P[(j0 + r) * BK + t]) * v0;
            }
            for (int r = 0; r < R; r++) store(O + (j0 + r) * d + c0, acc[r]);
        }
    }
}

/* Query row i (of the chunk) sees the keys [first(i), i + q_rel0]: its own position and the ones before it, back to
 * the window's start. */
static inline int64_t first_key(const Call* c, int64_t i) {
    const int64_t lo = c->window > 0 ? i + c->q_rel0 - c->window + 1 : 0;
    return lo > 0 ? lo : 0;
}

/* Key tile `tile` of KV head kvh, transposed into KT (d x BK); keys past the end are zero. */
static void pack_keys(const Call* c, int64_t kvh, int64_t tile, float* restrict KT) {
    const float* K = c->k + kvh * c->k_sh;
    const int64_t d = c->d, kt = tile * BK, nk = c->kv_len - kt < BK ? c->kv_len - kt : BK;
    for (int64_t t0 = 0; t0 < BK; t0 += 8) { /* eight keys at a time: eight streams read, one row written */
        for (int64_t i = 0; i < d; i++)
            for (int64_t t = t0; t < t0 + 8; t++) KT[i * BK + t] = t < nk ? K[(kt + t) * c->k_ss + i] : 0.0f;
    }
}

/* Work item: KV head kvh, query rows [i0, i1). Query vector j is row i0 + j % nq of head kvh * g + j / nq. KT: the
 * head's packed key tiles from tile t_lo on. */
static void attend_tile(const Call* c, int64_t kvh, int64_t i0, int64_t i1, const float* KT, int64_t t_lo,
                        float* buf) {
    const int64_t d = c->d, g = c->group, nq = i1 - i0, rows = (g * nq + R - 1) / R * R;
    float* Q = buf;                   /* rows x d, scaled */
    float* O = Q + rows * d;          /* rows x d */
    float* S = O + rows * d;          /* rows x BK: scores, then probabilities */
    float* l = S + rows * BK;         /* rows x VW: running sums, lane by lane */
    float* m = l + rows * VW;         /* rows: running max */
    float* alpha = m + rows;          /* rows: this tile's rescale of O */
    for (int64_t j = 0; j < rows; j++) {
        const int real = j < g * nq;
        const float* qr = real ? c->q + (i0 + j % nq) * c->q_st + (kvh * g + j / nq) * c->q_sh : 0;
        for (int64_t i = 0; i < d; i++) {
            Q[j * d + i] = real ? qr[i] * c->scale : 0.0f;
            O[j * d + i] = 0.0f;
        }
        store(l + j * VW, splat(0.0f));
        m[j] = -INFINITY;
    }
    const float* V = c->v + kvh * c->v_sh;
    vi iota;
    for (int i = 0; i < VW; i++) iota[i] = i;
    const int64_t k_hi = i1 - 1 + c->q_rel0 + 1; /* keys any row of the tile sees: up to its last row's position */
    for (int64_t kt = first_key(c, i0) / BK * BK; kt < k_hi; kt += BK) {
        const int64_t nk = k_hi - kt < BK ? k_hi - kt : BK;
        scores(Q, rows, d, KT + (kt / BK - t_lo) * d * BK, S);
        for (int64_t j = 0; j < rows; j++) {
            float* s = S + j * BK;
            int64_t lo = 0, hi = 0; /* this row's visible keys of the tile: [lo, hi) */
            if (j < g * nq) {
                const int64_t i = i0 + j % nq, f = first_key(c, i) - kt, e = i + c->q_rel0 + 1 - kt;
                lo = f > 0 ? f : 0;
                hi = e < nk ? e : nk;
            }
            if (hi <= lo) { /* nothing visible here: the row is unchanged */
                memset(s, 0, BK * sizeof(float));
                alpha[j] = 1.0f;
                continue;
            }
            vf x[4], top = splat(-INFINITY);
            for (int u = 0; u < 4; u++) { /* keys outside [lo, hi) become -inf */
                x[u] = load(s + u * VW);
                if (lo > 0 || hi < BK) {
                    const vi t = iota + u * VW;
                    x[u] = pick((t >= (int32_t)lo) & (t < (int32_t)hi), x[u], splat(-INFINITY));
                }
                top = pick(x[u] > top, x[u], top);
            }
            float mx = m[j];
            for (int i = 0; i < VW; i++) mx = top[i] > mx ? top[i] : mx;
            const float a = m[j] == -INFINITY ? 0.0f : exp_nonpositive(m[j] - mx); /* O and l are 0 until then */
            vf sum = load(l + j * VW) * a;
            for (int u = 0; u < 4; u++) {
                const vf p = exp_lanes_or_zero(x[u] - mx);
                store(s + u * VW, p);
                sum += p;
            }
            store(l + j * VW, sum);
            m[j] = mx;
            alpha[j] = a;
        }
        accumulate(O, rows, d, alpha, S, V + kt * c->v_ss, c->v_ss, nk);
    }
    for (int64_t j = 0; j < g * nq; j++) {
        float* o = c->out + (i0 + j % nq) * c->o_st + (kvh * g + j / nq) * c->o_sh;
        float total = 0.0f;
        for (int i = 0; i < VW; i++) total += l[j * VW + i];
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t i = 0; i < d; i++) o[i] = O[j * d + i] * inv;
    }
}

/* Attention of n query rows (at key positions q_rel0 .. q_rel0 + n - 1 of the kv_len keys: a chunk after q_rel0
 * cached tokens) with a causal mask and an optional sliding window (0: none). The keys are packed once per call,
 * for as many KV heads at a time as PACK_BYTES holds, then every (head, query tile) item of those heads runs.
 * Returns 0, or -1 when the shapes are beyond the kernel or memory runs out (the caller then uses SDPA, which
 * writes every row). */
int rollserve_prefill_attention(const float* q, int64_t q_st, int64_t q_sh, const float* k, int64_t k_sh,
                                int64_t k_ss, const float* v, int64_t v_sh, int64_t v_ss, float* out, int64_t o_st,
                                int64_t o_sh, int64_t n, int64_t kv_len, int64_t window, int64_t num_heads,
                                int64_t num_kv_heads, int64_t d, float scale, int num_threads) {
    if (n <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || d % VW != 0 || d > MAX_DIM || kv_len < n)
        return -1;
    const int64_t group = num_heads / num_kv_heads;
    int64_t tile = ROWS_PER_ITEM / group;
    tile = tile < 1 ? 1 : tile;
    const Call c = {q, k, v, out, q_st, q_sh, k_sh, k_ss, v_sh, v_ss, o_st, o_sh, n, kv_len, kv_len - n, window,
                    group, d, tile, scale};
    const int64_t tiles = (n + tile - 1) / tile;
    const int64_t t_lo = first_key(&c, 0) / BK, key_tiles = (kv_len + BK - 1) / BK - t_lo;
    const int64_t per_head = key_tiles * d * BK;
    int64_t heads = (int64_t)(PACK_BYTES / sizeof(float)) / per_head;
    heads = heads < 1 ? 1 : (heads > num_kv_heads ? num_kv_heads : heads);
    float* KT = (float*)malloc((size_t)(heads * per_head) * sizeof(float));
    if (KT == 0) return -1;
    const int64_t rows = (group * tile + R - 1) / R * R;
    const size_t floats = (size_t)(2 * rows * d + rows * BK + rows * VW + 2 * rows + 16);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && tiles * num_kv_heads > 1)
    {
        float* buf = (float*)malloc(floats * sizeof(float));
        if (buf == 0) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t h0 = 0; h0 < num_kv_heads; h0 += heads) {
            const int64_t hn = num_kv_heads - h0 < heads ? num_kv_heads - h0 : heads;
#pragma omp for schedule(static)
            for (int64_t w = 0; w < hn * key_tiles; w++)
                pack_keys(&c, h0 + w / key_tiles, t_lo + w % key_tiles, KT + w * d * BK);
            /* the last tiles see the most keys: they go first, so the threads finish together */
#pragma omp for schedule(dynamic, 1)
            for (int64_t w = 0; w < hn * tiles; w++) {
                const int64_t t = tiles - 1 - w / hn, i0 = t * tile, i1 = i0 + tile < n ? i0 + tile : n;
                if (buf != 0) attend_tile(&c, h0 + w % hn, i0, i1, KT + (w % hn) * per_head, t_lo, buf);
            }
        }
        free(buf);
    }
    free(KT);
    return failed ? -1 : 0;
}
