/* bfloat16 <-> float32 for the kernels: widening is exact; narrowing rounds to nearest
 * even, as torch rounds a result to bfloat16 (a NaN stays a quiet NaN). */
#ifndef LOCALCHAT_BF16_H
#define LOCALCHAT_BF16_H
#include <stdint.h>
#include <string.h>

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
#endif
