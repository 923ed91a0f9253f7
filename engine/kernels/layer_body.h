/* One Llama-family decoder layer for a few token rows, in one element type. layer.c
 * includes this file once per type, with these defined:
 *   ELEM        the element type (float, or uint16_t holding bfloat16)
 *   FN(name)    the function's name for this type
 *   LD(v)       an element as float
 *   ST(f)       a float rounded to an element (as torch rounds a result to the tensor's dtype)
 *   LINEAR      rows.c's product for this type
 *   LINEAR_Q8   q8.c's, LINEAR_Q4 q4.c's (int8 and int4 matrices), LINEAR_GG gguf.c's (GGUF blocks)
 *
 * Every step rounds where the reference (transformers' modules in this dtype, as
 * engine/models/llama_family.py runs them) rounds: RMSNorm's statistics in float32, its
 * product with the weight in the dtype; rotary as q*cos + rotate(q)*sin, each product and
 * the sum rounded; SiLU then the product with `up`, each rounded; residual sums rounded.
 * Attention runs in float32 (scores, softmax, weighted sum) and rounds its output once. */

/* RMSNorm of `n` values: out = w * round(x * rsqrt(mean(x^2) + eps)) */
static void FN(rms)(const ELEM *x, const ELEM *w, ELEM *out, int n, float eps) {
    float ss = 0.f;
    #pragma omp simd reduction(+:ss)
    for (int i = 0; i < n; i++) { float v = LD(x[i]); ss += v * v; }
    float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = ST(LD(w[i]) * LD(ST(LD(x[i]) * r)));
}

/* rotate_half rotary on one head of D values in place: cos/sin rows of this position; sin's
 * first half is negated already (llama_family.py's table), so rotate(x)*sin is a plain product */
static void FN(rope)(ELEM *x, const ELEM *cos, const ELEM *sin, int D) {
    int half = D / 2;
    float tmp[512];
    for (int i = 0; i < D; i++) {
        float rot = LD(x[i < half ? i + half : i - half]);
        tmp[i] = LD(ST(LD(ST(LD(x[i]) * LD(cos[i]))) + LD(ST(rot * LD(sin[i])))));
    }
    for (int i = 0; i < D; i++) x[i] = ST(tmp[i]);
}

/* One query row of one head over keys/values [0, n): softmax(q.k * scale) . v */
static void FN(attend)(const ELEM *q, const ELEM *kc, const ELEM *vc, int n, int D, float scale,
                       float *scores, ELEM *out) {
    float qf[512], acc[512];
    for (int d = 0; d < D; d++) { qf[d] = LD(q[d]); acc[d] = 0.f; }
    float mx = -INFINITY;
    for (int j = 0; j < n; j++) {
        const ELEM *k = kc + (int64_t)j * D;
        float s = 0.f;
        #pragma omp simd reduction(+:s)
        for (int d = 0; d < D; d++) s += qf[d] * LD(k[d]);
        s *= scale;
        scores[j] = s;
        mx = s > mx ? s : mx;
    }
    float sum = exp_shifted(scores, n, mx);
    for (int j = 0; j < n; j++) {
        const ELEM *v = vc + (int64_t)j * D;
        float p = scores[j];
        #pragma omp simd
        for (int d = 0; d < D; d++) acc[d] += p * LD(v[d]);
    }
    float inv = 1.f / sum;
    for (int d = 0; d < D; d++) out[d] = ST(acc[d] * inv);
}

/* y = x @ m.T (+ bias) for M rows: rows.c's product, or q8.c's or q4.c's for an int8 or
 * int4 matrix (their scratch at q4s), or gguf.c's for a GGUF file's blocks */
static void FN(product)(const ELEM *x, int64_t ldx, const Mat *m, const ELEM *bias, ELEM *y, int64_t ldy,
                        int M, int N, int K, void *q4s, int threads) {
    if (m->group == GG_MAT)
        LINEAR_GG(x, ldx, (const GGMat *)m->w, bias, y, ldy, M, N, K, threads);
    else if (m->group < 0)
        LINEAR_Q8(x, ldx, (const int8_t *)m->w, (const ELEM *)m->scale, bias, y, ldy, M, N, K, q4s, threads);
    else if (m->group)
        LINEAR_Q4(x, ldx, (const uint8_t *)m->w, (const uint16_t *)m->scale, (const uint16_t *)m->zero,
                  (int)m->group, bias, y, ldy, M, N, K, q4s, threads);
    else
        LINEAR(x, ldx, (const ELEM *)m->w, K, bias, y, ldy, M, N, K, threads);
}

/* act [T, I] = SiLU(gate) * up of gu [T, 2I] (gate then up in each row), each rounded */
static void FN(swiglu)(const ELEM *gu, ELEM *act, int T, int I) {
    for (int r = 0; r < T; r++) {
        const ELEM *g = gu + (int64_t)r * 2 * I, *u = g + I;
        ELEM *a = act + (int64_t)r * I;
        for (int i0 = 0; i0 < I; i0 += 16) {
            int n = I - i0 < 16 ? I - i0 : 16;
            float gv[16] = {0}, sv[16];
            for (int i = 0; i < n; i++) gv[i] = LD(g[i0 + i]);
            silu16(gv, sv);
            for (int i = 0; i < n; i++) a[i0 + i] = ST(LD(ST(sv[i])) * LD(u[i0 + i]));
        }
    }
}

/* the scratch of the widest product for T rows: q8.c's (x in float32) or q4.c's (x split,
 * and its group sums), whichever is larger */
static int64_t FN(quant_bytes)(const LayerShape *s, int T) {
    int64_t k = s->hidden > s->inter ? s->hidden : s->inter;
    int64_t hd = (int64_t)s->heads * s->head_dim;
    k = k > hd ? k : hd;
    return (int64_t)T * k * 4 + (int64_t)T * (k / 32) * 4 + 256;
}

int64_t FN(layer_scratch_bytes)(const LayerShape *s, int T, int context, int threads) {
    int64_t qkv = (int64_t)(s->heads + 2 * s->kv_heads) * s->head_dim;
    int64_t elems = (int64_t)T * (s->hidden + qkv + (int64_t)s->heads * s->head_dim + 3 * (int64_t)s->inter + s->hidden);
    return elems * (int64_t)sizeof(ELEM) + 64 + FN(quant_bytes)(s, T) + 64 + (int64_t)threads * (context + 16) * (int64_t)sizeof(float);
}

/* h [T, hidden] (updated in place): rows at positions pos .. pos+T-1, each attending to the
 * cache's [0, pos+r] after its own keys and values are written there. cos/sin: [T, D]. */
void FN(layer)(const LayerWeights *w, const LayerShape *s, ELEM *h, int T, int pos, const ELEM *cos,
               const ELEM *sin, void *scratch, int threads) {
    const int hid = s->hidden, H = s->heads, KV = s->kv_heads, D = s->head_dim, I = s->inter;
    const int QKV = (H + 2 * KV) * D, group = H / KV;
    ELEM *x = (ELEM *)scratch;                 /* [T, hid]  normed input of a product */
    ELEM *qkv = x + (int64_t)T * hid;          /* [T, QKV] */
    ELEM *att = qkv + (int64_t)T * QKV;        /* [T, H*D] */
    ELEM *gu = att + (int64_t)T * H * D;       /* [T, 2I]  */
    ELEM *act = gu + (int64_t)T * 2 * I;       /* [T, I]   */
    ELEM *y = act + (int64_t)T * I;            /* [T, hid] a product's output */
    void *q4s = (void *)(((uintptr_t)(y + (int64_t)T * hid) + 63) & ~(uintptr_t)63);
    float *scores = (float *)(((uintptr_t)q4s + FN(quant_bytes)(s, T) + 63) & ~(uintptr_t)63);
    const int ctx = pos + T;

    for (int r = 0; r < T; r++) FN(rms)(h + (int64_t)r * hid, (const ELEM *)w->ln1, x + (int64_t)r * hid, hid, s->eps);
    FN(product)(x, hid, &w->qkv, (const ELEM *)w->qkv_bias, qkv, QKV, T, QKV, hid, q4s, threads);

    ELEM *kc = (ELEM *)w->k_cache, *vc = (ELEM *)w->v_cache;
    for (int r = 0; r < T; r++) {
        ELEM *row = qkv + (int64_t)r * QKV;
        for (int hd = 0; hd < H + KV; hd++) {
            ELEM *head = row + hd * D;
            if (w->q_norm) FN(rms)(head, (const ELEM *)(hd < H ? w->q_norm : w->k_norm), head, D, s->eps);
            FN(rope)(head, cos + (int64_t)r * D, sin + (int64_t)r * D, D);
        }
        for (int kv = 0; kv < KV; kv++) {
            int64_t at = ((int64_t)kv * s->capacity + pos + r) * D;
            memcpy(kc + at, row + (H + kv) * D, D * sizeof(ELEM));
            memcpy(vc + at, row + (H + KV + kv) * D, D * sizeof(ELEM));
        }
    }
    /* each (row, head) is one thread's whole job: its bits do not depend on the thread count */
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int job = 0; job < T * H; job++) {
        int r = job / H, hd = job % H, kv = hd / group;
        int64_t base = (int64_t)kv * s->capacity * D;
        FN(attend)(qkv + (int64_t)r * QKV + hd * D, kc + base, vc + base, pos + r + 1, D, s->scale,
                   scores + (int64_t)omp_get_thread_num() * (ctx + 16), att + (int64_t)r * H * D + hd * D);
    }

    FN(product)(att, H * D, &w->o, (const ELEM *)w->o_bias, y, hid, T, hid, H * D, q4s, threads);
    for (int64_t i = 0; i < (int64_t)T * hid; i++) h[i] = ST(LD(h[i]) + LD(y[i]));

    for (int r = 0; r < T; r++) FN(rms)(h + (int64_t)r * hid, (const ELEM *)w->ln2, x + (int64_t)r * hid, hid, s->eps);
    FN(product)(x, hid, &w->gate_up, NULL, gu, 2 * I, T, 2 * I, hid, q4s, threads);
    FN(swiglu)(gu, act, T, I);
    FN(product)(act, I, &w->down, NULL, y, hid, T, hid, I, q4s, threads);
    for (int64_t i = 0; i < (int64_t)T * hid; i++) h[i] = ST(LD(h[i]) + LD(y[i]));
}

/* `count` layers in order (a resident model's whole stack): one call a pass */
void FN(layers)(const LayerWeights *w, int count, const LayerShape *s, ELEM *h, int T, int pos,
                const ELEM *cos, const ELEM *sin, void *scratch, int threads) {
    for (int i = 0; i < count; i++) FN(layer)(w + i, s, h, T, pos, cos, sin, scratch, threads);
}

/* `rows` rows of RMSNorm with the weight w, as the layers' norms compute it: the final norm
 * of a pass the layers ran in this file, so its bits are the same whichever forward ran them */
void FN(rms_rows)(const ELEM *x, const ELEM *w, ELEM *out, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++) FN(rms)(x + (int64_t)r * n, w, out + (int64_t)r * n, n, eps);
}

int64_t FN(tail_scratch_bytes)(int rows, int hid, int vocab) {
    return (int64_t)rows * hid * (int64_t)sizeof(ELEM) + 64 + (int64_t)rows * vocab * (int64_t)sizeof(ELEM) + 64
           + (int64_t)rows * hid * 4 + (int64_t)rows * (hid / 32) * 4 + 256 + 64;
}

/* A pass's last step for the `rows` rows at h [rows, hid]: the final RMSNorm (rms_rows), the
 * output head's product in the dtype (rows.c's, q8.c's or q4.c's, as for a layer's matrix),
 * widened to float32 logits [rows, vocab]. One call: between the last layer and the logits a
 * decode step runs no torch operation, each of which, after the layers have streamed the
 * weights through the caches, cost a cold start of 100-300 us on the development Xeon. */
void FN(tail)(const ELEM *h, int rows, int hid, const ELEM *norm, float eps, const Mat *head, int vocab,
              float *logits, void *scratch, int threads) {
    ELEM *x = (ELEM *)scratch;
    ELEM *y = (ELEM *)(((uintptr_t)(x + (int64_t)rows * hid) + 63) & ~(uintptr_t)63);
    void *q4s = (void *)(((uintptr_t)(y + (int64_t)rows * vocab) + 63) & ~(uintptr_t)63);
    FN(rms_rows)(h, norm, x, rows, hid, eps);
    if (sizeof(ELEM) == sizeof(float)) y = (ELEM *)logits;        /* float32: the product is the logits */
    FN(product)(x, hid, head, NULL, y, vocab, rows, vocab, hid, q4s, threads);
    if ((void *)y != (void *)logits)
        for (int64_t i = 0; i < (int64_t)rows * vocab; i++) logits[i] = LD(y[i]);
}

/* A whole one-token step or verify pass: the rows of the embedding table at ids (or h as
 * given, where ids is NULL) into h [T, hidden], every layer at positions pos .. pos+T-1 (cos
 * and sin: the rotary tables from position 0), then the tail for the last `rows` rows. One
 * call from Python a pass, for the same reason as the tail. The table is dense in the dtype
 * or per-channel int8 (a quantized profile's tied head), whose row is code * scale rounded
 * to the dtype, as qweights.Int8Weight.rows computes it. */
void FN(pass)(const LayerWeights *w, int count, const LayerShape *s, const int64_t *ids, const Mat *embed,
              ELEM *h, int T, int pos, const ELEM *cos, const ELEM *sin, void *scratch, int threads,
              const ELEM *norm, const Mat *head, int vocab, int rows, float *logits, void *tail_scratch) {
    const int hid = s->hidden, D = s->head_dim;
    for (int r = 0; ids && r < T; r++) {
        ELEM *row = h + (int64_t)r * hid;
        if (embed->group == 0) {
            memcpy(row, (const ELEM *)embed->w + ids[r] * hid, (size_t)hid * sizeof(ELEM));
        } else {
            const int8_t *q = (const int8_t *)embed->w + ids[r] * hid;
            float scale = LD(((const ELEM *)embed->scale)[ids[r]]);
            for (int i = 0; i < hid; i++) row[i] = ST((float)q[i] * scale);
        }
    }
    FN(layers)(w, count, s, h, T, pos, cos + (int64_t)pos * D, sin + (int64_t)pos * D, scratch, threads);
    FN(tail)(h + (int64_t)(T - rows) * hid, rows, hid, norm, s->eps, head, vocab, logits, tail_scratch, threads);
}
