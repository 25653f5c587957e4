/* LoRA deltas for every adapter of a step in one call: y[row] += B_g (A_g x[row]) for each row of each adapter
 * g, for one or several members (q|k|v, gate|up) that read the same x.
 *
 * Why we own this kernel: one step with a few adapters made 14 calls per adapter and layer of the fp32 linear
 * (a fixed cost each of tens of microseconds at rank-16 shapes), plus a gather and a scatter per call; punica's
 * grouped calls (SGMV) have no CPU build and no fixed order of sums.
 *
 *   x        [T, K] fp32 or bf16 (x_bf16), rows ldx apart
 *   rows     [n] int64: the rows of the call, adapter by adapter; group g holds rows[start[g] .. start[g + 1])
 *   per member m of M, per group g (index g * M + m):
 *     a[g M + m]   A  [r, K]  fp32, or NULL (adapter g does not adapt member m)
 *     bt[g M + m]  B^T [r, N_m] fp32, the scaling folded in
 *     rank[g M + m] r (1 .. LORA_MAX_RANK)
 *   y[m]     member m's output [T, N_m], rows ldy[m] apart, fp32 or bf16 (y_bf16); updated in place
 *
 * A row's delta depends on its x and its adapter alone, in one order whatever the call holds:
 *   s[j]  = sum over k of x[k] a[j][k]: 16 lanes, lane l the fma chain over k = l, l + 16, ... ascending (a
 *           K tail in the lanes it falls in), then the lanes summed in one tree;
 *   d[n]  = fma chain over j = 0 .. r - 1 ascending of s[j] bt[j][n], from +0;
 *   y[n]  = y[n] + d[n] in fp32 (one add; a bf16 y widened, added to and rounded to nearest even once).
 * Lanes are counted in groups of 16 at every build width (one zmm, or two ymm on AVX2), so an AVX2 build
 * computes the same bits; rows run on any thread. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cbrun_abi.h"
#include "vec.h"

#define LORA_MAX_RANK 512 /* ranks of one member at most (vLLM allows up to 512) */
#define LORA_MAX_MEMBERS 4
#define LORA_LANES 16

#define LORA_HALVES (LORA_LANES / VEC) /* native vectors per 16 lanes: 1 (AVX-512) or 2 (AVX2) */

static inline float lora_bf16_to_f32(uint16_t h) {
  union { uint32_t u; float f; } c = {(uint32_t)h << 16};
  return c.f;
}

/* Round to nearest even, as torch's .to(bfloat16) does (NaNs stay NaNs, quiet). */
static inline uint16_t lora_f32_to_bf16(float f) {
  union { float f; uint32_t u; } c = {f};
  if ((c.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((c.u >> 16) | 0x40u);
  return (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16);
}

/* The fixed tree over 16 lanes: lane l + 8 onto l, then + 4, then the last four as (0 + 2) + (1 + 3). */
static inline float lora_tree16(const float* a) {
  const float s8[8] = {a[0] + a[8], a[1] + a[9], a[2] + a[10], a[3] + a[11],
                       a[4] + a[12], a[5] + a[13], a[6] + a[14], a[7] + a[15]};
  const float s4[4] = {s8[0] + s8[4], s8[1] + s8[5], s8[2] + s8[6], s8[3] + s8[7]};
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* Register blocking, in the CPU's own vectors (vec.h: 16 lanes, or 8 on AVX2 with a 16-lane group as two):
 * the accumulators of a pass fill about half the registers. It regroups independent chains only, so the
 * bits are the same at every width and block. */
#define LORA_BLOCK 2 /* rows of one adapter computed together: each A and B^T vector loaded once for them */
#if VEC == 16
#define LORA_STORE_BF16 store16_bf16 /* each lane as lora_f32_to_bf16 rounds it */
#define LORA_RANKS 4 /* ranks per pass of the shrink */
#define LORA_VECS 4  /* 16-lane output groups per pass of the expand */
#else
#define LORA_STORE_BF16 store_bf16
#define LORA_RANKS 2
#define LORA_VECS 2
#endif

/* s[i][j0 + jj] for R rows and J ranks from j0: the lane chains over k in registers (R and J are constants at
 * every call, so the accumulators stay in registers), then each lane tree; the order is lora_apply's. */
static inline __attribute__((always_inline)) void lora_shrink_block(const float* const* xr, int R, int64_t K,
                                                                    const float* a, int64_t j0, int J,
                                                                    float (*s)[LORA_MAX_RANK]) {
  const int64_t whole = K / LORA_LANES * LORA_LANES;
  vNf acc[LORA_BLOCK][LORA_RANKS][LORA_HALVES];
  for (int i = 0; i < R; ++i)
    for (int jj = 0; jj < J; ++jj)
      for (int h = 0; h < LORA_HALVES; ++h) acc[i][jj][h] = splatN(0.f);
  for (int64_t k = 0; k < whole; k += LORA_LANES) {
    vNf xv[LORA_BLOCK][LORA_HALVES];
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < LORA_HALVES; ++h) xv[i][h] = loadN_f32(xr[i] + k + h * VEC);
    for (int jj = 0; jj < J; ++jj)
      for (int h = 0; h < LORA_HALVES; ++h) {
        const vNf av = loadN_f32(a + (j0 + jj) * K + k + h * VEC);
        for (int i = 0; i < R; ++i) acc[i][jj][h] += xv[i][h] * av;
      }
  }
  for (int i = 0; i < R; ++i)
    for (int jj = 0; jj < J; ++jj) {
      float lanes[LORA_LANES]; /* the tail's lanes indexed one by one in memory, not in the registers above */
      for (int h = 0; h < LORA_HALVES; ++h) storeN_f32(lanes + h * VEC, acc[i][jj][h]);
      for (int64_t k = whole; k < K; ++k) lanes[k - whole] += xr[i][k] * a[(j0 + jj) * K + k];
      s[i][j0 + jj] = lora_tree16(lanes);
    }
}

static inline __attribute__((always_inline)) void lora_shrink_rows(const float* const* xr, int R, int64_t K,
                                                                   const float* a, int64_t r,
                                                                   float (*s)[LORA_MAX_RANK]) {
  int64_t j = 0;
  for (; j + LORA_RANKS <= r; j += LORA_RANKS) lora_shrink_block(xr, R, K, a, j, LORA_RANKS, s);
  for (; j < r; ++j) lora_shrink_block(xr, R, K, a, j, 1, s);
}

/* One output row's y[c .. c + VEC) += d (fp32, or bf16 widened, added to and rounded once). */
static inline void lora_store(void* y, int y_bf16, int64_t c, vNf d) {
  if (y_bf16) {
    uint16_t* out = (uint16_t*)y + c;
    LORA_STORE_BF16(out, loadN_bf16(out) + d);
  } else {
    float* out = (float*)y + c;
    storeN_f32(out, loadN_f32(out) + d);
  }
}

/* R rows' y[c .. c + 16 V) += their deltas: V groups of 16 per row, each lane the fma chain over j from +0. */
static inline __attribute__((always_inline)) void lora_expand_block(float (*s)[LORA_MAX_RANK], int R, int64_t r,
                                                                    const float* bt, int64_t N, int64_t c, int V,
                                                                    void* const* yr, int y_bf16) {
  enum { W = LORA_VECS * LORA_HALVES };
  const int n = V * LORA_HALVES; /* native vectors per row */
  vNf d[LORA_BLOCK][W];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < n; ++v) d[i][v] = splatN(0.f);
  for (int64_t j = 0; j < r; ++j) {
    vNf sj[LORA_BLOCK];
    for (int i = 0; i < R; ++i) sj[i] = splatN(s[i][j]);
    for (int v = 0; v < n; ++v) {
      const vNf b = loadN_f32(bt + j * N + c + v * VEC);
      for (int i = 0; i < R; ++i) d[i][v] += sj[i] * b;
    }
  }
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < n; ++v) lora_store(yr[i], y_bf16, c + v * VEC, d[i][v]);
}

static inline __attribute__((always_inline)) void lora_expand_rows(float (*s)[LORA_MAX_RANK], int R, int64_t r,
                                                                   const float* bt, int64_t N, void* const* yr,
                                                                   int y_bf16) {
  int64_t c = 0;
  for (; c + LORA_VECS * LORA_LANES <= N; c += LORA_VECS * LORA_LANES)
    lora_expand_block(s, R, r, bt, N, c, LORA_VECS, yr, y_bf16);
  for (; c + LORA_LANES <= N; c += LORA_LANES) lora_expand_block(s, R, r, bt, N, c, 1, yr, y_bf16);
  for (; c < N; ++c)
    for (int i = 0; i < R; ++i) {
      float d = 0.f;
      for (int64_t j = 0; j < r; ++j) d += s[i][j] * bt[j * N + c];
      if (y_bf16) {
        uint16_t* out = (uint16_t*)yr[i] + c;
        *out = lora_f32_to_bf16(lora_bf16_to_f32(*out) + d);
      } else {
        ((float*)yr[i])[c] += d;
      }
    }
}

int lora_max_rank(void) { return LORA_MAX_RANK; }

int lora_apply(const void* x, int x_bf16, int64_t ldx, int64_t K, const int64_t* rows, const int64_t* start,
               int64_t G, const float* const* a, const float* const* bt, const int64_t* rank, int64_t M,
               void* const* y, const int64_t* ldy, const int64_t* widths, int y_bf16, int threads) {
  if (M < 1 || M > LORA_MAX_MEMBERS || G < 1 || K < 1 || start[0] != 0) return CB_BAD_ARGS;
  for (int64_t g = 0; g < G; ++g) {
    if (start[g + 1] < start[g]) return CB_BAD_ARGS;
    for (int64_t m = 0; m < M; ++m)
      if (a[g * M + m] && (rank[g * M + m] < 1 || rank[g * M + m] > LORA_MAX_RANK || !bt[g * M + m]))
        return CB_BAD_ARGS;
  }
  const int64_t n = start[G];
  if (n == 0) return CB_OK;
  int64_t blocks = 0; /* LORA_BLOCK rows of one adapter at a time */
  for (int64_t g = 0; g < G; ++g) blocks += (start[g + 1] - start[g] + LORA_BLOCK - 1) / LORA_BLOCK;
  int64_t* first = malloc((size_t)blocks * 2 * sizeof(int64_t)); /* [blocks, 2]: first row, its adapter */
  if (!first) return CB_NO_MEMORY;
  for (int64_t g = 0, b = 0; g < G; ++g)
    for (int64_t i = start[g]; i < start[g + 1]; i += LORA_BLOCK, ++b) first[2 * b] = i, first[2 * b + 1] = g;
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    float* xf = x_bf16 ? malloc((size_t)(LORA_BLOCK * K) * sizeof(float)) : NULL; /* the block's x widened */
    if (x_bf16 && !xf) {
#pragma omp atomic write
      failed = 1;
    }
    float s[LORA_BLOCK][LORA_MAX_RANK];
    int64_t widened = -1; /* the block whose x is in xf: a block's members follow each other in t */
    /* static: a task is a few hundred nanoseconds of arithmetic, about what a dynamic grab costs; which thread
     * computes a row changes none of its bits */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < blocks * M; ++t) {
      const int64_t b = t / M, m = t % M, g = first[2 * b + 1], at = g * M + m, i0 = first[2 * b];
      if (!a[at] || (x_bf16 && !xf)) continue;
      const int R = start[g + 1] - i0 < LORA_BLOCK ? (int)(start[g + 1] - i0) : LORA_BLOCK;
      const float* xr[LORA_BLOCK];
      void* yr[LORA_BLOCK];
      const size_t elem = y_bf16 ? 2 : 4;
      for (int i = 0; i < R; ++i) {
        const int64_t row = rows[i0 + i];
        yr[i] = (char*)y[m] + (size_t)(row * ldy[m]) * elem;
        if (x_bf16) {
          if (widened != b) {
            const uint16_t* from = (const uint16_t*)x + row * ldx;
            int64_t k = 0;
            for (; k + VEC <= K; k += VEC) storeN_f32(xf + i * K + k, loadN_bf16(from + k));
            for (; k < K; ++k) xf[i * K + k] = lora_bf16_to_f32(from[k]);
          }
          xr[i] = xf + i * K;
        } else {
          xr[i] = (const float*)x + row * ldx;
        }
      }
      widened = b;
      if (R == LORA_BLOCK) {
        lora_shrink_rows(xr, LORA_BLOCK, K, a[at], rank[at], s);
        lora_expand_rows(s, LORA_BLOCK, rank[at], bt[at], widths[m], yr, y_bf16);
      } else {
        lora_shrink_rows(xr, 1, K, a[at], rank[at], s);
        lora_expand_rows(s, 1, rank[at], bt[at], widths[m], yr, y_bf16);
      }
    }
    free(xf);
  }
  free(first);
  if (failed) return CB_NO_MEMORY;
  return CB_OK;
}
