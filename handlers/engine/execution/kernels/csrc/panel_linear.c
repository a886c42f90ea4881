/* Skinny fp32 linear layers: y[M, N] = x[M, K] @ W^T + b for the few rows of a decode step.
 *
 * Why: a decode step at a small batch streams every weight from memory once; its cost is the bytes read, as long
 * as the arithmetic keeps up. A general GEMM's packing, blocking and dispatch are built for large M and cost a
 * decode step more than its memory traffic; here the weight is laid out once at load so that the step reads it
 * in one sequential stream, and each weight vector loaded feeds every row of the tile.
 *
 * Layout (packed by handlers/engine/execution/panel_linear.py): output channels in panels of PW = 2 vectors
 * (32 channels with AVX-512, 16 with AVX2), N padded with zero channels, each panel stored k-major:
 * w[p][k][PW] = W[p * PW + j, k]. One k step of a panel is one or two cache lines read in order.
 *
 * A tile is up to MR rows of x times one panel: 2 * MR accumulators in registers, one broadcast of x and two FMAs
 * per row and k step (the outer-product form of a GEMM micro-kernel). More rows run the same panel again per
 * block of MR rows, from the L2 it was just read into. Each output is one chain of FMAs over k in order whatever
 * M, the tile or the thread count, so a row's result does not depend on its batch-mates. OpenMP threads take
 * whole runs of panels.
 *
 * Built at first use by handlers/engine/execution/kernels.py (cc -O3 -march=native -fopenmp).
 */
#include <stdint.h>

#include "vec_math.h"

#define PW (2 * VW) /* output channels per panel */
/* rows of x per tile: 2 * MR accumulators, 2 weight vectors and a broadcast within the vector registers */
#if VW == 16
#define MR 12
#else
#define MR 6
#endif
#define AHEAD 16 /* k steps of prefetch ahead of the loads: the panel's next cache lines, 1-2 KiB on */

static inline __attribute__((always_inline)) void tile(int mr, const float *w, int64_t K, const float *x,
                                                       int64_t ldx, float *y, int64_t ldy, int valid,
                                                       const float *bias) {
    vf acc[MR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * PW;
        /* into every cache level: later tiles of the panel read it again from the L2 (a non-temporal hint
         * sends them back to memory) */
        __builtin_prefetch(wk + AHEAD * PW, 0, 3);
#if VW == 16
        __builtin_prefetch(wk + AHEAD * PW + VW, 0, 3);
#endif
        const vf w0 = load(wk), w1 = load(wk + VW);
        for (int r = 0; r < mr; r++) {
            const vf b = splat(x[r * ldx + k]);
            acc[r][0] += b * w0;
            acc[r][1] += b * w1;
        }
    }
    for (int r = 0; r < mr; r++) {
        float *row = y + r * ldy;
        if (bias) {
            acc[r][0] += load(bias);
            acc[r][1] += load(bias + VW);
        }
        if (valid == PW) {
            store(row, acc[r][0]);
            store(row + VW, acc[r][1]);
        } else {
            float out[PW];
            store(out, acc[r][0]);
            store(out + VW, acc[r][1]);
            for (int j = 0; j < valid; j++) row[j] = out[j];
        }
    }
}

/* Every row of x through the panel at w (rows in tiles of MR, the last one shorter): the first tile streams
 * the panel from memory, the others find it in the L2. */
static void panel(const float *w, int64_t K, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy,
                  int valid, const float *bias) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) tile(MR, w, K, x + m * ldx, ldx, y + m * ldy, ldy, valid, bias);
    const float *xr = x + m * ldx;
    float *yr = y + m * ldy;
#define LAST(r) \
    case r: tile(r, w, K, xr, ldx, yr, ldy, valid, bias); break;
    switch (M - m) { /* each case its own unrolled tile; MR - 1 at most */
        LAST(1) LAST(2) LAST(3) LAST(4) LAST(5)
#if MR > 6
        LAST(6) LAST(7) LAST(8) LAST(9) LAST(10) LAST(11)
#endif
        default: break;
    }
#undef LAST
}

/* The panel width this build packs for (the Python side lays the weight out by it). */
int rollserve_panel_width(void) { return PW; }

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T + bias, W packed as above (ceil(N / PW) panels);
 * bias: NULL or padded to the panels' width. Returns 0, or -1 for arguments it does not take. */
int rollserve_panel_linear(const float *x, int64_t ldx, int64_t M, int64_t K, const float *w, const float *bias,
                           float *y, int64_t ldy, int64_t N, int threads) {
    if (M < 0 || K <= 0 || N <= 0 || ldx < K || ldy < N) return -1;
    if (M == 0) return 0;
    const int64_t panels = (N + PW - 1) / PW;
    const int nthreads = threads > 0 ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * PW;
        const int valid = N - n0 < PW ? (int)(N - n0) : PW;
        panel(w + p * K * PW, K, x, ldx, M, y + n0, ldy, valid, bias ? bias + n0 : 0);
    }
    return 0;
}
