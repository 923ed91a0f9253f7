/* y = x @ w.T (+ bias) for a few bfloat16 rows of x and a group-wise int4 weight in its
 * canonical form (engine/targets/qweights.py): w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g],
 * q as nibbles [N, K/2] (even k in the low nibble), scale and zero [N, K/group] in bf16.
 *
 * AVX-512 (with AVX512-BF16):
 * Per group of the input, the dot product splits in two:
 *   sum_k x[k] * w[n, k] = scale[n, g] * sum_k x[k] * (q[n, k] - 8) + zero[n, g] * sum_k x[k]
 * The first sum runs on AVX512-BF16 (q - 8 is exact in bf16, a code read once through a
 * 16-entry table); the second is one product per group with the row's group sum, computed
 * once per call. The weight is read at 0.625 bytes a parameter (0.5 + scale and zero).
 *
 * AVX2 has no bf16 dot product, and widening codes and x to float32 for FMAs took three
 * times the instructions a code of llama.cpp's (which multiplies 8-bit integers). Here x is
 * rounded per block of 32 to 16-bit integers (xi * sx, |xi| <= 32767: an error of at most
 * 2^-16 of the block's largest |x|, far below x's own bf16 rounding), and the codes times
 * xi are summed exactly in 32-bit integers, sixteen pairs per instruction; each block's
 * integer sum is then scaled in float32. The zero term uses the same rounded x, so the
 * result is that x's exact dot product with w, rounded by float32 sums only.
 *
 * As in rows.c, every output element is one fixed sequence of instructions owned by one
 * thread, whatever the number of rows or threads: a verify pass's rows are one-token steps
 * bit for bit. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"

#if LC_AVX512

#define Q4_MB 4             /* x rows per pass over a weight row (it stays in L1 between passes) */
#define Q4_PREFETCH 2048

/* One block of 64 codes (32 bytes) as two vectors of bf16 values 128 + q (exact: 0x4300 is
 * 128 and the low 7 mantissa bits count up from it): *lo the low nibbles (even k), *hi the
 * high ones (odd k); x is split to match (q4_split). Five instructions for 64 weights: the
 * kernel's first form (a 16-entry table lookup per 32 codes, lanes in k order) ran 2.3x
 * slower than aten's int4 kernel, this one faster. */
static inline void q4_codes(const uint8_t *p, __m512bh *lo, __m512bh *hi) {
    __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    __m512i base = _mm512_set1_epi16(0x4300);
    *lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi16(0x0f)), base);
    *hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), base);
}

/* A block's scales as 16 float lanes. The dot product of a block lands in lanes 0-7 for
 * its first 32 k (both halves of x' start there) and lanes 8-15 for the last 32: with
 * groups of 32 the two halves take the two groups' scales, else one scale. */
static inline __m512 q4_scales(const uint16_t *sr, int g, int group) {
    if (group == 32) {
        uint32_t pair;
        memcpy(&pair, sr + g, 4);
        __m512i v = _mm512_set1_epi32((int)pair);
        return _mm512_castsi512_ps(_mm512_mask_blend_epi32((__mmask16)0xff00, _mm512_slli_epi32(v, 16),
                                                           _mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))));
    }
    return _mm512_set1_ps(from_bf16(sr[g]));
}

/* bf16 values [0, n) of p (n <= 16) as float32 lanes */
static inline __m512 q4_f32(const uint16_t *p, int n) {
    __mmask16 k = n >= 16 ? (__mmask16)0xffff : (__mmask16)(0xffffu >> (16 - n));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

/* rows [m0, m0+mb) of the split x against weight row n:
 *   sum_k x w = sum_g [scale_g * sum_k x (128 + q) + (zero_g - 136 scale_g) * xsum_g]
 * since w = (q - 8) scale + zero. Even and odd blocks accumulate apart (two dependency
 * chains); the second sum is one vector pass over the row's scales and zeros. */
static inline __attribute__((always_inline)) void q4_rows(
        const uint16_t *xs, int K, const float *xsum, const uint8_t *q, const uint16_t *scale,
        const uint16_t *zero, const uint16_t *bias, uint16_t *y, int64_t ldy, int m0, int mb, int n,
        int group) {
    const int G = K / group;
    const uint8_t *qr = q + (int64_t)n * (K / 2);
    const uint16_t *sr = scale + (int64_t)n * G, *zr = zero + (int64_t)n * G;
    const uint16_t *xr[Q4_MB];
    __m512 acc[2][Q4_MB];
    for (int m = 0; m < Q4_MB; m++) {
        xr[m] = xs + (int64_t)(m0 + (m < mb ? m : 0)) * K;
        acc[0][m] = acc[1][m] = _mm512_setzero_ps();
    }
    for (int k = 0; k < K; k += 128) {
        for (int half = 0; half < 2; half++) {          /* constant after unrolling: acc stays in registers */
            int kb = k + 64 * half;
            if (kb >= K) break;
            __m512bh lo, hi;
            _mm_prefetch((const char *)(qr + kb / 2) + Q4_PREFETCH, _MM_HINT_T0);
            q4_codes(qr + kb / 2, &lo, &hi);
            __m512 sv = q4_scales(sr, kb / group, group);
            for (int m = 0; m < Q4_MB; m++) {
                if (m >= mb) break;
                __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(xr[m] + kb), lo);
                d = _mm512_dpbf16_ps(d, (__m512bh)_mm512_loadu_si512(xr[m] + kb + 32), hi);
                acc[half][m] = _mm512_fmadd_ps(d, sv, acc[half][m]);
            }
        }
    }
    for (int m = 0; m < mb; m++) {
        const float *xm = xsum + (int64_t)(m0 + m) * G;
        __m512 cv = _mm512_setzero_ps();
        for (int g0 = 0; g0 < G; g0 += 16) {
            int n16 = G - g0 < 16 ? G - g0 : 16;
            __mmask16 km = n16 >= 16 ? (__mmask16)0xffff : (__mmask16)(0xffffu >> (16 - n16));
            __m512 c = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), q4_f32(sr + g0, n16), q4_f32(zr + g0, n16));
            cv = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(km, xm + g0), cv);
        }
        float v = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][m], acc[1][m])) + _mm512_reduce_add_ps(cv);
        if (bias) v += from_bf16(bias[n]);
        y[(int64_t)(m0 + m) * ldy + n] = to_bf16(v);
    }
}

/* Each row of x, block of 64 by block, as [even k | odd k] (the codes' lane order), and its
 * sum per group, in one fixed order (a row's own, whatever M). */
static void q4_split(const uint16_t *x, int64_t ldx, int M, int K, int group, uint16_t *xs, float *xsum) {
    uint16_t even[32], odd[32];
    for (int i = 0; i < 32; i++) { even[i] = (uint16_t)(2 * i); odd[i] = (uint16_t)(2 * i + 1); }
    __m512i ie = _mm512_loadu_si512(even), io = _mm512_loadu_si512(odd);
    const int G = K / group;
    for (int m = 0; m < M; m++) {
        const uint16_t *xm = x + (int64_t)m * ldx;
        for (int k = 0; k < K; k += 64) {
            __m512i a = _mm512_loadu_si512(xm + k), b = _mm512_loadu_si512(xm + k + 32);
            _mm512_storeu_si512(xs + (int64_t)m * K + k, _mm512_permutex2var_epi16(a, ie, b));
            _mm512_storeu_si512(xs + (int64_t)m * K + k + 32, _mm512_permutex2var_epi16(a, io, b));
        }
        for (int g = 0; g < G; g++) {
            __m512 s = _mm512_setzero_ps();
            for (int k = g * group; k < (g + 1) * group; k += 16)
                s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xm + k))), 16)));
            xsum[(int64_t)m * G + g] = _mm512_reduce_add_ps(s);
        }
    }
}

/* Bytes of scratch linear_q4_bf16 needs for M rows of K */
int64_t q4_scratch_bytes(int M, int K, int group) {
    return (int64_t)M * K * 2 + (int64_t)M * (K / group) * 4 + 64;
}

/* x: [M, K] bf16 (row stride ldx), q: [N, K/2], scale/zero: [N, K/group], bias: [N] or NULL,
 * y: [M, N] (row stride ldy); scratch: q4_scratch_bytes(M, K, group). K % 64 == 0,
 * K % group == 0, group in 32, 64, 128, 256. */
void linear_q4_bf16(const uint16_t *x, int64_t ldx, const uint8_t *q, const uint16_t *scale,
                    const uint16_t *zero, int group, const uint16_t *bias, uint16_t *y, int64_t ldy,
                    int M, int N, int K, void *scratch, int threads) {
    uint16_t *xs = (uint16_t *)scratch;
    float *xsum = (float *)(((uintptr_t)(xs + (int64_t)M * K) + 63) & ~(uintptr_t)63);
    q4_split(x, ldx, M, K, group, xs, xsum);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++)
        for (int m0 = 0; m0 < M; m0 += Q4_MB) {
            int mb = M - m0 < Q4_MB ? M - m0 : Q4_MB;
            if (mb == Q4_MB) q4_rows(xs, K, xsum, q, scale, zero, bias, y, ldy, m0, Q4_MB, n, group);
            else if (mb == 1) q4_rows(xs, K, xsum, q, scale, zero, bias, y, ldy, m0, 1, n, group);
            else q4_rows(xs, K, xsum, q, scale, zero, bias, y, ldy, m0, mb, n, group);
        }
}

/* w [N, K] bf16: the definition's weights, (q - 8) * scale + zero in float32, rounded once,
 * in one pass over the codes: what a prefill multiplies by with torch's GEMM (at hundreds of
 * rows a GEMM beats this file's row kernel, and dequantizing in torch took five passes over
 * a full-size temporary). 32 codes a step: their even and odd k as two float vectors, each
 * rounded to bf16, interleaved back by 32-bit lanes (the even one in the low half). */
void dequant_q4_bf16(const uint8_t *q, const uint16_t *scale, const uint16_t *zero, int group, uint16_t *w,
                     int N, int K, int threads) {
    const int G = K / group;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const uint8_t *qr = q + (int64_t)n * (K / 2);
        uint16_t *wr = w + (int64_t)n * K;
        for (int k = 0; k < K; k += 32) {
            int g = k / group;
            __m512 s = _mm512_set1_ps(from_bf16(scale[(int64_t)n * G + g]));
            __m512 z = _mm512_set1_ps(from_bf16(zero[(int64_t)n * G + g]));
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qr + k / 2)));
            __m512i eight = _mm512_set1_epi32(8);
            __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(v, _mm512_set1_epi32(15)), eight));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight));
            __m256i el = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(lo, s, z));
            __m256i od = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(hi, s, z));
            _mm512_storeu_si512(wr + k, _mm512_or_si512(_mm512_cvtepu16_epi32(el),
                                                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(od), 16)));
        }
    }
}

#else
#define Q4_MB 4             /* x rows per pass over a weight row: 8 accumulators, 2 code vectors */
#define Q4_PREFETCH 2048

/* bf16 values [0, min(n, 8)) of p as float32 lanes, the rest 0 */
static inline __m256 q4_f32(const uint16_t *p, int n) {
    __m128i v;
    if (n >= 8) {
        v = _mm_loadu_si128((const __m128i *)p);
    } else {
        uint16_t tail[8] = {0};
        memcpy(tail, p, (size_t)n * 2);
        v = _mm_loadu_si128((const __m128i *)tail);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* rows [m0, m0+mb) of the rounded x against weight row n:
 *   sum_k x w = sum_b scale_g(b) * sx_b * sum_k xi q + sum_g (zero_g - 8 scale_g) * xsum_g
 * Even and odd blocks accumulate apart (two dependency chains). */
static inline __attribute__((always_inline)) void q4_rows(
        const int16_t *xs, const float *xsc, int K, const float *xsum, const uint8_t *q, const uint16_t *scale,
        const uint16_t *zero, const uint16_t *bias, uint16_t *y, int64_t ldy, int m0, int mb, int n,
        int group) {
    const int G = K / group, B = K / 32;
    const uint8_t *qr = q + (int64_t)n * (K / 2);
    const uint16_t *sr = scale + (int64_t)n * G, *zr = zero + (int64_t)n * G;
    const int16_t *xr[Q4_MB];
    const float *cr[Q4_MB];
    vf acc[2][Q4_MB];
    for (int m = 0; m < Q4_MB; m++) {
        int row = m0 + (m < mb ? m : 0);
        xr[m] = xs + (int64_t)row * K;
        cr[m] = xsc + (int64_t)row * B;
        acc[0][m] = acc[1][m] = vf_zero();
    }
    for (int k = 0; k < K; k += 64) {
        for (int half = 0; half < 2; half++) {          /* constant after unrolling: acc stays in registers */
            int kb = k + 32 * half;
            if (kb >= K) break;
            _mm_prefetch((const char *)(qr + kb / 2) + Q4_PREFETCH, _MM_HINT_T0);
            __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qr + kb / 2)));
            __m256i lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0f)), hi = _mm256_srli_epi16(v, 4);
            float sw = from_bf16(sr[kb / group]);
            for (int m = 0; m < Q4_MB; m++) {
                if (m >= mb) break;
                __m256i d = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)(xr[m] + kb))),
                                             _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr[m] + kb + 16))));
                acc[half][m] = vf_fmadd(_mm256_cvtepi32_ps(d), vf_set1(sw * cr[m][kb / 32]), acc[half][m]);
            }
        }
    }
    for (int m = 0; m < mb; m++) {
        const float *xm = xsum + (int64_t)(m0 + m) * G;
        vf cv = vf_zero();
        for (int g0 = 0; g0 < G; g0 += 8) {
            vf c = vf_fnmadd(vf_set1(8.f), q4_f32(sr + g0, G - g0), q4_f32(zr + g0, G - g0));
            cv = vf_fmadd(c, vf_load_n(xm + g0, G - g0), cv);
        }
        float v = vf_sum(vf_add(acc[0][m], acc[1][m])) + vf_sum(cv);
        if (bias) v += from_bf16(bias[n]);
        y[(int64_t)(m0 + m) * ldy + n] = to_bf16(v);
    }
}

/* Each row of x, block of 32 by block: rounded to xi (its even k, then its odd k: the codes'
 * lane order) with the block's sx, and the rounded x's sum per group, in one fixed order. */
static void q4_split(const uint16_t *x, int64_t ldx, int M, int K, int group, int16_t *xs, float *xsc,
                     float *xsum) {
    const int G = K / group, B = K / 32;
    for (int m = 0; m < M; m++) {
        const uint16_t *xm = x + (int64_t)m * ldx;
        for (int g = 0; g < G; g++) xsum[(int64_t)m * G + g] = 0.f;
        for (int b = 0; b < B; b++) {
            float f[32], amax = 0.f;
            int nan = 0;
            for (int i = 0; i < 32; i++) {
                f[i] = from_bf16(xm[32 * b + i]);
                amax = fmaxf(amax, fabsf(f[i]));
                nan |= f[i] != f[i];
            }
            /* a NaN or infinite input makes the block's scale NaN, so the output is NaN too */
            float inv = amax > 0.f && amax < INFINITY ? 32767.f / amax : 0.f, sx = nan ? NAN : amax / 32767.f;
            int16_t *out = xs + (int64_t)m * K + 32 * b;
            int isum = 0;
            for (int i = 0; i < 32; i++) {
                long r = lrintf(f[i] * inv);
                int16_t v = (int16_t)(r > 32767 ? 32767 : r < -32767 ? -32767 : r);
                out[i % 2 ? 16 + i / 2 : i / 2] = v;
                isum += v;
            }
            xsc[(int64_t)m * B + b] = sx;
            xsum[(int64_t)m * G + 32 * b / group] += sx * (float)isum;
        }
    }
}

static inline uintptr_t q4_align(uintptr_t p) { return (p + 63) & ~(uintptr_t)63; }

/* Bytes of scratch linear_q4_bf16 needs for M rows of K */
int64_t q4_scratch_bytes(int M, int K, int group) {
    return (int64_t)M * K * 2 + (int64_t)M * (K / 32) * 4 + (int64_t)M * (K / group) * 4 + 192;
}

/* as the AVX-512 build's, K % 64 == 0 */
void linear_q4_bf16(const uint16_t *x, int64_t ldx, const uint8_t *q, const uint16_t *scale,
                    const uint16_t *zero, int group, const uint16_t *bias, uint16_t *y, int64_t ldy,
                    int M, int N, int K, void *scratch, int threads) {
    int16_t *xs = (int16_t *)q4_align((uintptr_t)scratch);
    float *xsc = (float *)q4_align((uintptr_t)(xs + (int64_t)M * K));
    float *xsum = (float *)q4_align((uintptr_t)(xsc + (int64_t)M * (K / 32)));
    q4_split(x, ldx, M, K, group, xs, xsc, xsum);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++)
        for (int m0 = 0; m0 < M; m0 += Q4_MB) {
            int mb = M - m0 < Q4_MB ? M - m0 : Q4_MB;
            if (mb == Q4_MB) q4_rows(xs, xsc, K, xsum, q, scale, zero, bias, y, ldy, m0, Q4_MB, n, group);
            else if (mb == 1) q4_rows(xs, xsc, K, xsum, q, scale, zero, bias, y, ldy, m0, 1, n, group);
            else q4_rows(xs, xsc, K, xsum, q, scale, zero, bias, y, ldy, m0, mb, n, group);
        }
}

/* as the AVX-512 build's: (q - 8) * scale + zero in float32, one FMA, rounded once */
void dequant_q4_bf16(const uint8_t *q, const uint16_t *scale, const uint16_t *zero, int group, uint16_t *w,
                     int N, int K, int threads) {
    const int G = K / group;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const uint8_t *qr = q + (int64_t)n * (K / 2);
        uint16_t *wr = w + (int64_t)n * K;
        for (int k = 0; k < K; k += 2) {
            float s = from_bf16(scale[(int64_t)n * G + k / group]), z = from_bf16(zero[(int64_t)n * G + k / group]);
            wr[k] = to_bf16(fmaf((float)(qr[k / 2] & 15) - 8.f, s, z));
            wr[k + 1] = to_bf16(fmaf((float)(qr[k / 2] >> 4) - 8.f, s, z));
        }
    }
}
#endif

/* w [N, K] float32: (q - 8) * scale + zero, one FMA, not rounded: a prefill's weights where
 * its products run in float32 (engine/kernels/gemm.py) */
void dequant_q4_f32(const uint8_t *q, const uint16_t *scale, const uint16_t *zero, int group, float *w, int N,
                    int K, int threads) {
    const int G = K / group;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const uint8_t *qr = q + (int64_t)n * (K / 2);
        float *wr = w + (int64_t)n * K;
        for (int g = 0; g < G; g++) {
            float s = from_bf16(scale[(int64_t)n * G + g]), z = from_bf16(zero[(int64_t)n * G + g]);
            for (int k = g * group; k < (g + 1) * group; k += 2) {
                wr[k] = fmaf((float)(qr[k / 2] & 15) - 8.f, s, z);
                wr[k + 1] = fmaf((float)(qr[k / 2] >> 4) - 8.f, s, z);
            }
        }
    }
}
