/* Integer weights into quant_linear.c's layout at load: rows of bytes [N][K] (N a multiple of 16) to blocks of 16
 * output channels, each k-major: 8 bits: out[N/16][K][16]; 4 bits (values 0..15): out[N/16][K][8], byte j holding
 * row j in its low nibble and row j + 8 in its high one.
 *
 * Why C: the same transposition in numpy moves one byte at a time (a 7B file's 3.5 G weights took most of a
 * load); here a tile of 16 rows by 64 columns is copied in (each row's bytes read in order) and
 * written out transposed.
 */
#include <stdint.h>
#include <string.h>

#define KT 64 /* columns per tile: 16 rows of 64 bytes, each read as one cache line */

void rollserve_pack_blocks(const uint8_t *q, int64_t N, int64_t K, int bits, uint8_t *out, int threads) {
    const int64_t blocks = N / 16, width = bits == 8 ? 16 : 8;
#pragma omp parallel for num_threads(threads > 0 ? threads : 1) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rows = q + b * 16 * K;
        uint8_t *dst = out + b * K * width;
        uint8_t tile[16][KT];
        for (int64_t k0 = 0; k0 < K; k0 += KT) {
            const int64_t n = K - k0 < KT ? K - k0 : KT;
            for (int j = 0; j < 16; j++) memcpy(tile[j], rows + j * K + k0, (size_t)n);
            uint8_t *d = dst + k0 * width;
            if (bits == 8) {
                for (int64_t k = 0; k < n; k++)
                    for (int j = 0; j < 16; j++) d[k * 16 + j] = tile[j][k];
            } else {
                for (int64_t k = 0; k < n; k++)
                    for (int j = 0; j < 8; j++) d[k * 8 + j] = (uint8_t)(tile[j][k] | (tile[j + 8][k] << 4));
            }
        }
    }
}
