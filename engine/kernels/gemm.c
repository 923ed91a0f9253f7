/* y = x @ w.T (+ bias) in float32 for many rows of x: a prefill's products (a chunk of a
 * prompt), where rows.c's kernel, built for a few rows and lone-row exactness, is
 * compute-bound at half the machine's rate (engine/kernels/gemm.py says when this runs).
 *
 * The outer-product form: a tile of MR rows by NR output columns keeps MR*NR sums in
 * registers; each step over K loads MV vectors of the tile's rows at k (x packed
 * transposed, rows contiguous) and broadcasts the NR weights w[n][k], one FMA per vector
 * and weight. No horizontal sums, and the weight is read where it lies ([N, K], as nn.Linear
 * holds it): nothing of it is copied or reordered. A thread owns whole column blocks, so
 * the weight rows of a block are read from memory once for all the rows packed at once
 * (TILES tiles) and stay in cache across their tiles.
 *
 * Each output is one FMA chain over K in order, from zero: a row's result depends neither on
 * the rows beside it nor on the thread count, but it is not rows.c's (a prefill's rows need
 * not be). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if LC_AVX512
#define MV 3      /* vectors of rows per tile: 48 rows */
#define NR 8      /* columns per tile: 24 sums + 3 row vectors + 1 weight of 32 registers */
#else
#define MV 2      /* 16 rows */
#define NR 6      /* 12 sums + 2 row vectors + 1 weight of 16 registers */
#endif
#define MR (MV * VL)
#define TILES 8   /* tiles of rows packed at once: every column block's weights are read once for them */
#define KC 256    /* steps over K at a time: the weight rows' share (8 KB) stays in L1 across the tiles */

/* The sums of one tile over steps [k0, k1): xt is the tile's rows packed [K][MR], wr its NR
 * weight rows; the sums [NR][MR] start at 0 (k0 == 0) or at out, and end in out. mv (<= MV)
 * vectors of rows are live. The next block's weight rows (wn) are fetched meanwhile, a cache
 * line of each every 16 steps: rows of a few KB are too short for the hardware prefetcher to
 * learn them first (the demo's 576-wide rows ran at half the rate without). */
static inline __attribute__((always_inline)) void tile(const float *xt, const float *const *wr,
                                                       const float *const *wn, int k0, int k1, int mv,
                                                       float *out) {
    vf acc[MV][NR];
    for (int v = 0; v < MV; v++)
        for (int j = 0; j < NR; j++) acc[v][j] = k0 == 0 || v >= mv ? vf_zero() : vf_load(out + j * MR + v * VL);
    for (int kb = k0; kb < k1; kb += 16) {
        for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(wn[j] + kb), _MM_HINT_T0);
        int ke = k1 - kb < 16 ? k1 : kb + 16;
#pragma GCC unroll 4
        for (int k = kb; k < ke; k++) {
            vf xv[MV];
            for (int v = 0; v < MV; v++)
                if (v < mv) xv[v] = vf_load(xt + (int64_t)k * MR + v * VL);
            for (int j = 0; j < NR; j++) {
                vf b = vf_set1(wr[j][k]);
                for (int v = 0; v < MV; v++)
                    if (v < mv) acc[v][j] = vf_fmadd(xv[v], b, acc[v][j]);
            }
        }
    }
    for (int j = 0; j < NR; j++)
        for (int v = 0; v < MV; v++)
            if (v < mv) vf_store(out + j * MR + v * VL, acc[v][j]);
}

/* constant vector counts: the compiler keeps the sums in registers */
static void tile_any(const float *xt, const float *const *wr, const float *const *wn, int k0, int k1, int mv,
                     float *out) {
#if MV == 3
    if (mv == 1) tile(xt, wr, wn, k0, k1, 1, out);
    else if (mv == 2) tile(xt, wr, wn, k0, k1, 2, out);
    else tile(xt, wr, wn, k0, k1, 3, out);
#else
    if (mv == 1) tile(xt, wr, wn, k0, k1, 1, out);
    else tile(xt, wr, wn, k0, k1, 2, out);
#endif
}

/* rows [m0, m0 + mb) of x into xt, tile by tile: [tile][K][MR], rows past M zero */
static void pack(const float *x, int64_t ldx, int m0, int mb, int K, float *xt) {
    int tiles = (mb + MR - 1) / MR;
#pragma omp for schedule(static)
    for (int t = 0; t < tiles; t++) {
        float *dst = xt + (int64_t)t * K * MR;
        int rows = mb - t * MR < MR ? mb - t * MR : MR;
        for (int k = 0; k < K; k++)
            for (int r = 0; r < MR; r++)
                dst[(int64_t)k * MR + r] = r < rows ? x[(int64_t)(m0 + t * MR + r) * ldx + k] : 0.f;
    }
}

int64_t gemm_scratch_bytes(int M, int K) {
    int64_t rows = M < TILES * MR ? M : TILES * MR;
    return (rows + MR - 1) / MR * MR * K * 4;
}

/* Where a column block's weight rows come from: w [N, K] read in place (row stride ldw), or,
 * with fill set, rows [n0, n0 + nr) written by fill(ctx, n0, nr, K, buf) into a thread's
 * buffer [NR][K] first (a GGUF file's blocks decoded a block of rows at a time, so no
 * decoded copy of the whole weight is ever made: gguf_gemm.c) */
typedef void (*gemm_fill)(const void *ctx, int n0, int nr, int K, float *buf);

/* 0, or -2 where a thread's buffer for fill could not be had */
static int gemm_core(const float *x, int64_t ldx, const float *w, int64_t ldw, gemm_fill fill, const void *ctx,
                     const float *bias, float *y, int64_t ldy, int M, int N, int K, float *scratch, int threads) {
    int blocks_n = (N + NR - 1) / NR;
    float *bufs = NULL;
    if (fill && !(bufs = aligned_alloc(64, ((size_t)threads * NR * (size_t)K * 4 + 63) / 64 * 64))) return -2;
#pragma omp parallel num_threads(threads)
    for (int m0 = 0; m0 < M; m0 += TILES * MR) {
        int mb = M - m0 < TILES * MR ? M - m0 : TILES * MR, tiles = (mb + MR - 1) / MR;
        pack(x, ldx, m0, mb, K, scratch);          /* ends with a barrier: every row packed */
        float *buf = fill ? bufs + (int64_t)omp_get_thread_num() * NR * K : NULL;
#pragma omp for schedule(static)
        for (int bn = 0; bn < blocks_n; bn++) {
            int n0 = bn * NR, nr = N - n0 < NR ? N - n0 : NR;
            const float *wr[NR], *wn[NR];
            if (fill) fill(ctx, n0, nr, K, buf);
            /* a short last block reads its first row again in place of the missing ones */
            for (int j = 0; j < NR; j++) {
                wr[j] = fill ? buf + (int64_t)(j < nr ? j : 0) * K : w + (int64_t)(n0 + (j < nr ? j : 0)) * ldw;
                wn[j] = fill ? wr[j] : w + (int64_t)(n0 + NR + j < N ? n0 + NR + j : n0) * ldw;
            }
            float out[TILES][NR * MR] __attribute__((aligned(64)));
            /* KC steps of every tile in turn: the weight rows' KC columns stay in L1 */
            for (int k0 = 0; k0 < K; k0 += KC)
                for (int t = 0; t < tiles; t++) {
                    int rows = mb - t * MR < MR ? mb - t * MR : MR;
                    tile_any(scratch + (int64_t)t * K * MR, wr, wn, k0, K - k0 < KC ? K : k0 + KC,
                             (rows + VL - 1) / VL, out[t]);
                }
            for (int t = 0; t < tiles; t++) {
                int rows = mb - t * MR < MR ? mb - t * MR : MR;
                for (int r = 0; r < rows; r++) {
                    float *yr = y + (int64_t)(m0 + t * MR + r) * ldy + n0;
                    for (int j = 0; j < nr; j++) yr[j] = out[t][j * MR + r] + (bias ? bias[n0 + j] : 0.f);
                }
            }
        }                                          /* a barrier: the block is done before repacking */
    }
    free(bufs);
    return 0;
}

/* x: [M, K] (row stride ldx), w: [N, K] (row stride ldw), bias: [N] or NULL, y: [M, N] (row
 * stride ldy); scratch: gemm_scratch_bytes(M, K), 64-byte aligned */
void gemm_f32(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *bias, float *y,
              int64_t ldy, int M, int N, int K, float *scratch, int threads) {
    gemm_core(x, ldx, w, ldw, NULL, NULL, bias, y, ldy, M, N, K, scratch, threads);
}
