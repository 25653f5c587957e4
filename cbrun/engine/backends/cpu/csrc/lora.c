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
 * The vector types are 16 lanes at every build width (two 8-lane registers on AVX2), so an AVX2 build computes
 * the same bits; rows run on any thread. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cbrun_abi.h"

#define LORA_MAX_RANK 512 /* ranks of one member at most (vLLM allows up to 512) */
#define LORA_MAX_MEMBERS 4
#define LORA_LANES 16
#define LORA_COLS 64 /* outputs per task of the expand phase */

typedef float lv16 __attribute__((vector_size(64)));
typedef float lv16_mem __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t lh16_mem __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t lu16 __attribute__((vector_size(64)));

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

static inline float lora_tree16(lv16 a) {
  const float s8[8] = {a[0] + a[8], a[1] + a[9], a[2] + a[10], a[3] + a[11],
                       a[4] + a[12], a[5] + a[13], a[6] + a[14], a[7] + a[15]};
  const float s4[4] = {s8[0] + s8[4], s8[1] + s8[5], s8[2] + s8[6], s8[3] + s8[7]};
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* s[j] for j < r: one row xf (fp32, K) against A [r, K]; four ranks per pass over x. */
static void lora_shrink(const float* xf, int64_t K, const float* a, int64_t r, float* s) {
  const int64_t whole = K / LORA_LANES * LORA_LANES;
  int64_t j = 0;
  for (; j < r; j += 4) {
    const int64_t nj = r - j < 4 ? r - j : 4;
    lv16 acc[4] = {{0}, {0}, {0}, {0}};
    for (int64_t k = 0; k < whole; k += LORA_LANES) {
      const lv16 xv = *(const lv16_mem*)(xf + k);
      for (int64_t i = 0; i < nj; ++i) acc[i] += xv * *(const lv16_mem*)(a + (j + i) * K + k);
    }
    for (int64_t i = 0; i < nj; ++i) {
      for (int64_t k = whole; k < K; ++k) acc[i][k - whole] += xf[k] * a[(j + i) * K + k];
      s[j + i] = lora_tree16(acc[i]);
    }
  }
}

/* y[c0 .. c1) += the delta of one row: s [r] against bt [r, N]. */
static void lora_expand(const float* s, int64_t r, const float* bt, int64_t N, int64_t c0, int64_t c1, void* y,
                        int y_bf16) {
  int64_t c = c0;
  for (; c + LORA_LANES <= c1; c += LORA_LANES) {
    lv16 d = {0};
    for (int64_t j = 0; j < r; ++j) d += s[j] * *(const lv16_mem*)(bt + j * N + c);
    if (y_bf16) {
      uint16_t* out = (uint16_t*)y + c;
      const lu16 wide = __builtin_convertvector(*(const lh16_mem*)out, lu16) << 16;
      const lv16 sum = (lv16)wide + d;
      for (int l = 0; l < LORA_LANES; ++l) out[l] = lora_f32_to_bf16(sum[l]);
    } else {
      float* out = (float*)y + c;
      *(lv16_mem*)out = *(const lv16_mem*)out + d;
    }
  }
  for (; c < c1; ++c) {
    float d = 0.f;
    for (int64_t j = 0; j < r; ++j) d += s[j] * bt[j * N + c];
    if (y_bf16) {
      uint16_t* out = (uint16_t*)y + c;
      *out = lora_f32_to_bf16(lora_bf16_to_f32(*out) + d);
    } else {
      ((float*)y)[c] += d;
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
  int64_t most = 1; /* the call's largest rank: s's stride */
  for (int64_t t = 0; t < G * M; ++t)
    if (a[t] && rank[t] > most) most = rank[t];
  int64_t* group = malloc((size_t)n * sizeof(int64_t));                       /* [n] each row's adapter */
  float* xf = malloc((size_t)(n * K) * sizeof(float));                       /* [n, K] x widened */
  float* s = malloc((size_t)(n * M * most) * sizeof(float));                /* [n, M, most] */
  int64_t tiles = 0;
  for (int64_t m = 0; m < M; ++m) tiles += (widths[m] + LORA_COLS - 1) / LORA_COLS;
  if (!group || !xf || !s) {
    free(group), free(xf), free(s);
    return CB_NO_MEMORY;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = start[g]; i < start[g + 1]; ++i) group[i] = g;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      float* to = xf + i * K;
      if (x_bf16) {
        const uint16_t* from = (const uint16_t*)x + rows[i] * ldx;
        for (int64_t k = 0; k < K; ++k) to[k] = lora_bf16_to_f32(from[k]);
      } else {
        memcpy(to, (const float*)x + rows[i] * ldx, (size_t)K * sizeof(float));
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n * M; ++t) {
      const int64_t i = t / M, m = t % M, at = group[i] * M + m;
      if (a[at]) lora_shrink(xf + i * K, K, a[at], rank[at], s + t * most);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < n * tiles; ++t) {
      const int64_t i = t / tiles;
      int64_t tile = t % tiles, m = 0;
      while (tile >= (widths[m] + LORA_COLS - 1) / LORA_COLS) tile -= (widths[m++] + LORA_COLS - 1) / LORA_COLS;
      const int64_t at = group[i] * M + m;
      if (!a[at]) continue;
      const int64_t c0 = tile * LORA_COLS, c1 = c0 + LORA_COLS < widths[m] ? c0 + LORA_COLS : widths[m];
      const size_t elem = y_bf16 ? 2 : 4;
      void* row = (char*)y[m] + (size_t)(rows[i] * ldy[m]) * elem;
      lora_expand(s + (i * M + m) * most, rank[at], bt[at], widths[m], c0, c1, row, y_bf16);
    }
  }
  free(group), free(xf), free(s);
  return CB_OK;
}
