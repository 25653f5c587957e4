/* The outer-product microkernel of the linear layers (linear.c): a block of PANEL rows
 * packed k-major (p[k][PANEL]) times TILE_NR rows read along k, into a TILE_NR x PANEL
 * register block. Per k: two vector loads, TILE_NR broadcasts, 2 * TILE_NR FMAs, and
 * no reduction at the end, so each lane (one row of x) is a plain multiply-add chain
 * over k: the property batch invariance rests on. */
#ifndef CBRUN_PANEL_H
#define CBRUN_PANEL_H

#include "vec.h"

#define TILE_NR 6 /* rows per tile: 12 accumulators, 2 loads and a broadcast register of 16 */
#define PANEL 16  /* rows per packed panel (two vectors) */

/* out[j][i] = dot(x row i, weight row j) for one tile: a block of up to PANEL rows of x */
typedef float tile_block[TILE_NR][PANEL];

/* Prefetch the cache line holding float k of each of the NR weight rows `ahead` into L2. Issued
 * one line per row every 16 k inside a tile's first row step, it keeps a few misses in flight at
 * a time: prefetching a whole tile in bursts between steps stalled the loads behind it (the
 * kernel ran 25-35% slower at 16-48 rows, measured). */
static inline void prefetch_line(const float* const* ahead, int64_t k) {
  for (int j = 0; j < TILE_NR; ++j) __builtin_prefetch(ahead[j] + k, 0, 2);
}

/* out[j][i] for the PANEL rows packed k-major at xp ([K][PANEL]) against the TILE_NR weight rows w
 * ([K] each), VECS = 2 vectors of rows (a whole panel) or 1 (its first half; out[j][8..] untouched).
 * Every lane is one multiply-add chain over k = 0 .. K-1 from zero: the same bits for a row whichever
 * panel, lane or variant computes it (linear.c's batch invariance rests on this). */
#define DEFINE_PANEL_DOTS(NAME, VECS)                                                                   \
  static inline __attribute__((always_inline)) void NAME(const float* xp, const float* const* w,        \
                                                         const float* const* ahead, int64_t K,           \
                                                         tile_block out) {                               \
    v8f acc[TILE_NR][VECS];                                                                              \
    for (int j = 0; j < TILE_NR; ++j)                                                                    \
      for (int h = 0; h < VECS; ++h) acc[j][h] = splat(0.f);                                             \
    for (int64_t k0 = 0; k0 < K; k0 += 16) {                                                             \
      if (ahead) prefetch_line(ahead, k0);                                                               \
      const int64_t k1 = k0 + 16 < K ? k0 + 16 : K;                                                      \
      for (int64_t k = k0; k < k1; ++k) {                                                                \
        v8f xv[VECS];                                                                                    \
        for (int h = 0; h < VECS; ++h) {                                                                 \
          xv[h] = load_f32(xp + k * PANEL + 8 * h);                                                      \
          KEEP_IN_REGISTER(xv[h]);                                                                       \
        }                                                                                                \
        for (int j = 0; j < TILE_NR; ++j) {                                                              \
          const v8f wk = splat(w[j][k]);                                                                 \
          for (int h = 0; h < VECS; ++h) acc[j][h] += wk * xv[h]; /* one fused multiply-add where the CPU has FMA */ \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
    for (int j = 0; j < TILE_NR; ++j)                                                                    \
      for (int h = 0; h < VECS; ++h) store_f32(out[j] + 8 * h, acc[j][h]);                               \
  }

DEFINE_PANEL_DOTS(panel_dots, 2)
DEFINE_PANEL_DOTS(panel_dots_half, 1)

#endif
