/*
 * ggml's K-quant super-blocks (q4_k, q5_k, q6_k: 256 values along K; byte layouts in
 * services/worker/quant/kquants.py) for quant_kernels.c, which includes this file after its own
 * helpers: y = x W^T with W's rows as a GGUF stores them (no tiling: a row's super-blocks are read in
 * order), and rows dequantized to float32.
 *
 * x arrives as quant_kernels.c quantizes it for every format: int8 blocks of 32 with one scale each.
 * A super-block's scales cover 32 values (q4_k, q5_k: w = d sc q - dmin m) or 16 (q6_k: w = d sc (q - 32)),
 * so each block of x meets one or two weight scales, and the integer dot products run per 16 or 32 values.
 * AVX2 and AVX-512 VNNI loops (kquant_dot.h, compiled once per instruction set), chosen at run time as the
 * other formats' are; the scalar path decodes a super-block into plain arrays.
 */

#define QK 256 /* values per super-block */

INLINE int64_t k_block_bytes(int fmt) { return fmt == Q4_K ? 144 : fmt == Q5_K ? 176 : 210; }

/* q4_k / q5_k's 6-bit scale and min of sub-block j from their 12 packed bytes (ggml's get_scale_min_k4). */
INLINE void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/*
 * A super-block decoded: w = scale (q - zero) + offset per block of 32 values, zero 32 for q6_k, else 0
 * (q6_k's offsets are 0). q holds the values as stored, unsigned (the SIMD dot products take unsigned
 * weight bytes); scale holds each block's two group scales as one AVX vector reads them: the first group
 * of 16's in lanes 0-3, the second's in lanes 4-7 (q4_k and q5_k: one scale, twice).
 */
typedef struct {
    uint8_t q[QK];
    float scale[QK / QB][8];
    float offset[QK / QB];
} KBlock;

INLINE int k_zero(int fmt) { return fmt == Q6_K ? 32 : 0; }

INLINE void set_block_scales(KBlock *b, int blk, float s0, float s1) {
    for (int l = 0; l < 4; l++) b->scale[blk][l] = s0, b->scale[blk][4 + l] = s1;
}

static void decode_k(const uint8_t *p, int fmt, KBlock *b) {
    if (fmt == Q6_K) {
        const float d = fp16_to_f32(p + 208);
        const int8_t *sc = (const int8_t *)(p + 192);
        for (int blk = 0; blk < QK / QB; blk++)
            set_block_scales(b, blk, d * (float)sc[2 * blk], d * (float)sc[2 * blk + 1]);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = p + 64 * half, *qh = p + 128 + 32 * half;
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < QB; l++) {
                    const int low = c < 2 ? ql[32 * (c & 1) + l] & 15 : ql[32 * (c & 1) + l] >> 4;
                    b->q[128 * half + QB * c + l] = (uint8_t)(low | (((qh[l] >> (2 * c)) & 3) << 4));
                }
        }
        memset(b->offset, 0, sizeof b->offset);
        return;
    }
    const float d = fp16_to_f32(p), dmin = fp16_to_f32(p + 2);
    const uint8_t *qs = p + (fmt == Q5_K ? 48 : 16), *qh = p + 16;
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, p + 4, &sc, &m);
        set_block_scales(b, j, d * (float)sc, d * (float)sc);
        b->offset[j] = -(dmin * (float)m);
        for (int l = 0; l < QB; l++) {
            const uint8_t raw = qs[32 * (j / 2) + l];
            int v = j & 1 ? raw >> 4 : raw & 15;
            if (fmt == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
            b->q[QB * j + l] = (uint8_t)v;
        }
    }
}

/* out[0..K) = row w (K / 256 super-blocks) as float32: the same products gguf's dequantization takes. */
static void dequantize_row_k(const uint8_t *w, int64_t K, int fmt, float *out) {
    KBlock b;
    const int zero = k_zero(fmt);
    for (int64_t s = 0; s < K / QK; s++) {
        decode_k(w + s * k_block_bytes(fmt), fmt, &b);
        float *o = out + s * QK;
        for (int k = 0; k < QK; k++) o[k] = b.scale[k / QB][k % QB < 16 ? 0 : 4] * (float)(b.q[k] - zero);
        if (fmt != Q6_K)
            for (int k = 0; k < QK; k++) o[k] += b.offset[k / QB];
    }
}

/* A decoded row (num_super KBlocks) . one x row: exact integer sums per group of 16, then floats. */
static float decoded_dot_scalar(const KBlock *row, int64_t num_super, int zero, const int8_t *xq, const float *xd,
                                const float *xds) {
    float acc = 0.0f;
    for (int64_t s = 0; s < num_super; s++) {
        const KBlock *b = row + s;
        for (int blk = 0; blk < QK / QB; blk++) {
            const int64_t at = s * (QK / QB) + blk;
            const int8_t *x = xq + at * QB;
            const uint8_t *q = b->q + blk * QB;
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < 16; l++)
                s0 += ((int32_t)q[l] - zero) * x[l], s1 += ((int32_t)q[16 + l] - zero) * x[16 + l];
            acc += ((float)s0 * b->scale[blk][0] + (float)s1 * b->scale[blk][4]) * xd[at] + b->offset[blk] * xds[at];
        }
    }
    return acc;
}

#ifdef HAVE_X86
#define KQ_NAME(name) name##_avx2
#define KQ_TARGET AVX2_FNS
#define KQ_TARGET_OUTLINED __attribute__((target("avx2,fma,f16c"))) static
#define DOT32(u, x) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (x)), _mm256_set1_epi16(1))
#define KQ_ROW_DOT_ANY
#include "kquant_dot.h"
#undef KQ_ROW_DOT_ANY
#undef KQ_NAME
#undef KQ_TARGET
#undef KQ_TARGET_OUTLINED
#undef DOT32

#define KQ_NAME(name) name##_vnni
#define KQ_TARGET VNNI_FNS
#define KQ_TARGET_OUTLINED __attribute__((target(VNNI_TARGET))) static
#define DOT32(u, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (x))
#include "kquant_dot.h"
#undef KQ_NAME
#undef KQ_TARGET
#undef KQ_TARGET_OUTLINED
#undef DOT32
#include "kquant_dot512.h"
#endif

/*
 * y = x W^T (+ bias) for W [N, K] in a K-quant format: rows across threads. Groups of KQ_ROWS x rows
 * run over the weight row decoded once into a per-thread buffer (in L1: 4.3 KiB for 2048 values), so
 * decoding is paid once per weight row, not once per product; the rows left over (all of them at
 * batch 1) take the fused loop (row_dot), which decodes as it goes and reads the row once.
 */
static void linear_k(const QRows *xr, const uint8_t *w, const void *bias, void *y, int64_t ldy, int M, int64_t N,
                     int64_t K, int fmt, int dt, int accumulate) {
    const int64_t num_super = K / QK, row_bytes = num_super * k_block_bytes(fmt), nb = xr->nb;
    const int64_t chunk = chunk_of((N + TILE - 1) / TILE) * TILE;
    const size_t decoded_bytes = ((size_t)num_super * sizeof(KBlock) + 63) / 64 * 64;
#pragma omp parallel num_threads(num_threads)
    {
        KBlock *decoded = aligned_alloc(64, decoded_bytes);
#pragma omp for schedule(dynamic, chunk)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *row = w + n * row_bytes;
            int m = 0;
#ifdef HAVE_X86
            if (path > PATH_SCALAR) {
                const int vnni = path == PATH_VNNI;
                if (M >= KQ_ROWS) (vnni ? decode_row_any_vnni : decode_row_any_avx2)(fmt, row, num_super, decoded);
                for (; m + KQ_ROWS <= M; m += KQ_ROWS) {
                    const int64_t at = (int64_t)m * nb;
                    float v[KQ_ROWS];
                    (vnni ? decoded_dot_any_vnni : decoded_dot_any_avx2)(fmt, decoded, num_super, xr->q + at * QB,
                                                                         xr->d + at, xr->ds + at, nb, v);
                    for (int r = 0; r < KQ_ROWS; r++) put(y, ldy, m + r, n, v[r], fmt, NULL, bias, dt, accumulate);
                }
                if (m < M) prefetch_record(row + PREFETCH_AHEAD, row_bytes); /* streamed: see PREFETCH_AHEAD */
                for (; m < M; m++) {
                    const int64_t at = (int64_t)m * nb;
                    const float v = (vnni ? row_dot_any_512 : row_dot_any_avx2)(fmt, row, num_super, xr->q + at * QB,
                                                                                 xr->d + at, xr->ds + at);
                    put(y, ldy, m, n, v, fmt, NULL, bias, dt, accumulate);
                }
                continue;
            }
#endif
            for (int64_t s = 0; s < num_super; s++) decode_k(row + s * k_block_bytes(fmt), fmt, decoded + s);
            for (; m < M; m++) {
                const int64_t at = (int64_t)m * nb;
                const float v =
                    decoded_dot_scalar(decoded, num_super, k_zero(fmt), xr->q + at * QB, xr->d + at, xr->ds + at);
                put(y, ldy, m, n, v, fmt, NULL, bias, dt, accumulate);
            }
        }
        free(decoded);
    }
}
