/*
 * AMX tiles on Linux: whether this process may use them (CPUID, then the kernel's grant, asked once with
 * arch_prctl ARCH_REQ_XCOMP_PERM), and one tile configuration: tiles 0-7 all 16 rows of 64 bytes (a float32
 * 16 x 16 C, or 16 rows of 32 bfloat16 for A, or 16 pairs of 16 bfloat16 columns for B). Included by
 * amx_gemm.h (bfloat16 products) and prefill_attention.c; a thread configures
 * before its first tile instruction and releases after its last.
 */
#ifndef KVG_AMX_TILES_H
#define KVG_AMX_TILES_H
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 when this CPU has AMX-BF16 and the kernel granted this process its tile state. */
static inline int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) {
        unsigned a, b, c, d; /* CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE (any compiler knows cpuid.h) */
        const int has = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1) && (d >> 24 & 1);
        granted = has && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return granted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

AMX_TARGET static inline void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    __asm__ volatile("" : : "r"(&cfg) : "memory"); /* GCC's ldtilecfg does not say that it reads cfg */
    _tile_loadconfig(&cfg);
}

AMX_TARGET static inline void amx_release(void) { _tile_release(); }

/* GCC's tile loads (amxtileintrin.h: an asm with the address as a plain operand) do not say that they read
   memory, so stores the compiler sees no other reader of may move past them or be dropped: a tile loaded
   from a buffer that plain stores just wrote needs this between the two. No instruction. */
#define TILE_LOADS_SEE_STORES() __asm__ volatile("" : : : "memory")
#endif
#endif
