/* The block formats of GGUF files, read where they lie: a weight [N, K] is N rows of K/bs
 * blocks, each block `bytes` bytes holding bs weights (32 for Q4_0 ... Q8_0 and IQ4_NL, 256
 * for the K-quants and IQ4_XS), laid out as ggml writes them (ggml-common.h; gguf-py's
 * quants.py reads the same bytes in numpy).
 *
 * decode_*: one block to bs float32 weights, each computed as ggml and gguf-py compute it
 * (a product, then a sum or difference, each rounded to float32: this file is built with
 * -ffp-contract=off, so no compiler fuses them), so the weights are the file's own to the
 * bit.
 *
 * gguf_linear_f32: y[m, n] = sum_k x[m, k] w[n, k] for a few float32 rows of x (one-token
 * steps and verify passes). Activations stay in float32: llama.cpp rounds them to 8 bits
 * for its integer dot products, we do not. A thread takes a range of weight rows; for each
 * it decodes a block once for all the rows of x, and accumulates in FMA chains fixed by
 * the position within the block (32 / VL chains, added in one order at the end). So every
 * output is one fixed sequence of instructions owned by one thread, whatever the number of
 * rows or threads: a verify pass's rows are one-token steps bit for bit.
 *
 * gguf_dequant_f32: rows [n0, n1) decoded into float32, for a prefill's GEMM. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
       Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23 };

#define GG_MB 4                 /* rows of x per pass over a weight row */
#define GG_CHAINS (32 / VL)     /* accumulators per row: one per vector of a 32-weight group */

static const int8_t kvalues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* IEEE half to float32, exactly (subnormals included) */
static inline float f16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0) {
        float v = ldexpf((float)m, -24);
        return sign ? -v : v;
    }
    bits = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void decode_q4_0(const uint8_t *b, float *o) {
    const float d = f16(b);
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)((b[2 + j] & 0xf) - 8);
        o[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
}

static void decode_q4_1(const uint8_t *b, float *o) {
    const float d = f16(b), m = f16(b + 2);
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)(b[4 + j] & 0xf) + m;
        o[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
}

static void decode_q5_0(const uint8_t *b, float *o) {
    const float d = f16(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)((int)((b[6 + j] & 0xf) | (((qh >> j) & 1) << 4)) - 16);
        o[j + 16] = d * (float)((int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
}

static void decode_q5_1(const uint8_t *b, float *o) {
    const float d = f16(b), m = f16(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)((b[8 + j] & 0xf) | (((qh >> j) & 1) << 4)) + m;
        o[j + 16] = d * (float)((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
    }
}

static void decode_q8_0(const uint8_t *b, float *o) {
    const float d = f16(b);
    for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)b[2 + j] * d;
}

static void decode_iq4_nl(const uint8_t *b, float *o) {
    const float d = f16(b);
    for (int j = 0; j < 16; j++) {
        o[j] = d * (float)kvalues[b[2 + j] & 0xf];
        o[j + 16] = d * (float)kvalues[b[2 + j] >> 4];
    }
}

/* scales[16] qs[64] d dmin: 16 groups of 16, w = d*(sc & 15) * q - dmin*(sc >> 4) */
static void decode_q2_k(const uint8_t *b, float *o) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = f16(b + 80), dmin = f16(b + 82);
    float dl[16], ml[16];
    for (int i = 0; i < 16; i++) {
        dl[i] = d * (float)(sc[i] & 0xf);
        ml[i] = dmin * (float)(sc[i] >> 4);
    }
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                const int e = h * 128 + s * 32 + l;
                o[e] = dl[e / 16] * (float)((qs[h * 32 + l] >> (2 * s)) & 3) - ml[e / 16];
            }
}

/* hmask[32] qs[64] scales[12] d: 16 groups of 16, 6-bit signed scales, q in -4..3 */
static void decode_q3_k(const uint8_t *b, float *o) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = f16(b + 108);
    float dl[16];
    for (int i = 0; i < 16; i++) {
        const int lo = i < 8 ? sc[i] & 0xf : sc[i - 8] >> 4;
        const int hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        dl[i] = d * (float)((int8_t)(lo | (hi << 4)) - 32);
    }
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                const int e = h * 128 + s * 32 + l;
                const int q = ((qs[h * 32 + l] >> (2 * s)) & 3) - (((hm[l] >> (e / 32)) & 1) ? 0 : 4);
                o[e] = dl[e / 16] * (float)q;
            }
}

/* the 8 six-bit scales and mins of a Q4_K / Q5_K block's 12 bytes */
static void scale_min_k4(const uint8_t *s, float d, float dmin, float *dsc, float *dm) {
    for (int j = 0; j < 8; j++) {
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0xf) | ((s[j - 4] >> 2) & 0x30);
        const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
        dsc[j] = d * (float)sc;
        dm[j] = dmin * (float)mn;
    }
}

/* d dmin scales[12] qs[128]: 8 groups of 32, w = d*sc * q - dmin*m */
static void decode_q4_k(const uint8_t *b, float *o) {
    float dsc[8], dm[8];
    scale_min_k4(b + 4, f16(b), f16(b + 2), dsc, dm);
    const uint8_t *qs = b + 16;
    for (int c = 0; c < 4; c++)
        for (int s = 0; s < 2; s++)
            for (int l = 0; l < 32; l++) {
                const int g = c * 2 + s;
                o[g * 32 + l] = dsc[g] * (float)((qs[c * 32 + l] >> (4 * s)) & 0xf) - dm[g];
            }
}

/* d dmin scales[12] qh[32] qs[128]: as Q4_K with a fifth bit per weight */
static void decode_q5_k(const uint8_t *b, float *o) {
    float dsc[8], dm[8];
    scale_min_k4(b + 4, f16(b), f16(b + 2), dsc, dm);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int c = 0; c < 4; c++)
        for (int s = 0; s < 2; s++)
            for (int l = 0; l < 32; l++) {
                const int g = c * 2 + s;
                const int q = ((qs[c * 32 + l] >> (4 * s)) & 0xf) | (((qh[l] >> g) & 1) << 4);
                o[g * 32 + l] = dsc[g] * (float)q - dm[g];
            }
}

/* ql[128] qh[64] scales[16] (int8) d: 16 groups of 16, q in -32..31 */
static void decode_q6_k(const uint8_t *b, float *o) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16(b + 208);
    float dl[16];
    for (int i = 0; i < 16; i++) dl[i] = d * (float)sc[i];
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                const int e = h * 128 + s * 32 + l;
                const int lo = (ql[h * 64 + (s & 1) * 32 + l] >> (4 * (s >> 1))) & 0xf;
                const int hi = (qh[h * 32 + l] >> (2 * s)) & 3;
                o[e] = dl[e / 16] * (float)((lo | (hi << 4)) - 32);
            }
}

/* d scales_h(u16) scales_l[4] qs[128]: 8 groups of 32, 6-bit signed scales, IQ4_NL's values */
static void decode_iq4_xs(const uint8_t *b, float *o) {
    const float d = f16(b);
    const uint16_t sh = (uint16_t)(b[2] | (b[3] << 8));
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int g = 0; g < 8; g++) {
        const int s = ((sl[g / 2] >> (4 * (g % 2))) & 0xf) | (((sh >> (2 * g)) & 3) << 4);
        const float dl = d * (float)((int8_t)s - 32);
        for (int half = 0; half < 2; half++)
            for (int l = 0; l < 16; l++)
                o[g * 32 + half * 16 + l] = dl * (float)kvalues[(qs[g * 16 + l] >> (4 * half)) & 0xf];
    }
}

typedef void (*decode_fn)(const uint8_t *, float *);

/* a type's decoder, weights a block and bytes a block; 0 for a type this file does not read */
static int format(int type, decode_fn *fn, int *bs, int *bytes) {
    switch (type) {
    case Q4_0: *fn = decode_q4_0; *bs = 32; *bytes = 18; return 1;
    case Q4_1: *fn = decode_q4_1; *bs = 32; *bytes = 20; return 1;
    case Q5_0: *fn = decode_q5_0; *bs = 32; *bytes = 22; return 1;
    case Q5_1: *fn = decode_q5_1; *bs = 32; *bytes = 24; return 1;
    case Q8_0: *fn = decode_q8_0; *bs = 32; *bytes = 34; return 1;
    case IQ4_NL: *fn = decode_iq4_nl; *bs = 32; *bytes = 18; return 1;
    case Q2_K: *fn = decode_q2_k; *bs = 256; *bytes = 84; return 1;
    case Q3_K: *fn = decode_q3_k; *bs = 256; *bytes = 110; return 1;
    case Q4_K: *fn = decode_q4_k; *bs = 256; *bytes = 144; return 1;
    case Q5_K: *fn = decode_q5_k; *bs = 256; *bytes = 176; return 1;
    case Q6_K: *fn = decode_q6_k; *bs = 256; *bytes = 210; return 1;
    case IQ4_XS: *fn = decode_iq4_xs; *bs = 256; *bytes = 136; return 1;
    default: return 0;
    }
}

/* weights and bytes a block of `type` holds; 0 for a type this file does not read */
int gguf_block(int type, int *bs, int *bytes) {
    decode_fn fn;
    return format(type, &fn, bs, bytes);
}

/* y[m0 + m, n] for m < mb: weight row n (row_bytes apart) against x rows m0.. (float32, ldx) */
static inline void gg_rows(decode_fn fn, int bs, int bytes, const uint8_t *wr, int K, const float *x, int64_t ldx,
                           int m0, int mb, float *y, int64_t ldy, int n) {
    float wb[256] __attribute__((aligned(64)));
    vf acc[GG_MB][GG_CHAINS];
    for (int m = 0; m < GG_MB; m++)
        for (int c = 0; c < GG_CHAINS; c++) acc[m][c] = vf_zero();
    for (int k0 = 0; k0 < K; k0 += bs, wr += bytes) {
        fn(wr, wb);
        for (int m = 0; m < mb; m++) {
            const float *xr = x + (int64_t)(m0 + m) * ldx + k0;
            for (int k = 0; k < bs; k += 32)
                for (int c = 0; c < GG_CHAINS; c++)
                    acc[m][c] = vf_fmadd(vf_load(xr + k + c * VL), vf_load(wb + k + c * VL), acc[m][c]);
        }
    }
    for (int m = 0; m < mb; m++) {
        vf s = acc[m][0];
        for (int c = 1; c < GG_CHAINS; c++) s = vf_add(s, acc[m][c]);
        y[(int64_t)(m0 + m) * ldy + n] = vf_sum(s);
    }
}

/* 0 on success, -1 for a type this file does not read or K not a whole number of blocks */
int gguf_linear_f32(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, float *y,
                    int64_t ldy, int M, int N, int K, int threads) {
    decode_fn fn;
    int bs, bytes;
    if (!format(type, &fn, &bs, &bytes) || K % bs) return -1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++)
        for (int m0 = 0; m0 < M; m0 += GG_MB)
            gg_rows(fn, bs, bytes, w + (int64_t)n * row_bytes, K, x, ldx, m0, M - m0 < GG_MB ? M - m0 : GG_MB,
                    y, ldy, n);
    return 0;
}

int gguf_dequant_f32(int type, const uint8_t *w, int64_t row_bytes, float *out, int64_t ldo, int N, int K,
                     int threads) {
    decode_fn fn;
    int bs, bytes;
    if (!format(type, &fn, &bs, &bytes) || K % bs) return -1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const uint8_t *wr = w + (int64_t)n * row_bytes;
        for (int k0 = 0; k0 < K; k0 += bs, wr += bytes) fn(wr, out + (int64_t)n * ldo + k0);
    }
    return 0;
}
