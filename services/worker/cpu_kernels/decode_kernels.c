/*
 * kvgrid CPU decode kernels: the operations of a small decode step of a Llama-family model,
 * for x86-64 CPUs with AVX2 and FMA. Built at first use by library.py (cc -O3 -mavx2 -mfma
 * -fopenmp) and called through ctypes with raw pointers to contiguous torch tensors.
 *
 * Why: at batch 1 a decode step is ~120 matrix-vector products over the whole model, and
 * torch's bfloat16 GEMV falls well short of the memory bandwidth, while each of the ~20 small
 * eager ops per layer around them pays torch's dispatch, more than its own math at batch 1.
 * These kernels stream weights at close to bandwidth and do each small op in one call.
 *
 * Numerics follow the torch path op for op: every value torch would hold in a tensor of the
 * model dtype is rounded to that dtype here at the same point (bfloat16: round to nearest
 * even); everything in between is float32. Only summation order differs, and, in bfloat16 on
 * CPUs with AVX512-BF16, paged attention rounds its probabilities to bfloat16 (see there).
 *
 * dtype codes: see scalar.h. OpenMP is the process's runtime, torch's (same soname);
 * the thread count is set through kvg_set_num_threads, because an OpenMP thread count set with
 * omp_set_num_threads holds only for the thread that set it, and steps run on another one.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "scalar.h"
#include "vector_math.h"

static int num_threads = 1;

void kvg_set_num_threads(int n) { num_threads = n > 0 ? n : 1; }

#include "amx_gemm.h"

INLINE __m256 load8(const void *p, int64_t i, int dt) {
    if (dt == BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

/* bits of v rounded to bfloat16 as f32_to_bf16 does (nearest even, NaN to 0x7fc0), in each lane's upper half */
INLINE __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                       _mm256_set1_epi32((int)0xffff0000u));
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(nan));
}

/* round_to for eight lanes */
INLINE __m256 round8(__m256 v, int dt) { return dt == BF16 ? _mm256_castsi256_ps(bf16_bits8(v)) : v; }

/* store1 for eight lanes */
INLINE void store8(void *p, int64_t i, __m256 v, int dt) {
    if (dt == BF16) {
        const __m256i h = _mm256_srli_epi32(bf16_bits8(v), 16);
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
    } else {
        _mm256_storeu_ps((float *)p + i, v);
    }
}

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static void to_f32(const void *src, int64_t offset, float *dst, int64_t n, int dt) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src, offset + i, dt));
    for (; i < n; i++) dst[i] = load1(src, offset + i, dt);
}

/* ---- linear: y = x W^T + b --------------------------------------------------------------- */

#define ROWS 4 /* output rows per task: four weight streams in flight */

/* acc[r] = x . w[n0 + r], r < ROWS; x float32 [K], w rows of K values of dtype dt. */
INLINE void dot_rows(const float *x, const void *w, int64_t n0, int64_t K, int dt, float *acc) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const int64_t r0 = n0 * K, r1 = r0 + K, r2 = r1 + K, r3 = r2 + K;
    int64_t k = 0;
    /* bfloat16 rows are short streams (1152 bytes at K = 576) that the hardware prefetchers pick up
     * late: the next group's rows are asked for, a line per 32 elements. float32 rows gain nothing
     * from it, so only bfloat16 asks (benchmarks/worker_bench.py --dtype bfloat16 times the steps). */
    const char *next = (const char *)w + (r3 + K) * 2;
    for (; k + 8 <= K; k += 8) {
        if (dt == BF16 && k % 32 == 0)
            for (int r = 0; r < ROWS; r++) _mm_prefetch(next + (r * K + k) * 2, _MM_HINT_T0);
        __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(load8(w, r0 + k, dt), xv, a0);
        a1 = _mm256_fmadd_ps(load8(w, r1 + k, dt), xv, a1);
        a2 = _mm256_fmadd_ps(load8(w, r2 + k, dt), xv, a2);
        a3 = _mm256_fmadd_ps(load8(w, r3 + k, dt), xv, a3);
    }
    acc[0] = hsum8(a0), acc[1] = hsum8(a1), acc[2] = hsum8(a2), acc[3] = hsum8(a3);
    for (; k < K; k++) {
        acc[0] += x[k] * load1(w, r0 + k, dt);
        acc[1] += x[k] * load1(w, r1 + k, dt);
        acc[2] += x[k] * load1(w, r2 + k, dt);
        acc[3] += x[k] * load1(w, r3 + k, dt);
    }
}

INLINE float dot_row(const float *x, const void *w, int64_t n, int64_t K, int dt) {
    __m256 a = _mm256_setzero_ps();
    const int64_t r = n * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(load8(w, r + k, dt), _mm256_loadu_ps(x + k), a);
    float s = hsum8(a);
    for (; k < K; k++) s += x[k] * load1(w, r + k, dt);
    return s;
}

/* Output row y (y + row, dtype dt), columns n0 .. n0 + rows - 1: the products acc plus bias; accumulate adds them,
 * rounded to dt first, to what y holds (torch's residual add of a linear's output). */
INLINE void store_rows(const float *acc, int rows, int64_t n0, const void *bias, void *y, int64_t row, int dt,
                       int accumulate) {
    for (int r = 0; r < rows; r++) {
        const int64_t n = n0 + r, at = row + n;
        float v = acc[r] + (bias ? load1(bias, n, dt) : 0.0f);
        if (accumulate) v = load1(y, at, dt) + round_to(v, dt);
        store1(y, at, v, dt);
    }
}

INLINE void linear_impl(const float *xf, const void *w, const void *bias, void *y, int64_t ldy, int M, int64_t N,
                        int64_t K, int dt, int accumulate) {
    const int64_t groups = (N + ROWS - 1) / ROWS;
    /* Handed out in chunks: a thread that loses its core to another process holds up one chunk only. */
#pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = g * ROWS;
        const int rows = N - n0 < ROWS ? (int)(N - n0) : ROWS;
        /* The first row m streams this group's weights from memory; the others find them in L1. */
        for (int m = 0; m < M; m++) {
            float acc[ROWS];
            if (rows == ROWS && dt == BF16)  /* dt a constant in each: the loop has no dtype branches */
                dot_rows(xf + (int64_t)m * K, w, n0, K, BF16, acc);
            else if (rows == ROWS)
                dot_rows(xf + (int64_t)m * K, w, n0, K, F32, acc);
            else
                for (int r = 0; r < rows; r++) acc[r] = dot_row(xf + (int64_t)m * K, w, n0 + r, K, dt);
            store_rows(acc, rows, n0, bias, y, (int64_t)m * ldy, dt, accumulate);
        }
    }
}

/*
 * bfloat16 weights and input on CPUs with AVX512-BF16 (kvg_select_linear_path): VDPBF16PS multiplies
 * 32 bfloat16 pairs as stored, two exact products added into each float32 lane, where the loop above
 * widens every weight to float32 first (a shift and a multiply-add per 8 values, work that keeps two
 * cores short of the memory bandwidth at batch 1). The same exact products, summed in another order,
 * subnormal products (below 1e-38) flushed to zero. Rows of K % 32 end in a masked load of zeros.
 */
#define BF16DOT_TARGET "avx2,fma,avx512f,avx512bw,avx512bf16"
#define BF16DOT_FN __attribute__((target(BF16DOT_TARGET), always_inline)) static inline
#define BF16_ROWS 4 /* weight rows per pass: four streams, each x vector loaded once for all of them */

BF16DOT_FN float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

/* acc[r] = x . w[row r], r < BF16_ROWS (rows past the weight's end repeat its last row, unused) */
BF16DOT_FN void dot_rows_bf16dot(const uint16_t *x, const uint16_t *const *w, int64_t K, const char *next, float *acc) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        if (next) for (int r = 0; r < BF16_ROWS; r++) _mm_prefetch(next + (r * K + k) * 2, _MM_HINT_T0);
        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + k));
        a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_loadu_si512((const void *)(w[0] + k)));
        a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_loadu_si512((const void *)(w[1] + k)));
        a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_loadu_si512((const void *)(w[2] + k)));
        a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_loadu_si512((const void *)(w[3] + k)));
    }
    if (k < K) {
        const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
        a0 = _mm512_dpbf16_ps(a0, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w[0] + k));
        a1 = _mm512_dpbf16_ps(a1, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w[1] + k));
        a2 = _mm512_dpbf16_ps(a2, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w[2] + k));
        a3 = _mm512_dpbf16_ps(a3, xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w[3] + k));
    }
    acc[0] = hsum16(a0), acc[1] = hsum16(a1), acc[2] = hsum16(a2), acc[3] = hsum16(a3);
}

__attribute__((target(BF16DOT_TARGET))) static void linear_bf16dot(const uint16_t *x, const uint16_t *w,
                                                                   const void *bias, void *y, int64_t ldy, int M,
                                                                   int64_t N, int64_t K, int accumulate) {
    const int64_t groups = (N + BF16_ROWS - 1) / BF16_ROWS;
#pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = g * BF16_ROWS;
        const int rows = N - n0 < BF16_ROWS ? (int)(N - n0) : BF16_ROWS;
        const uint16_t *w_rows[BF16_ROWS];
        for (int r = 0; r < BF16_ROWS; r++) w_rows[r] = w + (n0 + (r < rows ? r : rows - 1)) * K;
        /* bfloat16 rows are short streams that the hardware prefetchers pick up late (see dot_rows) */
        const char *next = g + 1 < groups && rows == BF16_ROWS ? (const char *)(w + (n0 + BF16_ROWS) * K) : NULL;
        for (int m = 0; m < M; m++) {  /* the first row m streams the weights, the others find them in L1 */
            float acc[BF16_ROWS];
            dot_rows_bf16dot(x + (int64_t)m * K, w_rows, K, m == 0 ? next : NULL, acc);
            store_rows(acc, rows, n0, bias, y, (int64_t)m * ldy, BF16, accumulate);
        }
    }
}

enum { LINEAR_AVX2 = 0, LINEAR_AVX512_BF16 = 1 };
static int linear_path = -1; /* -1: not decided yet */

/* The fastest bfloat16 GEMV this CPU runs, at most want (tests force the other). */
int kvg_select_linear_path(int want) {
    const int best = has_bf16_dot() ? LINEAR_AVX512_BF16 : LINEAR_AVX2;
    linear_path = want < best ? (want < 0 ? LINEAR_AVX2 : want) : best;
    return linear_path;
}

int kvg_linear_path(void) { return linear_path < 0 ? kvg_select_linear_path(LINEAR_AVX512_BF16) : linear_path; }

#include "tile_gemm_bf16dot.h" /* the tile layout on AVX512-BF16 dot products; kvg_tile_linear */

/*
 * y[m, n] = sum_k x[m, k] w[n, k] + bias[n], for m < M (a handful of decode rows).
 * x: [M, K] (row stride K), w: [N, K], bias: [N] or NULL, y: rows of stride ldy; all dtype dt.
 * accumulate: y[m, n] += (that value, rounded to dt), as torch's residual add of a linear's output.
 */
void kvg_linear(const void *x, const void *w, const void *bias, void *y, int64_t ldy, int M, int64_t N, int64_t K,
                int dt, int accumulate) {
    if (dt == BF16 && kvg_linear_path() == LINEAR_AVX512_BF16) {
        linear_bf16dot(x, w, bias, y, ldy, M, N, K, accumulate);
        return;
    }
    float *xf = malloc(sizeof(float) * M * K);
    to_f32(x, 0, xf, (int64_t)M * K, dt);
    if (dt == BF16)
        linear_impl(xf, w, bias, y, ldy, M, N, K, BF16, accumulate);
    else
        linear_impl(xf, w, bias, y, ldy, M, N, K, F32, accumulate);
    free(xf);
}

/* ---- small per-row ops ------------------------------------------------------------------- */

/*
 * out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w, one rounding (as torch.nn.functional.rms_norm).
 * Each row's sum of squares is one serial chain, in index order (summing in eight lanes instead
 * moved a greedy token of the int8 e2e prompts to float32's sixth choice, outside the top 5 that
 * test allows); NORM_ROWS rows advance together so that their chains overlap, and groups of rows
 * split across threads.
 */
#define NORM_ROWS 8 /* = the lanes of a vector (transpose8) */

/* r[j] lane i <- r[i] lane j */
INLINE void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int k = 0; k < 8; k += 2) t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]), t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
    for (int k = 0; k < 8; k += 4) {
        u[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44), u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
        u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44), u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++)
        r[k] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x20), r[k + 4] = _mm256_permute2f128_ps(u[k], u[k + 4], 0x31);
}

/* out = x / rms(x) * w, w of dtype wdt (the model's, or float32 for a norm whose scale is 1 + weight) */
static void rms_norm(const void *x, const void *w, int wdt, void *out, int M, int64_t E, float eps, int dt) {
    const int groups = (M + NORM_ROWS - 1) / NORM_ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)M * E > 8192)
    for (int g = 0; g < groups; g++) {
        const int m0 = g * NORM_ROWS, count = M - m0 < NORM_ROWS ? M - m0 : NORM_ROWS;
        float ss[NORM_ROWS];
        int64_t rows[NORM_ROWS];  /* rows past the last one repeat it; their sums are not used */
        for (int r = 0; r < NORM_ROWS; r++) rows[r] = (int64_t)(m0 + (r < count ? r : count - 1)) * E;
        /* Eight squares of each row, transposed so that vector j holds element i + j of every row: added in
         * j order, each lane's chain stays in index order (the squares are rounded before the shuffles, so
         * never fused into the adds). */
        __m256 ss8 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= E; i += 8) {
            __m256 sq[NORM_ROWS];
            for (int r = 0; r < NORM_ROWS; r++) {
                const __m256 v = load8(x, rows[r] + i, dt);
                sq[r] = _mm256_mul_ps(v, v);
            }
            transpose8(sq);
            for (int j = 0; j < 8; j++) ss8 = _mm256_add_ps(ss8, sq[j]);
        }
        _mm256_storeu_ps(ss, ss8);
        for (; i < E; i++)
            for (int r = 0; r < count; r++) {
                const float v = load1(x, rows[r] + i, dt);
                float square = v * v;
                __asm__("" : "+x"(square)); /* rounded, then added: never one fused multiply-add */
                ss[r] += square;
            }
        for (int r = 0; r < count; r++) {
            const int64_t row = (int64_t)(m0 + r) * E;
            const float inv = 1.0f / sqrtf(ss[r] / (float)E + eps);
            if (dt == F32 && wdt == F32) {
                const float *xs = (const float *)x + row, *ws = (const float *)w;
                float *o = (float *)out + row;
                for (int64_t j = 0; j < E; j++) o[j] = xs[j] * inv * ws[j];
            } else {  /* the same two products, eight at a time */
                const __m256 inv8 = _mm256_set1_ps(inv);
                int64_t j = 0;
                for (; j + 8 <= E; j += 8)
                    store8(out, row + j, _mm256_mul_ps(_mm256_mul_ps(load8(x, row + j, dt), inv8), load8(w, j, wdt)), dt);
                for (; j < E; j++) store1(out, row + j, load1(x, row + j, dt) * inv * load1(w, j, wdt), dt);
            }
        }
    }
}

void kvg_rms_norm(const void *x, const void *w, void *out, int M, int64_t E, float eps, int dt) {
    rms_norm(x, w, dt, out, M, E, eps, dt);
}

/* Gemma's: x / rms(x) * scale with scale = 1 + weight in float32, rounded once to dt (Hugging Face's order) */
void kvg_rms_norm_scaled(const void *x, const float *scale, void *out, int M, int64_t E, float eps, int dt) {
    rms_norm(x, scale, F32, out, M, E, eps, dt);
}

/*
 * Rotary embedding of the q and k heads of each row of qkv ([M, (H + 2 KV) D], row stride ldq),
 * in place, then k and v into their cache slots (caches: [slots, KV, D]).
 * cos/sin: [positions, D] tables of rope.cos_sin_tables (sin carries the sign of the first half).
 * x * cos is rounded to the dtype and rotate_half(x) * sin to float32, then they are added and rounded:
 * in float32 Hugging Face's arithmetic exactly (never a fused multiply-add), in bfloat16 torch.addcmul's.
 */
void kvg_rope_write_kv(void *qkv, int64_t ldq, const void *cos, const void *sin, const int64_t *positions,
                       const int64_t *slots, void *k_cache, void *v_cache, int M, int H, int KV, int D, int dt) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= 8)
    for (int m = 0; m < M; m++) {
        float x[1024];
        const int64_t row = (int64_t)m * ldq, table = positions[m] * D;
        for (int h = 0; h < H + KV; h++) {
            const int64_t head = row + (int64_t)h * D;
            to_f32(qkv, head, x, D, dt);
            /* rotate_half: -x[j + half] (sign in sin), then x[j - half] */
            int j = 0;
            for (; half % 8 == 0 && j < D; j += 8) {
                __m256 xc = round8(_mm256_mul_ps(_mm256_loadu_ps(x + j), load8(cos, table + j, dt)), dt);
                __m256 product = _mm256_mul_ps(_mm256_loadu_ps(x + (j < half ? j + half : j - half)), load8(sin, table + j, dt));
                __asm__("" : "+x"(xc), "+x"(product)); /* both rounded: GCC would contract intrinsics too */
                store8(qkv, head + j, _mm256_add_ps(xc, product), dt);
            }
            for (; j < D; j++) {
                float xc = round_to(x[j] * load1(cos, table + j, dt), dt);
                float product = x[j < half ? j + half : j - half] * load1(sin, table + j, dt);
                __asm__("" : "+x"(xc), "+x"(product)); /* both rounded, then added: never a fused multiply-add */
                store1(qkv, head + j, xc + product, dt);
            }
        }
        const int64_t size = (int64_t)KV * D * (dt == BF16 ? 2 : 4), slot = slots[m] * size;
        const char *k = (const char *)qkv + (row + (int64_t)H * D) * (dt == BF16 ? 2 : 4);
        memcpy((char *)k_cache + slot, k, size);
        memcpy((char *)v_cache + slot, k + size, size);
    }
}

/* ---- greedy sampling --------------------------------------------------------------------- */

/*
 * out[m] = argmax of row m of x ([M, N] of dtype dt, row stride ldx), as torch.argmax of the rows in
 * float32: the first index of the largest value, or of the first NaN when the row has one (bfloat16
 * widens to float32 exactly, so a bfloat16 row needs no float32 copy first). 32 lanes (four vectors)
 * each keep their first maximum; the lanes' winners are merged by value, then index. torch's own argmax
 * over a whole vocabulary is a visible share of a large batch's step (benchmarks/sampling_bench.py's greedy case).
 */
void kvg_argmax_rows(const void *x, int64_t ldx, int M, int64_t N, int64_t *out, int dt) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)M * N > 65536)
    for (int m = 0; m < M; m++) {
        const int64_t row = (int64_t)m * ldx;
        int64_t best = 0;
        int64_t i = 0;
        if (N >= 32) { /* four chains of eight lanes, 32 values a turn: one chain waited on its compare and blend */
            __m256 top[4], nan = _mm256_setzero_ps();
            __m256i at[4];
            for (int c = 0; c < 4; c++) {
                top[c] = load8(x, row + 8 * c, dt);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(top[c], top[c], _CMP_UNORD_Q));
                at[c] = _mm256_setr_epi32(8 * c, 8 * c + 1, 8 * c + 2, 8 * c + 3, 8 * c + 4, 8 * c + 5, 8 * c + 6,
                                          8 * c + 7);
            }
            __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i step = _mm256_set1_epi32(32);
            for (i = 32; i + 32 <= N; i += 32) {
                idx = _mm256_add_epi32(idx, step);
                for (int c = 0; c < 4; c++) {
                    const __m256 v = load8(x, row + i + 8 * c, dt);
                    const __m256 gt = _mm256_cmp_ps(v, top[c], _CMP_GT_OQ);
                    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                    top[c] = _mm256_blendv_ps(top[c], v, gt);
                    const __m256i here = _mm256_add_epi32(idx, _mm256_set1_epi32(8 * c));
                    at[c] = _mm256_castps_si256(
                        _mm256_blendv_ps(_mm256_castsi256_ps(at[c]), _mm256_castsi256_ps(here), gt));
                }
            }
            if (_mm256_movemask_ps(nan)) {  /* a NaN wins: the scalar scan below finds the first */
                i = 0;
            } else {  /* each lane holds its first maximum; the largest of them, the first on ties */
                float tops[32];
                int32_t ats[32];
                for (int c = 0; c < 4; c++) {
                    _mm256_storeu_ps(tops + 8 * c, top[c]);
                    _mm256_storeu_si256((__m256i *)(ats + 8 * c), at[c]);
                }
                best = ats[0];
                float leader = tops[0];
                for (int l = 1; l < 32; l++)
                    if (tops[l] > leader || (tops[l] == leader && ats[l] < best)) best = ats[l], leader = tops[l];
            }
        }
        for (; i < N; i++) {
            const float v = load1(x, row + i, dt);
            if (v != v) {
                best = i;
                break;
            }
            if (v > load1(x, row + best, dt)) best = i;
        }
        out[m] = best;
    }
}

/* ---- attention ------------------------------------------------------------------------------- */

#define CHUNK 128     /* most tokens per task: long contexts split across threads (split-KV), merged after */
#define MIN_CHUNK 32  /* fewest tokens per task when short contexts split further to give every thread work */

/*
 * hsum8 of eight vectors at once: lane i of the result is hsum8(v[i]), added in the same order
 * (halves, then lanes 0+2 and 1+3, then those two), so the sums are bitwise the same. A 4x4
 * transpose per 128-bit half takes the place of eight separate shuffle chains.
 */
INLINE __m256 hsum8x8(const __m256 v[8]) {
    __m256 w[4];
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20),
                             _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
    const __m256 t0 = _mm256_unpacklo_ps(w[0], w[1]), t1 = _mm256_unpackhi_ps(w[0], w[1]);
    const __m256 t2 = _mm256_unpacklo_ps(w[2], w[3]), t3 = _mm256_unpackhi_ps(w[2], w[3]);
    const __m256 c0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 c1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 c2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 c3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    return _mm256_add_ps(_mm256_add_ps(c0, c2), _mm256_add_ps(c1, c3));
}

INLINE float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

/* exp8 for one float (tails): the same arithmetic, so a score's weight does not depend on its lane. */
INLINE float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

/* exp8 over n floats, so that the tests can check it against a float64 exp. */
void kvg_exp(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] = exp1(x[i]);
}

/* exp16 over n floats where the CPU has AVX-512 (0 elsewhere, writing nothing), so that the tests can check its
   lanes against exp8's bit for bit. */
__attribute__((target(AVX512_TARGET))) static void exp16_all(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, exp16(_mm512_loadu_ps(x + i)));
    for (; i < n; i++) y[i] = exp1(x[i]);
}

int kvg_exp16(const float *x, float *y, int64_t n) {
    if (!__builtin_cpu_supports("avx512f")) return 0;
    exp16_all(x, y, n);
    return 1;
}

/* A row's values from i on, one at a time (the vector loops' tails, with the same arithmetic) */
INLINE void silu_mul_tail(const void *gate_up, void *out, int64_t g, int64_t o, int64_t i, int64_t I, int dt) {
    for (; i < I; i++) {
        const float gate = load1(gate_up, g + i, dt);
        store1(out, o + i, round_to(gate / (1.0f + exp1(-gate)), dt) * load1(gate_up, g + I + i, dt), dt);
    }
}

/*
 * out[m, i] = silu(gate_up[m, i]) * gate_up[m, I + i]: torch rounds silu's output, then the product.
 * silu(g) = g / (1 + exp(-g)) with exp8, eight at a time (libm's expf, one scalar call per value,
 * showed in large batches' steps); rows split across threads when there are enough of them. Where the
 * CPU has AVX-512, kvg_silu_mul takes silu_mul_avx512 (below): the same arithmetic sixteen at a time.
 */
static void silu_mul_avx2(const void *gate_up, void *out, int M, int64_t I, int dt) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)M * I > 8192)
    for (int m = 0; m < M; m++) {
        const int64_t g = (int64_t)m * 2 * I, o = (int64_t)m * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 gate = load8(gate_up, g + i, dt);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate));
            const __m256 silu = round8(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), dt);
            store8(out, o + i, _mm256_mul_ps(silu, load8(gate_up, g + I + i, dt)), dt);
        }
        silu_mul_tail(gate_up, out, g, o, i, I, dt);
    }
}

/* tanh of eight floats as sign(u) (1 - 2 / (exp(2 |u|) + 1)), with exp8 */
INLINE __m256 tanh8(__m256 u) {
    const __m256 sign = _mm256_set1_ps(-0.0f), a = _mm256_andnot_ps(sign, u); /* |u| */
    const __m256 e = exp8(_mm256_add_ps(a, a));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    return _mm256_or_ps(t, _mm256_and_ps(u, sign));
}

/*
 * Gemma's MLP activation: out[m, i] = gelu_tanh(gate_up[m, i]) * gate_up[m, I + i], torch's
 * F.gelu(gate, approximate="tanh").mul_(up): the activation rounded, then the product. The activation in
 * torch's order, in float32: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), no fused multiply-adds; tanh from
 * exp8 (tanh8), where torch has its own, so a value rounded to bfloat16 lands one step away now and then.
 */
INLINE __m256 gelu_tanh8(__m256 x) {
    const __m256 beta = _mm256_set1_ps((float)(M_SQRT2 * M_2_SQRTPI * 0.5)), kappa = _mm256_set1_ps(0.044715f);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 inner = _mm256_mul_ps(beta, _mm256_add_ps(x, _mm256_mul_ps(kappa, cube)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(_mm256_set1_ps(1.0f), tanh8(inner)));
}

void kvg_gelu_tanh_mul(const void *gate_up, void *out, int M, int64_t I, int dt) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)M * I > 8192)
    for (int m = 0; m < M; m++) {
        const int64_t g = (int64_t)m * 2 * I, o = (int64_t)m * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 gelu = round8(gelu_tanh8(load8(gate_up, g + i, dt)), dt);
            store8(out, o + i, _mm256_mul_ps(gelu, load8(gate_up, g + I + i, dt)), dt);
        }
        if (i < I) { /* the tail through the same vector arithmetic (a scalar form could fuse a multiply-add) */
            float x[8] = {0}, gelu[8];
            for (int64_t j = i; j < I; j++) x[j - i] = load1(gate_up, g + j, dt);
            _mm256_storeu_ps(gelu, round8(gelu_tanh8(_mm256_loadu_ps(x)), dt));
            for (int64_t j = i; j < I; j++) store1(out, o + j, gelu[j - i] * load1(gate_up, g + I + j, dt), dt);
        }
    }
}

/* x[i] += y[i] for n values of dt, rounded as torch's x + y */
void kvg_add(void *x, const void *y, int64_t n, int dt) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(x, i, _mm256_add_ps(load8(x, i, dt), load8(y, i, dt)), dt);
    for (; i < n; i++) store1(x, i, load1(x, i, dt) + load1(y, i, dt), dt);
}

#define SPAN 8 /* tokens whose keys and values are taken together */
#define AHEAD 1 /* spans prefetched ahead: one span beats the hardware prefetchers alone, more gains nothing */

/*
 * The cache rows (in elements, rows of `row`) of tokens t .. t + SPAN - 1 of one sequence; tokens from
 * t1 on get token t's row. One division per span: a division per token cost as much as the span's math.
 */
INLINE void span_rows(const int32_t *table, int t, int t1, int block_size, int64_t row, int64_t rows[SPAN]) {
    int block = t / block_size, offset = t % block_size;
    for (int i = 0; i < SPAN; i++) {
        rows[i] = t + i < t1 ? ((int64_t)table[block] * block_size + offset) * row : rows[0];
        if (++offset == block_size) offset = 0, block++;
    }
}

enum { TO_L1, TO_L2 };

/* Asks for the cache rows of tokens [t, min(t + SPAN, t1)) of one sequence (every KV head) in L1 or L2. */
INLINE void prefetch_span(const void *cache, const int32_t *table, int t, int t1, int block_size, int64_t row,
                          int es, int level) {
    if (t >= t1) return;
    int64_t rows[SPAN];
    span_rows(table, t, t1, block_size, row, rows);
    const int span = t1 - t < SPAN ? t1 - t : SPAN;
    for (int i = 0; i < span; i++)
        for (int64_t b = 0; b < row * es; b += 64) {
            const char *line = (const char *)cache + rows[i] * es + b;
            if (level == TO_L2) _mm_prefetch(line, _MM_HINT_T1);
            else _mm_prefetch(line, _MM_HINT_T0);
        }
}

/*
 * Per head h, the chunk's n scores (scores + h * CHUNK) become exp(score - max), the rest of the last
 * span 0; part[h * (D + 2)] gets the max and part[h * (D + 2) + 1] the sum of the exps.
 */
INLINE void softmax_chunk(float *scores, int n, int H, int D, float *part) {
    const int n8 = n / 8 * 8;
    for (int h = 0; h < H; h++) {
        float *s = scores + h * CHUNK;
        __m256 top8 = _mm256_set1_ps(-INFINITY);
        for (int i = 0; i < n8; i += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + i));
        float top = hmax8(top8);
        for (int i = n8; i < n; i++) top = s[i] > top ? s[i] : top;
        top8 = _mm256_set1_ps(top);
        __m256 sum8 = _mm256_setzero_ps();
        for (int i = 0; i < n8; i += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), top8));
            _mm256_storeu_ps(s + i, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum8(sum8);
        for (int i = n8; i < n; i++) sum += (s[i] = exp1(s[i] - top));
        for (int i = n; i % SPAN; i++) s[i] = 0.0f;  /* the last span's missing tokens weigh nothing */
        part[(int64_t)h * (D + 2)] = top, part[(int64_t)h * (D + 2) + 1] = sum;
    }
}

/*
 * Tokens [t0, t1) of one sequence for all H query heads: writes, per head h,
 * part[h] = (max score, sum of exp(score - max), sum of exp(score - max) * v[0:D]).
 * The cache holds a token's keys for all KV heads in one row of KV * D, so a task reads whole
 * rows, block after block, in address order (one task per KV head read a third of every row and
 * left the hardware prefetchers short streams). Tokens go SPAN at a time: a query chunk is loaded
 * once for SPAN keys and their SPAN dot products reduced together (hsum8x8); the G heads of a KV
 * head follow one another, so its keys are read from L1 after the first. scores: H * CHUNK floats.
 */
INLINE void attention_chunk(const float *qf, const void *k_cache, const void *v_cache, const int32_t *table,
                            int t0, int t1, int H, int KV, int D, int block_size, float scale, float *scores,
                            float *part, int dt) {
    const int n = t1 - t0, d8 = D / 8 * 8, G = H / KV;
    const int64_t row = (int64_t)KV * D;
    const int es = dt == BF16 ? 2 : 4;
    int64_t rows[SPAN];
    for (int a = 0; a < AHEAD; a++) prefetch_span(k_cache, table, t0 + a * SPAN, t1, block_size, row, es, TO_L1);
    for (int t = t0; t < t1; t += SPAN) {
        const int span = t1 - t < SPAN ? t1 - t : SPAN;
        prefetch_span(k_cache, table, t + AHEAD * SPAN, t1, block_size, row, es, TO_L1);
        prefetch_span(v_cache, table, t, t1, block_size, row, es, TO_L2);  /* for the value pass */
        span_rows(table, t, t1, block_size, row, rows);  /* past the span: its first row (computed, not kept) */
        for (int h = 0; h < H; h++) {
            const float *qh = qf + (int64_t)h * D;
            const int64_t head = (int64_t)(h / G) * D;
            __m256 acc[SPAN];
            for (int i = 0; i < SPAN; i++) acc[i] = _mm256_setzero_ps();
            for (int j = 0; j < d8; j += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + j);
                for (int i = 0; i < SPAN; i++)
                    acc[i] = _mm256_fmadd_ps(qv, load8(k_cache, rows[i] + head + j, dt), acc[i]);
            }
            float sums[SPAN];
            _mm256_storeu_ps(sums, hsum8x8(acc));
            for (int i = 0; i < span; i++) {
                float s = sums[i];
                for (int j = d8; j < D; j++) s += qh[j] * load1(k_cache, rows[i] + head + j, dt);
                scores[h * CHUNK + (t - t0) + i] = s * scale;
            }
        }
    }
    for (int a = 0; a < AHEAD; a++) prefetch_span(v_cache, table, t0 + a * SPAN, t1, block_size, row, es, TO_L1);
    softmax_chunk(scores, n, H, D, part);
    for (int h = 0; h < H; h++) memset(part + (int64_t)h * (D + 2) + 2, 0, sizeof(float) * D);
    for (int t = t0; t < t1; t += SPAN) {
        const int span = t1 - t < SPAN ? t1 - t : SPAN;
        prefetch_span(v_cache, table, t + AHEAD * SPAN, t1, block_size, row, es, TO_L1);
        span_rows(table, t, t1, block_size, row, rows);  /* past the span: its first row, with weight 0 */
        for (int h = 0; h < H; h++) {
            const int64_t head = (int64_t)(h / G) * D;
            float *out = part + (int64_t)h * (D + 2) + 2;
            const float *p = scores + h * CHUNK + (t - t0);
            __m256 w[SPAN];
            for (int i = 0; i < SPAN; i++) w[i] = _mm256_set1_ps(p[i]);
            for (int j = 0; j < d8; j += 8) {
                __m256 o = _mm256_loadu_ps(out + j);
                for (int i = 0; i < SPAN; i++) o = _mm256_fmadd_ps(w[i], load8(v_cache, rows[i] + head + j, dt), o);
                _mm256_storeu_ps(out + j, o);
            }
            for (int j = d8; j < D; j++)
                for (int i = 0; i < span; i++) out[j] += p[i] * load1(v_cache, rows[i] + head + j, dt);
        }
    }
}


/*
 * The same chunk with 16-float vectors (AVX-512F), for D = 16 * NC (head sizes 64 and 128);
 * kvg_decode_attention takes it where the CPU has AVX-512 (kvg_select_attention_path). Keys: a
 * query chunk of 16 against SPAN keys, the 16 lanes folded to 8 before hsum8x8. Values: per head,
 * the output's NC vectors stay in registers over the chunk's tokens (one load and one multiply-add
 * per vector and token, no loads and stores of the output between spans); the G heads of a KV
 * head read its values from L1 after the first. Values are summed in token order, as above; the
 * scores differ from the AVX2 chunk's in the order of their partial sums only. On a cold cache it
 * reads faster than the AVX2 chunk, though still short of a plain read of the same rows.
 */
#define AVX512_FN AVX512_INLINE /* (vector_math.h) */

AVX512_FN __m512 load16(const void *p, int64_t i, int dt) {
    if (dt == BF16) return bf16x16_to_f32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_loadu_ps((const float *)p + i);
}

AVX512_FN __m256 fold16(__m512 v) {  /* lanes i + (i + 8) */
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

AVX512_FN void store16(void *p, int64_t i, __m512 v, int dt) {
    if (dt == BF16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), f32x16_to_bf16(v));
    else
        _mm512_storeu_ps((float *)p + i, v);
}

/* silu_mul_avx2 sixteen at a time (a prefill chunk's activations showed at 8% of a mixed workload's steps) */
__attribute__((target(AVX512_TARGET))) static void silu_mul_avx512(const void *gate_up, void *out, int M, int64_t I,
                                                                  int dt) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if ((int64_t)M * I > 8192)
    for (int m = 0; m < M; m++) {
        const int64_t g = (int64_t)m * 2 * I, o = (int64_t)m * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {
            const __m512 gate = load16(gate_up, g + i, dt);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
            __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            if (dt == BF16) silu = round16_bf16(silu);
            store16(out, o + i, _mm512_mul_ps(silu, load16(gate_up, g + I + i, dt)), dt);
        }
        silu_mul_tail(gate_up, out, g, o, i, I, dt);
    }
}

void kvg_silu_mul(const void *gate_up, void *out, int M, int64_t I, int dt) {
    static int avx512 = -1;
    if (avx512 < 0) avx512 = __builtin_cpu_supports("avx512f");
    if (avx512) silu_mul_avx512(gate_up, out, M, I, dt);
    else silu_mul_avx2(gate_up, out, M, I, dt);
}

AVX512_FN void attention_chunk16(const float *qf, const void *k_cache, const void *v_cache, const int32_t *table,
                                 int t0, int t1, int H, int KV, const int NC, int block_size, float scale,
                                 float *scores, float *part, int dt) {
    const int D = 16 * NC, n = t1 - t0, G = H / KV;
    const int64_t row = (int64_t)KV * D;
    const int es = dt == BF16 ? 2 : 4;
    int64_t rows[SPAN];
    for (int a = 0; a < AHEAD; a++) prefetch_span(k_cache, table, t0 + a * SPAN, t1, block_size, row, es, TO_L1);
    for (int t = t0; t < t1; t += SPAN) {
        const int span = t1 - t < SPAN ? t1 - t : SPAN;
        prefetch_span(k_cache, table, t + AHEAD * SPAN, t1, block_size, row, es, TO_L1);
        prefetch_span(v_cache, table, t, t1, block_size, row, es, TO_L2);  /* for the value pass */
        span_rows(table, t, t1, block_size, row, rows);
        for (int h = 0; h < H; h++) {
            const float *qh = qf + (int64_t)h * D;
            const int64_t head = (int64_t)(h / G) * D;
            __m512 acc[SPAN];
            for (int i = 0; i < SPAN; i++) acc[i] = _mm512_setzero_ps();
            for (int c = 0; c < NC; c++) {
                const __m512 qv = _mm512_loadu_ps(qh + 16 * c);
                for (int i = 0; i < SPAN; i++)
                    acc[i] = _mm512_fmadd_ps(qv, load16(k_cache, rows[i] + head + 16 * c, dt), acc[i]);
            }
            __m256 folded[SPAN];
            for (int i = 0; i < SPAN; i++) folded[i] = fold16(acc[i]);
            float sums[SPAN];
            _mm256_storeu_ps(sums, hsum8x8(folded));
            for (int i = 0; i < span; i++) scores[h * CHUNK + (t - t0) + i] = sums[i] * scale;
        }
    }
    softmax_chunk(scores, n, H, D, part);
    for (int h = 0; h < H; h++) {
        const int64_t head = (int64_t)(h / G) * D;
        const float *p = scores + h * CHUNK;
        __m512 o[NC];
        for (int c = 0; c < NC; c++) o[c] = _mm512_setzero_ps();
        int block = t0 / block_size, offset = t0 % block_size;
        for (int t = 0; t < n; t++) {
            const int64_t at = ((int64_t)table[block] * block_size + offset) * row + head;
            const __m512 w = _mm512_set1_ps(p[t]);
            for (int c = 0; c < NC; c++) o[c] = _mm512_fmadd_ps(w, load16(v_cache, at + 16 * c, dt), o[c]);
            if (++offset == block_size) offset = 0, block++;
        }
        float *out = part + (int64_t)h * (D + 2) + 2;
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(out + 16 * c, o[c]);
    }
}

__attribute__((target(AVX512_TARGET))) static void attention_chunk_avx512(
    const float *qf, const void *k_cache, const void *v_cache, const int32_t *table, int t0, int t1, int H, int KV,
    int D, int block_size, float scale, float *scores, float *part, int dt) {
#define CHUNK16(NC, DT) \
    attention_chunk16(qf, k_cache, v_cache, table, t0, t1, H, KV, NC, block_size, scale, scores, part, DT)
    if (dt == BF16 && D == 64) CHUNK16(4, BF16);
    else if (dt == BF16) CHUNK16(8, BF16);
    else if (D == 64) CHUNK16(4, F32);
    else CHUNK16(8, F32);
#undef CHUNK16
}

#include "attention_bf16.h"

enum { ATTENTION_AVX2 = 0, ATTENTION_AVX512 = 1, ATTENTION_AVX512_BF16 = 2 };
static int attention_path = -1; /* -1: not decided yet */

/* The fastest attention path this CPU runs, at most want (tests force the slower ones). */
int kvg_select_attention_path(int want) {
    __builtin_cpu_init();
    const int best = !__builtin_cpu_supports("avx512f") ? ATTENTION_AVX2
                     : has_bf16_dot()                    ? ATTENTION_AVX512_BF16
                                                         : ATTENTION_AVX512;
    attention_path = want < best ? (want < 0 ? ATTENTION_AVX2 : want) : best;
    return attention_path;
}

/* The attention path in use: the fastest this CPU runs, unless a test chose another. */
int kvg_attention_path(void) {
    return attention_path < 0 ? kvg_select_attention_path(ATTENTION_AVX512_BF16) : attention_path;
}
/*
 * One new query token per sequence over its paged cache (decode).
 * q: [B, H, D] (row stride ldq), caches: [num_blocks, block_size, KV, D], block_tables: [B, ldt] int32,
 * seq_lens: [B] int32, out: [B, H, D] (row stride ldo). The G = H / KV query heads of a KV head
 * share its keys and values. Each (sequence, chunk of tokens) is a task for all heads; chunks are
 * CHUNK tokens, or fewer (down to MIN_CHUNK) when a few short sequences would leave threads idle.
 * The chunks' partial softmax sums are merged per head. float32 throughout, the output rounded
 * once (as torch's SDPA). window > 0 (a sliding-window layer): only the last window tokens of each
 * sequence are read; blocks before them may hold another request's tokens by now.
 */
static inline int window_start(int seq_len, int window) { return window > 0 && seq_len > window ? seq_len - window : 0; }

/* How a step's sequences split into tasks: chunks of up to chunk tokens, chunks of them in the longest window. */
typedef struct {
    int chunk, chunks;
} AttentionSplit;

static AttentionSplit attention_split(const int32_t *seq_lens, int B, int window) {
    int max_len = 0;  /* tokens read, at most */
    for (int b = 0; b < B; b++) {
        const int len = seq_lens[b] - window_start(seq_lens[b], window);
        max_len = len > max_len ? len : max_len;
    }
    int chunk = CHUNK;
    const int wanted = 4 * num_threads;  /* tasks enough for dynamic scheduling to even the threads out */
    if ((int64_t)B * ((max_len + CHUNK - 1) / CHUNK) < wanted) {
        const int per_seq = (wanted + B - 1) / B;
        chunk = ((max_len + per_seq - 1) / per_seq + SPAN - 1) / SPAN * SPAN;
        chunk = chunk < MIN_CHUNK ? MIN_CHUNK : chunk > CHUNK ? CHUNK : chunk;
    }
    return (AttentionSplit){chunk, (max_len + chunk - 1) / chunk};
}

/* Floats of a thread's scratch: the query in float32 (H * D), then H * CHUNK scores or H * (D + 2) for the
   bfloat16 chunk (D <= CHUNK). */
static int64_t attention_scratch(int H, int D) { return (int64_t)H * D + (int64_t)H * (CHUNK + 2); }

/* One task: chunk c of sequence b's tokens for all its heads, into part (max, sum, D values per head).
   qf: attention_scratch(H, D) floats. */
static void attention_task(int b, int c, AttentionSplit split, const void *q, int64_t ldq, const void *k_cache,
                           const void *v_cache, const int32_t *block_tables, int64_t ldt, const int32_t *seq_lens,
                           int H, int KV, int D, int block_size, float scale, int dt, int window, float *part,
                           float *qf) {
    float *scores = qf + (int64_t)H * D;
    const int t0 = window_start(seq_lens[b], window) + c * split.chunk;
    const int t1 = t0 + split.chunk < seq_lens[b] ? t0 + split.chunk : seq_lens[b];
    const int32_t *table = block_tables + b * ldt;
    if (attention_path == ATTENTION_AVX512_BF16 && dt == BF16 && (D == 64 || D == 128)) {
        attention_chunk_bf16((const uint16_t *)q + b * ldq, k_cache, v_cache, table, t0, t1, H, KV, D, block_size,
                             scale, scores, part);
        return;
    }
    to_f32(q, b * ldq, qf, (int64_t)H * D, dt);
    if (attention_path >= ATTENTION_AVX512 && (D == 64 || D == 128))
        attention_chunk_avx512(qf, k_cache, v_cache, table, t0, t1, H, KV, D, block_size, scale, scores, part, dt);
    else if (dt == BF16)
        attention_chunk(qf, k_cache, v_cache, table, t0, t1, H, KV, D, block_size, scale, scores, part, BF16);
    else
        attention_chunk(qf, k_cache, v_cache, table, t0, t1, H, KV, D, block_size, scale, scores, part, F32);
}

/* The chunks of split that sequence b's window of its tokens takes: one at least (seq_lens are >= 1) */
static inline int chunks_of(AttentionSplit split, const int32_t *seq_lens, int b, int window) {
    return (seq_lens[b] - window_start(seq_lens[b], window) + split.chunk - 1) / split.chunk;
}

/* The parts of sequence b's chunks for head h (chunks of them, the first at first) merged into out, rounded once. */
static void attention_merge(int b, int h, int chunks, const float *first, void *out, int64_t ldo, int H, int D,
                            int dt) {
    const int64_t part_size = (int64_t)H * (D + 2);
    first += (int64_t)h * (D + 2);
    float top = -INFINITY, sum = 0.0f;
    for (int c = 0; c < chunks; c++) top = first[c * part_size] > top ? first[c * part_size] : top;
    float acc[1024];
    for (int j = 0; j < D; j++) acc[j] = 0.0f;
    for (int c = 0; c < chunks; c++) {
        const float *part = first + c * part_size;
        const float w = exp1(part[0] - top);
        sum += part[1] * w;
        for (int j = 0; j < D; j++) acc[j] += part[2 + j] * w;
    }
    for (int j = 0; j < D; j++) store1(out, b * ldo + (int64_t)h * D + j, acc[j] / sum, dt);
}

void kvg_decode_attention(const void *q, int64_t ldq, const void *k_cache, const void *v_cache,
                          const int32_t *block_tables, int64_t ldt, const int32_t *seq_lens, void *out, int64_t ldo,
                          int B, int H, int KV, int D, int block_size, float scale, int dt, int window) {
    if (attention_path < 0) kvg_select_attention_path(ATTENTION_AVX512_BF16);
    const AttentionSplit split = attention_split(seq_lens, B, window);
    const int64_t part_size = (int64_t)H * (D + 2);
    /* Only each sequence's own chunks are tasks (the split is sized by the longest): sequence b's are tasks
       first[b] .. first[b + 1] - 1, their parts in that order. Tasks past shorter sequences' ends, and their
       merge, were ~3% of the attention of 64 sequences of 76-768 tokens. */
    int *first = malloc(sizeof(int) * (B + 1));
    first[0] = 0;
    for (int b = 0; b < B; b++) first[b + 1] = first[b] + chunks_of(split, seq_lens, b, window);
    const int tasks = first[B];
    int *sequence = malloc(sizeof(int) * tasks);
    for (int b = 0; b < B; b++)
        for (int task = first[b]; task < first[b + 1]; task++) sequence[task] = b;
    float *parts = malloc(sizeof(float) * tasks * part_size);
    /* The merge, D multiply-adds per chunk and head, shares the tasks' team: on its own, serial below some size
       to spare a team's start, it took ~2.5% of a 64-row step. */
#pragma omp parallel num_threads(num_threads)
    {
        float *qf = malloc(sizeof(float) * attention_scratch(H, D));
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tasks; task++) {
            const int b = sequence[task];
            attention_task(b, task - first[b], split, q, ldq, k_cache, v_cache, block_tables, ldt, seq_lens, H, KV, D,
                           block_size, scale, dt, window, parts + task * part_size, qf);
        }
        free(qf);
#pragma omp for schedule(static)
        for (int head = 0; head < B * H; head++) {
            const int b = head / H;
            attention_merge(b, head % H, first[b + 1] - first[b], parts + first[b] * part_size, out, ldo, H, D, dt);
        }
    }
    free(parts);
    free(sequence);
    free(first);
}

#include "decode_layers.h" /* a whole decode step's layers in one call */
