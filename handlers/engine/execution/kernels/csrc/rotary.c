/* Rotary position embedding of one projection's output, in one pass: transformers' rotate-half form,
 * out = x * cos + cat(-x2, x1) * sin, per token and head, with the same roundings as torch's five operations
 * (each product rounded, then the sum; built with -ffp-contract=off so that no fused multiply-add changes a bit).
 *
 * torch runs it as a multiply, a negation, a concatenation, a multiply and an add, each a pass over the tensor
 * with a temporary of its size: five passes per query and key tensor and layer, where one suffices. Built at first
 * use by handlers/engine/execution/kernels.py; tokens are spread over OpenMP threads when there are many.
 */
#include <stdint.h>

/* x: [T, H, D] fp32 with any token and head strides, D contiguous; cos/sin: [T, D] contiguous; out: [T, H, D]
 * contiguous. */
void rollserve_rotary(const float* x, int64_t tokens, int64_t heads, int64_t d, int64_t x_stride_t,
                      int64_t x_stride_h, const float* cos, const float* sin, float* out, int num_threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && tokens >= 64) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float* c = cos + t * d;
        const float* s = sin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            const float* restrict xi = x + t * x_stride_t + h * x_stride_h;
            float* restrict o = out + (t * heads + h) * d;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = xi[i] * c[i];
                const float b = -xi[i + half] * s[i];
                o[i] = a + b;
            }
#pragma omp simd
            for (int64_t i = half; i < d; i++) {
                const float a = xi[i] * c[i];
                const float b = xi[i - half] * s[i];
                o[i] = a + b;
            }
        }
    }
}
