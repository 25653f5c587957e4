/* Shared-prefix ("cascade") decode attention, fp32: many decoding rows that
 * start with the same cached pages attend to those keys together.
 *
 * Per KV head the group's R rows x G query heads are R * G query rows against
 * the same L = S * P keys. Done with torch this is a GEMM with an inner size
 * of D = 64 (MKL runs ~80 GFLOP/s on it here), a full pass of exp over the
 * [R * G, L] scores and a second GEMM: about 50 GFLOP/s in all, 18% of a
 * W-prefix run. Here each task is one panel of 16 query rows of one KV head,
 * start to end in cache:
 *
 *   qp [D][16]      the panel's queries (scaled), packed k-major
 *   s  [L][16]      scores: the outer-product microkernel (panel.h) with the
 *                   keys as its tile rows, 6 keys per call, inner size D
 *   softmax         per query row, along the keys: with 16 rows side by side
 *                   in two vectors, max, exp and sum are lane-wise (no
 *                   horizontal reductions)
 *   acc [16][D]     exp(s - max) @ values: the same microkernel shape with s
 *                   as the panel and 6 value columns per call, inner size L
 *
 * The result is each row's softmax state over the shared keys (running max,
 * sum of exponentials, unnormalized output), which the decode kernel
 * continues over the row's own keys (attention.c).
 *
 *   q          [B, H, D]            queries of every decode row
 *   k, v       [H_kv, NB, P, D]     one layer's key and value pages
 *   rows       [R] int64            the group's rows of q
 *   pages      [S] int64            the shared block ids, in order
 *   m, l       [B, H], acc [B, H, D]  written for the group's rows only
 */
#include <stdlib.h>

#include "panel.h"

/* out[j][i] = sum_k p[k][i] * values[k][d0 + j]: a panel of probabilities p ([L][PANEL]) times
 * TILE_NR columns of the value rows (one row pointer per key). */
static inline __attribute__((always_inline)) void panel_by_columns(const float* p, const float* const* values,
                                                                   int64_t d0, int64_t L, tile_block out) {
  v8f acc[TILE_NR][2];
  for (int j = 0; j < TILE_NR; ++j) acc[j][0] = acc[j][1] = splat(0.f);
  for (int64_t k = 0; k < L; ++k) {
    v8f p0 = load_f32(p + k * PANEL), p1 = load_f32(p + k * PANEL + 8);
    KEEP_IN_REGISTER(p0);
    KEEP_IN_REGISTER(p1);
    const float* value = values[k] + d0;
    for (int j = 0; j < TILE_NR; ++j) {
      const v8f vk = splat(value[j]);
      acc[j][0] += vk * p0;
      acc[j][1] += vk * p1;
    }
  }
  for (int j = 0; j < TILE_NR; ++j) {
    store_f32(out[j], acc[j][0]);
    store_f32(out[j] + 8, acc[j][1]);
  }
}

/* Where query row r of a KV head's panel lives: (row of q, query head). */
typedef struct {
  const int64_t* rows;
  int64_t G, H;
} query_rows;

static inline int64_t query_offset(const query_rows* qr, int64_t head, int64_t r) {
  return qr->rows[r / qr->G] * qr->H + head * qr->G + r % qr->G; /* index into [B, H] */
}

/* Scores of query rows [r0, r0 + count) of one KV head against all L keys, softmax along the keys,
 * values; stores each row's max, sum and unnormalized output. */
static void attend_panel(const float* q, const float* const* keys, const float* const* values, int64_t L,
                         int64_t D, float scale, const query_rows* qr, int64_t head, int64_t r0, int count,
                         float* qp, float* s, float* m, float* l, float* acc) {
  for (int64_t d = 0; d < D; ++d) /* pack: qp[d][i], zero rows past the group */
    for (int i = 0; i < PANEL; ++i) qp[d * PANEL + i] = i < count ? q[query_offset(qr, head, r0 + i) * D + d] * scale : 0.f;
  tile_block out;
  for (int64_t k0 = 0; k0 < L; k0 += TILE_NR) { /* the last tile repeats its last key; extra rows not kept */
    const float* tile[TILE_NR];
    for (int j = 0; j < TILE_NR; ++j) tile[j] = keys[k0 + j < L ? k0 + j : L - 1];
    panel_dots(qp, tile, 0, D, out);
    for (int j = 0; j < TILE_NR && k0 + j < L; ++j) memcpy(s + (k0 + j) * PANEL, out[j], sizeof out[j]);
  }
  v8f top[2] = {splat(-INFINITY), splat(-INFINITY)}, total[2] = {splat(0.f), splat(0.f)};
  for (int64_t k = 0; k < L; ++k)
    for (int h = 0; h < 2; ++h) top[h] = vmax(top[h], load_f32(s + k * PANEL + h * 8));
  for (int64_t k = 0; k < L; ++k)
    for (int h = 0; h < 2; ++h) {
      const v8f e = exp8(load_f32(s + k * PANEL + h * 8) - top[h]);
      store_f32(s + k * PANEL + h * 8, e);
      total[h] += e;
    }
  for (int i = 0; i < count; ++i) {
    const int64_t at = query_offset(qr, head, r0 + i);
    m[at] = top[i / 8][i % 8];
    l[at] = total[i / 8][i % 8];
  }
  for (int64_t d0 = 0; d0 < D; d0 += TILE_NR) {
    const int64_t first = d0 + TILE_NR <= D ? d0 : D - TILE_NR; /* the last tile overlaps: no reads past a row */
    panel_by_columns(s, values, first, L, out);
    for (int i = 0; i < count; ++i) {
      float* row = acc + query_offset(qr, head, r0 + i) * D + first;
      for (int j = 0; j < TILE_NR; ++j) row[j] = out[j][i];
    }
  }
}

/* Row pointers of the L = S * P shared keys (or values) of one KV head's pool. */
static void shared_rows(const float* pool, const int64_t* pages, int64_t S, int64_t P, int64_t D,
                        const float** out) {
  for (int64_t i = 0; i < S * P; ++i) out[i] = pool + (pages[i / P] * P + i % P) * D;
}

/* Returns 0, or -1 when scratch could not be allocated (nothing written). Needs D >= TILE_NR. */
int shared_prefix_f32(const float* q, const float* k, const float* v, const int64_t* rows, int64_t R,
                      const int64_t* pages, int64_t S, int64_t H, int64_t Hkv, int64_t NB, int64_t P, int64_t D,
                      float scale, float* m, float* l, float* acc, int threads) {
  const int64_t G = H / Hkv, L = S * P, panels = (R * G + PANEL - 1) / PANEL;
  const float** pointers = malloc(sizeof(float*) * 2 * Hkv * L);
  if (!pointers) return -1;
  for (int64_t h = 0; h < Hkv; ++h) {
    shared_rows(k + h * NB * P * D, pages, S, P, D, pointers + (2 * h) * L);
    shared_rows(v + h * NB * P * D, pages, S, P, D, pointers + (2 * h + 1) * L);
  }
  const query_rows qr = {rows, G, H};
  int failed = 0;
  _Pragma("omp parallel num_threads(threads) reduction(|| : failed)") {
    float* qp = aligned_alloc(64, sizeof(float) * PANEL * D);
    float* s = aligned_alloc(64, sizeof(float) * PANEL * L);
    if (!qp || !s) failed = 1;
    _Pragma("omp for schedule(static)")
    for (int64_t task = 0; task < Hkv * panels; ++task) {
      if (failed) continue;
      const int64_t h = task / panels, r0 = (task % panels) * PANEL;
      const int count = (int)(R * G - r0 < PANEL ? R * G - r0 : PANEL);
      attend_panel(q, pointers + 2 * h * L, pointers + (2 * h + 1) * L, L, D, scale, &qr, h, r0, count, qp, s, m,
                   l, acc);
    }
    free(qp);
    free(s);
  }
  free(pointers);
  return failed ? -1 : 0;
}
