/* The GGUF block kernels (gguf.c) and, for a prefill's products over many rows, gemm.c's
 * GEMM fed a column block of weight rows at a time, decoded from the file's blocks into a
 * thread's small buffer (it stays in cache while the block's tiles read it): no decoded copy
 * of the whole weight is made, and the decoded weights are the file's to the bit (gguf.c's
 * decoders). One library, built as gguf.c alone would be (gguf_kernel.py). */
#include "gguf.c"
#include "gemm.c"

typedef struct {
    decode_fn decode;
    int bs, bytes;
    const uint8_t *w;
    int64_t row_bytes;
} GGRows;

static void gg_fill(const void *ctx, int n0, int nr, int K, float *buf) {
    const GGRows *g = ctx;
    for (int j = 0; j < nr; j++) {
        const uint8_t *wr = g->w + (int64_t)(n0 + j) * g->row_bytes;
        for (int k0 = 0; k0 < K; k0 += g->bs, wr += g->bytes) g->decode(wr, buf + (int64_t)j * K + k0);
    }
}

/* y = x @ w.T (+ bias) for M float32 rows of x and a weight of N rows in format `type`;
 * scratch: gemm_scratch_bytes(M, K). 0, -1 for a type gguf.c does not read or K not a whole
 * number of blocks, -2 out of memory. */
int gguf_gemm_f32(int type, const float *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, const float *bias,
                  float *y, int64_t ldy, int M, int N, int K, float *scratch, int threads) {
    Format f;
    if (!gg_format(type, &f) || K % f.bs) return -1;
    const GGRows rows = {f.decode, f.bs, f.bytes, w, row_bytes};
    return gemm_core(x, ldx, NULL, 0, gg_fill, &rows, bias, y, ldy, M, N, K, scratch, threads);
}
