/* AdamW over flat fp32 buffers in one pass, with 2BW's prediction in the same pass (CPU).
 *
 * Built on first use by optim/native.py (a C compiler, no torch headers) and called through
 * ctypes; the arithmetic and every coefficient are documented in optim/native.py. Compile with
 * -ffp-contract=off and without -ffast-math: each operation rounds to fp32 as written, the same
 * in the vector loop and its scalar tail, so a call over [0, n) equals calls over any split of
 * it bit for bit, and `predict` recomputes exactly what `step` wrote into `pred`.
 *
 * k[] (fp32 coefficients): 0 = 1 - b1, 1 = b2, 2 = 1 - b2, 3 = eps * sqrt(bias2), 4 = 1 - lr * wd,
 * 5 = -lr * sqrt(bias2) / bias1, 6 = the spike's -lr * (1 - b1) * sqrt(bias2) / bias1,
 * 7 = the prediction's 1 - lr' * wd, 8 = the prediction's -lr' * sqrt(bias2) / bias1.
 * kind: 0 no prediction, 1 fp32, 2 bf16 (round to nearest even, NaN stays NaN).
 */
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif
#define INLINE static inline __attribute__((always_inline))

INLINE uint16_t to_bf16(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  uint32_t nan = (b >> 16) | 0x40u;
  return (uint16_t)(((b & 0x7fffffffu) > 0x7f800000u) ? nan : rounded);
}

INLINE void put(void *out, int kind, int64_t i, float x) {
  if (kind == 1)
    ((float *)out)[i] = x;
  else if (kind == 2)
    ((uint16_t *)out)[i] = to_bf16(x);
}

/* p: the weights after the step (spike included); mi, ds: the moment and denominator */
INLINE float predicted(float p, float mi, float gi, float ds, const float *k, int nesterov) {
  float mn = nesterov ? mi + (gi - mi) * k[0] : mi;
  return p * k[7] + (mn / ds) * k[8];
}

INLINE void step_body(const float *src, float *dst, const float *restrict g,
                      float *restrict m, float *restrict v, float *restrict keep,
                      void *restrict pred, const float *restrict k, int64_t n, const int kind,
                      const int spike, const int nesterov, const int keeping) {
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i];
    float mi = m[i] + (gi - m[i]) * k[0];
    float vi = v[i] * k[1] + (gi * gi) * k[2];
    float ds = __builtin_sqrtf(vi) + k[3];
    float p = src[i] * k[4] + (mi / ds) * k[5];
    if (spike) p = p + ((gi - mi) / ds) * k[6];
    m[i] = mi;
    v[i] = vi;
    dst[i] = p;
    if (keeping) keep[i] = gi;
    if (kind) put(pred, kind, i, predicted(p, mi, gi, ds, k, nesterov));
  }
}

INLINE void predict_body(float *restrict src, const float *restrict g, const float *restrict m,
                         const float *restrict v, const float *restrict last,
                         void *restrict pred, const float *restrict k, int64_t n,
                         const int kind, const int spike, const int nesterov) {
  for (int64_t i = 0; i < n; i++) {
    float mi = m[i];
    float ds = __builtin_sqrtf(v[i]) + k[3];
    float p = src[i];
    if (spike) {
      p = p + ((g[i] - mi) / ds) * k[6];
      src[i] = p;
    }
    put(pred, kind, i, predicted(p, mi, nesterov ? last[i] : 0.0f, ds, k, nesterov));
  }
}

/* dst = the step of src (dst may be src); keep (nullable): receives g; pred (kind > 0): the
 * prediction made from the new state. spike/nesterov: 0 or 1. */
CLONES void m2bw_adamw_step(const float *src, float *dst, const float *g, float *m, float *v,
                            float *keep, void *pred, int kind, const float *k, int spike,
                            int nesterov, int64_t n) {
  int keeping = keep != 0;
#define STEP(K, S, N, KP)                                                       \
  if (kind == K && spike == S && nesterov == N && keeping == KP) {              \
    step_body(src, dst, g, m, v, keep, pred, k, n, K, S, N, KP);                \
    return;                                                                     \
  }
#define STEPS(K)                                                                \
  STEP(K, 0, 0, 0) STEP(K, 0, 0, 1) STEP(K, 1, 0, 0) STEP(K, 1, 0, 1)           \
  STEP(K, 0, 1, 0) STEP(K, 0, 1, 1) STEP(K, 1, 1, 0) STEP(K, 1, 1, 1)
  STEPS(0) STEPS(1) STEPS(2)
#undef STEPS
#undef STEP
}

/* pred = the prediction from the current state; spike: first src += the spike (written back). */
CLONES void m2bw_adamw_predict(float *src, const float *g, const float *m, const float *v,
                               const float *last, void *pred, int kind, const float *k,
                               int spike, int nesterov, int64_t n) {
#define PRED(K, S, N)                                                           \
  if (kind == K && spike == S && nesterov == N) {                               \
    predict_body(src, g, m, v, last, pred, k, n, K, S, N);                      \
    return;                                                                     \
  }
  PRED(1, 0, 0) PRED(1, 1, 0) PRED(1, 0, 1) PRED(1, 1, 1)
  PRED(2, 0, 0) PRED(2, 1, 0) PRED(2, 0, 1) PRED(2, 1, 1)
#undef PRED
}
