/* A whole Llama-family decoder layer for a one-token step or a verify pass, in one call:
 * RMSNorm, q/k/v, per-head q/k norms (Qwen3), rotary, the keys and values written into the
 * position-indexed cache, attention, o, the residual, RMSNorm, gate/up, SiLU, down, the
 * residual (layer_body.h, compiled once per element type); and a mixture-of-experts block's
 * routed experts (moe_body.h), whose products are the same; and Qwen3.5's hybrid layers
 * (hybrid_body.h).
 *
 * Why: at the demo model's size a one-token step is some 25 small torch operations a layer,
 * and their dispatch, not the arithmetic, decided its speed (engine/models/llama_family.py
 * says when this runs). The products are rows.c's and, for int8 and int4 weights, q8.c's and
 * q4.c's, and for a GGUF file's blocks gguf.c's, included here.
 *
 * The property greedy speculation needs holds by construction here too: every row of a pass
 * is computed as a lone row is. Norms, rotary and the cache writes are per row; attention is
 * one (row, head) per thread job, over that row's own causal prefix, in a fixed order; the
 * products are rows.c's, whose elements do not depend on the row count or thread count. */
#include <math.h>
#include <omp.h>

#include "rows.c"
#include "q8.c"
#if LC_BF16
#include "q4.c"
#endif
#include "gguf.c"

/* A weight matrix [N, K]: dense in the layer's dtype (group 0), per-channel int8 (group -1,
 * q8.c: codes and a scale per row in the layer's dtype), or group-wise int4 in its canonical
 * form (group > 0, q4.c; bf16 layers only), or a GGUF file's blocks (group GG_MAT: w is a
 * GGMat; float32 layers only) */
typedef struct {
    const void *w, *scale, *zero;
    int64_t group;
} Mat;

#define GG_MAT (-2)
#define GG_PARTS 8

/* A matrix of GGUF blocks: its rows in parts of one block format each, stacked (a fused q/k/v
 * whose v is another format); each part `rows` rows of `row_bytes` bytes at w (gguf.c) */
typedef struct {
    int64_t type, rows, row_bytes;
    const uint8_t *w;
} GGPart;

typedef struct {
    int64_t count;
    GGPart part[GG_PARTS];
} GGMat;

/* y = x @ m.T (+ bias) for M float32 rows: each part's columns by gguf.c's product */
static void linear_gg(const float *x, int64_t ldx, const GGMat *g, const float *bias, float *y, int64_t ldy,
                      int M, int N, int K, int threads) {
    int64_t col = 0;
    for (int i = 0; i < g->count; i++) {
        const GGPart *p = &g->part[i];
        gguf_linear_f32((int)p->type, x, ldx, p->w, p->row_bytes, y + col, ldy, M, (int)p->rows, K, threads);
        col += p->rows;
    }
    if (bias)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) y[(int64_t)m * ldy + n] += bias[n];
}

typedef struct {
    const void *ln1, *qkv_bias, *o_bias, *ln2, *q_norm, *k_norm;
    Mat qkv, o, gate_up, down;
    void *k_cache, *v_cache;          /* [kv_heads, capacity, head_dim] each */
} LayerWeights;

/* A Qwen3.5 decoder layer (hybrid_body.h): a gated attention layer's q (each head's query
 * then its gate), k, v, o and norms, or a gated delta-net layer's projections; the dense
 * MLP (gate.w NULL where the caller runs the layer's MLP, a mixture of experts) */
typedef struct {
    const void *ln1, *ln2, *q_norm, *k_norm, *norm, *dt_bias;
    const float *a_neg;               /* -exp(A_log), float32 */
    Mat q, k, v, o, qkv, z, b, a, out, gate, up, down;
    Mat qkvz, ba;                     /* Qwen3-Next's in-projections, grouped by key head (qkv.w NULL) */
    Mat se_gate, se_up, se_down, se_score;   /* a sparse block's shared expert and its gate [1, hidden] */
    void *k_cache, *v_cache;          /* [kv_heads, capacity, head_dim] each */
    int in_tiled, out_tiled;          /* qkv's value rows and z's, and out's input columns, in a GGUF
                                         file's order: value heads tiled, head i of every key head,
                                         then i + 1 (not grouped by key head) */
} HybridWeights;

typedef struct {
    int hidden, inter, shared_inter, heads, kv_heads, head_dim, rot, Hk, Hv, Dk, Dv;
    int64_t capacity;
    float eps, scale;
} HybridShape;

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter;
    int64_t capacity;
    float eps, scale;
} LayerShape;

/* s[j] = e^(s[j] - mx) for j < n; returns their sum (one fixed order for a given n) */
static float exp_shifted(float *s, int n, float mx) {
    vf acc = vf_zero(), m = vf_set1(mx);
    for (int j = 0; j < n; j += VL) {
        vf e = vf_exp_neg(vf_sub(vf_load_n(s + j, n - j), m));
        vf_store_n(s + j, e, n - j);
        if (n - j < VL) e = vf_load_n(s + j, n - j);     /* the lanes past n count 0 */
        acc = vf_add(acc, e);
    }
    return vf_sum(acc);
}

/* out = g / (1 + e^-g), sixteen values; large positive g gives e^-g = 0 and out = g */
static inline void silu16(const float *g, float *out) {
    for (int i = 0; i < 16; i += VL) {
        vf x = vf_load(g + i);
        vf neg = vf_sub(vf_zero(), x);
        /* e^-g for g < 0 is e^|g|: computed as 1 / e^g so the exponential only sees x <= 0 */
        vf e = vf_exp_neg(vf_select_nonneg(x, neg, x));          /* e^-|g| */
        /* g >= 0: g / (1 + e^-g); g < 0: g * e^g / (1 + e^g) */
        vf num = vf_select_nonneg(x, x, vf_mul(x, e));
        vf_store(out + i, vf_div(num, vf_add(vf_set1(1.f), e)));
    }
}

#define ELEM float
#define FN(name) name##_f32
#define LD(v) (v)
#define ST(f) (f)
#define LINEAR linear_f32
#define LINEAR_Q8 linear_q8_f32
#define LINEAR_Q4(...) ((void)0)      /* no int4 weights in a float32 layer (layer_kernel.py) */
#define LINEAR_GG linear_gg
#include "layer_body.h"
#include "moe_body.h"
#include "hybrid_body.h"
#undef ELEM
#undef FN
#undef LD
#undef ST
#undef LINEAR
#undef LINEAR_Q8
#undef LINEAR_Q4
#undef LINEAR_GG

#if LC_BF16
#define ELEM uint16_t
#define FN(name) name##_bf16
#define LD(v) from_bf16(v)
#define ST(f) to_bf16(f)
#define LINEAR linear_bf16
#define LINEAR_Q8 linear_q8_bf16
#define LINEAR_Q4 linear_q4_bf16
#define LINEAR_GG(...) ((void)0)      /* GGUF blocks run with float32 activations (layer_kernel.py) */
#include "layer_body.h"
#include "moe_body.h"
#include "hybrid_body.h"
#endif

/* The index of the largest of n floats, the first of equals; a NaN is larger than any number
 * (the first NaN's index), as torch.argmax. A greedy step's next token, without the torch
 * operation's cold start after a pass (layer_body.h's tail says why that matters). */
int64_t argmax_f32(const float *x, int64_t n) {
    int64_t i = 0, full = n - n % VL;
    vf best = vf_set1(-INFINITY);
    int nan = 0;
    for (; i < full; i += VL) {
        vf v = vf_load(x + i);
        nan |= vf_any_nan(v);
        best = vf_max(best, v);
    }
    if (nan)
        for (int64_t j = 0; j < n; j++)
            if (x[j] != x[j]) return j;
    float lanes[VL], m = -INFINITY;
    vf_store(lanes, best);
    for (int k = 0; k < VL; k++) m = lanes[k] > m ? lanes[k] : m;
    for (int64_t j = full; j < n; j++) {
        if (x[j] != x[j]) return j;
        m = x[j] > m ? x[j] : m;
    }
    for (int64_t j = 0; j < full; j += VL) {
        unsigned bits = vf_eq_bits(vf_load(x + j), m);
        if (bits) return j + __builtin_ctz(bits);
    }
    for (int64_t j = full; j < n; j++)
        if (x[j] == m) return j;
    return 0;      /* n == 0 */
}
