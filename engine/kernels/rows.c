/* y = x @ w.T (+ bias) for a few rows of x, in bfloat16 (AVX512-BF16) or float32
 * (AVX-512F): the matrix products of a decode step and of a speculative verify pass
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
 * 1.50x torch's one-row product, interleaved). The stream is also fetched PREFETCH_BYTES
 * ahead in software: on a 2-core Intel Xeon VM with AMX the hardware prefetcher alone read the
 * demo model's one-token products at 12.4-14.4 GB/s, with the prefetch at 17.2-17.9
 * (a `sum` of the same weights: 14.5-16.4), interleaved in one run. More rows are compute-bound: blocks of NB weight rows times MB x rows, each x vector loaded
 * once for NB columns.
 *
 * bf16 output is rounded to nearest even, as torch rounds. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define NB 4      /* output columns per block: 4 weight streams in flight */
#define MB 6      /* rows per tile: MB*NB accumulators + NB weights + 1 input fit 32 registers */
/* Prefetch distance, 4 KB ahead. The four weight rows of a block are four streams, each
 * crossing a 4 KB page where the hardware prefetcher stops; fetching ahead across pages
 * took a bf16 layer's products from 0.93-1.0x torch's to 1.17-1.26x (development EPYC,
 * interleaved in one run). */
#define PREFETCH_BYTES 4096
#define STREAM_ROWS 2     /* more rows in this order were 2x slower than the tiles, measured */

/* One kernel per element type T: LANES inputs per step, LOAD(ptr, mask) a masked vector,
 * DOT(acc, x, w) the multiply-accumulate, STORE/BIAS the conversions at the end. */
#define ROW_KERNEL(NAME, T, VEC, LANES, MASK_T, FULL, LOAD, DOT, BIAS, STORE)                       \
static inline __attribute__((always_inline)) void NAME##_tile(                                      \
        const T *x, int64_t ldx, const T *w, int64_t ldw, const T *bias, T *y, int64_t ldy,         \
        int m0, int mb, int n0, int nb, int K) {                                                    \
    __m512 acc[MB][NB];                                                                             \
    for (int m = 0; m < MB; m++)                                                                    \
        for (int j = 0; j < NB; j++) acc[m][j] = _mm512_setzero_ps();                               \
    for (int k = 0; k < K; k += LANES) {                                                            \
        MASK_T mask = K - k >= LANES ? FULL : (MASK_T)(FULL >> (LANES - (K - k)));                  \
        VEC wv[NB];                                                                                 \
        for (int j = 0; j < NB; j++)                                                                \
            if (j < nb)                                                                             \
                _mm_prefetch((const char *)(w + (int64_t)(n0 + j) * ldw + k) + PREFETCH_BYTES,      \
                             _MM_HINT_T0);                                                          \
        for (int j = 0; j < NB; j++)                                                                \
            if (j < nb) wv[j] = LOAD(mask, w + (int64_t)(n0 + j) * ldw + k);                        \
        for (int m = 0; m < MB; m++) {                                                              \
            if (m >= mb) break;                                                                     \
            VEC xv = LOAD(mask, x + (int64_t)(m0 + m) * ldx + k);                                   \
            for (int j = 0; j < NB; j++)                                                            \
                if (j < nb) acc[m][j] = DOT(acc[m][j], xv, wv[j]);                                  \
        }                                                                                           \
    }                                                                                               \
    for (int m = 0; m < mb; m++)                                                                    \
        for (int j = 0; j < nb; j++) {                                                              \
            float s = _mm512_reduce_add_ps(acc[m][j]);                                              \
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
            switch (mb) {                                                                           \
            case 1: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, 1, n0, NB, K); break;             \
            case 2: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, 2, n0, NB, K); break;             \
            case 3: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, 3, n0, NB, K); break;             \
            case 4: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, 4, n0, NB, K); break;             \
            case 5: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, 5, n0, NB, K); break;             \
            default: NAME##_tile(x, ldx, w, ldw, bias, y, ldy, m0, MB, n0, NB, K); break;           \
            }                                                                                       \
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
    __m512 acc[STREAM_ROWS];                                                                        \
    for (int m = 0; m < STREAM_ROWS; m++) acc[m] = _mm512_setzero_ps();                             \
    const T *wr = w + (int64_t)n * ldw;                                                             \
    for (int k = 0; k < K; k += LANES) {                                                            \
        MASK_T mask = K - k >= LANES ? FULL : (MASK_T)(FULL >> (LANES - (K - k)));                  \
        _mm_prefetch((const char *)(wr + k) + PREFETCH_BYTES, _MM_HINT_T0);                         \
        VEC wv = LOAD(mask, wr + k);                                                                \
        for (int m = 0; m < STREAM_ROWS; m++) {                                                     \
            if (m >= mb) break;                                                                     \
            acc[m] = DOT(acc[m], LOAD(mask, x + (int64_t)m * ldx + k), wv);                         \
        }                                                                                           \
    }                                                                                               \
    for (int m = 0; m < mb; m++) {                                                                  \
        float s = _mm512_reduce_add_ps(acc[m]);                                                     \
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

#define BF16_LOAD(mask, p) ((__m512bh)_mm512_maskz_loadu_epi16(mask, p))
#define F32_LOAD(mask, p) _mm512_maskz_loadu_ps(mask, p)
#define F32_DOT(acc, x, w) _mm512_fmadd_ps(x, w, acc)
#define SAME(v) (v)

/* built twice (engine/kernels/row_kernel.py): with -mavx512bf16 for the bf16 kernel, and
 * without for CPUs that have AVX-512 but not its bf16 instructions */
#ifdef __AVX512BF16__
ROW_KERNEL(linear_bf16, uint16_t, __m512bh, 32, __mmask32, 0xffffffffu, BF16_LOAD, _mm512_dpbf16_ps,
           from_bf16, to_bf16)
#endif
ROW_KERNEL(linear_f32, float, __m512, 16, __mmask16, (__mmask16)0xffffu, F32_LOAD, F32_DOT, SAME, SAME)
