/*
 * ggml's K-quant super-blocks (q4_k, q5_k, q6_k: 256 values along K; byte layouts in
 * services/worker/quant/kquants.py) for quant_kernels.c, which includes this file after its own
 * helpers: y = x W^T with W's rows as a GGUF stores them (no tiling: a row's super-blocks are read in
 * order, and one row of 2048 values is at most 1680 bytes, in L1 for every x row of the call), and rows
 * dequantized to float32.
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

/* All 8 scales (bytes 0-7 of out) and mins (bytes 8-15) of the 12 packed bytes, four at a time. */
INLINE void scales_mins_k4(const uint8_t *q, uint32_t out[4]) {
    uint32_t v[3];
    memcpy(v, q, 12);
    const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    out[0] = v[0] & low6;                                      /* sc 0-3 */
    out[1] = (v[2] & low4) | (((v[0] >> 6) & top2) << 4);     /* sc 4-7 */
    out[2] = v[1] & low6;                                      /* m 0-3 */
    out[3] = ((v[2] >> 4) & low4) | (((v[1] >> 6) & top2) << 4); /* m 4-7 */
}

/* A super-block decoded: w[k] = scale[k / 16] * q[k] + offset[k / 32] (q6_k: offsets 0, q signed). */
typedef struct {
    int8_t q[QK];
    float scale[QK / 16];
    float offset[QK / QB];
} KBlock;

static void decode_k(const uint8_t *p, int fmt, KBlock *b) {
    if (fmt == Q6_K) {
        const float d = fp16_to_f32(p + 208);
        for (int g = 0; g < QK / 16; g++) b->scale[g] = d * (float)((const int8_t *)(p + 192))[g];
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = p + 64 * half, *qh = p + 128 + 32 * half;
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < QB; l++) {
                    const int low = c < 2 ? ql[32 * (c & 1) + l] & 15 : ql[32 * (c & 1) + l] >> 4;
                    b->q[128 * half + QB * c + l] = (int8_t)((low | (((qh[l] >> (2 * c)) & 3) << 4)) - 32);
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
        b->scale[2 * j] = b->scale[2 * j + 1] = d * (float)sc;
        b->offset[j] = -(dmin * (float)m);
        for (int l = 0; l < QB; l++) {
            const uint8_t raw = qs[32 * (j / 2) + l];
            int v = j & 1 ? raw >> 4 : raw & 15;
            if (fmt == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
            b->q[QB * j + l] = (int8_t)v;
        }
    }
}

/* out[0..K) = row w (K / 256 super-blocks) as float32: the same products gguf's dequantization takes. */
static void dequantize_row_k(const uint8_t *w, int64_t K, int fmt, float *out) {
    KBlock b;
    for (int64_t s = 0; s < K / QK; s++) {
        decode_k(w + s * k_block_bytes(fmt), fmt, &b);
        float *o = out + s * QK;
        for (int k = 0; k < QK; k++) o[k] = b.scale[k / 16] * (float)b.q[k];
        if (fmt != Q6_K)
            for (int k = 0; k < QK; k++) o[k] += b.offset[k / QB];
    }
}

static float row_dot_k_scalar(const uint8_t *w, int64_t num_super, int fmt, const int8_t *xq, const float *xd,
                              const float *xds) {
    KBlock b;
    float acc = 0.0f;
    for (int64_t s = 0; s < num_super; s++) {
        decode_k(w + s * k_block_bytes(fmt), fmt, &b);
        for (int blk = 0; blk < QK / QB; blk++) {
            const int64_t at = s * (QK / QB) + blk;
            const int8_t *x = xq + at * QB, *q = b.q + blk * QB;
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < 16; l++) s0 += (int32_t)q[l] * x[l], s1 += (int32_t)q[16 + l] * x[16 + l];
            acc += ((float)s0 * b.scale[2 * blk] + (float)s1 * b.scale[2 * blk + 1]) * xd[at] + b.offset[blk] * xds[at];
        }
    }
    return acc;
}

#ifdef HAVE_X86
#define KQ_NAME(name) name##_avx2
#define KQ_TARGET AVX2_FNS
#define KQ_TARGET_OUTLINED __attribute__((target("avx2,fma,f16c"))) static
#define DOT32(u, x) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (x)), _mm256_set1_epi16(1))
#include "kquant_dot.h"
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
#endif

/* y = x W^T (+ bias) for W [N, K] in a K-quant format: rows across threads, each row against every x row. */
static void linear_k(const QRows *xr, const uint8_t *w, const void *bias, void *y, int64_t ldy, int M, int64_t N,
                     int64_t K, int fmt, int dt, int accumulate) {
    const int64_t num_super = K / QK, row_bytes = num_super * k_block_bytes(fmt), nb = xr->nb;
    const int64_t chunk = chunk_of((N + TILE - 1) / TILE) * TILE;
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int m = 0; m < M; m++) {
            const int64_t at = (int64_t)m * nb;
            const int8_t *xq = xr->q + at * QB;
            float v;
#ifdef HAVE_X86
            if (path == PATH_VNNI)
                v = row_dot_any_vnni(fmt, row, num_super, xq, xr->d + at, xr->ds + at);
            else if (path == PATH_AVX2)
                v = row_dot_any_avx2(fmt, row, num_super, xq, xr->d + at, xr->ds + at);
            else
#endif
                v = row_dot_k_scalar(row, num_super, fmt, xq, xr->d + at, xr->ds + at);
            put(y, ldy, m, n, v, fmt, NULL, bias, dt, accumulate);
        }
    }
}
