/*
 * One weight row of K-quant super-blocks . one x row on 512-bit vectors, for CPUs with AVX-512 VNNI:
 * kquants.h includes this file after kquant_dot.h and takes row_dot_any_512 where row_dot_any_avx2
 * would run on the AVX2 path.
 *
 * kquant_dot.h's row_dot works 32 values (one of x's blocks) per step on 256-bit vectors; here two
 * such steps go into one instruction, the low half doing what that row_dot does for one block and
 * the high half for the next: its four accumulators are the halves of two (acc[0] | acc[1] and
 * acc[2] | acc[3]), each lane takes the same integer sums, conversions and multiply-adds in the
 * same order, and the end adds the same vectors, so the result is that row_dot's bit for bit. A
 * sub-block pair's scales come from the super-block's scale vector by one permute, not from memory.
 *
 * Why: at batch 1 a decode step's K-quant products (Q4_K_M models' most common blocks) were bound
 * by row_dot's instructions, not by reading the weights: 640 x 2048 q4_k products ran at ~13 GB/s
 * where q4_0 and q5_0 ran at 26-30 (AMX Xeon, 2 threads, 18 matrices, 0.3-0.4 GB in L3). Both
 * built alike and alternated in one process, ms for the 18: q4_k 1.04 -> 0.83, q6_k 1.46 -> 1.04,
 * q5_k 1.45 -> 1.19; Gemma 3 270M Q4_K_M's own 36 (attn_output q4_k, ffn_down q6_k, 23 MB) 1.94 ->
 * 1.53 a token.
 */

/* Each 16-bit lane of v shifted right by lo in the low 256 bits and by hi in the high 256. */
VNNI_FNS __m512i shift_halves(__m512i v, int lo, int hi) {
    return _mm512_srlv_epi16(v, _mm512_inserti64x4(_mm512_set1_epi16((short)lo), _mm256_set1_epi16((short)hi), 1));
}

/* lanes 0-3 s[0], 4-7 s[1], 8-11 s[2], 12-15 s[3]: q6_k's scales of two blocks' groups of 16 */
VNNI_FNS __m512 quarters(const float *s) {
    const __m512i which = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(which, _mm512_castps128_ps512(_mm_loadu_ps(s)));
}

/* 64 unsigned weight bytes . 64 signed x bytes: 16 int32 lanes, each the sum of four bytes' products */
VNNI_FNS __m512i dot64(__m512i u, __m512i x) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x); }

VNNI_FNS float row_dot_512(const int fmt, const uint8_t *w, int64_t num_super, const int8_t *xq, const float *xd,
                           const float *xds) {
    __m512 acc01 = _mm512_setzero_ps(), acc23 = _mm512_setzero_ps();
    __m256 offsets = _mm256_setzero_ps();
    const __m512i c32 = _mm512_set1_epi8(32), low4 = _mm512_set1_epi8(15);
    /* + 2i: the lanes of scales 2i and 2i + 1 */
    const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int64_t s = 0; s < num_super; s++) {
        const uint8_t *p = w + s * k_block_bytes(fmt);
        const int8_t *x = xq + s * QK;
        const float *dx = xd + s * (QK / QB), *dsx = xds + s * (QK / QB);
        if (fmt == Q6_K) {
            float scale[16];
            q6_k_scales_vnni(p, dx, scale);
            for (int half = 0; half < 2; half++) {
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half)));
                const __m512i ql = _mm512_loadu_si512((const void *)(p + 64 * half)); /* row_dot's ql0 | ql1 */
                for (int c = 0; c < 4; c += 2) { /* its steps c and c + 1 */
                    const __m512i low = _mm512_and_si512(c ? _mm512_srli_epi16(ql, 4) : ql, low4);
                    const __m512i top = _mm512_and_si512(shift_halves(qh, 2 * c, 2 * c + 2), _mm512_set1_epi8(3));
                    const __m512i u = _mm512_or_si512(low, _mm512_slli_epi16(top, 4));
                    const int b = 4 * half + c; /* x's blocks b and b + 1 */
                    const __m512i xv = _mm512_loadu_si512((const void *)(x + QB * b));
                    const __m512i sums = _mm512_sub_epi32(dot64(u, xv), dot64(c32, xv));
                    __m512 *acc = c ? &acc23 : &acc01;
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), quarters(scale + 2 * b), *acc);
                }
            }
            continue;
        }
        const float d = _cvtsh_ss(*(const uint16_t *)p), dmin = _cvtsh_ss(*(const uint16_t *)(p + 2));
        const __m128i sm = scales_mins_vnni(p + 4);
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
        const __m256 scale8 = _mm256_mul_ps(_mm256_mul_ps(sc, _mm256_set1_ps(d)), _mm256_loadu_ps(dx));
        const __m512 scale = _mm512_castps256_ps512(scale8); /* lanes 8-15 unused */
        const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
        offsets = _mm256_fmadd_ps(_mm256_mul_ps(mins, _mm256_set1_ps(dmin)), _mm256_loadu_ps(dsx), offsets);
        const uint8_t *qs = p + (fmt == Q5_K ? 48 : 16);
        const __m512i qh = fmt == Q5_K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 16)))
                                       : _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) { /* row_dot's sub-blocks 2i (low nibbles) and 2i + 1 (high) */
            const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * i)));
            __m512i u = _mm512_and_si512(shift_halves(raw, 0, 4), low4);
            if (fmt == Q5_K)
                u = _mm512_or_si512(
                    u, _mm512_slli_epi16(_mm512_and_si512(shift_halves(qh, 2 * i, 2 * i + 1), _mm512_set1_epi8(1)), 4));
            const __m512i sums = dot64(u, _mm512_loadu_si512((const void *)(x + QB * 2 * i)));
            __m512 *acc = i & 1 ? &acc23 : &acc01;
            const __m512 scales = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(2 * i), pair), scale);
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scales, *acc);
        }
    }
    const __m256 acc0 = _mm512_castps512_ps256(acc01), acc2 = _mm512_castps512_ps256(acc23);
    const __m256 acc1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc01), 1));
    const __m256 acc3 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc23), 1));
    return hsum_vnni(_mm256_sub_ps(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)), offsets));
}

__attribute__((target(VNNI_TARGET))) static float row_dot_any_512(int fmt, const uint8_t *w, int64_t num_super,
                                                                  const int8_t *xq, const float *xd,
                                                                  const float *xds) {
    switch (fmt) {
        case Q4_K: return row_dot_512(Q4_K, w, num_super, xq, xd, xds);
        case Q5_K: return row_dot_512(Q5_K, w, num_super, xq, xd, xds);
        default: return row_dot_512(Q6_K, w, num_super, xq, xd, xds);
    }
}
