/*
 * One weight row of K-quant super-blocks . one x row (int8 blocks of 32), for one instruction set:
 * kquants.h includes this file twice, defining KQ_NAME (a suffix per set), KQ_TARGET (its target
 * attribute) and DOT32(u, x) (32 unsigned weight bytes . 32 signed x bytes -> 8 int32 lanes, lane i the
 * sum of bytes 4i..4i+3: lanes 0-3 the first 16 values, 4-7 the next 16). AVX2 takes maddubs then madd,
 * AVX-512 VNNI one vpdpbusd on 256-bit vectors. Per 32 values: the integer sums (q6_k: minus 32 x, its
 * values being q - 32) as floats, times the scales of their groups of 16 and x's block scale; q4_k and
 * q5_k's offsets (-dmin m) times x's block sums add up apart, eight lanes per super-block.
 */

KQ_TARGET __m256i KQ_NAME(low_nibbles)(__m256i raw) { return _mm256_and_si256(raw, _mm256_set1_epi8(15)); }

KQ_TARGET __m256i KQ_NAME(high_nibbles)(__m256i raw) {
    return _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));
}

/* Bits shift..shift+width-1 of each byte moved to bits 4.. (shift < 8; 16-bit shifts, then the byte masked). */
KQ_TARGET __m256i KQ_NAME(high_bits)(__m256i qh, int shift, int mask) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8(mask)), 4);
}

/* acc += sums (8 int32) as floats times s0 on lanes 0-3 (the first group of 16) and s1 on lanes 4-7. */
KQ_TARGET __m256 KQ_NAME(scale_sums)(__m256i sums, float s0, float s1, __m256 acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0)), acc);
}

/* The sum of total's eight lanes. */
KQ_TARGET float KQ_NAME(hsum)(__m256 total) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
    return _mm_cvtss_f32(v);
}

/*
 * All 8 scales (bytes 0-7) and mins (bytes 8-15) of a q4_k / q5_k super-block from its 12 packed bytes at q (16
 * read; the quants follow them), each as ggml's get_scale_min_k4 gives it: lanes 0-3 and 8-11 are bytes 0-3 and
 * 4-7 of q, 6 bits each; lanes 4-7 and 12-15 the low and high nibbles of bytes 8-11, above them the top two bits
 * of bytes 0-3 and 4-7.
 */
KQ_TARGET __m128i KQ_NAME(scales_mins)(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q);
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i high = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -128, -128, -128, -128);
    const __m128i low = _mm_blendv_epi8(a, _mm_srli_epi16(a, 4), high); /* lanes 12-15: the high nibbles */
    const __m128i keep = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    return _mm_or_si128(_mm_and_si128(low, keep), _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30)));
}

/* A q6_k super-block p's 16 groups' d sc dx at once, into scale: groups 2b and 2b + 1 meet x's block b. */
KQ_TARGET void KQ_NAME(q6_k_scales)(const uint8_t *p, const float *dx, float scale[16]) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(p + 208)));
    const __m256 dx8 = _mm256_loadu_ps(dx);
    for (int i = 0; i < 2; i++) {
        const __m256i groups = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 192 + 8 * i)));
        const __m256i pairs =
            _mm256_setr_epi32(4 * i, 4 * i, 4 * i + 1, 4 * i + 1, 4 * i + 2, 4 * i + 2, 4 * i + 3, 4 * i + 3);
        const __m256 dxs = _mm256_permutevar8x32_ps(dx8, pairs);
        _mm256_storeu_ps(scale + 8 * i, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(groups), d), dxs));
    }
}

/*
 * Four float accumulators taken in turn and the offsets summed as one vector per super-block: one
 * accumulator would chain every block's multiply-add on the last one's result, and a row at batch 1 is
 * that chain's length.
 */
KQ_TARGET float KQ_NAME(row_dot)(const int fmt, const uint8_t *w, int64_t num_super, const int8_t *xq,
                                 const float *xd, const float *xds) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 offsets = _mm256_setzero_ps();
    const __m256i c32 = _mm256_set1_epi8(32);
    for (int64_t s = 0; s < num_super; s++) {
        const uint8_t *p = w + s * k_block_bytes(fmt);
        const int8_t *x = xq + s * QK;
        const float *dx = xd + s * (QK / QB), *dsx = xds + s * (QK / QB);
        if (fmt == Q6_K) {
            float scale[16];
            KQ_NAME(q6_k_scales)(p, dx, scale);
            for (int half = 0; half < 2; half++) {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half));
                const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(p + 64 * half));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(p + 64 * half + 32));
                for (int c = 0; c < 4; c++) {
                    const __m256i ql = c & 1 ? ql1 : ql0;
                    const __m256i low = c < 2 ? KQ_NAME(low_nibbles)(ql) : KQ_NAME(high_nibbles)(ql);
                    const __m256i u = _mm256_or_si256(low, KQ_NAME(high_bits)(qh, 2 * c, 3));
                    const int b = 4 * half + c; /* x's block of 32 within the super-block */
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + QB * b));
                    const __m256i sums = _mm256_sub_epi32(DOT32(u, xv), DOT32(c32, xv));
                    acc[c] = KQ_NAME(scale_sums)(sums, scale[2 * b], scale[2 * b + 1], acc[c]);
                }
            }
            continue;
        }
        const float d = _cvtsh_ss(*(const uint16_t *)p), dmin = _cvtsh_ss(*(const uint16_t *)(p + 2));
        const __m128i sm = KQ_NAME(scales_mins)(p + 4);
        /* the 8 sub-blocks' d sc dx at once, and their offsets dmin m times x's block sums */
        float scale[8];
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
        _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_mul_ps(sc, _mm256_set1_ps(d)), _mm256_loadu_ps(dx)));
        const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
        offsets = _mm256_fmadd_ps(_mm256_mul_ps(mins, _mm256_set1_ps(dmin)), _mm256_loadu_ps(dsx), offsets);
        const uint8_t *qs = p + (fmt == Q5_K ? 48 : 16);
        const __m256i qh = fmt == Q5_K ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
            for (int h = 0; h < 2; h++) {
                const int j = 2 * i + h; /* sub-block j: the low (h 0) or high nibbles of these 32 bytes */
                __m256i u = h ? KQ_NAME(high_nibbles)(raw) : KQ_NAME(low_nibbles)(raw);
                if (fmt == Q5_K) u = _mm256_or_si256(u, KQ_NAME(high_bits)(qh, j, 1));
                const __m256i sums = DOT32(u, _mm256_loadu_si256((const __m256i *)(x + QB * j)));
                acc[j & 3] = KQ_NAME(scale_sums)(sums, scale[j], scale[j], acc[j & 3]);
            }
        }
    }
    return KQ_NAME(hsum)(_mm256_sub_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])),
                                       offsets));
}

/* A super-block p into b (decode_k's layout), the values as row_dot makes them. */
KQ_TARGET void KQ_NAME(decode)(const int fmt, const uint8_t *p, KBlock *b) {
    float scale[16];
    if (fmt == Q6_K) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(p + 208)));
        for (int i = 0; i < 2; i++) {
            const __m256i groups = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 192 + 8 * i)));
            _mm256_storeu_ps(scale + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(groups)));
        }
        for (int half = 0; half < 2; half++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half));
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(p + 64 * half));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(p + 64 * half + 32));
            for (int c = 0; c < 4; c++) {
                const __m256i ql = c & 1 ? ql1 : ql0;
                const __m256i low = c < 2 ? KQ_NAME(low_nibbles)(ql) : KQ_NAME(high_nibbles)(ql);
                const __m256i u = _mm256_or_si256(low, KQ_NAME(high_bits)(qh, 2 * c, 3));
                _mm256_storeu_si256((__m256i *)(b->q + 128 * half + QB * c), u);
            }
        }
        for (int blk = 0; blk < QK / QB; blk++)
            _mm256_storeu_ps(b->scale[blk], _mm256_set_m128(_mm_set1_ps(scale[2 * blk + 1]), _mm_set1_ps(scale[2 * blk])));
        _mm256_storeu_ps(b->offset, _mm256_setzero_ps());
        return;
    }
    const float d = _cvtsh_ss(*(const uint16_t *)p), dmin = _cvtsh_ss(*(const uint16_t *)(p + 2));
    const __m128i sm = KQ_NAME(scales_mins)(p + 4);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm));
    _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(d), sc));
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8)));
    _mm256_storeu_ps(b->offset, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(dmin), mins)));
    const uint8_t *qs = p + (fmt == Q5_K ? 48 : 16);
    const __m256i qh = fmt == Q5_K ? _mm256_loadu_si256((const __m256i *)(p + 16)) : _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
        for (int h = 0; h < 2; h++) {
            const int j = 2 * i + h;
            __m256i u = h ? KQ_NAME(high_nibbles)(raw) : KQ_NAME(low_nibbles)(raw);
            if (fmt == Q5_K) u = _mm256_or_si256(u, KQ_NAME(high_bits)(qh, j, 1));
            _mm256_storeu_si256((__m256i *)(b->q + QB * j), u);
            _mm256_storeu_ps(b->scale[j], _mm256_set1_ps(scale[j]));
        }
    }
}

/*
 * A decoded row . KQ_ROWS x rows (row r's blocks at xq + r * ldx values, its scales at xd + r * ldd):
 * per block of 32 the weight bytes and scales are loaded once for all rows; per row one DOT32 (q6_k:
 * minus 32 x), times the block's lane scales and the row's dx. One accumulator per row: the rows'
 * multiply-adds are independent, so no chain waits on the last one's result.
 */
#define KQ_ROWS 4
KQ_TARGET void KQ_NAME(decoded_dot)(const int fmt, const KBlock *row, int64_t num_super, const int8_t *xq,
                                    const float *xd, const float *xds, int64_t ldd, float out[KQ_ROWS]) {
    __m256 acc[KQ_ROWS], offsets[KQ_ROWS];
    for (int r = 0; r < KQ_ROWS; r++) acc[r] = offsets[r] = _mm256_setzero_ps();
    const __m256i c32 = _mm256_set1_epi8(32);
    for (int64_t s = 0; s < num_super; s++) {
        const KBlock *b = row + s;
        for (int j = 0; j < QK / QB; j++) {
            const int64_t at = s * (QK / QB) + j; /* x's block */
            const __m256i u = _mm256_loadu_si256((const __m256i *)(b->q + QB * j));
            const __m256 scale = _mm256_loadu_ps(b->scale[j]);
            for (int r = 0; r < KQ_ROWS; r++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (r * ldd + at) * QB));
                __m256i sums = DOT32(u, xv);
                if (fmt == Q6_K) sums = _mm256_sub_epi32(sums, DOT32(c32, xv));
                const __m256 dx = _mm256_broadcast_ss(xd + r * ldd + at);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, dx), acc[r]);
            }
        }
        if (fmt != Q6_K) {
            const __m256 offset = _mm256_loadu_ps(b->offset);
            for (int r = 0; r < KQ_ROWS; r++)
                offsets[r] = _mm256_fmadd_ps(offset, _mm256_loadu_ps(xds + r * ldd + s * (QK / QB)), offsets[r]);
        }
    }
    for (int r = 0; r < KQ_ROWS; r++) out[r] = KQ_NAME(hsum)(_mm256_add_ps(acc[r], offsets[r]));
}

/* row_dot, decode over a row and decoded_dot with fmt a constant in each branch: one loop per format. */
#define KQ_BY_FORMAT(call, ...)                                         \
    switch (fmt) {                                                      \
        case Q4_K: call(Q4_K, __VA_ARGS__); break;                      \
        case Q5_K: call(Q5_K, __VA_ARGS__); break;                      \
        default: call(Q6_K, __VA_ARGS__); break;                        \
    }

#ifdef KQ_ROW_DOT_ANY /* AVX2 only: with AVX-512 VNNI, row_dot_any_512 (kquant_dot512.h) takes one-row products */
KQ_TARGET_OUTLINED float KQ_NAME(row_dot_any)(int fmt, const uint8_t *w, int64_t num_super, const int8_t *xq,
                                              const float *xd, const float *xds) {
    float v;
#define KQ_CALL(f, ...) v = KQ_NAME(row_dot)(f, __VA_ARGS__)
    KQ_BY_FORMAT(KQ_CALL, w, num_super, xq, xd, xds)
#undef KQ_CALL
    return v;
}
#endif

KQ_TARGET_OUTLINED void KQ_NAME(decode_row_any)(int fmt, const uint8_t *w, int64_t num_super, KBlock *row) {
#define KQ_CALL(f, ...) for (int64_t s = 0; s < num_super; s++) KQ_NAME(decode)(f, w + s * k_block_bytes(f), row + s)
    KQ_BY_FORMAT(KQ_CALL, 0)
#undef KQ_CALL
}

KQ_TARGET_OUTLINED void KQ_NAME(decoded_dot_any)(int fmt, const KBlock *row, int64_t num_super, const int8_t *xq,
                                                 const float *xd, const float *xds, int64_t ldd, float out[KQ_ROWS]) {
#define KQ_CALL(f, ...) KQ_NAME(decoded_dot)(f, __VA_ARGS__)
    KQ_BY_FORMAT(KQ_CALL, row, num_super, xq, xd, xds, ldd, out)
#undef KQ_CALL
}
#undef KQ_BY_FORMAT
