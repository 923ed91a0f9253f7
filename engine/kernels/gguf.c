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
 * steps and verify passes). Activations stay in float32: llama.cpp rounds them to 8 bits
 * for its integer dot products, we do not. A block is unpacked once to its integer codes and
 * per-group scales (unpack_*), shared by all the rows of x; a group's codes, widened to
 * float, are multiplied with x in one FMA chain, and the chain's sum scaled once, so a
 * weight's scale is applied per group rather than per weight (the weights are the file's,
 * the rounding float32's). A thread takes a range of weight rows, and every output is one
 * fixed sequence of instructions owned by one thread, whatever the number of rows or
 * threads: a verify pass's rows are one-token steps bit for bit.
 *
 * gguf_dequant_f32: rows [n0, n1) decoded into float32, for a prefill's GEMM. */
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

#define GG_MB 4                 /* rows of x per pass over a weight row */

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

/* the 8 six-bit scales and mins of a Q4_K / Q5_K block's 12 bytes, times d and dmin: group j
 * < 4 takes s[j] & 63 and s[j + 4] & 63, j >= 4 the nibbles of s[j + 4] with the top two
 * bits of s[j - 4] and s[j] (ggml's get_scale_min_k4), four groups a 32-bit word at once */
static inline void scale_min_k4(const uint8_t *s, float d, float dmin, float *dsc, float *dm) {
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
    const uint32_t sc_hi = (u[2] & four) | (((u[0] >> 6) & two) << 4);
    const uint32_t mn_hi = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
    scale8((uint64_t)(u[0] & six) | (uint64_t)sc_hi << 32, 0, d, dsc);
    scale8((uint64_t)(u[1] & six) | (uint64_t)mn_hi << 32, 0, dmin, dm);
}

/* unpack_*: one block to its integer codes q (int8, in the weights' order) and, per group
 * of G weights, a scale d[g] and an offset m[g] (formats without one leave m alone), such
 * that weight e of group g is d[g] * q[e] + m[g]: the decoders' arithmetic, factored. The
 * codes are unpacked 32 at a time in AVX2's integer instructions (AVX-512 CPUs have them). */
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

static inline __attribute__((always_inline)) const int8_t *unpack_q4_0(const uint8_t *b, int8_t *q, float *d, float *m) {
    (void)m;
    d[0] = gg_half(b);
    put32(q, _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8)));
    return q;
}

static inline __attribute__((always_inline)) const int8_t *unpack_q4_1(const uint8_t *b, int8_t *q, float *d, float *m) {
    d[0] = gg_half(b);
    m[0] = gg_half(b + 2);
    put32(q, nibbles(b + 4));
    return q;
}

static inline __attribute__((always_inline)) const int8_t *unpack_q5_0(const uint8_t *b, int8_t *q, float *d, float *m) {
    (void)m;
    d[0] = gg_half(b);
    put32(q, _mm256_sub_epi8(_mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2)), _mm256_set1_epi8(16)));
    return q;
}

static inline __attribute__((always_inline)) const int8_t *unpack_q5_1(const uint8_t *b, int8_t *q, float *d, float *m) {
    d[0] = gg_half(b);
    m[0] = gg_half(b + 2);
    put32(q, _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4)));
    return q;
}

static inline __attribute__((always_inline)) const int8_t *unpack_q8_0(const uint8_t *b, int8_t *q, float *d, float *m) {
    (void)m;
    (void)q;
    d[0] = gg_half(b);
    return (const int8_t *)(b + 2);             /* the codes as stored */
}

static inline __attribute__((always_inline)) const int8_t *unpack_iq4_nl(const uint8_t *b, int8_t *q, float *d, float *m) {
    (void)m;
    d[0] = gg_half(b);
    put32(q, iq4_values(b + 2));
    return q;
}

/* scales[16] qs[64] d dmin: 16 groups of 16, q in 0..3 */
static inline __attribute__((always_inline)) const int8_t *unpack_q2_k(const uint8_t *b, int8_t *q, float *d, float *m) {
    const uint8_t *sc = b, *qs = b + 16;
    const float dd = gg_half(b + 80), dmin = gg_half(b + 82);
    uint64_t v[2];
    memcpy(v, sc, 16);
    for (int h = 0; h < 2; h++) {
        scale8(v[h] & 0x0f0f0f0f0f0f0f0full, 0, dd, d + 8 * h);
        scale8((v[h] >> 4) & 0x0f0f0f0f0f0f0f0full, 0, -dmin, m + 8 * h);
    }
    for (int h = 0; h < 2; h++) {
        const __m256i v = ld32(qs + h * 32);
        for (int s = 0; s < 4; s++) put32(q + h * 128 + s * 32, low_bits(v, 2 * s, 3));
    }
    return q;
}

/* hmask[32] qs[64] scales[12] d: 16 groups of 16, q in -4..3 (4 less where hmask's bit is clear) */
static inline __attribute__((always_inline)) const int8_t *unpack_q3_k(const uint8_t *b, int8_t *q, float *d, float *m) {
    (void)m;
    const uint8_t *qs = b + 32, *sc = b + 96;
    const float dd = gg_half(b + 108);
    for (int i = 0; i < 16; i++) {
        const int lo = i < 8 ? sc[i] & 0xf : sc[i - 8] >> 4;
        const int hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        d[i] = dd * (float)((int8_t)(lo | (hi << 4)) - 32);
    }
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
static inline __attribute__((always_inline)) const int8_t *unpack_q4_k(const uint8_t *b, int8_t *q, float *d, float *m) {
    scale_min_k4(b + 4, gg_half(b), -gg_half(b + 2), d, m);        /* -(dmin * mn), exactly */
    for (int c = 0; c < 4; c++) {
        const __m256i v = ld32(b + 16 + c * 32);
        put32(q + c * 64, low_bits(v, 0, 0xf));
        put32(q + c * 64 + 32, low_bits(v, 4, 0xf));
    }
    return q;
}

/* d dmin scales[12] qh[32] qs[128]: as Q4_K with a fifth bit per weight, q in 0..31 */
static inline __attribute__((always_inline)) const int8_t *unpack_q5_k(const uint8_t *b, int8_t *q, float *d, float *m) {
    scale_min_k4(b + 4, gg_half(b), -gg_half(b + 2), d, m);
    const __m256i qh = ld32(b + 16);
    for (int c = 0; c < 4; c++) {
        const __m256i v = ld32(b + 48 + c * 32);
        put32(q + c * 64, _mm256_or_si256(low_bits(v, 0, 0xf), _mm256_slli_epi16(low_bits(qh, 2 * c, 1), 4)));
        put32(q + c * 64 + 32, _mm256_or_si256(low_bits(v, 4, 0xf), _mm256_slli_epi16(low_bits(qh, 2 * c + 1, 1), 4)));
    }
    return q;
}

/* ql[128] qh[64] scales[16] (int8) d: 16 groups of 16, q in -32..31 */
static inline __attribute__((always_inline)) const int8_t *unpack_q6_k(const uint8_t *b, int8_t *q, float *d, float *m) {
    (void)m;
    uint64_t sc[2];
    memcpy(sc, b + 192, 16);
    const float dd = gg_half(b + 208);
    scale8(sc[0], 1, dd, d);
    scale8(sc[1], 1, dd, d + 8);
    const __m256i bias = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        const __m256i qh = ld32(b + 128 + h * 32);
        for (int s = 0; s < 4; s++) {
            const __m256i lo = low_bits(ld32(b + h * 64 + (s & 1) * 32), 4 * (s >> 1), 0xf);
            const __m256i hi = _mm256_slli_epi16(low_bits(qh, 2 * s, 3), 4);
            put32(q + h * 128 + s * 32, _mm256_sub_epi8(_mm256_or_si256(lo, hi), bias));
        }
    }
    return q;
}

/* d scales_h(u16) scales_l[4] qs[128]: 8 groups of 32, 6-bit signed scales, IQ4_NL's values */
static inline __attribute__((always_inline)) const int8_t *unpack_iq4_xs(const uint8_t *b, int8_t *q, float *d, float *m) {
    (void)m;
    const float dd = gg_half(b);
    const int sh = b[2] | (b[3] << 8);
    uint32_t x;
    memcpy(&x, b + 4, 4);
    /* group g's scale: nibble g of scales_l, bits 2g, 2g+1 of scales_h above it, less 32 */
    const __m128i lo = _mm_cvtsi32_si128((int)(x & 0x0f0f0f0fu)), hi = _mm_cvtsi32_si128((int)((x >> 4) & 0x0f0f0f0fu));
    const __m256i top = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(sh), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                         _mm256_set1_epi32(3));
    const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)),
                                                        _mm256_slli_epi32(top, 4)), _mm256_set1_epi32(32));
    _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(sc), _mm256_set1_ps(dd)));
    for (int g = 0; g < 8; g++) put32(q + g * 32, iq4_values(b + 8 + g * 16));
    return q;
}

typedef void (*decode_fn)(const uint8_t *, float *);
typedef void (*dot_fn)(const uint8_t *, int, const float *, int64_t, const float *, int64_t, int, int, float *,
                       int64_t, int);

/* a fixed-order sum of 8 lanes (as the AVX2 build's vf_sum) */
static inline float sum8(__m256 v) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
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

/* gg_dot_<format>: y[m0 + m, n] for m < mb, weight row n (K weights at wr) against x rows
 * m0.. For each group of G weights, p = sum x * q in VL lanes (a fixed chain), then acc +=
 * d[g] * p; for formats with offsets, the groups' m[g] * xs[g] (xs: x summed over the
 * group, once per row) are summed apart: eight groups a fused vector product-sum where a
 * block has eight or sixteen, else one fused scalar product-sum a group (fused, so no
 * build's contraction flags change a bit). One body per row count (MROWS, a constant), so
 * the accumulators stay in registers. One fixed sequence per output, whatever mb or the
 * thread. */
#define GG_DOT(NAME, TYPE, BS, BYTES, G, OFFSETS)                                                                    \
static inline __attribute__((always_inline)) void gg_rows_##NAME(                                                \
        const uint8_t *wr, int K, const float *x, int64_t ldx, const float *xs, int64_t ldxs, int m0, const int MROWS, \
        float *y, int64_t ldy, int n) {                                                                          \
    enum { NG = (BS) / (G), VEC_OFF = (OFFSETS) && NG % 8 == 0 };                                                \
    int8_t q[BS] __attribute__((aligned(64)));                                                                   \
    float d[NG], off_g[NG];                                                                                      \
    vf acc[GG_MB];                                                                                               \
    __m256 offv[GG_MB];                                                                                          \
    float off[GG_MB];                                                                                            \
    for (int m = 0; m < MROWS; m++) {                                                                               \
        acc[m] = vf_zero();                                                                                      \
        offv[m] = _mm256_setzero_ps();                                                                           \
        off[m] = 0.f;                                                                                            \
    }                                                                                                            \
    for (int k0 = 0; k0 < K; k0 += (BS), wr += (BYTES)) {                                                        \
        const int8_t *cq = unpack_##NAME(wr, q, d, off_g);                                                       \
        for (int g = 0; g < NG; g++) {                                                                           \
            const int at = k0 + g * (G);                                                                         \
            vf w[(G) / VL];                                                                                      \
            for (int c = 0; c < (G) / VL; c++) w[c] = codes(cq + g * (G) + c * VL);                             \
            const vf dg = vf_set1(d[g]);                                                                         \
            for (int m = 0; m < MROWS; m++) {                                                                       \
                const float *xr = x + (int64_t)(m0 + m) * ldx + at;                                              \
                vf p = vf_mul(vf_load(xr), w[0]);                                                                \
                for (int c = 1; c < (G) / VL; c++) p = vf_fmadd(vf_load(xr + c * VL), w[c], p);                 \
                acc[m] = vf_fmadd(dg, p, acc[m]);                                                                \
                if ((OFFSETS) && !VEC_OFF)                                                                       \
                    off[m] = fmaf(off_g[g], xs[(int64_t)(m0 + m) * ldxs + at / (G)], off[m]);                   \
            }                                                                                                    \
        }                                                                                                        \
        if (VEC_OFF)                                                                                             \
            for (int m = 0; m < MROWS; m++)                                                                         \
                for (int g = 0; g < NG; g += 8)                                                                  \
                    offv[m] = _mm256_fmadd_ps(_mm256_loadu_ps(off_g + g),                                        \
                                              _mm256_loadu_ps(xs + (int64_t)(m0 + m) * ldxs + k0 / (G) + g), offv[m]); \
    }                                                                                                            \
    for (int m = 0; m < MROWS; m++)                                                                                 \
        y[(int64_t)(m0 + m) * ldy + n] = vf_sum(acc[m]) + (VEC_OFF ? sum8(offv[m]) : off[m]);                   \
}                                                                                                                \
static void gg_dot_##NAME(const uint8_t *wr, int K, const float *x, int64_t ldx, const float *xs, int64_t ldxs,  \
                          int m0, int mb, float *y, int64_t ldy, int n) {                                        \
    switch (mb) {                                                                                                \
    case 1: gg_rows_##NAME(wr, K, x, ldx, xs, ldxs, m0, 1, y, ldy, n); break;                                    \
    case 2: gg_rows_##NAME(wr, K, x, ldx, xs, ldxs, m0, 2, y, ldy, n); break;                                    \
    case 3: gg_rows_##NAME(wr, K, x, ldx, xs, ldxs, m0, 3, y, ldy, n); break;                                    \
    default: gg_rows_##NAME(wr, K, x, ldx, xs, ldxs, m0, 4, y, ldy, n); break;                                   \
    }                                                                                                            \
}
/* gg_decode_<format>: one block to its bs float32 weights, d[g] * q + m[g] with the product
 * and the sum each rounded (no fused multiply-add), which is how ggml and gguf-py compute
 * them: the file's own weights to the bit. */
#define GG_DECODE(NAME, TYPE, BS, BYTES, G, OFFSETS)                                                                    \
static void gg_decode_##NAME(const uint8_t *b, float *o) {                                                   \
    int8_t q[BS] __attribute__((aligned(64)));                                                               \
    float d[(BS) / (G)], m[(BS) / (G)];                                                                      \
    const int8_t *cq = unpack_##NAME(b, q, d, m);                                                            \
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

/* 0 on success, -1 for a type this file does not read or K not a whole number of blocks */
int gguf_linear_f32(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, float *y,
                    int64_t ldy, int M, int N, int K, int threads) {
    Format f;
    if (!gg_format(type, &f) || K % f.bs) return -1;
    const int G = f.group, ng = K / G;
    float xs_stack[4096];
    float *xs = f.offsets && (int64_t)M * ng > 4096 ? malloc(sizeof(float) * (size_t)M * (size_t)ng) : xs_stack;
    if (!xs) return -2;
    if (f.offsets)
        for (int m = 0; m < M; m++)
            for (int g = 0; g < ng; g++) {
                const float *xr = x + (int64_t)m * ldx + (int64_t)g * G;
                float s = 0.f;
                for (int k = 0; k < G; k++) s += xr[k];
                xs[(int64_t)m * ng + g] = s;
            }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++)
        for (int m0 = 0; m0 < M; m0 += GG_MB)
            f.dot(w + (int64_t)n * row_bytes, K, x, ldx, xs, ng, m0, M - m0 < GG_MB ? M - m0 : GG_MB, y, ldy, n);
    if (xs != xs_stack) free(xs);
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
