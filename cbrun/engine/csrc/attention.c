/* Attention over the paged K/V cache, and K/V writes into it.
 *
 * paged_decode_{f32,bf16}: attention for rows with one query token each
 * (decodes, short chunks over a cached context), keys and values read in
 * place from the page pool (no gather copy).
 *
 *   q          [B, H, D]            query of each row
 *   k, v       [H_kv, NB, P, D]     one layer's key and value pages
 *   tables     [B, max_pages] int64 block ids; page i holds positions (first_page + i) * P ...
 *   kv_len     [B] int64            keys at positions < kv_len are visible ...
 *   kv_lo      [B] int64            ... and at positions >= kv_lo (sliding window; else 0)
 *   first_page [B] int64            logical page index of tables[b][0]
 *   out        [B, H, D]
 *   m0, l0     [B, H] fp32, acc0 [B, H, D] fp32, or all NULL: a softmax state to
 *              continue from (running max, sum of exponentials, unnormalized
 *              output) for keys before kv_lo that were attended elsewhere
 *              (a shared prefix attended for many rows at once)
 *
 * Work is split over (row, kv head) pairs. Each streams its keys and values
 * once, in segments of up to 64 keys (spanning pages when pages are small),
 * with an online softmax over its G = H / H_kv query heads (flash-decoding
 * style). Within a segment each page piece is scored for all G heads while it
 * sits in L1, in register blocks of 3 heads x 4 keys that load every key
 * vector once; then one softmax update per head; then each piece's values are
 * added for all heads, in blocks of 3 heads x 32 dims that load every value
 * vector once. (Scoring head by head over a whole segment re-read 32 KB per
 * head from L2, which halved the FMA rate: in an engine run the blocked form
 * spends 14% less time here, measured.) Runs of adjacent pages are left to the
 * hardware prefetcher; a segment on pages that jump is prefetched one ahead.
 *
 * paged_write: store new tokens' K/V rows at their flat slots (any element size).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "vec.h"

#define MAX_GD 4096 /* G * D per (row, kv head) */
#define SEG 64      /* keys scored per online-softmax segment */
#define MAX_G 64    /* query heads per kv head */

/* A dot product with one key row (for the keys left over from whole score blocks).
 * C = D / 8 vectors per head row. */
#define DEFINE_ROW_OPS(SUFFIX, T, LOADV)                                                               \
  static inline float dot_##SUFFIX(const v8f* q, const T* key, int64_t C) {                            \
    v8f a0 = splat(0.f), a1 = splat(0.f);                                                             \
    int64_t c = 0;                                                                                     \
    for (; c + 1 < C; c += 2) {                                                                        \
      a0 += q[c] * LOADV(key + c * 8);                                                                 \
      a1 += q[c + 1] * LOADV(key + c * 8 + 8);                                                         \
    }                                                                                                  \
    if (c < C) a0 += q[c] * LOADV(key + c * 8);                                                        \
    return hsum(a0 + a1);                                                                              \
  }

DEFINE_ROW_OPS(f32, float, load_f32)
DEFINE_ROW_OPS(bf16, uint16_t, load_bf16)

/* Keys of the page piece at position pos: to the end of its page of P rows, or to `end` if sooner. */
static inline int64_t piece_keys(int64_t pos, int64_t end, int64_t P) {
  const int64_t to_page_end = P - pos % P;
  return to_page_end < end - pos ? to_page_end : end - pos;
}

/* Row of position pos in a pool of P-row pages, found through `table` (table[0] is logical page `first`). */
static inline int64_t pool_row(const int64_t* table, int64_t first, int64_t pos, int64_t P) {
  return table[pos / P - first] * P + pos % P;
}

/* Prefetch into L2 the key and value rows of the chunk of up to SEG keys at
 * position `start` (rows of `row_bytes`; pages of P rows found through `table`). */
static inline void prefetch_chunk(const void* k, const void* v, const int64_t* table, int64_t first,
                                  int64_t start, int64_t hi, int64_t P, int64_t row_bytes) {
  const int64_t end = hi - start < SEG ? hi : start + SEG;
  for (int64_t pos = start; pos < end;) {
    const int64_t cnt = piece_keys(pos, end, P);
    const int64_t offset = pool_row(table, first, pos, P) * row_bytes;
    for (int64_t off = 0; off < cnt * row_bytes; off += 64) {
      __builtin_prefetch((const char*)k + offset + off, 0, 2);
      __builtin_prefetch((const char*)v + offset + off, 0, 2);
    }
    pos += cnt;
  }
}

/* Softmax statistics of one segment's scores s[0..n) for one query head:
 * turns s into exp(s - new max), updates the running max m and sum l, and
 * returns the factor that rescales what was accumulated before. */
static inline float online_softmax(float* s, int64_t n, float* m, float* l) {
  const int64_t padded = (n + 7) & ~(int64_t)7;
  for (int64_t j = n; j < padded; ++j) s[j] = -INFINITY;
  v8f mx = splat(*m);
  for (int64_t j = 0; j < padded; j += 8) mx = vmax(mx, load_f32(s + j));
  const float new_max = max_of(mx);
  const float correction = expf(*m - new_max); /* 0 on the first segment */
  v8f total = splat(0.f);
  for (int64_t j = 0; j < padded; j += 8) {
    v8f p = exp8(load_f32(s + j) - splat(new_max));
    store_f32(s + j, p);
    total += p;
  }
  *l = *l * correction + hsum(total);
  *m = new_max;
  return correction;
}

/* Whether the chunk of up to SEG keys at `start` lies on a page that does not follow its predecessor in
 * the pool (the hardware prefetcher follows runs of adjacent pages, not jumps). */
static inline int scattered(const int64_t* table, int64_t first, int64_t start, int64_t hi, int64_t P) {
  const int64_t end = hi - start < SEG ? hi : start + SEG;
  for (int64_t page = start / P - first; page <= (end - 1) / P - first; ++page)
    if (page > 0 && table[page] != table[page - 1] + 1) return 1;
  return 0;
}

/* Register blocks: HB query heads share every key and value vector loaded, KB keys
 * are scored at a time (HB * KB accumulators) and values are summed VB vectors
 * (8 * VB dims) at a time (HB * VB accumulators). */
#define HB 3
#define KB 4
#define VB 4
_Static_assert(HB == 3, "FOR_HEAD_BLOCKS has one branch per block size 1..3");

/* [sum(a[0]), ..., sum(a[3])] in lanes 0..3 (lanes 4..7 repeat them). */
static inline v8f reduce4(const v8f* a) {
  const v8f s01 = SHUFFLE(a[0], a[1], 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(a[0], a[1], 1, 3, 9, 11, 5, 7, 13, 15);
  const v8f s23 = SHUFFLE(a[2], a[3], 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(a[2], a[3], 1, 3, 9, 11, 5, 7, 13, 15);
  const v8f t = SHUFFLE(s01, s23, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(s01, s23, 1, 3, 9, 11, 5, 7, 13, 15);
  return t + SHUFFLE(t, t, 4, 5, 6, 7, 0, 1, 2, 3);
}

#define DEFINE_BLOCK_OPS(SUFFIX, T, LOADV)                                                              \
  /* s[g * SEG + j] = q_g . key_j for hb heads and n keys of one page piece */                          \
  static inline __attribute__((always_inline)) void score_piece_##SUFFIX(                               \
      const v8f* q, int hb, const T* keys, int64_t n, int64_t C, float* s) {                            \
    int64_t j = 0;                                                                                      \
    for (; j + KB <= n; j += KB) {                                                                      \
      v8f a[HB][KB];                                                                                    \
      for (int g = 0; g < hb; ++g)                                                                      \
        for (int i = 0; i < KB; ++i) a[g][i] = splat(0.f);                                              \
      for (int64_t c = 0; c < C; ++c)                                                                   \
        for (int i = 0; i < KB; ++i) {                                                                  \
          v8f key = LOADV(keys + (j + i) * C * 8 + c * 8);                                              \
          KEEP_IN_REGISTER(key);                                                                        \
          for (int g = 0; g < hb; ++g) a[g][i] += q[g * C + c] * key;                                   \
        }                                                                                               \
      for (int g = 0; g < hb; ++g) {                                                                    \
        const v8f sums = reduce4(a[g]);                                                                 \
        for (int i = 0; i < KB; ++i) s[g * SEG + j + i] = sums[i];                                      \
      }                                                                                                 \
    }                                                                                                   \
    for (; j < n; ++j)                                                                                  \
      for (int g = 0; g < hb; ++g) s[g * SEG + j] = dot_##SUFFIX(q + g * C, keys + j * C * 8, C);       \
  }                                                                                                     \
  /* acc[g * C + c] += sum_j p[g * SEG + j] * values[j][c] for hb heads and n keys of one page piece */   \
  static inline __attribute__((always_inline)) void value_piece_##SUFFIX(                               \
      v8f* acc, int hb, const float* p, const T* values, int64_t n, int64_t C) {                        \
    for (int64_t c0 = 0; c0 < C; c0 += VB) {                                                            \
      const int vb = C - c0 < VB ? (int)(C - c0) : VB;                                                  \
      v8f a[HB][VB];                                                                                    \
      for (int g = 0; g < hb; ++g)                                                                      \
        for (int c = 0; c < vb; ++c) a[g][c] = acc[g * C + c0 + c];                                     \
      for (int64_t j = 0; j < n; ++j) {                                                                 \
        v8f w[HB];                                                                                      \
        for (int g = 0; g < hb; ++g) w[g] = splat(p[g * SEG + j]);                                      \
        for (int c = 0; c < vb; ++c) {                                                                  \
          v8f value = LOADV(values + j * C * 8 + (c0 + c) * 8);                                         \
          KEEP_IN_REGISTER(value);                                                                      \
          for (int g = 0; g < hb; ++g) a[g][c] += w[g] * value;                                         \
        }                                                                                               \
      }                                                                                                 \
      for (int g = 0; g < hb; ++g)                                                                      \
        for (int c = 0; c < vb; ++c) acc[g * C + c0 + c] = a[g][c];                                     \
    }                                                                                                   \
  }

DEFINE_BLOCK_OPS(f32, float, load_f32)
DEFINE_BLOCK_OPS(bf16, uint16_t, load_bf16)

/* Runs CALL for each block of heads [g0, g0 + hb_) of G, with hb_ a constant 1..HB in each branch
 * (so the register blocks are sized at compile time). */
#define FOR_HEAD_BLOCKS(G, CALL)                                                                    \
  for (int64_t g0 = 0; g0 < (G); g0 += HB) {                                                        \
    const int64_t left = (G) - g0;                                                                  \
    if (left >= HB) { const int hb_ = HB; CALL; }                                                   \
    else if (left == 2) { const int hb_ = 2; CALL; }                                                \
    else { const int hb_ = 1; CALL; }                                                               \
  }

/* One (row, kv head): G query heads against keys [lo, hi) of one sequence, in
 * segments of at most SEG keys. Each page piece of a segment is scored for all
 * heads while it is in L1, then one softmax update per head, then each piece's
 * values are added for all heads. */
#define DEFINE_DECODE_TASK(SUFFIX, T, LOADV, STORE)                                                      \
  static inline __attribute__((always_inline)) void decode_task_##SUFFIX(                                \
      const T* q, const T* k, const T* v, const int64_t* table, int64_t first, int64_t lo, int64_t hi,   \
      T* out, int64_t G, int64_t D, int64_t P, float scale, const float* m0, const float* l0,           \
      const float* acc0) {                                                                               \
    const int64_t C = D / 8;                                                                             \
    v8f qf[MAX_GD / 8], acc[MAX_GD / 8];                                                                 \
    float scores[MAX_G * SEG] __attribute__((aligned(32)));                                              \
    float m[MAX_G], l[MAX_G];                                                                            \
    for (int64_t i = 0; i < G * C; ++i) {                                                                \
      qf[i] = LOADV(q + i * 8) * splat(scale);                                                           \
      acc[i] = acc0 ? load_f32(acc0 + i * 8) : splat(0.f);                                               \
    }                                                                                                    \
    for (int64_t g = 0; g < G; ++g) { m[g] = m0 ? m0[g] : -INFINITY; l[g] = l0 ? l0[g] : 0.f; }          \
    for (int64_t start = lo; start < hi;) {                                                              \
      const int64_t n = hi - start < SEG ? hi - start : SEG;                                             \
      if (start + n < hi && scattered(table, first, start + n, hi, P))                                  \
        prefetch_chunk(k, v, table, first, start + n, hi, P, D * (int64_t)sizeof(T));                    \
      for (int64_t pos = start; pos < start + n;) {                                                      \
        const int64_t cnt = piece_keys(pos, start + n, P);                                               \
        const T* keys = k + pool_row(table, first, pos, P) * D;                                          \
        float* s = scores + (pos - start);                                                               \
        FOR_HEAD_BLOCKS(G, score_piece_##SUFFIX(qf + g0 * C, hb_, keys, cnt, C, s + g0 * SEG))  \
        pos += cnt;                                                                                      \
      }                                                                                                  \
      for (int64_t g = 0; g < G; ++g) {                                                                  \
        const float correction = online_softmax(scores + g * SEG, n, m + g, l + g);                      \
        if (correction != 1.f)                                                                           \
          for (int64_t c = 0; c < C; ++c) acc[g * C + c] *= splat(correction);                           \
      }                                                                                                  \
      for (int64_t pos = start; pos < start + n;) {                                                      \
        const int64_t cnt = piece_keys(pos, start + n, P);                                               \
        const T* vals = v + pool_row(table, first, pos, P) * D;                                          \
        FOR_HEAD_BLOCKS(G, value_piece_##SUFFIX(acc + g0 * C, hb_, scores + g0 * SEG + (pos - start), vals, cnt, C)) \
        pos += cnt;                                                                                      \
      }                                                                                                  \
      start += n;                                                                                        \
    }                                                                                                    \
    for (int64_t g = 0; g < G; ++g) {                                                                    \
      const v8f inv = splat(l[g] > 0.f ? 1.f / l[g] : 0.f);                                              \
      for (int64_t c = 0; c < C; ++c) STORE(out + g * D + c * 8, acc[g * C + c] * inv);                  \
    }                                                                                                    \
  }                                                                                                      \
                                                                                                         \
  void paged_decode_##SUFFIX(const T* q, const T* k, const T* v, const int64_t* tables,                  \
                             const int64_t* kv_len, const int64_t* kv_lo, const int64_t* first_page,     \
                             T* out, int64_t B, int64_t H, int64_t D, int64_t Hkv, int64_t NB, int64_t P, \
                             int64_t max_pages, float scale, int threads, const float* m0,              \
                             const float* l0, const float* acc0) {                                       \
    const int64_t G = H / Hkv;                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                               \
    for (int64_t task = 0; task < B * Hkv; ++task) {                                                     \
      const int64_t b = task % B, h = task / B;                                                          \
      const int64_t offset = (b * H + h * G) * D;                                                        \
      const T* kh = k + h * NB * P * D;                                                                  \
      const T* vh = v + h * NB * P * D;                                                                  \
      const int64_t* table = tables + b * max_pages;                                                     \
      /* a softmax state to continue from (keys before kv_lo attended elsewhere), else none */              \
      const int64_t first_head = b * H + h * G;                                                          \
      const float* sm = m0 ? m0 + first_head : 0;                                                        \
      const float* sl = l0 ? l0 + first_head : 0;                                                        \
      const float* sa = acc0 ? acc0 + first_head * D : 0;                                                \
      /* constant head sizes let the compiler keep accumulators in registers */                          \
      if (D == 64)                                                                                       \
        decode_task_##SUFFIX(q + offset, kh, vh, table, first_page[b], kv_lo[b], kv_len[b], out + offset, \
                             G, 64, P, scale, sm, sl, sa);                                                                    \
      else if (D == 128)                                                                                 \
        decode_task_##SUFFIX(q + offset, kh, vh, table, first_page[b], kv_lo[b], kv_len[b], out + offset, \
                             G, 128, P, scale, sm, sl, sa);                                                                   \
      else                                                                                               \
        decode_task_##SUFFIX(q + offset, kh, vh, table, first_page[b], kv_lo[b], kv_len[b], out + offset, \
                             G, D, P, scale, sm, sl, sa);                                                                     \
    }                                                                                                    \
  }

DEFINE_DECODE_TASK(f32, float, load_f32, store_f32)
DEFINE_DECODE_TASK(bf16, uint16_t, load_bf16, store_bf16)

int64_t paged_decode_max_gd(void) { return MAX_GD; }

/* pool [H_kv, NB * P, D] (contiguous); src [H_kv, T, D] with strides (head, token) in
 * elements and unit stride along D; slots [T]. Copies T * H_kv rows of D elements. */
void paged_write(char* pool, const char* src, const int64_t* slots, int64_t T, int64_t Hkv, int64_t D,
                 int64_t slots_per_head, int64_t head_stride, int64_t token_stride, int64_t elem) {
  const int64_t row = D * elem;
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t t = 0; t < T; ++t)
      memcpy(pool + (h * slots_per_head + slots[t]) * row, src + (h * head_stride + t * token_stride) * elem, row);
}
