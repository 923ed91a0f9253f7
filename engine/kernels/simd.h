/* The float vector the kernels compute with, in the instruction set the library is built
 * for (engine/kernels/row_kernel.py chooses it from what the CPU reports): sixteen lanes of
 * AVX-512F, or eight of AVX2 with FMA. A kernel written with these is one source for both.
 *
 * LC_BF16 is 1 where a build has bfloat16 kernels: AVX-512 builds with AVX512-BF16, and
 * every AVX2 build (which widens bfloat16 to float32 itself). */
#ifndef LOCALCHAT_SIMD_H
#define LOCALCHAT_SIMD_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LC_AVX512 1
#define VL 16
#ifdef __AVX512BF16__
#define LC_BF16 1
#else
#define LC_BF16 0
#endif
typedef __m512 vf;

static inline __mmask16 vf_mask(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)(0xffffu >> (16 - n)); }
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vf_load_n(const float *p, int n) { return _mm512_maskz_loadu_ps(vf_mask(n), p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline void vf_store_n(float *p, vf v, int n) { _mm512_mask_storeu_ps(p, vf_mask(n), v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline float vf_sum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vf_round(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* p * 2^n for integral n >= -126 */
static inline vf vf_scale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
/* a where a >= 0, else b */
static inline vf vf_select_nonneg(vf a, vf yes, vf no) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GE_OQ), no, yes);
}
static inline int vf_any_nan(vf v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
/* a bit per lane equal to a (lane i: bit i) */
static inline unsigned vf_eq_bits(vf v, float a) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(a), _CMP_EQ_OQ); }
/* n (<= 16) int8 values at p as float lanes, the rest 0 */
static inline vf vf_from_i8(const int8_t *p, int n) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(vf_mask(n), p)));
}

#elif defined(__AVX2__) && defined(__FMA__)
#define LC_AVX512 0
#define VL 8
#define LC_BF16 1
typedef __m256 vf;

/* lanes [0, n) set: eight -1 then eight 0, read from 8 - n */
static const int32_t lc_tail[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
static inline __m256i vf_mask(int n) {
    return _mm256_loadu_si256((const __m256i *)(lc_tail + 8 - (n >= 8 ? 8 : n <= 0 ? 0 : n)));
}
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vf_load_n(const float *p, int n) { return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, vf_mask(n)); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline void vf_store_n(float *p, vf v, int n) { _mm256_maskstore_ps(p, vf_mask(n), v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
/* halves, then pairs, then the last two: one fixed order */
static inline float vf_sum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf vf_round(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_scale2(vf p, vf n) {
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vf vf_select_nonneg(vf a, vf yes, vf no) {
    return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_GE_OQ));
}
static inline int vf_any_nan(vf v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
static inline unsigned vf_eq_bits(vf v, float a) {
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(a), _CMP_EQ_OQ));
}
static inline vf vf_from_i8(const int8_t *p, int n) {
    int64_t b = 0;
    memcpy(&b, p, (size_t)(n >= 8 ? 8 : n <= 0 ? 0 : n));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(b)));
}
#else
#error "the kernels need AVX-512F, or AVX2 with FMA"
#endif

/* e^x for x <= 0 (below -87 it is 0 to float precision), VL at a time: 2^n * p(r) */
static inline vf vf_exp_neg(vf x) {
    x = vf_max(x, vf_set1(-87.3f));
    vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fmadd(p, vf_mul(r, r), vf_add(r, vf_set1(1.f)));
    return vf_scale2(p, n);
}
#endif
