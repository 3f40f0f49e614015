/*
 * The tile GEMM's weights (amx_gemm.h's layout, cpu_kernels/tile_gemm.py) multiplied with AVX512-BF16 dot
 * products, for CPUs with those units and no AMX (AMD Zen 4 and 5): kvg_tile_linear takes the AMX tiles where
 * they are granted and this kernel elsewhere. decode_kernels.c includes this file after its GEMV paths.
 *
 * Why: at tens of rows a bfloat16 product is bound by its multiply-adds on such a CPU, where oneDNN's GEMM on
 * its reordered weights reaches 70-95% of them but each call through torch costs ~20 us, and its products are
 * out of reach of the one-call decode step (decode_layers.h), which then falls back to a Python loop of ~9
 * calls a layer. This kernel writes into the step's own buffers, residual adds included, from C.
 *
 * The layout gives, for each group of 32 columns and each pair of K (p), the 32 columns' two values side by
 * side in 128 bytes (T[p][r][2]): two vectors of 16 pairs, what VDPBF16PS multiplies against one pair of x
 * broadcast to every lane. A block of PAIR_ROWS rows against two groups (64 columns) keeps 24 float32 sums in
 * registers, four weight vectors and one broadcast a row loaded for each pair of K. Each thread takes a run of
 * groups; two groups' weights (K * 128 bytes) stay in L2 while every block of rows passes, the first pass
 * reading them from memory. The next two groups are asked for in L2 meanwhile, spread over the passes.
 *
 * Sums: float32 over K in order, a pair at a time (VDPBF16PS adds the pair's odd product to the lane, then its
 * even one, each exact before a float32 rounding, subnormals flushed); then as the AMX kernel: the bias added,
 * rounded to bfloat16, added to y where accumulating (tile_put). The AMX tiles add 16 pairs a step in an order
 * of their own, so the two differ in the last place now and then, as both do from oneDNN.
 */

#define PAIR_ROWS 6 /* rows a block: 6 x 4 sums, 4 weight vectors, 1 broadcast: 29 of the 32 registers */

/* rows xr (R of them, stride ldx) against G groups (w: the first group's tiles, stride K * 32 elements) over
   K / 2 pairs; sums to c as G blocks of R rows of 32 floats (tile_put's order). next: where `share` lines of
   the next groups start, to ask for in L2 spread evenly over the pairs (none where NULL). */
BF16DOT_FN void pair_block(const int R, const int G, const uint16_t *xr, int64_t ldx, const uint16_t *w, int64_t K,
                           float *c, const char *next, int64_t share) {
    __m512 acc[PAIR_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 2 * G; j++) acc[r][j] = _mm512_setzero_ps();
    const int32_t *x32 = (const int32_t *)xr;
    const int64_t pairs = K / 2, ld32 = ldx / 2;
    for (int64_t p = 0, owed = 0; p < pairs; p++) {
        __m512bh b[4];
        for (int g = 0; g < G; g++) {
            b[2 * g] = (__m512bh)_mm512_loadu_si512((const void *)(w + g * K * 32 + p * 64));
            b[2 * g + 1] = (__m512bh)_mm512_loadu_si512((const void *)(w + g * K * 32 + p * 64 + 32));
        }
        if (next)
            for (owed += share; owed >= pairs; owed -= pairs, next += 64) _mm_prefetch(next, _MM_HINT_T1);
        for (int r = 0; r < R; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(x32[r * ld32 + p]);
            for (int j = 0; j < 2 * G; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) {
            _mm512_storeu_ps(c + (g * R + r) * 32, acc[r][2 * g]);
            _mm512_storeu_ps(c + (g * R + r) * 32 + 16, acc[r][2 * g + 1]);
        }
}

/* y[m, :] (+)= x[m, :] W^T + bias for m < M, as tile_linear_amx; x's rows of an even stride, any M */
__attribute__((target(BF16DOT_TARGET))) static void tile_linear_bf16dot(const uint16_t *x, int64_t ldx,
                                                                        const uint16_t *w, const uint16_t *bias,
                                                                        uint16_t *y, int64_t ldy, int M, int64_t N,
                                                                        int64_t K, int accumulate) {
    const int64_t groups = N / 32, group = K * 32; /* elements of a group's tiles */
    const int passes = (M + PAIR_ROWS - 1) / PAIR_ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        float c[2 * PAIR_ROWS * 32] __attribute__((aligned(64)));
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t g0 = groups * t / n, g1 = groups * (t + 1) / n;
        for (int64_t g = g0; g < g1; g += 2) {
            const int G = g1 - g >= 2 ? 2 : 1;
            const uint16_t *wg = w + g * group;
            /* the next groups' lines (K a group), a share in each pass */
            const int64_t ahead = g + G < g1 ? (g1 - g - G >= 2 ? 2 : 1) * K : 0, share = (ahead + passes - 1) / passes;
            const char *next = ahead ? (const char *)(wg + G * group) : NULL;
            for (int m = 0; m < M; m += PAIR_ROWS) {
                const int R = M - m < PAIR_ROWS ? M - m : PAIR_ROWS;
                const uint16_t *xm = x + (int64_t)m * ldx;
                switch (G * 8 + R) {
#define BLOCK(G_, R_)                                                   \
    case G_ * 8 + R_:                                                   \
        pair_block(R_, G_, xm, ldx, wg, K, c, next, share); \
        break;
                    BLOCK(1, 1) BLOCK(1, 2) BLOCK(1, 3) BLOCK(1, 4) BLOCK(1, 5) BLOCK(1, 6)
                    BLOCK(2, 1) BLOCK(2, 2) BLOCK(2, 3) BLOCK(2, 4) BLOCK(2, 5) BLOCK(2, 6)
#undef BLOCK
                }
                if (next) next += share * 64; /* what this pass asked for */
                for (int h = 0; h < G; h++)
                    tile_put(c + h * R * 32, R, y + (int64_t)m * ldy + (g + h) * 32, ldy,
                             bias ? bias + (g + h) * 32 : NULL, accumulate);
            }
        }
    }
}

enum { TILES_NONE = 0, TILES_AMX = 1, TILES_BF16DOT = 2 };
static int tile_path = -1; /* -1: not decided yet */

/* Which kernel the tile GEMM takes: want (TILES_AMX or TILES_BF16DOT) where this CPU runs it, else the best it
   runs (AMX where granted); returns the one taken (tests run both where both run). */
int kvg_select_tile_path(int want) {
    if (want == TILES_AMX && amx_granted()) return tile_path = TILES_AMX;
    if (want == TILES_BF16DOT && has_bf16_dot()) return tile_path = TILES_BF16DOT;
    return tile_path = amx_granted() ? TILES_AMX : has_bf16_dot() ? TILES_BF16DOT : TILES_NONE;
}

/* the tile GEMM's kernel here: TILES_AMX, TILES_BF16DOT or TILES_NONE (not on this CPU) */
int kvg_tile_path(void) { return tile_path < 0 ? kvg_select_tile_path(TILES_AMX) : tile_path; }

/*
 * y[m, :] (+)= x[m, :] W^T + bias for m < M on the tile layout (amx_gemm.h): AMX tiles where granted, else
 * AVX512-BF16 dot products (kvg_select_tile_path). Returns 0 (nothing written) where neither runs, N or K is not
 * a multiple of 32, or (AMX) the padded copy of the rows cannot be allocated.
 */
int kvg_tile_linear(const void *x, int64_t ldx, const void *w, const void *bias, void *y, int64_t ldy, int M,
                    int64_t N, int64_t K, int accumulate) {
    const int path = kvg_tile_path();
    if (path == TILES_AMX) return tile_linear_amx(x, ldx, w, bias, y, ldy, M, N, K, accumulate);
    if (path != TILES_BF16DOT || N % 32 || K % 32 || M <= 0 || ldx % 2) return 0;
    tile_linear_bf16dot(x, ldx, w, bias, y, ldy, M, N, K, accumulate);
    return 1;
}
