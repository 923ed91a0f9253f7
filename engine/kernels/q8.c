/* y = x @ w.T (+ bias) for a few rows of x and a per-channel int8 weight
 * (engine/targets/qweights.py): w[n, k] = q[n, k] * scale[n], q int8 [N, K] row-major, one
 * scale per output row. In bfloat16 (x, scale, bias and y bf16) or float32.
 *
 *   sum_k x[k] * w[n, k] = scale[n] * sum_k x[k] * q[n, k]
 * The sum runs in float32: each code widened to float32 (exact), x widened once per call
 * into the scratch, sixteen products per FMA (eight on AVX2), then one product with the scale and one
 * rounding. The weight is read at one byte a parameter, each weight row once per Q8_MB rows
 * of x (it stays in L1 between them).
 *
 * As in rows.c, every output element is one fixed sequence of instructions owned by one
 * thread, whatever the number of rows or threads: a verify pass's rows are one-token steps
 * bit for bit. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"

#if LC_AVX512
#define Q8_MB 4             /* x rows per pass over a weight row */
#else
#define Q8_MB 2             /* AVX2: 2 rows x 4 chains of accumulators, of 16 registers */
#endif
#define Q8_CHAINS 4         /* accumulators per row: FMA chains in flight */
#define Q8_PREFETCH 2048

/* sums[m] = sum_k xf[m0 + m][k] * q[n][k] for m < mb, xf float32 [M, K]. Blocks of VL codes
 * go round Q8_CHAINS accumulators (block b into chain b % Q8_CHAINS), the last one partial;
 * the chains are added in one fixed order. */
static inline __attribute__((always_inline)) void q8_rows(const float *xf, int K, const int8_t *q, int m0,
                                                          int mb, int n, float *sums) {
    const int8_t *qr = q + (int64_t)n * K;
    const float *xr[Q8_MB];
    vf acc[Q8_MB][Q8_CHAINS];
    for (int m = 0; m < Q8_MB; m++) {
        xr[m] = xf + (int64_t)(m0 + (m < mb ? m : 0)) * K;
        for (int c = 0; c < Q8_CHAINS; c++) acc[m][c] = vf_zero();
    }
    const int full = K / (VL * Q8_CHAINS) * (VL * Q8_CHAINS);
    for (int k = 0; k < full; k += VL * Q8_CHAINS) {
        _mm_prefetch((const char *)(qr + k) + Q8_PREFETCH, _MM_HINT_T0);
        for (int c = 0; c < Q8_CHAINS; c++) {           /* constant after unrolling: acc stays in registers */
            vf w = vf_from_i8(qr + k + VL * c, VL);
            for (int m = 0; m < Q8_MB; m++) {
                if (m >= mb) break;
                acc[m][c] = vf_fmadd(vf_load(xr[m] + k + VL * c), w, acc[m][c]);
            }
        }
    }
    for (int k = full, c = 0; k < K; k += VL, c++) {    /* the tail: fewer than Q8_CHAINS blocks */
        vf w = vf_from_i8(qr + k, K - k);
        for (int m = 0; m < Q8_MB; m++) {
            if (m >= mb) break;
            acc[m][c] = vf_fmadd(vf_load_n(xr[m] + k, K - k), w, acc[m][c]);
        }
    }
    for (int m = 0; m < mb; m++)
        sums[m] = vf_sum(vf_add(vf_add(acc[m][0], acc[m][1]), vf_add(acc[m][2], acc[m][3])));
}

/* Every row of the weight against every row of xf, through q8_rows; `put(m, n, sum)`
 * writes one output */
#define Q8_DRIVE(PUT)                                                                               \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                               \
    for (int n = 0; n < N; n++) {                                                                   \
        float sums[Q8_MB];                                                                          \
        for (int m0 = 0; m0 < M; m0 += Q8_MB) {                                                     \
            int mb = M - m0 < Q8_MB ? M - m0 : Q8_MB;                                               \
            if (mb == Q8_MB) q8_rows(xf, K, q, m0, Q8_MB, n, sums);                                 \
            else if (mb == 1) q8_rows(xf, K, q, m0, 1, n, sums);                                    \
            else q8_rows(xf, K, q, m0, mb, n, sums);                                                \
            for (int m = 0; m < mb; m++) PUT(m0 + m, n, sums[m]);                                   \
        }                                                                                           \
    }

/* Bytes of scratch linear_q8_* needs for M rows of K */
int64_t q8_scratch_bytes(int M, int K) {
    return (int64_t)M * K * 4 + 64;
}

/* x: [M, K] bf16 (row stride ldx), q: [N, K] int8, scale: [N] bf16, bias: [N] or NULL,
 * y: [M, N] (row stride ldy); scratch: q8_scratch_bytes(M, K) */
void linear_q8_bf16(const uint16_t *x, int64_t ldx, const int8_t *q, const uint16_t *scale,
                    const uint16_t *bias, uint16_t *y, int64_t ldy, int M, int N, int K, void *scratch,
                    int threads) {
    float *xf = (float *)scratch;
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) xf[(int64_t)m * K + k] = from_bf16(x[(int64_t)m * ldx + k]);
#define Q8_PUT_BF16(m, n, s) \
    y[(int64_t)(m) * ldy + (n)] = to_bf16((s) * from_bf16(scale[n]) + (bias ? from_bf16(bias[n]) : 0.f))
    Q8_DRIVE(Q8_PUT_BF16)
#undef Q8_PUT_BF16
}

/* the same in float32 throughout */
void linear_q8_f32(const float *x, int64_t ldx, const int8_t *q, const float *scale, const float *bias,
                   float *y, int64_t ldy, int M, int N, int K, void *scratch, int threads) {
    float *xf = (float *)scratch;
    for (int m = 0; m < M; m++) memcpy(xf + (int64_t)m * K, x + (int64_t)m * ldx, (size_t)K * 4);
#define Q8_PUT_F32(m, n, s) y[(int64_t)(m) * ldy + (n)] = (s) * scale[n] + (bias ? bias[n] : 0.f)
    Q8_DRIVE(Q8_PUT_F32)
#undef Q8_PUT_F32
}

/* w [N, K] bf16: the definition's weights, q * scale rounded once (the product of a code
 * and a bf16 scale is exact in float32, so these are the bits torch's q.to(bf16) * scale
 * gives), in one pass over the codes: what a prefill multiplies by with torch's GEMM. */
void dequant_q8_bf16(const int8_t *q, const uint16_t *scale, uint16_t *w, int N, int K, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const int8_t *qr = q + (int64_t)n * K;
        uint16_t *wr = w + (int64_t)n * K;
        const float s = from_bf16(scale[n]);
        for (int k = 0; k < K; k++) wr[k] = to_bf16((float)qr[k] * s);
    }
}
