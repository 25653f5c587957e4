/* fp32 linear layers that read their weights in place: y = x @ W^T.
 *
 * A BLAS GEMM repacks the weight matrix on every call; at a few dozen rows
 * that costs as much as the multiply, and even at hundreds of rows MKL's fp32
 * GEMM reaches 40-85 GFLOP/s at 16-64 rows on the decoder's shapes here
 * (2 x AVX2 cores, ~195 peak). Here the weights stay in their [N, K] layout and are read
 * once per call, in tiles of NR = 6 rows that stay in L1 while every row of x
 * is multiplied against them. x is the small operand, so it is the one packed:
 *
 *   - Full panels of 16 rows of x are copied k-major (xp[p][k][16]); a panel
 *     times a weight tile is an outer-product kernel: per k, two vector loads of
 *     x, six broadcasts of weights, twelve FMAs into a 6 x 16 register block,
 *     and no reduction at the end. With one tile in cache it runs at 166-195
 *     GFLOP/s against 117-140 for the dot-product kernel below; streaming all
 *     30 layers' weights of the default model it gains 5-20% over that kernel
 *     at 16-64 rows (measured, same runs), and is level with MKL from ~256.
 *   - The rows left over (M mod 16, or all of them below 16 rows) go through a
 *     dot-product kernel on the same L1-resident tile: 2 rows x 6 weights of
 *     vector partial sums along K, reduced once per output (padding them into a
 *     panel would waste up to 15/16 of the work).
 *
 * Weights come from memory on every call (a model's weights do not fit in
 * cache), so while a tile's first row step runs, the tile LIN_PF ahead is
 * prefetched into L2 a line at a time (see prefetch_line).
 *
 * Edge tiles repeat their last weight row (the extra outputs are not stored),
 * so every tile runs the full-width kernels.
 *
 *   linear_f32      y[M, sum N_s] = x @ [w_0; w_1; ...]^T (+ biases): one or several
 *                   weights sharing the input (q, k and v projections) in one pass.
 *   gated_silu_f32  y[M, N] = silu(x @ wg^T + bg) * (x @ wu^T + bu): a gated MLP's
 *                   gate and up projections, with the activation in the epilogue.
 *
 * Both take `xp`, scratch for (M / 16) * 16 * K floats (the packed panels).
 */
#include "vec.h"
#include "panel.h"

#define LIN_MR 2     /* rows of x per dot-product step */
#define LIN_PF 2     /* tiles ahead to prefetch */
#define MAX_SEGMENTS 8

/* s[i][j] = dot(x row i, weight row j) over K, for mr <= MR rows of x (stride ldx). */
static inline __attribute__((always_inline)) void pair_dots(const float* x, int64_t ldx, const float* const* w,
                                                            const float* const* ahead, int64_t K, int mr,
                                                            float s[LIN_MR][TILE_NR]) {
  v8f acc[LIN_MR][TILE_NR];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < TILE_NR; ++j) acc[i][j] = splat(0.f);
  const int64_t K8 = K & ~(int64_t)7;
  for (int64_t k = 0; k < K8; k += 8) {
    if (ahead && (k & 15) == 0) prefetch_line(ahead, k);
    v8f xv[LIN_MR];
    for (int i = 0; i < mr; ++i) xv[i] = load_f32(x + i * ldx + k);
    for (int j = 0; j < TILE_NR; ++j) {
      v8f wv = load_f32(w[j] + k);
      KEEP_IN_REGISTER(wv);
      for (int i = 0; i < mr; ++i) acc[i][j] += xv[i] * wv;
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < TILE_NR; ++j) {
      float sum = hsum(acc[i][j]);
      for (int64_t k = K8; k < K; ++k) sum += x[i * ldx + k] * w[j][k];
      s[i][j] = sum;
    }
}

/* Copy rows [0, panels * PANEL) of x into k-major panels, this thread's share (every threads-th panel). */
static void pack_panels(const float* x, int64_t ldx, int64_t panels, int64_t K, float* xp, int thread,
                        int threads) {
  for (int64_t p = thread; p < panels; p += threads) {
    const float* src = x + p * PANEL * ldx;
    float* dst = xp + p * PANEL * K;
    for (int64_t k0 = 0; k0 < K; k0 += 64) { /* blocks of 64 columns: 16 source lines stay in L1 */
      const int64_t k1 = k0 + 64 < K ? k0 + 64 : K;
      for (int i = 0; i < PANEL; ++i)
        for (int64_t k = k0; k < k1; ++k) dst[k * PANEL + i] = src[i * ldx + k];
    }
  }
}

/* Where one weight tile's products go: `cols` columns of y from `col` on, with their biases (NULL if
 * none; `up_bias` only for gated tiles). */
typedef struct {
  float* y;
  int64_t ldy, col;
  int cols;
  const float *bias, *up_bias;
} tile_target;

/* Fills rows[] with weight tile t's NR rows (rows[0] NULL past the end) and *target with its outputs. */
typedef void (*tile_fn)(const void* call, int64_t t, const float* rows[TILE_NR], tile_target* target);

/* Stores rows m..m+count of a tile's products out[j][i] (i < count) at its target. */
typedef void (*emit_fn)(const tile_target* target, int64_t m, int count, tile_block out);

/* One weight tile against every row of x (panels from xp, then the rest in pairs), handing each block to emit. */
static inline __attribute__((always_inline)) void tile_times_x(const float* x, int64_t ldx, const float* xp,
                                                               int64_t M, int64_t K, const float* const* rows,
                                                               const float* const* next, emit_fn emit,
                                                               const tile_target* target) {
  const int64_t panels = M / PANEL, packed = panels * PANEL;
  tile_block out = {{0}};
  for (int64_t p = 0; p < panels; ++p) {
    panel_dots(xp + p * PANEL * K, rows, p == 0 ? next : 0, K, out);
    emit(target, p * PANEL, PANEL, out);
  }
  for (int64_t m = packed; m < M; m += LIN_MR) {
    const float* const* ahead = m == 0 ? next : 0;
    float s[LIN_MR][TILE_NR];
    const int mr = M - m < LIN_MR ? (int)(M - m) : LIN_MR;
    if (mr == LIN_MR) pair_dots(x + m * ldx, ldx, rows, ahead, K, LIN_MR, s); /* constant mr: in registers */
    else pair_dots(x + m * ldx, ldx, rows, ahead, K, 1, s);
    for (int i = 0; i < mr; ++i)
      for (int j = 0; j < TILE_NR; ++j) out[j][i] = s[i][j];
    emit(target, m, mr, out);
  }
}

/* Both entry points: pack x's panels (threads share the work), then split the weight tiles between
 * the threads, each tile against all of x while the tile LIN_PF ahead is prefetched. */
static inline __attribute__((always_inline)) void run_tiles(const float* x, int64_t ldx, int64_t M, int64_t K,
                                                            float* xp, int threads, int64_t tiles,
                                                            const void* call, tile_fn tile_rows, emit_fn emit) {
  _Pragma("omp parallel num_threads(threads)") {
    pack_panels(x, ldx, M / PANEL, K, xp, omp_get_thread_num(), omp_get_num_threads());
    _Pragma("omp barrier")
    _Pragma("omp for schedule(static)")
    for (int64_t t = 0; t < tiles; ++t) {
      const float *rows[TILE_NR], *next[TILE_NR];
      tile_target target, unused;
      tile_rows(call, t, rows, &target);
      tile_rows(call, t + LIN_PF, next, &unused);
      tile_times_x(x, ldx, xp, M, K, rows, next[0] ? next : 0, emit, &target);
    }
  }
}

/* The weights of a linear_f32 call: segments s of n[s] rows each, outputs side by side. */
typedef struct {
  int count;
  const float* const* w;
  const float* const* bias;
  const int64_t* n;
  int64_t K;
  float* y;
  int64_t ldy;
} linear_call;

/* Tile t takes NR rows at a time within each segment; a short tile repeats its last row. */
static void segment_tile(const void* call, int64_t t, const float* rows[TILE_NR], tile_target* target) {
  const linear_call* c = call;
  int64_t first_col = 0;
  for (int s = 0; s < c->count; ++s) {
    const int64_t tiles = (c->n[s] + TILE_NR - 1) / TILE_NR;
    if (t < tiles) {
      const int64_t n = t * TILE_NR;
      const int nr = (int)(c->n[s] - n < TILE_NR ? c->n[s] - n : TILE_NR);
      for (int j = 0; j < TILE_NR; ++j) rows[j] = c->w[s] + (n + (j < nr ? j : nr - 1)) * c->K;
      *target = (tile_target){c->y, c->ldy, first_col + n, nr, c->bias[s] ? c->bias[s] + n : 0, 0};
      return;
    }
    t -= tiles;
    first_col += c->n[s];
  }
  rows[0] = 0;
}

static void emit_linear(const tile_target* target, int64_t m, int count, tile_block out) {
  const float* b = target->bias;
  for (int i = 0; i < count; ++i) {
    float* y = target->y + (m + i) * target->ldy + target->col;
    for (int j = 0; j < target->cols; ++j) y[j] = b ? out[j][i] + b[j] : out[j][i];
  }
}

void linear_f32(const float* x, int64_t ldx, int count, const float* const* w, const float* const* bias,
                const int64_t* n, float* y, int64_t ldy, int64_t M, int64_t K, float* xp, int threads) {
  if (count > MAX_SEGMENTS) return;
  const linear_call c = {count, w, bias, n, K, y, ldy};
  int64_t tiles = 0;
  for (int s = 0; s < count; ++s) tiles += (n[s] + TILE_NR - 1) / TILE_NR;
  run_tiles(x, ldx, M, K, xp, threads, tiles, &c, segment_tile, emit_linear);
}

/* The weights of a gated_silu_f32 call. */
typedef struct {
  const float *wg, *wu, *bg, *bu;
  int64_t N, K;
  float* y;
  int64_t ldy;
} gated_call;

#define GATED_COLS (TILE_NR / 2) /* a tile holds gate rows n.. in its first half, the matching up rows in its second */

/* Gate rows n..n+GATED_COLS of tile t and the matching up rows; a short tile repeats its last pair. */
static void gated_tile(const void* call, int64_t t, const float* rows[TILE_NR], tile_target* target) {
  const gated_call* c = call;
  const int64_t n = t * GATED_COLS;
  if (n >= c->N) {
    rows[0] = 0;
    return;
  }
  const int cols = (int)(c->N - n < GATED_COLS ? c->N - n : GATED_COLS);
  for (int j = 0; j < GATED_COLS; ++j) {
    const int64_t row = n + (j < cols ? j : cols - 1);
    rows[j] = c->wg + row * c->K;
    rows[GATED_COLS + j] = c->wu + row * c->K;
  }
  *target = (tile_target){c->y, c->ldy, n, cols, c->bg ? c->bg + n : 0, c->bu ? c->bu + n : 0};
}

/* silu(g) * u for 8 lanes: g / (1 + exp(-g)) * u, as torch computes silu. */
static inline v8f silu_mul8(v8f g, v8f u) { return g / (splat(1.f) + exp8(-g)) * u; }

static void emit_gated(const tile_target* target, int64_t m, int count, tile_block out) {
  for (int j = 0; j < target->cols; ++j)
    for (int half = 0; half < PANEL; half += 8) {
      const v8f g = load_f32(out[j] + half) + splat(target->bias ? target->bias[j] : 0.f);
      const v8f u = load_f32(out[GATED_COLS + j] + half) + splat(target->up_bias ? target->up_bias[j] : 0.f);
      store_f32(out[j] + half, silu_mul8(g, u));
    }
  for (int i = 0; i < count; ++i)
    for (int j = 0; j < target->cols; ++j) target->y[(m + i) * target->ldy + target->col + j] = out[j][i];
}

void gated_silu_f32(const float* x, int64_t ldx, const float* wg, const float* wu, const float* bg,
                    const float* bu, float* y, int64_t ldy, int64_t M, int64_t N, int64_t K, float* xp,
                    int threads) {
  const gated_call c = {wg, wu, bg, bu, N, K, y, ldy};
  run_tiles(x, ldx, M, K, xp, threads, (N + GATED_COLS - 1) / GATED_COLS, &c, gated_tile, emit_gated);
}
