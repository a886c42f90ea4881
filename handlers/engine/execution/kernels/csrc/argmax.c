/* Greedy choice for a step's rows of logits: the first index of each row's largest value, a NaN counting as the
 * largest (torch.argmax's rule), so the tokens are the same as torch's.
 *
 * torch.argmax on one CPU thread takes several times as long as the row's maximum alone (it tracks the index
 * element by element), milliseconds for a 32-row step of a 49k vocabulary. Here the maximum (and whether there is
 * a NaN) is a vectorized reduction, then a vectorized search for its first position, a chunk at a time: bound by
 * reading the row twice (benchmarks/README.md has the figures). Rows are spread over OpenMP threads. Built at first use by handlers/engine/execution/kernels.py.
 */
#include <math.h>
#include <stdint.h>

#define CHUNK 256

static int64_t first_of_row(const float* restrict p, int64_t cols) {
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < cols; i++) {
        m = p[i] > m ? p[i] : m;
        nan |= p[i] != p[i];
    }
    for (int64_t c = 0; c < cols; c += CHUNK) {
        const int64_t end = c + CHUNK < cols ? c + CHUNK : cols;
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = c; i < end; i++) hit |= nan ? p[i] != p[i] : p[i] == m;
        if (hit)
            for (int64_t i = c; i < end; i++)
                if (nan ? p[i] != p[i] : p[i] == m) return i;
    }
    return 0; /* not reached for cols > 0: the maximum is one of the row's values */
}

/* x: rows x cols fp32, row i at x + i * row_stride, columns contiguous; out: rows int64. */
void rollserve_argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out,
                           int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows > 1) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = first_of_row(x + r * row_stride, cols);
}
