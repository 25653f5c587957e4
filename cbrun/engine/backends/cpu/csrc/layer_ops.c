/* The element-wise parts of a decoder layer, fp32, for the fused layer path
 * (fused_layers.py). In stock modules each is 5-10 small torch ops; at decode
 * sizes their dispatch costs more than the arithmetic.
 *
 *   rmsnorm_f32  out = w * (h * 1/sqrt(mean(h^2) + eps)) per row of D, where
 *                h = x, or h = x + delta (the residual add, stored to sum_out).
 *                Rows may be heads inside token rows (q/k norms).
 *   silu_mul_f32 silu(gate) * up, one pass (gated MLPs at large steps).
 *   rope_f32     rotary embedding in place, rotate-half convention:
 *                out[i] = x[i] cos[i] - x[i + D/2] sin[i], out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2].
 *
 * Products and sums are kept separate, as torch computes them (no fused
 * multiply-add), so rope matches the stock modules bit for bit and rmsnorm up
 * to the order of its sum of squares. */
#include "cbrun_abi.h"
#include "vec.h"

#if defined(__GNUC__) && !defined(__clang__)
#define NO_FMA __attribute__((optimize("fp-contract=off")))
#else
#define NO_FMA /* clang contracts only within one expression: products are separate statements below */
#endif

#define PARALLEL_MIN_ELEMENTS 65536 /* below this one thread is faster than waking two */

static NO_FMA void rmsnorm_row(const float* x, const float* delta, float* sum_out, const float* w, float eps,
                               float* out, int64_t D) {
  const int64_t D8 = D & ~(int64_t)7;
  v8f squares = splat(0.f);
  float tail = 0.f;
  for (int64_t i = 0; i < D8; i += 8) {
    v8f h = load_f32(x + i);
    if (delta) {
      h = h + load_f32(delta + i);
      store_f32(sum_out + i, h);
    }
    v8f sq = h * h;
    squares = squares + sq;
  }
  for (int64_t i = D8; i < D; ++i) {
    float h = delta ? x[i] + delta[i] : x[i];
    if (delta) sum_out[i] = h;
    float sq = h * h;
    tail = tail + sq;
  }
  const float variance = (hsum(squares) + tail) / (float)D;
  const float inv = 1.f / sqrtf(variance + eps);
  const float* h = delta ? sum_out : x;
  for (int64_t i = 0; i < D8; i += 8) {
    v8f normed = load_f32(h + i) * splat(inv);
    store_f32(out + i, load_f32(w + i) * normed);
  }
  for (int64_t i = D8; i < D; ++i) {
    float normed = h[i] * inv;
    out[i] = w[i] * normed;
  }
}

/* Rows (t, j) for t < T, j < heads, at x + t * ldx + j * D (likewise delta, sum_out, out). */
void rmsnorm_f32(const cb_rmsnorm_params* a) {
  const int64_t heads = a->heads, D = a->D;
  const int use = a->T * heads * D >= PARALLEL_MIN_ELEMENTS ? a->threads : 1;
  _Pragma("omp parallel for schedule(static) num_threads(use)")
  for (int64_t r = 0; r < a->T * heads; ++r) {
    const int64_t t = r / heads, j = r % heads;
    const float* delta = a->delta ? a->delta + t * a->ldd + j * D : 0;
    rmsnorm_row(a->x + t * a->ldx + j * D, delta, delta ? a->sum_out + t * a->lds + j * D : 0, a->w, a->eps,
                a->out + t * a->ldo + j * D, D);
  }
}

static NO_FMA void rope_row(float* x, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const v8f x1 = load_f32(x + i), x2 = load_f32(x + half + i);
    const v8f a = x1 * load_f32(c + i);
    const v8f b = x2 * load_f32(s + i);
    const v8f d = x2 * load_f32(c + half + i);
    const v8f e = x1 * load_f32(s + half + i);
    store_f32(x + i, a - b);
    store_f32(x + half + i, d + e);
  }
  for (; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    const float a = x1 * c[i];
    const float b = x2 * s[i];
    const float d = x2 * c[half + i];
    const float e = x1 * s[half + i];
    x[i] = a - b;
    x[half + i] = d + e;
  }
}

/* x: T token rows (stride ldx) of `heads` heads of D; cos/sin [T, D] (stride ldc). */
void rope_f32(float* x, int64_t ldx, int64_t heads, int64_t D, const float* cos, const float* sin, int64_t ldc,
              int64_t T, int threads) {
  const int use = T * heads * D >= PARALLEL_MIN_ELEMENTS ? threads : 1;
  _Pragma("omp parallel for schedule(static) num_threads(use)")
  for (int64_t r = 0; r < T * heads; ++r) {
    const int64_t t = r / heads, j = r % heads;
    rope_row(x + t * ldx + j * D, cos + t * ldc, sin + t * ldc, D / 2);
  }
}

/* out[i] = silu(gate[i]) * up[i] = gate / (1 + exp(-gate)) * up over rows of n (strides ldg, ldu, ldo):
 * the activation of a gated MLP whose projections ran as separate GEMMs (large steps). */
void silu_mul_f32(const float* gate, int64_t ldg, const float* up, int64_t ldu, float* out, int64_t ldo, int64_t T,
                  int64_t n, int threads) {
  const int use = T * n >= PARALLEL_MIN_ELEMENTS ? threads : 1;
  const int64_t n8 = n & ~(int64_t)7;
  _Pragma("omp parallel for schedule(static) num_threads(use)")
  for (int64_t t = 0; t < T; ++t) {
    const float *g = gate + t * ldg, *u = up + t * ldu;
    float* o = out + t * ldo;
    for (int64_t i = 0; i < n8; i += 8) {
      const v8f x = load_f32(g + i);
      store_f32(o + i, x / (splat(1.f) + exp8(-x)) * load_f32(u + i));
    }
    for (int64_t i = n8; i < n; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
}
