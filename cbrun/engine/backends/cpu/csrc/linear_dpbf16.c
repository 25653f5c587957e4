/* bf16 linear layers in one arithmetic on every CPU, AMX's tdpbf16ps order: y = x @ W^T (+ bias) for bf16 weights
 * and activations.
 *
 * Every output y[m][n] is the sum of tile_order.h over K (padded with zeros to Kp, a multiple of 32): blocks of 16
 * pairs in ascending order, each an even and an odd fp32 chain from +0 added to C as C + (E + O), denormals read
 * as zero and flushed. The bias (fp32) is added after the sum and bf16 outputs are rounded once. Nothing about a
 * call changes a sum: not the number of rows, the blocking, the threads, nor the variant that computes it:
 *   CB_DP_SCALAR  plain C (tile_order.h): the reference the others must equal, whatever MXCSR holds.
 *   CB_DP_TWIN    the same chains in portable vectors, the build's own width (AVX-512F or AVX2 FMA; NEON),
 *                 the even and odd elements split from the packed pairs in registers (a shift, a mask), x
 *                 converted to fp32 once per call, the CPU's flush modes set (MXCSR FTZ|DAZ; FPCR.FZ).
 *   CB_DP_ISA     AVX512-BF16's vdpbf16ps on re-paired operands: the instruction adds a pair's high element
 *                 first, then its low one, so pairs (k, k + 2) of the same parity, high first, make each of
 *                 E and O one vdpbf16ps chain; one vaddps per block and chain. x is re-paired once per call,
 *                 the weights in registers (a shift and a ternary logic op per vector).
 *   CB_DP_AMX     AMX-BF16's tdpbf16ps itself: 16 rows x 16 outputs per C tile, two per block, one 16-pair
 *                 block per instruction, the packed weights tile-loaded as they lie.
 * The ISA and AMX code is compiled on every x86 build (target attributes) and runs only where the CPU has it;
 * the engine runs a variant only after it has equalled CB_DP_SCALAR on the user's CPU (self_check.py). Every
 * variant runs with the flush modes set (the epilogue too, which all share), so bias adds and SiLU are one
 * arithmetic as well. Why we own this kernel: oneDNN's bf16 GEMM blocks K by the call's shape (a row's bits
 * change with the batch once K >= 1536) and has no twin on CPUs without its instructions.
 *
 * Weights are packed once, at load (dp_pack_weight), and the packed matrix is the only copy the engine keeps:
 * blocks of DP_BLOCK = 32 outputs with the k-pairs of each output interleaved,
 *     packed[block][pair][32 outputs][2 elements]   (bf16; K padded to Kp, the last block to 32 outputs, with
 *                                                    zeros)
 * so one 64-byte line holds one pair of 16 outputs, and 16 lines 128 bytes apart are an AMX B tile (16 pairs x
 * 16 outputs). A gated MLP block holds 16 gate rows and the matching 16 up rows, and its epilogue writes
 * silu(gate) * up. x (bf16, or fp32 rounded to bf16) is copied per call into rows of Kp in the layout the
 * variant reads (dp_scratch_bytes).
 *
 *   dp_pack_weight w [n, K] bf16 -> outputs of a packed matrix (plain, or a gated block's gate or up half)
 *   dp_unpack_weight the inverse, bit for bit (close, weight reads, a tied head's embedding lookup)
 *   dp_linear      y [M, N] = x [M, K] @ W^T (+ bias), or silu(x @ Wg^T + bg) * (x @ Wu^T + bu), or (gated
 *                  raw) the gate and up sums side by side, y [M, 2N]: one member of a fused matrix alone
 *   dp_variant_runs  whether a variant can run on this CPU (and, for CB_DP_AMX, this process)
 */
#include <stdlib.h>
#include <string.h>

#include "amx_state.h"
#include "dp_pairs.h"
#include "tile_order.h"

#define DP_BLOCK 32            /* outputs per packed block */
#define DP_ROWS 16             /* rows of x per step: one AMX tile's rows (the vector variants go fewer at a time) */
#ifndef DP_CHUNK_BYTES
#define DP_CHUNK_BYTES (256 << 10) /* packed x per row chunk: stays in L2 while the weight blocks pass */
#endif
#ifndef DP_MIN_CHUNK
/* rows per chunk at least: with a large K (6144: 16 rows fill 256 KiB) the weights, which stream from memory
 * once per chunk, cost more than x falling out of L2 (docs/performance.md). The order of every output's sum does
 * not depend on the chunking. */
#define DP_MIN_CHUNK 128
#endif
#ifndef DP_K_PAIRS
/* pairs of k per step at most: one step of a block's weights (DP_K_PAIRS * 128 bytes: 16 KiB) stays in L1 while
 * every row group of a chunk passes it */
#define DP_K_PAIRS 128
#endif
_Static_assert(DP_K_PAIRS % TO_BLOCK_PAIRS == 0 && DP_MIN_CHUNK % DP_ROWS == 0, "steps of whole blocks and tiles");

typedef float dp_tile[DP_ROWS][DP_BLOCK];

/* Pairs of k per step for Kp / 2 = `pairs`: whole 16-pair blocks, the same for every call at that K (it depends
 * on K alone), as even as steps of at most DP_K_PAIRS allow. A step only carries C, in fp32, to the next one:
 * no sum's order or rounding changes (an fp32 value stored and loaded is itself). */
static inline int64_t dp_k_step(int64_t pairs) {
  const int64_t blocks = pairs / TO_BLOCK_PAIRS, most = DP_K_PAIRS / TO_BLOCK_PAIRS;
  const int64_t steps = (blocks + most - 1) / most;
  return (blocks + steps - 1) / steps * TO_BLOCK_PAIRS;
}

/* The rows function of every variant: `rows` (<= DP_ROWS) rows of the variant's x layout (Kp elements apart)
 * against pairs p0 .. p1 - 1 (whole blocks) of one packed block `w` (dp_rows_isa_paired: the step's re-paired
 * copy, dp_repair_step), continuing C in `out` (from +0 where p0 = 0). */
typedef void (*dp_rows_fn)(const void* xs, int64_t Kp, const uint16_t* w, int rows, int64_t p0, int64_t p1,
                           dp_tile out);

/* ---- CB_DP_SCALAR: the reference ----------------------------------------------------------------- */

static void dp_rows_scalar(const void* xs, int64_t Kp, const uint16_t* w, int rows, int64_t p0, int64_t p1,
                           dp_tile out) {
  const uint16_t* xp = xs;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < DP_BLOCK; ++j) {
      float c = p0 ? out[r][j] : 0.f;
      for (int64_t p = p0; p < p1; p += TO_BLOCK_PAIRS)
        c = to_block(c, xp + r * Kp + 2 * p, w + (p * DP_BLOCK + j) * 2, 2 * DP_BLOCK);
      out[r][j] = c;
    }
}

/* ---- CB_DP_TWIN: portable vectors, the flush modes doing the flushing ----------------------------- */

#define TWIN_V (16 / VEC) /* vectors per half block (16 outputs): 1 (AVX-512) or 2 (8 lanes) */
#if VEC == 16
#define TWIN_ROWS 8 /* 16 chains + 2 weight halves of 32 zmm; x comes as broadcasts from memory */
#else
#define TWIN_ROWS 2 /* 8 chains + 4 weight halves + 4 splats of 16 ymm */
#endif

/* R rows (a constant) of fp32 x against NV vectors of outputs from 16h of a block (half h: NV = TWIN_V), pairs
 * p0 .. p1 - 1: per block, E and O from zero, fused multiply-adds (-ffp-contract=fast), C in `out`. */
#define DEFINE_TWIN_ROWS_OF(NAME, R, NV)                                                                       \
  static inline __attribute__((always_inline)) void NAME(const float* xf, int64_t Kp, const uint16_t* w,       \
                         int h, int64_t p0, int64_t p1, float (*out)[DP_BLOCK]) {                              \
    for (int64_t b0 = p0; b0 < p1; b0 += TO_BLOCK_PAIRS) {                                                     \
      vNf even[R][NV], odd[R][NV];                                                                             \
      for (int r = 0; r < R; ++r)                                                                              \
        for (int v = 0; v < NV; ++v) even[r][v] = odd[r][v] = splatN(0.f);                                     \
      for (int64_t p = b0; p < b0 + TO_BLOCK_PAIRS; ++p) {                                                     \
        vNf low[NV], high[NV];                                                                                 \
        for (int v = 0; v < NV; ++v) {                                                                         \
          const vNu pairs = *(const vNu_mem*)(w + (p * DP_BLOCK + 16 * h + v * VEC) * 2);                      \
          low[v] = twin_low(pairs);                                                                            \
          high[v] = twin_high(pairs);                                                                          \
        }                                                                                                      \
        for (int r = 0; r < R; ++r) {                                                                          \
          const vNf xe = splatN(xf[r * Kp + 2 * p]), xo = splatN(xf[r * Kp + 2 * p + 1]);                      \
          for (int v = 0; v < NV; ++v) {                                                                       \
            even[r][v] += xe * low[v];                                                                         \
            odd[r][v] += xo * high[v];                                                                         \
          }                                                                                                    \
        }                                                                                                      \
      }                                                                                                        \
      for (int r = 0; r < R; ++r)                                                                              \
        for (int v = 0; v < NV; ++v) {                                                                         \
          float* at = out[r] + 16 * h + v * VEC;                                                               \
          const vNf c = b0 ? loadN_f32(at) : splatN(0.f);                                                      \
          storeN_f32(at, c + (even[r][v] + odd[r][v]));                                                        \
        }                                                                                                      \
    }                                                                                                          \
  }

#define DEFINE_TWIN_ROWS(R) DEFINE_TWIN_ROWS_OF(twin_rows_##R, R, TWIN_V)

DEFINE_TWIN_ROWS(1)
DEFINE_TWIN_ROWS(2)
/* One row against a whole block (both halves, h = 0): twice the independent chains of twin_rows_1, so a decode
 * row's FMAs are not held up by their own latency; each output's chains are the same. */
DEFINE_TWIN_ROWS_OF(twin_row_block, 1, 2 * TWIN_V)
#if TWIN_ROWS > 2
DEFINE_TWIN_ROWS(3)
DEFINE_TWIN_ROWS(4)
DEFINE_TWIN_ROWS(5)
DEFINE_TWIN_ROWS(6)
DEFINE_TWIN_ROWS(7)
DEFINE_TWIN_ROWS(8)
#endif

/* Not inlined into the driver: no FMA may move out of the region where the flush modes are set. */
static __attribute__((noinline)) void dp_rows_twin(const void* xs, int64_t Kp, const uint16_t* w, int rows,
                                                   int64_t p0, int64_t p1, dp_tile out) {
  const float* xf = xs;
  for (int r0 = 0; r0 < rows; r0 += TWIN_ROWS) {
    const int n = rows - r0 < TWIN_ROWS ? rows - r0 : TWIN_ROWS;
    const float* x = xf + r0 * Kp;
    if (n == 1) {
      twin_row_block(x, Kp, w, 0, p0, p1, out + r0);
      continue;
    }
    for (int h = 0; h < 2; ++h) switch (n) {
        case 1: twin_rows_1(x, Kp, w, h, p0, p1, out + r0); break;
#if TWIN_ROWS > 2
        case 2: twin_rows_2(x, Kp, w, h, p0, p1, out + r0); break;
        case 3: twin_rows_3(x, Kp, w, h, p0, p1, out + r0); break;
        case 4: twin_rows_4(x, Kp, w, h, p0, p1, out + r0); break;
        case 5: twin_rows_5(x, Kp, w, h, p0, p1, out + r0); break;
        case 6: twin_rows_6(x, Kp, w, h, p0, p1, out + r0); break;
        case 7: twin_rows_7(x, Kp, w, h, p0, p1, out + r0); break;
        default: twin_rows_8(x, Kp, w, h, p0, p1, out + r0); break;
#else
        default: twin_rows_2(x, Kp, w, h, p0, p1, out + r0); break;
#endif
      }
  }
}

/* ---- CB_DP_ISA: vdpbf16ps on re-paired operands --------------------------------------------------- */

#if DP_HAS_ISA_SOURCE
#include <immintrin.h>

#define DP_ISA_TARGET __attribute__((target("avx512f,avx512bf16"), always_inline)) static inline
#define DP_ISA_ROWS 6 /* 6 rows x 32 outputs x (E, O) = 24 zmm, + 4 weights + 2 broadcasts; C in `out` */

/* A step's weights re-paired for vdpbf16ps, once per block and step for every row group of the chunk: pairs p and
 * p + 1 (lines r0 and r1 of 16 outputs each) become, per output, the even pair (w[2p] high, w[2p+2] low) in line
 * p - p0 of `to` and the odd pair (w[2p+1] high, w[2p+3] low) in line p + 1 - p0: the packed geometry, 16 KiB at
 * most (DP_K_PAIRS), in L1. x's words come paired so already (dp_prepare_row). */
__attribute__((target("avx512f,avx512bf16"))) static void dp_repair_step(const uint16_t* w, int64_t p0, int64_t p1,
                                                                        uint16_t* to) {
  const __m512i low_half = _mm512_set1_epi32(0xFFFF);
  for (int64_t p = p0; p < p1; p += 2)
    for (int v = 0; v < 2; ++v) {
      const __m512i r0 = _mm512_loadu_si512(w + (p * DP_BLOCK + 16 * v) * 2);
      const __m512i r1 = _mm512_loadu_si512(w + ((p + 1) * DP_BLOCK + 16 * v) * 2);
      _mm512_storeu_si512(to + ((p - p0) * DP_BLOCK + 16 * v) * 2,
                          _mm512_ternarylogic_epi32(_mm512_slli_epi32(r0, 16), r1, low_half, 0xF8));
      _mm512_storeu_si512(to + ((p + 1 - p0) * DP_BLOCK + 16 * v) * 2,
                          _mm512_ternarylogic_epi32(_mm512_srli_epi32(r1, 16), r0, low_half, 0xF4));
    }
}

/* The weights of pairs p and p + 1, re-paired: from the step's copy (PAIRED: dp_repair_step, line 0 is pair p0) or
 * from the packed block itself, in registers (a shift and a ternary logic op per vector, as dp_repair_step). */
#define ISA_WEIGHTS_1(w, p, p0, v, we, wo)                                                                     \
  do {                                                                                                         \
    we = (__m512bh)_mm512_loadu_si512(w + (((p) - (p0)) * DP_BLOCK + 16 * (v)) * 2);                           \
    wo = (__m512bh)_mm512_loadu_si512(w + (((p) + 1 - (p0)) * DP_BLOCK + 16 * (v)) * 2);                       \
  } while (0)
#define ISA_WEIGHTS_0(w, p, p0, v, we, wo)                                                                     \
  do {                                                                                                         \
    const __m512i r0 = _mm512_loadu_si512(w + ((p) * DP_BLOCK + 16 * (v)) * 2);                                \
    const __m512i r1 = _mm512_loadu_si512(w + (((p) + 1) * DP_BLOCK + 16 * (v)) * 2);                          \
    we = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi32(r0, 16), r1, _mm512_set1_epi32(0xFFFF), 0xF8);  \
    wo = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(r1, 16), r0, _mm512_set1_epi32(0xFFFF), 0xF4);  \
  } while (0)

/* R rows (a constant) of re-paired x against pairs p0 .. p1 - 1 of one block. */
#define DEFINE_ISA_ROWS(R, PAIRED)                                                                             \
  DP_ISA_TARGET void isa_rows_##R##_##PAIRED(const uint32_t* xr, int64_t Kp, const uint16_t* w, int64_t p0,     \
                                             int64_t p1, float (*out)[DP_BLOCK]) {                             \
    for (int64_t b0 = p0; b0 < p1; b0 += TO_BLOCK_PAIRS) {                                                     \
      __m512 even[R][2], odd[R][2];                                                                            \
      for (int r = 0; r < R; ++r) even[r][0] = even[r][1] = odd[r][0] = odd[r][1] = _mm512_setzero_ps();      \
      for (int64_t p = b0; p < b0 + TO_BLOCK_PAIRS; p += 2) {                                                  \
        __m512bh we[2], wo[2];                                                                                 \
        for (int v = 0; v < 2; ++v) ISA_WEIGHTS_##PAIRED(w, p, p0, v, we[v], wo[v]);                           \
        for (int r = 0; r < R; ++r) {                                                                          \
          const __m512bh xe = (__m512bh)_mm512_set1_epi32((int)xr[r * (Kp / 2) + p]);                          \
          const __m512bh xo = (__m512bh)_mm512_set1_epi32((int)xr[r * (Kp / 2) + p + 1]);                      \
          for (int v = 0; v < 2; ++v) {                                                                        \
            even[r][v] = _mm512_dpbf16_ps(even[r][v], xe, we[v]);                                              \
            odd[r][v] = _mm512_dpbf16_ps(odd[r][v], xo, wo[v]);                                                \
          }                                                                                                    \
        }                                                                                                      \
      }                                                                                                        \
      for (int r = 0; r < R; ++r)                                                                              \
        for (int v = 0; v < 2; ++v) {                                                                          \
          const __m512 c = b0 ? _mm512_loadu_ps(out[r] + 16 * v) : _mm512_setzero_ps();                        \
          _mm512_storeu_ps(out[r] + 16 * v, _mm512_add_ps(c, _mm512_add_ps(even[r][v], odd[r][v])));           \
        }                                                                                                      \
    }                                                                                                          \
  }

/* Rows in even passes of at most DP_ISA_ROWS (8 rows as 4 + 4, not 6 + 2). */
#define DEFINE_ISA_DISPATCH(NAME, PAIRED)                                                                      \
  DEFINE_ISA_ROWS(1, PAIRED)                                                                                   \
  DEFINE_ISA_ROWS(2, PAIRED)                                                                                   \
  DEFINE_ISA_ROWS(3, PAIRED)                                                                                   \
  DEFINE_ISA_ROWS(4, PAIRED)                                                                                   \
  DEFINE_ISA_ROWS(5, PAIRED)                                                                                   \
  DEFINE_ISA_ROWS(6, PAIRED)                                                                                   \
  __attribute__((target("avx512f,avx512bf16"), noinline)) static void NAME(                                    \
      const void* xs, int64_t Kp, const uint16_t* w, int rows, int64_t p0, int64_t p1, dp_tile out) {          \
    const uint32_t* xr = xs;                                                                                   \
    const int passes = (rows + DP_ISA_ROWS - 1) / DP_ISA_ROWS, per_pass = (rows + passes - 1) / passes;        \
    for (int r0 = 0; r0 < rows; r0 += per_pass) {                                                              \
      const uint32_t* x = xr + r0 * (Kp / 2);                                                                  \
      switch (rows - r0 < per_pass ? rows - r0 : per_pass) {                                                   \
        case 1: isa_rows_1_##PAIRED(x, Kp, w, p0, p1, out + r0); break;                                        \
        case 2: isa_rows_2_##PAIRED(x, Kp, w, p0, p1, out + r0); break;                                        \
        case 3: isa_rows_3_##PAIRED(x, Kp, w, p0, p1, out + r0); break;                                        \
        case 4: isa_rows_4_##PAIRED(x, Kp, w, p0, p1, out + r0); break;                                        \
        case 5: isa_rows_5_##PAIRED(x, Kp, w, p0, p1, out + r0); break;                                        \
        default: isa_rows_6_##PAIRED(x, Kp, w, p0, p1, out + r0); break;                                       \
      }                                                                                                        \
    }                                                                                                          \
  }

DEFINE_ISA_DISPATCH(dp_rows_isa, 0)        /* from the packed block: a chunk of one row group (decode) */
DEFINE_ISA_DISPATCH(dp_rows_isa_paired, 1) /* from the step's re-paired copy: chunks of several row groups */
#endif

/* ---- CB_DP_AMX: tdpbf16ps ------------------------------------------------------------------------- */

#if CB_HAS_AMX_SOURCE
/* 16 rows x 16 outputs per C tile: tmm0 and tmm1 a block's two halves, x in tmm2, the weights in tmm3 and tmm4;
 * one instruction per 16-pair block and half. x rows past `rows` are the scratch's zeroed pad rows (the row count
 * is padded to DP_ROWS), read and never stored. */
#define DP_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} dp_tile_config;

DP_AMX_TARGET static void dp_amx_configure(void) {
  dp_tile_config config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 5; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

DP_AMX_TARGET static void dp_rows_amx(const void* xs, int64_t Kp, const uint16_t* w, int rows, int64_t p0,
                                      int64_t p1, dp_tile out) {
  (void)rows;
  const uint16_t* xp = xs;
  if (p0) {
    _tile_loadd(0, out[0], DP_BLOCK * 4);
    _tile_loadd(1, out[0] + 16, DP_BLOCK * 4);
  } else {
    _tile_zero(0);
    _tile_zero(1);
  }
  for (int64_t p = p0; p < p1; p += TO_BLOCK_PAIRS) {
    _tile_loadd(2, xp + 2 * p, Kp * 2);
    _tile_loadd(3, w + p * DP_BLOCK * 2, DP_BLOCK * 4);
    _tile_loadd(4, w + p * DP_BLOCK * 2 + 32, DP_BLOCK * 4);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, out[0], DP_BLOCK * 4);
  _tile_stored(1, out[0] + 16, DP_BLOCK * 4);
}

DP_AMX_TARGET static void dp_amx_release(void) { _tile_release(); }
#endif

/* Whether this CPU runs a variant of the pair kernels (CB_DP_ISA: AVX512-BF16; CB_DP_AMX: AMX-BF16 and Linux's
 * grant of the tile state). Attention's pair-dot scores have no AMX variant (dp_pairs.h). */
int dp_variant_runs(int variant) {
  if (variant == CB_DP_AMX) return cb_amx_runs(CB_AMX_BF16);
  return dp_variant_supported(variant);
}

static dp_rows_fn dp_rows_for(int variant) {
  if (!dp_variant_runs(variant)) return 0;
#if DP_HAS_ISA_SOURCE
  if (variant == CB_DP_ISA) return dp_rows_isa;
#endif
#if CB_HAS_AMX_SOURCE
  if (variant == CB_DP_AMX) return dp_rows_amx;
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
  return (N + per_block - 1) / per_block * to_padded_k(K) * DP_BLOCK;
}

/* A new packed matrix of `blocks` blocks of K inputs, zeroed block by block by the threads that will compute
 * those blocks (dp_linear's static split of blocks over the same number of threads): on a machine of several
 * NUMA nodes, with threads bound to cores, each block's pages are first touched, so placed, where they are read. */
int dp_zero_blocks(uint16_t* packed, int64_t blocks, int64_t K, int threads) {
  if (blocks < 1 || K < 1) return CB_BAD_ARGS;
  const int64_t Kp = to_padded_k(K);
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
  const int64_t Kp = to_padded_k(K);
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
  const int64_t Kp = to_padded_k(K);
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

/* Bytes of dp_linear's scratch for M rows of K: the rows padded to DP_ROWS, each Kp elements of the largest
 * layout a variant reads (fp32). */
int64_t dp_scratch_bytes(int64_t M, int64_t K) {
  return (M + DP_ROWS - 1) / DP_ROWS * DP_ROWS * to_padded_k(K) * (int64_t)sizeof(float);
}

/* Row m of x into the layout `variant` reads, Kp elements past K zero: bf16 rows (CB_DP_SCALAR, CB_DP_AMX), fp32
 * rows (CB_DP_TWIN: the bf16 values widened), or CB_DP_ISA's re-paired words, per 4 elements k .. k + 3
 * (x[k] << 16 | x[k + 2], x[k + 1] << 16 | x[k + 3]). x is bf16, or fp32 rounded to bf16 (nearest even). Past M
 * (AMX's pad rows), zeros. */
static void dp_prepare_row(const void* x, int64_t ldx, int x_bf16, int64_t M, int64_t m, int64_t K, int64_t Kp,
                           void* scratch, int variant) {
  uint16_t row[Kp];
  if (m >= M) memset(row, 0, Kp * 2);
  else if (x_bf16) memcpy(row, (const uint16_t*)x + m * ldx, K * 2);
  else
    for (int64_t k = 0; k < K; ++k) row[k] = f32_to_bf16(((const float*)x)[m * ldx + k]);
  if (m < M) memset(row + K, 0, (Kp - K) * 2);
  if (variant == CB_DP_TWIN) {
    float* dst = (float*)scratch + m * Kp;
    for (int64_t k = 0; k < Kp; ++k) dst[k] = dp_bf16_to_f32(row[k]);
  } else if (variant == CB_DP_ISA) {
    uint32_t* dst = (uint32_t*)scratch + m * (Kp / 2);
    for (int64_t k = 0; k < Kp; k += 4) {
      dst[k / 2] = (uint32_t)row[k] << 16 | row[k + 2];
      dst[k / 2 + 1] = (uint32_t)row[k + 1] << 16 | row[k + 3];
    }
  } else {
    memcpy((uint16_t*)scratch + m * Kp, row, Kp * 2);
  }
}

/* Where row m of the variant's layout starts in the scratch. */
static inline const void* dp_scratch_row(const void* scratch, int64_t m, int64_t Kp, int variant) {
  return variant == CB_DP_TWIN ? (const void*)((const float*)scratch + m * Kp)
                               : (const void*)((const uint16_t*)scratch + m * Kp);
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
 * rows ldx apart, bf16 or fp32; y [M, N] rows ldy apart, bf16 or fp32; scratch: dp_scratch_bytes(M, K). Returns
 * 0, CB_BAD_ARGS, CB_NO_MEMORY, or CB_NO_VARIANT where this CPU cannot run it.
 *
 * Threads split the work by output blocks within a chunk of rows, never by k. Where K is longer than a step
 * (dp_k_step: whole 16-pair blocks, a function of K alone), each block's C for the chunk's rows is carried in
 * fp32 tiles from one step to the next, so the step's weights stay in L1 while every row group passes them; the
 * sum of every output is the one of tile_order.h whatever the steps, chunks or threads. */
static int dp_linear_run(const void* x, int64_t ldx, int x_bf16, const uint16_t* packed, int64_t N, int64_t K,
                         int gated, const float* bias, const float* up_bias, void* y, int64_t ldy, int y_bf16,
                         int64_t M, void* scratch, int variant, int threads) {
  if (M < 0 || N < 1 || K < 1 || ldx < K || gated < 0 || gated > CB_MODE_RAW) return CB_BAD_ARGS;
  const dp_rows_fn rows_fn = dp_rows_for(variant);
  if (!rows_fn) return CB_NO_VARIANT;
  if (M == 0) return 0;
  const int64_t Kp = to_padded_k(K);
  const int64_t blocks = (N + (gated ? DP_BLOCK / 2 : DP_BLOCK) - 1) / (gated ? DP_BLOCK / 2 : DP_BLOCK);
  const int64_t padded_rows = variant == CB_DP_AMX ? (M + DP_ROWS - 1) / DP_ROWS * DP_ROWS : M;
  int64_t chunk = DP_CHUNK_BYTES / (Kp * 2);
  chunk = chunk < DP_MIN_CHUNK ? DP_MIN_CHUNK : chunk - chunk % DP_ROWS;
  const int64_t pairs = Kp / 2, step = dp_k_step(pairs);
  const dp_target target = {bias, up_bias, gated, y_bf16, y, ldy, N};
  int failed = 0;
  _Pragma("omp parallel num_threads(threads)") {
    const unsigned mode = dp_flush_on();
    const int thread = omp_get_thread_num(), count = omp_get_num_threads();
    for (int64_t m = thread; m < padded_rows; m += count) dp_prepare_row(x, ldx, x_bf16, M, m, K, Kp, scratch, variant);
#if CB_HAS_AMX_SOURCE
    if (variant == CB_DP_AMX) dp_amx_configure();
#endif
    /* CB_DP_ISA's re-paired step of weights (step * 128 bytes: 16 KiB at most) */
    uint16_t* repaired = variant == CB_DP_ISA ? aligned_alloc(64, step * DP_BLOCK * 2 * sizeof(uint16_t)) : 0;
    /* C of a chunk's rows against one block, carried across its K steps (one tile when K is one step) */
    dp_tile one, *tiles = step < pairs ? malloc(sizeof(dp_tile) * (chunk / DP_ROWS + 1)) : &one;
    if (!tiles || (variant == CB_DP_ISA && !repaired)) {
      _Pragma("omp atomic write")
      failed = 1;
    }
    _Pragma("omp barrier")
    for (int64_t m0 = 0; m0 < M && !failed; m0 += chunk) {
      const int64_t m1 = m0 + chunk < M ? m0 + chunk : M;
      _Pragma("omp for schedule(static)")
      for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* w = packed + b * Kp * DP_BLOCK;
        for (int64_t p0 = 0; p0 < pairs; p0 += step) { /* this step's weights stay in L1 for every row group */
          const int64_t p1 = p0 + step < pairs ? p0 + step : pairs;
          const uint16_t* ws = w;
          dp_rows_fn fn = rows_fn;
#if DP_HAS_ISA_SOURCE
          if (variant == CB_DP_ISA && m1 - m0 > DP_ROWS) { /* re-paired once for all the chunk's row groups */
            dp_repair_step(w, p0, p1, repaired);
            ws = repaired;
            fn = dp_rows_isa_paired;
          }
#endif
          /* The weights that follow this step's (the next step, or the next block: packed contiguously) are
           * fetched into L2 a slice per row group while this step computes, so a matrix larger than the caches
           * (an output head) streams from memory under the arithmetic rather than between it. With one row group
           * the arithmetic reads the weights as it goes, and the hardware's prefetcher does better alone. */
          const char* next = (const char*)(w + p1 * DP_BLOCK * 2);
          const int64_t next_bytes = m1 - m0 > DP_ROWS ? (p1 - p0) * DP_BLOCK * 2 * (int64_t)sizeof(uint16_t) : 0;
          const int64_t groups = (m1 - m0 + DP_ROWS - 1) / DP_ROWS, slice = (next_bytes / groups + 63) & ~(int64_t)63;
          for (int64_t m = m0; m < m1; m += DP_ROWS) {
            const int rows = m1 - m < DP_ROWS ? (int)(m1 - m) : DP_ROWS;
            const int64_t from = (m - m0) / DP_ROWS * slice;
            for (int64_t at = from; at < from + slice && at < next_bytes; at += 64) __builtin_prefetch(next + at, 0, 2);
            dp_tile* tile = step < pairs ? &tiles[(m - m0) / DP_ROWS] : &one;
            fn(dp_scratch_row(scratch, m, Kp, variant), Kp, ws, rows, p0, p1, *tile);
            if (p1 == pairs) dp_emit(&target, b, m, rows, *tile); /* K in one step: out as soon as done */
          }
        }
      }
    }
    if (tiles != &one) free(tiles);
    free(repaired);
#if CB_HAS_AMX_SOURCE
    if (variant == CB_DP_AMX) dp_amx_release();
#endif
    dp_flush_restore(mode);
  }
  return failed ? CB_NO_MEMORY : 0;
}

/* The entry point: `mode` CB_MODE_PLAIN, CB_MODE_SILU or CB_MODE_RAW; `scratch` dp_scratch_bytes (cbrun_abi.h). */
int dp_linear(const cb_linear_params* a) {
  return dp_linear_run(a->x, a->ldx, a->x_bf16, a->packed, a->N, a->K, a->mode, a->bias, a->up_bias, a->y, a->ldy,
                       a->y_bf16, a->M, a->scratch, a->variant, a->threads);
}

int dp_block_outputs(void) { return DP_BLOCK; }

int64_t dp_inner_padded(int64_t K) { return to_padded_k(K); }
