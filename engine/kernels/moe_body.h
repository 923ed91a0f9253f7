/* A mixture-of-experts block's routed experts for a few token rows, in one element type:
 * layer.c includes this file after layer_body.h, once per type, with the same macros.
 *
 * Each expert the rows route to is applied once, to all the rows routed to it (its weights
 * read once a pass), in ascending expert order; each row's result is the sum, in that
 * order, of its experts' outputs times their routing weights. That is the arithmetic of
 * transformers' experts modules (gate and up fused, SiLU(gate) * up, down, the product
 * with the routing weight and index_add_, each rounded to the dtype), and it makes every
 * row a lone row's bits: the products are rows.c's and q4.c's, whose elements do not
 * depend on the row count, and a row's sum runs over its own experts in a fixed order. */

/* A pass routes its rows to several experts (8 a token in Qwen3.5-35B-A3B; a prefill chunk
 * hits most of them, a few rows each): each expert's products are then too small to share
 * between threads without their fork and join costing a good part of the read, so the
 * threads take whole experts instead (one parallel region a block), each product on one
 * thread. Only when fewer experts are hit than there are threads do the threads share each
 * product. The bits are the same either way: a product's elements do not depend on the
 * thread count, and the rows are summed afterwards in expert order. */

static int64_t FN(moe_thread_bytes)(int n, int hid, int I) {
    int64_t wide = hid > I ? hid : I;
    int64_t q4 = (int64_t)n * wide * 4 + (int64_t)n * (wide / 32) * 4 + 256;     /* q4.c's, either build */
    return ((int64_t)n * 3 * I * (int64_t)sizeof(ELEM) + 63) / 64 * 64 + (q4 + 63) / 64 * 64;
}

int64_t FN(moe_scratch_bytes)(int T, int hid, int I, int k, int E, int threads) {
    int64_t ints = 2 * ((int64_t)E + 1) + 2 * (int64_t)T * k;
    int64_t rows = (int64_t)T * k * hid * (int64_t)sizeof(ELEM);          /* xg and d, a slot each */
    int64_t each = FN(moe_thread_bytes)(T, hid, I);
    return ints * 4 + 64 + 2 * (rows + 64) + (threads > 1 ? threads : 1) * each + 64;
}

/* One expert's rows: act = SiLU(gate x) * up x, then d = down act (n rows of x, d). */
static void FN(moe_expert)(const Mat *a, const Mat *up, const Mat *b, const ELEM *x, int n, int hid, int I, ELEM *d,
                           void *mine, int threads) {
    ELEM *gu = (ELEM *)mine, *act = gu + (int64_t)n * 2 * I;
    void *q4s = (void *)(((uintptr_t)(act + (int64_t)n * I) + 63) & ~(uintptr_t)63);
    if (up) {
        FN(product)(x, hid, a, NULL, gu, 2 * I, n, I, hid, q4s, threads);
        FN(product)(x, hid, up, NULL, gu + I, 2 * I, n, I, hid, q4s, threads);
    } else {
        FN(product)(x, hid, a, NULL, gu, 2 * I, n, 2 * I, hid, q4s, threads);
    }
    FN(swiglu)(gu, act, n, I);
    FN(product)(act, I, b, NULL, d, hid, n, hid, I, q4s, threads);
}

/* out [T, hid] = sum over each row's k routed experts e of wts[t, j] * down_e(SiLU(gate_e x) * up_e x).
 * x [T, hid]; idx, wts [T, k] (an index outside [0, E) is skipped); gate_up: the experts'
 * [2I, hid] matrices, down: their [hid, I] ones, either E descriptions or, with a step in
 * bytes > 0, one description whose weight moves by that step per expert (a dense 3-D tensor).
 * With `up` (E descriptions, no steps), gate_up holds the [I, hid] gate matrices and up the
 * up ones, as checkpoints store them: the two products fill the halves of the same rows. */
void FN(moe)(const Mat *gate_up, int64_t gu_step, const Mat *up, const Mat *down, int64_t down_step, int E,
             int hid, int I, const ELEM *x, int T, const int64_t *idx, const ELEM *wts, int k, ELEM *out,
             void *scratch, int threads) {
    int *start = (int *)scratch;               /* [E + 1] each expert's first routed slot */
    int *hit = start + E + 1;                  /* [E + 1] the experts routed to, ascending */
    int *row = hit + E + 1;                    /* [T k]   the rows routed, grouped by expert */
    int *slot = row + (int64_t)T * k;          /* [T k]   and the slot j each came from */
    ELEM *xg = (ELEM *)(((uintptr_t)(slot + (int64_t)T * k) + 63) & ~(uintptr_t)63);   /* [T k, hid] */
    ELEM *d = (ELEM *)(((uintptr_t)(xg + (int64_t)T * k * hid) + 63) & ~(uintptr_t)63); /* [T k, hid] */
    char *mine = (char *)(((uintptr_t)(d + (int64_t)T * k * hid) + 63) & ~(uintptr_t)63);
    int64_t each = FN(moe_thread_bytes)(T, hid, I);

    memset(start, 0, (size_t)(E + 1) * sizeof(int));
    for (int64_t s = 0; s < (int64_t)T * k; s++)
        if (idx[s] >= 0 && idx[s] < E) start[idx[s] + 1]++;
    int hits = 0;
    for (int e = 0; e < E; e++) {
        if (start[e + 1]) hit[hits++] = e;
        start[e + 1] += start[e];
    }
    for (int t = 0; t < T; t++)                /* rows ascending within an expert */
        for (int j = 0; j < k; j++) {
            int64_t e = idx[(int64_t)t * k + j];
            if (e < 0 || e >= E) continue;
            int p = start[e]++;
            row[p] = t;
            slot[p] = j;
        }
    for (int e = E; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    for (int s = 0; s < start[E]; s++)
        memcpy(xg + (int64_t)s * hid, x + (int64_t)row[s] * hid, (size_t)hid * sizeof(ELEM));

#define MOE_MATS(e)                                                                                 \
    Mat a = gu_step ? gate_up[0] : gate_up[e], b = down_step ? down[0] : down[e];                   \
    if (gu_step) a.w = (const char *)a.w + gu_step * (e);                                           \
    if (down_step) b.w = (const char *)b.w + down_step * (e);
    if (threads > 1 && hits >= threads) {
        #pragma omp parallel for schedule(static, 1) num_threads(threads)
        for (int h = 0; h < hits; h++) {
            int e = hit[h], s0 = start[e];
            MOE_MATS(e)
            FN(moe_expert)(&a, up ? &up[e] : NULL, &b, xg + (int64_t)s0 * hid, start[e + 1] - s0, hid, I,
                           d + (int64_t)s0 * hid, mine + omp_get_thread_num() * each, 1);
        }
    } else {
        for (int h = 0; h < hits; h++) {
            int e = hit[h], s0 = start[e];
            MOE_MATS(e)
            FN(moe_expert)(&a, up ? &up[e] : NULL, &b, xg + (int64_t)s0 * hid, start[e + 1] - s0, hid, I,
                           d + (int64_t)s0 * hid, mine, threads);
        }
    }
#undef MOE_MATS

    const ELEM zero = ST(0.f);
    for (int64_t i = 0; i < (int64_t)T * hid; i++) out[i] = zero;
    for (int s = 0; s < start[E]; s++) {       /* each row's experts in ascending order */
        int t = row[s];
        float w = LD(wts[(int64_t)t * k + slot[s]]);
        ELEM *o = out + (int64_t)t * hid;
        const ELEM *dv = d + (int64_t)s * hid;
        for (int c = 0; c < hid; c++) o[c] = ST(LD(o[c]) + LD(ST(LD(dv[c]) * w)));
    }
}
