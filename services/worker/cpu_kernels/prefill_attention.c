/*
 * Causal attention of prefill chunks over the paged KV cache, for x86-64 CPUs with AVX-512F.
 * Built at first use by library.py (cc -O3 -mavx512f -mavx2 -mfma -fopenmp) and loaded only where
 * the CPU has AVX-512F; elsewhere prefill chunks keep torch's SDPA.
 *
 * Why: torch's fused CPU attention, on prompts of up to a few hundred tokens, runs far below what
 * the same cores give a bf16 GEMM, and it needs the context gathered out of the blocks and every KV
 * head repeated per query head first. On a workload of mixed prompt lengths that made attention a
 * sizeable share of the worker's time.
 *
 * Layout: a task is 16 consecutive query rows of one sequence against one KV head, for the G query
 * heads sharing it. The 16 rows sit in the 16 lanes of a vector: a key's score for all 16 rows is D
 * multiply-adds of a transposed query block by the key's elements (broadcast), so no horizontal sums;
 * the softmax runs down the lanes; the output, D vectors of 16 rows, takes a value's elements the same
 * way. Keys and values are converted to float32 once per tile of TILE tokens and shared by the G
 * heads. Two passes, as the decode kernel: every score first (the exact max), then the values in
 * token order. float32 throughout; the output is rounded to the model dtype once (as SDPA). On
 * bfloat16 caches, where the CPU has AMX-BF16, the same tasks multiply on AMX tiles (task_amx), and where it
 * has AVX512-BF16 without AMX, on VDPBF16PS dot products over the same bfloat16 pairs (task_bf16dot): SmolLM2
 * prefill steps (2 threads, Zen 5, alternated in one process) 6% faster than the float32 task's at 256-token
 * prompts, 11% at 512, 2% at 64.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "amx_tiles.h"
#include "scalar.h"
#include "vector_math.h"

#define ROWS 16      /* query rows per task: the lanes of a vector */
#define TILE 64      /* keys converted to float32 at a time (2 x 16 KB at D = 64) */
#define MAX_D 256

static int num_threads = 1;

void kvp_set_num_threads(int n) { num_threads = n > 0 ? n : 1; }

/* In-register transpose of a 16 x 16 block: r[i] lane j becomes r[j] lane i. */
INLINE void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    __m512 u[16];  /* u[4i + j], 128-bit lane L: column 4L + j of rows 4i .. 4i + 3 */
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; j++) {
        const __m512 v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), v2 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);
        const __m512 w1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
        const __m512 w2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
        r[j] = _mm512_shuffle_f32x4(v1, w1, 0x88), r[8 + j] = _mm512_shuffle_f32x4(v1, w1, 0xdd);
        r[4 + j] = _mm512_shuffle_f32x4(v2, w2, 0x88), r[12 + j] = _mm512_shuffle_f32x4(v2, w2, 0xdd);
    }
}

INLINE __m512 load16(const void *p, int64_t i, int dt) {
    if (dt == BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}

/* Stores 16 floats as dtype dt, bfloat16 rounded to nearest even as f32_to_bf16 (scalar.h). */
INLINE void store16(void *p, int64_t i, __m512 x, int dt) {
    if (dt != BF16) {
        _mm512_storeu_ps((float *)p + i, x);
        return;
    }
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    h = _mm512_mask_mov_epi32(h, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm512_cvtepi32_epi16(h));
}

/* dst[(t - t0) * D ...] = the cache rows of tokens [t0, t1) for the KV head at `head`, as float32. */
INLINE void load_tile(const void *cache, const int32_t *table, int t0, int t1, int block_size, int64_t row,
                      int64_t head, int D, int dt, float *dst) {
    for (int t = t0; t < t1; t++, dst += D) {
        const int64_t at = ((int64_t)table[t / block_size] * block_size + t % block_size) * row + head;
        for (int d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, load16(cache, at + d, dt));
    }
}

/*
 * Softmax down each lane of scores s [t][ROWS], t < n, in place: exp(score - the lane's max), keys a lane
 * does not see (past its position, from unmasked on) 0, and zeros on to end (padding); returns the lanes'
 * sums. Every lane sees key 0, so its max is finite.
 */
INLINE __m512 softmax_lanes(float *s, int n, int end, int unmasked, __m512i pos) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t++) top = _mm512_max_ps(top, _mm512_loadu_ps(s + (int64_t)t * ROWS));
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < n; t++) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + (int64_t)t * ROWS), top));
        if (t >= unmasked) e = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(t)), e);
        _mm512_storeu_ps(s + (int64_t)t * ROWS, e);
        sum = _mm512_add_ps(sum, e);
    }
    for (int t = n; t < end; t++) _mm512_storeu_ps(s + (int64_t)t * ROWS, _mm512_setzero_ps());
    return sum;
}

/*
 * One task: query rows [r0, r0 + ROWS) of a sequence (fewer at its end: the missing lanes repeat
 * the last row and are not stored) at positions first + r, against KV head g. q rows: q + row * ldq,
 * head h at h * D; out likewise with ldo. scratch: see kvp_prefill_attention.
 */
static void task(const void *q, int64_t ldq, const void *k_cache, const void *v_cache, const int32_t *table,
                 int first, int r0, int nrows, int g, int H, int KV, int D, int block_size, float scale,
                 void *out, int64_t ldo, int dt, float *scratch, int max_keys) {
    const int G = H / KV;
    const int64_t row = (int64_t)KV * D, head = (int64_t)g * D;
    const int last = first + r0 + nrows - 1;  /* the last row's position: keys [0, last] matter */
    const int n = last + 1;
    float *qt = scratch;                          /* [G][D][ROWS]: transposed queries */
    float *s = qt + (int64_t)G * D * ROWS;        /* [G][max_keys][ROWS]: scores, then weights */
    float *o = s + (int64_t)G * max_keys * ROWS;  /* [G][D][ROWS]: outputs */
    float *kv = o + (int64_t)G * D * ROWS;        /* [TILE][D]: a tile of keys or values */
    for (int hh = 0; hh < G; hh++)
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 block[16];
            for (int r = 0; r < ROWS; r++) {
                const int rr = r < nrows ? r : nrows - 1;
                block[r] = load16(q, (int64_t)(r0 + rr) * ldq + (int64_t)(g * G + hh) * D + d0, dt);
            }
            transpose16(block);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(qt + ((int64_t)hh * D + d0 + i) * ROWS, block[i]);
        }
    /* Lane r sees keys up to position first + r0 + min(r, nrows - 1). */
    int lane_pos[ROWS];
    for (int r = 0; r < ROWS; r++) lane_pos[r] = first + r0 + (r < nrows ? r : nrows - 1);
    const __m512i pos = _mm512_loadu_si512(lane_pos);
    const int unmasked = first + r0;  /* keys below this are seen by every lane */

    /* Pass 1: scores. */
    for (int t0 = 0; t0 < n; t0 += TILE) {
        const int t1 = t0 + TILE < n ? t0 + TILE : n;
        load_tile(k_cache, table, t0, t1, block_size, row, head, D, dt, kv);
        for (int hh = 0; hh < G; hh++) {
            const float *qh = qt + (int64_t)hh * D * ROWS;
            float *sh = s + (int64_t)hh * max_keys * ROWS;
            for (int t = t0; t < t1; t++) {
                const float *k = kv + (int64_t)(t - t0) * D;
                __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
                for (int d = 0; d < D; d += 2) {
                    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + (int64_t)d * ROWS), _mm512_set1_ps(k[d]), a0);
                    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + (int64_t)(d + 1) * ROWS), _mm512_set1_ps(k[d + 1]), a1);
                }
                __m512 score = _mm512_mul_ps(_mm512_add_ps(a0, a1), _mm512_set1_ps(scale));
                if (t >= unmasked) {  /* the diagonal: lanes before this key's position do not see it */
                    const __mmask16 hidden = _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(t));
                    score = _mm512_mask_mov_ps(score, hidden, _mm512_set1_ps(-INFINITY));
                }
                _mm512_storeu_ps(sh + (int64_t)t * ROWS, score);
            }
        }
    }
    /* Softmax down each lane. Hidden keys weigh 0. */
    __m512 sums[8];  /* G <= 8 (the library checks) */
    for (int hh = 0; hh < G; hh++) {
        sums[hh] = softmax_lanes(s + (int64_t)hh * max_keys * ROWS, n, n, unmasked, pos);
        float *oh = o + (int64_t)hh * D * ROWS;
        for (int i = 0; i < D * ROWS; i += 16) _mm512_storeu_ps(oh + i, _mm512_setzero_ps());
    }
    /* Pass 2: values, in token order, 16 output dims (16 vectors of rows) at a time. */
    for (int t0 = 0; t0 < n; t0 += TILE) {
        const int t1 = t0 + TILE < n ? t0 + TILE : n;
        load_tile(v_cache, table, t0, t1, block_size, row, head, D, dt, kv);
        for (int hh = 0; hh < G; hh++) {
            const float *sh = s + (int64_t)hh * max_keys * ROWS;
            float *oh = o + (int64_t)hh * D * ROWS;
            for (int d0 = 0; d0 < D; d0 += 16) {
                __m512 acc[16];
                for (int i = 0; i < 16; i++) acc[i] = _mm512_loadu_ps(oh + (int64_t)(d0 + i) * ROWS);
                for (int t = t0; t < t1; t++) {
                    const __m512 w = _mm512_loadu_ps(sh + (int64_t)t * ROWS);
                    const float *v = kv + (int64_t)(t - t0) * D + d0;
                    for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(w, _mm512_set1_ps(v[i]), acc[i]);
                }
                for (int i = 0; i < 16; i++) _mm512_storeu_ps(oh + (int64_t)(d0 + i) * ROWS, acc[i]);
            }
        }
    }
    for (int hh = 0; hh < G; hh++) {
        const float *oh = o + (int64_t)hh * D * ROWS;
        float lane_sums[ROWS];
        _mm512_storeu_ps(lane_sums, sums[hh]);
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 block[16];
            for (int i = 0; i < 16; i++) block[i] = _mm512_loadu_ps(oh + (int64_t)(d0 + i) * ROWS);
            transpose16(block);
            for (int r = 0; r < nrows; r++) {
                const int64_t at = (int64_t)(r0 + r) * ldo + (int64_t)(g * G + hh) * D + d0;
                store16(out, at, _mm512_div_ps(block[r], _mm512_set1_ps(lane_sums[r])), dt);
            }
        }
    }
}

/* Words per row of a sequence's transposed values: its keys rounded up to a whole A tile (32). */
static int vt_words(int keys) { return (keys + 31) / 32 * 16; }

/* Whether sequence b has more than one task per KV head, which then share its transposed values. */
static int shares_values(const int32_t *query_start, int b) {
    return query_start[b + 1] - query_start[b] > ROWS;
}

#ifdef HAVE_AMX
/* Helpers of the bfloat16 tasks (task_amx, task_bf16dot): no AMX instruction of their own. */
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define BF16_INLINE __attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline

/*
 * The same task on AMX-BF16 tiles, for bfloat16 caches whose blocks hold a multiple of 16 tokens and D a
 * multiple of 32. Scores S = K Q^T: 16 keys of a block are one A tile straight from the cache (rows of
 * KV * D apart), shared by up to four heads; the task's queries one B tile per 32 elements (transposed as
 * pairs once: row p, column r is row r's elements 2p, 2p + 1). The scores come out as [key][row] vectors,
 * so the masks and the softmax run down the lanes as in the float32 task; each head's max is taken as its
 * scores leave the tiles. Values: O^T = V^T P^T, so that neither the weights nor the values are transposed
 * per task. The weights, rounded to bfloat16 (as the decode kernel's bfloat16 path, torch's flash
 * attention on CPU and vLLM's paged attention round them), go straight from two keys' score vectors to
 * one B row (row r: the pair of its weights); the values' A tiles (16 elements x 32 keys) come from the
 * sequence's transposed values (values_transposed), built once per call for all of its tasks, or by its
 * only task for a KV head. Up to four float32 C tiles (64 output elements x 16 rows) accumulate at a time;
 * the output is transposed back at the end (a few rows gathered instead). Sums are float32; what differs
 * from the float32 task is the weights' rounding, the order of the sums and that the tiles flush
 * subnormals to zero. Against transposing each task's weights and interleaving its values for itself
 * (SmolLM2's heads, 30 layers): 12% less time for 256-token prompts, 32% for one of 2048, 13% for single
 * rows after 300 cached tokens; 3-7% more for 64-token prompts, whose few short tasks save less than the
 * transposes cost.
 */

/*
 * Keys [32 j, 32 j + 32) of one sequence's values at one KV head (rows KV * D apart from v_cache + head), as
 * the A operand of O^T = V^T P^T: vt is [D][words], word (d, i) the pair (v_2i[d], v_2i+1[d]); keys at n
 * or past are zeros. Pairs interleaved 16 at a time (vpunpck{l,h}wd, then back in element order), then
 * 16 x 16 blocks of words transposed.
 */
BF16_TARGET static void values_transposed(const uint16_t *v_cache, const int32_t *table, int n, int j, int block_size,
                                         int64_t row, int64_t head, int D, int words, int32_t *vt) {
    static const uint16_t zeros[MAX_D];
    int32_t pairs[16 * MAX_D]; /* [pair][D words] */
    const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i order_hi = _mm512_add_epi32(order, _mm512_set1_epi32(8));
    for (int t = 32 * j + 32; t < 32 * j + 64 && t < n; t++) { /* the next unit's rows, while these are worked on */
        const uint16_t *next = v_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row + head;
        for (int d0 = 0; d0 < D; d0 += 32) _mm_prefetch((const char *)(next + d0), _MM_HINT_T0);
    }
    for (int i = 0; i < 16; i++) {
        const uint16_t *ab[2];
        for (int e = 0; e < 2; e++) {
            const int t = 32 * j + 2 * i + e;
            ab[e] = t < n ? v_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row + head
                          : zeros;
        }
        for (int d0 = 0; d0 < D; d0 += 32) {
            const __m512i va = _mm512_loadu_si512(ab[0] + d0), vb = _mm512_loadu_si512(ab[1] + d0);
            const __m512i lo = _mm512_unpacklo_epi16(va, vb), hi = _mm512_unpackhi_epi16(va, vb);
            _mm512_storeu_si512(pairs + i * D + d0, _mm512_permutex2var_epi32(lo, order, hi));
            _mm512_storeu_si512(pairs + i * D + d0 + 16, _mm512_permutex2var_epi32(lo, order_hi, hi));
        }
    }
    for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 block[16];
        for (int i = 0; i < 16; i++) block[i] = _mm512_loadu_ps((const float *)pairs + i * D + d0);
        transpose16(block); /* moves bits only: block[d] lane i is pair i's word d0 + d */
        for (int d = 0; d < 16; d++) _mm512_storeu_ps((float *)vt + (int64_t)(d0 + d) * words + 16 * j, block[d]);
    }
}

/* Scratch floats a thread needs for sequences of up to max_keys tokens: task_amx's, then a sequence's transposed
   values at one KV head. */
static int64_t amx_scratch_floats(int G, int D, int max_keys) {
    const int64_t keys = (max_keys + 31) / 32 * 32;
    return (int64_t)G * D * ROWS / 2 + (int64_t)G * keys * ROWS + (int64_t)ROWS * keys / 2 + (int64_t)D * ROWS +
           (int64_t)D * vt_words(max_keys);
}

/* Weight of key t for the 16 lanes: exp(scale * (score - max)), 0 where a lane does not see it or past n. */
BF16_INLINE __m512 lane_weight(const float *sh, int t, int n, int unmasked, __m512i pos, __m512 scale, __m512 top) {
    if (t >= n) return _mm512_setzero_ps();
    const __m512 e = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(sh + (int64_t)t * ROWS), scale, top));
    return t < unmasked ? e : _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(t)), e);
}

/* [P][ROWS] words per head, head after head: word (p, r) is row r's elements 2p, 2p + 1 of that query head (rows
   past nrows repeat the last); 16 x 16 blocks of words transposed. */
BF16_INLINE void query_pairs(const uint16_t *q, int64_t ldq, int r0, int nrows, int g, int G, int D, int32_t *qt) {
    for (int hh = 0; hh < G; hh++)
        for (int d0 = 0; d0 < D; d0 += 32) {
            __m512 block[16];
            for (int r = 0; r < ROWS; r++) {
                const int rr = r < nrows ? r : nrows - 1;
                block[r] = _mm512_loadu_ps(q + (int64_t)(r0 + rr) * ldq + (int64_t)(g * G + hh) * D + d0);
            }
            transpose16(block); /* moves bits only */
            for (int i = 0; i < 16; i++)
                _mm512_storeu_ps((float *)qt + ((int64_t)hh * D / 2 + d0 / 2 + i) * ROWS, block[i]);
        }
}

/* A bfloat16 task's keys (n, rounded up to 32, and the scratch's room: keys), its query pairs, lanes' positions
   and the scratch carved: [G][P][ROWS] query pairs, transposed; [G][keys][ROWS] scores; [keys / 2][ROWS][2] one
   head's weights; [D][ROWS] one head's outputs, transposed. */
typedef struct {
    int n, n32, keys, unmasked; /* keys below unmasked are seen by every lane */
    __m512i pos;                /* lane r's position: it sees keys up to it */
    int32_t *qt;
    float *s, *o;
    uint16_t *pt;
} Bf16Task;

BF16_INLINE Bf16Task bf16_task(const uint16_t *q, int64_t ldq, int first, int r0, int nrows, int g, int G, int D,
                               float *scratch, int max_keys) {
    Bf16Task b;
    b.n = first + r0 + nrows, b.n32 = (b.n + 31) / 32 * 32, b.keys = (max_keys + 31) / 32 * 32;
    b.qt = (int32_t *)scratch;
    b.s = scratch + (int64_t)G * D * ROWS / 2;
    b.pt = (uint16_t *)(b.s + (int64_t)G * b.keys * ROWS);
    b.o = (float *)(b.pt + (int64_t)ROWS * b.keys);
    query_pairs(q, ldq, r0, nrows, g, G, D, b.qt);
    int lane_pos[ROWS];
    for (int r = 0; r < ROWS; r++) lane_pos[r] = first + r0 + (r < nrows ? r : nrows - 1);
    b.pos = _mm512_loadu_si512(lane_pos);
    b.unmasked = first + r0;
    return b;
}

/* A key's scores for the 16 lanes with the diagonal applied: -inf for the lanes before the key's position. */
BF16_INLINE __m512 masked(const Bf16Task *b, int t, __m512 score) {
    if (t < b->unmasked) return score;
    return _mm512_mask_mov_ps(score, _mm512_cmplt_epi32_mask(b->pos, _mm512_set1_epi32(t)), _mm512_set1_ps(-INFINITY));
}

/* Query head hh's weights exp(scale * (score - top)) of keys [0, n32) rounded to bfloat16 pairs into b->pt
   [n32 / 2][ROWS][2] (word r of pair i: keys 2i and 2i + 1 for row r); returns the lanes' sums of the unrounded
   weights. */
BF16_INLINE __m512 weight_pairs(const Bf16Task *b, int hh, float scale, __m512 top) {
    const float *sh = b->s + (int64_t)hh * b->keys * ROWS;
    const int n = b->n, unmasked = b->unmasked;
    const __m512i pos = b->pos;
    const __m512 vscale = _mm512_set1_ps(scale);
    uint16_t *pt = b->pt;
    /* word 2r: key 2i's weight for row r (lane r of the low half), word 2r + 1: key 2i + 1's */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512 scaled_top = _mm512_mul_ps(top, vscale);
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < b->n32; t += 2) {
        const __m512 e0 = lane_weight(sh, t, n, unmasked, pos, vscale, scaled_top);
        const __m512 e1 = lane_weight(sh, t + 1, n, unmasked, pos, vscale, scaled_top);
        sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0); /* words 0-15: e0, 16-31: e1 */
        _mm512_storeu_si512(pt + (int64_t)t * ROWS, _mm512_permutexvar_epi16(pairs, both));
    }
    return sum;
}

/* Output rows [r0, r0 + nrows) of query head h from o [D][ROWS] (one head's sums, transposed), each divided by
   its lane's sum of weights. */
BF16_INLINE void put_rows(const float *o, __m512 sum, int r0, int nrows, int h, int D, uint16_t *out, int64_t ldo) {
    float lane_sums[ROWS];
    _mm512_storeu_ps(lane_sums, sum);
    const __m512i column = _mm512_setr_epi32(0, ROWS, 2 * ROWS, 3 * ROWS, 4 * ROWS, 5 * ROWS, 6 * ROWS, 7 * ROWS,
                                             8 * ROWS, 9 * ROWS, 10 * ROWS, 11 * ROWS, 12 * ROWS, 13 * ROWS,
                                             14 * ROWS, 15 * ROWS);
    for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 block[16];
        if (nrows > 4) { /* block[r]: row r's elements d0 .. d0 + 15 */
            for (int i = 0; i < 16; i++) block[i] = _mm512_loadu_ps(o + (int64_t)(d0 + i) * ROWS);
            transpose16(block);
        } else { /* a few rows (a decode, a chunk's last rows): each row's column gathered */
            for (int r = 0; r < nrows; r++) block[r] = _mm512_i32gather_ps(column, o + (int64_t)d0 * ROWS + r, 4);
        }
        for (int r = 0; r < nrows; r++) {
            const int64_t at = (int64_t)(r0 + r) * ldo + (int64_t)h * D + d0;
            store16(out, at, _mm512_div_ps(block[r], _mm512_set1_ps(lane_sums[r])), BF16);
        }
    }
}

AMX_TARGET static void task_amx(const uint16_t *q, int64_t ldq, const uint16_t *k_cache, const int32_t *vt, int words,
                                const int32_t *table, int first, int r0, int nrows, int g, int H, int KV, int D,
                                int block_size, float scale, uint16_t *out, int64_t ldo, float *scratch,
                                int max_keys) {
    const int G = H / KV, P = D / 2;
    const int64_t row = (int64_t)KV * D, head = (int64_t)g * D;
    const Bf16Task b = bf16_task(q, ldq, first, r0, nrows, g, G, D, scratch, max_keys);
    __m512 top[8]; /* G <= 8: each head's max score per lane (every lane sees key 0, so it ends finite) */
    for (int hh = 0; hh < G; hh++) top[hh] = _mm512_set1_ps(-INFINITY);

    TILE_LOADS_SEE_STORES(); /* qt */
    /* Pass 1: scores, 16 keys (of one block) a tile; the diagonal's hidden ones -inf. */
    for (int t0 = 0; t0 < b.n; t0 += 16) {
        const int64_t slot = (int64_t)table[t0 / block_size] * block_size + t0 % block_size;
        const uint16_t *keys16 = k_cache + slot * row + head; /* 16 keys of one block, rows KV * D apart */
        const int t1 = t0 + 16 < b.n ? t0 + 16 : b.n;
        for (int h0 = 0; h0 < G; h0 += 4) { /* up to four heads' C tiles (0, 3, 4, 5) share each key tile (1) */
            const int heads = G - h0 < 4 ? G - h0 : 4;
            const int32_t *qh = b.qt + (int64_t)h0 * P * ROWS;
            _tile_zero(0);
            if (heads > 1) _tile_zero(3);
            if (heads > 2) _tile_zero(4);
            if (heads > 3) _tile_zero(5);
            for (int c = 0; c < D / 32; c++) {
                _tile_loadd(1, keys16 + 32 * c, row * 2);
                _tile_loadd(2, qh + (int64_t)16 * c * ROWS, ROWS * 4);
                if (heads > 1) _tile_loadd(6, qh + (int64_t)(P + 16 * c) * ROWS, ROWS * 4);
                _tile_dpbf16ps(0, 1, 2);
                if (heads > 1) _tile_dpbf16ps(3, 1, 6);
                if (heads > 2) {
                    _tile_loadd(2, qh + (int64_t)(2 * P + 16 * c) * ROWS, ROWS * 4);
                    if (heads > 3) _tile_loadd(6, qh + (int64_t)(3 * P + 16 * c) * ROWS, ROWS * 4);
                    _tile_dpbf16ps(4, 1, 2);
                    if (heads > 3) _tile_dpbf16ps(5, 1, 6);
                }
            }
            _tile_stored(0, b.s + ((int64_t)h0 * b.keys + t0) * ROWS, ROWS * 4);
            if (heads > 1) _tile_stored(3, b.s + ((int64_t)(h0 + 1) * b.keys + t0) * ROWS, ROWS * 4);
            if (heads > 2) _tile_stored(4, b.s + ((int64_t)(h0 + 2) * b.keys + t0) * ROWS, ROWS * 4);
            if (heads > 3) _tile_stored(5, b.s + ((int64_t)(h0 + 3) * b.keys + t0) * ROWS, ROWS * 4);
        }
        for (int hh = 0; hh < G; hh++) {
            float *sh = b.s + ((int64_t)hh * b.keys + t0) * ROWS;
            __m512 m = top[hh];
            for (int t = t0; t < t1; t++) {
                const __m512 score = masked(&b, t, _mm512_loadu_ps(sh + (int64_t)(t - t0) * ROWS));
                if (t >= b.unmasked) _mm512_storeu_ps(sh + (int64_t)(t - t0) * ROWS, score);
                m = _mm512_max_ps(m, score);
            }
            top[hh] = m;
        }
    }
    for (int hh = 0; hh < G; hh++) {
        const __m512 sum = weight_pairs(&b, hh, scale, top[hh]);
        TILE_LOADS_SEE_STORES(); /* pt */
        /* O^T += V^T P^T: up to 64 output elements (four C tiles) at a time, over 32 keys a step. */
        for (int d0 = 0; d0 < D; d0 += 64) {
            const int tiles = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
            const int32_t *a = vt + (int64_t)d0 * words;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int t0 = 0; t0 < b.n32; t0 += 32) {
                _tile_loadd(5, b.pt + (int64_t)t0 * ROWS, ROWS * 4);
                _tile_loadd(4, a + t0 / 2, words * 4);
                _tile_loadd(6, a + 16 * words + t0 / 2, words * 4);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 6, 5);
                if (tiles > 2) {
                    _tile_loadd(4, a + 32 * words + t0 / 2, words * 4);
                    _tile_loadd(6, a + 48 * words + t0 / 2, words * 4);
                    _tile_dpbf16ps(2, 4, 5);
                    _tile_dpbf16ps(3, 6, 5);
                }
            }
            _tile_stored(0, b.o + (int64_t)d0 * ROWS, ROWS * 4);
            _tile_stored(1, b.o + (int64_t)(d0 + 16) * ROWS, ROWS * 4);
            if (tiles > 2) {
                _tile_stored(2, b.o + (int64_t)(d0 + 32) * ROWS, ROWS * 4);
                _tile_stored(3, b.o + (int64_t)(d0 + 48) * ROWS, ROWS * 4);
            }
        }
        put_rows(b.o, sum, r0, nrows, g * G + hh, D, out, ldo);
    }
}

/*
 * The AMX task's products on AVX512-BF16 dot products (VDPBF16PS), for CPUs with those units and no AMX (AMD Zen
 * 4 and 5): the same query pairs, weights rounded to bfloat16 pairs and transposed values, so the same sums up to
 * their order. Scores: a key's 16 lanes (rows) are D / 2 products of a query pair vector by the key's pair
 * broadcast straight from the cache, four keys at a time for each head; values: O^T's 16 elements of 16 rows
 * at a time, each pair of keys one product of their weights' vector by the values' pair broadcast from vt.
 * Half the float32 task's multiply-adds, and no key or value converted to float32.
 */
BF16_TARGET static void task_bf16dot(const uint16_t *q, int64_t ldq, const uint16_t *k_cache, const int32_t *vt,
                                     int words, const int32_t *table, int first, int r0, int nrows, int g, int H,
                                     int KV, int D, int block_size, float scale, uint16_t *out, int64_t ldo,
                                     float *scratch, int max_keys) {
    const int G = H / KV, P = D / 2;
    const int64_t row = (int64_t)KV * D, head = (int64_t)g * D;
    const Bf16Task b = bf16_task(q, ldq, first, r0, nrows, g, G, D, scratch, max_keys);
    __m512 top[8]; /* G <= 8 */
    for (int hh = 0; hh < G; hh++) top[hh] = _mm512_set1_ps(-INFINITY);

    /* Pass 1: scores, four keys at a time per head (keys past n repeat the last; their scores are not stored). */
    for (int t0 = 0; t0 < b.n; t0 += 4) {
        const int32_t *k32[4];
        for (int i = 0; i < 4; i++) {
            const int t = t0 + i < b.n ? t0 + i : b.n - 1;
            k32[i] = (const int32_t *)(k_cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * row +
                                       head);
        }
        for (int hh = 0; hh < G; hh++) {
            const int32_t *qh = b.qt + (int64_t)hh * P * ROWS;
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int p = 0; p < P; p++) {
                const __m512bh qp = (__m512bh)_mm512_loadu_si512(qh + (int64_t)p * ROWS);
                for (int i = 0; i < 4; i++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], qp, (__m512bh)_mm512_set1_epi32(k32[i][p]));
            }
            float *sh = b.s + (int64_t)hh * b.keys * ROWS;
            __m512 m = top[hh];
            for (int i = 0; i < 4 && t0 + i < b.n; i++) {
                const __m512 score = masked(&b, t0 + i, acc[i]);
                _mm512_storeu_ps(sh + (int64_t)(t0 + i) * ROWS, score);
                m = _mm512_max_ps(m, score);
            }
            top[hh] = m;
        }
    }
    for (int hh = 0; hh < G; hh++) {
        const __m512 sum = weight_pairs(&b, hh, scale, top[hh]);
        /* O^T += V^T P^T: 16 output elements at a time, over the pairs of keys */
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int i = 0; i < b.n32 / 2; i++) {
                const __m512bh w = (__m512bh)_mm512_loadu_si512(b.pt + (int64_t)2 * i * ROWS);
                for (int j = 0; j < 16; j++) {
                    const __m512bh v = (__m512bh)_mm512_set1_epi32(vt[(int64_t)(d0 + j) * words + i]);
                    acc[j] = _mm512_dpbf16_ps(acc[j], w, v);
                }
            }
            for (int j = 0; j < 16; j++) _mm512_storeu_ps(b.o + (int64_t)(d0 + j) * ROWS, acc[j]);
        }
        put_rows(b.o, sum, r0, nrows, g * G + hh, D, out, ldo);
    }
}
#endif

enum { PATH_FLOAT32 = 0, PATH_AMX = 1, PATH_BF16DOT = 2 };
static int path = -1; /* -1: not decided yet */

/* The path for bfloat16 caches: want where this CPU runs it (tests run each), else the fastest it runs (AMX tiles,
   then AVX512-BF16 dot products, then float32 FMAs); returns the path taken. */
int kvp_select_path(int want) {
    int amx = 0;
#ifdef HAVE_AMX
    amx = amx_granted();
#endif
    const int runs[] = {1, amx, has_bf16_dot()};
    if (want >= 0 && want <= PATH_BF16DOT && runs[want]) return path = want;
    return path = amx ? PATH_AMX : runs[PATH_BF16DOT] ? PATH_BF16DOT : PATH_FLOAT32;
}

/*
 * Prefill chunks of B sequences: sequence b's q_len query rows start at row query_start[b] - query_start[0]
 * of q ([T, H, D], row stride ldq) and out (row stride ldo), and are its last q_len of seq_lens[b]
 * positions; each attends causally to its cache (block_tables: [B, ldt] int32) up to its own position.
 * Caches: [num_blocks, block_size, KV, D]. D: a multiple of 16 up to MAX_D; G = H / KV heads per KV
 * head; at most 8 of them. Returns 0; -1 when a work buffer could not be had; -2, computing nothing, for
 * a shape it does not take.
 */
int kvp_prefill_attention(const void *q, int64_t ldq, const void *k_cache, const void *v_cache,
                          const int32_t *block_tables, int64_t ldt, const int32_t *seq_lens,
                          const int32_t *query_start, void *out, int64_t ldo, int B, int H, int KV, int D,
                          int block_size, float scale, int dt) {
    if (KV < 1 || H % KV || H / KV > 8 || D % 16 || D > MAX_D) return -2;
    const int G = H / KV;
    int max_keys = 0, num_tasks = 0;
    for (int b = 0; b < B; b++) {
        max_keys = seq_lens[b] > max_keys ? seq_lens[b] : max_keys;
        num_tasks += KV * ((query_start[b + 1] - query_start[b] + ROWS - 1) / ROWS);
    }
    if (path < 0) kvp_select_path(PATH_AMX);
    /* bfloat16 pairs (AMX tiles or dot products: the float32 task otherwise) */
    const int pairs = (path == PATH_AMX || path == PATH_BF16DOT) && dt == BF16 && D % 32 == 0 && block_size % 16 == 0;
    /* On pairs, a sequence of more than one task per KV head has its values transposed once for them all: in vt
       from vt_at[b], by units of (sequence, KV head, 32 keys) that run before the tasks. */
    int64_t *vt_at = malloc(sizeof(int64_t) * (B + 1));
    if (!vt_at) return -1;
    int num_units = 0;
    vt_at[0] = 0;
    for (int b = 0; b < B; b++) {
        const int shared = pairs && shares_values(query_start, b);
        vt_at[b + 1] = vt_at[b] + (shared ? (int64_t)KV * D * vt_words(seq_lens[b]) : 0);
        num_units += shared ? KV * ((seq_lens[b] + 31) / 32) : 0;
    }
    int *tasks = malloc(sizeof(int) * 3 * (num_tasks + num_units + 1));
    int32_t *vt = vt_at[B] ? aligned_alloc(64, (sizeof(int32_t) * vt_at[B] + 63) / 64 * 64) : NULL;
    if (!tasks || (vt_at[B] && !vt)) {
        free(tasks), free(vt_at), free(vt);
        return -1;
    }
    int *units = tasks + 3 * num_tasks;
    /* tasks: (sequence, first row, KV head); a sequence's later rows (longer contexts) first, so that its last
       tasks to be taken are its short ones. */
    for (int b = 0, i = 0, u = 0; b < B; b++) {
        const int q_len = query_start[b + 1] - query_start[b];
        for (int r0 = (q_len - 1) / ROWS * ROWS; r0 >= 0; r0 -= ROWS)
            for (int g = 0; g < KV; g++) tasks[i++] = b, tasks[i++] = r0, tasks[i++] = g;
        for (int g = 0; vt_at[b + 1] > vt_at[b] && g < KV; g++)
            for (int j = 0; j < (seq_lens[b] + 31) / 32; j++) units[u++] = b, units[u++] = g, units[u++] = j;
    }
    int64_t scratch_floats = (int64_t)G * D * ROWS * 2 + (int64_t)G * max_keys * ROWS + (int64_t)TILE * D;
#ifdef HAVE_AMX
    if (pairs) scratch_floats = amx_scratch_floats(G, D, max_keys);
#endif
    int failed = 0;
    const int es = dt == BF16 ? 2 : 4;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = aligned_alloc(64, (sizeof(float) * scratch_floats + 63) / 64 * 64);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#ifdef HAVE_AMX
        if (pairs && path == PATH_AMX) amx_configure();
#pragma omp for schedule(dynamic, 4)
        for (int u = 0; u < num_units; u++) { /* every task of a sequence reads all of its transposed values */
            const int b = units[3 * u], g = units[3 * u + 1], j = units[3 * u + 2], words = vt_words(seq_lens[b]);
            values_transposed(v_cache, block_tables + b * ldt, seq_lens[b], j, block_size, (int64_t)KV * D,
                              (int64_t)g * D, D, words, vt + vt_at[b] + (int64_t)g * D * words);
        }
#endif
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < num_tasks; t++) {
            if (!scratch) continue;
            const int b = tasks[3 * t], r0 = tasks[3 * t + 1], g = tasks[3 * t + 2];
            const int64_t base = query_start[b] - query_start[0];
            const int q_len = query_start[b + 1] - query_start[b];
            const int nrows = q_len - r0 < ROWS ? q_len - r0 : ROWS;
#ifdef HAVE_AMX
            if (pairs) {
                const int words = vt_words(seq_lens[b]);
                int32_t *values = (int32_t *)(scratch + scratch_floats - (int64_t)D * vt_words(max_keys));
                if (vt_at[b + 1] > vt_at[b])
                    values = vt + vt_at[b] + (int64_t)g * D * words;
                else /* the sequence's one task for this KV head transposes them itself, into its scratch's end */
                    for (int j = 0; j < (seq_lens[b] + 31) / 32; j++)
                        values_transposed(v_cache, block_tables + b * ldt, seq_lens[b], j, block_size,
                                          (int64_t)KV * D, (int64_t)g * D, D, words, values);
                (path == PATH_AMX ? task_amx : task_bf16dot)(
                    (const uint16_t *)q + base * ldq, ldq, k_cache, values, words, block_tables + b * ldt,
                    seq_lens[b] - q_len, r0, nrows, g, H, KV, D, block_size, scale, (uint16_t *)out + base * ldo, ldo,
                    scratch, max_keys);
                continue;
            }
#endif
            task((const char *)q + base * ldq * es, ldq, k_cache, v_cache, block_tables + b * ldt,
                 seq_lens[b] - q_len, r0, nrows, g, H, KV, D, block_size, scale, (char *)out + base * ldo * es, ldo,
                 dt, scratch, max_keys);
        }
#ifdef HAVE_AMX
        if (pairs && path == PATH_AMX) amx_release();
#endif
        free(scratch);
    }
    free(tasks), free(vt_at), free(vt);
    return failed ? -1 : 0;
}
