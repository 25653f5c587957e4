/* The one bf16 dot-product arithmetic of the engine's bf16 linears: AMX's tdpbf16ps order, in plain C.
 *
 * A sum over K (bf16 x and w, K padded with zeros to a multiple of TO_BLOCK_K = 32) is cut into blocks of 16
 * pairs, taken in ascending order. Per block, from E = O = +0:
 *     E = fma(x[2k],   w[2k],   E)    k = 0 .. 15 ascending (the block's even elements)
 *     O = fma(x[2k+1], w[2k+1], O)    (its odd elements)
 *     C = C + (E + O)                 C (from +0) is the first operand, then E
 * with denormal inputs read as zero and every result flushed to a signed zero when, rounded to 24 bits with an
 * unbounded exponent, it is below 2^-126 (x86's FTZ and DAZ, tininess after rounding). This is what the Intel
 * SDM's pseudo-code of tdpbf16ps says and what the instruction was measured to do, bit for bit
 * (../shared/amx_probe); a padded block's zero pairs are computed as the tiles compute them.
 *
 * The helpers here are the reference every method must equal: they do their own flushing, so they give the same
 * bits whatever the CPU's MXCSR holds. The fast methods (linear_dpbf16.c) get the same rules from the hardware:
 * the tiles and vdpbf16ps always flush, vector FMAs under MXCSR FTZ|DAZ (dp_flush_on). NaN payloads, where
 * several NaNs meet, are the one thing not specified. */
#ifndef CBRUN_TILE_ORDER_H
#define CBRUN_TILE_ORDER_H

#include <float.h>
#include <math.h>
#include <stdint.h>

#define TO_BLOCK_K 32    /* K elements per block: one tile row of bf16 */
#define TO_BLOCK_PAIRS 16 /* pairs of k per block */

/* K padded to whole blocks. */
static inline int64_t to_padded_k(int64_t K) { return (K + TO_BLOCK_K - 1) / TO_BLOCK_K * TO_BLOCK_K; }

/* A bf16 value read as fp32, denormals as signed zeros. */
static inline float to_read(uint16_t h) {
  union { uint32_t u; float f; } c;
  c.u = (uint32_t)h << 16;
  return fabsf(c.f) < FLT_MIN ? copysignf(0.f, c.f) : c.f;
}

/* fma(a, b, c) rounded once, then flushed if tiny after rounding; a, b, c are zero or normal. Where the result
 * could be tiny (|a b| and |c| both at most 2^-60: a larger operand leaves a sum that is zero or at least 2^-83),
 * it is computed again scaled by 2^64, in the normal range, where "rounded with an unbounded exponent" is plain
 * rounding; the smaller factor takes the scale, so nothing overflows. */
static inline float to_fma(float a, float b, float c) {
  const float r = fmaf(a, b, c);
  if (!(fabsf(r) <= 0x1p-100f)) return r; /* the common case, infinities and NaNs too */
  if (fabs((double)a * (double)b) > 0x1p-60 || fabsf(c) > 0x1p-60f) return r;
  const float scaled = fabsf(a) <= fabsf(b) ? fmaf(a * 0x1p64f, b, c * 0x1p64f) : fmaf(a, b * 0x1p64f, c * 0x1p64f);
  if (fabsf(scaled) < 0x1p-62f) return copysignf(0.f, scaled); /* tiny: below 2^-126 once scaled back */
  return scaled * 0x1p-64f;                                    /* exact */
}

/* x + y under the same rules (x the first operand). */
static inline float to_add(float x, float y) { return to_fma(x, 1.f, y); }

/* An incoming C read as the tiles read it: a denormal counts as zero. */
static inline float to_daz(float v) { return fabsf(v) < FLT_MIN ? copysignf(0.f, v) : v; }

/* One block of 16 pairs added to C: x at x (unit stride, 32 elements), w's element 2k and 2k + 1 at
 * w + k * w_pair_stride (and + 1). */
static inline float to_block(float c, const uint16_t* x, const uint16_t* w, int64_t w_pair_stride) {
  float even = 0.f, odd = 0.f;
  for (int k = 0; k < TO_BLOCK_PAIRS; ++k) {
    even = to_fma(to_read(x[2 * k]), to_read(w[k * w_pair_stride]), even);
    odd = to_fma(to_read(x[2 * k + 1]), to_read(w[k * w_pair_stride + 1]), odd);
  }
  return to_add(to_daz(c), to_add(even, odd));
}

#endif
