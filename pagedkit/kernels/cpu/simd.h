/* Row helpers of the CPU attention kernel (paged_attention.c): 16-bit float conversions rounding to nearest even
 * (as onnxruntime's Cast and torch's .to()), float32 dot / axpy, exp, max and sum over rows. AVX-512 where the
 * compiler targets it, AVX2 + F16C + FMA next, plain C otherwise; the element kinds are 0 = float32,
 * 1 = float16, 2 = bfloat16. */
#ifndef PAGEDKIT_CPU_SIMD_H
#define PAGEDKIT_CPU_SIMD_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float b2f(uint16_t b) { uint32_t x = (uint32_t)b << 16; float f; memcpy(&f, &x, 4); return f; }
static inline uint16_t f2b(float f) {
  uint32_t x; memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);  /* NaN stays NaN */
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}
#if defined(__FLT16_MAX__)
static inline float h2f(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline uint16_t f2h(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }
#else
static inline float h2f(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (e == 0) {
    float f = (float)man * 5.9604644775390625e-08f;  /* subnormal: man * 2^-24 */
    memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (e == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((e + 112) << 23) | (man << 13);
  }
  float f; memcpy(&f, &bits, 4); return f;
}
static inline uint16_t f2h(float f) {
  uint32_t x; memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00);
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);  /* rounds to 65520 or more: inf */
  if (ax < 0x38800000u) {  /* a subnormal half: round x * 2^24 to an integer, to nearest even */
    float a; memcpy(&a, &ax, 4);
    return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f));
  }
  return (uint16_t)(sign | ((ax + 0xc8000fffu + ((ax >> 13) & 1)) >> 13));
}
#endif
static inline float load1(const void* p, size_t i, int kind) {
  if (kind == 0) return ((const float*)p)[i];
  return kind == 1 ? h2f(((const uint16_t*)p)[i]) : b2f(((const uint16_t*)p)[i]);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
static inline vf v_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void v_store(float* p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_set(float x) { return _mm512_set1_ps(x); }
static inline vf v_zero(void) { return _mm512_setzero_ps(); }
static inline float v_sum(vf x) { return _mm512_reduce_add_ps(x); }
static inline vf v_wide(const uint16_t* p, int kind) {
  __m256i x = _mm256_loadu_si256((const __m256i*)p);
  if (kind == 1) return _mm512_cvtph_ps(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
static inline void v_narrow(uint16_t* p, vf x, int kind) {
  if (kind == 1) {
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return;
  }
  __m512i b = _mm512_castps_si512(x);
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                   _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, b, _mm512_set1_epi32(0x400000));  /* NaN: quiet, not rounded */
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define VW 8
typedef __m256 vf;
static inline vf v_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void v_store(float* p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_set(float x) { return _mm256_set1_ps(x); }
static inline vf v_zero(void) { return _mm256_setzero_ps(); }
static inline float v_sum(vf x) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}
static inline vf v_wide(const uint16_t* p, int kind) {
  __m128i x = _mm_loadu_si128((const __m128i*)p);
  if (kind == 1) return _mm256_cvtph_ps(x);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
static inline void v_narrow(uint16_t* p, vf x, int kind) {
  if (kind == 1) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return;
  }
  float t[8];
  _mm256_storeu_ps(t, x);
  for (int i = 0; i < 8; i++) p[i] = f2b(t[i]);
}
#else
#define VW 0
#endif

/* dst[0:n] = src[off:off+n] as float32 */
static void to_f32(float* dst, const void* src, size_t off, size_t n, int kind) {
  if (kind == 0) { memcpy(dst, (const float*)src + off, n * sizeof(float)); return; }
  const uint16_t* s = (const uint16_t*)src + off;
  size_t i = 0;
#if VW
  for (; i + VW <= n; i += VW) v_store(dst + i, v_wide(s + i, kind));
#endif
  for (; i < n; i++) dst[i] = kind == 1 ? h2f(s[i]) : b2f(s[i]);
}
/* dst[off:off+n] = src[0:n] in `kind`, rounded to nearest even */
static void from_f32(void* dst, size_t off, const float* src, size_t n, int kind) {
  if (kind == 0) { memcpy((float*)dst + off, src, n * sizeof(float)); return; }
  uint16_t* d = (uint16_t*)dst + off;
  size_t i = 0;
#if VW
  for (; i + VW <= n; i += VW) v_narrow(d + i, v_load(src + i), kind);
#endif
  for (; i < n; i++) d[i] = kind == 1 ? f2h(src[i]) : f2b(src[i]);
}
/* x rounded to `kind` and back (what a Cast to it and back does) */
static void round_row(float* x, size_t n, int kind) {
  if (kind == 0) return;
  size_t i = 0;
#if VW
  uint16_t t[VW];
  for (; i + VW <= n; i += VW) { v_narrow(t, v_load(x + i), kind); v_store(x + i, v_wide(t, kind)); }
#endif
  for (; i < n; i++) x[i] = kind == 1 ? h2f(f2h(x[i])) : b2f(f2b(x[i]));
}
static inline float dot_ff(const float* a, const float* b, int n) {
  int i = 0;
  float s = 0.f;
#if VW
  vf acc = v_zero();
  for (; i + VW <= n; i += VW) acc = v_fma(v_load(a + i), v_load(b + i), acc);
  s = v_sum(acc);
#endif
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}
static inline void axpy_ff(float* o, float p, const float* b, int n) {
  int i = 0;
#if VW
  vf pp = v_set(p);
  for (; i + VW <= n; i += VW) v_store(o + i, v_fma(pp, v_load(b + i), v_load(o + i)));
#endif
  for (; i < n; i++) o[i] += p * b[i];
}

/* A KV group's attention with its G query heads in registers (AVX-512, 16-bit caches, D a multiple of 16, G <= 6):
 * qk_group: scores[h * n + i] = dot(q_h, K row i) * scale; pv_group: acc[h * D + d] = sum_i p[h * n + i] V[i, d].
 * Each sum runs in the order dot_ff / axpy_ff use (16-lane FMAs over d, then the lane sum; keys in order), so the
 * results are those of the generic loops, bit for bit; what changes is that a K / V row is widened once into
 * registers and the accumulators never leave them. Specialized per G (a constant after inlining). */
#if defined(__AVX512F__)
#define GROUP_MAX 6
static inline int group_fast(int G, int D, int kind) { return kind != 0 && G >= 1 && G <= GROUP_MAX && D % 16 == 0; }
static inline __attribute__((always_inline)) void qk_g(float* scores, const float* q, const uint16_t* cache,
                                                      const int64_t* rows, int64_t n, const int G, int D, int kind,
                                                      float scale) {
  for (int64_t i = 0; i < n; i++) {
    const uint16_t* kr = cache + (size_t)rows[i] * D;
    __m512 s[GROUP_MAX];
    for (int h = 0; h < G; h++) s[h] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
      __m512 k = v_wide(kr + d, kind);
      for (int h = 0; h < G; h++) s[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)h * D + d), k, s[h]);
    }
    for (int h = 0; h < G; h++) scores[(size_t)h * n + i] = _mm512_reduce_add_ps(s[h]) * scale;
  }
}
/* d in chunks of W vectors (4, then 1 for the rest): acc[h][w] stays in registers over every key */
#define PV_CHUNK(W)                                                                                         \
  for (; d + 16 * (W) <= D; d += 16 * (W)) {                                                                \
    __m512 a[GROUP_MAX][W];                                                                                 \
    for (int h = 0; h < G; h++)                                                                             \
      for (int w = 0; w < (W); w++) a[h][w] = _mm512_setzero_ps();                                          \
    for (int64_t i = 0; i < n; i++) {                                                                       \
      const uint16_t* vr = cache + (size_t)rows[i] * D + d;                                                 \
      __m512 v[W];                                                                                          \
      for (int w = 0; w < (W); w++) v[w] = v_wide(vr + 16 * w, kind);                                       \
      for (int h = 0; h < G; h++) {                                                                         \
        __m512 p = _mm512_set1_ps(p_[(size_t)h * n + i]);                                                   \
        for (int w = 0; w < (W); w++) a[h][w] = _mm512_fmadd_ps(p, v[w], a[h][w]);                          \
      }                                                                                                     \
    }                                                                                                       \
    for (int h = 0; h < G; h++)                                                                             \
      for (int w = 0; w < (W); w++) _mm512_storeu_ps(acc + (size_t)h * D + d + 16 * w, a[h][w]);            \
  }
static inline __attribute__((always_inline)) void pv_g(float* acc, const float* p_, const uint16_t* cache,
                                                      const int64_t* rows, int64_t n, const int G, int D, int kind) {
  int d = 0;
  PV_CHUNK(4)
  PV_CHUNK(1)
}
#define GROUP_SWITCH(CALL)                                                                                  \
  switch (G) {                                                                                              \
    case 1: CALL(1); break;                                                                                 \
    case 2: CALL(2); break;                                                                                 \
    case 3: CALL(3); break;                                                                                 \
    case 4: CALL(4); break;                                                                                 \
    case 5: CALL(5); break;                                                                                 \
    default: CALL(6); break;                                                                                \
  }
static void qk_group(float* scores, const float* q, const uint16_t* cache, const int64_t* rows, int64_t n, int G,
                     int D, int kind, float scale) {
#define QK_CALL(g) qk_g(scores, q, cache, rows, n, g, D, kind, scale)
  GROUP_SWITCH(QK_CALL)
#undef QK_CALL
}
static void pv_group(float* acc, const float* p, const uint16_t* cache, const int64_t* rows, int64_t n, int G, int D,
                     int kind) {
#define PV_CALL(g) pv_g(acc, p, cache, rows, n, g, D, kind)
  GROUP_SWITCH(PV_CALL)
#undef PV_CALL
}
#else
static inline int group_fast(int G, int D, int kind) { (void)G; (void)D; (void)kind; return 0; }
static void qk_group(float* scores, const float* q, const uint16_t* cache, const int64_t* rows, int64_t n, int G,
                     int D, int kind, float scale) {
  (void)scores; (void)q; (void)cache; (void)rows; (void)n; (void)G; (void)D; (void)kind; (void)scale;
}
static void pv_group(float* acc, const float* p, const uint16_t* cache, const int64_t* rows, int64_t n, int G, int D,
                     int kind) {
  (void)acc; (void)p; (void)cache; (void)rows; (void)n; (void)G; (void)D; (void)kind;
}
#endif

#if defined(__AVX512F__)
/* exp(x), |relative error| < 2e-7 (range reduction by ln 2 in two parts, degree-6 polynomial); x < -87.3: 0 */
static inline __m512 v_exp(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.3f);
  __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
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
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512 e = _mm512_scalef_ps(p, n);
  return _mm512_mask_mov_ps(e, under, _mm512_setzero_ps());
}
#endif
/* x = exp(x - m) over n values; returns their sum */
static float exp_sum(float* x, size_t n, float m) {
  size_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps(), mm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    __m512 e = v_exp(_mm512_sub_ps(_mm512_loadu_ps(x + i), mm));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    __m512 e = v_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mm));
    _mm512_mask_storeu_ps(x + i, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
    i = n;
  }
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; i++) { x[i] = expf(x[i] - m); s += x[i]; }
  return s;
}
static float max_of(const float* x, size_t n) {
  float m = -INFINITY;
  for (size_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}
static void scale_row(float* x, size_t n, float s) {
  size_t i = 0;
#if VW
  vf ss = v_set(s);
  for (; i + VW <= n; i += VW) v_store(x + i, v_mul(v_load(x + i), ss));
#endif
  for (; i < n; i++) x[i] *= s;
}
#endif
