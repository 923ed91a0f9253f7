/* The block formats of GGUF files, read where they lie: a weight [N, K] is N rows of K/bs
 * blocks, each block `bytes` bytes holding bs weights (32 for Q4_0 ... Q8_0 and IQ4_NL, 256
 * for the K-quants and IQ4_XS), laid out as ggml writes them (ggml-common.h; gguf-py's
 * quants.py reads the same bytes in numpy).
 *
 * gg_decode_*: one block to bs float32 weights, each computed as ggml and gguf-py compute it
 * (a product, then a sum, each rounded to float32: this file is built with -ffp-contract=off,
 * so no compiler fuses them), so the weights are the file's own to the bit.
 *
 * gguf_linear_f32: y[m, n] = sum_k x[m, k] w[n, k] for a few float32 rows of x (one-token
 * steps, verify passes, short prefills). Each row of x is first rounded to 16-bit integers
 * with a float scale per block of the weight's format, 32 or 256 values (gg_quantize_row:
 * within 1/65534 of the block's largest value, where llama.cpp rounds activations to 8 bits,
 * 1/254); a block is unpacked once to its integer codes and scales (unpack_*), shared by all
 * the rows of x; codes and activations are multiplied in integers, exactly. A block of 32
 * scales each chunk's integer sum once in float; a block of 256 (the K-quants, IQ4_XS)
 * multiplies each group's codes by its integer scale first, so the whole block sums in
 * integers and is scaled in float once (the weights are the file's, the rounding the
 * activations' and float32's). A thread takes a range of weight rows, and every output is
 * one fixed sequence of instructions owned by one thread, whatever the number of rows or
 * threads: a verify pass's rows are one-token steps bit for bit.
 *
 * gguf_dequant_f32: whole rows decoded into float32 (a dense view, embedding rows); a
 * prefill's GEMM decodes a few rows at a time itself (gguf_gemm.c). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
       Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23 };

/* every format this file reads: its unpack_ function's suffix, its GGUF type, weights and
 * bytes a block, weights a group (one scale), whether a group has an offset as well */
#define GG_FORMATS(X)                                                                                            \
    X(q4_0, Q4_0, 32, 18, 32, 0) X(q4_1, Q4_1, 32, 20, 32, 1) X(q5_0, Q5_0, 32, 22, 32, 0)                        \
    X(q5_1, Q5_1, 32, 24, 32, 1) X(q8_0, Q8_0, 32, 34, 32, 0) X(iq4_nl, IQ4_NL, 32, 18, 32, 0)                    \
    X(q2_k, Q2_K, 256, 84, 16, 1) X(q3_k, Q3_K, 256, 110, 16, 0) X(q4_k, Q4_K, 256, 144, 32, 1)                   \
    X(q5_k, Q5_K, 256, 176, 32, 1) X(q6_k, Q6_K, 256, 210, 16, 0) X(iq4_xs, IQ4_XS, 256, 136, 32, 0)

#define GG_MB 4                 /* rows of x per pass over a weight row (the switch in gg_dot_*) */
#ifndef GG_NT
#define GG_NT 32                /* weight rows a tile (gguf_linear_f32) */
#endif

static const int8_t kvalues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* IEEE half to float32, exactly (subnormals included): F16C's conversion where the build has it */
static inline float gg_half(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0) {
        float v = ldexpf((float)m, -24);
        return sign ? -v : v;
    }
    bits = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* out[j] = mul * v_j for the 8 bytes of `v` (unsigned, or with `sign` signed), each product
 * rounded once, as the scalar (float)v_j * mul rounds it */
static inline void scale8(uint64_t v, int sign, float mul, float *out) {
    const __m128i b = _mm_cvtsi64_si128((long long)v);
    const __m256i w = sign ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(w), _mm256_set1_ps(mul)));
}

/* the 8 six-bit scales (as integers) and mins (times dmin) of a Q4_K / Q5_K block's 12
 * bytes: group j < 4 takes s[j] & 63 and s[j + 4] & 63, j >= 4 the nibbles of s[j + 4] with
 * the top two bits of s[j - 4] and s[j] (ggml's get_scale_min_k4), four groups a 32-bit word
 * at once */
static inline void scale_min_k4(const uint8_t *s, float dmin, int16_t *isc, float *dm) {
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    const uint32_t sc_hi = (u[2] & four) | (((u[0] >> 6) & two) << 4);
    const uint32_t mn_hi = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
    const uint64_t sc = (uint64_t)(u[0] & six) | (uint64_t)sc_hi << 32;
    _mm_storeu_si128((__m128i *)isc, _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    scale8((uint64_t)(u[1] & six) | (uint64_t)mn_hi << 32, 0, dmin, dm);
}

/* unpack_*: one block to its integer codes q (int8, in the weights' order) and scales. A
 * block of 32 (one group): its scale d[0] and, with an offset, m[0]: weight e is d[0] * q[e]
 * + m[0]. A block of 256 (the K-quants, IQ4_XS): its scale d[0], and per group of G weights
 * an integer scale isc[g] and (Q2_K, Q4_K, Q5_K) an offset m[g]: weight e of group g is
 * (d[0] * isc[g]) * q[e] + m[g], the product in brackets rounded to float32 as ggml rounds
 * it. The codes are unpacked 32 at a time in AVX2's integer instructions (AVX-512 CPUs have
 * them). */
static inline void put32(int8_t *q, __m256i v) { _mm256_storeu_si256((__m256i *)q, v); }
static inline __m256i ld32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline __m256i low_bits(__m256i v, int shift, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8((char)mask));
}

/* 16 bytes of nibbles as 32 codes: the 16 low nibbles, then the 16 high ones */
static inline __m256i nibbles(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0xf));
}

/* 32 nibble codes through IQ4's table of values */
static inline __m256i iq4_values(const uint8_t *p) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)kvalues);
    return _mm256_shuffle_epi8(_mm256_set_m128i(lut, lut), nibbles(p));
}

/* byte j: 16 where bit j of the 32 at p is set, else 0 (Q5_0 / Q5_1's fifth bits) */
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

static inline __attribute__((always_inline)) const int8_t *unpack_q4_0(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    (void)isc;
    (void)m;
    d[0] = gg_half(b);
    put32(q, _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8)));
    return q;
}

static inline __attribute__((always_inline)) const int8_t *unpack_q4_1(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    (void)isc;
    d[0] = gg_half(b);
    m[0] = gg_half(b + 2);
    put32(q, nibbles(b + 4));
    return q;
}

static inline __attribute__((always_inline)) const int8_t *unpack_q5_0(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    (void)isc;
    (void)m;
    d[0] = gg_half(b);
    put32(q, _mm256_sub_epi8(_mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2)), _mm256_set1_epi8(16)));
    return q;
}

static inline __attribute__((always_inline)) const int8_t *unpack_q5_1(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    (void)isc;
    d[0] = gg_half(b);
    m[0] = gg_half(b + 2);
    put32(q, _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4)));
    return q;
}

static inline __attribute__((always_inline)) const int8_t *unpack_q8_0(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    (void)isc;
    (void)m;
    (void)q;
    d[0] = gg_half(b);
    return (const int8_t *)(b + 2);             /* the codes as stored */
}

static inline __attribute__((always_inline)) const int8_t *unpack_iq4_nl(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    (void)isc;
    (void)m;
    d[0] = gg_half(b);
    put32(q, iq4_values(b + 2));
    return q;
}

/* scales[16] qs[64] d dmin: 16 groups of 16, q in 0..3 */
static inline __attribute__((always_inline)) const int8_t *unpack_q2_k(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    const uint8_t *sc = b, *qs = b + 16;
    const float dmin = gg_half(b + 82);
    d[0] = gg_half(b + 80);
    uint64_t v[2];
    memcpy(v, sc, 16);
    _mm256_storeu_si256((__m256i *)isc, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)sc),
                                                                         _mm_set1_epi8(0xf))));
    for (int h = 0; h < 2; h++) scale8((v[h] >> 4) & 0x0f0f0f0f0f0f0f0full, 0, -dmin, m + 8 * h);
    for (int h = 0; h < 2; h++) {
        const __m256i v = ld32(qs + h * 32);
        for (int s = 0; s < 4; s++) put32(q + h * 128 + s * 32, low_bits(v, 2 * s, 3));
    }
    return q;
}

/* hmask[32] qs[64] scales[12] d: 16 groups of 16, q in -4..3 (4 less where hmask's bit is clear) */
static inline __attribute__((always_inline)) const int8_t *unpack_q3_k(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    (void)m;
    const uint8_t *qs = b + 32, *sc = b + 96;
    d[0] = gg_half(b + 108);
    /* group i's six-bit scale, less 32: its low four bits are nibble i of scales[0..7] (the
     * low nibbles, then the high ones), its top two bits 2 (i / 4) of scales[8 + i % 4] */
    uint64_t lo;
    uint32_t hi;
    memcpy(&lo, sc, 8);
    memcpy(&hi, sc + 8, 4);
    const uint64_t m4 = 0x0f0f0f0f0f0f0f0full;
    const uint32_t m2 = 0x03030303u;
    const uint64_t top0 = (uint64_t)(hi & m2) | (uint64_t)((hi >> 2) & m2) << 32;
    const uint64_t top1 = (uint64_t)((hi >> 4) & m2) | (uint64_t)((hi >> 6) & m2) << 32;
    const __m128i six = _mm_set_epi64x((long long)(((lo >> 4) & m4) | top1 << 4), (long long)((lo & m4) | top0 << 4));
    _mm256_storeu_si256((__m256i *)isc, _mm256_cvtepi8_epi16(_mm_sub_epi8(six, _mm_set1_epi8(32))));
    const __m256i hm = ld32(b), four = _mm256_set1_epi8(4);
    for (int h = 0; h < 2; h++) {
        const __m256i v = ld32(qs + h * 32);
        for (int s = 0; s < 4; s++) {
            const __m256i high = _mm256_slli_epi16(low_bits(hm, h * 4 + s, 1), 2);     /* 4 or 0 */
            put32(q + h * 128 + s * 32, _mm256_sub_epi8(_mm256_add_epi8(low_bits(v, 2 * s, 3), high), four));
        }
    }
    return q;
}

/* d dmin scales[12] qs[128]: 8 groups of 32, q in 0..15 */
static inline __attribute__((always_inline)) const int8_t *unpack_q4_k(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    d[0] = gg_half(b);
    scale_min_k4(b + 4, -gg_half(b + 2), isc, m);        /* -(dmin * mn), exactly */
    for (int c = 0; c < 4; c++) {
        const __m256i v = ld32(b + 16 + c * 32);
        put32(q + c * 64, low_bits(v, 0, 0xf));
        put32(q + c * 64 + 32, low_bits(v, 4, 0xf));
    }
    return q;
}

/* d dmin scales[12] qh[32] qs[128]: as Q4_K with a fifth bit per weight, q in 0..31 */
static inline __attribute__((always_inline)) const int8_t *unpack_q5_k(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    d[0] = gg_half(b);
    scale_min_k4(b + 4, -gg_half(b + 2), isc, m);
    const __m256i qh = ld32(b + 16);
    for (int c = 0; c < 4; c++) {
        const __m256i v = ld32(b + 48 + c * 32);
        put32(q + c * 64, _mm256_or_si256(low_bits(v, 0, 0xf), _mm256_slli_epi16(low_bits(qh, 2 * c, 1), 4)));
        put32(q + c * 64 + 32, _mm256_or_si256(low_bits(v, 4, 0xf), _mm256_slli_epi16(low_bits(qh, 2 * c + 1, 1), 4)));
    }
    return q;
}

/* ql[128] qh[64] scales[16] (int8) d: 16 groups of 16, q in -32..31 */
static inline __attribute__((always_inline)) const int8_t *unpack_q6_k(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    (void)m;
    d[0] = gg_half(b + 208);
    _mm256_storeu_si256((__m256i *)isc, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192))));
    const __m256i bias = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        const __m256i qh = ld32(b + 128 + h * 32);
        for (int s = 0; s < 4; s++) {
            const __m256i lo = low_bits(ld32(b + h * 64 + (s & 1) * 32), 4 * (s >> 1), 0xf);
            /* bits 2s, 2s + 1 of qh to bits 4, 5: one shift (or none) and a mask */
            const __m256i at = s == 0 ? _mm256_slli_epi16(qh, 4) : s == 1 ? _mm256_slli_epi16(qh, 2)
                             : s == 2 ? qh : _mm256_srli_epi16(qh, 2);
            const __m256i hi = _mm256_and_si256(at, _mm256_set1_epi8(0x30));
            put32(q + h * 128 + s * 32, _mm256_sub_epi8(_mm256_or_si256(lo, hi), bias));
        }
    }
    return q;
}

/* d scales_h(u16) scales_l[4] qs[128]: 8 groups of 32, 6-bit signed scales, IQ4_NL's values */
static inline __attribute__((always_inline)) const int8_t *unpack_iq4_xs(const uint8_t *b, int8_t *q, float *d, float *m, int16_t *isc) {
    (void)m;
    d[0] = gg_half(b);
    const int sh = b[2] | (b[3] << 8);
    uint32_t x;
    memcpy(&x, b + 4, 4);
    /* group g's scale: nibble g of scales_l, bits 2g, 2g+1 of scales_h above it, less 32 */
    const __m128i lo = _mm_cvtsi32_si128((int)(x & 0x0f0f0f0fu)), hi = _mm_cvtsi32_si128((int)((x >> 4) & 0x0f0f0f0fu));
    const __m256i top = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(sh), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                         _mm256_set1_epi32(3));
    const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)),
                                                        _mm256_slli_epi32(top, 4)), _mm256_set1_epi32(32));
    _mm_storeu_si128((__m128i *)isc, _mm_packs_epi32(_mm256_castsi256_si128(sc), _mm256_extracti128_si256(sc, 1)));
    for (int g = 0; g < 8; g++) put32(q + g * 32, iq4_values(b + 8 + g * 16));
    return q;
}

typedef void (*decode_fn)(const uint8_t *, float *);

/* A few rows of x, each rounded to 16-bit integers per block of the weight's format (32 or
 * 256 values): value j of block c is s[c] * q[j], s[c] = (largest |x| of the block) / GG_XR,
 * q[j] = x[j] / s[c] rounded to the nearest (even) integer. Each 32 codes are stored in the
 * order the build widens 32 weight codes to 16 bits, so a weight chunk meets its activations
 * without a shuffle: in order on AVX-512 (one widening of 32), in the order of AVX2's byte
 * unpacking otherwise (0..7, 16..23, 8..15, 24..31). xs[g]: the block's s times the sum of
 * the codes of group g (16 or 32 values), for the formats whose groups have offsets. A
 * non-finite value makes its block's scale NaN, so NaN reaches the outputs it touches, as
 * float32 would. */
#define GG_XR 32767
typedef struct {
    const int16_t *q;
    const float *s, *xs;
    int64_t ldq, lds, ldxs;             /* per row */
} GGX;

typedef void (*dot_fn)(const uint8_t *, int, const GGX *, int, int, float *, int64_t, int);

/* a fixed-order sum of 8 lanes (as the AVX2 build's vf_sum) */
static inline float sum8(__m256 v) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}

static inline int hsum_epi32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    return _mm_cvtsi128_si32(t);
}

/* the largest |x| of 32 values, and whether one of them is not finite (max_ps drops a NaN
 * operand in one position only: every value is checked) */
static inline float gg_absmax32(const float *xc, int *bad) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), finite = _mm256_set1_ps(3.4028235e38f);
    const __m256 a0 = _mm256_and_ps(_mm256_loadu_ps(xc), absmask), a1 = _mm256_and_ps(_mm256_loadu_ps(xc + 8), absmask),
                 a2 = _mm256_and_ps(_mm256_loadu_ps(xc + 16), absmask), a3 = _mm256_and_ps(_mm256_loadu_ps(xc + 24), absmask);
    const __m256 mv = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_movehdup_ps(t));
    *bad |= _mm256_movemask_ps(_mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a0, finite, _CMP_NLE_UQ),
                                                         _mm256_cmp_ps(a1, finite, _CMP_NLE_UQ)),
                                           _mm256_or_ps(_mm256_cmp_ps(a2, finite, _CMP_NLE_UQ),
                                                        _mm256_cmp_ps(a3, finite, _CMP_NLE_UQ))));
    return _mm_cvtss_f32(t);
}

/* one row of K values (K a multiple of CH, CH 32 or 256) into q, s (a scale per CH values)
 * and, with G (16 or 32) nonzero, xs (per group of G) */
static void gg_quantize_row(const float *x, int K, int G, int CH, int16_t *q, float *s, float *xs) {
    for (int c0 = 0; c0 < K / CH; c0++) {
        int bad = 0;
        float mx = 0.f;
        for (int c = c0 * CH / 32; c < (c0 + 1) * CH / 32; c++) mx = fmaxf(mx, gg_absmax32(x + 32 * c, &bad));
        const float inv = mx > 0.f && !bad ? (float)GG_XR / mx : 0.f;
        s[c0] = bad ? NAN : mx / (float)GG_XR;
        const __m256 iv = _mm256_set1_ps(inv);
        for (int c = c0 * CH / 32; c < (c0 + 1) * CH / 32; c++) {
            const float *xc = x + 32 * c;
            const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xc), iv)),
                          i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xc + 8), iv)),
                          i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xc + 16), iv)),
                          i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xc + 24), iv));
#if LC_AVX512
            /* packs interleaves 64-bit quarters: [i0 lo, i1 lo, i0 hi, i1 hi], put back in order */
            _mm256_storeu_si256((__m256i *)(q + 32 * c), _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xd8));
            _mm256_storeu_si256((__m256i *)(q + 32 * c + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xd8));
#else
            /* packs interleaves 128-bit halves: [i0 lo, i2 lo] with [i0 hi, i2 hi] gives 0..7, 16..23 */
            _mm256_storeu_si256((__m256i *)(q + 32 * c), _mm256_packs_epi32(_mm256_permute2x128_si256(i0, i2, 0x20),
                                                                            _mm256_permute2x128_si256(i0, i2, 0x31)));
            _mm256_storeu_si256((__m256i *)(q + 32 * c + 16), _mm256_packs_epi32(_mm256_permute2x128_si256(i1, i3, 0x20),
                                                                                 _mm256_permute2x128_si256(i1, i3, 0x31)));
#endif
            if (G == 32) xs[c] = s[c0] * (float)hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
            if (G == 16) {
                xs[2 * c] = s[c0] * (float)hsum_epi32(_mm256_add_epi32(i0, i1));
                xs[2 * c + 1] = s[c0] * (float)hsum_epi32(_mm256_add_epi32(i2, i3));
            }
        }
    }
}

/* gg_dot_<format>: y[m0 + m, n] for m < mb, weight row n (K weights at wr) against x rows
 * m0... A block is unpacked once to its int8 codes and scales, shared by the rows. Codes
 * are widened to 16 bits and multiplied with the activations' codes in integers (pmaddwd:
 * 32 products into pair sums, exact; AVX2 adds its two halves' into 8 sums, AVX-512 keeps
 * 16). A block of 32 (GG_BLOCK) converts its sums to float and scales them by the block's
 * scale times the row's activation scale; blocks alternate between two float chains, so the
 * next need not wait for the last one's sum. A block of 256 (GG_KBLOCK) stays in integers
 * to its end. An offset (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) meets xs, the scaled sum of the
 * activations of its group, in a fused product-sum of its own.
 * So a product is the file's weights times x rounded to 16 bits, summed in float32. One body
 * per row count (MROWS, a constant), so the accumulators stay in registers; one fixed
 * sequence per output, whatever mb or the thread. */
#if LC_AVX512
typedef __m512 gacc;
static inline gacc gacc_zero(void) { return _mm512_setzero_ps(); }
static inline float gacc_sum(gacc a, gacc b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }

/* 16 floats the unpacking stored as two halves of 8, read back as two halves: one load of all
 * 16 would wait for both stores to reach the cache (no store forwarding across them) */
static inline __m512 load16(const float *p) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_loadu_pd((const double *)p)),
                                               _mm256_loadu_pd((const double *)(p + 8)), 1));
}

/* GG_BLOCK(...): a block of 32 (one group, one chunk) into acc and off, for MROWS rows of x.
 * AVX-512: the 32 codes one register, in order; their 16 pair sums take the block's scale
 * times the row's activation scale. */
#define GG_BLOCK(NAME, BS, G, OFFSETS)                                                                            \
    int8_t q[BS] __attribute__((aligned(64)));                                                                   \
    int16_t isc[16];                      /* unused: a block of 32 has one float scale */                        \
    float d[(BS) / (G)], off_g[(BS) / (G)];                                                                      \
    const int8_t *cq = unpack_##NAME(wr, q, d, off_g, isc);                                                      \
    const __m256i v = _mm256_loadu_si256((const __m256i *)cq);                                                   \
    const __m512i w = (OFFSETS) ? _mm512_cvtepu8_epi16(v) : _mm512_cvtepi8_epi16(v);                             \
    for (int m = 0; m < MROWS; m++) {                                                                            \
        const int64_t row = m0 + m;                                                                              \
        const __m512i p = _mm512_madd_epi16(w, _mm512_loadu_si512(x->q + row * x->ldq + k0));                    \
        acc[m][odd] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(d[0] * x->s[row * x->lds + k0 / 32]), \
                                      acc[m][odd]);                                                              \
        if (OFFSETS) off[m] = fmaf(off_g[0], x->xs[row * x->ldxs + k0 / 32], off[m]);                             \
    }

/* acc + the pair sums of a and b's 16-bit products, exactly: one instruction with VNNI */
static inline __m512i dot16(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* GG_KBLOCK(...): a block of 256 (K-quants, IQ4_XS) in integers. The activations' scale is
 * one per block, so a group's integer scale multiplies its codes (16 bits hold every code
 * times its scale: |q isc| <= 4096) and every product of the block sums in 32-bit integers,
 * scaled in float once: per row and chunk, one multiply-add of 32 pairs. Two integer chains
 * a row (even and odd chunks), each lane at most 8 products of |q isc| 4096 by |x| 32767, so
 * their sum (16 products) stays below 2^31. */
#define GG_KBLOCK(NAME, BS, G, OFFSETS)                                                                           \
    enum { NG = (BS) / (G), NC = (BS) / 32, VEC_OFF = (OFFSETS) && NG % 8 == 0 };                                \
    int8_t q[BS] __attribute__((aligned(64)));                                                                   \
    int16_t isc[16] __attribute__((aligned(32)));                                                                \
    float d[NG], off_g[NG] __attribute__((aligned(64)));                                                         \
    const int8_t *cq = unpack_##NAME(wr, q, d, off_g, isc);                                                      \
    __m512i ia[GG_MB][2];                                                                                        \
    for (int m = 0; m < MROWS; m++) ia[m][0] = ia[m][1] = _mm512_setzero_si512();                                \
    const __m512i scv = NG == 16 ? _mm512_castsi256_si512(_mm256_load_si256((const __m256i *)isc))               \
                                 : _mm512_castsi128_si512(_mm_load_si128((const __m128i *)isc));                 \
    _Pragma("GCC unroll 8")                                                                                      \
    for (int c = 0; c < NC; c++) {                                                                               \
        const __m256i v = _mm256_loadu_si256((const __m256i *)(cq + 32 * c));                                    \
        const __m512i w = (OFFSETS) ? _mm512_cvtepu8_epi16(v) : _mm512_cvtepi8_epi16(v);                         \
        /* group 2c in words 0..15 and 2c + 1 in 16..31 (groups of 16), or group c in all */                     \
        const __m512i sc = _mm512_permutexvar_epi16(NG == 16 ?                                                   \
            _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1)), 1)      \
            : _mm512_set1_epi16((short)c), scv);                                                                 \
        const __m512i ws = _mm512_mullo_epi16(w, sc);                                                            \
        for (int m = 0; m < MROWS; m++) {                                                                        \
            const int16_t *xq = x->q + (int64_t)(m0 + m) * x->ldq + k0 + 32 * c;                                 \
            ia[m][c & 1] = dot16(ia[m][c & 1], ws, _mm512_loadu_si512(xq));                                      \
        }                                                                                                        \
    }                                                                                                            \
    for (int m = 0; m < MROWS; m++) {                                                                            \
        const float xsc = x->s[(int64_t)(m0 + m) * x->lds + k0 / (BS)];                                          \
        acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia[m][0], ia[m][1])),                    \
                                    _mm512_set1_ps(d[0] * xsc), acc[m][0]);                                      \
        const float *xs = x->xs + (int64_t)(m0 + m) * x->ldxs + k0 / (G);                                        \
        if (VEC_OFF && NG == 16)                                                                                 \
            acc[m][1] = _mm512_fmadd_ps(load16(off_g), _mm512_loadu_ps(xs), acc[m][1]);                          \
        else if (VEC_OFF)                                                                                        \
            acc[m][1] = _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_loadu_ps(off_g)),                          \
                                        _mm512_zextps256_ps512(_mm256_loadu_ps(xs)), acc[m][1]);                 \
    }
#else
typedef __m256 gacc;
static inline gacc gacc_zero(void) { return _mm256_setzero_ps(); }
static inline float gacc_sum(gacc a, gacc b) { return sum8(_mm256_add_ps(a, b)); }

/* GG_BLOCK(...), AVX2: the 32 codes unpacked to two registers of 16 16-bit codes, their
 * pair sums added into 8 */
#define GG_BLOCK(NAME, BS, G, OFFSETS)                                                                            \
    int8_t q[BS] __attribute__((aligned(64)));                                                                   \
    int16_t isc[16];                      /* unused: a block of 32 has one float scale */                        \
    float d[(BS) / (G)], off_g[(BS) / (G)];                                                                      \
    const int8_t *cq = unpack_##NAME(wr, q, d, off_g, isc);                                                      \
    const __m256i v = _mm256_loadu_si256((const __m256i *)cq), zero = _mm256_setzero_si256();                    \
    const __m256i ext = (OFFSETS) ? zero : _mm256_cmpgt_epi8(zero, v);              /* codes >= 0 or signed */   \
    const __m256i wa = _mm256_unpacklo_epi8(v, ext), wb = _mm256_unpackhi_epi8(v, ext);                         \
    for (int m = 0; m < MROWS; m++) {                                                                            \
        const int64_t row = m0 + m;                                                                              \
        const int16_t *xq = x->q + row * x->ldq + k0;                                                            \
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(wa, _mm256_loadu_si256((const __m256i *)xq)),      \
                                           _mm256_madd_epi16(wb, _mm256_loadu_si256((const __m256i *)(xq + 16)))); \
        acc[m][odd] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[0] * x->s[row * x->lds + k0 / 32]), \
                                      acc[m][odd]);                                                              \
        if (OFFSETS) off[m] = fmaf(off_g[0], x->xs[row * x->ldxs + k0 / 32], off[m]);                             \
    }

/* GG_KBLOCK(...), AVX2: as AVX-512's, a chunk's codes in two registers of 16 (unpacking
 * order: words 0..7 of each from the chunk's first 16 weights), each with its own integer
 * chain a row (at most 16 products a lane), converted to float apart. */
#define GG_KBLOCK(NAME, BS, G, OFFSETS)                                                                           \
    enum { NG = (BS) / (G), NC = (BS) / 32, VEC_OFF = (OFFSETS) && NG % 8 == 0 };                                \
    int8_t q[BS] __attribute__((aligned(64)));                                                                   \
    int16_t isc[16] __attribute__((aligned(32)));                                                                \
    float d[NG], off_g[NG];                                                                                      \
    const int8_t *cq = unpack_##NAME(wr, q, d, off_g, isc);                                                      \
    __m256i ia[GG_MB][2];                                                                                        \
    for (int m = 0; m < MROWS; m++) ia[m][0] = ia[m][1] = _mm256_setzero_si256();                                \
    const __m256i zero = _mm256_setzero_si256();                                                                 \
    _Pragma("GCC unroll 8")                                                                                      \
    for (int c = 0; c < NC; c++) {                                                                               \
        const __m256i v = _mm256_loadu_si256((const __m256i *)(cq + 32 * c));                                    \
        const __m256i ext = (OFFSETS) ? zero : _mm256_cmpgt_epi8(zero, v);                                       \
        /* words 0..7 of a register: the first group of the chunk (groups of 16), 8..15 the second */            \
        const __m256i sc = NG == 16 ? _mm256_set_m128i(_mm_set1_epi16(isc[2 * c + 1]), _mm_set1_epi16(isc[2 * c])) \
                                    : _mm256_set1_epi16(isc[c]);                                                 \
        const __m256i wa = _mm256_mullo_epi16(_mm256_unpacklo_epi8(v, ext), sc),                                 \
                      wb = _mm256_mullo_epi16(_mm256_unpackhi_epi8(v, ext), sc);                                 \
        for (int m = 0; m < MROWS; m++) {                                                                        \
            const int16_t *xq = x->q + (int64_t)(m0 + m) * x->ldq + k0 + 32 * c;                                 \
            ia[m][0] = _mm256_add_epi32(ia[m][0], _mm256_madd_epi16(wa, _mm256_loadu_si256((const __m256i *)xq))); \
            ia[m][1] = _mm256_add_epi32(ia[m][1],                                                                \
                                        _mm256_madd_epi16(wb, _mm256_loadu_si256((const __m256i *)(xq + 16))));  \
        }                                                                                                        \
    }                                                                                                            \
    for (int m = 0; m < MROWS; m++) {                                                                            \
        const float xsc = x->s[(int64_t)(m0 + m) * x->lds + k0 / (BS)];                                          \
        acc[m][0] = _mm256_fmadd_ps(_mm256_add_ps(_mm256_cvtepi32_ps(ia[m][0]), _mm256_cvtepi32_ps(ia[m][1])),   \
                                    _mm256_set1_ps(d[0] * xsc), acc[m][0]);                                      \
        const float *xs = x->xs + (int64_t)(m0 + m) * x->ldxs + k0 / (G);                                        \
        if (VEC_OFF)                                                                                             \
            for (int g = 0; g < NG; g += 8)                                                                      \
                acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(off_g + g), _mm256_loadu_ps(xs + g), acc[m][1]);     \
    }
#endif

#define GG_DOT(NAME, TYPE, BS, BYTES, G, OFFSETS)                                                                    \
static inline __attribute__((always_inline)) void gg_block_##NAME(                                               \
        const uint8_t *wr, int k0, const GGX *x, int m0, const int MROWS, const int odd, gacc (*acc)[2],         \
        float *off) {                                                                                            \
    (void)odd;                                                                                                   \
    (void)off;                                                                                                   \
    if ((BS) == 256) {                                                                                           \
        GG_KBLOCK(NAME, BS, G, OFFSETS)                                                                          \
    } else {                                                                                                     \
        GG_BLOCK(NAME, BS, G, OFFSETS)                                                                           \
    }                                                                                                            \
}                                                                                                                \
static inline __attribute__((always_inline)) void gg_rows_##NAME(                                                \
        const uint8_t *wr, int K, const GGX *x, int m0, const int MROWS, float *y, int64_t ldy, int n) {         \
    enum { NC = (BS) / 32 };                                                                                     \
    gacc acc[GG_MB][2];                                                                                          \
    float off[GG_MB];                                                                                            \
    for (int m = 0; m < MROWS; m++) {                                                                            \
        acc[m][0] = acc[m][1] = gacc_zero();                                                                     \
        off[m] = 0.f;                                                                                            \
    }                                                                                                            \
    int k0 = 0;                                                                                                  \
    for (; k0 + 2 * (BS) <= K; k0 += 2 * (BS), wr += 2 * (BYTES)) {    /* two blocks: chunk parity constant */  \
        gg_block_##NAME(wr, k0, x, m0, MROWS, 0, acc, off);                                                      \
        gg_block_##NAME(wr + (BYTES), k0 + (BS), x, m0, MROWS, NC & 1, acc, off);                                \
    }                                                                                                            \
    if (k0 < K) gg_block_##NAME(wr, k0, x, m0, MROWS, 0, acc, off);                                              \
    for (int m = 0; m < MROWS; m++)                                                                              \
        y[(int64_t)(m0 + m) * ldy + n] = gacc_sum(acc[m][0], acc[m][1]) + off[m];                                \
}                                                                                                                \
static void gg_dot_##NAME(const uint8_t *wr, int K, const GGX *x, int m0, int mb, float *y, int64_t ldy, int n) { \
    switch (mb) {                                                                                                \
    case 1: gg_rows_##NAME(wr, K, x, m0, 1, y, ldy, n); break;                                                   \
    case 2: gg_rows_##NAME(wr, K, x, m0, 2, y, ldy, n); break;                                                   \
    case 3: gg_rows_##NAME(wr, K, x, m0, 3, y, ldy, n); break;                                                   \
    default: gg_rows_##NAME(wr, K, x, m0, 4, y, ldy, n); break;                                                  \
    }                                                                                                            \
}
/* VL int8 codes as float lanes, widened by a load from memory: written as an instruction of
 * its own because the compiler, seeing the codes just stored, moves them through registers
 * instead, a dozen shuffles a block that cost more than the arithmetic */
static inline vf codes(const int8_t *p) {
#if LC_AVX512
    __m512i r;
    __asm__("vpmovsxbd %1, %0" : "=v"(r) : "m"(*(const struct { int8_t b[16]; } *)p));
    return _mm512_cvtepi32_ps(r);
#else
    __m256i r;
    __asm__("vpmovsxbd %1, %0" : "=x"(r) : "m"(*(const struct { int8_t b[8]; } *)p));
    return _mm256_cvtepi32_ps(r);
#endif
}

/* gg_decode_<format>: one block to its bs float32 weights, d[g] * q + m[g] with the product
 * and the sum each rounded (no fused multiply-add), which is how ggml and gguf-py compute
 * them: the file's own weights to the bit. */
#define GG_DECODE(NAME, TYPE, BS, BYTES, G, OFFSETS)                                                                    \
static void gg_decode_##NAME(const uint8_t *b, float *o) {                                                   \
    int8_t q[BS] __attribute__((aligned(64)));                                                               \
    int16_t isc[16];                                                                                         \
    float d[(BS) / (G)], m[(BS) / (G)];                                                                      \
    const int8_t *cq = unpack_##NAME(b, q, d, m, isc);                                                       \
    if ((BS) == 256)                                                                                         \
        for (int g = (BS) / (G) - 1; g >= 0; g--) d[g] = d[0] * (float)isc[g];                               \
    for (int g = 0; g < (BS) / (G); g++) {                                                                   \
        const vf dg = vf_set1(d[g]);                                                                         \
        for (int c = 0; c < (G) / VL; c++) {                                                                 \
            vf w = vf_mul(codes(cq + g * (G) + c * VL), dg);                                                 \
            if (OFFSETS) w = vf_add(w, vf_set1(m[g]));                                                       \
            vf_store(o + g * (G) + c * VL, w);                                                               \
        }                                                                                                    \
    }                                                                                                        \
}
GG_FORMATS(GG_DOT)
GG_FORMATS(GG_DECODE)

typedef struct {
    decode_fn decode;
    dot_fn dot;
    int bs, bytes, group, offsets;      /* weights and bytes a block, weights a group, has m[] */
} Format;

/* a type's format; 0 for a type this file does not read */
static int gg_format(int type, Format *f) {
#define GG_ROW(NAME, TYPE, BS, BYTES, G, OFFSETS) [TYPE] = {gg_decode_##NAME, gg_dot_##NAME, BS, BYTES, G, OFFSETS},
    static const Format table[] = {GG_FORMATS(GG_ROW)};
#undef GG_ROW
    if (type < 0 || type >= (int)(sizeof table / sizeof table[0]) || !table[type].decode) return 0;
    *f = table[type];
    return 1;
}

/* weights and bytes a block of `type` holds; 0 for a type this file does not read */
int gguf_block(int type, int *bs, int *bytes) {
    Format f;
    if (!gg_format(type, &f)) return 0;
    *bs = f.bs;
    *bytes = f.bytes;
    return 1;
}

/* 0 on success, -1 for a type this file does not read or K not a whole number of blocks, -2
 * out of memory */
int gguf_linear_f32(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, float *y,
                    int64_t ldy, int M, int N, int K, int threads) {
    Format f;
    if (!gg_format(type, &f) || K % f.bs) return -1;
    const int G = f.offsets ? f.group : 0, ng = G ? K / G : 0, CH = f.bs;    /* an activation scale per block */
    int16_t *q = malloc(sizeof(int16_t) * (size_t)M * (size_t)K + sizeof(float) * (size_t)M * (size_t)(K / CH + ng));
    if (!q) return -2;
    float *s = (float *)(q + (int64_t)M * K), *xs = s + (int64_t)M * (K / CH);
    for (int m = 0; m < M; m++)
        gg_quantize_row(x + (int64_t)m * ldx, K, G, CH, q + (int64_t)m * K, s + (int64_t)m * (K / CH), xs + (int64_t)m * ng);
    const GGX xq = {q, s, xs, K, K / CH, ng};
    /* a tile of weight rows stays in the cache while each group of GG_MB rows of x passes
     * over it, so rows of x are read from the nearest cache whatever M */
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n0 = 0; n0 < N; n0 += GG_NT)
        for (int m0 = 0; m0 < M; m0 += GG_MB)
            for (int n = n0; n < (n0 + GG_NT < N ? n0 + GG_NT : N); n++)
                f.dot(w + (int64_t)n * row_bytes, K, &xq, m0, M - m0 < GG_MB ? M - m0 : GG_MB, y, ldy, n);
    free(q);
    return 0;
}

int gguf_dequant_f32(int type, const uint8_t *w, int64_t row_bytes, float *out, int64_t ldo, int N, int K,
                     int threads) {
    Format f;
    if (!gg_format(type, &f) || K % f.bs) return -1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + (int64_t)n * row_bytes;
        for (int k0 = 0; k0 < K; k0 += f.bs, wr += f.bytes) f.decode(wr, out + (int64_t)n * ldo + k0);
    }
    return 0;
}
