/* The outer-product microkernel shared by the linear layers (linear.c) and the
 * shared-prefix and prefill attention (panel_attention.c): a block of PANEL rows packed
 * k-major (p[k][PANEL]) times TILE_NR rows read along k, into a TILE_NR x PANEL
 * register block. Per k: two vector loads, TILE_NR broadcasts, 2 * TILE_NR FMAs,
 * and no reduction at the end (155-195 GFLOP/s with its operands in cache on
 * the 2-core AVX2 machine measured, against 117-140 for dot products). */
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

/* out[j][i] for the PANEL rows packed k-major at xp ([K][PANEL]). */
static inline __attribute__((always_inline)) void panel_dots(const float* xp, const float* const* w,
                                                             const float* const* ahead, int64_t K, tile_block out) {
  v8f acc[TILE_NR][2];
  for (int j = 0; j < TILE_NR; ++j) acc[j][0] = acc[j][1] = splat(0.f);
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    if (ahead) prefetch_line(ahead, k0);
    const int64_t k1 = k0 + 16 < K ? k0 + 16 : K;
    for (int64_t k = k0; k < k1; ++k) {
      v8f x0 = load_f32(xp + k * PANEL), x1 = load_f32(xp + k * PANEL + 8);
      KEEP_IN_REGISTER(x0);
      KEEP_IN_REGISTER(x1);
      for (int j = 0; j < TILE_NR; ++j) {
        const v8f wk = splat(w[j][k]);
        acc[j][0] += wk * x0;
        acc[j][1] += wk * x1;
      }
    }
  }
  for (int j = 0; j < TILE_NR; ++j) {
    store_f32(out[j], acc[j][0]);
    store_f32(out[j] + 8, acc[j][1]);
  }
}

#endif
