/*
 * Scalar helpers shared by the native CPU kernels: float32 / bfloat16 loads and stores that
 * round as torch does (bfloat16: round to nearest even). dtype codes: 0 float32, 1 bfloat16.
 */
#ifndef KVGRID_SCALAR_H
#define KVGRID_SCALAR_H

#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

INLINE float load1(const void *p, int64_t i, int dt) {
    return dt == BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void store1(void *p, int64_t i, float v, int dt) {
    if (dt == BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* The value a tensor of dtype dt would hold. */
INLINE float round_to(float v, int dt) { return dt == BF16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

#endif
