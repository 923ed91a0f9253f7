/* A gated delta-net layer's per-token steps (Qwen3.5, Qwen3-Next): the causal conv over
 * its window and the gated delta rule's recurrence, for a few token rows in order.
 *
 * The arithmetic is transformers' reference torch code (`causal_conv1d_update`,
 * `torch_recurrent_gated_delta_rule`) done in one pass over the state instead of some
 * twenty torch operations, each a full sweep of a 32 x 128 x 128 float32 state. The
 * recurrence runs in float32 and the state stays float32 from token to token, as the
 * reference's does; each head is one thread's whole job and each token's step is the same
 * instructions whether it is a lone call or one of several, so T tokens in one call are
 * bit for bit T one-token calls (a verify pass's rows are one-token steps; the replay of
 * accepted updates, models/replay.py, leaves what plain decoding would). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* element i of a float32 (bf16 == 0) or bfloat16 array */
static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* v rounded to the array's type, as torch rounds a result to the tensor's dtype */
static inline float rnd(float v, int bf16) { return bf16 ? from_bf16(to_bf16(v)) : v; }

static inline void st(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = to_bf16(v);
    else ((float *)p)[i] = v;
}

/* The depthwise causal conv of T new columns: x [T, C] (row stride ldx), window [C, K] (the
 * last K inputs, oldest first; updated in place), w [C, K]; out [T, C] = SiLU(conv) when silu,
 * else the conv, each rounded to the type (the conv's float32 sum once, then the SiLU). */
__attribute__((noinline)) void gdn_conv(const void *x, int64_t ldx, void *window, const void *w, void *out,
                                        int T, int C, int K, int silu, int bf16, int threads) {
    /* a channel is one thread's whole job */
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int c = 0; c < C; c++)
        for (int t = 0; t < T; t++) {
            int64_t base = (int64_t)c * K;
            for (int i = 0; i + 1 < K; i++) st(window, base + i, ld(window, base + i + 1, bf16), bf16);
            st(window, base + K - 1, ld(x, (int64_t)t * ldx + c, bf16), bf16);
            float s = 0.f;
            for (int i = 0; i < K; i++) s += ld(w, base + i, bf16) * ld(window, base + i, bf16);
            s = rnd(s, bf16);
            if (silu) s = s / (1.f + expf(-s));
            st(out, (int64_t)t * C + c, s, bf16);
        }
}

#define MAX_DIM 256

/* T tokens of the recurrence for every value head. q, k [T, Hk, Dk] (row stride ldqk), v
 * [T, Hv, Dv] (row stride ldv), all of the type of bf16; g [T, Hv] float32 (the log decay),
 * beta [T, Hv] (type of beta_bf16); s_in, s_out [Hv, Dk, Dv] float32 (s_in is not written
 * unless s_out is s_in: each element is read before it is written, so the state may be
 * advanced in place); out [T, Hv, Dv].
 * Value head h reads key head h / (Hv / Hk). With l2 the query and key are scaled to unit
 * length (eps 1e-6 under the root); the query then by 1/sqrt(Dk). */
__attribute__((noinline)) void gdn_rule(const void *q, const void *k, const void *v, int64_t ldqk, int64_t ldv,
                                        int bf16, const float *g, const void *beta,
              int beta_bf16, const float *s_in, float *s_out, void *out, int T, int Hk, int Hv, int Dk, int Dv,
              int l2, int threads) {
    const int rep = Hv / Hk;
    const float qscale = sqrtf((float)Dk);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int h = 0; h < Hv; h++) {
        float qn[MAX_DIM], kn[MAX_DIM], mem[MAX_DIM], acc[MAX_DIM], vt[MAX_DIM];
        const int64_t hs = (int64_t)h * Dk * Dv;
        const float *src = s_in + hs;
        float *S = s_out + hs;
        for (int t = 0; t < T; t++) {
            int64_t qk = (int64_t)t * ldqk + (int64_t)(h / rep) * Dk, vo = ((int64_t)t * Hv + h) * Dv;
            int64_t vi = (int64_t)t * ldv + (int64_t)h * Dv;
            for (int d = 0; d < Dk; d++) { qn[d] = ld(q, qk + d, bf16); kn[d] = ld(k, qk + d, bf16); }
            if (l2) {
                float sq = 0.f, sk = 0.f;
                for (int d = 0; d < Dk; d++) { sq += qn[d] * qn[d]; sk += kn[d] * kn[d]; }
                float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
                for (int d = 0; d < Dk; d++) { qn[d] *= iq; kn[d] *= ik; }
            }
            for (int d = 0; d < Dk; d++) qn[d] /= qscale;
            const float decay = expf(g[(int64_t)t * Hv + h]);
            const float b = ld(beta, (int64_t)t * Hv + h, beta_bf16);
            for (int e = 0; e < Dv; e++) { mem[e] = 0.f; acc[e] = 0.f; vt[e] = ld(v, vi + e, bf16); }
            /* decay the state and read what it holds for this key: mem = S^T k */
            for (int d = 0; d < Dk; d++) {
                const float *r = (t ? S : src) + (int64_t)d * Dv;
                float *o = S + (int64_t)d * Dv;
                const float kd = kn[d];
                #pragma omp simd
                for (int e = 0; e < Dv; e++) {
                    float s = r[e] * decay;
                    o[e] = s;
                    mem[e] += s * kd;
                }
            }
            for (int e = 0; e < Dv; e++) mem[e] = (vt[e] - mem[e]) * b;      /* the delta */
            /* write the delta in along the key, and read the query's output: S^T q */
            for (int d = 0; d < Dk; d++) {
                float *o = S + (int64_t)d * Dv;
                const float kd = kn[d], qd = qn[d];
                #pragma omp simd
                for (int e = 0; e < Dv; e++) {
                    float s = o[e] + kd * mem[e];
                    o[e] = s;
                    acc[e] += s * qd;
                }
            }
            for (int e = 0; e < Dv; e++) st(out, vo + e, acc[e], bf16);
        }
        if (T == 0 && S != src) memcpy(S, src, (size_t)Dk * Dv * sizeof(float));
    }
}

/* A delta-net layer's conv and recurrence in one call, as a one-token step or a verify pass
 * runs them (kernels/hybrid_body.h computes what comes before and after): raw [T, C] the
 * projected q, k, v before the conv (C = 2 Hk Dk + Hv Dv); the conv with SiLU into conv [T, C]
 * (the window advanced in place), then the recurrence over its q, k, v parts with the
 * query and key scaled to unit length, from s_in into s_out (which may be s_in), into out
 * [T, Hv, Dv]. The same two functions the replay calls, so the bits are theirs. */
void gdn_step(const void *raw, void *window, const void *w, void *conv, const float *g, const void *beta,
              const float *s_in, float *s_out, void *out, int T, int Hk, int Hv, int Dk, int Dv, int K, int bf16,
              int threads) {
    const int C = 2 * Hk * Dk + Hv * Dv;
    const size_t es = bf16 ? 2 : 4;
    gdn_conv(raw, C, window, w, conv, T, C, K, 1, bf16, threads);
    const char *c = (const char *)conv;
    gdn_rule(c, c + (size_t)Hk * Dk * es, c + (size_t)2 * Hk * Dk * es, C, C, bf16, g, beta, bf16, s_in, s_out, out,
             T, Hk, Hv, Dk, Dv, 1, threads);
}
