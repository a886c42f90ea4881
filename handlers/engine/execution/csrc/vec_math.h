/* Arithmetic shared by the attention kernels (included by paged_attention.c and prefill_attention.c). */
#ifndef ROLLSERVE_VEC_MATH_H
#define ROLLSERVE_VEC_MATH_H
#include <math.h>
#include <stdint.h>
#include <string.h>

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

#endif
