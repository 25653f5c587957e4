/* Attention over the paged K/V cache, and K/V writes into it.
 *
 * paged_attend_{f32,bf16}: every query token of a step (decodes, prefill chunks,
 * continued chunks over a cached prefix) is a row with its own key range,
 * attended in place in the page pool (no gather copy).
 *
 *   q          [R, H, D]            query of each row, rows ldq apart (heads D apart, unit stride)
 *   k, v       [H_kv, NB, P, D]     one layer's key and value pages
 *   tables     [S, max_pages] int64 block ids of each sequence; page i holds positions (first_page + i) * P ...
 *   row_seq    [R] int64            the sequence (table) of each row
 *   first_page [S] int64            logical page index of tables[s][0]
 *   kv_len     [R] int64            keys at positions < kv_len are visible ...
 *   kv_lo      [R] int64            ... and at positions >= kv_lo (sliding window; else 0)
 *   out        [R, H, D]
 *   tasks      rows task_rows[task_start[t] .. task_start[t + 1]) with `task_shared[t]` leading keys on
 *              the same blocks (a shared prefix, or a prefill chunk's cached context), a multiple of SEG
 *
 * Batch invariance: a row's result depends on its query and keys alone. Keys
 * are taken in segments that end at multiples of SEG (absolute positions) and
 * the segment's own key range; each segment is split into runs of pages that
 * follow each other in the pool (a page piece where they do not); every score is one multiply-add chain over D and a fixed lane
 * sum (bf16 with D a multiple of 32: AMX's order, attention_tile.h); each segment updates the online softmax (flash-decoding style) in key
 * order. So a decode, the same token inside a prefill chunk of any length,
 * its recompute after a soft reset, and a row attending a shared prefix with
 * a hundred others all give the same bits. Rows sharing leading blocks
 * (a common system prompt, n samples of one prompt, the tokens of one chunk)
 * run as one task: each run of a shared segment is scored, and later
 * summed, for the task's rows one after another while it sits in L1 (in passes
 * of as many rows as keep their scores in L1 too), so shared keys come from
 * memory once per task ("cascade" attention without a second kernel or a
 * merge step).
 *
 * Work is split over (task, kv head) pairs. Within a segment each run is scored
 * for the G = H / H_kv query heads, in register blocks of 3 heads x 4 keys that
 * load every key vector once (the heads' query vectors held in registers, so
 * loads stay fewer than FMAs; with AVX-512, 3 pairs of heads x 4 keys, a pair in
 * 16 lanes); then one softmax update per head; then each run's values are added
 * for all heads, in blocks of 3 heads x 32 dims that load every value vector once
 * (3 heads x 64 dims, 16 lanes, with AVX-512; bf16 values then 32 dims per load, value_pairs16). Runs of
 * adjacent pages are left to the hardware prefetcher; a segment on pages that
 * jump is prefetched one ahead; each run's values are prefetched into L2 while
 * its keys are scored.
 *
 * paged_attend_bf16dp: bf16 with D a multiple of 32, scores and value sums in AMX's order (attention_tile.h:
 * the portable twin or the plain-C reference, one set of bits).
 *
 * paged_write: store new tokens' K/V rows at their flat slots (any element size).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cbrun_abi.h"
#include "dp_pairs.h"

#define MAX_GD 4096 /* G * D per (row, kv head) */
#ifndef SEG
#define SEG 128 /* keys per online-softmax segment: fewer, longer segments measured faster than 64 (fewer rescales) */
#endif
#define MAX_G 64    /* query heads per kv head */
_Static_assert(SEG % 16 == 0, "segments of whole 16-lane vectors (online_softmax16)");

/* A dot product with one key row (for the keys left over from whole score blocks): one accumulator
 * over the C = D / 8 vectors of a head row and the lane sum of reduce4, so a key's score has the same
 * bits whether it falls in a block of KB keys or not. */
#define DEFINE_ROW_OPS(SUFFIX, T, LOADV)                                                               \
  static inline float dot_##SUFFIX(const v8f* q, const T* key, int64_t C) {                            \
    v8f a = splat(0.f);                                                                                \
    for (int64_t c = 0; c < C; ++c) a += q[c] * LOADV(key + c * 8);                                    \
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));                          \
  }

DEFINE_ROW_OPS(f32, float, load_f32)
DEFINE_ROW_OPS(bf16, uint16_t, load_bf16)

/* Row of position pos in a pool of P-row pages, found through `table` (table[0] is logical page `first`). */
static inline int64_t pool_row(const int64_t* table, int64_t first, int64_t pos, int64_t P) {
  return table[pos / P - first] * P + pos % P;
}

/* Keys of the page piece at position pos: to the end of its page of P rows, or to `end` if sooner. */
static inline int64_t piece_keys(int64_t pos, int64_t end, int64_t P) {
  const int64_t to_page_end = P - pos % P;
  return to_page_end < end - pos ? to_page_end : end - pos;
}

/* Keys of the run at position pos: page pieces up to `end` while each next page follows its predecessor in the
 * pool (a prompt's pages mostly do), so the keys lie at consecutive rows. Computing a run at once or piece by
 * piece is the same arithmetic in the same order (scores are per key; values are summed key after key); a
 * longer run only pays each pass's set-up (accumulator loads and stores) fewer times. */
static inline int64_t run_keys(const int64_t* table, int64_t first, int64_t pos, int64_t end, int64_t P) {
  int64_t stop = pos + piece_keys(pos, end, P);
  while (stop < end && table[stop / P - first] == table[(stop - 1) / P - first] + 1) stop += piece_keys(stop, end, P);
  return stop - pos;
}

/* Prefetch `bytes` from p into L2, a cache line at a time: L2, not L1, since the scores stream keys through L1
 * meanwhile and evicted what was prefetched there before it was read (measured on a decode replay). */
static inline void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char*)p + off, 0, 2);
}

/* Prefetch into L2 the key and value rows of the chunk of up to SEG keys at
 * position `start` (rows of `row_bytes`; pages of P rows found through `table`). */
static inline void prefetch_chunk(const void* k, const void* v, const int64_t* table, int64_t first,
                                  int64_t start, int64_t hi, int64_t P, int64_t row_bytes) {
  const int64_t end = hi - start < SEG ? hi : start + SEG;
  for (int64_t pos = start; pos < end;) {
    const int64_t cnt = piece_keys(pos, end, P);
    const int64_t offset = pool_row(table, first, pos, P) * row_bytes;
    prefetch_l2((const char*)k + offset, cnt * row_bytes);
    prefetch_l2((const char*)v + offset, cnt * row_bytes);
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

typedef float v4f __attribute__((vector_size(16)));

/* [sum(a[0]), ..., sum(a[3])], each lane sum in dot_'s order ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). */
static inline v4f reduce4(const v8f* a) {
  const v8f s01 = SHUFFLE(a[0], a[1], 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(a[0], a[1], 1, 3, 9, 11, 5, 7, 13, 15);
  const v8f s23 = SHUFFLE(a[2], a[3], 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(a[2], a[3], 1, 3, 9, 11, 5, 7, 13, 15);
  const v8f t = SHUFFLE(s01, s23, 0, 2, 8, 10, 4, 6, 12, 14) + SHUFFLE(s01, s23, 1, 3, 9, 11, 5, 7, 13, 15);
  return __builtin_shufflevector(t, t, 0, 1, 2, 3) + __builtin_shufflevector(t, t, 4, 5, 6, 7);
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
      for (int64_t c = 0; c < C; ++c) {                                                                 \
        v8f qc[HB]; /* in registers: with q as a memory operand of each FMA, loads outnumber FMAs */    \
        for (int g = 0; g < hb; ++g) {                                                                  \
          qc[g] = q[g * C + c];                                                                         \
          KEEP_IN_REGISTER(qc[g]);                                                                      \
        }                                                                                               \
        for (int i = 0; i < KB; ++i) {                                                                  \
          v8f key = LOADV(keys + (j + i) * C * 8 + c * 8);                                              \
          KEEP_IN_REGISTER(key);                                                                        \
          for (int g = 0; g < hb; ++g) a[g][i] += qc[g] * key;                                          \
        }                                                                                               \
      }                                                                                                 \
      for (int g = 0; g < hb; ++g) {                                                                    \
        const v4f sums = reduce4(a[g]);                                                                 \
        memcpy(s + g * SEG + j, &sums, sizeof sums); /* one 16-byte store */                            \
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
#define value_piece_float value_piece_f32
#define value_piece_uint16_t value_piece_bf16

/* Values 16 lanes (one zmm) at a time where the compiler targets AVX-512F: two adjacent 8-lane vectors of a
 * head row in one register. Each lane is still its own chain over the keys in order (lanes only regroup),
 * so the bits are those of the 8-lane code, on AVX2 machines too; half the instructions (measured: the
 * bf16 kernel 6.1 -> 3.9 ms per layer on 256 W-prefix rows, Zen 5). ATTN_WIDE is 0 elsewhere and the
 * 16-lane functions are then never called. (Scores go 16 lanes as two heads against one key broadcast into
 * both halves, score_pairs_*; two keys per register, each half a key's chain, measured slower: the halves'
 * loads and inserts cost more than the FMAs saved.) */
#if (defined(__AVX512F__) || defined(CBRUN_ATTN_WIDE)) && !defined(CBRUN_ATTN_NARROW)
#define ATTN_WIDE 1 /* -DCBRUN_ATTN_WIDE on AVX2: the same C in ymm halves (the tests' portable twin) */
#if defined(__AVX512F__)
#define KEEP_ZMM(v) __asm__("" : "+v"(v))
#else
#define KEEP_ZMM(v) ((void)0)
#endif
#else
#define ATTN_WIDE 0
#define KEEP_ZMM(v) ((void)0)
#endif
/* online_softmax with the exponentials 16 lanes at a time: the max is the same value whatever the lanes'
 * grouping, each exponential is exp8's lane arithmetic (exp16), and the sum takes the 8-lane halves in
 * online_softmax's order (s[0..8), s[8..16), ...; the padding's exp(-inf) adds exact zeros), so the same bits. */
static inline float online_softmax16(float* s, int64_t n, float* m, float* l) {
  const int64_t padded = (n + 15) & ~(int64_t)15; /* n <= SEG, a multiple of 16 */
  for (int64_t j = n; j < padded; ++j) s[j] = -INFINITY;
  v16f mx = splat16(*m);
  for (int64_t j = 0; j < padded; j += 16) mx = vmax16(mx, load16_f32(s + j));
  const v8f halves = vmax(__builtin_shufflevector(mx, mx, 0, 1, 2, 3, 4, 5, 6, 7),
                          __builtin_shufflevector(mx, mx, 8, 9, 10, 11, 12, 13, 14, 15));
  const float new_max = max_of(halves);
  const float correction = expf(*m - new_max); /* 0 on the first segment */
  v8f total = splat(0.f);
  for (int64_t j = 0; j < padded; j += 16) {
    const v16f p = exp16(load16_f32(s + j) - splat16(new_max));
    store16_f32(s + j, p);
    total += __builtin_shufflevector(p, p, 0, 1, 2, 3, 4, 5, 6, 7);
    total += __builtin_shufflevector(p, p, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  *l = *l * correction + hsum(total);
  *m = new_max;
  return correction;
}
#if ATTN_WIDE
#define SEGMENT_SOFTMAX online_softmax16
#else
#define SEGMENT_SOFTMAX online_softmax
#endif

#define VB16 4 /* 16-lane value vectors per pass: 64 dims, HB * VB16 = 12 accumulators */

#define DEFINE_WIDE_VALUE_OPS(SUFFIX, T, LOAD16)                                                         \
  /* value_piece_##SUFFIX with 16 lanes; C (8-lane vectors per head row) even */                         \
  static inline __attribute__((always_inline)) void value_piece16_##SUFFIX(                             \
      v8f* acc, int hb, const float* p, const T* values, int64_t n, int64_t C) {                        \
    const int64_t C16 = C / 2;                                                                           \
    for (int64_t c0 = 0; c0 < C16; c0 += VB16) {                                                         \
      const int vb = C16 - c0 < VB16 ? (int)(C16 - c0) : VB16;                                           \
      v16f a[HB][VB16];                                                                                  \
      for (int g = 0; g < hb; ++g)                                                                       \
        for (int c = 0; c < vb; ++c) a[g][c] = load16_f32((const float*)(acc + g * C) + (c0 + c) * 16);  \
      for (int64_t j = 0; j < n; ++j) {                                                                  \
        v16f w[HB];                                                                                      \
        for (int g = 0; g < hb; ++g) w[g] = splat16(p[g * SEG + j]);                                     \
        for (int c = 0; c < vb; ++c) {                                                                   \
          v16f value = LOAD16(values + j * C * 8 + (c0 + c) * 16);                                       \
          KEEP_ZMM(value);                                                                               \
          for (int g = 0; g < hb; ++g) a[g][c] += w[g] * value;                                          \
        }                                                                                                \
      }                                                                                                  \
      for (int g = 0; g < hb; ++g)                                                                       \
        for (int c = 0; c < vb; ++c) store16_f32((float*)(acc + g * C) + (c0 + c) * 16, a[g][c]);       \
    }                                                                                                    \
  }

DEFINE_WIDE_VALUE_OPS(f32, float, load16_f32)
DEFINE_WIDE_VALUE_OPS(bf16, uint16_t, load16_bf16)
#define value_piece16_float value_piece16_f32
#define value_piece16_uint16_t value_piece16_bf16

/* bf16 values 32 dims per 64-byte load, where ATTN_WIDE and D is a multiple of 32: the load's 16 even dims
 * become fp32 by a shift (raw << 16) and its 16 odd dims by a mask (raw & 0xffff0000), the same fp32 values
 * load16_bf16 gives, for half the loads and conversions (measured: the conversions, not the FMAs, bounded
 * value_piece16_bf16 on Zen 4). A head's accumulators then hold each 32-dim chunk m as two vectors, 2m the
 * even dims 32m + 2i and 2m + 1 the odd dims 32m + 2i + 1 (lane i); each lane is still its dim's own chain
 * over the keys in order, so the bits are those of the dim-ordered code once unpair_values puts the dims
 * back in order before the output is written. */
#if defined(__clang__)
#define SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif
typedef uint32_t v16u_mem __attribute__((vector_size(64), aligned(2), may_alias));
#define PAIRED_VALUES(T, D) (ATTN_WIDE && sizeof(T) == 2 && (D) % 32 == 0)

static inline __attribute__((always_inline)) void value_pairs16_uint16_t(v8f* acc, int hb, const float* p,
                                                                        const uint16_t* values, int64_t n,
                                                                        int64_t C) {
  const int64_t C16 = C / 2; /* 16-lane vectors per head row: an even number (D % 32 == 0) */
  for (int64_t c0 = 0; c0 < C16; c0 += VB16) {
    const int vb = C16 - c0 < VB16 ? (int)(C16 - c0) : VB16; /* 2 or 4: whole chunks of 32 dims */
    v16f a[HB][VB16];
    for (int g = 0; g < hb; ++g)
      for (int c = 0; c < vb; ++c) a[g][c] = load16_f32((const float*)(acc + g * C) + (c0 + c) * 16);
    for (int64_t j = 0; j < n; ++j) {
      v16f w[HB];
      for (int g = 0; g < hb; ++g) w[g] = splat16(p[g * SEG + j]);
      for (int c = 0; c < vb; c += 2) {
        const v16u raw = *(const v16u_mem*)(values + j * C * 8 + (c0 + c) * 16); /* dims (c0 + c) * 16 ... + 31 */
        v16f even = (v16f)(raw << 16), odd = (v16f)(raw & 0xffff0000u);
        KEEP_ZMM(even);
        KEEP_ZMM(odd);
        for (int g = 0; g < hb; ++g) {
          a[g][c] += w[g] * even;
          a[g][c + 1] += w[g] * odd;
        }
      }
    }
    for (int g = 0; g < hb; ++g)
      for (int c = 0; c < vb; ++c) store16_f32((float*)(acc + g * C) + (c0 + c) * 16, a[g][c]);
  }
}
/* Never called (PAIRED_VALUES is false for fp32 values); named so that DEFINE_SEGMENT compiles for both. */
#define value_pairs16_float value_piece16_f32

/* A row's G heads' accumulators from value_pairs16's layout back to dim order (a permutation: no arithmetic). */
static inline void unpair_values(v8f* acc, int64_t G, int64_t D) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t m = 0; m < D / 32; ++m) {
      float* chunk = (float*)(acc + g * (D / 8)) + 32 * m;
      const v16f even = load16_f32(chunk), odd = load16_f32(chunk + 16);
      store16_f32(chunk, SHUFFLE16(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
      store16_f32(chunk + 16, SHUFFLE16(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
    }
}

/* Scores 16 lanes at a time where the compiler targets AVX-512F: two query heads side by side in one register
 * (head 2p in lanes 0-7, head 2p + 1 in lanes 8-15, paired once per row: row_state.qp), each key vector
 * broadcast into both halves by its load (a load-port broadcast, no shuffle), so one FMA advances two heads'
 * chains. Each half is the 8-lane code's chain over the C vectors, and the lane sum is reduce4's tree in each
 * 256-bit half, so every score has the bits of score_piece_##SUFFIX; half the FMAs and shuffles. A missing
 * head 2p + 1 (odd G) runs on a zero query and is never stored. */
#define PB 3  /* head pairs per score block: PB * KB = 12 accumulators */
_Static_assert(PB == 3, "FOR_PAIR_BLOCKS has one branch per block size 1..3");
#define EVEN16 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30
#define ODD16 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31

/* Four keys' accumulators of one head pair -> lanes 0-3: the lower head's four scores, lanes 8-11: the upper
 * head's, each by reduce4's tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), operands in its order. */
static inline v16f reduce4_pair(const v16f* a) {
  const v16f s01 = SHUFFLE16(a[0], a[1], EVEN16) + SHUFFLE16(a[0], a[1], ODD16);
  const v16f s23 = SHUFFLE16(a[2], a[3], EVEN16) + SHUFFLE16(a[2], a[3], ODD16);
  const v16f t = SHUFFLE16(s01, s23, EVEN16) + SHUFFLE16(s01, s23, ODD16);
  return t + __builtin_shufflevector(t, t, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
}

#define DEFINE_WIDE_SCORE_OPS(SUFFIX, T, LOADV)                                                          \
  /* s[h * SEG + j] = q_h . key_j for the heads of pb pairs (`heads`: 2 pb, or 2 pb - 1), qp paired, qf not */ \
  static inline __attribute__((always_inline)) void score_pairs_##SUFFIX(                               \
      const v16f* qp, const v8f* qf, int pb, int heads, const T* keys, int64_t n, int64_t C, float* s) {  \
    int64_t j = 0;                                                                                       \
    for (; j + KB <= n; j += KB) {                                                                       \
      v16f a[PB][KB];                                                                                    \
      for (int p = 0; p < pb; ++p)                                                                       \
        for (int i = 0; i < KB; ++i) a[p][i] = splat16(0.f);                                             \
      for (int64_t c = 0; c < C; ++c) {                                                                  \
        v16f qc[PB];                                                                                     \
        for (int p = 0; p < pb; ++p) {                                                                   \
          qc[p] = load16_f32((const float*)(qp + p * C + c));                                            \
          KEEP_ZMM(qc[p]);                                                                               \
        }                                                                                                \
        for (int i = 0; i < KB; ++i) {                                                                   \
          const v8f half = LOADV(keys + (j + i) * C * 8 + c * 8);                                        \
          v16f key = __builtin_shufflevector(half, half, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7); \
          KEEP_ZMM(key);                                                                                 \
          for (int p = 0; p < pb; ++p) a[p][i] += qc[p] * key;                                           \
        }                                                                                                \
      }                                                                                                  \
      for (int p = 0; p < pb; ++p) {                                                                     \
        const v16f sums = reduce4_pair(a[p]);                                                            \
        const v4f lower = __builtin_shufflevector(sums, sums, 0, 1, 2, 3);                               \
        const v4f upper = __builtin_shufflevector(sums, sums, 8, 9, 10, 11);                             \
        memcpy(s + 2 * p * SEG + j, &lower, sizeof lower);                                               \
        if (2 * p + 1 < heads) memcpy(s + (2 * p + 1) * SEG + j, &upper, sizeof upper);                  \
      }                                                                                                  \
    }                                                                                                    \
    for (; j < n; ++j) /* the last keys one by one: dot_'s chain and sum on the 8-lane query, the same bits */ \
      for (int h = 0; h < heads; ++h) s[h * SEG + j] = dot_##SUFFIX(qf + h * C, keys + j * C * 8, C);       \
  }

DEFINE_WIDE_SCORE_OPS(f32, float, load_f32)
DEFINE_WIDE_SCORE_OPS(bf16, uint16_t, load_bf16)

/* Runs CALL for each block of heads [g0, g0 + hb_) of G, with hb_ a constant 1..HB in each branch
 * (so the register blocks are sized at compile time). */
#define FOR_HEAD_BLOCKS(G, CALL)                                                                    \
  for (int64_t g0 = 0; g0 < (G); g0 += HB) {                                                        \
    const int64_t left = (G) - g0;                                                                  \
    if (left >= HB) { const int hb_ = HB; CALL; }                                                   \
    else if (left == 2) { const int hb_ = 2; CALL; }                                                \
    else { const int hb_ = 1; CALL; }                                                               \
  }

/* Runs CALL for each block of head pairs [p0, p0 + pb_) of NP, pb_ a constant 1..PB in each branch. */
#define FOR_PAIR_BLOCKS(NP, CALL)                                                                   \
  for (int64_t p0 = 0; p0 < (NP); p0 += PB) {                                                       \
    const int64_t left = (NP) - p0;                                                                 \
    if (left >= PB) { const int pb_ = PB; CALL; }                                                   \
    else if (left == 2) { const int pb_ = 2; CALL; }                                                \
    else { const int pb_ = 1; CALL; }                                                               \
  }

/* Softmax state of one query row for one kv head: its G scaled query heads, running max and sum per
 * head, and the unnormalized output; C = D / 8 vectors per head. */
typedef struct {
  v8f *qf, *acc;      /* [G * C] each */
  v16f* qp;           /* [(G + 1) / 2 * C]: qf's heads in pairs, 2p in lanes 0-7 and 2p + 1 (or zeros) in 8-15 */
  float *m, *l;       /* [G] each */
  const uint16_t* qb; /* [G, D] the row's bf16 query heads as they lie (pair-dot scores) */
  float scale;
} row_state;

#include "attention_tile.h"

/* out [G, n] = the scores of q [G, D] (one row's heads of one kv head) against keys [n, D], n <= SEG, by
 * `variant` (CB_DP_SCALAR or CB_DP_TWIN): what the load check and the tests compare. */
int attend_dp_scores(int variant, const uint16_t* q, const uint16_t* keys, int64_t G, int64_t n, int64_t D, float scale,
                     float* out) {
  if (!ta_variant_runs(variant) || D % 32 || D > TA_MAX_D || n < 1 || n > SEG || G < 1) return CB_BAD_ARGS;
#if CB_HAS_AMX_SOURCE
  if (variant == CB_DP_AMX) {
    if (G > TA_AMX_MAX_G) return CB_BAD_ARGS;
    ta_scores_amx_entry(q, keys, G, n, D, scale, out);
    return 0;
  }
#endif
  if (variant == CB_DP_SCALAR) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t j = 0; j < n; ++j) out[g * n + j] = ta_score_scalar(q + g * D, keys + j * D, D, scale);
    return 0;
  }
#if TA_HAS_ISA
  if (variant == CB_DP_ISA) {
    ta_scores_isa_entry(q, keys, G, n, D, scale, out);
    return 0;
  }
#endif
  ta_scores_twin_entry(q, keys, G, n, D, scale, out);
  return 0;
}

/* out [G, D] = the value sums of keys 0 .. n - 1 (values [n, D]) weighted by w [G, n] (softmax weights, rounded
 * to bf16 here), from zero accumulators, by `variant`: the value half of the load check. */
int attend_dp_values(int variant, const float* w, const uint16_t* values, int64_t G, int64_t n, int64_t D,
                     float* out) {
  if (!ta_variant_runs(variant) || D % 32 || D > TA_MAX_D || n < 1 || n > SEG || G < 1 || G > MAX_G
      || (variant == CB_DP_AMX && G > 16))
    return CB_BAD_ARGS;
  float rounded[MAX_G * SEG];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < n; ++j) rounded[g * SEG + j] = ta_round_weight(w[g * n + j]);
  const int64_t table[1] = {0}; /* one page of n keys */
  for (int64_t x = 0; x < G * D; ++x) out[x] = 0.f;
  if (variant == CB_DP_SCALAR) {
    ta_values_scalar(out, rounded, values, table, 0, 0, n, G, D, n);
    return 0;
  }
#if CB_HAS_AMX_SOURCE
  if (variant == CB_DP_AMX) {
    ta_values_amx_entry(out, rounded, values, table, G, n, D);
    return 0;
  }
#endif
  const unsigned modes = dp_flush_on();
#if TA_HAS_ISA
  if (variant == CB_DP_ISA) {
    ta_values_isa(out, rounded, values, table, 0, 0, n, G, D, n);
    dp_flush_restore(modes);
    ta_unpair_isa(out, G, D);
    return 0;
  }
#endif
  ta_values_twin(out, rounded, values, table, 0, 0, n, G, D, n);
  dp_flush_restore(modes);
  ta_unpair(out, G, D);
  return 0;
}

/* Keys [start, start + n) of one segment of a sequence (pages through `table`, table[0] is logical page
 * `first`) for `count` rows that all see them (one row, or the rows of a task over a shared segment):
 * each page piece is scored for every row and head while it sits in L1, then one softmax update per
 * row and head, then each piece's values are added for every row and head. A row's arithmetic and
 * order do not depend on `count`, so it gets the same bits alone or with others; with many rows, the
 * segment's keys and values (2 * SEG * D elements, more than L1) come from memory once, not once per
 * row. `scores` is scratch for count * G * SEG floats. */
#define DEFINE_SEGMENT(SUFFIX, T, ATTR, SCORE, PAIRS)                                                         \
  ATTR static inline __attribute__((always_inline)) void attend_segment_##SUFFIX(                       \
      const row_state* st, int64_t count, const T* k, const T* v, const int64_t* table, int64_t first,   \
      int64_t start, int64_t n, int64_t G, int64_t D, int64_t P, float* scores) {                        \
    const int64_t C = D / 8;                                                                             \
    for (int64_t pos = start; pos < start + n;) {                                                        \
      const int64_t cnt = run_keys(table, first, pos, start + n, P);                                     \
      const T* keys = k + pool_row(table, first, pos, P) * D;                                            \
      /* the run's values, summed after the softmax */                                                    \
      prefetch_l2(v + pool_row(table, first, pos, P) * D, cnt * D * (int64_t)sizeof(T));                 \
      for (int64_t i = 0; i < count; ++i) {                                                              \
        float* s = scores + i * G * SEG + (pos - start);                                                 \
        if (PAIRS##_WIDE) { /* heads in pairs, 16 lanes */                                               \
          FOR_PAIR_BLOCKS((G + 1) / 2, PAIRS(st[i], p0, pb_, G - 2 * p0, keys, cnt, C, s + 2 * p0 * SEG))  \
        } else {                                                                                          \
          FOR_HEAD_BLOCKS(G, SCORE(st[i], g0, hb_, keys, cnt, C, D, s + g0 * SEG))                       \
        }                                                                                                 \
      }                                                                                                  \
      pos += cnt;                                                                                        \
    }                                                                                                    \
    for (int64_t i = 0; i < count; ++i)                                                                  \
      for (int64_t g = 0; g < G; ++g) {                                                                  \
        const float correction = SEGMENT_SOFTMAX(scores + (i * G + g) * SEG, n, st[i].m + g, st[i].l + g); \
        if (correction != 1.f)                                                                           \
          for (int64_t c = 0; c < C; ++c) st[i].acc[g * C + c] *= splat(correction);                     \
      }                                                                                                  \
    for (int64_t pos = start; pos < start + n;) {                                                        \
      const int64_t cnt = run_keys(table, first, pos, start + n, P);                                     \
      const T* vals = v + pool_row(table, first, pos, P) * D;                                            \
      for (int64_t i = 0; i < count; ++i) {                                                              \
        const float* p = scores + i * G * SEG + (pos - start);                                           \
        if (PAIRED_VALUES(T, D))                                                                         \
          FOR_HEAD_BLOCKS(G, value_pairs16_##T(st[i].acc + g0 * C, hb_, p + g0 * SEG, vals, cnt, C))      \
        else if (ATTN_WIDE && C % 2 == 0)                                                                \
          FOR_HEAD_BLOCKS(G, value_piece16_##T(st[i].acc + g0 * C, hb_, p + g0 * SEG, vals, cnt, C))      \
        else                                                                                             \
          FOR_HEAD_BLOCKS(G, value_piece_##T(st[i].acc + g0 * C, hb_, p + g0 * SEG, vals, cnt, C))       \
      }                                                                                                  \
      pos += cnt;                                                                                        \
    }                                                                                                    \
  }

/* The scores of one head block: fp32 chains over the scaled query (8 lanes). */
#define SCORE_F32(st, g0, hb, keys, n, C, D, s) score_piece_f32((st).qf + (g0) * (C), hb, keys, n, C, s)
#define SCORE_BF16(st, g0, hb, keys, n, C, D, s) score_piece_bf16((st).qf + (g0) * (C), hb, keys, n, C, s)
/* Or head pairs in 16 lanes (score_pairs_*, the same bits) where ATTN_WIDE. */
#define PAIRS_F32(st, p0, pb, heads, keys, n, C, s) \
  score_pairs_f32((st).qp + (p0) * (C), (st).qf + 2 * (p0) * (C), pb, (int)((heads) < 2 * (pb) ? (heads) : 2 * (pb)), keys, n, C, s)
#define PAIRS_BF16(st, p0, pb, heads, keys, n, C, s) \
  score_pairs_bf16((st).qp + (p0) * (C), (st).qf + 2 * (p0) * (C), pb, (int)((heads) < 2 * (pb) ? (heads) : 2 * (pb)), keys, n, C, s)
#define PAIRS_F32_WIDE ATTN_WIDE
#define PAIRS_BF16_WIDE ATTN_WIDE
#define NO_ATTR

DEFINE_SEGMENT(f32, float, NO_ATTR, SCORE_F32, PAIRS_F32)
DEFINE_SEGMENT(bf16, uint16_t, NO_ATTR, SCORE_BF16, PAIRS_BF16)

/* Start of the segment after the one holding `pos`: segments end at multiples of SEG (absolute
 * positions), so a query's segments depend on its own key range alone, never on the batch. */
static inline int64_t segment_end(int64_t pos, int64_t hi) {
  const int64_t end = (pos / SEG + 1) * SEG;
  return end < hi ? end : hi;
}

/* Whether the tasks' rows can be attended: every row once, key ranges inside their tables' valid
 * blocks, shared keys a whole number of segments seen whole by every row of the task (from key 0) on
 * the same blocks as its first row. */
static int valid_tasks(const int64_t* tables, int64_t max_pages, const int64_t* row_seq, const int64_t* first_page,
                       const int64_t* kv_len, const int64_t* kv_lo, int64_t R, int64_t S, int64_t NB, int64_t P,
                       const int64_t* task_rows, const int64_t* task_start, const int64_t* task_shared,
                       int64_t tasks) {
  if (task_start[0] != 0 || task_start[tasks] != R) return 0;
  int64_t* pages_used = calloc(S > 0 ? S : 1, sizeof(int64_t)); /* pages each sequence's rows read */
  char* seen = calloc(R > 0 ? R : 1, 1);
  int ok = pages_used && seen;
  for (int64_t t = 0; ok && t < tasks; ++t) {
    const int64_t shared = task_shared[t];
    ok = task_start[t + 1] > task_start[t] && shared >= 0 && shared % SEG == 0;
    const int64_t lead = ok ? row_seq[task_rows[task_start[t]]] : 0;
    for (int64_t i = task_start[t]; ok && i < task_start[t + 1]; ++i) {
      const int64_t r = task_rows[i];
      ok = r >= 0 && r < R && !seen[r] && row_seq[r] >= 0 && row_seq[r] < S && lead >= 0 && lead < S;
      if (!ok) break;
      seen[r] = 1;
      const int64_t seq = row_seq[r], first = first_page[seq];
      ok = first >= 0 && kv_lo[r] >= first * P && kv_lo[r] < kv_len[r] && kv_len[r] <= (first + max_pages) * P
           && (!shared || (kv_lo[r] == 0 && first == 0 && first_page[lead] == 0 && shared <= kv_len[r]));
      for (int64_t page = 0; ok && page < (shared + P - 1) / P; ++page)
        ok = tables[seq * max_pages + page] == tables[lead * max_pages + page];
      const int64_t used = ok ? (kv_len[r] - 1) / P - first + 1 : 0;
      if (used > pages_used[seq]) pages_used[seq] = used;
    }
  }
  for (int64_t seq = 0; ok && seq < S; ++seq)
    for (int64_t page = 0; ok && page < pages_used[seq]; ++page)
      ok = tables[seq * max_pages + page] >= 0 && tables[seq * max_pages + page] < NB;
  free(pages_used);
  free(seen);
  return ok;
}

/* Rows of a task that go through a shared segment together: as many as keep their scores
 * (G * SEG floats each) within SHARED_SCORE_BYTES, so the scores stay in L1 beside a page piece. */
#define SHARED_SCORE_BYTES (24 << 10)
static inline int64_t shared_block(int64_t G, int64_t count) {
  int64_t block = SHARED_SCORE_BYTES / (G * SEG * (int64_t)sizeof(float));
  block = block < 1 ? 1 : block;
  return block < count ? block : count;
}

/* Per-thread scratch for a task's row states and shared scores, grown as needed and kept: a step runs
 * thousands of tasks (every prefill row that shares no segment is one), and four mallocs and frees per
 * task showed in profiles. */
static _Thread_local char* task_room;
static _Thread_local size_t task_room_bytes;

static inline size_t scratch_round(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

static char* task_scratch(size_t bytes) {
  if (bytes > task_room_bytes) {
    free(task_room);
    const size_t grown = bytes < (64 << 10) ? (64 << 10) : scratch_round(bytes + bytes / 2);
    task_room = aligned_alloc(64, grown);
    task_room_bytes = task_room ? grown : 0;
  }
  return task_room;
}

/* One task for one kv head: its rows attend the shared keys [0, shared) together, a segment at a time
 * for a block of rows (each page piece read once per block), then each row its own keys
 * [max(lo, shared), hi). Every row goes through the same segments and arithmetic as it would alone. QF: whether
 * the scores read the scaled fp32 query (1: qf, and its head pairs); AMX's order scales the sums instead (0: qf the
 * query widened, unscaled; 2: qf holds the query re-paired for vdpbf16ps; qb the bf16 query as it lies). UNPAIR
 * puts a row's accumulators back in dim order. */
#define DEFINE_TASK(SUFFIX, T, LOADV, STORE, ATTR, QF, UNPAIR)                                                  \
  ATTR static int attend_task_##SUFFIX(const T* q, const T* k, const T* v, const int64_t* tables,             \
                                  int64_t max_pages, const int64_t* row_seq, const int64_t* first_page,  \
                                  const int64_t* kv_len, const int64_t* kv_lo, T* out, int64_t ldq,       \
                                  int64_t H,                                                             \
                                  int64_t G, int64_t D, int64_t P, float scale, const int64_t* rows,      \
                                  int64_t count, int64_t shared, int64_t h) {                             \
    const int64_t C = D / 8;                                                                             \
    float scores[MAX_G * SEG] __attribute__((aligned(32)));                                              \
    const int64_t block = shared ? shared_block(G, count) : 1;                                           \
    const int64_t W = 2 * G * C + 2 * ((G + 1) / 2) * C; /* v8f per row: qf, acc, then qp's pairs */    \
    const size_t vector_bytes = scratch_round(sizeof(v8f) * W * count);                                  \
    const size_t stat_bytes = scratch_round(sizeof(float) * 2 * G * count);                              \
    const size_t state_bytes = scratch_round(sizeof(row_state) * count);                                 \
    char* room = task_scratch(vector_bytes + stat_bytes + state_bytes                                    \
                              + (shared ? scratch_round(sizeof(float) * block * G * SEG) : 0));          \
    if (!room) return -1;                                                                                \
    v8f* vectors = (v8f*)room;                                                                           \
    float* stats = (float*)(room + vector_bytes);                                                        \
    row_state* states = (row_state*)(room + vector_bytes + stat_bytes);                                  \
    float* shared_scores = shared ? (float*)(room + vector_bytes + stat_bytes + state_bytes) : 0;        \
    for (int64_t i = 0; i < count; ++i) {                                                                \
      const T* qr = q + rows[i] * ldq + h * G * D;                                                       \
      v8f* qf = vectors + i * W;                                                                         \
      for (int64_t c = 0; c < G * C; ++c) {                                                              \
        qf[c] = QF == 1 ? LOADV(qr + c * 8) * splat(scale) : LOADV(qr + c * 8);                         \
        qf[G * C + c] = splat(0.f);                                                                      \
      }                                                                                                  \
      if (QF == 2) ta_repair_queries((const uint16_t*)(const void*)qr, G, D, (uint32_t*)(void*)qf);      \
      if (QF == 1 && ATTN_WIDE) /* the heads in pairs for score_pairs_* (the last one beside zeros where G is odd) */ \
        for (int64_t g = 0; g < G; g += 2)                                                               \
          for (int64_t c = 0; c < C; ++c) {                                                              \
            const v8f lower = qf[g * C + c], upper = g + 1 < G ? qf[(g + 1) * C + c] : splat(0.f);       \
            store16_f32((float*)(qf + 2 * G * C + g * C + 2 * c),                                        \
                        __builtin_shufflevector(lower, upper, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)); \
          }                                                                                              \
      for (int64_t g = 0; g < G; ++g) stats[2 * i * G + g] = -INFINITY, stats[(2 * i + 1) * G + g] = 0.f; \
    }                                                                                                    \
    _Pragma("GCC diagnostic push")                                                                       \
    _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")                                          \
    const int64_t lead = row_seq[rows[0]];                                                               \
    for (int64_t i = 0; i < count; ++i)                                                                  \
      states[i] = (row_state){vectors + i * W, vectors + i * W + G * C, (v16f*)(void*)(vectors + i * W + 2 * G * C), \
                              stats + 2 * i * G,                                                         \
                              stats + (2 * i + 1) * G,                                                   \
                              (const uint16_t*)(const void*)(q + rows[i] * ldq + h * G * D), scale};     \
    for (int64_t start = 0; start < shared; start += SEG) {                                              \
      if (start + SEG < shared && scattered(tables + lead * max_pages, 0, start + SEG, shared, P))       \
        prefetch_chunk(k, v, tables + lead * max_pages, 0, start + SEG, shared, P, D * (int64_t)sizeof(T)); \
      for (int64_t i = 0; i < count; i += block) /* blocks of rows whose scores fit the scratch */       \
        attend_segment_##SUFFIX(states + i, count - i < block ? count - i : block, k, v,                  \
                                tables + lead * max_pages, 0, start, SEG, G, D, P, shared_scores);        \
    }                                                                                                    \
    for (int64_t i = 0; i < count; ++i) {                                                                \
      const int64_t r = rows[i], seq = row_seq[r], first = first_page[seq], hi = kv_len[r];              \
      const int64_t* table = tables + seq * max_pages;                                                   \
      const row_state st = states[i];                                                                    \
      for (int64_t start = kv_lo[r] > shared ? kv_lo[r] : shared; start < hi;) {                         \
        const int64_t end = segment_end(start, hi);                                                      \
        if (end < hi && scattered(table, first, end, hi, P))                                             \
          prefetch_chunk(k, v, table, first, end, hi, P, D * (int64_t)sizeof(T));                        \
        attend_segment_##SUFFIX(&st, 1, k, v, table, first, start, end - start, G, D, P, scores);        \
        start = end;                                                                                     \
      }                                                                                                  \
      UNPAIR(st.acc, G, D);                                                                              \
      T* o = out + (r * H + h * G) * D;                                                                  \
      for (int64_t g = 0; g < G; ++g) {                                                                  \
        const v8f inv = splat(st.l[g] > 0.f ? 1.f / st.l[g] : 0.f);                                      \
        for (int64_t c = 0; c < C; ++c) STORE(o + g * D + c * 8, st.acc[g * C + c] * inv);                \
      }                                                                                                  \
    }                                                                                                    \
    _Pragma("GCC diagnostic pop")                                                                        \
    return 0;                                                                                            \
  }                                                                                                      \

/* An entry point: the parameters (cbrun_abi.h) as the locals CALL_TASK names, REFUSE (an extra refusal) and
 * the checks every entry makes, then each (task, kv head) through DISPATCH. */
#define DEFINE_ENTRY(NAME, T, REFUSE, DISPATCH)                                                          \
  int NAME(const cb_attend_params* a) {                                                                  \
    const T *q = a->q, *k = a->k, *v = a->v;                                                             \
    T* out = a->out;                                                                                     \
    const int64_t *tables = a->tables, *row_seq = a->row_seq, *first_page = a->first_page;               \
    const int64_t *kv_len = a->kv_len, *kv_lo = a->kv_lo;                                                \
    const int64_t *task_rows = a->task_rows, *task_start = a->task_start, *task_shared = a->task_shared; \
    const int64_t max_pages = a->max_pages, R = a->R, S = a->S, H = a->H, D = a->D, Hkv = a->Hkv;         \
    const int64_t NB = a->NB, P = a->P, tasks = a->tasks, ldq = a->ldq;                                  \
    const float scale = a->scale;                                                                        \
    const int variant = a->variant, threads = a->threads;                                                \
    (void)variant;                                                                                       \
    if (REFUSE) return CB_BAD_ARGS;                                                                      \
    if (Hkv < 1 || H % Hkv || H / Hkv > MAX_G || (H / Hkv) * D > MAX_GD || D % 8 || P < 1 || tasks < 1   \
        || ldq < H * D                                                                                    \
        || !valid_tasks(tables, max_pages, row_seq, first_page, kv_len, kv_lo, R, S, NB, P, task_rows,    \
                        task_start, task_shared, tasks))                                                 \
      return CB_BAD_ARGS;                                                                                \
    const int64_t G = H / Hkv;                                                                           \
    int failed = 0;                                                                                      \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                               \
    for (int64_t job = 0; job < tasks * Hkv; ++job) {                                                    \
      const int64_t t = job / Hkv, h = job % Hkv;                                                        \
      const T* kh = k + h * NB * P * D;                                                                  \
      const T* vh = v + h * NB * P * D;                                                                  \
      const int64_t* rows = task_rows + task_start[t];                                                   \
      const int64_t count = task_start[t + 1] - task_start[t];                                           \
      int status;                                                                                        \
      DISPATCH                                                                                           \
      if (status) {                                                                                      \
        _Pragma("omp atomic write")                                                                      \
        failed = 1;                                                                                      \
      }                                                                                                  \
    }                                                                                                    \
    return failed ? CB_NO_MEMORY : CB_OK;                                                                \
  }

#define UNPAIR_WIDE(acc, G, D) if (PAIRED_VALUES(__typeof__(*out), D)) unpair_values(acc, G, D)
#define UNPAIR_NONE(acc, G, D) ((void)(acc))
#define UNPAIR_TWIN(acc, G, D) ta_unpair((float*)(void*)(acc), G, D)
#define UNPAIR_ISA(acc, G, D) ta_unpair_isa((float*)(void*)(acc), G, D)
DEFINE_TASK(f32, float, load_f32, store_f32, NO_ATTR, 1, UNPAIR_WIDE)
DEFINE_TASK(bf16, uint16_t, load_bf16, store_bf16, NO_ATTR, 1, UNPAIR_WIDE)
DEFINE_TASK(ta_scalar, uint16_t, load_bf16, store_bf16, NO_ATTR, 0, UNPAIR_NONE)
DEFINE_TASK(ta_twin, uint16_t, load_bf16, store_bf16, NO_ATTR, 0, UNPAIR_TWIN)
DEFINE_TASK(ta_scalar_pairs, uint16_t, load_bf16, store_bf16, NO_ATTR, 0, UNPAIR_NONE)
DEFINE_TASK(ta_twin_pairs, uint16_t, load_bf16, store_bf16, NO_ATTR, 0, UNPAIR_TWIN)
#if TA_HAS_ISA
DEFINE_TASK(ta_isa, uint16_t, load_bf16, store_bf16, TA_ISA_TARGET, 2, UNPAIR_ISA)
DEFINE_TASK(ta_isa_pairs, uint16_t, load_bf16, store_bf16, TA_ISA_TARGET, 2, UNPAIR_ISA)
#endif
#if CB_HAS_AMX_SOURCE
DEFINE_TASK(ta_amx, uint16_t, load_bf16, store_bf16, TA_AMX_TARGET, 0, UNPAIR_NONE)

/* attend_task_ta_amx with the tiles configured for the task's G around it (a thread's own tile state); more
 * than TA_AMX_MAX_G query heads per kv head take the twin, the same bits. */
TA_AMX_TARGET static int attend_task_ta_tiles(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                              const int64_t* tables, int64_t max_pages, const int64_t* row_seq,
                                              const int64_t* first_page, const int64_t* kv_len, const int64_t* kv_lo,
                                              uint16_t* out, int64_t ldq, int64_t H, int64_t G, int64_t D, int64_t P,
                                              float scale, const int64_t* rows, int64_t count, int64_t shared,
                                              int64_t h) {
  if (G > TA_AMX_MAX_G)
    return attend_task_ta_twin(q, k, v, tables, max_pages, row_seq, first_page, kv_len, kv_lo, out, ldq, H, G, D, P,
                               scale, rows, count, shared, h);
  ta_amx_configure(G);
  const int status = attend_task_ta_amx(q, k, v, tables, max_pages, row_seq, first_page, kv_len, kv_lo, out, ldq, H, G,
                                        D, P, scale, rows, count, shared, h);
  ta_amx_release();
  return status;
}
#endif

/* One task for one kv head through FN, with the head size a constant where it is 64 or 128 (so the compiler
 * keeps the accumulators in registers). */
#define CALL_TASK(FN)                                                                                      \
  (D == 64    ? FN(q, kh, vh, tables, max_pages, row_seq, first_page, kv_len, kv_lo, out, ldq, H, G, 64, P, scale, rows, \
                   count, task_shared[t], h)                                                              \
   : D == 128 ? FN(q, kh, vh, tables, max_pages, row_seq, first_page, kv_len, kv_lo, out, ldq, H, G, 128, P, scale,      \
                   rows, count, task_shared[t], h)                                                        \
              : FN(q, kh, vh, tables, max_pages, row_seq, first_page, kv_len, kv_lo, out, ldq, H, G, D, P, scale, rows,  \
                   count, task_shared[t], h))
DEFINE_ENTRY(paged_attend_f32, float, 0, status = CALL_TASK(attend_task_f32);)
DEFINE_ENTRY(paged_attend_bf16, uint16_t, 0, status = CALL_TASK(attend_task_bf16);)
/* bf16 in AMX's order (attention_tile.h): `variant` CB_DP_SCALAR (the reference), CB_DP_TWIN, CB_DP_ISA or
 * CB_DP_AMX (where ta_variant_runs). */
#if CB_HAS_AMX_SOURCE
#define TA_AMX_TASK(otherwise) (variant == CB_DP_AMX ? CALL_TASK(attend_task_ta_tiles) : (otherwise))
#else
#define TA_AMX_TASK(otherwise) (otherwise)
#endif
#if TA_HAS_ISA
#define TA_ISA_TASK(otherwise) (variant == CB_DP_ISA ? CALL_TASK(attend_task_ta_isa) : (otherwise))
#define TA_ISA_PAIRS_TASK(otherwise) (variant == CB_DP_ISA ? CALL_TASK(attend_task_ta_isa_pairs) : (otherwise))
#else
#define TA_ISA_TASK(otherwise) (otherwise)
#define TA_ISA_PAIRS_TASK(otherwise) (otherwise)
#endif
/* Paired keys (a->paired_keys, attention_tile.h) through the reference, the twin or the isa; the tiles read
 * key rows. */
DEFINE_ENTRY(paged_attend_bf16dp, uint16_t,
             !ta_variant_runs(variant) || D % 32 || D > TA_MAX_D || (a->paired_keys && variant == CB_DP_AMX),
             status = a->paired_keys
                          ? TA_ISA_PAIRS_TASK(variant == CB_DP_TWIN ? CALL_TASK(attend_task_ta_twin_pairs)
                                                                    : CALL_TASK(attend_task_ta_scalar_pairs))
                          : TA_AMX_TASK(TA_ISA_TASK(variant == CB_DP_TWIN ? CALL_TASK(attend_task_ta_twin)
                                                                          : CALL_TASK(attend_task_ta_scalar)));)

int64_t paged_attend_max_gd(void) { return MAX_GD; }
int64_t paged_attend_segment(void) { return SEG; }
int64_t paged_attend_tile_max_d(void) { return TA_MAX_D; }
int attend_dp_variant_runs(int variant) { return ta_variant_runs(variant); }

/* pool [H_kv, NB * P, D] (contiguous); src [H_kv, T, D] with strides (head, token) in
 * elements and unit stride along D; slots [T] (cb_kv_write_params). Copies T * H_kv rows of D elements, or with
 * `paired_page` = P (bf16 keys, D even) each row's D / 2 pairs into its page pair-major (attention_tile.h). */
void paged_write(const cb_kv_write_params* a) {
  char* pool = a->pool;
  const char* src = a->src;
  const int64_t elem = a->elem, row = a->D * elem, P = a->paired_page;
  for (int64_t h = 0; h < a->Hkv; ++h)
    for (int64_t t = 0; t < a->T; ++t) {
      const int64_t slot = h * a->slots_per_head + a->slots[t];
      const char* from = src + (h * a->head_stride + t * a->token_stride) * elem;
      if (!P) {
        memcpy(pool + slot * row, from, row);
        continue;
      }
      char* page = pool + slot / P * P * row; /* pair p of slot x at word p * P + x */
      for (int64_t p = 0; p < a->D / 2; ++p) memcpy(page + (p * P + slot % P) * 4, from + p * 4, 4);
    }
}
