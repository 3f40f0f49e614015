/*
 * kvgrid quantized linear: y = x W^T for W packed as int8 per output channel or as ggml's
 * q8_0 / q4_0 / q4_1 blocks of 32 (formats: services/worker/quant/formats.py).
 *
 * As ggml does: each row of x is quantized once per call to int8 blocks of 32 with one float
 * scale per block (d = max |x| / 127), then every (weight row, x row) pair takes integer dot
 * products per block, scaled by the two blocks' scales and summed in float32. q4_1's offset m
 * adds m * d_x * sum(q_x) per block; q4_0's -8 adds -8 d * d_x * sum(q_x).
 *
 * Work is split across threads by groups of ROWS weight rows: a group is unpacked once into
 * int8 (nibbles to bytes) in a per-thread buffer and then used by every x row, so steps of many
 * rows read and unpack each weight byte once. Groups are handed out dynamically, so a thread that
 * loses its core to another process delays only the group it holds.
 *
 * Built without -mavx2: the AVX2 dot product is compiled for that target only and chosen at run
 * time when the CPU has AVX2 (kvq_use_avx2 forces the portable scalar one, for tests).
 * dtype codes of x and y: scalar.h. Format codes: 0 int8, 1 q8_0, 2 q4_0, 3 q4_1.
 */
#include <math.h>
#include <stdlib.h>

#include "scalar.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

enum { INT8 = 0, Q8_0 = 1, Q4_0 = 2, Q4_1 = 3 };
#define QB 32  /* values per block */
#define ROWS 4 /* weight rows per task */

static int num_threads = 1;
static int use_avx2 = -1; /* -1: not decided yet */

void kvq_set_num_threads(int n) { num_threads = n > 0 ? n : 1; }

/* Returns whether the AVX2 dot product is in use: on request (want=1) where the CPU has it. */
int kvq_use_avx2(int want) {
#ifdef HAVE_X86
    __builtin_cpu_init();
    use_avx2 = want && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    use_avx2 = 0;
#endif
    return use_avx2;
}

INLINE float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24); /* zero or subnormal */
        return sign ? -f : f;
    }
    uint32_t u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    memcpy(&f, &u, 4);
    return f;
}

static int block_bytes(int fmt) { return fmt == Q8_0 ? 34 : fmt == Q4_0 ? 18 : 20; }

/* ---- the activations: int8 blocks ---------------------------------------------------------- */

typedef struct {
    int8_t *q;    /* [M, nb * QB] */
    float *d;     /* [M, nb] */
    float *ds;    /* [M, nb]: d * (sum of q) per block, for the weights' per-block offsets */
    int64_t nb;
} QRows;

static QRows quantize_rows(const void *x, int M, int64_t K, int dt) {
    QRows r;
    r.nb = (K + QB - 1) / QB;
    r.q = calloc((size_t)M * r.nb * QB, 1);
    r.d = malloc(sizeof(float) * M * r.nb);
    r.ds = malloc(sizeof(float) * M * r.nb);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * r.nb > 512)
    for (int64_t mb = 0; mb < (int64_t)M * r.nb; mb++) {
        const int64_t m = mb / r.nb, b = mb % r.nb, k0 = b * QB, n = K - k0 < QB ? K - k0 : QB;
        float v[QB], amax = 0.0f;
        for (int j = 0; j < n; j++) {
            v[j] = load1(x, m * K + k0 + j, dt);
            amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        }
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < n; j++) {
            float t = nearbyintf(v[j] * inv);
            t = t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t;
            r.q[mb * QB + j] = (int8_t)t;
            sum += (int32_t)t;
        }
        r.d[mb] = d, r.ds[mb] = d * (float)sum;
    }
    return r;
}

/* ---- the weights: one row unpacked to bytes ------------------------------------------------- */

/*
 * Row n of the packed matrix into q (nb * QB bytes, zero past K), per-block scales d and offsets m:
 * a block's weights are d q + m. int8: d = 1 (the channel scale comes at the end), m = 0. q4: q holds
 * the raw nibbles 0..15, so q4_0's -8 d is an offset too.
 */
static void unpack_row(const uint8_t *w, int64_t n, int64_t K, int64_t nb, int fmt, int8_t *q, float *d, float *m) {
    if (fmt == INT8) {
        memcpy(q, w + n * K, K);
        memset(q + K, 0, nb * QB - K);
        for (int64_t b = 0; b < nb; b++) d[b] = 1.0f, m[b] = 0.0f;
        return;
    }
    const int bytes = block_bytes(fmt);
    const uint8_t *row = w + n * nb * bytes;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bytes;
        d[b] = fp16_to_f32(blk);
        m[b] = fmt == Q4_1 ? fp16_to_f32(blk + 2) : fmt == Q4_0 ? -8.0f * d[b] : 0.0f;
        int8_t *out = q + b * QB;
        if (fmt == Q8_0) {
            memcpy(out, blk + 2, QB);
            continue;
        }
        const uint8_t *nib = blk + (fmt == Q4_1 ? 4 : 2);
#ifdef HAVE_X86 /* SSE2, in every x86-64: low halves to bytes 0-15, high halves to 16-31 */
        const __m128i raw = _mm_loadu_si128((const __m128i *)nib), low4 = _mm_set1_epi8(15);
        _mm_storeu_si128((__m128i *)out, _mm_and_si128(raw, low4));
        _mm_storeu_si128((__m128i *)(out + QB / 2), _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
#else
        for (int j = 0; j < QB / 2; j++) out[j] = (int8_t)(nib[j] & 15), out[j + QB / 2] = (int8_t)(nib[j] >> 4);
#endif
    }
}

/* ---- one dot product over all blocks ---------------------------------------------------------- */

/*
 * sum_b wd[b] xd[b] (q_w . q_x)_b + wm[b] xds[b], the weights' q signed (int8, q8_0) or nibbles
 * 0..15 (q4); wm is NULL for formats without offsets.
 */
static float dot_scalar(const int8_t *wq, const float *wd, const float *wm, const int8_t *xq, const float *xd,
                        const float *xds, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t s = 0;
        for (int j = 0; j < QB; j++) s += (int32_t)wq[b * QB + j] * (int32_t)xq[b * QB + j];
        acc += (float)s * (wd[b] * xd[b]);
        if (wm) acc += wm[b] * xds[b];
    }
    return acc;
}

#ifdef HAVE_X86
__attribute__((target("avx2,fma"))) static float dot_avx2(const int8_t *wq, const float *wd, const float *wm,
                                                           const int8_t *xq, const float *xd, const float *xds,
                                                           int64_t nb, int is_unsigned) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    float offsets = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wq + b * QB));
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * QB));
        /* maddubs multiplies unsigned by signed bytes: nibbles go in as they are; signed weights
           lend their sign to x (|w| * sign(w) x = w x). No pair overflows int16 (2 * 127 * 127). */
        const __m256i p16 = is_unsigned ? _mm256_maddubs_epi16(w, x)
                                        : _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
        const __m256i p32 = _mm256_madd_epi16(p16, ones);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(wd[b] * xd[b]), acc);
        if (wm) offsets += wm[b] * xds[b];
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s) + offsets;
}
#else
static float dot_avx2(const int8_t *wq, const float *wd, const float *wm, const int8_t *xq, const float *xd,
                      const float *xds, int64_t nb, int u) {
    (void)u;
    return dot_scalar(wq, wd, wm, xq, xd, xds, nb);
}
#endif

/*
 * y[m, n] = sum_k x[m, k] W[n, k] + bias[n] for m < M; x: [M, K] of dtype dt, W: [N, K] packed
 * in fmt (int8 with scales [N] float32), bias: [N] of dtype dt or NULL, y: rows of stride ldy.
 * accumulate: y[m, n] += (that value rounded to dt), as torch's residual add of a linear's output.
 */
void kvq_linear(const void *x, const void *w, const float *scales, const void *bias, void *y, int64_t ldy, int M,
                int64_t N, int64_t K, int fmt, int dt, int accumulate) {
    if (use_avx2 < 0) kvq_use_avx2(1);
    const int avx2 = use_avx2, is_unsigned = fmt == Q4_0 || fmt == Q4_1;
    QRows xr = quantize_rows(x, M, K, dt);
    const int64_t nb = xr.nb, groups = (N + ROWS - 1) / ROWS;
#pragma omp parallel num_threads(num_threads)
    {
        int8_t *wq = malloc((size_t)ROWS * nb * QB);
        float *wd = malloc(sizeof(float) * ROWS * nb), *wm = malloc(sizeof(float) * ROWS * nb);
#pragma omp for schedule(dynamic, 4)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * ROWS;
            const int rows = N - n0 < ROWS ? (int)(N - n0) : ROWS;
            for (int r = 0; r < rows; r++)
                unpack_row(w, n0 + r, K, nb, fmt, wq + r * nb * QB, wd + r * nb, wm + r * nb);
            for (int m = 0; m < M; m++) {
                const int8_t *xq = xr.q + (int64_t)m * nb * QB;
                const float *xd = xr.d + (int64_t)m * nb;
                const float *xds = xr.ds + (int64_t)m * nb;
                for (int r = 0; r < rows; r++) {
                    const int8_t *q = wq + r * nb * QB;
                    const float *d = wd + r * nb, *mm = is_unsigned ? wm + r * nb : NULL;
                    float v = avx2 ? dot_avx2(q, d, mm, xq, xd, xds, nb, is_unsigned)
                                   : dot_scalar(q, d, mm, xq, xd, xds, nb);
                    const int64_t n = n0 + r, at = (int64_t)m * ldy + n;
                    if (fmt == INT8) v *= scales[n];
                    if (bias) v += load1(bias, n, dt);
                    if (accumulate) v = load1(y, at, dt) + round_to(v, dt);
                    store1(y, at, v, dt);
                }
            }
        }
        free(wq), free(wd), free(wm);
    }
    free(xr.q), free(xr.d), free(xr.ds);
}

/* out[i, :] = row index[i] of W as float32 (an embedding lookup, or a whole matrix for a GEMM). */
void kvq_dequantize_rows(const void *w, const float *scales, const int64_t *index, int64_t count, int64_t K, int fmt,
                         float *out) {
    const int64_t nb = (K + QB - 1) / QB;
#pragma omp parallel num_threads(num_threads)
    {
        int8_t *q = malloc((size_t)nb * QB);
        float *d = malloc(sizeof(float) * nb), *m = malloc(sizeof(float) * nb);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {
            const int64_t n = index ? index[i] : i;
            unpack_row(w, n, K, nb, fmt, q, d, m);
            const float scale = fmt == INT8 ? scales[n] : 1.0f;
            for (int64_t k = 0; k < K; k++) out[i * K + k] = (float)q[k] * d[k / QB] * scale + m[k / QB];
        }
        free(q), free(d), free(m);
    }
}
