/* y = x @ w.T (+ bias) for a few rows of x, in bfloat16 or float32, on AVX-512 (bf16 with
 * AVX512-BF16's dot product) or AVX2 with FMA (bf16 widened to float32): the matrix products of a decode step and of a speculative verify pass
 * (engine/kernels/row_kernel.py says when they run and why).
 *
 * Two properties, both by construction:
 * - Every output element is one dot product over K, accumulated in float32 by the same
 *   sequence of instructions and reduced in the same fixed order, whatever the number of
 *   rows M, the row tile it falls in, or the number of threads (a thread owns whole output
 *   columns). So a one-token step's row is bit for bit a verify pass's row, which greedy
 *   speculative decoding needs (engine/models/rows.py).
 * - Each weight is read once per call: a block of columns is applied to every row of x
 *   while it is in cache, so a pass of 17 rows reads the weights as a step of 1 does.
 *
 * Two loop orders compute those same elements. Up to STREAM_ROWS rows of x, each weight
 * row is read once, start to end, and applied to every x row: one sequential stream per
 * thread, which the hardware prefetcher follows at nearly the memory's read rate (a
 * Qwen3-1.7B-shaped layer at 40.5 GB/s on the development EPYC, where a `sum` read ~43, and
 * 1.50x torch's one-row product, interleaved). On Intel the stream is also fetched
 * PREFETCH_BYTES ahead in software (row_kernel.py builds it without elsewhere): on a 2-core
 * Intel Xeon VM with AMX the hardware prefetcher alone read the demo model's one-token
 * products at 12.4-14.4 GB/s, with the prefetch at 17.2-17.9 (a `sum` of the same weights:
 * 14.5-16.4), interleaved in one run. More rows are compute-bound: blocks of NB weight rows
 * times MB x rows, each x vector loaded once for NB columns.
 *
 * bf16 output is rounded to nearest even, as torch rounds.
 *
 * An AVX2 build has 16 vector registers, not 32: its tiles are 2 x 2, and each accumulator
 * is two vectors (two FMA chains in flight per output, where AVX-512 has one of twice the
 * width). */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"

#if LC_AVX512
#define NB 4      /* output columns per block: 4 weight streams in flight */
#define MB 6      /* rows per tile: MB*NB accumulators + NB weights + 1 input fit 32 registers */
#else
#define NB 2      /* 2 x 2 tiles of two-vector accumulators, 2 two-vector weights, 1 input: 14 of 16 */
#define MB 2
#endif
/* Prefetch distance, 4 KB ahead. The four weight rows of a block are four streams, each
 * crossing a 4 KB page where the hardware prefetcher stops; fetching ahead across pages
 * took a bf16 layer's products from 0.93-1.0x torch's to 1.17-1.26x (development EPYC,
 * interleaved in one run). */
#define PREFETCH_BYTES 4096
#ifndef STREAM_PREFETCH
#define STREAM_PREFETCH PREFETCH_BYTES
#endif
#define STREAM_ROWS 2     /* more rows in this order were 2x slower than the tiles, measured */

/* One kernel per element type T: LANES inputs per step, LOAD(ptr, n) the vector of the next
 * min(n, LANES) of them (the rest 0), DOT(acc, x, w) the multiply-accumulate into an ACC,
 * ACC_ZERO/ACC_SUM its start and its sum, STORE/BIAS the conversions at the end. */
#define ROW_KERNEL(NAME, T, VEC, ACC, LANES, LOAD, DOT, ACC_ZERO, ACC_SUM, BIAS, STORE)            \
static inline __attribute__((always_inline)) void NAME##_tile(                                      \
        const T *x, int64_t ldx, const T *w, int64_t ldw, const T *bias, T *y, int64_t ldy,         \
        int m0, int mb, int n0, int nb, int K) {                                                    \
    ACC acc[MB][NB];                                                                                \
    for (int m = 0; m < MB; m++)                                                                    \
        for (int j = 0; j < NB; j++) acc[m][j] = ACC_ZERO();                                        \
    for (int k = 0; k < K; k += LANES) {                                                            \
        VEC wv[NB];                                                                                 \
        for (int j = 0; j < NB; j++)                                                                \
            if (j < nb)                                                                             \
                _mm_prefetch((const char *)(w + (int64_t)(n0 + j) * ldw + k) + PREFETCH_BYTES,      \
                             _MM_HINT_T0);                                                          \
        for (int j = 0; j < NB; j++)                                                                \
            if (j < nb) wv[j] = LOAD(w + (int64_t)(n0 + j) * ldw + k, K - k);                        \
        for (int m = 0; m < MB; m++) {                                                              \
            if (m >= mb) break;                                                                     \
            VEC xv = LOAD(x + (int64_t)(m0 + m) * ldx + k, K - k);                                   \
            for (int j = 0; j < NB; j++)                                                            \
                if (j < nb) acc[m][j] = DOT(acc[m][j], xv, wv[j]);                                  \
        }                                                                                           \
    }                                                                                               \
    for (int m = 0; m < mb; m++)                                                                    \
        for (int j = 0; j < nb; j++) {                                                              \
            float s = ACC_SUM(acc[m][j]);                                                           \
            if (bias) s += BIAS(bias[n0 + j]);                                                      \
            y[(int64_t)(m0 + m) * ldy + n0 + j] = STORE(s);                                         \
        }                                                                                           \
}                                                                                                   \
                                                                                                    \
static void NAME##_block(const T *x, int64_t ldx, const T *w, int64_t ldw, const T *bias, T *y,     \
                         int64_t ldy, int M, int n0, int nb, int K) {                               \
    for (int m0 = 0; m0 < M; m0 += MB) {                                                            \
        int mb = M - m0 < MB ? M - m0 : MB;                                                         \
        if (nb == NB) {                                                                             \
            /* constant tile sizes: the compiler keeps the accumulators in registers */             \
            TILES(NAME, mb)                                                                         \
        } else {                                                                                    \
            /* the column tail: the same per-element arithmetic, one element at a time */           \
            for (int j = 0; j < nb; j++)                                                            \
                for (int m = 0; m < mb; m++)                                                        \
                    NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0 + m, 1, n0 + j, 1, K);             \
        }                                                                                           \
    }                                                                                               \
}                                                                                                   \
                                                                                                    \
/* weight row n applied to rows [0, mb) of x, the row read once from start to end; each        \
 * element's instructions are the tile's (same loads, same order, same reduction) */             \
static inline __attribute__((always_inline)) void NAME##_stream(                                    \
        const T *x, int64_t ldx, const T *w, int64_t ldw, const T *bias, T *y, int64_t ldy,         \
        int mb, int n, int K) {                                                                     \
    ACC acc[STREAM_ROWS];                                                                           \
    for (int m = 0; m < STREAM_ROWS; m++) acc[m] = ACC_ZERO();                                      \
    const T *wr = w + (int64_t)n * ldw;                                                             \
    for (int k = 0; k < K; k += LANES) {                                                            \
        if (STREAM_PREFETCH) _mm_prefetch((const char *)(wr + k) + STREAM_PREFETCH, _MM_HINT_T0);   \
        VEC wv = LOAD(wr + k, K - k);                                                               \
        for (int m = 0; m < STREAM_ROWS; m++) {                                                     \
            if (m >= mb) break;                                                                     \
            acc[m] = DOT(acc[m], LOAD(x + (int64_t)m * ldx + k, K - k), wv);                         \
        }                                                                                           \
    }                                                                                               \
    for (int m = 0; m < mb; m++) {                                                                  \
        float s = ACC_SUM(acc[m]);                                                                  \
        if (bias) s += BIAS(bias[n]);                                                               \
        y[(int64_t)m * ldy + n] = STORE(s);                                                         \
    }                                                                                               \
}                                                                                                   \
                                                                                                    \
/* x: [M, K] (row stride ldx), w: [N, K] (row stride ldw), bias: [N] or NULL, y: [M, N] (row       \
 * stride ldy) */                                                                                   \
void NAME(const T *x, int64_t ldx, const T *w, int64_t ldw, const T *bias, T *y, int64_t ldy,       \
          int M, int N, int K, int threads) {                                                       \
    if (M <= STREAM_ROWS) {                                                                         \
        /* static schedule: each thread one contiguous run of weight rows */                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                           \
        for (int n = 0; n < N; n++) {                                                               \
            if (M == 1) NAME##_stream(x, ldx, w, ldw, bias, y, ldy, 1, n, K);                       \
            else NAME##_stream(x, ldx, w, ldw, bias, y, ldy, STREAM_ROWS, n, K);                    \
        }                                                                                           \
        return;                                                                                     \
    }                                                                                               \
    int blocks = (N + NB - 1) / NB;                                                                 \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                               \
    for (int b = 0; b < blocks; b++) {                                                              \
        int n0 = b * NB;                                                                            \
        NAME##_block(x, ldx, w, ldw, bias, y, ldy, M, n0, N - n0 < NB ? N - n0 : NB, K);            \
    }                                                                                               \
}

/* constant tile sizes: the compiler keeps the accumulators in registers */
#if MB == 6
#define TILES(NAME, mb)                                                                             \
    switch (mb) {                                                                                   \
    case 1: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, 1, n0, NB, K); break;                     \
    case 2: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, 2, n0, NB, K); break;                     \
    case 3: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, 3, n0, NB, K); break;                     \
    case 4: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, 4, n0, NB, K); break;                     \
    case 5: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, 5, n0, NB, K); break;                     \
    default: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, MB, n0, NB, K); break;                   \
    }
#else
#define TILES(NAME, mb)                                                                             \
    if (mb == 1) NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, 1, n0, NB, K);                       \
    else NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, MB, n0, NB, K);
#endif

#define SAME(v) (v)

#if LC_AVX512
static inline __m512bh bf16_load(const uint16_t *p, int n) {
    return (__m512bh)_mm512_maskz_loadu_epi16(n >= 32 ? 0xffffffffu : 0xffffffffu >> (32 - n), p);
}
#define F32_DOT(acc, x, w) _mm512_fmadd_ps(x, w, acc)

/* built twice (engine/kernels/row_kernel.py): with -mavx512bf16 for the bf16 kernel, and
 * without for CPUs that have AVX-512 but not its bf16 instructions */
#ifdef __AVX512BF16__
ROW_KERNEL(linear_bf16, uint16_t, __m512bh, __m512, 32, bf16_load, _mm512_dpbf16_ps, _mm512_setzero_ps,
           _mm512_reduce_add_ps, from_bf16, to_bf16)
#endif
ROW_KERNEL(linear_f32, float, __m512, __m512, 16, vf_load_n, F32_DOT, _mm512_setzero_ps, _mm512_reduce_add_ps,
           SAME, SAME)

#else
/* sixteen inputs as two float vectors: for float32 the first and last eight; for bfloat16
 * the even and odd ones of a 32-byte load (widening by a shift and a mask: a dot product
 * may take its terms in any order as long as x and w are split alike) */
typedef struct { __m256 a, b; } pair;

static inline pair pair_zero(void) { return (pair){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline pair pair_dot(pair acc, pair x, pair w) {
    return (pair){_mm256_fmadd_ps(x.a, w.a, acc.a), _mm256_fmadd_ps(x.b, w.b, acc.b)};
}
static inline float pair_sum(pair acc) { return vf_sum(_mm256_add_ps(acc.a, acc.b)); }
static inline pair f32_load(const float *p, int n) { return (pair){vf_load_n(p, n), vf_load_n(p + 8, n - 8)}; }
static inline pair bf16_load(const uint16_t *p, int n) {
    __m256i v;
    if (n >= 16) {
        v = _mm256_loadu_si256((const __m256i *)p);
    } else {
        uint16_t tail[16] = {0};
        memcpy(tail, p, (size_t)n * 2);
        v = _mm256_loadu_si256((const __m256i *)tail);
    }
    return (pair){_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
                  _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)))};
}

ROW_KERNEL(linear_bf16, uint16_t, pair, pair, 16, bf16_load, pair_dot, pair_zero, pair_sum, from_bf16, to_bf16)
ROW_KERNEL(linear_f32, float, pair, pair, 16, f32_load, pair_dot, pair_zero, pair_sum, SAME, SAME)
#endif
