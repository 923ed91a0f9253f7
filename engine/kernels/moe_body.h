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

int64_t FN(moe_scratch_bytes)(int T, int hid, int I, int k, int E) {
    int64_t wide = hid > I ? hid : I;
    int64_t ints = (int64_t)E + 1 + 2 * (int64_t)T * k;
    int64_t elems = (int64_t)T * (hid + 2 * (int64_t)I + I + hid);
    int64_t q4 = (int64_t)T * wide * 4 + (int64_t)T * (wide / 32) * 4 + 256;     /* q4.c's, either build */
    return ints * 4 + 64 + elems * (int64_t)sizeof(ELEM) + 64 + q4 + 64;
}

/* out [T, hid] = sum over each row's k routed experts e of wts[t, j] * down_e(SiLU(gate_e x) * up_e x).
 * x [T, hid]; idx, wts [T, k] (an index outside [0, E) is skipped); gate_up: the experts'
 * [2I, hid] matrices, down: their [hid, I] ones, either E descriptions or, with a step in
 * bytes > 0, one description whose weight moves by that step per expert (a dense 3-D tensor). */
void FN(moe)(const Mat *gate_up, int64_t gu_step, const Mat *down, int64_t down_step, int E, int hid, int I,
             const ELEM *x, int T, const int64_t *idx, const ELEM *wts, int k, ELEM *out, void *scratch,
             int threads) {
    int *start = (int *)scratch;               /* [E + 1] each expert's first routed slot */
    int *row = start + E + 1;                  /* [T k]   the rows routed, grouped by expert */
    int *slot = row + (int64_t)T * k;          /* [T k]   and the slot j each came from */
    ELEM *xg = (ELEM *)(((uintptr_t)(slot + (int64_t)T * k) + 63) & ~(uintptr_t)63);   /* [T, hid] */
    ELEM *gu = xg + (int64_t)T * hid;          /* [T, 2I] */
    ELEM *act = gu + (int64_t)T * 2 * I;       /* [T, I]  */
    ELEM *d = act + (int64_t)T * I;            /* [T, hid] */
    void *q4s = (void *)(((uintptr_t)(d + (int64_t)T * hid) + 63) & ~(uintptr_t)63);

    memset(start, 0, (size_t)(E + 1) * sizeof(int));
    for (int64_t s = 0; s < (int64_t)T * k; s++)
        if (idx[s] >= 0 && idx[s] < E) start[idx[s] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
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

    const ELEM zero = ST(0.f);
    for (int64_t i = 0; i < (int64_t)T * hid; i++) out[i] = zero;
    for (int e = 0; e < E; e++) {
        int s0 = start[e], n = start[e + 1] - s0;
        if (!n) continue;
        Mat a = gu_step ? gate_up[0] : gate_up[e], b = down_step ? down[0] : down[e];
        if (gu_step) a.w = (const char *)a.w + gu_step * e;
        if (down_step) b.w = (const char *)b.w + down_step * e;
        for (int i = 0; i < n; i++)
            memcpy(xg + (int64_t)i * hid, x + (int64_t)row[s0 + i] * hid, (size_t)hid * sizeof(ELEM));
        FN(product)(xg, hid, &a, NULL, gu, 2 * I, n, 2 * I, hid, q4s, threads);
        FN(swiglu)(gu, act, n, I);
        FN(product)(act, I, &b, NULL, d, hid, n, hid, I, q4s, threads);
        for (int i = 0; i < n; i++) {
            int t = row[s0 + i];
            float w = LD(wts[(int64_t)t * k + slot[s0 + i]]);
            ELEM *o = out + (int64_t)t * hid;
            const ELEM *dv = d + (int64_t)i * hid;
            for (int c = 0; c < hid; c++) o[c] = ST(LD(o[c]) + LD(ST(LD(dv[c]) * w)));
        }
    }
}
