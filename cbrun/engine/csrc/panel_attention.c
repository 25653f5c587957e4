/* Attention of many query rows against one set of keys, fp32, a panel of 16
 * query rows at a time, start to end in cache:
 *
 *   - shared prefixes ("cascade" decode attention): many decoding rows that
 *     start with the same cached pages attend to those keys together, and the
 *     decode kernel continues each row's softmax over its own keys
 *     (attention.c);
 *   - prefill chunks over plain causal attention: a chunk's queries against
 *     the sequence's keys from position 0, through its pages or its new keys.
 *
 * Per KV head the query rows are (token or row) x G query heads. Done with
 * torch, the shared prefix is a GEMM with an inner size of D = 64 (MKL runs
 * ~80 GFLOP/s on it here), a full pass of exp over the scores and a second
 * GEMM: about 50 GFLOP/s in all, 18% of a W-prefix run; torch's SDPA runs
 * causal prefill at ~50 GFLOP/s. Here each task is one panel of one KV head:
 *
 *   qp [D][16]      the panel's queries (scaled), packed k-major
 *   s  [L][16]      scores: the outer-product microkernel (panel.h) with the
 *                   keys as its tile rows, 6 keys per call, inner size D;
 *                   under a causal limit, keys past each row's position are
 *                   masked and keys past the panel's last row not computed
 *   softmax         per query row, along the keys: with 16 rows side by side
 *                   in two vectors, max, exp and sum are lane-wise (no
 *                   horizontal reductions)
 *   acc [16][D]     exp(s - max) @ values: the same microkernel shape with s
 *                   as the panel and 6 value columns per call, inner size L
 *
 * shared_prefix_f32 returns each row's softmax state (running max, sum of
 * exponentials, unnormalized output); prefill_attention_f32 the normalized
 * output.
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

/* Where the query rows of one KV head are: row r is query head head * G + r % G of q's row
 * rows[r / G] (shared prefixes), or of token r / G (prefill: rows NULL). Under a causal limit
 * (causal_from >= 0) row r sees keys [0, causal_from + r / G]; else all L. */
typedef struct {
  const int64_t* rows;
  int64_t G, H, causal_from;
} query_rows;

static inline int64_t query_offset(const query_rows* qr, int64_t head, int64_t r) {
  const int64_t row = qr->rows ? qr->rows[r / qr->G] : r / qr->G;
  return row * qr->H + head * qr->G + r % qr->G; /* index into [rows, H] */
}

static inline int64_t visible_keys(const query_rows* qr, int64_t r, int64_t L) {
  return qr->causal_from < 0 ? L : qr->causal_from + r / qr->G + 1;
}

/* s[k][i] = scaled query row i . key k for keys [0, L), then softmax along k (masked past each
 * row's limit); returns each row's max and sum in top, total. */
static void panel_softmax(const float* qp, const float* const* keys, int64_t L, int64_t D, const query_rows* qr,
                          int64_t r0, float* s, v8f top[2], v8f total[2]) {
  tile_block out;
  for (int64_t k0 = 0; k0 < L; k0 += TILE_NR) { /* the last tile repeats its last key; extra rows not kept */
    const float* tile[TILE_NR];
    for (int j = 0; j < TILE_NR; ++j) tile[j] = keys[k0 + j < L ? k0 + j : L - 1];
    panel_dots(qp, tile, 0, D, out);
    for (int j = 0; j < TILE_NR && k0 + j < L; ++j) memcpy(s + (k0 + j) * PANEL, out[j], sizeof out[j]);
  }
  if (qr->causal_from >= 0) /* the diagonal block: keys past a row's own position */
    for (int i = 0; i < PANEL; ++i)
      for (int64_t k = visible_keys(qr, r0 + i, L); k < L; ++k) s[k * PANEL + i] = -INFINITY;
  top[0] = top[1] = splat(-INFINITY);
  total[0] = total[1] = splat(0.f);
  for (int64_t k = 0; k < L; ++k)
    for (int h = 0; h < 2; ++h) top[h] = vmax(top[h], load_f32(s + k * PANEL + h * 8));
  for (int64_t k = 0; k < L; ++k)
    for (int h = 0; h < 2; ++h) {
      const v8f e = exp8(load_f32(s + k * PANEL + h * 8) - top[h]);
      store_f32(s + k * PANEL + h * 8, e);
      total[h] += e;
    }
}

/* Query rows [r0, r0 + count) of one KV head against its keys: with m and l, stores each row's
 * max, sum and unnormalized output (acc); without, the normalized output. */
static void attend_panel(const float* q, const float* const* keys, const float* const* values, int64_t L,
                         int64_t D, float scale, const query_rows* qr, int64_t head, int64_t r0, int count,
                         float* qp, float* s, float* m, float* l, float* acc) {
  int64_t at[PANEL]; /* each row's index into [rows, H] */
  for (int i = 0; i < count; ++i) at[i] = query_offset(qr, head, r0 + i);
  for (int64_t d = 0; d < D; ++d) /* pack: qp[d][i], zero rows past the end */
    for (int i = 0; i < PANEL; ++i) qp[d * PANEL + i] = i < count ? q[at[i] * D + d] * scale : 0.f;
  if (qr->causal_from >= 0) L = visible_keys(qr, r0 + count - 1, L); /* keys the panel's last row sees */
  v8f top[2], total[2];
  panel_softmax(qp, keys, L, D, qr, r0, s, top, total);
  float inverse[PANEL];
  for (int i = 0; i < count; ++i) {
    if (m) {
      m[at[i]] = top[i / 8][i % 8];
      l[at[i]] = total[i / 8][i % 8];
    }
    inverse[i] = m ? 1.f : 1.f / total[i / 8][i % 8];
  }
  tile_block out;
  for (int64_t d0 = 0; d0 < D; d0 += TILE_NR) {
    const int64_t first = d0 + TILE_NR <= D ? d0 : D - TILE_NR; /* the last tile overlaps: no reads past a row */
    panel_by_columns(s, values, first, L, out);
    for (int i = 0; i < count; ++i) {
      float* row = acc + at[i] * D + first;
      for (int j = 0; j < TILE_NR; ++j) row[j] = out[j][i] * inverse[i];
    }
  }
}

/* Row pointers of keys (or values) [0, L) of one KV head: in pages of P rows of a pool (pages),
 * or rows `stride` floats apart from `base` (pages NULL). */
static void key_rows(const float* base, const int64_t* pages, int64_t stride, int64_t L, int64_t P, int64_t D,
                     const float** out) {
  for (int64_t i = 0; i < L; ++i) out[i] = pages ? base + (pages[i / P] * P + i % P) * D : base + i * stride;
}

/* The tasks (KV head x panel of query rows), split between the threads; row pointers of keys and
 * values at keys[(2h) L ...] and [(2h + 1) L ...]. Returns 0, or -1 when scratch could not be
 * allocated (the output is then incomplete). */
static int attend_all(const float* q, const float** keys, int64_t L, int64_t Hkv, int64_t D, float scale,
                      const query_rows* qr, int64_t count, float* m, float* l, float* acc, int threads) {
  const int64_t panels = (count + PANEL - 1) / PANEL;
  int failed = 0;
  _Pragma("omp parallel num_threads(threads) reduction(|| : failed)") {
    float* qp = aligned_alloc(64, sizeof(float) * PANEL * D);
    float* s = aligned_alloc(64, sizeof(float) * PANEL * L);
    if (!qp || !s) failed = 1;
    _Pragma("omp for schedule(dynamic, 1)")
    for (int64_t task = 0; task < Hkv * panels; ++task) {
      if (failed) continue;
      const int64_t h = task % Hkv, r0 = (task / Hkv) * PANEL;
      const int n = (int)(count - r0 < PANEL ? count - r0 : PANEL);
      attend_panel(q, keys + 2 * h * L, keys + (2 * h + 1) * L, L, D, scale, qr, h, r0, n, qp, s, m, l, acc);
    }
    free(qp);
    free(s);
  }
  return failed ? -1 : 0;
}

/* Both entry points: the row pointers of keys [0, L) of every KV head (head h's rows start
 * head_offset * h floats into k and v; see key_rows), then the tasks. Returns 0, or -1. */
static int attend_keys(const float* q, const float* k, const float* v, int64_t head_offset, const int64_t* pages,
                       int64_t stride, int64_t L, int64_t P, int64_t Hkv, int64_t D, float scale,
                       const query_rows* qr, int64_t count, float* m, float* l, float* acc, int threads) {
  const float** pointers = malloc(sizeof(float*) * 2 * Hkv * L);
  if (!pointers) return -1;
  for (int64_t h = 0; h < Hkv; ++h) {
    key_rows(k + h * head_offset, pages, stride, L, P, D, pointers + (2 * h) * L);
    key_rows(v + h * head_offset, pages, stride, L, P, D, pointers + (2 * h + 1) * L);
  }
  const int status = attend_all(q, pointers, L, Hkv, D, scale, qr, count, m, l, acc, threads);
  free(pointers);
  return status;
}

/* Shared prefix: q [B, H, D]; pools [H_kv, NB, P, D]; rows [R] of q; pages [S] (L = S * P keys);
 * writes m, l [B, H] and acc [B, H, D] at those rows. Returns 0, or -1 (out of memory). */
int shared_prefix_f32(const float* q, const float* k, const float* v, const int64_t* rows, int64_t R,
                      const int64_t* pages, int64_t S, int64_t H, int64_t Hkv, int64_t NB, int64_t P, int64_t D,
                      float scale, float* m, float* l, float* acc, int threads) {
  const query_rows qr = {rows, H / Hkv, H, -1};
  return attend_keys(q, k, v, NB * P * D, pages, 0, S * P, P, Hkv, D, scale, &qr, R * (H / Hkv), m, l, acc,
                     threads);
}

/* Causal prefill of T query tokens at positions [from, from + T) over keys [0, from + T): q and out
 * [T, H, D]. Keys and values from the pools' pages [S] when `pages` is given ([H_kv, NB, P, D]),
 * else from k, v as [H_kv, T, D] rows with strides (head, token) in floats (from = 0: the chunk's
 * own keys). Returns 0, or -1 (out of memory). */
int prefill_attention_f32(const float* q, const float* k, const float* v, const int64_t* pages, int64_t NB,
                          int64_t P, int64_t head_stride, int64_t token_stride, int64_t T, int64_t from, int64_t H,
                          int64_t Hkv, int64_t D, float scale, float* out, int threads) {
  const query_rows qr = {0, H / Hkv, H, from};
  return attend_keys(q, k, v, pages ? NB * P * D : head_stride, pages, token_stride, from + T, P, Hkv, D, scale,
                     &qr, T * (H / Hkv), 0, 0, out, threads);
}
