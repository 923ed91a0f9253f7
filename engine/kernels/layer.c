/* A whole Llama-family decoder layer for a one-token step or a verify pass, in one call:
 * RMSNorm, q/k/v, per-head q/k norms (Qwen3), rotary, the keys and values written into the
 * position-indexed cache, attention, o, the residual, RMSNorm, gate/up, SiLU, down, the
 * residual (layer_body.h, compiled once per element type); and a mixture-of-experts block's
 * routed experts (moe_body.h), whose products are the same.
 *
 * Why: at the demo model's size a one-token step is some 25 small torch operations a layer,
 * and their dispatch, not the arithmetic, decided its speed (engine/models/llama_family.py
 * says when this runs). The products are rows.c's and, for int8 and int4 weights, q8.c's and
 * q4.c's, included here.
 *
 * The property greedy speculation needs holds by construction here too: every row of a pass
 * is computed as a lone row is. Norms, rotary and the cache writes are per row; attention is
 * one (row, head) per thread job, over that row's own causal prefix, in a fixed order; the
 * products are rows.c's, whose elements do not depend on the row count or thread count. */
#include <math.h>
#include <omp.h>

#include "rows.c"
#include "q8.c"
#ifdef __AVX512BF16__
#include "q4.c"
#endif

/* A weight matrix [N, K]: dense in the layer's dtype (group 0), per-channel int8 (group -1,
 * q8.c: codes and a scale per row in the layer's dtype), or group-wise int4 in its canonical
 * form (group > 0, q4.c; bf16 layers only) */
typedef struct {
    const void *w, *scale, *zero;
    int64_t group;
} Mat;

typedef struct {
    const void *ln1, *qkv_bias, *o_bias, *ln2, *q_norm, *k_norm;
    Mat qkv, o, gate_up, down;
    void *k_cache, *v_cache;          /* [kv_heads, capacity, head_dim] each */
} LayerWeights;

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter;
    int64_t capacity;
    float eps, scale;
} LayerShape;

/* e^x for x <= 0 (below -87 it is 0 to float precision), sixteen at a time: 2^n * p(r) */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* s[j] = e^(s[j] - mx) for j < n; returns their sum (one fixed order for a given n) */
static float exp_shifted(float *s, int n, float mx) {
    __m512 acc = _mm512_setzero_ps(), m = _mm512_set1_ps(mx);
    for (int j = 0; j < n; j += 16) {
        __mmask16 k = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)(0xffffu >> (16 - (n - j)));
        __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), m));
        _mm512_mask_storeu_ps(s + j, k, e);
        acc = _mm512_mask_add_ps(acc, k, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}

/* out = g / (1 + e^-g), sixteen values; large positive g gives e^-g = 0 and out = g */
static inline void silu16(const float *g, float *out) {
    __m512 x = _mm512_loadu_ps(g);
    __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), x);
    /* e^-g for g < 0 is e^|g|: computed as 1 / e^g so exp512 only sees x <= 0 */
    __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    __m512 e = exp512(_mm512_mask_blend_ps(pos, x, neg));        /* e^-|g| */
    __m512 one = _mm512_set1_ps(1.f);
    /* g >= 0: g / (1 + e^-g); g < 0: g * e^g / (1 + e^g) */
    __m512 num = _mm512_mask_blend_ps(pos, _mm512_mul_ps(x, e), x);
    _mm512_storeu_ps(out, _mm512_div_ps(num, _mm512_add_ps(one, e)));
}

#define ELEM float
#define FN(name) name##_f32
#define LD(v) (v)
#define ST(f) (f)
#define LINEAR linear_f32
#define LINEAR_Q8 linear_q8_f32
#define LINEAR_Q4(...) ((void)0)      /* no int4 weights in a float32 layer (layer_kernel.py) */
#include "layer_body.h"
#include "moe_body.h"
#undef ELEM
#undef FN
#undef LD
#undef ST
#undef LINEAR
#undef LINEAR_Q8
#undef LINEAR_Q4

#ifdef __AVX512BF16__
#define ELEM uint16_t
#define FN(name) name##_bf16
#define LD(v) from_bf16(v)
#define ST(f) to_bf16(f)
#define LINEAR linear_bf16
#define LINEAR_Q8 linear_q8_bf16
#define LINEAR_Q4 linear_q4_bf16
#include "layer_body.h"
#include "moe_body.h"
#endif
