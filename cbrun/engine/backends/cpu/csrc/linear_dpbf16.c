/* bf16 linear layers on bf16 dot-product pairs (AVX512-BF16's vdpbf16ps), with one arithmetic on
 * every CPU: y = x @ W^T (+ bias) for bf16 weights and activations.
 *
 * Every output y[m][n] is one fp32 chain over the pairs p = 0 .. Kp/2 - 1 of k, in that order,
 * started from zero; pair p adds its two products as vdpbf16ps does, per fp32 lane:
 *     t   = fma(x[2p+1], w[2p+1], acc)     flushed to zero if denormal
 *     acc = fma(x[2p],   w[2p],   t)       flushed to zero if denormal
 * with denormal inputs read as zero. (This model matched the instruction bit for bit in millions of
 * lanes of random bit patterns, NaNs and denormals included, on AMD Zen 4 and Zen 5.) K is padded to
 * even with a zero pair element, the bias (fp32) is added after the chain and bf16 outputs are
 * rounded once. Nothing about a call changes a chain: not the number of rows, the blocking, the
 * threads, nor the variant that computes it:
 *   CB_DP_SCALAR  plain C: fmaf and explicit flushing. The reference the others must equal.
 *   CB_DP_TWIN    the same loops in portable vectors (AVX2, AVX-512F, NEON: whatever the build targets),
 *              two FMAs per pair, with the CPU's flush-to-zero and denormals-are-zero modes set for
 *              the call (MXCSR on x86, FPCR on AArch64) so the FMAs flush as the instruction does.
 *   CB_DP_ISA     vdpbf16ps itself: 8 rows x 32 outputs a step in 16 zmm accumulators. Compiled on every
 *              x86 build (a target attribute), run only where the CPU has AVX512-BF16.
 * So a request's numbers are the same bits alone or in a crowd, and on every CPU: a CPU without the
 * instruction computes them with the twin, slowly. The engine runs a variant only after it has
 * equalled CB_DP_SCALAR on the user's CPU (linear_methods.py). Every variant runs with the flush modes
 * set (the epilogue too, which all variants share), so bias adds and SiLU are one arithmetic as well.
 * Why we own this kernel: oneDNN's bf16 GEMM blocks K by the call's shape (a row's bits change with
 * the batch once K >= 1536) and its order is not vdpbf16ps's pair order on every CPU.
 *
 * Weights are packed once, at load (dp_pack_weight), and the packed matrix is the only copy the engine
 * keeps: blocks of DP_BLOCK = 32 outputs with the k-pairs of
 * each output interleaved,
 *     packed[block][pair][32 outputs][2 elements]   (bf16; K padded to even, the last block to
 *                                                    32 outputs, with zeros)
 * so one 64-byte load holds one pair of 16 outputs. A gated MLP block holds 16 gate rows and the
 * matching 16 up rows, and its epilogue writes silu(gate) * up. x (bf16, or fp32 rounded to bf16)
 * is copied per call into rows padded to Kp: xp[M][Kp].
 *
 *   dp_pack_weight w [n, K] bf16 -> outputs of a packed matrix (plain, or a gated block's gate or up half)
 *   dp_unpack_weight the inverse, bit for bit (close, weight reads, a tied head's embedding lookup)
 *   dp_linear      y [M, N] = x [M, K] @ W^T (+ bias), or silu(x @ Wg^T + bg) * (x @ Wu^T + bu), or (gated
 *                  raw) the gate and up sums side by side, y [M, 2N]: one member of a fused matrix alone
 *   dp_variant_runs  whether a variant can run on this CPU (CB_DP_ISA: the CPU reports AVX512-BF16)
 */
#include <stdlib.h>
#include <string.h>

#include "dp_pairs.h"

#define DP_BLOCK 32            /* outputs per packed block */
#define DP_ROWS 8              /* rows of x per step */
#ifndef DP_CHUNK_BYTES
#define DP_CHUNK_BYTES (256 << 10) /* packed x per row chunk: stays in L2 while the weight blocks pass */
#endif
#ifndef DP_MIN_CHUNK
/* rows per chunk at least: with a large K (6144: 16 rows fill 256 KiB) the weights, which stream from memory
 * once per chunk, cost more than x falling out of L2 (docs/performance.md, round 12). The order of every
 * output's chain does not depend on the chunking. */
#define DP_MIN_CHUNK 128
#endif
#ifndef DP_K_PAIRS
/* pairs of k per step at most: one step of a block's weights (DP_K_PAIRS * 128 bytes: 16 KiB) stays in L1 while
 * every row group of a chunk passes it */
#define DP_K_PAIRS 128
#endif

typedef float dp_tile[DP_ROWS][DP_BLOCK];

/* Pairs of k per step for K / 2 = `pairs`: the same for every call at that K (it depends on K alone), as even
 * as steps of at most DP_K_PAIRS allow. A step only carries the fp32 sums to the next one: no chain's order or
 * rounding changes (an fp32 value stored and loaded is itself). */
static inline int64_t dp_k_step(int64_t pairs) {
  const int64_t steps = (pairs + DP_K_PAIRS - 1) / DP_K_PAIRS;
  return (pairs + steps - 1) / steps;
}

/* ---- CB_DP_SCALAR: the reference ----------------------------------------------------------------- */

static void dp_rows_scalar(const uint16_t* xp, int64_t Kp, const uint16_t* w, int rows, int64_t p0, int64_t p1,
                           dp_tile out) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < DP_BLOCK; ++j) {
      float acc = p0 ? out[r][j] : 0.f;
      for (int64_t p = p0; p < p1; ++p) acc = dp_pair_scalar(xp + r * Kp + 2 * p, w + (p * DP_BLOCK + j) * 2, acc);
      out[r][j] = acc;
    }
}

/* ---- CB_DP_TWIN: portable vectors, the flush modes doing the flushing ----------------------------- */

#define TWIN_VECS (DP_BLOCK / VEC) /* vectors across a block's outputs: 2 (AVX-512) or 4 (8 lanes) */
#if VEC == 16
#define TWIN_ROWS 8 /* 16 accumulators + 4 weight halves + 2 splats of 32 zmm */
#else
#define TWIN_ROWS 2 /* 8 accumulators + 8 weight halves of 16 ymm would spill at more rows */
#endif

/* TWIN_ROWS (or fewer) rows against pairs p0 .. p1 - 1 of one block, continuing the sums in `out` (from zero
 * where p0 = 0); each lane the chain of the header, fused multiply-adds where the build targets FMA
 * (-ffp-contract=fast), flushed by the mode the caller set. */
static inline __attribute__((always_inline)) void twin_rows(const uint16_t* xp, int64_t Kp, const uint16_t* w,
                                                            int rows, int64_t p0, int64_t p1,
                                                            float (*out)[DP_BLOCK]) {
  vNf acc[TWIN_ROWS][TWIN_VECS];
  for (int r = 0; r < TWIN_ROWS; ++r)
    for (int v = 0; v < TWIN_VECS; ++v) acc[r][v] = p0 && r < rows ? loadN_f32(out[r] + v * VEC) : splatN(0.f);
  for (int64_t p = p0; p < p1; ++p) {
    vNf high[TWIN_VECS], low[TWIN_VECS];
    for (int v = 0; v < TWIN_VECS; ++v) {
      const vNu pairs = *(const vNu_mem*)(w + (p * DP_BLOCK + v * VEC) * 2);
      high[v] = twin_high(pairs);
      low[v] = twin_low(pairs);
    }
    for (int r = 0; r < TWIN_ROWS; ++r) {
      if (r >= rows) break;
      uint32_t pair;
      memcpy(&pair, xp + r * Kp + 2 * p, 4);
      const vNf xh = splatN(twin_scalar_high(pair)), xl = splatN(twin_scalar_low(pair));
      for (int v = 0; v < TWIN_VECS; ++v) acc[r][v] = dp_pair_twin(acc[r][v], xh, high[v], xl, low[v]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < TWIN_VECS; ++v) storeN_f32(out[r] + v * VEC, acc[r][v]);
}

static void dp_rows_twin(const uint16_t* xp, int64_t Kp, const uint16_t* w, int rows, int64_t p0, int64_t p1,
                         dp_tile out) {
  for (int r0 = 0; r0 < rows; r0 += TWIN_ROWS) {
    const int n = rows - r0 < TWIN_ROWS ? rows - r0 : TWIN_ROWS;
    twin_rows(xp + r0 * Kp, Kp, w, n, p0, p1, out + r0);
  }
}

/* ---- CB_DP_ISA: vdpbf16ps ------------------------------------------------------------------------ */

#if DP_HAS_ISA_SOURCE
#include <immintrin.h>

#define DP_ISA_TARGET __attribute__((target("avx512f,avx512bf16"), always_inline)) static inline

/* R rows (a compile-time count) against pairs p0 .. p1 - 1 of one block, continuing the sums in `out` (from
 * zero where p0 = 0): per pair, two 64-byte weight loads, one broadcast of each row's pair, 2R instructions. */
#define DEFINE_ISA_ROWS(R)                                                                              \
  DP_ISA_TARGET void isa_rows_##R(const uint16_t* xp, int64_t Kp, const uint16_t* w, int64_t p0, int64_t p1, \
                                  dp_tile out) {                                                        \
    __m512 acc[R][2];                                                                                   \
    for (int r = 0; r < R; ++r) {                                                                       \
      acc[r][0] = p0 ? _mm512_loadu_ps(out[r]) : _mm512_setzero_ps();                                   \
      acc[r][1] = p0 ? _mm512_loadu_ps(out[r] + 16) : _mm512_setzero_ps();                              \
    }                                                                                                   \
    for (int64_t p = p0; p < p1; ++p) {                                                                 \
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * DP_BLOCK * 2);                           \
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * DP_BLOCK * 2 + DP_BLOCK);                \
      for (int r = 0; r < R; ++r) {                                                                     \
        int32_t pair;                                                                                   \
        memcpy(&pair, xp + r * Kp + 2 * p, 4);                                                          \
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                          \
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);                                                \
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);                                                \
      }                                                                                                 \
    }                                                                                                   \
    for (int r = 0; r < R; ++r) {                                                                       \
      _mm512_storeu_ps(out[r], acc[r][0]);                                                              \
      _mm512_storeu_ps(out[r] + 16, acc[r][1]);                                                         \
    }                                                                                                   \
  }

DEFINE_ISA_ROWS(1)
DEFINE_ISA_ROWS(2)
DEFINE_ISA_ROWS(3)
DEFINE_ISA_ROWS(4)
DEFINE_ISA_ROWS(5)
DEFINE_ISA_ROWS(6)
DEFINE_ISA_ROWS(7)
DEFINE_ISA_ROWS(8)

__attribute__((target("avx512f,avx512bf16"))) static void dp_rows_isa(const uint16_t* xp, int64_t Kp,
                                                                       const uint16_t* w, int rows, int64_t p0,
                                                                       int64_t p1, dp_tile out) {
  switch (rows) {
    case 1: isa_rows_1(xp, Kp, w, p0, p1, out); break;
    case 2: isa_rows_2(xp, Kp, w, p0, p1, out); break;
    case 3: isa_rows_3(xp, Kp, w, p0, p1, out); break;
    case 4: isa_rows_4(xp, Kp, w, p0, p1, out); break;
    case 5: isa_rows_5(xp, Kp, w, p0, p1, out); break;
    case 6: isa_rows_6(xp, Kp, w, p0, p1, out); break;
    case 7: isa_rows_7(xp, Kp, w, p0, p1, out); break;
    default: isa_rows_8(xp, Kp, w, p0, p1, out); break;
  }
}
#endif

/* Rows of x (rows <= DP_ROWS, Kp apart) against pairs p0 .. p1 - 1 of one packed block, continuing the sums
 * in `out` (started from zero where p0 = 0). */
typedef void (*dp_rows_fn)(const uint16_t* xp, int64_t Kp, const uint16_t* w, int rows, int64_t p0, int64_t p1,
                           dp_tile out);

/* Whether this CPU runs a variant of the pair kernels, linear and attention alike (CB_DP_ISA: AVX512-BF16). */
int dp_variant_runs(int variant) { return dp_variant_supported(variant); }

static dp_rows_fn dp_rows_for(int variant) {
  if (!dp_variant_runs(variant)) return 0;
#if DP_HAS_ISA_SOURCE
  if (variant == CB_DP_ISA) return dp_rows_isa;
#endif
  return variant == CB_DP_TWIN ? dp_rows_twin : dp_rows_scalar;
}

/* ---- packing ---------------------------------------------------------------------------------- */

/* Roles of a weight in a packed matrix: all 32 lanes of a block (plain), or a gated block's first 16
 * lanes (gate rows) or last 16 (up rows). Output n of a role lives in block dp_block_of(n), lane
 * dp_lane_of(n). */

static inline int64_t dp_block_of(int64_t n, int role) { return role == CB_ROLE_PLAIN ? n / DP_BLOCK : n / (DP_BLOCK / 2); }
static inline int dp_lane_of(int64_t n, int role) {
  if (role == CB_ROLE_PLAIN) return (int)(n % DP_BLOCK);
  return (int)(n % (DP_BLOCK / 2)) + (role == CB_ROLE_UP ? DP_BLOCK / 2 : 0);
}

/* Packed elements for N outputs of K inputs (gated: N gate and N up rows). */
int64_t dp_packed_size(int64_t N, int64_t K, int gated) {
  const int64_t per_block = gated ? DP_BLOCK / 2 : DP_BLOCK;
  return (N + per_block - 1) / per_block * ((K + 1) / 2 * 2) * DP_BLOCK;
}

/* A new packed matrix of `blocks` blocks of K inputs, zeroed block by block by the threads that will compute
 * those blocks (dp_linear's static split of blocks over the same number of threads): on a machine of several
 * NUMA nodes, with threads bound to cores, each block's pages are first touched, so placed, where they are read. */
int dp_zero_blocks(uint16_t* packed, int64_t blocks, int64_t K, int threads) {
  if (blocks < 1 || K < 1) return CB_BAD_ARGS;
  const int64_t Kp = (K + 1) / 2 * 2;
  _Pragma("omp parallel for num_threads(threads) schedule(static)")
  for (int64_t b = 0; b < blocks; ++b) memset(packed + b * Kp * DP_BLOCK, 0, Kp * DP_BLOCK * sizeof(uint16_t));
  return 0;
}

/* One output's pairs from pair `from` on into its lane (`lane` = the block + 2 * its lane): pair p at
 * lane + p * 2 * DP_BLOCK, each pair one 4-byte word; an odd K's last pair is (w[K - 1], 0). */
static void dp_pack_row(const uint16_t* src, int64_t K, int64_t from, uint16_t* lane) {
  const int64_t whole = K / 2;
  for (int64_t p = from; p < whole; ++p) memcpy(lane + p * 2 * DP_BLOCK, src + 2 * p, 4);
  if (K % 2) {
    lane[whole * 2 * DP_BLOCK] = src[K - 1];
    lane[whole * 2 * DP_BLOCK + 1] = 0;
  }
}

#if defined(__clang__)
#define DP_SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define DP_SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, (v16u){__VA_ARGS__})
#endif
typedef uint32_t dp_words16 __attribute__((vector_size(64), aligned(4), may_alias));

/* One whole 64-byte line of the pack: streamed past the caches where the CPU can (AVX-512, an aligned line: no
 * read of the line's old contents, and an update's packs would only push the model's other weights out of the
 * caches), else a plain store. dp_pack_weight fences the streamed lines before it returns. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline void dp_store_line(uint16_t* line, v16u words) {
  if ((uintptr_t)line % 64 == 0)
    _mm512_stream_si512((void*)line, (__m512i)words);
  else
    *(dp_words16*)line = words;
}
static inline void dp_fence_lines(void) { _mm_sfence(); }
#else
static inline void dp_store_line(uint16_t* line, v16u words) { *(dp_words16*)line = words; }
static inline void dp_fence_lines(void) {}
#endif

/* Stage k of a 16 x 16 transpose of words: rows i and i + s (s = 2^k, bit k of i clear) exchange bit k of the
 * word index with bit k of the row index (DP_LOk gives row i, DP_HIk row i + s, from their 32 words). */
#define DP_LO0 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define DP_HI0 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define DP_LO1 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define DP_HI1 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define DP_LO2 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define DP_HI2 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define DP_LO3 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define DP_HI3 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define DP_STAGE(t, s, LO, HI)                 \
  for (int i = 0; i < 16; ++i)                 \
    if (!(i & (s))) {                          \
      const v16u a = (t)[i], c = (t)[i + (s)]; \
      (t)[i] = DP_SHUFFLE16(a, c, LO);         \
      (t)[i + (s)] = DP_SHUFFLE16(a, c, HI);   \
    }

/* 16 rows (row r at src + r * ldw) into 16 consecutive lanes from `lanes`, 16 pairs at a time: a 16 x 16
 * transpose of 4-byte words in registers, each pair of the 16 outputs one whole 64-byte store. Returns the pairs
 * moved (a multiple of 16); dp_pack_row moves the rest. It only moves words: the packed bits are dp_pack_row's. */
static int64_t dp_pack_16_rows(const uint16_t* src, int64_t ldw, int64_t K, uint16_t* lanes) {
  const int64_t whole = K / 2 / 16 * 16;
  for (int64_t p = 0; p < whole; p += 16) {
    v16u t[16];
    for (int r = 0; r < 16; ++r) t[r] = *(const dp_words16*)(src + r * ldw + 2 * p);
    DP_STAGE(t, 1, DP_LO0, DP_HI0)
    DP_STAGE(t, 2, DP_LO1, DP_HI1)
    DP_STAGE(t, 4, DP_LO2, DP_HI2)
    DP_STAGE(t, 8, DP_LO3, DP_HI3)
    for (int c = 0; c < 16; ++c) dp_store_line(lanes + (p + c) * 2 * DP_BLOCK, t[c]);
  }
  return whole;
}

/* Rows w [rows, K] bf16 (rows ldw apart) become outputs first .. first + rows - 1 of `role` in `packed` (a
 * matrix of K inputs): only those outputs' lanes are written (the pad element of an odd K as zero), so the
 * members of a fused matrix (q|k|v, gate and up) are packed, and later replaced, one at a time, each
 * straight from its own tensor. Lanes no member owns stay as the caller made them (zeros). Threads take
 * whole blocks, so none writes a cache line another one writes. */
int dp_pack_weight(const uint16_t* w, int64_t ldw, int64_t rows, int64_t K, int role, int64_t first, uint16_t* packed,
                 int threads) {
  if (rows < 1 || K < 1 || first < 0 || ldw < K || role < CB_ROLE_PLAIN || role > CB_ROLE_UP) return CB_BAD_ARGS;
  const int64_t Kp = (K + 1) / 2 * 2;
  const int64_t b0 = dp_block_of(first, role), b1 = dp_block_of(first + rows - 1, role) + 1;
  _Pragma("omp parallel num_threads(threads)") {
  _Pragma("omp for schedule(static)")
  for (int64_t b = b0; b < b1; ++b) {
    const int per_block = role == CB_ROLE_PLAIN ? DP_BLOCK : DP_BLOCK / 2;
    const int64_t n0 = b * per_block < first ? first : b * per_block;
    const int64_t n1 = (b + 1) * per_block < first + rows ? (b + 1) * per_block : first + rows;
    uint16_t* dst = packed + b * Kp * DP_BLOCK;
    for (int64_t n = n0; n < n1;) {
      const int lane = dp_lane_of(n, role);
      const uint16_t* src = w + (n - first) * ldw;
      if (lane % 16 == 0 && n + 16 <= n1) { /* 16 rows on lanes lane..lane+15: whole 64-byte lines of the block */
        const int64_t done = dp_pack_16_rows(src, ldw, K, dst + 2 * lane);
        for (int r = 0; r < 16; ++r) dp_pack_row(src + r * ldw, K, done, dst + 2 * (lane + r));
        n += 16;
      } else {
        dp_pack_row(src, K, 0, dst + 2 * lane);
        n += 1;
      }
    }
  }
  dp_fence_lines(); /* this thread's streamed lines are in memory before the region's end lets anyone read them */
  }
  return 0;
}

/* The inverse of dp_pack_weight, exactly: outputs of `role` back into rows out [count, K] (ldo apart): outputs
 * first .. first + count - 1, or ids[i] where `ids` is given (an embedding lookup in a tied output head). */
int dp_unpack_weight(const uint16_t* packed, int64_t K, int role, int64_t first, const int64_t* ids, int64_t count,
                   uint16_t* out, int64_t ldo, int threads) {
  if (count < 0 || K < 1 || ldo < K || role < CB_ROLE_PLAIN || role > CB_ROLE_UP) return CB_BAD_ARGS;
  const int64_t Kp = (K + 1) / 2 * 2;
  _Pragma("omp parallel for num_threads(threads) schedule(static)")
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = ids ? ids[i] : first + i;
    const uint16_t* src = packed + dp_block_of(n, role) * Kp * DP_BLOCK;
    const int j = dp_lane_of(n, role);
    uint16_t* dst = out + i * ldo;
    for (int64_t k = 0; k < K; ++k) dst[k] = src[(k / 2 * DP_BLOCK + j) * 2 + k % 2];
  }
  return 0;
}

/* ---- the driver ------------------------------------------------------------------------------- */

static inline void dp_store(void* y, int64_t at, int y_bf16, float value) {
  if (y_bf16) ((uint16_t*)y)[at] = f32_to_bf16(value);
  else ((float*)y)[at] = value;
}

/* Rows of x into xp [M][Kp] as bf16 (fp32 rounded to nearest even), the pad column zero; this thread's
 * rows (every threads-th). */
static void dp_pack_rows(const void* x, int64_t ldx, int x_bf16, int64_t M, int64_t K, int64_t Kp, uint16_t* xp,
                         int thread, int threads) {
  for (int64_t m = thread; m < M; m += threads) {
    uint16_t* dst = xp + m * Kp;
    if (x_bf16) memcpy(dst, (const uint16_t*)x + m * ldx, K * 2);
    else
      for (int64_t k = 0; k < K; ++k) dst[k] = f32_to_bf16(((const float*)x)[m * ldx + k]);
    if (Kp > K) dst[K] = 0;
  }
}

typedef struct {
  const float *bias, *up_bias; /* fp32 [N] or NULL */
  int gated, y_bf16;
  void* y;
  int64_t ldy, N;
} dp_target;

/* Rows m.. of block b's sums: + bias, (gated: silu(gate) * up, 16 lanes at a time), stored. */
static void dp_emit(const dp_target* t, int64_t b, int64_t m, int rows, dp_tile acc) {
  if (!t->gated) {
    const int64_t n0 = b * DP_BLOCK;
    const int cols = t->N - n0 < DP_BLOCK ? (int)(t->N - n0) : DP_BLOCK;
    if (cols == DP_BLOCK) { /* a whole block: 16 lanes at a time, the same arithmetic as below */
      for (int r = 0; r < rows; ++r)
        for (int h = 0; h < DP_BLOCK; h += 16) {
          const v16f sums = load16_f32(acc[r] + h);
          store16_output(t->y, (m + r) * t->ldy + n0 + h, t->y_bf16,
                         t->bias ? sums + load16_f32(t->bias + n0 + h) : sums);
        }
      return;
    }
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < cols; ++j)
        dp_store(t->y, (m + r) * t->ldy + n0 + j, t->y_bf16, t->bias ? acc[r][j] + t->bias[n0 + j] : acc[r][j]);
    return;
  }
  const int half = DP_BLOCK / 2;
  const int64_t n0 = b * half;
  const int cols = t->N - n0 < half ? (int)(t->N - n0) : half;
  float bg[16] = {0}, bu[16] = {0};
  for (int j = 0; j < cols; ++j) {
    bg[j] = t->bias ? t->bias[n0 + j] : 0.f;
    bu[j] = t->up_bias ? t->up_bias[n0 + j] : 0.f;
  }
  if (t->gated == CB_MODE_RAW) { /* gate sums (+ bias) in columns n, up sums (+ bias) in columns N + n */
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < cols; ++j) {
        dp_store(t->y, (m + r) * t->ldy + n0 + j, t->y_bf16, acc[r][j] + bg[j]);
        dp_store(t->y, (m + r) * t->ldy + t->N + n0 + j, t->y_bf16, acc[r][half + j] + bu[j]);
      }
    return;
  }
  for (int r = 0; r < rows; ++r) {
    const v16f g = load16_f32(acc[r]) + load16_f32(bg), u = load16_f32(acc[r] + half) + load16_f32(bu);
    const v16f out = g / (splat16(1.f) + exp16(-g)) * u;
    if (cols == half) {
      store16_output(t->y, (m + r) * t->ldy + n0, t->y_bf16, out);
      continue;
    }
    for (int j = 0; j < cols; ++j) dp_store(t->y, (m + r) * t->ldy + n0 + j, t->y_bf16, out[j]);
  }
}

/* y = x @ W^T (+ bias) for the packed W of N outputs over K (gated = CB_MODE_SILU: silu(x @ Wg^T + bias) *
 * (x @ Wu^T + up_bias), N outputs; CB_MODE_RAW: x @ Wg^T + bias and x @ Wu^T + up_bias, 2N outputs). x [M, K]
 * rows ldx apart, bf16 or fp32; y [M, N] rows ldy apart, bf16 or fp32; xp: scratch for M * Kp bf16. Returns 0,
 * CB_BAD_ARGS, CB_NO_MEMORY, or CB_NO_VARIANT where this CPU cannot run it.
 *
 * Threads split the work by output blocks within a chunk of rows, never by k. Where K is longer than a step
 * (dp_k_step: a function of K alone), each block's sums for the chunk's rows are carried in fp32 tiles from
 * one step of pairs to the next, so the step's weights stay in L1 while every row group passes them; the
 * chain of every output is the one above whatever the steps, chunks or threads. */
static int dp_linear_run(const void* x, int64_t ldx, int x_bf16, const uint16_t* packed, int64_t N, int64_t K,
                         int gated, const float* bias, const float* up_bias, void* y, int64_t ldy, int y_bf16,
                         int64_t M, uint16_t* xp, int variant, int threads) {
  if (M < 0 || N < 1 || K < 1 || gated < 0 || gated > CB_MODE_RAW) return CB_BAD_ARGS;
  const dp_rows_fn rows_fn = dp_rows_for(variant);
  if (!rows_fn) return CB_NO_VARIANT;
  if (M == 0) return 0;
  const int64_t Kp = (K + 1) / 2 * 2;
  const int64_t blocks = (N + (gated ? DP_BLOCK / 2 : DP_BLOCK) - 1) / (gated ? DP_BLOCK / 2 : DP_BLOCK);
  int64_t chunk = DP_CHUNK_BYTES / (Kp * 2);
  chunk = chunk < DP_MIN_CHUNK ? DP_MIN_CHUNK : chunk - chunk % DP_ROWS;
  const int64_t pairs = Kp / 2, step = dp_k_step(pairs);
  const dp_target target = {bias, up_bias, gated, y_bf16, y, ldy, N};
  int failed = 0;
  _Pragma("omp parallel num_threads(threads)") {
    const unsigned mode = dp_flush_on();
    dp_pack_rows(x, ldx, x_bf16, M, K, Kp, xp, omp_get_thread_num(), omp_get_num_threads());
    /* the sums of a chunk's rows against one block, carried across its K steps (one tile when K is one step) */
    dp_tile one, *tiles = step < pairs ? malloc(sizeof(dp_tile) * (chunk / DP_ROWS + 1)) : &one;
    if (!tiles) {
      _Pragma("omp atomic write")
      failed = 1;
    }
    _Pragma("omp barrier")
    for (int64_t m0 = 0; m0 < M && !failed; m0 += chunk) {
      const int64_t m1 = m0 + chunk < M ? m0 + chunk : M;
      _Pragma("omp for schedule(static)")
      for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* w = packed + b * Kp * DP_BLOCK;
        if (step == pairs) { /* K in one step: each row group's sums go out as soon as they are done */
          for (int64_t m = m0; m < m1; m += DP_ROWS) {
            const int rows = m1 - m < DP_ROWS ? (int)(m1 - m) : DP_ROWS;
            rows_fn(xp + m * Kp, Kp, w, rows, 0, pairs, one);
            dp_emit(&target, b, m, rows, one);
          }
          continue;
        }
        for (int64_t p0 = 0; p0 < pairs; p0 += step) { /* this step's weights stay in L1 for every row group */
          const int64_t p1 = p0 + step < pairs ? p0 + step : pairs;
          for (int64_t m = m0; m < m1; m += DP_ROWS) {
            const int rows = m1 - m < DP_ROWS ? (int)(m1 - m) : DP_ROWS;
            rows_fn(xp + m * Kp, Kp, w, rows, p0, p1, tiles[(m - m0) / DP_ROWS]);
          }
        }
        for (int64_t m = m0; m < m1; m += DP_ROWS)
          dp_emit(&target, b, m, m1 - m < DP_ROWS ? (int)(m1 - m) : DP_ROWS, tiles[(m - m0) / DP_ROWS]);
      }
    }
    if (tiles != &one) free(tiles);
    dp_flush_restore(mode);
  }
  return failed ? CB_NO_MEMORY : 0;
}

/* The entry point: `mode` CB_MODE_PLAIN, CB_MODE_SILU or CB_MODE_RAW; `scratch` M * Kp bf16 (cbrun_abi.h). */
int dp_linear(const cb_linear_params* a) {
  return dp_linear_run(a->x, a->ldx, a->x_bf16, a->packed, a->N, a->K, a->mode, a->bias, a->up_bias, a->y, a->ldy,
                       a->y_bf16, a->M, a->scratch, a->variant, a->threads);
}

int dp_block_outputs(void) { return DP_BLOCK; }
