/*
 * y = x W^T (+ bias) for bfloat16 x, W, y on AMX-BF16 tiles, W kept once more in the tiles' layout
 * (cpu_kernels/tile_gemm.py): decode_kernels.c includes this file after its helpers.
 *
 * Why: a decode step of tens of rows reads every weight once and multiplies it by each row, so it is
 * bound by reading the weights; oneDNN's GEMM on its reordered weights (onednn_gemm.py) reads them at
 * ~60% of the memory bandwidth at 64 rows, and each call through torch costs ~20 us more (a step makes
 * 120). This kernel streams each thread's columns in order and writes into the step's own buffers.
 * Above a few hundred rows the products are bound by the multiplies and oneDNN's blocking wins.
 *
 * The layout, per group of 32 weight rows (n0 .. n0+31) and chunk of 32 along K (c): 2 KiB,
 * T[p][r][2] = W[n0 + r][32c + 2p + {0, 1}] for p < 16, r < 32 (tdpbf16ps's pairs of K), which is two
 * B tiles side by side (columns 0-15 and 16-31, rows of 128 bytes); groups after each other, each
 * group's K / 32 chunks in order: [N / 32, K / 32, 16, 32, 2]. N and K must be multiples of 32.
 *
 * Sums are float32 over the whole of K in order, 32 at a time (tdpbf16ps), then the bias is added, the
 * sum rounded to bfloat16 (nearest even, as torch), and where accumulating added to y and rounded
 * again (torch's out.add_(product)). oneDNN's products on 16 rows are these bit for bit; on more rows
 * it splits K into blocks and adds their sums, which rounds differently in the last place now and then.
 * CPUs with AVX512-BF16 and no AMX multiply the same layout in tile_gemm_bf16dot.h, whose kvg_tile_linear
 * picks the kernel.
 */

#include "amx_tiles.h"
#include "vector_math.h"

/* rows of a 32-column block of sums (rows of 32 floats) out to y, as the header says (both tile GEMMs) */
__attribute__((target(AVX512_TARGET))) static void tile_put(const float *c, int rows, uint16_t *y, int64_t ldy,
                                                            const uint16_t *bias, int acc) {
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++) {
            __m512 v = _mm512_loadu_ps(c + r * 32 + h * 16);
            if (bias) v = _mm512_add_ps(v, bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)(bias + h * 16))));
            __m256i out = f32x16_to_bf16(v);
            uint16_t *dst = y + r * ldy + h * 16;
            if (acc) {
                const __m512 before = bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)dst));
                out = f32x16_to_bf16(_mm512_add_ps(before, bf16x16_to_f32(out)));
            }
            _mm256_storeu_si256((__m256i *)dst, out);
        }
}

#if defined(HAVE_AMX)

/* groups of 32 columns whose weights stay in L2 while every block of 32 rows passes (8 was ~5% slower at 64 rows) */
#define TILE_SLAB 4
#define TILE_AHEAD 8 /* chunks (2 KiB each) the stream keeps at least ahead of the first pass */

/*
 * A thread's weights stream from memory into L2 ahead of the products, through a cursor that moves on at every
 * chunk multiplied, in whichever pass of 32 rows, by that pass's share of a chunk (2 KiB / the passes), and in
 * the first pass at least to TILE_AHEAD chunks past the chunk in use. So memory is read while the later passes
 * multiply the slab's weights from L2, not only during the first: the first pass then finds part of its slab
 * in L2. Asked for only in the first pass, at TILE_AHEAD chunks ahead, the weights of SmolLM2's 30 layers took
 * 22-25 ms at 64 rows where now 19-22 (2 threads, AMX Xeon; 128 rows 39-42 and 33-34); 16 rows or fewer make
 * one pass and ask for the same lines as before. Without any requests the hardware's prefetcher left memory
 * idle between tile loads: a 64-row decode step of the model runner took 61 ms instead of 46. The requests
 * are spread over the chunk's products rather than sent in one burst.
 */
typedef struct {
    const char *at, *end; /* the next line to ask for; the thread's last weight */
    int64_t share;        /* bytes asked for per chunk multiplied */
} Stream;

/* asks for the lines from at on into L2; returns where the next ask starts */
static inline const char *stream_lines(const char *at, int64_t lines) {
    for (int64_t line = 0; line < lines; line++, at += 64) _mm_prefetch(at, _MM_HINT_T1);
    return at;
}

/*
 * Rows m .. m+15 (m+31 where two) of x against group g's chunks: the sums into c (rows of 32 floats). first:
 * this is the first pass over these weights (they come from memory, the stream is kept ahead of them).
 */
AMX_TARGET static void tile_block(const uint16_t *xm, int64_t ldx, const uint16_t *wg, int64_t chunks, int two,
                                  float *c, Stream *s, int first) {
    const char *at = s->at;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < chunks; k++) {
        const char *until = at + s->share, *ahead = (const char *)(wg + (k + TILE_AHEAD) * 1024);
        if (first && until < ahead) until = ahead;
        if (until > s->end) until = s->end;
        const int64_t lines = until > at ? (until - at) / 64 : 0, quarter = lines / 4, rest = lines - 3 * quarter;
        _tile_loadd(6, wg + k * 1024, 128);
        _tile_loadd(7, wg + k * 1024 + 32, 128);
        _tile_loadd(4, xm + k * 32, ldx * 2);
        at = stream_lines(at, quarter);
        _tile_dpbf16ps(0, 4, 6);
        at = stream_lines(at, quarter);
        _tile_dpbf16ps(1, 4, 7);
        at = stream_lines(at, quarter);
        if (two) {
            _tile_loadd(5, xm + 16 * ldx + k * 32, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
            at = stream_lines(at, rest);
            _tile_dpbf16ps(3, 5, 7);
        } else
            at = stream_lines(at, rest);
    }
    s->at = at;
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    if (two) {
        _tile_stored(2, c + 512, 128);
        _tile_stored(3, c + 528, 128);
    }
}

/*
 * y[m, :] (+)= x[m, :] W^T + bias for m < M: x [M, K] bfloat16 rows of stride ldx, w the tiles (layout above),
 * bias [N] or NULL, y rows of stride ldy. Each thread takes a run of column groups and streams its weights
 * in order, a slab of TILE_SLAB groups at a time against every 32 rows. Rows past a multiple of 16 are
 * multiplied as zeros from a padded copy. Returns 0 (nothing written) where AMX is unavailable, N or K
 * is not a multiple of 32, or the padded copy cannot be allocated. kvg_tile_linear (tile_gemm_bf16dot.h)
 * calls it where AMX is granted.
 */
static int tile_linear_amx(const void *x, int64_t ldx, const void *w, const void *bias, void *y, int64_t ldy, int M,
                    int64_t N, int64_t K, int accumulate) {
    if (!amx_granted() || N % 32 || K % 32 || M <= 0) return 0;
    static __thread uint16_t *padded;
    static __thread size_t padded_size;
    const uint16_t *xs = x;
    const int rows16 = (M + 15) / 16 * 16;
    if (rows16 != M) {
        const size_t size = (size_t)rows16 * K * 2;
        if (size > padded_size) {
            free(padded);
            padded = malloc(size);
            if (!padded) return padded_size = 0, 0;
            padded_size = size;
        }
        for (int m = 0; m < M; m++) memcpy(padded + (int64_t)m * K, xs + m * ldx, K * 2);
        memset(padded + (int64_t)M * K, 0, (size_t)(rows16 - M) * K * 2);
        xs = padded, ldx = K;
    }
    const int64_t groups = N / 32, chunks = K / 32;
    const int passes = (rows16 + 31) / 32;
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure(); /* tiles 0-3: C, 2 x 2 blocks of 16 x 16 sums; 4, 5: A, 16 rows of x; 6, 7: B */
        float c[32 * 32] __attribute__((aligned(64)));
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t g0 = groups * t / n, g1 = groups * (t + 1) / n;
        const uint16_t *mine = (const uint16_t *)w + g0 * chunks * 1024;
        Stream s = {(const char *)(mine + TILE_AHEAD * 1024), (const char *)((const uint16_t *)w + g1 * chunks * 1024),
                    (2048 / passes + 63) / 64 * 64};
        for (int64_t s0 = g0; s0 < g1; s0 += TILE_SLAB) {
            const int64_t s1 = s0 + TILE_SLAB < g1 ? s0 + TILE_SLAB : g1;
            for (int m = 0; m < rows16; m += 32) {
                const int two = rows16 - m >= 32, span = two ? 32 : 16, rows = M - m < span ? M - m : span;
                for (int64_t g = s0; g < s1; g++) {
                    tile_block(xs + m * ldx, ldx, (const uint16_t *)w + g * chunks * 1024, chunks, two, c, &s, m == 0);
                    tile_put(c, rows, (uint16_t *)y + m * ldy + g * 32, ldy,
                             bias ? (const uint16_t *)bias + g * 32 : NULL, accumulate);
                }
            }
        }
        amx_release();
    }
    return 1;
}
#else
static int amx_granted(void) { return 0; }
static int tile_linear_amx(const void *x, int64_t ldx, const void *w, const void *bias, void *y, int64_t ldy, int M,
                           int64_t N, int64_t K, int accumulate) {
    (void)x, (void)ldx, (void)w, (void)bias, (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)accumulate;
    return 0;
}
#endif
