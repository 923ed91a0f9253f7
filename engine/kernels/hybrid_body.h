/* Qwen3.5's decoder layers for a one-token step or a verify pass: the gated attention
 * layer whole, and the gated delta-net layer's two halves around its conv and recurrence
 * (those run in gdn.c, the very code the replay of accepted updates runs). layer.c includes
 * this file once per element type, after layer_body.h (whose products, attention and SiLU
 * it uses).
 *
 * Rounding follows transformers' modules in the dtype: the zero-centred RMSNorm computes
 * x * rsqrt(mean(x^2) + eps) * (1 + w) in float32 and rounds once; the gated RMSNorm rounds
 * the normed value, its product with the weight, and the product with SiLU(z) (in float32);
 * rotary on the first `rot` values of a head as q*cos + rotate_half(q)*sin, each product
 * and the sum rounded; the attention output's sigmoid gate rounded, then its product.
 * Attention runs in float32 and rounds its output once. Every row is computed as a lone
 * row is: norms, gates and cache writes per row, attention one (row, head) per thread job
 * over that row's causal prefix, products from rows.c, q8.c and q4.c. */

/* zero-centred RMSNorm of n values */
static void FN(rms1p)(const ELEM *x, const ELEM *w, ELEM *out, int n, float eps) {
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
    for (int i = 0; i < n; i++) { float v = LD(x[i]); ss += v * v; }
    float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = ST(LD(x[i]) * r * (1.f + LD(w[i])));
}

/* rotate_half rotary on the first R values of a head, in place; cos/sin: this row's R values */
static void FN(rope_part)(ELEM *x, const ELEM *cos, const ELEM *sin, int R) {
    int half = R / 2;
    float tmp[512];
    for (int i = 0; i < R; i++) {
        float rot = i < half ? -LD(x[i + half]) : LD(x[i - half]);
        tmp[i] = LD(ST(LD(ST(LD(x[i]) * LD(cos[i]))) + LD(ST(rot * LD(sin[i])))));
    }
    for (int i = 0; i < R; i++) x[i] = ST(tmp[i]);
}

static inline float FN(sigmoid)(float v) { return 1.f / (1.f + expf(-v)); }

/* y [T, hid] = round(SiLU(x W_gate) * x W_up) W_down, an MLP of width I */
static void FN(hyb_swiglu)(const Mat *gate, const Mat *up, const Mat *down, const ELEM *x, int T, int hid, int I,
                           ELEM *gu, ELEM *act, ELEM *y, void *q4s, int threads) {
    FN(product)(x, hid, gate, NULL, gu, 2 * I, T, I, hid, q4s, threads);
    FN(product)(x, hid, up, NULL, gu + I, 2 * I, T, I, hid, q4s, threads);
    FN(swiglu)(gu, act, T, I);
    FN(product)(act, I, down, NULL, y, hid, T, hid, I, q4s, threads);
}

/* h += the MLP of x = rms1p(h, ln2): the dense MLP's half */
static void FN(hyb_mlp)(const HybridWeights *w, const HybridShape *s, ELEM *h, int T, ELEM *x, ELEM *gu,
                        ELEM *act, ELEM *y, void *q4s, int threads) {
    const int hid = s->hidden;
    for (int r = 0; r < T; r++)
        FN(rms1p)(h + (int64_t)r * hid, (const ELEM *)w->ln2, x + (int64_t)r * hid, hid, s->eps);
    FN(hyb_swiglu)(&w->gate, &w->up, &w->down, x, T, hid, s->inter, gu, act, y, q4s, threads);
    for (int64_t i = 0; i < (int64_t)T * hid; i++) h[i] = ST(LD(h[i]) + LD(y[i]));
}

/* the elements a row of a mixer's own scratch takes: the attention's q and gate, k, v and
 * output; or the delta-net's b and a, and its grouped projections (Qwen3-Next: q, k, v, z;
 * b, a) */
static int64_t FN(mix_elems)(const HybridShape *s) {
    int64_t hd = (int64_t)s->heads * s->head_dim, kvd = (int64_t)s->kv_heads * s->head_dim;
    int64_t attn = 2 * hd + 2 * kvd + hd;
    int64_t delta = 2 * (int64_t)s->Hk * s->Dk + 2 * (int64_t)s->Hv * s->Dv + 4 * (int64_t)s->Hv;
    return attn > delta ? attn : delta;
}

/* the scratch a pass of T rows needs, either layer kind: elements, the quantized products'
 * scratch, and each thread's attention scores over `context` keys */
int64_t FN(hybrid_scratch_bytes)(const HybridShape *s, int T, int context, int threads) {
    int64_t hd = (int64_t)s->heads * s->head_dim;
    int64_t mix = FN(mix_elems)(s);
    int64_t vd = (int64_t)s->Hv * s->Dv;
    int64_t inter = s->inter > s->shared_inter ? s->inter : s->shared_inter;
    int64_t elems = (int64_t)T * (2 * s->hidden + mix + 3 * inter);
    int64_t k = s->hidden > inter ? s->hidden : inter;
    k = k > hd ? k : hd;
    k = k > vd ? k : vd;
    int64_t quant = (int64_t)T * k * 4 + (int64_t)T * (k / 32) * 4 + 256;
    return elems * (int64_t)sizeof(ELEM) + 64 + quant + 64 + (int64_t)threads * (context + 16) * (int64_t)sizeof(float);
}

/* the scratch's parts: x [T, hid], y [T, hid], mix [T, ...], gu [T, 2I], act [T, I], q4s, scores */
#define HYB_PARTS                                                                                   \
    const int hid = s->hidden, I = s->inter > s->shared_inter ? s->inter : s->shared_inter;        \
    int64_t hd_ = (int64_t)s->heads * s->head_dim, vd_ = (int64_t)s->Hv * s->Dv;                   \
    int64_t mix_ = FN(mix_elems)(s);                                                               \
    ELEM *x = (ELEM *)scratch, *y = x + (int64_t)T * hid, *mix = y + (int64_t)T * hid;             \
    ELEM *gu = mix + (int64_t)T * mix_, *act = gu + (int64_t)T * 2 * I;                            \
    int64_t kq_ = hid > I ? hid : I;                                                               \
    kq_ = kq_ > hd_ ? kq_ : hd_;                                                                   \
    kq_ = kq_ > vd_ ? kq_ : vd_;                                                                   \
    void *q4s = (void *)(((uintptr_t)(act + (int64_t)T * I) + 63) & ~(uintptr_t)63);               \
    float *scores = (float *)(((uintptr_t)q4s + (int64_t)T * kq_ * 4 + (int64_t)T * (kq_ / 32) * 4 \
                               + 256 + 63) & ~(uintptr_t)63);                                      \
    (void)scores; (void)gu; (void)act;

/* A gated attention decoder layer over h [T, hid] in place, rows at positions pos..pos+T-1
 * (each attends to the cache's [0, pos+r] after its keys and values are written there);
 * cos/sin [T, rot]. The dense MLP too when w->gate.w is set (else the caller runs it). */
void FN(hyb_attn)(const HybridWeights *w, const HybridShape *s, ELEM *h, int T, int pos, const ELEM *cos,
                  const ELEM *sin, void *scratch, int threads) {
    HYB_PARTS
    const int H = s->heads, KV = s->kv_heads, D = s->head_dim, R = s->rot, group = H / KV;
    ELEM *qg = mix, *kk = qg + (int64_t)T * 2 * H * D, *vv = kk + (int64_t)T * KV * D;
    ELEM *att = vv + (int64_t)T * KV * D;
    const int ctx = pos + T;

    for (int r = 0; r < T; r++)
        FN(rms1p)(h + (int64_t)r * hid, (const ELEM *)w->ln1, x + (int64_t)r * hid, hid, s->eps);
    FN(product)(x, hid, &w->q, NULL, qg, 2 * H * D, T, 2 * H * D, hid, q4s, threads);
    FN(product)(x, hid, &w->k, NULL, kk, KV * D, T, KV * D, hid, q4s, threads);
    FN(product)(x, hid, &w->v, NULL, vv, KV * D, T, KV * D, hid, q4s, threads);

    ELEM *kc = (ELEM *)w->k_cache, *vc = (ELEM *)w->v_cache;
    for (int r = 0; r < T; r++) {
        const ELEM *cr = cos + (int64_t)r * R, *sr = sin + (int64_t)r * R;
        for (int hh = 0; hh < H; hh++) {            /* each head's query is followed by its gate */
            ELEM *q = qg + (int64_t)r * 2 * H * D + (int64_t)hh * 2 * D;
            FN(rms1p)(q, (const ELEM *)w->q_norm, q, D, s->eps);
            FN(rope_part)(q, cr, sr, R);
        }
        for (int kv = 0; kv < KV; kv++) {
            ELEM *k = kk + (int64_t)r * KV * D + (int64_t)kv * D;
            FN(rms1p)(k, (const ELEM *)w->k_norm, k, D, s->eps);
            FN(rope_part)(k, cr, sr, R);
            int64_t at = ((int64_t)kv * s->capacity + pos + r) * D;
            memcpy(kc + at, k, D * sizeof(ELEM));
            memcpy(vc + at, vv + (int64_t)r * KV * D + (int64_t)kv * D, D * sizeof(ELEM));
        }
    }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int job = 0; job < T * H; job++) {
        int r = job / H, hh = job % H, kv = hh / group;
        int64_t base = (int64_t)kv * s->capacity * D;
        FN(attend)(qg + (int64_t)r * 2 * H * D + (int64_t)hh * 2 * D, kc + base, vc + base, pos + r + 1, D,
                   s->scale, scores + (int64_t)omp_get_thread_num() * (ctx + 16), att + (int64_t)r * H * D + hh * D);
    }
    for (int r = 0; r < T; r++)
        for (int hh = 0; hh < H; hh++) {
            const ELEM *gate = qg + (int64_t)r * 2 * H * D + (int64_t)hh * 2 * D + D;
            ELEM *a = att + (int64_t)r * H * D + (int64_t)hh * D;
            for (int d = 0; d < D; d++) a[d] = ST(LD(a[d]) * LD(ST(FN(sigmoid)(LD(gate[d])))));
        }
    FN(product)(att, H * D, &w->o, NULL, y, hid, T, hid, H * D, q4s, threads);
    for (int64_t i = 0; i < (int64_t)T * hid; i++) h[i] = ST(LD(h[i]) + LD(y[i]));
    if (w->gate.w) FN(hyb_mlp)(w, s, h, T, x, gu, act, y, q4s, threads);
}

/* A gated delta-net layer's first half over h [T, hid] (not written): x = rms1p(h, ln1) and
 * its projections: raw [T, conv channels] (q, k, v before the conv), z [T, Hv*Dv], beta
 * [T, Hv] = sigmoid(x W_b) rounded, and g [T, Hv] float32 = a_neg * softplus(x W_a + dt_bias)
 * (a_neg = -exp(A_log) in float32; softplus as torch's, x past 20 kept as is). Qwen3-Next's
 * projections come grouped by key head (qkvz: each head's q, k, then its value heads' v and
 * z; ba: its value heads' b then a) and are regrouped as Qwen3.5's are laid out. */
void FN(hyb_gdn_in)(const HybridWeights *w, const HybridShape *s, const ELEM *h, int T, ELEM *raw, ELEM *z,
                    ELEM *beta, float *g, void *scratch, int threads) {
    HYB_PARTS
    const int Hv = s->Hv, C = 2 * s->Hk * s->Dk + Hv * s->Dv;
    ELEM *ba = mix;                                    /* [T, Hv] b, then [T, Hv] a */
    for (int r = 0; r < T; r++)
        FN(rms1p)(h + (int64_t)r * hid, (const ELEM *)w->ln1, x + (int64_t)r * hid, hid, s->eps);
    if (w->qkv.w) {
        FN(product)(x, hid, &w->qkv, NULL, raw, C, T, C, hid, q4s, threads);
        FN(product)(x, hid, &w->z, NULL, z, Hv * s->Dv, T, Hv * s->Dv, hid, q4s, threads);
        FN(product)(x, hid, &w->b, NULL, ba, Hv, T, Hv, hid, q4s, threads);
        FN(product)(x, hid, &w->a, NULL, ba + (int64_t)T * Hv, Hv, T, Hv, hid, q4s, threads);
        if (w->in_tiled) {                             /* value heads into the model's order */
            const int Hk = s->Hk, Dv = s->Dv, rep = Hv / Hk;
            ELEM *tmp = ba + (int64_t)2 * T * Hv;      /* mix's room past b and a: Hv * Dv fits */
            for (int r = 0; r < T; r++)
                for (int part = 0; part < 2; part++) {
                    ELEM *v = part ? z + (int64_t)r * Hv * Dv : raw + (int64_t)r * C + 2 * (int64_t)Hk * s->Dk;
                    memcpy(tmp, v, (size_t)Hv * Dv * sizeof(ELEM));
                    for (int k = 0; k < Hk; k++)
                        for (int i = 0; i < rep; i++)
                            memcpy(v + ((int64_t)k * rep + i) * Dv, tmp + ((int64_t)i * Hk + k) * Dv, Dv * sizeof(ELEM));
                }
        }
    } else {
        const int Hk = s->Hk, Dk = s->Dk, Dv = s->Dv, rep = Hv / Hk, G = 2 * Dk + 2 * rep * Dv;
        ELEM *grouped = ba + (int64_t)2 * T * Hv, *gba = grouped + (int64_t)T * Hk * G;
        FN(product)(x, hid, &w->qkvz, NULL, grouped, Hk * G, T, Hk * G, hid, q4s, threads);
        FN(product)(x, hid, &w->ba, NULL, gba, 2 * Hv, T, 2 * Hv, hid, q4s, threads);
        for (int r = 0; r < T; r++) {
            ELEM *rr = raw + (int64_t)r * C, *zr = z + (int64_t)r * Hv * Dv;
            for (int g = 0; g < Hk; g++) {
                const ELEM *src = grouped + ((int64_t)r * Hk + g) * G;
                memcpy(rr + (int64_t)g * Dk, src, Dk * sizeof(ELEM));
                memcpy(rr + (int64_t)(Hk + g) * Dk, src + Dk, Dk * sizeof(ELEM));
                memcpy(rr + 2 * (int64_t)Hk * Dk + (int64_t)g * rep * Dv, src + 2 * Dk, rep * Dv * sizeof(ELEM));
                memcpy(zr + (int64_t)g * rep * Dv, src + 2 * Dk + rep * Dv, rep * Dv * sizeof(ELEM));
                const ELEM *sba = gba + (int64_t)r * 2 * Hv + (int64_t)g * 2 * rep;
                memcpy(ba + (int64_t)r * Hv + (int64_t)g * rep, sba, rep * sizeof(ELEM));
                memcpy(ba + (int64_t)T * Hv + (int64_t)r * Hv + (int64_t)g * rep, sba + rep, rep * sizeof(ELEM));
            }
        }
    }
    const ELEM *dt = (const ELEM *)w->dt_bias;
    for (int r = 0; r < T; r++)
        for (int j = 0; j < Hv; j++) {
            int64_t i = (int64_t)r * Hv + j;
            beta[i] = ST(FN(sigmoid)(LD(ba[i])));
            float v = LD(ba[(int64_t)T * Hv + i]) + LD(dt[j]);
            float sp = v > 20.f ? v : log1pf(expf(v));
            g[i] = w->a_neg[j] * sp;
        }
}

/* The second half: core [T, Hv*Dv] (the recurrence's output) through the gated RMSNorm with
 * z, the out-projection, the residual into h; the dense MLP too when w->gate.w is set. */
void FN(hyb_gdn_out)(const HybridWeights *w, const HybridShape *s, ELEM *h, int T, const ELEM *core,
                     const ELEM *z, void *scratch, int threads) {
    HYB_PARTS
    const int Hv = s->Hv, Dv = s->Dv;
    ELEM *o = mix;
    const ELEM *nw = (const ELEM *)w->norm;
    const int per_key = Hv / s->Hk;
    for (int64_t row = 0; row < (int64_t)T * Hv; row++) {
        const ELEM *c = core + row * Dv, *zz = z + row * Dv;
        int head = (int)(row % Hv);             /* grouped: key head head / per_key, its head % per_key-th */
        int at = w->out_tiled ? (head % per_key) * s->Hk + head / per_key : head;
        ELEM *out = o + (row - head + at) * Dv;
        float ss = 0.f;
        for (int d = 0; d < Dv; d++) { float v = LD(c[d]); ss += v * v; }
        float r = 1.f / sqrtf(ss / (float)Dv + s->eps);
        for (int d = 0; d < Dv; d++) {
            float n = LD(ST(LD(nw[d]) * LD(ST(LD(c[d]) * r))));
            float zv = LD(zz[d]);
            out[d] = ST(n * (zv * FN(sigmoid)(zv)));
        }
    }
    FN(product)(o, Hv * Dv, &w->out, NULL, y, hid, T, hid, Hv * Dv, q4s, threads);
    for (int64_t i = 0; i < (int64_t)T * hid; i++) h[i] = ST(LD(h[i]) + LD(y[i]));
    if (w->gate.w) FN(hyb_mlp)(w, s, h, T, x, gu, act, y, q4s, threads);
}
/* A sparse block's half but its routed experts: x [T, hid] = rms1p(h, ln2) (h not written),
 * and shared [T, hid] = sigmoid(x W_score) * SwiGLU expert(x), the gate and the product
 * each rounded. The caller routes x, runs the experts, and adds: h + (experts + shared). */
void FN(hyb_moe_in)(const HybridWeights *w, const HybridShape *s, const ELEM *h, int T, ELEM *xo, ELEM *shared,
                    void *scratch, int threads) {
    HYB_PARTS
    const int SI = s->shared_inter;
    ELEM *score = mix;
    for (int r = 0; r < T; r++)
        FN(rms1p)(h + (int64_t)r * hid, (const ELEM *)w->ln2, xo + (int64_t)r * hid, hid, s->eps);
    FN(hyb_swiglu)(&w->se_gate, &w->se_up, &w->se_down, xo, T, hid, SI, gu, act, y, q4s, threads);
    FN(product)(xo, hid, &w->se_score, NULL, score, 1, T, 1, hid, q4s, threads);
    for (int r = 0; r < T; r++) {
        float g = LD(ST(FN(sigmoid)(LD(score[r]))));
        for (int i = 0; i < hid; i++) shared[(int64_t)r * hid + i] = ST(g * LD(y[(int64_t)r * hid + i]));
    }
}
#undef HYB_PARTS
