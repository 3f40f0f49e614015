/*
 * Vector math shared by the native CPU kernels (decode_kernels.c, prefill_attention.c, amx_gemm.h): exp on
 * eight and sixteen floats, and bfloat16 <-> float32 on sixteen lanes. The sixteen-lane ones carry their own
 * target, so a file compiled for AVX2 calls them from its AVX-512 functions; every lane's arithmetic is the
 * same at either width, so a value never depends on the width that computed it.
 */
#ifndef KVGRID_VECTOR_MATH_H
#define KVGRID_VECTOR_MATH_H

#include <immintrin.h>
#include <stdint.h>

#include "scalar.h"

#define AVX512_TARGET "avx2,fma,avx512f"
#define AVX512_INLINE __attribute__((target(AVX512_TARGET), always_inline)) static inline

/* Whether this CPU multiplies bfloat16 pairs (AVX512-BF16, with the AVX512-BW moves every bfloat16 kernel uses). */
static inline int has_bf16_dot(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

/*
 * exp of eight floats, within 2 ulp of expf for the softmax's x <= 0 (x is clamped to [-87.3, 88.3]:
 * below, the result is ~1e-38 rather than 0, which no sum of probabilities can tell apart).
 * x = n ln2 + r with |r| <= ln2/2 (ln2 split in two constants, so n ln2 is exact), exp(r) from a
 * degree-7 polynomial whose terms are the Taylor coefficients 1/k! tuned for the interval, times 2^n
 * built in the exponent bits. One call replaces eight calls of libm's expf.
 */
/* exp8's and exp16's constants, one copy: the two agree bit for bit only while they share them */
#define EXP_LO -87.3f
#define EXP_HI 88.3f
#define EXP_LOG2E 1.44269504f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* exp8 on sixteen lanes, each lane's result exp8's bit for bit: the same operations, but for 2^n applied by
   vscalef, which rounds the product once as exp8's multiply by the power built in the exponent bits does */
AVX512_INLINE __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n); /* p 2^n: exp8's product by the power in the exponent bits, one instruction */
}

/* bfloat16 bits to float32, sixteen lanes */
AVX512_INLINE __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* round_to(v, BF16) on 16 lanes: nearest even, NaN to the quiet NaN (0x7fc0), kept as float32 */
AVX512_INLINE __m512 round16_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)),
                                 _mm512_set1_epi32((int)0xffff0000u));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
}

/* f32_to_bf16 on 16 lanes: round16_bf16's bits */
AVX512_INLINE __m256i f32x16_to_bf16(__m512 v) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round16_bf16(v)), 16));
}

#endif
