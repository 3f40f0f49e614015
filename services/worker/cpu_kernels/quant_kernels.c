/*
 * kvgrid quantized linear: y = x W^T for W packed as int8 per output channel or as ggml's
 * q8_0 / q4_0 / q4_1 / q5_0 blocks of 32, in the tiled layout of services/worker/quant/formats.py:
 * rows in tiles of 8, and per (tile, block of 32 along K) one record holding the 8 rows' fp16
 * scales d (q8_0, q4_*, q5_0), then their fp16 offsets m (q4_1), then their values 4 bytes at a
 * time, row after row (bytes 0-3 of rows 0..7, then bytes 4-7, ...). q4 and q5 bytes hold value j
 * in their low half and j + 16 in their high half, as ggml stores them; q5_0 records end with the
 * values' fifth bits, one bit per byte of nibbles in the order the vectors below load them
 * (formats.py's _fifth_bit_order). int8 records have no scales (one float per channel, applied at
 * the end) and K padded with zeros to whole blocks.
 *
 * As ggml does: each row of x is quantized once per call to int8 blocks of 32 with one float
 * scale per block (d = max |x| / 127); then per block integer dot products, scaled by the two
 * blocks' scales and summed in float32. q4_1's offset m adds m * d_x * sum(q_x) per block; q4_0's
 * -8 adds -8 d * d_x * sum(q_x). q5_0's -16 is taken off in the integers (q . q_x - 16 sum(q_x)),
 * so its sums are those of the same values stored as q8_0, and so its outputs, bit for bit.
 *
 * AVX2: one 32-byte load holds 4 bytes of each of the tile's 8 rows, multiplied (maddubs) with
 * 4 bytes of x broadcast to every lane, so the eight int32 lanes are the eight rows' sums: no
 * horizontal reductions, one scale multiply per block for eight rows, and the eight outputs are
 * one vector. AVX-512 VNNI (vpdpbusd, multiply and sum into int32 in one instruction) does the
 * same on 64-byte vectors, two 4-byte chunks per load. The path is chosen at run time, each one
 * compiled for its own instruction set by per-function target attributes, so the library builds
 * and runs on any x86-64 or other CPU; kvq_select_path forces a slower one (for tests). The
 * portable scalar path unpacks a row to bytes and takes plain loops.
 *
 * Work is split across threads by tiles, handed out dynamically in chunks, so a thread that
 * loses its core to another process delays only the chunk it holds. dtype codes of x and y:
 * scalar.h. Format codes: 0 int8, 1 q8_0, 2 q4_0, 3 q4_1, 7 q5_0, and ggml's K-quants 4 q4_k, 5 q5_k,
 * 6 q6_k, whose rows stay as stored (kquants.h).
 */
#include <math.h>
#include <stdlib.h>

#include "scalar.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

enum { INT8 = 0, Q8_0 = 1, Q4_0 = 2, Q4_1 = 3, Q4_K = 4, Q5_K = 5, Q6_K = 6, Q5_0 = 7 };
enum { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_VNNI = 2 };
#define QB 32  /* values per block */
#define TILE 8 /* rows per tile */

static int num_threads = 1;
static int path = -1; /* a PATH_*; -1: not decided yet */

void kvq_set_num_threads(int n) { num_threads = n > 0 ? n : 1; }

/* The fastest path this CPU runs, at most want; kvq_select_path(PATH_VNNI) picks the best. */
int kvq_select_path(int want) {
    int best = PATH_SCALAR;
#ifdef HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = PATH_AVX2;
    if (best == PATH_AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        best = PATH_VNNI;
#endif
    path = want < best ? (want > PATH_SCALAR ? want : PATH_SCALAR) : best;
    return path;
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

INLINE int is_kquant(int fmt) { return fmt >= Q4_K && fmt <= Q6_K; }
INLINE int has_nibbles(int fmt) { return fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0; }

/* Bytes of a record's scales, and of its values (8 rows x 32 bytes, or x 16 of nibbles, + 4 of fifth bits). */
INLINE int64_t header_bytes(int fmt) { return fmt == INT8 ? 0 : fmt == Q4_1 ? 2 * 2 * TILE : 2 * TILE; }
INLINE int64_t value_bytes(int fmt) {
    return fmt == Q5_0 ? TILE * (QB / 2 + 4) : has_nibbles(fmt) ? TILE * QB / 2 : TILE * QB;
}
INLINE int64_t record_bytes(int fmt) { return header_bytes(fmt) + value_bytes(fmt); }

/* The fifth bit of value j (< 32) of the tile's row i, from a q5_0 record's bits (formats.py's _fifth_bit_order):
   per 64-byte vector of nibbles (chunks 2c and 2c + 1), 64 bits for its low halves, then 64 for its high
   halves (values 16 + ...); within those, bit 32 * (chunk % 2) + 4 * row + byte, value j at byte j % 4 of
   chunk j % 16 / 4. */
INLINE int fifth_bit(const uint8_t *fifth, int64_t i, int j) {
    const int high = j / 16, chunk = j % 16 / 4;
    const int k = ((chunk / 2 * 2 + high) * 2 + chunk % 2) * 32 + (int)i * 4 + j % 4;
    return fifth[k / 8] >> (k % 8) & 1;
}

/* ---- the activations: int8 blocks ---------------------------------------------------------- */

#ifdef HAVE_X86
#define AVX2_FNS __attribute__((target("avx2,fma,f16c"), always_inline)) static inline
#define VNNI_TARGET "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"
#define VNNI_FNS __attribute__((target(VNNI_TARGET), always_inline)) static inline
#endif

typedef struct {
    int8_t *q;      /* [M, nb * QB], zero past K */
    float *d;       /* [M, nb] */
    float *ds;      /* [M, nb]: d * (sum of q) per block, for the weights' per-block offsets */
    uint8_t *wide;  /* VNNI: [M, nb, 8 * 32], each 4 bytes of q repeated 8 times (+128 for signed weights) */
    int64_t nb;
} QRows;

/* One growing buffer per thread for a call's quantized activations (a decode step makes ~100 calls). */
static __thread uint8_t *scratch;
static __thread size_t scratch_size;

static uint8_t *scratch_of(size_t bytes) {
    if (bytes > scratch_size) {
        free(scratch);
        scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_size = scratch ? bytes : 0;
    }
    return scratch;
}

/* A block of n <= QB values at x[at..] into q (QB bytes, zero past n); returns d, sets *sum. */
static float quantize_block_scalar(const void *x, int64_t at, int n, int dt, int8_t *q, int32_t *sum) {
    float v[QB], amax = 0.0f;
    for (int j = 0; j < n; j++) {
        v[j] = load1(x, at + j, dt);
        amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
    }
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    *sum = 0;
    memset(q, 0, QB);
    for (int j = 0; j < n; j++) {
        float t = nearbyintf(v[j] * inv);
        t = t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t;
        q[j] = (int8_t)t;
        *sum += (int32_t)t;
    }
    return d;
}

#ifdef HAVE_X86
AVX2_FNS __m256 load8(const void *x, int64_t at, int dt) {
    if (dt == BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + at);
}

/* The same block of QB values, the same arithmetic (so the same bytes), eight lanes at a time. */
__attribute__((target("avx2,fma,f16c"))) static float quantize_block_avx2(const void *x, int64_t at, int dt,
                                                                          int8_t *q, int32_t *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) v[i] = load8(x, at + 8 * i, dt), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float d = _mm_cvtss_f32(m) / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 scale = _mm256_set1_ps(inv);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    __m256i r[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256 t = _mm256_round_ps(_mm256_mul_ps(v[i], scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(t), hi), lo);
        total = _mm256_add_epi32(total, r[i]);
    }
    /* packs work within 128-bit lanes: the bytes come out as 4-value runs to put back in order */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    *sum = _mm_cvtsi128_si32(s);
    return d;
}

/* VNNI's x operand for a block: each 4 bytes of q as 8 copies (one per row of a tile), 256 bytes. */
__attribute__((target("avx2"))) static void widen_block(const int8_t *q, uint8_t *wide, int bias) {
    const __m256i flip = _mm256_set1_epi8(bias ? (char)0x80 : 0);
    for (int j = 0; j < 8; j++) {
        int32_t v;
        memcpy(&v, q + 4 * j, 4);
        _mm256_storeu_si256((__m256i *)(wide + 32 * j), _mm256_xor_si256(_mm256_set1_epi32(v), flip));
    }
}
#endif

/* x's rows as int8 blocks; for VNNI's tiled formats also widened, biased by +128 where the weights are signed. */
static QRows quantize_rows(const void *x, int M, int64_t K, int dt, int fmt) {
    (void)fmt; /* read by VNNI's widening only */
    QRows r;
    r.nb = (K + QB - 1) / QB;
    const size_t blocks = (size_t)M * r.nb, wide = path == PATH_VNNI && !is_kquant(fmt) ? blocks * 8 * QB : 0;
    uint8_t *buf = scratch_of(blocks * QB + 2 * sizeof(float) * blocks + wide);
    r.q = (int8_t *)buf;
    r.d = (float *)(buf + blocks * QB);
    r.ds = r.d + blocks;
    r.wide = wide ? (uint8_t *)(r.ds + blocks) : NULL;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (blocks > 512)
    for (int64_t mb = 0; mb < (int64_t)blocks; mb++) {
        const int64_t m = mb / r.nb, k0 = (mb % r.nb) * QB, n = K - k0 < QB ? K - k0 : QB;
        int8_t *q = r.q + mb * QB;
        int32_t sum;
        float d;
#ifdef HAVE_X86
        if (path >= PATH_AVX2 && n == QB)
            d = quantize_block_avx2(x, m * K + k0, dt, q, &sum);
        else
#endif
            d = quantize_block_scalar(x, m * K + k0, (int)n, dt, q, &sum);
        r.d[mb] = d, r.ds[mb] = d * (float)sum;
#ifdef HAVE_X86
        if (r.wide) widen_block(q, r.wide + mb * 8 * QB, fmt == INT8 || fmt == Q8_0);
#endif
    }
    return r;
}

/* ---- the weights: one row unpacked to bytes ------------------------------------------------- */

/*
 * Row n of the tiled matrix into q (nb * QB bytes), per-block scales d and offsets m: a block's
 * weights are d q + m. int8: d = 1 (the channel scale comes at the end), m = 0. q4: q holds the
 * raw nibbles 0..15, so q4_0's -8 d is an offset too. q5_0: q holds q - 16 (as q8_0 would), m = 0.
 */
static void unpack_row(const uint8_t *w, int64_t n, int64_t nb, int fmt, int8_t *q, float *d, float *m) {
    const int64_t hdr = header_bytes(fmt), chunks = has_nibbles(fmt) ? QB / 8 : QB / 4, i = n % TILE;
    const uint8_t *tile = w + (n / TILE) * nb * record_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = tile + b * record_bytes(fmt);
        d[b] = fmt == INT8 ? 1.0f : fp16_to_f32(rec + 2 * i);
        m[b] = fmt == Q4_1 ? fp16_to_f32(rec + 2 * TILE + 2 * i) : fmt == Q4_0 ? -8.0f * d[b] : 0.0f;
        uint8_t raw[QB];
        for (int64_t c = 0; c < chunks; c++) memcpy(raw + 4 * c, rec + hdr + c * 4 * TILE + 4 * i, 4);
        int8_t *out = q + b * QB;
        if (!has_nibbles(fmt))
            memcpy(out, raw, QB);
        else
            for (int j = 0; j < QB / 2; j++) out[j] = (int8_t)(raw[j] & 15), out[j + QB / 2] = (int8_t)(raw[j] >> 4);
        if (fmt == Q5_0) {
            const uint8_t *fifth = rec + hdr + TILE * QB / 2;
            for (int j = 0; j < QB; j++) out[j] = (int8_t)(out[j] + 16 * fifth_bit(fifth, i, j) - 16);
        }
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
/*
 * At batch 1 the weights stream from memory (92 MiB a token for the default model), and one core's
 * few outstanding misses bound its bandwidth: requesting the lines PREFETCH_AHEAD bytes ahead (the
 * next tiles, which this thread takes next) keeps more misses in flight than the hardware prefetchers
 * alone, and any distance of 4-16 KiB does as well (benchmarks/worker_bench.py --quantization gguf
 * --batch-sizes 1 times those steps).
 */
#define PREFETCH_AHEAD 4096

INLINE void prefetch_record(const uint8_t *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

AVX2_FNS __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

AVX2_FNS __m256 halves8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* 32 fifth bits (4 bytes at p) as 32 bytes of 16 or 0: byte k takes bit k. */
AVX2_FNS __m256i fifth_bytes(const uint8_t *p) {
    int32_t bits;
    memcpy(&bits, p, 4);
    /* byte k takes byte k / 8 of the bits (each 128-bit lane holds all four) */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ull); /* byte k: 1 << k % 8 */
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(bits), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

/*
 * A block's 8 integer sums into the tile's float accumulators: times the rows' scales d (from the
 * record p) and x's d_x; q4_1's offsets m (q4_0's -8 d) times d_x * sum(q_x) accumulate apart.
 */
AVX2_FNS void scale_block(const int fmt, __m256i sums, const uint8_t *p, float xd, float xds, __m256 *acc,
                          __m256 *offsets) {
    const __m256 dx = _mm256_set1_ps(xd);
    if (fmt == INT8) {
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), dx, *acc);
        return;
    }
    const __m256 d = halves8(p);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, dx), *acc);
    if (fmt == Q4_1) *offsets = _mm256_fmadd_ps(halves8(p + 2 * TILE), _mm256_set1_ps(xds), *offsets);
    if (fmt == Q4_0) *offsets = _mm256_fmadd_ps(d, _mm256_set1_ps(-8.0f * xds), *offsets);
}

/*
 * The tile's 8 rows . one x row, as 8 float lanes. fmt is a constant at each call site (see
 * tile_any), so every format gets its own loop.
 */
AVX2_FNS __m256 tile_dot(const int fmt, const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xd,
                         const float *xds, int64_t ahead) {
    const int64_t hdr = header_bytes(fmt), rec = record_bytes(fmt);
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = tile + b * rec, *v = p + hdr;
        if (ahead) prefetch_record(p + ahead, rec);
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
        } else if (fmt == Q5_0) {
            /* values 0..31 with their fifth bits: pairs up to 2 * 31 * 127, so each chunk widens on its own;
               sum(q_x) (at most 32 * 127) in int16 throughout. */
            const __m256i ones8 = _mm256_set1_epi8(1);
            __m256i xsum = _mm256_setzero_si256();
            sums = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) { /* chunk c's fifth bits: 32-bit word 4 (c / 2) + c % 2, +2 for the high */
                const uint8_t *fifth = v + 4 * QB + 16 * (c / 2) + 4 * (c % 2);
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(v + 32 * c));
                const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, low4), fifth_bytes(fifth));
                const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4),
                                                   fifth_bytes(fifth + 8));
                const __m256i xl = bcast4(x + 4 * c), xh = bcast4(x + QB / 2 + 4 * c);
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), ones));
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), ones));
                xsum = _mm256_add_epi16(xsum, _mm256_maddubs_epi16(ones8, xl));
                xsum = _mm256_add_epi16(xsum, _mm256_maddubs_epi16(ones8, xh));
            }
            sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(_mm256_madd_epi16(xsum, ones), 4));
        } else {
            /* Signed weights: |w| times x carrying w's sign (maddubs takes unsigned by signed). */
            sums = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(v + 32 * c)), xb = bcast4(x + 4 * c);
                const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xb, w));
                sums = _mm256_add_epi32(sums, _mm256_madd_epi16(p16, ones));
            }
        }
        scale_block(fmt, sums, p, xd[b], xds[b], &acc, &offsets);
    }
    return _mm256_add_ps(acc, offsets);
}

/*
 * out = KERNEL(fmt, ...) with fmt a constant in each branch, so that the inlined kernel is compiled
 * once per format (the AVX2 and VNNI dispatchers below differ only in target and kernel).
 */
#define STORE_TILE_BY_FORMAT(KERNEL, fmt, out, ...)                                   \
    do {                                                                              \
        switch (fmt) {                                                                \
            case INT8: _mm256_storeu_ps(out, KERNEL(INT8, __VA_ARGS__)); break;       \
            case Q8_0: _mm256_storeu_ps(out, KERNEL(Q8_0, __VA_ARGS__)); break;       \
            case Q4_0: _mm256_storeu_ps(out, KERNEL(Q4_0, __VA_ARGS__)); break;       \
            case Q5_0: _mm256_storeu_ps(out, KERNEL(Q5_0, __VA_ARGS__)); break;       \
            default: _mm256_storeu_ps(out, KERNEL(Q4_1, __VA_ARGS__)); break;         \
        }                                                                             \
    } while (0)

__attribute__((target("avx2,fma,f16c"))) static void tile_any(int fmt, const uint8_t *tile, int64_t nb,
                                                              const int8_t *xq, const float *xd, const float *xds,
                                                              int64_t ahead, float out[TILE]) {
    STORE_TILE_BY_FORMAT(tile_dot, fmt, out, tile, nb, xq, xd, xds, ahead);
}

/* ---- AVX-512 VNNI -------------------------------------------------------------------------- */

/*
 * The same tile . x row with vpdpbusd on 64-byte vectors: one load holds two 4-byte chunks of the
 * tile's 8 rows (lanes 0-7 one chunk, 8-15 the next), multiplied with x's widened bytes, which hold
 * the matching two 4-byte pieces of x 8 times over, and summed into int32 lanes in one instruction.
 * vpdpbusd multiplies unsigned by signed bytes: q4 nibbles are unsigned as they are; signed weights
 * (q8_0, int8) meet x + 128 (widened that way) and the 128 * sum(w) that adds is taken back.
 */
VNNI_FNS __m256 tile_dot_vnni(const int fmt, const uint8_t *tile, int64_t nb, const uint8_t *xw, const float *xd,
                              const float *xds, int64_t ahead) {
    const int64_t hdr = header_bytes(fmt), rec = record_bytes(fmt);
    const __m512i low4 = _mm512_set1_epi8(15), ones = _mm512_set1_epi8(1);
    __m256 acc = _mm256_setzero_ps(), offsets = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = tile + b * rec, *v = p + hdr, *x = xw + b * 8 * QB;
        if (ahead) prefetch_record(p + ahead, rec);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        if (fmt == Q4_0 || fmt == Q4_1) {
            for (int c = 0; c < 2; c++) { /* chunks 2c, 2c+1: x bytes 8c.. low halves, 16 + 8c.. high */
                const __m512i raw = _mm512_loadu_si512(v + 64 * c);
                const __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                s0 = _mm512_dpbusd_epi32(s0, lo, _mm512_loadu_si512(x + 64 * c));
                s1 = _mm512_dpbusd_epi32(s1, hi, _mm512_loadu_si512(x + 128 + 64 * c));
            }
        } else if (fmt == Q5_0) {
            /* the nibbles with their fifth bits (one mask per vector: + 16 where set), then - 16 sum(q_x) */
            const __m512i sixteen = _mm512_set1_epi8(16);
            __m512i xsum = _mm512_setzero_si512();
            for (int c = 0; c < 2; c++) {
                uint64_t fifth[2]; /* the low halves' bits, the high halves' */
                memcpy(fifth, v + 4 * QB + 16 * c, 16);
                const __m512i raw = _mm512_loadu_si512(v + 64 * c);
                const __m512i xl = _mm512_loadu_si512(x + 64 * c), xh = _mm512_loadu_si512(x + 128 + 64 * c);
                __m512i lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                lo = _mm512_mask_add_epi8(lo, (__mmask64)fifth[0], lo, sixteen);
                hi = _mm512_mask_add_epi8(hi, (__mmask64)fifth[1], hi, sixteen);
                s0 = _mm512_dpbusd_epi32(s0, lo, xl);
                s1 = _mm512_dpbusd_epi32(s1, hi, xh);
                xsum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(xsum, ones, xl), ones, xh);
            }
            s1 = _mm512_sub_epi32(s1, _mm512_slli_epi32(xsum, 4));
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i w = _mm512_loadu_si512(v + 64 * c);
                s0 = _mm512_dpbusd_epi32(s0, _mm512_loadu_si512(x + 64 * c), w); /* (x + 128) . w */
                s1 = _mm512_dpbusd_epi32(s1, ones, w);                          /* sum(w) */
            }
            s1 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s1, 7));
        }
        const __m512i s = _mm512_add_epi32(s0, s1);
        const __m256i sums = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        scale_block(fmt, sums, p, xd[b], xds[b], &acc, &offsets);
    }
    return _mm256_add_ps(acc, offsets);
}

__attribute__((target(VNNI_TARGET))) static void tile_any_vnni(int fmt, const uint8_t *tile, int64_t nb,
                                                               const uint8_t *xw, const float *xd, const float *xds,
                                                               int64_t ahead, float out[TILE]) {
    STORE_TILE_BY_FORMAT(tile_dot_vnni, fmt, out, tile, nb, xw, xd, xds, ahead);
}

/* Tiles across threads, each tile against every x row (the first row streams it from memory, the
   others find it in L1); AVX2 or VNNI dot products. */
static void linear_simd(const QRows *xr, const void *w, const float *scales, const void *bias, void *y, int64_t ldy,
                        int M, int64_t N, int fmt, int dt, int accumulate) {
    const int64_t nb = xr->nb, tiles = (N + TILE - 1) / TILE, chunk = chunk_of(tiles);
#pragma omp parallel for schedule(dynamic, chunk) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = (const uint8_t *)w + t * nb * record_bytes(fmt);
        const int rows = N - t * TILE < TILE ? (int)(N - t * TILE) : TILE;
        for (int m = 0; m < M; m++) {
            const int64_t at = (int64_t)m * nb;
            float out[TILE];
            const int64_t ahead = m == 0 ? PREFETCH_AHEAD : 0; /* the first row streams the tile */
            if (xr->wide)
                tile_any_vnni(fmt, tile, nb, xr->wide + at * 8 * QB, xr->d + at, xr->ds + at, ahead, out);
            else
                tile_any(fmt, tile, nb, xr->q + at * QB, xr->d + at, xr->ds + at, ahead, out);
            for (int r = 0; r < rows; r++) put(y, ldy, m, t * TILE + r, out[r], fmt, scales, bias, dt, accumulate);
        }
    }
}
#endif

#include "kquants.h"

/*
 * y[m, n] = sum_k x[m, k] W[n, k] + bias[n] for m < M; x: [M, K] of dtype dt, W: [N, K] tiled
 * in fmt (int8 with scales [N] float32), bias: [N] of dtype dt or NULL, y: rows of stride ldy.
 * accumulate: y[m, n] += (that value rounded to dt), as torch's residual add of a linear's output.
 */
void kvq_linear(const void *x, const void *w, const float *scales, const void *bias, void *y, int64_t ldy, int M,
                int64_t N, int64_t K, int fmt, int dt, int accumulate) {
    if (path < 0) kvq_select_path(PATH_VNNI);
    QRows xr = quantize_rows(x, M, K, dt, fmt);
    if (is_kquant(fmt)) {
        linear_k(&xr, w, bias, y, ldy, M, N, K, fmt, dt, accumulate);
        return;
    }
#ifdef HAVE_X86
    if (path > PATH_SCALAR)
        linear_simd(&xr, w, scales, bias, y, ldy, M, N, fmt, dt, accumulate);
    else
#endif
        linear_scalar(&xr, w, scales, bias, y, ldy, M, N, fmt, dt, accumulate);
}

/*
 * One caller's share of a one-row product, for a team that splits a step's products itself
 * (decode_layers.h: kvg_decode_layers): tiles [t0, t1) of y = x W^T + bias, with no OpenMP of its
 * own; x is quantized into the caller's own scratch (a few hundred bytes at one row). Then the first
 * lines of next (this caller's share of the step's next product) are asked for, so that its stream
 * does not start cold after the small ops between. kvq_takes_tiles says which formats it takes
 * (those of linear_simd, on this CPU).
 */
int kvq_takes_tiles(int fmt) {
    if (path < 0) kvq_select_path(PATH_VNNI);
#ifdef HAVE_X86
    return !is_kquant(fmt) && path > PATH_SCALAR;
#else
    (void)fmt;
    return 0;
#endif
}

void kvq_linear_tiles(const void *x, const void *w, const float *scales, const void *bias, void *y, int64_t N,
                      int64_t K, int fmt, int dt, int accumulate, int64_t t0, int64_t t1, const void *next) {
#ifdef HAVE_X86
    const QRows xr = quantize_rows(x, 1, K, dt, fmt);
    const int64_t nb = xr.nb;
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tile = (const uint8_t *)w + t * nb * record_bytes(fmt);
        const int rows = N - t * TILE < TILE ? (int)(N - t * TILE) : TILE;
        float out[TILE];
        if (xr.wide)
            tile_any_vnni(fmt, tile, nb, xr.wide, xr.d, xr.ds, PREFETCH_AHEAD, out);
        else
            tile_any(fmt, tile, nb, xr.q, xr.d, xr.ds, PREFETCH_AHEAD, out);
        for (int r = 0; r < rows; r++) put(y, 0, 0, t * TILE + r, out[r], fmt, scales, bias, dt, accumulate);
    }
    if (next) prefetch_record(next, PREFETCH_AHEAD);
#else
    (void)x, (void)w, (void)scales, (void)bias, (void)y, (void)N, (void)K, (void)fmt, (void)dt, (void)accumulate;
    (void)t0, (void)t1, (void)next;
#endif
}

/* out[i, :] = row index[i] of W as float32 (an embedding lookup, or a whole matrix for a GEMM). */
void kvq_dequantize_rows(const void *w, const float *scales, const int64_t *index, int64_t count, int64_t K, int fmt,
                         float *out) {
    const int64_t nb = (K + QB - 1) / QB;
    if (is_kquant(fmt)) {
        const int64_t row_bytes = K / QK * k_block_bytes(fmt);
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count > 1)
        for (int64_t i = 0; i < count; i++)
            dequantize_row_k((const uint8_t *)w + (index ? index[i] : i) * row_bytes, K, fmt, out + i * K);
        return;
    }
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
__attribute__((target_clones("avx2", "default"))) void kvq_quantize_rows_int8(const void *x, int M, int64_t K, int dt,
                                                                               int8_t *q, float *scale) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)M * K > 8192)
    for (int m = 0; m < M; m++) {
        float amax = 0.0f;
        if (dt == F32) {
            /* Eight running maxima, not one: a single one is a serial chain the compiler may not reorder. */
            const float *row = (const float *)x + (int64_t)m * K;
            float lanes[8] = {0};
            int64_t k = 0;
            for (; k + 8 <= K; k += 8)
                for (int j = 0; j < 8; j++) lanes[j] = fabsf(row[k + j]) > lanes[j] ? fabsf(row[k + j]) : lanes[j];
            for (; k < K; k++) amax = fabsf(row[k]) > amax ? fabsf(row[k]) : amax;
            for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
        } else {
            for (int64_t k = 0; k < K; k++) {
                const float v = fabsf(load1(x, (int64_t)m * K + k, dt));
                amax = v > amax ? v : amax;
            }
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t *out = q + (int64_t)m * K;
        /* |v| <= 127: adding and taking away 1.5 * 2^23 rounds to the nearest integer, ties to even
         * (nearbyintf's result in the default rounding mode), and the loop vectorizes. */
        const float magic = 12582912.0f;
        if (dt == F32) {
            const float *row = (const float *)x + (int64_t)m * K;
            for (int64_t k = 0; k < K; k++) out[k] = (int8_t)((row[k] * inv + magic) - magic);
        } else {
            for (int64_t k = 0; k < K; k++) out[k] = (int8_t)((load1(x, (int64_t)m * K + k, dt) * inv + magic) - magic);
        }
        scale[m] = amax / 127.0f;
    }
}

/*
 * The rounding error kvq_quantize_rows_int8 left in each row, r = x - scale q (float32), quantized the
 * same way into q2 and scale2: the int8 GEMM's second activation term. r is computed twice (for the
 * maximum, then for the values) rather than stored.
 */
__attribute__((target_clones("avx2", "default"))) void kvq_quantize_residual_int8(const void *x, int M, int64_t K,
                                                                                   int dt, const int8_t *q,
                                                                                   const float *scale, int8_t *q2,
                                                                                   float *scale2) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)M * K > 8192)
    for (int m = 0; m < M; m++) {
        const int64_t at = (int64_t)m * K;
        const float s = scale[m];
        float lanes[8] = {0}, amax = 0.0f;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8)
            for (int j = 0; j < 8; j++) {
                const float r = fabsf(load1(x, at + k + j, dt) - (float)q[at + k + j] * s);
                lanes[j] = r > lanes[j] ? r : lanes[j];
            }
        for (; k < K; k++) {
            const float r = fabsf(load1(x, at + k, dt) - (float)q[at + k] * s);
            amax = r > amax ? r : amax;
        }
        for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, magic = 12582912.0f; /* see above */
        for (k = 0; k < K; k++)
            q2[at + k] = (int8_t)(((load1(x, at + k, dt) - (float)q[at + k] * s) * inv + magic) - magic);
        scale2[m] = amax / 127.0f;
    }
}

/*
 * y[m, n] (+)= acc[m, n] * row_scale[m] * col_scale[n] + bias[n]: the int32 sums of the int8 GEMM
 * back to dtype dt, into rows of stride ldy; accumulate rounds the product to dt first, as put().
 */
__attribute__((target_clones("avx2", "default"))) void kvq_scale_int32(const int32_t *acc, int M, int64_t N,
                                                                        const float *row_scale, const float *col_scale,
                                                                        const void *bias, void *y, int64_t ldy, int dt,
                                                                        int accumulate) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)M * N > 8192)
    for (int m = 0; m < M; m++) {
        const int32_t *row = acc + (int64_t)m * N;
        const float rs = row_scale[m];
        if (dt == F32 && !bias) {  /* the decode step's cases, vectorised */
            float *out = (float *)y + (int64_t)m * ldy;
            if (accumulate)
                for (int64_t n = 0; n < N; n++) out[n] += (float)row[n] * rs * col_scale[n];
            else
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
