/* Linear layers that read their weights in place, y = x @ W^T, with one
 * reduction order for every row count (batch invariance).
 *
 * Every output y[i][n] is one fp32 multiply-add chain over k = 0 .. K-1, in
 * that order, started from zero; the bias is added after it, and bf16 outputs
 * are rounded once at the end. Nothing else about a call (how many rows it
 * has, which panel or lane a row lands in, how the rows are blocked, how many
 * threads run it) changes that chain, so a row gives the same bits alone or
 * among a thousand others. That is why we own this kernel: BLAS GEMMs choose
 * their blocking over K by the shape of the call (and MKL and oneDNN switch
 * kernels with M), so a request's numbers would depend on its neighbours.
 *
 * The weights stay in their [N, K] layout (fp32 or bf16) and are read once
 * per block of rows, in tiles of TILE_NR rows (6, or 10 with AVX-512: panel.h)
 * that stay in L1 (bf16 tiles are widened to fp32 into a per-thread buffer
 * first, which is exact). x is the small operand, so it is the one packed:
 * copied k-major into panels of 16 rows (xp[p][k][16], bf16 widened), the last
 * panel padded with zero rows. A step of rows times a weight tile is the
 * outer-product kernel of panel.h: per k, the lanes of two vectors of VEC lanes
 * (vec.h: 16 with AVX-512, else 8) are STEP = 2 * VEC rows, one panel or two,
 * each lane its own chain. A step holding at most VEC real rows runs only its
 * first vector (the lanes are independent, so nothing changes for the rows it
 * holds). Neither the width nor the step changes a chain, so every width
 * gives the same bits. Rows are taken in blocks of at most BLOCK_BYTES of
 * packed x, so the panels of a block stay in L2 while every weight tile
 * passes them. Where K is long (an 8B model's 14336-wide down projection),
 * K is taken in steps that depend on K alone: a tile's slice of one step
 * passes every panel of the block, and each output's sum is carried in fp32
 * to the next step, so the chain is still the one above.
 *
 * Weights come from memory on every call (a model's weights do not fit in
 * cache), so while a tile's first step runs, the tile LIN_PF ahead is
 * prefetched into L2 a line at a time (see prefetch_line).
 *
 * Edge tiles repeat their last weight row (the extra outputs are not stored),
 * so every tile runs the full-width kernel.
 *
 *   linear_rows    y[M, sum N_s] = x @ [w_0; w_1; ...]^T (+ biases): one or several
 *                  weights sharing the input (q, k and v projections) in one pass.
 *   gated_silu     y[M, N] = silu(x @ wg^T + bg) * (x @ wu^T + bu): a gated MLP's
 *                  gate and up projections, with the activation in the epilogue.
 *
 * Both take one cb_dense_params (cbrun_abi.h: the shapes). Element types are
 * flags: x, the weights (with their biases) and y are each fp32 or bf16. Both
 * take `xp`, scratch for ceil(M / 16) * 16 * K floats. Both return CB_OK,
 * CB_BAD_ARGS for arguments they cannot handle (nothing written), or
 * CB_NO_MEMORY.
 */
#include <stdlib.h>

#include "cbrun_abi.h"
#include "panel.h"
#include "vec.h"

#define LIN_PF 2               /* tiles ahead to prefetch */
#define MAX_SEGMENTS 8         /* weights in one linear_rows call */
#define BLOCK_BYTES (384 << 10) /* packed x per row block (one K step of it): stays in L2 while the weight tiles pass */
#ifndef LIN_K_STEP
#define LIN_K_STEP 1024 /* floats of k per step at most: a tile's slice (TILE_NR x 4 KiB at most) stays in L1/L2 */
#endif

static inline float bf16_to_f32(uint16_t h) {
  union { uint32_t u; float f; } c;
  c.u = (uint32_t)h << 16;
  return c.f;
}

/* Element i of a row of fp32 (bf16 == 0) or bf16 values. */
static inline float element(const void* row, int64_t i, int bf16) {
  return bf16 ? bf16_to_f32(((const uint16_t*)row)[i]) : ((const float*)row)[i];
}

/* Copy rows of x into k-major panels (the rows past M are zeros), this thread's share (every threads-th panel). */
static void pack_panels(const void* x, int64_t ldx, int x_bf16, int64_t M, int64_t K, float* xp, int thread,
                        int threads) {
  const int64_t panels = (M + PANEL - 1) / PANEL;
  const size_t elem = x_bf16 ? 2 : 4;
  for (int64_t p = thread; p < panels; p += threads) {
    float* dst = xp + p * PANEL * K;
    const int64_t real = M - p * PANEL < PANEL ? M - p * PANEL : PANEL;
    for (int64_t k0 = 0; k0 < K; k0 += 64) { /* blocks of 64 columns: 16 source lines stay in L1 */
      const int64_t k1 = k0 + 64 < K ? k0 + 64 : K;
      for (int i = 0; i < PANEL; ++i) {
        const char* src = (const char*)x + (p * PANEL + i) * ldx * elem;
        for (int64_t k = k0; k < k1; ++k) dst[k * PANEL + i] = i < real ? element(src, k, x_bf16) : 0.f;
      }
    }
  }
}

/* Where one weight tile's products go: `cols` columns of y from `col` on, with their biases (NULL if
 * none; `up_bias` only for gated tiles). */
typedef struct {
  void* y;
  int64_t ldy, col;
  int cols, y_bf16, bias_bf16;
  const void *bias, *up_bias;
} tile_target;

/* Fills rows[] with weight tile t's NR rows (rows[0] NULL past the end) and *target with its outputs. */
typedef void (*tile_fn)(const void* call, int64_t t, const void* rows[TILE_NR], tile_target* target);

/* Stores rows m..m+count of a tile's products out[j][i] (i < count) at its target. */
typedef void (*emit_fn)(const tile_target* target, int64_t m, int count, tile_block out);

static inline void store_output(const tile_target* target, int64_t row, int j, float value) {
  const int64_t at = row * target->ldy + target->col + j;
  if (target->y_bf16) ((uint16_t*)target->y)[at] = f32_to_bf16(value);
  else ((float*)target->y)[at] = value;
}

/* The tile's rows as fp32: the weights themselves, or (bf16) widened into `buffer` [TILE_NR][K]. */
static inline void tile_as_f32(const void* const* rows, int w_bf16, int64_t K, float* buffer,
                               const float* out[TILE_NR]) {
  for (int j = 0; j < TILE_NR; ++j) {
    if (!w_bf16) {
      out[j] = rows[j];
      continue;
    }
    const uint16_t* src = rows[j];
    float* dst = buffer + j * K;
    int64_t k = 0;
    for (; k + VEC <= K; k += VEC) storeN_f32(dst + k, loadN_bf16(src + k));
    for (; k < K; ++k) dst[k] = bf16_to_f32(src[k]);
    out[j] = dst;
  }
}

/* One weight tile against the panels [p0, p1) of x, a step (STEP_PANELS panels) at a time, handing each
 * block of products to emit. With K longer than one K step (lin_k_step: a function of K alone), the tile's
 * rows are taken a K step at a time over every step of panels (that slice of the tile stays in L1 while the
 * panels pass), each step's sums carried in `sums` [steps of the block] between K steps. */
static inline __attribute__((always_inline)) void tile_times_panels(const float* xp, int64_t p0, int64_t p1,
                                                                    int64_t M, int64_t K, int64_t k_step,
                                                                    const float* const* w,
                                                                    const float* const* next, emit_fn emit,
                                                                    const tile_target* target, tile_block* sums) {
  for (int64_t k0 = 0; k0 < K; k0 += k_step) {
    const int64_t k1 = k0 + k_step < K ? k0 + k_step : K;
    for (int64_t p = p0; p < p1; p += STEP_PANELS) {
      int64_t real = M - p * PANEL < STEP ? M - p * PANEL : STEP;
      real = real < (p1 - p) * PANEL ? real : (p1 - p) * PANEL; /* a step never runs past its block */
      const float* const* ahead = p == p0 ? next : 0;
      tile_block* out = sums + (p - p0) / STEP_PANELS;
      if (real <= VEC) panel_dots_half(xp + p * PANEL * K, w, ahead, K, k0, k1, *out);
      else panel_dots(xp + p * PANEL * K, w, ahead, K, k0, k1, *out);
      if (k1 == K) emit(target, p * PANEL, (int)real, *out);
    }
  }
}

/* Floats of k per K step: the same for every call at that K (it depends on K alone), as even as steps of at
 * most LIN_K_STEP allow. One step (the whole of K) up to LIN_K_STEP. */
static inline int64_t lin_k_step(int64_t K) {
  const int64_t steps = (K + LIN_K_STEP - 1) / LIN_K_STEP;
  return (K + steps - 1) / steps;
}

/* Both entry points: pack x's panels (threads share the work), then per block of panels split the weight
 * tiles between the threads, each tile against the block while the tile LIN_PF ahead is prefetched. A block
 * holds as many panels as keep one K step of them in L2 (the whole of K when K is one step). */
static int run_tiles(const void* x, int64_t ldx, int x_bf16, int w_bf16, int64_t M, int64_t K, float* xp,
                     int threads, int64_t tiles, const void* call, tile_fn tile_rows, emit_fn emit) {
  const int64_t panels = (M + PANEL - 1) / PANEL;
  const int64_t k_step = lin_k_step(K);
  int64_t block = BLOCK_BYTES / (PANEL * k_step * (int64_t)sizeof(float));
  block = block < 2 ? 2 : block;
  block -= block % STEP_PANELS; /* whole steps: only the last panel of x ever runs alone */
  int failed = 0;
  _Pragma("omp parallel num_threads(threads)") {
    pack_panels(x, ldx, x_bf16, M, K, xp, omp_get_thread_num(), omp_get_num_threads());
    float* buffer = w_bf16 ? malloc(sizeof(float) * TILE_NR * K) : 0;
    tile_block* sums = malloc(sizeof(tile_block) * (block / STEP_PANELS + 1));
    if ((w_bf16 && !buffer) || !sums) {
      _Pragma("omp atomic write")
      failed = 1;
    }
    _Pragma("omp barrier")
    if (!failed)
      for (int64_t p0 = 0; p0 < panels; p0 += block) {
        const int64_t p1 = p0 + block < panels ? p0 + block : panels;
        _Pragma("omp for schedule(static)")
        for (int64_t t = 0; t < tiles; ++t) {
          const void *rows[TILE_NR], *next_rows[TILE_NR];
          const float *w[TILE_NR], *next[TILE_NR];
          tile_target target, unused;
          tile_rows(call, t, rows, &target);
          tile_rows(call, t + LIN_PF, next_rows, &unused);
          tile_as_f32(rows, w_bf16, K, buffer, w);
          const int prefetch = next_rows[0] && !w_bf16;
          for (int j = 0; j < TILE_NR && prefetch; ++j) next[j] = next_rows[j];
          tile_times_panels(xp, p0, p1, M, K, k_step, w, prefetch ? next : 0, emit, &target, sums);
        }
      }
    free(buffer);
    free(sums);
  }
  return failed ? CB_NO_MEMORY : CB_OK;
}

/* The weights of a linear_rows call: segments s of n[s] rows each, outputs side by side. */
typedef struct {
  int count, w_bf16, y_bf16;
  const void* const* w;
  const void* const* bias;
  const int64_t* n;
  int64_t K;
  void* y;
  int64_t ldy;
} linear_call;

/* Tile t takes NR rows at a time within each segment; a short tile repeats its last row. */
static void segment_tile(const void* call, int64_t t, const void* rows[TILE_NR], tile_target* target) {
  const linear_call* c = call;
  const size_t elem = c->w_bf16 ? 2 : 4;
  int64_t first_col = 0;
  for (int s = 0; s < c->count; ++s) {
    const int64_t tiles = (c->n[s] + TILE_NR - 1) / TILE_NR;
    if (t < tiles) {
      const int64_t n = t * TILE_NR;
      const int nr = (int)(c->n[s] - n < TILE_NR ? c->n[s] - n : TILE_NR);
      for (int j = 0; j < TILE_NR; ++j) rows[j] = (const char*)c->w[s] + (n + (j < nr ? j : nr - 1)) * c->K * elem;
      const void* bias = c->bias[s] ? (const char*)c->bias[s] + n * elem : 0;
      *target = (tile_target){c->y, c->ldy, first_col + n, nr, c->y_bf16, c->w_bf16, bias, 0};
      return;
    }
    t -= tiles;
    first_col += c->n[s];
  }
  rows[0] = 0;
}

static void emit_linear(const tile_target* target, int64_t m, int count, tile_block out) {
  for (int i = 0; i < count; ++i)
    for (int j = 0; j < target->cols; ++j)
      store_output(target, m + i, j,
                   target->bias ? out[j][i] + element(target->bias, j, target->bias_bf16) : out[j][i]);
}

int linear_rows(const cb_dense_params* a) {
  if (a->count < 1 || a->count > MAX_SEGMENTS || a->M < 0 || a->K < 1) return CB_BAD_ARGS;
  if (a->M == 0) return CB_OK;
  const linear_call c = {a->count, a->w_bf16, a->y_bf16, a->w, a->bias, a->n, a->K, a->y, a->ldy};
  int64_t tiles = 0;
  for (int s = 0; s < a->count; ++s) {
    if (a->n[s] < 1) return CB_BAD_ARGS;
    tiles += (a->n[s] + TILE_NR - 1) / TILE_NR;
  }
  return run_tiles(a->x, a->ldx, a->x_bf16, a->w_bf16, a->M, a->K, a->xp, a->threads, tiles, &c, segment_tile,
                   emit_linear);
}

int linear_max_segments(void) { return MAX_SEGMENTS; }

/* The build's vector width (VEC fp32 lanes: 16 with AVX-512F, else 8) and rows per packed panel: callers
 * size `xp` as ceil(M / linear_panel_rows()) * linear_panel_rows() * K floats. */
int linear_vec_width(void) { return VEC; }

int linear_panel_rows(void) { return PANEL; }

/* The weights of a gated_silu call. */
typedef struct {
  const void *wg, *wu, *bg, *bu;
  int w_bf16, y_bf16;
  int64_t N, K;
  void* y;
  int64_t ldy;
} gated_call;

#define GATED_COLS (TILE_NR / 2) /* a tile holds gate rows n.. in its first half, the matching up rows in its second */

/* Gate rows n..n+GATED_COLS of tile t and the matching up rows; a short tile repeats its last pair. */
static void gated_tile(const void* call, int64_t t, const void* rows[TILE_NR], tile_target* target) {
  const gated_call* c = call;
  const size_t elem = c->w_bf16 ? 2 : 4;
  const int64_t n = t * GATED_COLS;
  if (n >= c->N) {
    rows[0] = 0;
    return;
  }
  const int cols = (int)(c->N - n < GATED_COLS ? c->N - n : GATED_COLS);
  for (int j = 0; j < GATED_COLS; ++j) {
    const int64_t row = n + (j < cols ? j : cols - 1);
    rows[j] = (const char*)c->wg + row * c->K * elem;
    rows[GATED_COLS + j] = (const char*)c->wu + row * c->K * elem;
  }
  const void* bg = c->bg ? (const char*)c->bg + n * elem : 0;
  const void* bu = c->bu ? (const char*)c->bu + n * elem : 0;
  *target = (tile_target){c->y, c->ldy, n, cols, c->y_bf16, c->w_bf16, bg, bu};
}

/* silu(g) * u lane by lane: g / (1 + exp(-g)) * u, as torch computes silu (the same bits at either width). */
static inline vNf silu_mulN(vNf g, vNf u) { return g / (splatN(1.f) + expN(-g)) * u; }

static void emit_gated(const tile_target* target, int64_t m, int count, tile_block out) {
  for (int j = 0; j < target->cols; ++j) {
    const float bg = target->bias ? element(target->bias, j, target->bias_bf16) : 0.f;
    const float bu = target->up_bias ? element(target->up_bias, j, target->bias_bf16) : 0.f;
    for (int i = 0; i < count; i += VEC) { /* the vectors holding real rows */
      const vNf g = loadN_f32(out[j] + i) + splatN(bg);
      const vNf u = loadN_f32(out[GATED_COLS + j] + i) + splatN(bu);
      storeN_f32(out[j] + i, silu_mulN(g, u));
    }
  }
  for (int i = 0; i < count; ++i)
    for (int j = 0; j < target->cols; ++j) store_output(target, m + i, j, out[j][i]);
}

/* The gate is weight 0 and the up projection weight 1 of `a`, of one width N = n[0] = n[1]. */
int gated_silu(const cb_dense_params* a) {
  if (a->count != 2 || a->M < 0 || a->n[0] < 1 || a->n[1] != a->n[0] || a->K < 1) return CB_BAD_ARGS;
  if (a->M == 0) return CB_OK;
  const int64_t N = a->n[0];
  const gated_call c = {a->w[0], a->w[1], a->bias[0], a->bias[1], a->w_bf16, a->y_bf16, N, a->K, a->y, a->ldy};
  return run_tiles(a->x, a->ldx, a->x_bf16, a->w_bf16, a->M, a->K, a->xp, a->threads, (N + GATED_COLS - 1) / GATED_COLS,
                   &c, gated_tile, emit_gated);
}
