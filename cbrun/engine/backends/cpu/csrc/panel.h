/* The outer-product microkernel of the linear layers (linear.c): STEP rows of x, packed k-major in
 * panels of PANEL rows (p[k][PANEL]), times TILE_NR weight rows read along k, into a TILE_NR x STEP
 * register block. Per k: two vector loads, TILE_NR broadcasts, 2 * TILE_NR FMAs, and no reduction
 * at the end, so each lane (one row of x) is a plain multiply-add chain over k: the property batch
 * invariance rests on.
 *
 * Vectors are VEC lanes wide (vec.h: 16 where the compiler targets AVX-512F, 8 otherwise) and a step
 * is always two of them, so the block is sized by the register file:
 *   VEC 8  (AVX2, 16 ymm):    TILE_NR 6: 12 accumulators + 2 x vectors + 1 broadcast = 15 registers;
 *                             a step is one panel (its two halves), 16 rows.
 *   VEC 16 (AVX-512, 32 zmm): TILE_NR 10: 20 accumulators + 2 + 1 = 23 registers; a step is two
 *                             panels (one zmm each), 32 rows.
 * Two vectors per step because with one, each FMA would need its own broadcast load (TILE_NR + 1
 * loads for TILE_NR FMAs: load-bound where two loads and two FMAs issue per cycle); with two, a
 * broadcast feeds two FMAs (TILE_NR + 2 loads for 2 * TILE_NR). The zmm file would hold up to 14
 * rows (31 registers), but the general registers run out first: each row is a pointer, and beside
 * the two panel pointers and the k counter and bound, 10 rows is the largest even count (a gated
 * tile is half gate rows, half up rows) that fits the 15 of x86-64.
 * GCC 12 (-march=skylake-avx512, icelake-server, sapphirerapids) compiles the 10-row loop to 10
 * broadcasts, 2 loads, 20 FMAs and 4 loop instructions per k with no stack access; at 12 rows it
 * spills two row pointers and the bound (3 extra loads per k), at 14 five. A 10-row tile of
 * K = 576 floats (23 KiB) also stays in a 32 KiB L1. PANEL stays 16 rows at both widths (the
 * packing, and the scratch callers allocate, do not depend on the width); the wide step takes two
 * consecutive panels, and a step of at most VEC real rows (a lone last panel included) runs one
 * vector. (A 16-wide build on AVX2, the tests' twin of the AVX-512 build, holds its 40 ymm halves
 * of accumulators mostly on the stack: right, but about ten times slower; it is never the default.)
 *
 * The width only regroups lanes: every output is the same chain at either width, so the 8- and
 * 16-wide builds give the same bits (tests/cpu_kernels/test_linear_widths.py). */
#ifndef CBRUN_PANEL_H
#define CBRUN_PANEL_H

#include "vec.h"

#if VEC == 16
#define TILE_NR 10 /* rows per tile: 20 accumulators, 2 loads and a broadcast register of 32 */
#else
#define TILE_NR 6 /* rows per tile: 12 accumulators, 2 loads and a broadcast register of 16 */
#endif
#define PANEL 16              /* rows per packed panel (two vectors of 8, or one of 16) */
#define STEP (2 * VEC)        /* rows per microkernel call: two vectors (one panel, or two) */
#define STEP_PANELS (STEP / PANEL)

/* out[j][i] = dot(x row i, weight row j) for one tile: a block of up to STEP rows of x */
typedef float tile_block[TILE_NR][STEP];

/* Prefetch the cache line holding float k of each of the NR weight rows `ahead` into L2. Issued
 * one line per row every 16 k inside a tile's first row step, it keeps a few misses in flight at
 * a time: prefetching a whole tile in bursts between steps stalled the loads behind it (the
 * kernel ran 25-35% slower at 16-48 rows, measured). */
static inline void prefetch_line(const float* const* ahead, int64_t k) {
  for (int j = 0; j < TILE_NR; ++j) __builtin_prefetch(ahead[j] + k, 0, 2);
}

/* Lanes of vector h of a step start at this float of panel-major, k-major x: vector h holds rows
 * h * VEC .. of the step, in panel h * VEC / PANEL at lane offset h * VEC % PANEL. */
#define STEP_VECTOR(xp, panel_floats, k, h) \
  ((xp) + ((h) * VEC / PANEL) * (panel_floats) + (k) * PANEL + (h) * VEC % PANEL)

/* out[j][i] for the STEP rows packed at xp (STEP_PANELS panels [K][PANEL] one after another) against
 * the TILE_NR weight rows w ([K] each) over k = k0 .. k1 - 1, continuing the sums in `out` (from zero where
 * k0 = 0); VECS = 2 vectors of rows (a whole step) or 1 (its first VEC rows; out[j][VEC..] untouched).
 * Every lane is one multiply-add chain over k = 0 .. K-1 from zero, carried exactly between calls (an fp32
 * value stored and loaded is itself): the same bits for a row whichever panel, lane, width, K step or
 * variant computes it (linear.c's batch invariance rests on this). */
#define DEFINE_PANEL_DOTS(NAME, VECS)                                                                   \
  static inline __attribute__((always_inline)) void NAME(const float* xp, const float* const* w,        \
                                                         const float* const* ahead, int64_t K,           \
                                                         int64_t k0, int64_t k1, tile_block out) {       \
    const int64_t panel_floats = PANEL * K;                                                              \
    vNf acc[TILE_NR][VECS];                                                                              \
    for (int j = 0; j < TILE_NR; ++j)                                                                    \
      for (int h = 0; h < VECS; ++h) acc[j][h] = k0 ? loadN_f32(out[j] + VEC * h) : splatN(0.f);         \
    for (int64_t kb = k0; kb < k1; kb += 16) {                                                           \
      if (ahead) prefetch_line(ahead, kb);                                                               \
      const int64_t ke = kb + 16 < k1 ? kb + 16 : k1;                                                    \
      for (int64_t k = kb; k < ke; ++k) {                                                                \
        vNf xv[VECS];                                                                                    \
        for (int h = 0; h < VECS; ++h) {                                                                 \
          xv[h] = loadN_f32(STEP_VECTOR(xp, panel_floats, k, h));                                        \
          KEEP_IN_REGISTER_N(xv[h]);                                                                     \
        }                                                                                                \
        for (int j = 0; j < TILE_NR; ++j) {                                                              \
          const vNf wk = splatN(w[j][k]);                                                                \
          for (int h = 0; h < VECS; ++h) acc[j][h] += wk * xv[h]; /* one fused multiply-add where the CPU has FMA */ \
        }                                                                                                \
      }                                                                                                  \
    }                                                                                                    \
    for (int j = 0; j < TILE_NR; ++j)                                                                    \
      for (int h = 0; h < VECS; ++h) storeN_f32(out[j] + VEC * h, acc[j][h]);                            \
  }

DEFINE_PANEL_DOTS(panel_dots, 2)
DEFINE_PANEL_DOTS(panel_dots_half, 1)

#endif
