/* bf16 attention in AMX's order (paged_attend_bf16dp): scores and value sums as tdpbf16ps computes them.
 *
 * Included by attention.c after its row state and helpers. Both products of attention are bf16 dot products in
 * the order of tile_order.h (the linears' one bf16 arithmetic), so that AMX tiles can compute them and every
 * other CPU computes the same bits:
 *
 *   score(q, key) = C * scale, C from +0 over the D / 32 blocks of 16 element pairs of the head, ascending:
 *       E = fma(q[2k], key[2k], E)   O = fma(q[2k+1], key[2k+1], O)   C = C + (E + O)
 *     (the tiles: A = 16 key rows of 32 elements as they lie in the page, B = the query heads, paired).
 *   out[d] += sum over the segment's keys of w[j] * value[j][d], in blocks of 32 keys at absolute positions
 *     32m .. 32m + 31 (pairs of adjacent keys), each block C = C + (E + O) with E over its even keys and O
 *     over its odd ones; w[j] is the softmax weight exp(s_j - max) rounded to bf16 (the tiles' A operand is
 *     bf16), a key outside the segment a zero weight on a zero value, as the tiles' zero padding computes it.
 *
 * Denormal inputs read as zero and results flush (tile_order.h). A segment boundary (a multiple of SEG, itself a
 * multiple of 32, or the row's own first and last key) never cuts a block in two rows' different ways, so a key
 * range's bits depend on the row's keys alone: batch invariance as for the fp32 chains. The softmax statistics
 * (max, sum of the unrounded weights, the rescale between segments) stay fp32, as in the other kernels.
 *
 * Two variants compute it: the plain-C reference (tile_order.h's helpers, its own flushing) and the portable
 * twin (vector FMAs under the CPU's flush modes): the scores with keys in the lanes (each VEC keys' pairs
 * transposed once per run and shared by every head and row of the task), the values with dims in the lanes
 * (a 2 * VEC-dim chunk of a value row loaded once: its even dims by a shift, its odd dims by a mask, so the
 * accumulators hold a chunk's even dims, then its odd dims, until ta_unpair). The loader serves the twin only
 * after it equalled the reference on this CPU. */
#ifndef CBRUN_ATTENTION_TILE_H
#define CBRUN_ATTENTION_TILE_H

#include "amx_state.h"
#include "dp_pairs.h"
#include "tile_order.h"

#define TA_MAX_D 256                /* head size at most: the transposed keys of a lane group stay on the stack */
#define TA_BLOCK_KEYS TO_BLOCK_K    /* keys per value block: 16 pairs of adjacent keys */
#define TA_HBV (VEC == 16 ? 3 : 2)  /* heads per value pass: 4 * TA_HBV accumulators, within the registers */
_Static_assert(SEG % TA_BLOCK_KEYS == 0, "segments of whole value blocks");

/* A softmax weight p (finite, >= 0) rounded to the nearest bf16, ties to even, kept as fp32. */
static inline float ta_round_weight(float p) {
  union { float f; uint32_t u; } c = {p};
  c.u = (c.u + 0x7FFFu + ((c.u >> 16) & 1u)) & 0xFFFF0000u;
  return c.f;
}

/* Whether this process runs a variant: the reference and the twin everywhere, vdpbf16ps where AVX512-BF16 (and VL)
 * is there, the tiles where AMX-BF16 is granted. */
static inline int ta_isa_runs(void);
static inline int ta_variant_runs(int variant) {
  return variant == CB_DP_SCALAR || variant == CB_DP_TWIN || (variant == CB_DP_ISA && ta_isa_runs())
         || (variant == CB_DP_AMX && cb_amx_runs(CB_AMX_BF16));
}

/* ---- the plain-C reference ------------------------------------------------------------------------ */

static inline float ta_score_scalar(const uint16_t* q, const uint16_t* key, int64_t D, float scale) {
  float c = 0.f;
  for (int64_t b = 0; b < D; b += TO_BLOCK_K) c = to_block(c, q + b, key + b, 2);
  return dp_flush(c * scale);
}

/* acc [G, D] (dim order) += the values of keys [start, end) weighted by w (w[g * SEG + j] for key start + j,
 * bf16-rounded), block by block; the value rows through `table` (table[0] is logical page `first`). */
static void ta_values_scalar(float* acc, const float* w, const uint16_t* v, const int64_t* table, int64_t first,
                             int64_t start, int64_t end, int64_t G, int64_t D, int64_t P) {
  for (int64_t b = start / TA_BLOCK_KEYS * TA_BLOCK_KEYS; b < end; b += TA_BLOCK_KEYS)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) {
        float sums[2] = {0.f, 0.f}; /* E (even keys), O (odd keys) */
        for (int64_t pos = b; pos < b + TA_BLOCK_KEYS; ++pos) {
          const int in = pos >= start && pos < end;
          const float weight = in ? to_daz(w[g * SEG + pos - start]) : 0.f;
          const float value = in ? to_read(v[pool_row(table, first, pos, P) * D + d]) : 0.f;
          sums[pos % 2] = to_fma(weight, value, sums[pos % 2]);
        }
        acc[g * D + d] = to_add(to_daz(acc[g * D + d]), to_add(sums[0], sums[1]));
      }
}

/* ---- the portable twin ---------------------------------------------------------------------------- */

/* r[i][x] -> r[x][i] for a VEC x VEC block of 32-bit lanes: at the stage for bit k, rows i and i + k (bit k of i
 * clear) swap the lanes where bit k of the lane and of the row differ; after every bit, each lane has moved to the
 * transposed place. */
static inline void ta_transpose_block(vNu* r) {
#if VEC == 16
  for (int i = 0; i < 16; ++i)
    if (!(i & 1)) {
      const vNu a = r[i], b = r[i + 1];
      r[i] = SHUFFLE16(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[i + 1] = SHUFFLE16(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
  for (int i = 0; i < 16; ++i)
    if (!(i & 2)) {
      const vNu a = r[i], b = r[i + 2];
      r[i] = SHUFFLE16(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[i + 2] = SHUFFLE16(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
  for (int i = 0; i < 16; ++i)
    if (!(i & 4)) {
      const vNu a = r[i], b = r[i + 4];
      r[i] = SHUFFLE16(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
      r[i + 4] = SHUFFLE16(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
  for (int i = 0; i < 16; ++i)
    if (!(i & 8)) {
      const vNu a = r[i], b = r[i + 8];
      r[i] = SHUFFLE16(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
      r[i + 8] = SHUFFLE16(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
#else
  for (int i = 0; i < 8; ++i)
    if (!(i & 1)) {
      const vNu a = r[i], b = r[i + 1];
      r[i] = SHUFFLE(a, b, 0, 8, 2, 10, 4, 12, 6, 14);
      r[i + 1] = SHUFFLE(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
    }
  for (int i = 0; i < 8; ++i)
    if (!(i & 2)) {
      const vNu a = r[i], b = r[i + 2];
      r[i] = SHUFFLE(a, b, 0, 1, 8, 9, 4, 5, 12, 13);
      r[i + 2] = SHUFFLE(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    }
  for (int i = 0; i < 8; ++i)
    if (!(i & 4)) {
      const vNu a = r[i], b = r[i + 4];
      r[i] = SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11);
      r[i + 4] = SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    }
#endif
}

/* A key chunk's 16-bit halves permuted per 4 elements k .. k + 3 to (k + 2, k, k + 3, k + 1): its words become
 * the isa's re-paired operands (element 2p high with 2p + 2 low, then 2p + 1 with 2p + 3), so the transpose
 * after it delivers them ready for vdpbf16ps: one byte shuffle per chunk where the re-pairing of the transposed
 * pairs took six shifts and masks per two pairs for every VEC keys. */
typedef uint16_t ta_halves __attribute__((vector_size(VEC * 4)));
#if VEC == 16
#define TA_REPAIR_ORDER                                                                                         \
  2, 0, 3, 1, 6, 4, 7, 5, 10, 8, 11, 9, 14, 12, 15, 13, 18, 16, 19, 17, 22, 20, 23, 21, 26, 24, 27, 25, 30, 28, \
      31, 29
#else
#define TA_REPAIR_ORDER 2, 0, 3, 1, 6, 4, 7, 5, 10, 8, 11, 9, 14, 12, 15, 13
#endif
#if defined(__clang__)
#define TA_REPAIR_HALVES(v) ((vNu)__builtin_shufflevector((ta_halves)(v), (ta_halves)(v), TA_REPAIR_ORDER))
#else
#define TA_REPAIR_HALVES(v) ((vNu)__builtin_shuffle((ta_halves)(v), (ta_halves){TA_REPAIR_ORDER}))
#endif

/* kt [D / 2, VEC]: pair p of key i (rows D apart, m <= VEC of them) at kt[p * VEC + i], zero pairs past key m;
 * with `repaired`, the isa's words in place of the pairs (TA_REPAIR_HALVES). Inlined into each variant's
 * functions, so the shuffle compiles for the variant's instructions. */
static inline __attribute__((always_inline)) void ta_transpose_keys(const uint16_t* keys, int64_t m, int64_t D,
                                                                   uint32_t* kt, int repaired) {
  for (int64_t p0 = 0; p0 < D / 2; p0 += VEC) {
    vNu r[VEC];
    for (int i = 0; i < VEC; ++i) {
      if (i < m) r[i] = *(const vNu_mem*)(keys + i * D + 2 * p0);
      else r[i] = (vNu){0};
      if (repaired) r[i] = TA_REPAIR_HALVES(r[i]);
    }
    ta_transpose_block(r);
    for (int x = 0; x < VEC; ++x) *(vNu*)(void*)(kt + (p0 + x) * VEC) = r[x];
  }
}
#define TA_PAIRS 0    /* ta_transpose_keys: the twin's pairs */
#define TA_REPAIRED 1 /* the isa's re-paired words */

/* The m lanes of hb heads' score sums c[g], scaled (flush modes on), into s[g * SEG + i]. */
static inline __attribute__((always_inline)) void ta_store_scores(const vNf* c, int hb, float scale, int64_t m,
                                                                 float* s) {
  for (int g = 0; g < hb; ++g) {
    if (m == VEC) { /* a whole vector straight to s (a partial one by lanes: the compiler made that a rep movs) */
      storeN_f32(s + g * SEG, c[g] * splatN(scale));
      continue;
    }
    float lanes[VEC] __attribute__((aligned(64)));
    storeN_f32(lanes, c[g] * splatN(scale));
    for (int64_t i = 0; i < m; ++i) s[g * SEG + i] = lanes[i];
  }
}

/* The scores of hb heads (qw [hb, D], the query widened to fp32) against the m keys whose pair p lies at kt + p * ks
 * (a transposed block, or a page of paired keys), into s[g * SEG + i]; the caller holds the flush modes on. */
static inline __attribute__((always_inline)) void ta_score_keys_twin(const float* qw, int hb, const uint32_t* kt,
                                                                    int64_t ks, int64_t D, float scale, int64_t m,
                                                                    float* s) {
  vNf c[HB];
  for (int g = 0; g < hb; ++g) c[g] = splatN(0.f);
  for (int64_t b = 0; b < D / 2; b += TO_BLOCK_PAIRS) {
    vNf e[HB], o[HB];
    for (int g = 0; g < hb; ++g) e[g] = o[g] = splatN(0.f);
    for (int64_t p = b; p < b + TO_BLOCK_PAIRS; ++p) {
      const vNu raw = *(const vNu_mem*)(kt + p * ks);
      vNf low = twin_low(raw), high = twin_high(raw); /* element 2p, 2p + 1 of every key */
      KEEP_IN_REGISTER_N(low);
      KEEP_IN_REGISTER_N(high);
      for (int g = 0; g < hb; ++g) {
        e[g] += splatN(qw[g * D + 2 * p]) * low;
        o[g] += splatN(qw[g * D + 2 * p + 1]) * high;
      }
    }
    for (int g = 0; g < hb; ++g) c[g] = c[g] + (e[g] + o[g]);
  }
  ta_store_scores(c, hb, scale, m, s);
}

/* One block of 32 keys for hb heads: acc [hb, D] (paired chunks) += the block's values (rows[i], a zero row where
 * there is no key) weighted by w [hb, TA_BLOCK_KEYS] (zero where there is no key); flush modes on. Only the pairs
 * [k0, k1) hold keys: a pair of no key adds fma(+0, +0, E) = E + 0 to each chain, nothing before the first key
 * (the chains are +0 there) and, after the last, what one add of +0 does (a -0 becomes +0; it is idempotent). */
static inline __attribute__((always_inline)) void ta_value_block_twin(float* acc, int hb, const float* w,
                                                                     const uint16_t* const* rows, int64_t D, int k0,
                                                                     int k1) {
  for (int64_t c0 = 0; c0 < D; c0 += 2 * VEC) {
    vNf ee[TA_HBV], eo[TA_HBV], oe[TA_HBV], oo[TA_HBV]; /* even keys x even dims, x odd dims; odd keys x ... */
    for (int g = 0; g < hb; ++g) ee[g] = eo[g] = oe[g] = oo[g] = splatN(0.f);
    for (int k = k0; k < k1; ++k) {
      const vNu even_key = *(const vNu_mem*)(rows[2 * k] + c0), odd_key = *(const vNu_mem*)(rows[2 * k + 1] + c0);
      vNf e_lo = twin_low(even_key), e_hi = twin_high(even_key), o_lo = twin_low(odd_key), o_hi = twin_high(odd_key);
      KEEP_IN_REGISTER_N(e_lo);
      KEEP_IN_REGISTER_N(e_hi);
      KEEP_IN_REGISTER_N(o_lo);
      KEEP_IN_REGISTER_N(o_hi);
      for (int g = 0; g < hb; ++g) {
        const vNf we = splatN(w[g * TA_BLOCK_KEYS + 2 * k]), wo = splatN(w[g * TA_BLOCK_KEYS + 2 * k + 1]);
        ee[g] += we * e_lo;
        eo[g] += we * e_hi;
        oe[g] += wo * o_lo;
        oo[g] += wo * o_hi;
      }
    }
    if (k1 < TO_BLOCK_PAIRS)
      for (int g = 0; g < hb; ++g) {
        const vNf zero = splatN(0.f);
        ee[g] = ee[g] + zero, eo[g] = eo[g] + zero, oe[g] = oe[g] + zero, oo[g] = oo[g] + zero;
      }
    for (int g = 0; g < hb; ++g) {
      float* a = acc + g * D + c0;
      storeN_f32(a, loadN_f32(a) + (ee[g] + oe[g]));
      storeN_f32(a + VEC, loadN_f32(a + VEC) + (eo[g] + oo[g]));
    }
  }
}

/* The values of keys [start, end) for one row's G heads: acc [G, D] (paired chunks), w [G, SEG] the rounded
 * weights of keys start ...; flush modes on. */
static inline void ta_values_twin(float* acc, const float* w, const uint16_t* v, const int64_t* table, int64_t first,
                                  int64_t start, int64_t end, int64_t G, int64_t D, int64_t P) {
  static const uint16_t zero_row[TA_MAX_D] __attribute__((aligned(64)));
  const uint16_t* rows[TA_BLOCK_KEYS];
  float wb[MAX_G * TA_BLOCK_KEYS] __attribute__((aligned(64)));
  for (int64_t b = start / TA_BLOCK_KEYS * TA_BLOCK_KEYS; b < end; b += TA_BLOCK_KEYS) {
    for (int64_t i = 0; i < TA_BLOCK_KEYS; ++i) {
      const int64_t pos = b + i;
      const int in = pos >= start && pos < end;
      rows[i] = in ? v + pool_row(table, first, pos, P) * D : zero_row;
      for (int64_t g = 0; g < G; ++g) wb[g * TA_BLOCK_KEYS + i] = in ? w[g * SEG + pos - start] : 0.f;
    }
    const int k0 = (int)((start > b ? start - b : 0) / 2), k1 = (int)((end - b < TA_BLOCK_KEYS ? end - b + 1 : 32) / 2);
    for (int64_t g0 = 0; g0 < G; g0 += TA_HBV) {
      const int64_t left = G - g0;
      float* a = acc + g0 * D;
      const float* wg = wb + g0 * TA_BLOCK_KEYS;
      if (left >= TA_HBV) ta_value_block_twin(a, TA_HBV, wg, rows, D, k0, k1);
      else if (left == 2) ta_value_block_twin(a, 2, wg, rows, D, k0, k1);
      else ta_value_block_twin(a, 1, wg, rows, D, k0, k1);
    }
  }
}

/* A row's G heads' accumulators from the twin's paired chunks back to dim order (a permutation). */
static inline void ta_unpair(float* acc, int64_t G, int64_t D) {
  float chunk[2 * VEC];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c0 = 0; c0 < D; c0 += 2 * VEC) {
      float* a = acc + g * D + c0;
      for (int i = 0; i < VEC; ++i) chunk[2 * i] = a[i], chunk[2 * i + 1] = a[VEC + i];
      memcpy(a, chunk, sizeof chunk);
    }
}

/* ---- a segment: scores, the softmax update, the values ----------------------------------------------- */

/* The segment's softmax update for every row and head: s becomes the bf16-rounded weights, the accumulators
 * rescaled (attention.c's online softmax, fp32). */
static inline void ta_softmax(const row_state* st, int64_t count, float* scores, int64_t n, int64_t G, int64_t C) {
  for (int64_t i = 0; i < count; ++i)
    for (int64_t g = 0; g < G; ++g) {
      float* s = scores + (i * G + g) * SEG;
      const float correction = SEGMENT_SOFTMAX(s, n, st[i].m + g, st[i].l + g);
      if (correction != 1.f)
        for (int64_t c = 0; c < C; ++c) st[i].acc[g * C + c] *= splat(correction);
      for (int64_t j = 0; j < n; ++j) s[j] = ta_round_weight(s[j]);
    }
}

/* Keys [start, start + n) of one segment for `count` rows that all see them (attention.c's attend_segment_*: the
 * same contract and scratch), by the reference. */
static inline void attend_segment_ta_scalar(const row_state* st, int64_t count, const uint16_t* k, const uint16_t* v,
                                            const int64_t* table, int64_t first, int64_t start, int64_t n, int64_t G,
                                            int64_t D, int64_t P, float* scores) {
  for (int64_t pos = start; pos < start + n; ++pos) {
    const uint16_t* key = k + pool_row(table, first, pos, P) * D;
    for (int64_t i = 0; i < count; ++i)
      for (int64_t g = 0; g < G; ++g)
        scores[(i * G + g) * SEG + pos - start] = ta_score_scalar(st[i].qb + g * D, key, D, st[i].scale);
  }
  ta_softmax(st, count, scores, n, G, D / 8);
  for (int64_t i = 0; i < count; ++i)
    ta_values_scalar((float*)st[i].acc, scores + i * G * SEG, v, table, first, start, start + n, G, D, P);
}

/* The vector variants' segment (the twin's, or the isa's): each run's keys transposed VEC at a time, scored for
 * every row and head of the task by SCORE_KEYS; the values by VALUES (ta_values_twin's contract). */
#define TA_VECTOR_SEGMENT(NAME, ATTR, SCORE_KEYS, KEYS_AS, VALUES)                                                     \
  ATTR static inline void NAME(const row_state* st, int64_t count, const uint16_t* k, const uint16_t* v,       \
                               const int64_t* table, int64_t first, int64_t start, int64_t n, int64_t G,       \
                               int64_t D, int64_t P, float* scores) {                                          \
    const int64_t C = D / 8;                                                                                   \
    uint32_t kt[TA_MAX_D / 2 * VEC] __attribute__((aligned(64)));                                             \
    unsigned modes = dp_flush_on();                                                                            \
    for (int64_t pos = start; pos < start + n;) {                                                              \
      const int64_t cnt = run_keys(table, first, pos, start + n, P);                                           \
      const uint16_t* keys = k + pool_row(table, first, pos, P) * D;                                           \
      prefetch_l2(v + pool_row(table, first, pos, P) * D, cnt * D * (int64_t)sizeof(uint16_t));                \
      for (int64_t j = 0; j < cnt; j += VEC) {                                                                 \
        const int64_t m = cnt - j < VEC ? cnt - j : VEC;                                                       \
        ta_transpose_keys(keys + j * D, m, D, kt, KEYS_AS);                                                    \
        for (int64_t i = 0; i < count; ++i) {                                                                  \
          float* s = scores + i * G * SEG + (pos - start) + j;                                                 \
          const void* q = st[i].qf; /* the twin: the query widened; the isa: re-paired (DEFINE_TASK) */        \
          FOR_HEAD_BLOCKS(G, SCORE_KEYS(q, g0, hb_, kt, D, st[i].scale, m, s + g0 * SEG))                      \
        }                                                                                                      \
      }                                                                                                        \
      pos += cnt;                                                                                              \
    }                                                                                                          \
    dp_flush_restore(modes);                                                                                   \
    ta_softmax(st, count, scores, n, G, C);                                                                    \
    modes = dp_flush_on();                                                                                     \
    for (int64_t i = 0; i < count; ++i)                                                                        \
      VALUES((float*)st[i].acc, scores + i * G * SEG, v, table, first, start, start + n, G, D, P);            \
    dp_flush_restore(modes);                                                                                   \
  }

/* ---- keys laid out in pairs (the engine's pools where a vector variant serves) ----------------------- *
 * A pool of paired keys holds each page's keys pair-major: pair p (elements 2p, 2p + 1) of the key in slot x at
 * word p * P + x of the page (its D / 2 * P words), as paged_write lays them. VEC keys' pair p then lie side by
 * side, in the lanes the scores want, and are read in place: no transpose per step. The values stay row by row. */

/* Word 0 (pair 0) of the key at position pos in a pool of paired keys; its pair p at + p * P. */
static inline const uint32_t* ta_key_pairs(const uint16_t* k, const int64_t* table, int64_t first, int64_t pos,
                                           int64_t P, int64_t D) {
  return (const uint32_t*)(const void*)(k + table[pos / P - first] * P * D) + pos % P;
}

/* kt [D / 2, VEC] from m <= VEC paired keys side by side at kp (pair p at kp + p * P), zero pairs past m: a chunk
 * that reading VEC words in place would carry past its page's end. */
static inline void ta_gather_pairs(const uint32_t* kp, int64_t P, int64_t m, int64_t D, uint32_t* kt) {
  for (int64_t p = 0; p < D / 2; ++p)
    for (int64_t i = 0; i < VEC; ++i) kt[p * VEC + i] = i < m ? kp[p * P + i] : 0u;
}

/* key [D] of the paired key at kp, row by row (the reference's operand). */
static inline void ta_key_row(const uint32_t* kp, int64_t P, int64_t D, uint16_t* key) {
  for (int64_t p = 0; p < D / 2; ++p) memcpy(key + 2 * p, kp + p * P, sizeof(uint32_t));
}

/* attend_segment_ta_scalar over paired keys. */
static inline void attend_segment_ta_scalar_pairs(const row_state* st, int64_t count, const uint16_t* k,
                                                  const uint16_t* v, const int64_t* table, int64_t first,
                                                  int64_t start, int64_t n, int64_t G, int64_t D, int64_t P,
                                                  float* scores) {
  uint16_t key[TA_MAX_D];
  for (int64_t pos = start; pos < start + n; ++pos) {
    ta_key_row(ta_key_pairs(k, table, first, pos, P, D), P, D, key);
    for (int64_t i = 0; i < count; ++i)
      for (int64_t g = 0; g < G; ++g)
        scores[(i * G + g) * SEG + pos - start] = ta_score_scalar(st[i].qb + g * D, key, D, st[i].scale);
  }
  ta_softmax(st, count, scores, n, G, D / 8);
  for (int64_t i = 0; i < count; ++i)
    ta_values_scalar((float*)st[i].acc, scores + i * G * SEG, v, table, first, start, start + n, G, D, P);
}

/* TA_VECTOR_SEGMENT over paired keys: page piece by page piece, VEC keys read in place by SCORE_PAIRS (pair p at
 * + p * P), or gathered (stride VEC) where VEC words would run past the page. */
#define TA_PAIRED_SEGMENT(NAME, ATTR, SCORE_PAIRS, VALUES)                                                     \
  ATTR static inline void NAME(const row_state* st, int64_t count, const uint16_t* k, const uint16_t* v,       \
                               const int64_t* table, int64_t first, int64_t start, int64_t n, int64_t G,       \
                               int64_t D, int64_t P, float* scores) {                                          \
    const int64_t C = D / 8;                                                                                   \
    uint32_t kt[TA_MAX_D / 2 * VEC] __attribute__((aligned(64)));                                             \
    unsigned modes = dp_flush_on();                                                                            \
    for (int64_t pos = start; pos < start + n;) {                                                              \
      const int64_t cnt = piece_keys(pos, start + n, P);                                                       \
      const uint32_t* kp = ta_key_pairs(k, table, first, pos, P, D);                                           \
      prefetch_l2(v + pool_row(table, first, pos, P) * D, cnt * D * (int64_t)sizeof(uint16_t));                \
      for (int64_t j = 0; j < cnt; j += VEC) {                                                                 \
        const int64_t m = cnt - j < VEC ? cnt - j : VEC;                                                       \
        const uint32_t* src = kp + j;                                                                          \
        int64_t ks = P;                                                                                        \
        if (pos % P + j + VEC > P) { /* in place would read past the page */                                  \
          ta_gather_pairs(kp + j, P, m, D, kt);                                                                \
          src = kt, ks = VEC;                                                                                  \
        }                                                                                                      \
        for (int64_t i = 0; i < count; ++i) {                                                                  \
          float* s = scores + i * G * SEG + (pos - start) + j;                                                 \
          const void* q = st[i].qf;                                                                            \
          FOR_HEAD_BLOCKS(G, SCORE_PAIRS(q, g0, hb_, src, ks, D, st[i].scale, m, s + g0 * SEG))                \
        }                                                                                                      \
      }                                                                                                        \
      pos += cnt;                                                                                              \
    }                                                                                                          \
    dp_flush_restore(modes);                                                                                   \
    ta_softmax(st, count, scores, n, G, C);                                                                    \
    modes = dp_flush_on();                                                                                     \
    for (int64_t i = 0; i < count; ++i)                                                                        \
      VALUES((float*)st[i].acc, scores + i * G * SEG, v, table, first, start, start + n, G, D, P);            \
    dp_flush_restore(modes);                                                                                   \
  }

/* attend_dp_scores by a vector variant (NAME): HB heads at a time, PREPARE(q, heads, D, buffer) laying their query
 * out as SCORE_KEYS reads it, the keys transposed VEC at a time. */
#define TA_SCORES_ENTRY(NAME, ATTR, PREPARE, SCORE_KEYS, KEYS_AS)                                             \
  ATTR static void NAME(const uint16_t* q, const uint16_t* keys, int64_t G, int64_t n, int64_t D, float scale, \
                        float* out) {                                                                         \
    float prepared[HB * TA_MAX_D] __attribute__((aligned(64)));                                              \
    float s[HB * SEG];                                                                                        \
    uint32_t kt[TA_MAX_D / 2 * VEC] __attribute__((aligned(64)));                                            \
    for (int64_t h0 = 0; h0 < G; h0 += HB) {                                                                  \
      const int64_t heads = G - h0 < HB ? G - h0 : HB;                                                        \
      PREPARE(q + h0 * D, heads, D, (void*)prepared);                                                         \
      const unsigned modes = dp_flush_on();                                                                   \
      for (int64_t j = 0; j < n; j += VEC) {                                                                  \
        const int64_t m = n - j < VEC ? n - j : VEC;                                                          \
        ta_transpose_keys(keys + j * D, m, D, kt, KEYS_AS);                                                   \
        FOR_HEAD_BLOCKS(heads, SCORE_KEYS(prepared, g0, hb_, kt, D, scale, m, s + j + g0 * SEG))               \
      }                                                                                                       \
      dp_flush_restore(modes);                                                                                \
      for (int64_t g = 0; g < heads; ++g)                                                                     \
        for (int64_t j = 0; j < n; ++j) out[(h0 + g) * n + j] = s[g * SEG + j];                               \
    }                                                                                                         \
  }

/* q [heads, D] widened to fp32: the twin's query. */
static inline void ta_widen_queries(const uint16_t* q, int64_t heads, int64_t D, float* qw) {
  for (int64_t x = 0; x < heads * D; ++x) qw[x] = dp_bf16_to_f32(q[x]);
}

#define TA_TWIN_KEYS(q, g0, hb, kt, D, scale, m, s) \
  ta_score_keys_twin((const float*)(q) + (g0) * (D), hb, kt, VEC, D, scale, m, s)
#define TA_TWIN_PAIRS(q, g0, hb, kp, ks, D, scale, m, s) \
  ta_score_keys_twin((const float*)(q) + (g0) * (D), hb, kp, ks, D, scale, m, s)
TA_VECTOR_SEGMENT(attend_segment_ta_twin, , TA_TWIN_KEYS, TA_PAIRS, ta_values_twin)
TA_PAIRED_SEGMENT(attend_segment_ta_twin_pairs, , TA_TWIN_PAIRS, ta_values_twin)
TA_SCORES_ENTRY(ta_scores_twin_entry, , ta_widen_queries, TA_TWIN_KEYS, TA_PAIRS)

/* ---- isa: the scores on vdpbf16ps (AVX512-BF16) ------------------------------------------------------ *
 * vdpbf16ps adds a pair to a lane as t = fma(a.hi, b.hi, acc), acc = fma(a.lo, b.lo, t) (dp_pairs.h), so it takes
 * two steps of one chain at once where a dword holds element 2p in its high half and 2p + 2 in its low one: the
 * E chain's pairs p, p + 1 as (2p | 2p + 2), the O chain's as (2p + 1 | 2p + 3): the keys' words so permuted
 * before their transpose (TA_REPAIRED), the query re-paired alike once per row (ta_repair_queries). 8 lanes use the
 * instruction's ymm form (an AVX2 build on such a CPU). A build with -DCBRUN_TA_ISA_EMULATE computes the
 * instruction by that definition in portable FMAs and lets "isa" run on any CPU: the tests' check of the
 * re-pairing on CPUs without the instruction. */
#if DP_HAS_ISA_SOURCE || defined(CBRUN_TA_ISA_EMULATE)
#define TA_HAS_ISA 1
#if defined(CBRUN_TA_ISA_EMULATE)
#define TA_ISA_TARGET
static inline int ta_isa_runs(void) { return 1; }
static inline __attribute__((always_inline)) vNf ta_dp(vNf acc, vNu a, vNu b) {
  return dp_pair_twin(acc, twin_high(a), twin_high(b), twin_low(a), twin_low(b)); /* high pair first */
}
#else
#include <immintrin.h>
#define TA_ISA_TARGET __attribute__((target("avx512f,avx512vl,avx512bw,avx512bf16")))
static inline int ta_isa_runs(void) {
  __builtin_cpu_init();
  return dp_isa_runs() && __builtin_cpu_supports("avx512vl");
}
#if VEC == 16
TA_ISA_TARGET static inline __attribute__((always_inline)) vNf ta_dp(vNf acc, vNu a, vNu b) {
  return (vNf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}
#else
TA_ISA_TARGET static inline __attribute__((always_inline)) vNf ta_dp(vNf acc, vNu a, vNu b) {
  return (vNf)_mm256_dpbf16_ps((__m256)acc, (__m256bh)a, (__m256bh)b);
}
#endif
#endif

/* qr [G, D / 2] of q [G, D]: per head, for each even pair p, (q[2p] << 16 | q[2p + 2]) then (q[2p + 1] << 16 |
 * q[2p + 3]): the E and O operands of pairs p and p + 1. */
static inline void ta_repair_queries(const uint16_t* q, int64_t G, int64_t D, uint32_t* qr) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p = 0; p < D / 2; p += 2) {
      const uint16_t* e = q + g * D + 2 * p;
      qr[g * D / 2 + p] = (uint32_t)e[0] << 16 | e[2];
      qr[g * D / 2 + p + 1] = (uint32_t)e[1] << 16 | e[3];
    }
}

/* ta_score_keys_twin's scores with two pairs of each chain per instruction; qr the heads' re-paired queries. */
TA_ISA_TARGET static inline __attribute__((always_inline)) void ta_score_keys_isa(const uint32_t* qr, int hb,
                                                                                 const uint32_t* kt, int64_t D,
                                                                                 float scale, int64_t m, float* s) {
  vNf c[HB];
  for (int g = 0; g < hb; ++g) c[g] = splatN(0.f);
  for (int64_t b = 0; b < D / 2; b += TO_BLOCK_PAIRS) {
    vNf e[HB], o[HB];
    for (int g = 0; g < hb; ++g) e[g] = o[g] = splatN(0.f);
    for (int64_t p = b; p < b + TO_BLOCK_PAIRS; p += 2) {
      vNu even = *(const vNu*)(const void*)(kt + p * VEC), odd = *(const vNu*)(const void*)(kt + (p + 1) * VEC);
      KEEP_IN_REGISTER_N(even);
      KEEP_IN_REGISTER_N(odd);
      for (int g = 0; g < hb; ++g) {
        const uint32_t qe = qr[g * D / 2 + p], qo = qr[g * D / 2 + p + 1];
        e[g] = ta_dp(e[g], even, (vNu){0} + qe);
        o[g] = ta_dp(o[g], odd, (vNu){0} + qo);
      }
    }
    for (int g = 0; g < hb; ++g) c[g] = c[g] + (e[g] + o[g]);
  }
  ta_store_scores(c, hb, scale, m, s);
}

/* The value sums on vdpbf16ps: per 32-dim chunk, the E chain's keys 4j and 4j + 2 of a block in one instruction
 * (a dword of each dim holding key 4j's element high and key 4j + 2's low: one word interleave of the two rows),
 * the O chain's keys 4j + 1 and 4j + 3 alike, against the weights paired the same way; then C = C + (E + O) per
 * block as in the twin. The interleave keeps each 128-bit lane's dims together, so the accumulators hold a chunk's
 * dims 8L .. 8L + 3 of every lane L, then 8L + 4 .. 8L + 7, until ta_unpair_isa. */
#if VEC == 16
#define TA_WORDS_LOW                                                                                              \
  0, 32, 1, 33, 2, 34, 3, 35, 8, 40, 9, 41, 10, 42, 11, 43, 16, 48, 17, 49, 18, 50, 19, 51, 24, 56, 25, 57, 26, 58, \
      27, 59
#define TA_WORDS_HIGH                                                                                              \
  4, 36, 5, 37, 6, 38, 7, 39, 12, 44, 13, 45, 14, 46, 15, 47, 20, 52, 21, 53, 22, 54, 23, 55, 28, 60, 29, 61, 30, \
      62, 31, 63
#else
#define TA_WORDS_LOW 0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27
#define TA_WORDS_HIGH 4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15, 31
#endif
/* dword x of TA_INTERLEAVE(low, high, ORDER): (high's word << 16) | low's word, for the words ORDER picks (the
 * first or second four of each 128-bit lane): vpunpck{l,h}wd. */
#if defined(__clang__)
#define TA_INTERLEAVE(low, high, ORDER) \
  ((vNu)__builtin_shufflevector((ta_halves)(low), (ta_halves)(high), ORDER))
#else
#define TA_INTERLEAVE(low, high, ORDER) ((vNu)__builtin_shuffle((ta_halves)(low), (ta_halves)(high), (ta_halves){ORDER}))
#endif

/* One block of 32 keys for hb heads: acc [hb, D] (the isa's chunk order) += the block's values (rows[i]) weighted
 * by wq [hb, 16] (per 4 keys 4j .. 4j + 3: the E word (w[4j] | w[4j + 2]) at 2j, the O word at 2j + 1, bf16
 * halves, zero where there is no key); only the groups [j0, j1) hold keys, the pairs of no key adding what they add
 * in the twin (see ta_value_block_twin); flush modes on. */
TA_ISA_TARGET static inline __attribute__((always_inline)) void ta_value_block_isa(float* acc, int hb,
                                                                                  const uint32_t* wq,
                                                                                  const uint16_t* const* rows,
                                                                                  int64_t D, int j0, int j1,
                                                                                  int partial) {
  for (int64_t c0 = 0; c0 < D; c0 += 2 * VEC) {
    vNf el[TA_HBV], eh[TA_HBV], ol[TA_HBV], oh[TA_HBV]; /* E over the chunk's first dims, its second; O alike */
    for (int g = 0; g < hb; ++g) el[g] = eh[g] = ol[g] = oh[g] = splatN(0.f);
    for (int j = j0; j < j1; ++j) {
      const vNu k0 = *(const vNu_mem*)(rows[4 * j] + c0), k1 = *(const vNu_mem*)(rows[4 * j + 1] + c0);
      const vNu k2 = *(const vNu_mem*)(rows[4 * j + 2] + c0), k3 = *(const vNu_mem*)(rows[4 * j + 3] + c0);
      vNu e_lo = TA_INTERLEAVE(k2, k0, TA_WORDS_LOW), e_hi = TA_INTERLEAVE(k2, k0, TA_WORDS_HIGH);
      vNu o_lo = TA_INTERLEAVE(k3, k1, TA_WORDS_LOW), o_hi = TA_INTERLEAVE(k3, k1, TA_WORDS_HIGH);
      KEEP_IN_REGISTER_N(e_lo);
      KEEP_IN_REGISTER_N(e_hi);
      KEEP_IN_REGISTER_N(o_lo);
      KEEP_IN_REGISTER_N(o_hi);
      for (int g = 0; g < hb; ++g) {
        const vNu we = (vNu){0} + wq[g * 16 + 2 * j], wo = (vNu){0} + wq[g * 16 + 2 * j + 1];
        el[g] = ta_dp(el[g], e_lo, we);
        eh[g] = ta_dp(eh[g], e_hi, we);
        ol[g] = ta_dp(ol[g], o_lo, wo);
        oh[g] = ta_dp(oh[g], o_hi, wo);
      }
    }
    if (partial)
      for (int g = 0; g < hb; ++g) {
        const vNf zero = splatN(0.f);
        el[g] = el[g] + zero, eh[g] = eh[g] + zero, ol[g] = ol[g] + zero, oh[g] = oh[g] + zero;
      }
    for (int g = 0; g < hb; ++g) {
      float* a = acc + g * D + c0;
      storeN_f32(a, loadN_f32(a) + (el[g] + ol[g]));
      storeN_f32(a + VEC, loadN_f32(a + VEC) + (eh[g] + oh[g]));
    }
  }
}

/* The E and O words of 4 keys' bf16-rounded weights w4: (w4[0] | w4[2]), (w4[1] | w4[3]), the first one high. */
static inline void ta_pair_weights(const float* w4, uint32_t* words) {
  uint32_t u[4];
  memcpy(u, w4, sizeof u);
  words[0] = (u[0] & 0xFFFF0000u) | u[2] >> 16;
  words[1] = (u[1] & 0xFFFF0000u) | u[3] >> 16;
}

/* ta_values_twin's contract on vdpbf16ps; acc in the isa's chunk order. A block within [start, end) takes its rows
 * page piece by page piece and its weights straight from w; the first and last block, key by key with zeros. */
TA_ISA_TARGET static inline void ta_values_isa(float* acc, const float* w, const uint16_t* v, const int64_t* table,
                                               int64_t first, int64_t start, int64_t end, int64_t G, int64_t D,
                                               int64_t P) {
  static const uint16_t zero_row[TA_MAX_D] __attribute__((aligned(64)));
  const uint16_t* rows[TA_BLOCK_KEYS];
  float wb[TA_BLOCK_KEYS];                                                /* one head's weights, zeros outside */
  uint32_t wq[MAX_G * TA_BLOCK_KEYS / 2] __attribute__((aligned(64))); /* paired for the instruction */
  for (int64_t b = start / TA_BLOCK_KEYS * TA_BLOCK_KEYS; b < end; b += TA_BLOCK_KEYS) {
    if (b >= start && b + TA_BLOCK_KEYS <= end) {
      for (int64_t i = 0; i < TA_BLOCK_KEYS;) {
        const uint16_t* row = v + pool_row(table, first, b + i, P) * D;
        const int64_t cnt = piece_keys(b + i, b + TA_BLOCK_KEYS, P);
        for (int64_t t = 0; t < cnt; ++t) rows[i + t] = row + t * D;
        i += cnt;
      }
      for (int64_t g = 0; g < G; ++g)
        for (int j = 0; j < TA_BLOCK_KEYS / 4; ++j) ta_pair_weights(w + g * SEG + (b - start) + 4 * j, wq + g * 16 + 2 * j);
    } else {
      for (int64_t i = 0; i < TA_BLOCK_KEYS; ++i) {
        const int64_t pos = b + i;
        rows[i] = pos >= start && pos < end ? v + pool_row(table, first, pos, P) * D : zero_row;
      }
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t i = 0; i < TA_BLOCK_KEYS; ++i) {
          const int64_t pos = b + i;
          wb[i] = pos >= start && pos < end ? w[g * SEG + pos - start] : 0.f;
        }
        for (int j = 0; j < TA_BLOCK_KEYS / 4; ++j) ta_pair_weights(wb + 4 * j, wq + g * 16 + 2 * j);
      }
    }
    const int64_t k0 = (start > b ? start - b : 0) / 2, k1 = (end - b < TA_BLOCK_KEYS ? end - b + 1 : 32) / 2;
    const int j0 = (int)(k0 / 2), j1 = (int)((k1 + 1) / 2), partial = k1 < TO_BLOCK_PAIRS;
    for (int64_t g0 = 0; g0 < G; g0 += TA_HBV) {
      const int64_t left = G - g0;
      float* a = acc + g0 * D;
      const uint32_t* wg = wq + g0 * 16;
      if (left >= TA_HBV) ta_value_block_isa(a, TA_HBV, wg, rows, D, j0, j1, partial);
      else if (left == 2) ta_value_block_isa(a, 2, wg, rows, D, j0, j1, partial);
      else ta_value_block_isa(a, 1, wg, rows, D, j0, j1, partial);
    }
  }
}

/* A row's G heads' accumulators from the isa's chunk order back to dim order (a permutation). */
static inline void ta_unpair_isa(float* acc, int64_t G, int64_t D) {
  float chunk[2 * VEC];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c0 = 0; c0 < D; c0 += 2 * VEC) {
      float* a = acc + g * D + c0;
      for (int x = 0; x < VEC; ++x) chunk[8 * (x / 4) + x % 4] = a[x], chunk[8 * (x / 4) + 4 + x % 4] = a[VEC + x];
      memcpy(a, chunk, sizeof chunk);
    }
}

/* The isa's E and O words of pairs p and p + 1 (vectors a, b of VEC keys' natural pairs): dword i of E = element
 * 2p of key i (a's low half) high | element 2p + 2 (b's low half) low; O the same of the high halves: vpermt2w. */
#if VEC == 16
#define TA_E_WORDS                                                                                                \
  32, 0, 34, 2, 36, 4, 38, 6, 40, 8, 42, 10, 44, 12, 46, 14, 48, 16, 50, 18, 52, 20, 54, 22, 56, 24, 58, 26, 60, 28, \
      62, 30
#define TA_O_WORDS                                                                                                \
  33, 1, 35, 3, 37, 5, 39, 7, 41, 9, 43, 11, 45, 13, 47, 15, 49, 17, 51, 19, 53, 21, 55, 23, 57, 25, 59, 27, 61, 29, \
      63, 31
#else
#define TA_E_WORDS 16, 0, 18, 2, 20, 4, 22, 6, 24, 8, 26, 10, 28, 12, 30, 14
#define TA_O_WORDS 17, 1, 19, 3, 21, 5, 23, 7, 25, 9, 27, 11, 29, 13, 31, 15
#endif

/* ta_score_keys_isa's scores from natural pairs in place (pair p of the m keys at kp + p * ks). */
TA_ISA_TARGET static inline __attribute__((always_inline)) void ta_score_pairs_isa(const uint32_t* qr, int hb,
                                                                                  const uint32_t* kp, int64_t ks,
                                                                                  int64_t D, float scale, int64_t m,
                                                                                  float* s) {
  vNf c[HB];
  for (int g = 0; g < hb; ++g) c[g] = splatN(0.f);
  for (int64_t b = 0; b < D / 2; b += TO_BLOCK_PAIRS) {
    vNf e[HB], o[HB];
    for (int g = 0; g < hb; ++g) e[g] = o[g] = splatN(0.f);
    for (int64_t p = b; p < b + TO_BLOCK_PAIRS; p += 2) {
      const vNu first = *(const vNu_mem*)(kp + p * ks), second = *(const vNu_mem*)(kp + (p + 1) * ks);
      vNu even = TA_INTERLEAVE(first, second, TA_E_WORDS), odd = TA_INTERLEAVE(first, second, TA_O_WORDS);
      KEEP_IN_REGISTER_N(even);
      KEEP_IN_REGISTER_N(odd);
      for (int g = 0; g < hb; ++g) {
        const uint32_t qe = qr[g * D / 2 + p], qo = qr[g * D / 2 + p + 1];
        e[g] = ta_dp(e[g], even, (vNu){0} + qe);
        o[g] = ta_dp(o[g], odd, (vNu){0} + qo);
      }
    }
    for (int g = 0; g < hb; ++g) c[g] = c[g] + (e[g] + o[g]);
  }
  ta_store_scores(c, hb, scale, m, s);
}

#define TA_ISA_KEYS(q, g0, hb, kt, D, scale, m, s) \
  ta_score_keys_isa((const uint32_t*)(q) + (g0) * (D) / 2, hb, kt, D, scale, m, s)
TA_VECTOR_SEGMENT(attend_segment_ta_isa, TA_ISA_TARGET, TA_ISA_KEYS, TA_REPAIRED, ta_values_isa)
#define TA_ISA_PAIRS(q, g0, hb, kp, ks, D, scale, m, s) \
  ta_score_pairs_isa((const uint32_t*)(q) + (g0) * (D) / 2, hb, kp, ks, D, scale, m, s)
TA_PAIRED_SEGMENT(attend_segment_ta_isa_pairs, TA_ISA_TARGET, TA_ISA_PAIRS, ta_values_isa)
TA_SCORES_ENTRY(ta_scores_isa_entry, TA_ISA_TARGET, ta_repair_queries, TA_ISA_KEYS, TA_REPAIRED)
#else
#define TA_HAS_ISA 0
static inline int ta_isa_runs(void) { return 0; }
#endif

/* ---- AMX: tdpbf16ps itself ------------------------------------------------------------------------- *
 * The scores as C [16 keys, G heads] = 16 key rows as they lie in the page (A, one 32-element block per
 * instruction) x the row's query heads paired (B [16 pairs, G]); the values as C [G heads, 16 dims] = the block's
 * weights (A [G, 32 keys], bf16) x 16 dims of the block's values with adjacent keys paired (B [16 pairs, 16 dims],
 * repacked per block). Tile per tile the order is tile_order.h's; the multiply by the scale and the softmax run in
 * vectors as in the twin. Groups of more than 16 query heads take the twin (the same bits). */
#if CB_HAS_AMX_SOURCE
#include <immintrin.h>
#define TA_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define TA_AMX_MAX_G 16

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} ta_tile_config;

/* tmm0 scores (C), tmm1 key rows (A), tmm2 query pairs (B); tmm3 value sums (C), tmm4 weights (A), tmm5 values (B). */
TA_AMX_TARGET static void ta_amx_configure(int64_t G) {
  ta_tile_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  const uint8_t rows[6] = {16, 16, 16, (uint8_t)G, (uint8_t)G, 16};
  const uint16_t colsb[6] = {(uint16_t)(G * 4), 64, (uint16_t)(G * 4), 64, 64, 64};
  for (int t = 0; t < 6; ++t) c.rows[t] = rows[t], c.colsb[t] = colsb[t];
  _tile_loadconfig(&c);
}

TA_AMX_TARGET static void ta_amx_release(void) { _tile_release(); }

/* qt [D / 2, 16]: pair p of head g's query (qb [G, D]) at qt[p * 16 + g]: B tiles of 16 pairs, 64 bytes a row. */
static inline void ta_pair_queries(const uint16_t* qb, int64_t G, int64_t D, uint32_t* qt) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p = 0; p < D / 2; ++p) memcpy(qt + p * 16 + g, qb + g * D + 2 * p, sizeof(uint32_t));
}

/* The scores of G heads (qt) against the m <= 16 keys at `keys` (rows D apart) into s[g * SEG + j]. */
TA_AMX_TARGET static void ta_score_keys_amx(const uint32_t* qt, int64_t G, const uint16_t* keys, int64_t m, int64_t D,
                                            float scale, float* s) {
  uint16_t padded[16 * TA_MAX_D] __attribute__((aligned(64)));
  const uint16_t* a = keys;
  if (m < 16) { /* 16 tile rows: the keys past m zero, not the pool's next rows */
    memcpy(padded, keys, (size_t)(m * D) * sizeof(uint16_t));
    memset(padded + m * D, 0, (size_t)((16 - m) * D) * sizeof(uint16_t));
    a = padded;
  }
  _tile_zero(0);
  for (int64_t b = 0; b < D / TO_BLOCK_K; ++b) {
    _tile_loadd(1, a + TO_BLOCK_K * b, D * 2);
    _tile_loadd(2, qt + b * TO_BLOCK_PAIRS * 16, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  float ct[16][16] __attribute__((aligned(64)));
  _tile_stored(0, ct, 64);
  for (int64_t j = 0; j < m; ++j)
    for (int64_t g = 0; g < G; ++g) s[g * SEG + j] = dp_flush(ct[j][g] * scale);
}

/* ta_values_twin's sums on tiles: acc [G, D] in dim order. */
TA_AMX_TARGET static void ta_values_amx(float* acc, const float* w, const uint16_t* v, const int64_t* table,
                                        int64_t first, int64_t start, int64_t end, int64_t G, int64_t D, int64_t P) {
  static const uint16_t zero_row[TA_MAX_D] __attribute__((aligned(64)));
  const uint16_t* rows[TA_BLOCK_KEYS];
  uint16_t wb[TA_AMX_MAX_G * TA_BLOCK_KEYS] __attribute__((aligned(64))); /* A: G rows of 32 bf16 weights */
  uint32_t vb[TO_BLOCK_PAIRS * 16] __attribute__((aligned(64)));          /* B: 16 key pairs x 16 dims */
  for (int64_t b = start / TA_BLOCK_KEYS * TA_BLOCK_KEYS; b < end; b += TA_BLOCK_KEYS) {
    for (int64_t i = 0; i < TA_BLOCK_KEYS; ++i) {
      const int64_t pos = b + i;
      const int in = pos >= start && pos < end;
      rows[i] = in ? v + pool_row(table, first, pos, P) * D : zero_row;
      for (int64_t g = 0; g < G; ++g) {
        union { float f; uint32_t u; } weight = {in ? w[g * SEG + pos - start] : 0.f};
        wb[g * TA_BLOCK_KEYS + i] = (uint16_t)(weight.u >> 16); /* exact: the weights are rounded to bf16 */
      }
    }
    _tile_loadd(4, wb, 64);
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      for (int p = 0; p < TO_BLOCK_PAIRS; ++p)
        for (int x = 0; x < 16; ++x)
          vb[p * 16 + x] = (uint32_t)rows[2 * p][d0 + x] | (uint32_t)rows[2 * p + 1][d0 + x] << 16;
      _tile_loadd(3, acc + d0, D * 4);
      _tile_loadd(5, vb, 64);
      _tile_dpbf16ps(3, 4, 5);
      _tile_stored(3, acc + d0, D * 4);
    }
  }
}

/* attend_dp_scores and attend_dp_values on tiles (G <= TA_AMX_MAX_G): configured, computed, released. */
TA_AMX_TARGET static void ta_scores_amx_entry(const uint16_t* q, const uint16_t* keys, int64_t G, int64_t n, int64_t D,
                                              float scale, float* out) {
  uint32_t qt[TA_MAX_D / 2 * 16] __attribute__((aligned(64)));
  float s[TA_AMX_MAX_G * SEG];
  ta_amx_configure(G);
  ta_pair_queries(q, G, D, qt);
  const unsigned modes = dp_flush_on();
  for (int64_t j = 0; j < n; j += 16) ta_score_keys_amx(qt, G, keys + j * D, n - j < 16 ? n - j : 16, D, scale, s + j);
  dp_flush_restore(modes);
  ta_amx_release();
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < n; ++j) out[g * n + j] = s[g * SEG + j];
}

TA_AMX_TARGET static void ta_values_amx_entry(float* out, const float* w, const uint16_t* values, const int64_t* table,
                                              int64_t G, int64_t n, int64_t D) {
  ta_amx_configure(G);
  ta_values_amx(out, w, values, table, 0, 0, n, G, D, n);
  ta_amx_release();
}

/* attend_segment_ta_twin's contract, on tiles (G <= TA_AMX_MAX_G; the task configured them). */
TA_AMX_TARGET static inline void attend_segment_ta_amx(const row_state* st, int64_t count, const uint16_t* k,
                                                       const uint16_t* v, const int64_t* table, int64_t first,
                                                       int64_t start, int64_t n, int64_t G, int64_t D, int64_t P,
                                                       float* scores) {
  uint32_t qt[TA_MAX_D / 2 * 16] __attribute__((aligned(64)));
  unsigned modes = dp_flush_on(); /* for the scale's multiply; the tiles flush whatever MXCSR holds */
  for (int64_t i = 0; i < count; ++i) {
    ta_pair_queries(st[i].qb, G, D, qt);
    for (int64_t pos = start; pos < start + n;) {
      const int64_t cnt = run_keys(table, first, pos, start + n, P);
      const uint16_t* keys = k + pool_row(table, first, pos, P) * D;
      for (int64_t j = 0; j < cnt; j += 16)
        ta_score_keys_amx(qt, G, keys + j * D, cnt - j < 16 ? cnt - j : 16, D, st[i].scale,
                          scores + i * G * SEG + (pos - start) + j);
      pos += cnt;
    }
  }
  dp_flush_restore(modes);
  ta_softmax(st, count, scores, n, G, D / 8);
  for (int64_t i = 0; i < count; ++i)
    ta_values_amx((float*)st[i].acc, scores + i * G * SEG, v, table, first, start, start + n, G, D, P);
}
#endif

#endif
