/* Small-batch fp32 linear layers that read their weights in place.
 *
 * At decode sizes (a few dozen rows) a BLAS GEMM spends as long repacking the
 * weight matrix on every call as it does multiplying. Here weights are read
 * once, in their own [N, K] layout, in tiles of NR rows that stay in L1 while
 * every MR-row tile of x (from L2) is multiplied against them (2 x 6 measured
 * best of 3x4, 4x3, 2x4, 2x6, 5x2, 1x8 on AVX2 at 8-64 rows); products are
 * accumulated along K in vector lanes and reduced once per output.
 *
 * Weights come from memory on every step (a model's weights do not fit in
 * cache), so while one tile is multiplied the tile LIN_PF ahead is prefetched
 * into L2, spread over the row steps: without it the hardware prefetcher stops
 * as soon as the current tile stops missing, and each tile's first rows wait
 * on memory (measured +10-15% GFLOP/s at 16-64 rows).
 *
 *   linear_f32      y[M, sum N_s] = x @ [w_0; w_1; ...]^T (+ biases): one or several
 *                   weights sharing the input (q, k and v projections) in one pass.
 *   gated_silu_f32  y[M, N] = silu(x @ wg^T + bg) * (x @ wu^T + bu): a gated MLP's
 *                   gate and up projections, with the activation in the epilogue.
 */
#include "vec.h"

#define LIN_MR 2
#define LIN_NR 6
#define LIN_PF 2
#define MAX_SEGMENTS 8

/* s[i][j] = dot(x row i, weight row j) over K, for mr <= MR rows of x (stride ldx)
 * and nr <= NR weight rows at w[j]. */
static inline __attribute__((always_inline)) void tile_dots(const float* x, int64_t ldx, const float* const* w,
                                                            int64_t K, int mr, int nr, float s[LIN_MR][LIN_NR]) {
  v8f acc[LIN_MR][LIN_NR];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = splat(0.f);
  const int64_t K8 = K & ~(int64_t)7;
  for (int64_t k = 0; k < K8; k += 8) {
    v8f xv[LIN_MR];
    for (int i = 0; i < mr; ++i) xv[i] = load_f32(x + i * ldx + k);
    for (int j = 0; j < nr; ++j) {
      v8f wv = load_f32(w[j] + k);
      KEEP_IN_REGISTER(wv);
      for (int i = 0; i < mr; ++i) acc[i][j] += xv[i] * wv;
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float sum = hsum(acc[i][j]);
      for (int64_t k = K8; k < K; ++k) sum += x[i * ldx + k] * w[j][k];
      s[i][j] = sum;
    }
}

/* Full tiles get a body specialized for MR x NR; edges the generic one. */
static inline void tile_dots_any(const float* x, int64_t ldx, const float* const* w, int64_t K, int mr, int nr,
                                 float s[LIN_MR][LIN_NR]) {
  if (mr == LIN_MR && nr == LIN_NR) tile_dots(x, ldx, w, K, LIN_MR, LIN_NR, s);
  else tile_dots(x, ldx, w, K, mr, nr, s);
}

/* Prefetch part `step` of `steps` of each of nr weight rows of K floats. */
static inline void prefetch_rows(const float* const* rows, int nr, int64_t K, int64_t step, int64_t steps) {
  const int64_t bytes = K * (int64_t)sizeof(float);
  for (int j = 0; j < nr; ++j) prefetch_range(rows[j], bytes * step / steps, bytes * (step + 1) / steps);
}

/* The weights of a linear_f32 call: segments s of n[s] rows each, outputs side by side. */
typedef struct {
  int count;
  const float* const* w;
  const float* const* bias;
  const int64_t* n;
  int64_t K;
} segments;

/* Rows of tile t (NR rows at a time within each segment): fills rows[], the output
 * column and the bias of its first row (NULL if none); returns the row count, 0 past the end. */
static int segment_tile(const segments* sg, int64_t t, const float* rows[LIN_NR], int64_t* col,
                        const float** bias) {
  int64_t first_col = 0;
  for (int s = 0; s < sg->count; ++s) {
    const int64_t tiles = (sg->n[s] + LIN_NR - 1) / LIN_NR;
    if (t < tiles) {
      const int64_t n = t * LIN_NR;
      const int nr = (int)(sg->n[s] - n < LIN_NR ? sg->n[s] - n : LIN_NR);
      for (int j = 0; j < nr; ++j) rows[j] = sg->w[s] + (n + j) * sg->K;
      *col = first_col + n;
      *bias = sg->bias[s] ? sg->bias[s] + n : 0;
      return nr;
    }
    t -= tiles;
    first_col += sg->n[s];
  }
  return 0;
}

void linear_f32(const float* x, int64_t ldx, int count, const float* const* w, const float* const* bias,
                const int64_t* n, float* y, int64_t ldy, int64_t M, int64_t K, int threads) {
  if (count > MAX_SEGMENTS) return;
  const segments sg = {count, w, bias, n, K};
  int64_t tiles = 0;
  for (int s = 0; s < count; ++s) tiles += (n[s] + LIN_NR - 1) / LIN_NR;
  const int64_t steps = (M + LIN_MR - 1) / LIN_MR;
  _Pragma("omp parallel for schedule(static) num_threads(threads)")
  for (int64_t t = 0; t < tiles; ++t) {
    const float *rows[LIN_NR], *next[LIN_NR], *b, *next_b;
    int64_t col, next_col;
    const int nr = segment_tile(&sg, t, rows, &col, &b);
    const int next_nr = segment_tile(&sg, t + LIN_PF, next, &next_col, &next_b);
    for (int64_t step = 0, m = 0; m < M; ++step, m += LIN_MR) {
      const int mr = M - m < LIN_MR ? (int)(M - m) : LIN_MR;
      prefetch_rows(next, next_nr, K, step, steps);
      float s[LIN_MR][LIN_NR];
      tile_dots_any(x + m * ldx, ldx, rows, K, mr, nr, s);
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j) y[(m + i) * ldy + col + j] = b ? s[i][j] + b[j] : s[i][j];
    }
  }
}

/* Gate rows n..n+NR/2 and the matching up rows: the tile's first half gates, second half ups. */
static int gated_tile(const float* wg, const float* wu, int64_t N, int64_t K, int64_t t, const float* rows[LIN_NR]) {
  const int half = LIN_NR / 2;
  const int64_t n = t * half;
  if (n >= N) return 0;
  const int cols = (int)(N - n < half ? N - n : half);
  for (int j = 0; j < cols; ++j) {
    rows[j] = wg + (n + j) * K;
    rows[cols + j] = wu + (n + j) * K;
  }
  return cols;
}

/* silu(g) * u for up to 8 lanes: g / (1 + exp(-g)) * u, as torch computes silu. */
static inline v8f silu_mul8(v8f g, v8f u) { return g / (splat(1.f) + exp8(-g)) * u; }

void gated_silu_f32(const float* x, int64_t ldx, const float* wg, const float* wu, const float* bg,
                    const float* bu, float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
  const int half = LIN_NR / 2;
  const int64_t tiles = (N + half - 1) / half;
  const int64_t steps = (M + LIN_MR - 1) / LIN_MR;
  _Pragma("omp parallel for schedule(static) num_threads(threads)")
  for (int64_t t = 0; t < tiles; ++t) {
    const float *rows[LIN_NR], *next[LIN_NR];
    const int cols = gated_tile(wg, wu, N, K, t, rows);
    const int next_cols = gated_tile(wg, wu, N, K, t + LIN_PF, next);
    const int64_t n = t * half;
    for (int64_t step = 0, m = 0; m < M; ++step, m += LIN_MR) {
      const int mr = M - m < LIN_MR ? (int)(M - m) : LIN_MR;
      prefetch_rows(next, 2 * next_cols, K, step, steps);
      float s[LIN_MR][LIN_NR];
      tile_dots_any(x + m * ldx, ldx, rows, K, mr, 2 * cols, s);
      v8f g = splat(0.f), u = splat(0.f); /* lane i * half + j: row i, column j */
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < cols; ++j) {
          g[i * half + j] = s[i][j] + (bg ? bg[n + j] : 0.f);
          u[i * half + j] = s[i][cols + j] + (bu ? bu[n + j] : 0.f);
        }
      const v8f out = silu_mul8(g, u);
      for (int i = 0; i < mr; ++i)
        for (int j = 0; j < cols; ++j) y[(m + i) * ldy + n + j] = out[i * half + j];
    }
  }
}
