/* The element-wise steps of a Llama-structured layer, fused: RMSNorm (with the residual add before it) and the
 * gated MLP's silu(gate) * up.
 *
 * torch runs transformers' RMSNorm on the CPU as six passes over the tensor (pow, mean, add, rsqrt, two multiplies),
 * the residual add as a seventh, and the MLP's activation and product as two more with a temporary each: passes
 * over memory in a prefill, operator calls in a decode step (benchmarks/README.md has what they cost). Here each is
 * one pass per row, rows spread over OpenMP threads when there are many.
 * The arithmetic is fp32 and in transformers' order (the residual sum as torch adds it, x * rsqrt(mean(x^2) + eps)
 * then times the weight); the sum of squares and exp are our own, so the results differ from torch's in the last
 * bits (handlers/engine/execution/lean.py checks the whole forward against the exact one at load). Built at first
 * use by handlers/engine/execution/kernels.py.
 */
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

#define PARALLEL_FROM 32768 /* elements: below this a second thread costs more than it saves */

static inline void norm_row(const float* restrict x, int64_t cols, const float* restrict w, float eps,
                            float* restrict out) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < cols; i++) sum += x[i] * x[i];
    const float r = 1.0f / sqrtf(sum / (float)cols + eps);
#pragma omp simd
    for (int64_t i = 0; i < cols; i++) out[i] = w[i] * (x[i] * r);
}

/* out[r] = rmsnorm(x[r]) * w for rows of cols floats (row strides xs, os). */
void rollserve_rms_norm(const float* x, int64_t xs, int64_t rows, int64_t cols, const float* w, float eps,
                        float* out, int64_t os, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * cols >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * xs, cols, w, eps, out + r * os);
}

/* residual[r] += a[r], then out[r] = rmsnorm(residual[r]) * w: the layer's residual add and the next norm. */
void rollserve_add_rms_norm(const float* a, int64_t as, float* residual, int64_t rs, int64_t rows, int64_t cols,
                            const float* w, float eps, float* out, int64_t os, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * cols >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        float* restrict x = residual + r * rs;
        const float* restrict ar = a + r * as;
#pragma omp simd
        for (int64_t i = 0; i < cols; i++) x[i] = x[i] + ar[i];
        norm_row(x, cols, w, eps, out + r * os);
    }
}

/* out[r] = silu(gate[r]) * up[r], silu(g) = g / (1 + exp(-g)). */
void rollserve_silu_mul(const float* gate, int64_t gs, const float* up, int64_t us, int64_t rows, int64_t cols,
                        float* out, int64_t os, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * cols >= PARALLEL_FROM)
    for (int64_t r = 0; r < rows; r++) {
        const float* restrict g = gate + r * gs;
        const float* restrict u = up + r * us;
        float* restrict o = out + r * os;
        int64_t i = 0;
        for (; i + VW <= cols; i += VW) {
            const vf x = load(g + i);
            store(o + i, x / (1.0f + exp_lanes_clamped(-x)) * load(u + i));
        }
        for (; i < cols; i++) o[i] = g[i] / (1.0f + exp_clamped(-g[i])) * u[i];
    }
}
