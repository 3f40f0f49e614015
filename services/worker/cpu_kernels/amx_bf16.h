/*
 * y = x W^T on AMX-BF16 tiles, float32 sums, for a weight kept a second time as bfloat16 in the tiles'
 * layout (quant/matmul.py: amx_copy): quant_kernels.c includes this file after its own helpers.
 *
 * Why: a batch of decode rows against a large packed matrix (Gemma's 262144-row LM head at 64 rows)
 * is compute-bound on the integer dot products, while AMX multiplies 16x32 by 32x16 bfloat16 per
 * instruction and the product is bound by reading the bfloat16 copy instead. Sums are float32 (only
 * the inputs are rounded to bfloat16: x here, W when the copy was made).
 *
 * The copy's layout, per group of 16 weight rows (n0 .. n0+15) and chunk of 32 along K (c): one 1 KiB
 * tile B[p][r][2] = W[n0 + r][32c + 2p + {0, 1}] for p < 16, r < 16 (tdpbf16ps's pairs of K); groups
 * after each other, each group's K / 32 tiles in order: [ceil(N / 16), K / 32, 16, 16, 2] bfloat16.
 * K must be a multiple of 32; rows past N are zeros.
 *
 * x is rounded to bfloat16 into rows padded with zeros to a multiple of 16 (one A tile a group of 16
 * rows); per weight group up to four C tiles (64 rows of x) accumulate over K, then go out through put().
 * Linux grants a process the AMX state on request (amx_tiles.h), once.
 */

#include "amx_tiles.h"
#if defined(HAVE_X86) && defined(HAVE_AMX)

int kvq_amx_available(void) { return amx_granted(); }

/* One weight group (b: its K / 32 tiles) against groups g0 .. g0+count-1 of x's 16 rows; the sums to c. */
#define AMX_GROUP(g)                                               \
    if (count > g) {                                               \
        _tile_loadd(4, xk + (int64_t)(g0 + g) * 16 * K, 2 * K);    \
        _tile_dpbf16ps(g, 4, 5);                                   \
    }
AMX_TARGET static void amx_group(const uint16_t *b, const uint16_t *xb, int64_t K, int g0, int count,
                                 float c[4][16][16]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K / 32; k++) {
        const uint16_t *xk = xb + 32 * k;
        _tile_loadd(5, b + k * 512, 64);
        AMX_GROUP(0) AMX_GROUP(1) AMX_GROUP(2) AMX_GROUP(3)
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
}
#undef AMX_GROUP

/*
 * y[m, n] (+)= x[m, :] . W[n, :] + bias[n] for m < M, n < N: x [M, K] of dtype dt, wb the bfloat16 copy
 * (layout above), y rows of stride ldy in dt. Returns 0 where AMX is unavailable (nothing written).
 */
int kvq_amx_linear(const void *x, const uint16_t *wb, const void *bias, void *y, int64_t ldy, int M, int64_t N,
                   int64_t K, int dt, int accumulate) {
    if (!kvq_amx_available() || K % 32) return 0;
    const int groups = (M + 15) / 16;
    uint16_t *xb = (uint16_t *)scratch_of((size_t)groups * 16 * K * 2);
    for (int m = 0; m < groups * 16; m++)
        for (int64_t k = 0; k < K; k++) xb[m * K + k] = m < M ? f32_to_bf16(load1(x, (int64_t)m * K + k, dt)) : 0;
    const int64_t num_groups = (N + 15) / 16, tiles = K / 32;
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure();
        float(*c)[16][16] = aligned_alloc(64, 4 * 16 * 16 * sizeof(float));
#pragma omp for schedule(dynamic, 64)
        for (int64_t j = 0; j < num_groups; j++) {
            const uint16_t *b = wb + j * tiles * 512;
            for (int g0 = 0; g0 < groups; g0 += 4) {
                const int count = groups - g0 < 4 ? groups - g0 : 4;
                amx_group(b, xb, K, g0, count, c);
                const int cols = N - j * 16 < 16 ? (int)(N - j * 16) : 16;
                for (int g = 0; g < count; g++)
                    for (int r = 0; r < 16 && (g0 + g) * 16 + r < M; r++) {
                        const int m = (g0 + g) * 16 + r;
                        if (dt == F32 && !bias && !accumulate) { /* the LM head's case: a row's 16 sums as they are */
                            memcpy((float *)y + m * ldy + j * 16, c[g][r], sizeof(float) * cols);
                            continue;
                        }
                        for (int col = 0; col < cols; col++)
                            put(y, ldy, m, j * 16 + col, c[g][r][col], Q4_K, NULL, bias, dt, accumulate);
                    }
            }
        }
        free(c);
        amx_release();
    }
    return 1;
}
#else
int kvq_amx_available(void) { return 0; }
int kvq_amx_linear(const void *x, const uint16_t *wb, const void *bias, void *y, int64_t ldy, int M, int64_t N,
                   int64_t K, int dt, int accumulate) {
    (void)x, (void)wb, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)dt, (void)accumulate;
    return 0;
}
#endif
