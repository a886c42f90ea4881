/* Arithmetic shared by the kernels (included by paged_attention.c, prefill_attention.c, elementwise.c). */
#ifndef ROLLSERVE_VEC_MATH_H
#define ROLLSERVE_VEC_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* 2^(x log2 e) = exp(x) split into the nearest integer r of t = x log2 e and a fraction f = t - r in [-1/2, 1/2],
 * 2^f by its degree-6 Taylor polynomial (relative error ~2e-7); the same expression for a float and for a vector
 * (scalars broadcast), so both round alike. 1.5 * 2^23 added and taken away rounds t to the nearest integer. */
#define ROUNDED(t) (((t) + 12582912.0f) - 12582912.0f)
#define POW2_FRACTION(f) ((((((1.5403530e-4f * (f) + 1.3333558e-3f) * (f) + 9.6181291e-3f) * (f) + 5.5504109e-2f) \
                           * (f) + 2.4022651e-1f) * (f) + 6.9314718e-1f) * (f) + 1.0f)

/* exp(x) for x in [-87, 88], written so that the compiler vectorizes a loop of it. */
static inline float exp_in_range(float x) {
    const float t = x * 1.4426950408889634f;
    const float r = ROUNDED(t);
    float p = POW2_FRACTION(t - r);
    int32_t bits;
    memcpy(&bits, &p, sizeof bits);
    bits += ((int32_t)r) << 23;
    memcpy(&p, &bits, sizeof p);
    return p;
}

/* exp(x) for x <= 0 (softmax arithmetic); below -87 it is exp(-87). */
static inline float exp_nonpositive(float x) { return exp_in_range(x < -87.0f ? -87.0f : x); }

/* exp(x) for any x, within [exp(-87), exp(88)]: finite everywhere. */
static inline float exp_clamped(float x) { return exp_in_range(x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x)); }

/* Vectors of VW floats as GCC vector extensions: one AVX-512 register, else two AVX2 halves. */
#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4))); /* an unaligned load or store */

static inline vf load(const float* p) { return *(const vfu*)p; }
static inline void store(float* p, vf x) { *(vfu*)p = x; }
static inline vf splat(float x) { return x - (vf){0}; } /* x - 0 is x for every x: the subtraction folds away */
static inline vf pick(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); } /* m ? a : b per lane */

/* exp_in_range of every lane, given t = x log2(e). */
static inline vf exp2_lanes(vf t) {
    const vf r = ROUNDED(t);
    const vf p = POW2_FRACTION(t - r);
    return (vf)((vi)p + (__builtin_convertvector(r, vi) << 23));
}

/* exp of every lane for x <= 0, and exactly 0 below -87 (masked scores are -inf). */
static inline vf exp_lanes_or_zero(vf x) {
    const vi gone = x < -87.0f;
    return (vf)((vi)exp2_lanes(pick(gone, splat(-87.0f), x) * 1.4426950408889634f) & ~gone);
}

/* exp of every lane, within [exp(-87), exp(88)]: finite everywhere. */
static inline vf exp_lanes_clamped(vf x) {
    x = pick(x < -87.0f, splat(-87.0f), x);
    x = pick(x > 88.0f, splat(88.0f), x);
    return exp2_lanes(x * 1.4426950408889634f);
}

#endif
