/*
 * kvgrid quantized linear: y = x W^T for W packed as int8 per output channel or as ggml's
 * q8_0 / q4_0 / q4_1 blocks of 32, in the tiled layout of services/worker/quant/formats.py:
 * rows in tiles of 8, and per (tile, block of 32 along K) one record holding the 8 rows' fp16
 * scales d (q8_0, q4_*), then their fp16 offsets m (q4_1), then their values 4 bytes at a time,
 * row after row (bytes 0-3 of rows 0..7, then bytes 4-7, ...). q4 bytes hold value j in their
 * low half and j + 16 in their high half, as ggml stores them. int8 records have no scales (one
 * float per channel, applied at the end) and K padded with zeros to whole blocks.
 *
 * As ggml does: each row of x is quantized once per call to int8 blocks of 32 with one float
 * scale per block (d = max |x| / 127); then per block integer dot products, scaled by the two
 * blocks' scales and summed in float32. q4_1's offset m adds m * d_x * sum(q_x) per block; q4_0's
 * -8 adds -8 d * d_x * sum(q_x).
 *
 * AVX2: one 32-byte load holds 4 bytes of each of the tile's 8 rows, multiplied (maddubs) with
 * 4 bytes of x broadcast to every lane, so the eight int32 lanes are the eight rows' sums: no
 * horizontal reductions, one scale multiply per block for eight rows, and the eight outputs are
 * one vector. The portable scalar path (kvq_use_avx2(0) forces it, for tests) unpacks a row to
 * bytes and takes plain loops.
 *
 * Work is split across threads by tiles, handed out dynamically in chunks, so a thread that
 * loses its core to another process delays only the chunk it holds. dtype codes of x and y:
 * scalar.h. Format codes: 0 int8, 1 q8_0, 2 q4_0, 3 q4_1.
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
#define TILE 8 /* rows per tile */

static int num_threads = 1;
static int use_avx2 = -1; /* -1: not decided yet */

void kvq_set_num_threads(int n) { num_threads = n > 0 ? n : 1; }

/* Returns whether the AVX2 kernels are in use: on request (want=1) where the CPU has AVX2, FMA, F16C. */
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

/* Bytes of a record's scales, and of its values (8 rows x 32 bytes, or x 16 of nibbles). */
INLINE int64_t header_bytes(int fmt) { return fmt == INT8 ? 0 : fmt == Q4_1 ? 2 * 2 * TILE : 2 * TILE; }
INLINE int64_t value_bytes(int fmt) { return fmt == Q4_0 || fmt == Q4_1 ? TILE * QB / 2 : TILE * QB; }
INLINE int64_t record_bytes(int fmt) { return header_bytes(fmt) + value_bytes(fmt); }

/* ---- the activations: int8 blocks ---------------------------------------------------------- */

typedef struct {
    int8_t *q;    /* [M, nb * QB], zero past K */
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
 * Row n of the tiled matrix into q (nb * QB bytes), per-block scales d and offsets m: a block's
 * weights are d q + m. int8: d = 1 (the channel scale comes at the end), m = 0. q4: q holds the
 * raw nibbles 0..15, so q4_0's -8 d is an offset too.
 */
static void unpack_row(const uint8_t *w, int64_t n, int64_t nb, int fmt, int8_t *q, float *d, float *m) {
    const int64_t hdr = header_bytes(fmt), chunks = value_bytes(fmt) / (4 * TILE), i = n % TILE;
    const uint8_t *tile = w + (n / TILE) * nb * record_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = tile + b * record_bytes(fmt);
        d[b] = fmt == INT8 ? 1.0f : fp16_to_f32(rec + 2 * i);
        m[b] = fmt == Q4_1 ? fp16_to_f32(rec + 2 * TILE + 2 * i) : fmt == Q4_0 ? -8.0f * d[b] : 0.0f;
        uint8_t raw[QB];
        for (int64_t c = 0; c < chunks; c++) memcpy(raw + 4 * c, rec + hdr + c * 4 * TILE + 4 * i, 4);
        int8_t *out = q + b * QB;
        if (chunks * 4 == QB)
            memcpy(out, raw, QB);
        else
            for (int j = 0; j < QB / 2; j++) out[j] = (int8_t)(raw[j] & 15), out[j + QB / 2] = (int8_t)(raw[j] >> 4);
    }
}

/* y[m, n] from a dot product: the int8 channel scale, bias, then stored or added (rounded as torch). */
INLINE void put(void *y, int64_t ldy, int m, int64_t n, float v, int fmt, const float *scales, const void *bias,
                int dt, int accumulate) {
    const int64_t at = (int64_t)m * ldy + n;
    if (fmt == INT8) v *= scales[n];
    if (bias) v += load1(bias, n, dt);
    if (accumulate) v = load1(y, at, dt) + round_to(v, dt);
    store1(y, at, v, dt);
}

/* Chunks of tiles per hand-out: about eight per thread. */
static int64_t chunk_of(int64_t tiles) {
    const int64_t chunk = tiles / ((int64_t)num_threads * 8);
    return chunk < 1 ? 1 : chunk;
}

/* ---- portable: rows unpacked, plain loops --------------------------------------------------- */

/* sum_b wd[b] xd[b] (q_w . q_x)_b + wm[b] xds[b]. */
static float dot_scalar(const int8_t *wq, const float *wd, const float *wm, const int8_t *xq, const float *xd,
                        const float *xds, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t s = 0;
        for (int j = 0; j < QB; j++) s += (int32_t)wq[b * QB + j] * (int32_t)xq[b * QB + j];
        acc += (float)s * (wd[b] * xd[b]) + wm[b] * xds[b];
    }
    return acc;
}

static void linear_scalar(const QRows *xr, const void *w, const float *scales, const void *bias, void *y, int64_t ldy,
                          int M, int64_t N, int fmt, int dt, int accumulate) {
    const int64_t nb = xr->nb, tiles = (N + TILE - 1) / TILE, chunk = chunk_of(tiles);
#pragma omp parallel num_threads(num_threads)
    {
        int8_t *wq = malloc((size_t)nb * QB);
        float *wd = malloc(sizeof(float) * nb), *wm = malloc(sizeof(float) * nb);
#pragma omp for schedule(dynamic, chunk)
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t n = t * TILE; n < N && n < (t + 1) * TILE; n++) {
                unpack_row(w, n, nb, fmt, wq, wd, wm);
                for (int m = 0; m < M; m++) {
                    const int64_t at = (int64_t)m * nb;
                    const float v = dot_scalar(wq, wd, wm, xr->q + at * QB, xr->d + at, xr->ds + at, nb);
                    put(y, ldy, m, n, v, fmt, scales, bias, dt, accumulate);
                }
            }
        free(wq), free(wd), free(wm);
    }
}

/* ---- AVX2 --------------------------------------------------------------------------------- */

#ifdef HAVE_X86
#define AVX2_FNS __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

AVX2_FNS __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

AVX2_FNS __m256 halves8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/*
 * The tile's 8 rows . one x row, as 8 float lanes. fmt is a constant at each call site (see
 * tile_any), so every format gets its own loop.
 */
AVX2_FNS __m256 tile_dot(const int fmt, const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xd,
                         const float *xds) {
    const int64_t hdr = header_bytes(fmt), rec = record_bytes(fmt);
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = tile + b * rec, *v = p + hdr;
        const int8_t *x = xq + b * QB;
        __m256i sums;
        if (fmt == Q4_0 || fmt == Q4_1) {
            /* 8 products of nibbles (<= 15) and x (|x| <= 127), pairs summed: at most 8 * 2 * 15 * 127
               = 30480 per int16 lane, so they add up in int16 before one widening. */
            __m256i s16 = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(v + 32 * c));
                const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo, bcast4(x + 4 * c)));
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi, bcast4(x + QB / 2 + 4 * c)));
            }
            sums = _mm256_madd_epi16(s16, ones);
        } else {
            /* Signed weights: |w| times x carrying w's sign (maddubs takes unsigned by signed). */
            sums = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(v + 32 * c)), xb = bcast4(x + 4 * c);
                const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xb, w));
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(p16, ones));
            }
        }
        const __m256 dx = _mm256_set1_ps(xd[b]);
        if (fmt == INT8) {
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), dx, acc);
            continue;
        }
        const __m256 d = halves8(p);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, dx), acc);
        if (fmt == Q4_1) offsets = _mm256_fmadd_ps(halves8(p + 2 * TILE), _mm256_set1_ps(xds[b]), offsets);
        if (fmt == Q4_0) offsets = _mm256_fmadd_ps(d, _mm256_set1_ps(-8.0f * xds[b]), offsets);
    }
    return _mm256_add_ps(acc, offsets);
}

__attribute__((target("avx2,fma,f16c"))) static void tile_any(int fmt, const uint8_t *tile, int64_t nb,
                                                              const int8_t *xq, const float *xd, const float *xds,
                                                              float out[TILE]) {
    __m256 v;
    switch (fmt) {
        case INT8: v = tile_dot(INT8, tile, nb, xq, xd, xds); break;
        case Q8_0: v = tile_dot(Q8_0, tile, nb, xq, xd, xds); break;
        case Q4_0: v = tile_dot(Q4_0, tile, nb, xq, xd, xds); break;
        default: v = tile_dot(Q4_1, tile, nb, xq, xd, xds); break;
    }
    _mm256_storeu_ps(out, v);
}

static void linear_avx2(const QRows *xr, const void *w, const float *scales, const void *bias, void *y, int64_t ldy,
                        int M, int64_t N, int fmt, int dt, int accumulate) {
    const int64_t nb = xr->nb, tiles = (N + TILE - 1) / TILE, chunk = chunk_of(tiles);
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = (const uint8_t *)w + t * nb * record_bytes(fmt);
        const int rows = N - t * TILE < TILE ? (int)(N - t * TILE) : TILE;
        /* The first x row streams the tile from memory; the others find it in L1. */
        for (int m = 0; m < M; m++) {
            const int64_t at = (int64_t)m * nb;
            float out[TILE];
            tile_any(fmt, tile, nb, xr->q + at * QB, xr->d + at, xr->ds + at, out);
            for (int r = 0; r < rows; r++) put(y, ldy, m, t * TILE + r, out[r], fmt, scales, bias, dt, accumulate);
        }
    }
}
#endif

/*
 * y[m, n] = sum_k x[m, k] W[n, k] + bias[n] for m < M; x: [M, K] of dtype dt, W: [N, K] tiled
 * in fmt (int8 with scales [N] float32), bias: [N] of dtype dt or NULL, y: rows of stride ldy.
 * accumulate: y[m, n] += (that value rounded to dt), as torch's residual add of a linear's output.
 */
void kvq_linear(const void *x, const void *w, const float *scales, const void *bias, void *y, int64_t ldy, int M,
                int64_t N, int64_t K, int fmt, int dt, int accumulate) {
    if (use_avx2 < 0) kvq_use_avx2(1);
    QRows xr = quantize_rows(x, M, K, dt);
#ifdef HAVE_X86
    if (use_avx2)
        linear_avx2(&xr, w, scales, bias, y, ldy, M, N, fmt, dt, accumulate);
    else
#endif
        linear_scalar(&xr, w, scales, bias, y, ldy, M, N, fmt, dt, accumulate);
    free(xr.q), free(xr.d), free(xr.ds);
}

/* out[i, :] = row index[i] of W as float32 (an embedding lookup, or a whole matrix for a GEMM). */
void kvq_dequantize_rows(const void *w, const float *scales, const int64_t *index, int64_t count, int64_t K, int fmt,
                         float *out) {
    const int64_t nb = (K + QB - 1) / QB;
#pragma omp parallel num_threads(num_threads) if (count > 1)
    {
        int8_t *q = malloc((size_t)nb * QB);
        float *d = malloc(sizeof(float) * nb), *m = malloc(sizeof(float) * nb);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {
            const int64_t n = index ? index[i] : i;
            unpack_row(w, n, nb, fmt, q, d, m);
            const float scale = fmt == INT8 ? scales[n] : 1.0f;
            for (int64_t k = 0; k < K; k++) out[i * K + k] = (float)q[k] * d[k / QB] * scale + m[k / QB];
        }
        free(q), free(d), free(m);
    }
}

/* ---- int8 GEMM's two ends (quant/matmul.py: int8 weights through torch._int_mm) ----------------- */

/*
 * Each row of x to int8 with one scale: scale[m] = max |x[m, :]| / 127, q = round(x * 127 / max),
 * ties to even as torch.round. A row of zeros gets scale 0 and zeros.
 */
__attribute__((target_clones("avx2", "default"))) void kvq_quantize_rows_int8(const void *x, int M, int64_t K, int dt, int8_t *q, float *scale) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)M * K > 65536)
    for (int m = 0; m < M; m++) {
        float amax = 0.0f;
        if (dt == F32) {
            const float *row = (const float *)x + (int64_t)m * K;
            for (int64_t k = 0; k < K; k++) amax = fabsf(row[k]) > amax ? fabsf(row[k]) : amax;
        } else {
            for (int64_t k = 0; k < K; k++) {
                const float v = fabsf(load1(x, (int64_t)m * K + k, dt));
                amax = v > amax ? v : amax;
            }
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t *out = q + (int64_t)m * K;
        for (int64_t k = 0; k < K; k++) out[k] = (int8_t)nearbyintf(load1(x, (int64_t)m * K + k, dt) * inv);
        scale[m] = amax / 127.0f;
    }
}

/*
 * y[m, n] (+)= acc[m, n] * row_scale[m] * col_scale[n] + bias[n]: the int32 sums of the int8 GEMM
 * back to dtype dt, into rows of stride ldy; accumulate rounds the product to dt first, as put().
 */
__attribute__((target_clones("avx2", "default"))) void kvq_scale_int32(const int32_t *acc, int M, int64_t N, const float *row_scale, const float *col_scale,
                     const void *bias, void *y, int64_t ldy, int dt, int accumulate) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)M * N > 65536)
    for (int m = 0; m < M; m++) {
        const int32_t *row = acc + (int64_t)m * N;
        const float rs = row_scale[m];
        if (dt == F32 && !bias && !accumulate) {
            float *out = (float *)y + (int64_t)m * ldy;
            for (int64_t n = 0; n < N; n++) out[n] = (float)row[n] * rs * col_scale[n];
            continue;
        }
        for (int64_t n = 0; n < N; n++) {
            const int64_t at = (int64_t)m * ldy + n;
            float v = (float)row[n] * rs * col_scale[n];
            if (bias) v += load1(bias, n, dt);
            if (accumulate) v = load1(y, at, dt) + round_to(v, dt);
            store1(y, at, v, dt);
        }
    }
}
