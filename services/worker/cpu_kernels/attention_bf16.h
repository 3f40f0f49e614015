/*
 * Paged decode attention over bfloat16 caches on CPUs with AVX512-BF16 (head sizes 64 and 128): one
 * task's chunk of a sequence, for all its query heads. decode_kernels.c includes this file after the
 * attention helpers it uses (span_rows, prefetch_span, exp1, SPAN, CHUNK) and calls
 * attention_chunk_bf16 where its attention path is ATTENTION_AVX512_BF16.
 */

/*
 * The next span's rows (n tokens, in elements) to ask for in L1 while a span is worked on: query
 * head h of H asks for its share of the tokens, so that the requests come spread over the span's
 * arithmetic (one burst for the whole span would stall the core until the fill buffers free up).
 */
typedef struct {
    const char *k, *v;
    const int64_t *rows;
    int n;
    int64_t bytes; /* in a row */
} NextSpan;

INLINE void prefetch_next_share(NextSpan next, int h, int H) {
    for (int i = h * next.n / H; i < (h + 1) * next.n / H; i++)
        for (int64_t b = 0; b < next.bytes; b += 64) {
            _mm_prefetch(next.k + next.rows[i] * 2 + b, _MM_HINT_T0);
            _mm_prefetch(next.v + next.rows[i] * 2 + b, _MM_HINT_T0);
        }
}

BF16DOT_FN __m512bh load32bh(const uint16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }

#define QSPAN 16 /* keys whose dot products are reduced together: one vector of 16 scores */

/* Lane i of the result is the sum of v[i]'s 16 lanes: pairs of vectors folded into one at each of four steps. */
BF16DOT_FN __m512 hsum16x16(const __m512 v[16]) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: v[2i] and v[2i+1], two partial sums each */
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: v[4i] .. v[4i+3], one partial sum each */
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xee));
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd));
}

/*
 * One span (rows: QSPAN tokens, the padding's rows repeat a real one) for HEADS query heads of one KV
 * head (q: their queries; k, v: the caches at that head). Keys: per head, QSPAN dot products reduced
 * into one vector of scores. The heads' running max (top) and sum move on; the span's
 * probabilities are rounded to bfloat16 pairs (p_t, p_t+1). Values: a pair's two rows interleaved
 * element by element (vpunpck{l,h}wd) once for all the heads, into acc (2 * NQ vectors a head, lo
 * and hi halves) after scaling it by the head's correction. The heads' chains are independent, so
 * the core overlaps them. next: the next span's rows, each head asking for its share meanwhile.
 */
BF16DOT_FN void span_group(const int HEADS, const int NQ, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           const int64_t *rows, __mmask16 valid, float scale, float *top, float *sum, float *acc,
                           NextSpan next, int h0, int H) {
    const int D = 32 * NQ;
    __m512 scores[HEADS];
    for (int e = 0; e < HEADS; e++) {
        __m512 dots[QSPAN];
        for (int i = 0; i < QSPAN; i++) dots[i] = _mm512_setzero_ps();
        for (int j = 0; j < NQ; j++) {
            const __m512bh qv = load32bh(q + e * D + 32 * j);
            for (int i = 0; i < QSPAN; i++) dots[i] = _mm512_dpbf16_ps(dots[i], qv, load32bh(k + rows[i] + 32 * j));
        }
        prefetch_next_share(next, h0 + e, H);
        scores[e] = _mm512_mul_ps(hsum16x16(dots), _mm512_set1_ps(scale));
    }
    uint32_t p[HEADS][QSPAN / 2];
    float correction[HEADS];
    for (int e = 0; e < HEADS; e++) {
        const float best = _mm512_mask_reduce_max_ps(valid, scores[e]), m = best > top[e] ? best : top[e];
        const __m512 x = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(scores[e], _mm512_set1_ps(m))));
        correction[e] = exp1(top[e] - m);
        sum[e] = sum[e] * correction[e] + _mm512_reduce_add_ps(x);
        top[e] = m;
        _mm256_storeu_si256((__m256i *)p[e], (__m256i)_mm512_cvtneps_pbh(x));
    }
    __m512 lo[HEADS * NQ], hi[HEADS * NQ];
    for (int e = 0; e < HEADS; e++) {
        const __m512 c = _mm512_set1_ps(correction[e]);
        for (int j = 0; j < NQ; j++) {
            lo[e * NQ + j] = _mm512_mul_ps(c, _mm512_loadu_ps(acc + e * D + 32 * j));
            hi[e * NQ + j] = _mm512_mul_ps(c, _mm512_loadu_ps(acc + e * D + 32 * j + 16));
        }
    }
    for (int i = 0; i < QSPAN / 2; i++) {
        const uint16_t *a = v + rows[2 * i], *b = v + rows[2 * i + 1];
        __m512bh w[HEADS];
        for (int e = 0; e < HEADS; e++) w[e] = (__m512bh)_mm512_set1_epi32((int)p[e][i]);
        for (int j = 0; j < NQ; j++) {
            const __m512i va = _mm512_loadu_si512((const void *)(a + 32 * j));
            const __m512i vb = _mm512_loadu_si512((const void *)(b + 32 * j));
            const __m512bh even = (__m512bh)_mm512_unpacklo_epi16(va, vb);
            const __m512bh odd = (__m512bh)_mm512_unpackhi_epi16(va, vb);
            for (int e = 0; e < HEADS; e++) {
                lo[e * NQ + j] = _mm512_dpbf16_ps(lo[e * NQ + j], w[e], even);
                hi[e * NQ + j] = _mm512_dpbf16_ps(hi[e * NQ + j], w[e], odd);
            }
        }
    }
    for (int e = 0; e < HEADS; e++)
        for (int j = 0; j < NQ; j++) {
            _mm512_storeu_ps(acc + e * D + 32 * j, lo[e * NQ + j]);
            _mm512_storeu_ps(acc + e * D + 32 * j + 16, hi[e * NQ + j]);
        }
}

/*
 * bfloat16 caches on CPUs with AVX512-BF16, for D = 32 * NQ (head sizes 64 and 128): one pass over
 * the chunk, QSPAN tokens at a time, keys and values together (online softmax), so that reading
 * the cache overlaps the arithmetic: the next span's rows are asked for in L1 while this span's
 * products run. Dot products of bfloat16 pairs (VDPBF16PS: two exact products added into a float32
 * lane) on the cache's and the query's own bits. Keys: per query head, QSPAN dot products reduced
 * into one vector of scores (hsum16x16). Per head a running max m and sum l (the accumulators
 * rescaled by exp(m_old - m) when the max moves); a span's probabilities exp(s - m) are rounded to
 * bfloat16 (as torch's flash attention on CPU and vLLM's paged attention round them before the
 * product with V), the sums kept in float32. Values: two
 * tokens a product, their rows interleaved (span_group). The output is put back in element order
 * at the end. What differs from a float32 reference is the probabilities' rounding, the order of
 * the sums and that VDPBF16PS flushes subnormals (below 1e-38) to zero. scratch: H * (D + 2) floats.
 * Measured no faster on an AMX Xeon (2 cores): the keys' products on AMX tiles (a span's 16 rows straight
 * from the cache against the G queries, the scores read back in one tile), ~20% slower, its tile loads not
 * overlapping the products; keys stored transposed within a block, so that a product's lanes are tokens and
 * no horizontal sums are needed, within 5% either way; two passes per chunk (all keys, then values against
 * the chunk's largest score, nothing rescaled), 10% faster from cache but 20% slower from memory.
 */
BF16DOT_FN void attention_chunk_bf16dot(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                        const int32_t *table, int t0, int t1, int H, int KV, const int NQ,
                                        int block_size, float scale, float *scratch, float *part) {
    const int D = 32 * NQ, G = H / KV, most = 8 / NQ; /* heads whose values go together: 16 accumulators */
    const int64_t row = (int64_t)KV * D;
    float *acc = scratch, *top = scratch + (int64_t)H * D, *sum = top + H;
    for (int64_t i = 0; i < (int64_t)H * D; i++) acc[i] = 0.0f;
    for (int h = 0; h < H; h++) top[h] = -INFINITY, sum[h] = 0.0f;
    int64_t rows[QSPAN], next_rows[QSPAN];
    for (int s = 0; s < QSPAN; s += SPAN) prefetch_span(k_cache, table, t0 + s, t1, block_size, row, 2, TO_L1);
    for (int s = 0; s < QSPAN; s += SPAN) prefetch_span(v_cache, table, t0 + s, t1, block_size, row, 2, TO_L1);
    for (int t = t0; t < t1; t += QSPAN) {
        const int n = t1 - t < QSPAN ? t1 - t : QSPAN;
        for (int s = 0; s < QSPAN; s += SPAN) span_rows(table, t + s < t1 ? t + s : t, t1, block_size, row, rows + s);
        const int ahead = t1 - (t + QSPAN) < QSPAN ? t1 - (t + QSPAN) : QSPAN; /* the next span's tokens */
        for (int s = 0; s < ahead; s += SPAN) span_rows(table, t + QSPAN + s, t1, block_size, row, next_rows + s);
        const NextSpan next = {(const char *)k_cache, (const char *)v_cache, next_rows, ahead > 0 ? ahead : 0, row * 2};
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        for (int h0 = 0, heads; h0 < H; h0 += heads) {
            const int kv = h0 / G, left = (kv + 1) * G - h0; /* heads of this KV head from h0 on */
            heads = left < most ? left : most;
            const uint16_t *qh = q + (int64_t)h0 * D, *k = k_cache + (int64_t)kv * D, *v = v_cache + (int64_t)kv * D;
            float *a = acc + (int64_t)h0 * D;
            switch (heads * 8 + NQ) {
#define GROUP(HEADS, NQ_)                                                                                  \
    case HEADS * 8 + NQ_:                                                                                  \
        span_group(HEADS, NQ_, qh, k, v, rows, valid, scale, top + h0, sum + h0, a, next, h0, H); \
        break;
                GROUP(1, 2) GROUP(2, 2) GROUP(3, 2) GROUP(4, 2) GROUP(1, 4) GROUP(2, 4)
#undef GROUP
            }
        }
    }
    /* lane i of the low half holds element 8 * (i / 4) + i % 4, of the high half 4 more: where element j is */
    const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i order_hi = _mm512_add_epi32(order, _mm512_set1_epi32(8));
    for (int h = 0; h < H; h++) {
        float *out = part + (int64_t)h * (D + 2);
        out[0] = top[h], out[1] = sum[h];
        for (int j = 0; j < NQ; j++) {
            const __m512 lo = _mm512_loadu_ps(acc + (int64_t)h * D + 32 * j);
            const __m512 hi = _mm512_loadu_ps(acc + (int64_t)h * D + 32 * j + 16);
            _mm512_storeu_ps(out + 2 + 32 * j, _mm512_permutex2var_ps(lo, order, hi));
            _mm512_storeu_ps(out + 2 + 32 * j + 16, _mm512_permutex2var_ps(lo, order_hi, hi));
        }
    }
}

__attribute__((target(BF16DOT_TARGET))) static void attention_chunk_bf16(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int t0, int t1, int H,
    int KV, int D, int block_size, float scale, float *scratch, float *part) {
    if (D == 64)
        attention_chunk_bf16dot(q, k_cache, v_cache, table, t0, t1, H, KV, 2, block_size, scale, scratch, part);
    else
        attention_chunk_bf16dot(q, k_cache, v_cache, table, t0, t1, H, KV, 4, block_size, scale, scratch, part);
}
