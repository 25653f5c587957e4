/* int8 linear layers (W8A8) with exact integer sums: y = x @ W^T (+ bias) for weights quantized once
 * at load and activations quantized per row at every call.
 *
 * Invariance. Every output is
 *     acc[m][n] = sum over k of qx[m][k] * qw[n][k]               (int32, exact)
 *     y[m][n]   = fmaf((float)acc, sx[m] * sw[n], bias[n] or 0)   (fp32: one product, one fma)
 * with the gated MLP's silu(g) * u taken after it as linear_dpbf16.c does (exp16, 16 lanes), and a bf16
 * output rounded once. The only reduction is the integer one, and an integer sum has no order: every
 * partial sum is a sum of a subset of the products, each |qx * qw| <= 127 * 128 (a checkpoint's weights
 * may hold -128; our own quantization gives |q| <= 127), so while K * 127 * 128 < 2^31 (i8_inner_fits)
 * no partial sum overflows and any grouping, blocking, lane split or instruction gives the same int32.
 * The row's quantization reads only that row:
 *     amax = max |x[m][k]|;  rows with amax < 2^-100 (or not finite) quantize to zero with sx = 0;
 *     sx = amax / 127;  qx[k] = rintf(clamp(x[k] * (127 / amax), -127, 127))   (round half to even)
 * (the threshold keeps every product away from denormals, so the CPU's flush modes never show). So a
 * row's numbers do not depend on the number of rows, the chunks, the K steps, the threads, nor the
 * variant that sums them:
 *   CB_I8_SCALAR  plain C int32 loops: the reference the others must equal.
 *   CB_I8_AVX2    vpmaddwd on int16-widened operands (exact: pair sums <= 2 * 127 * 128).
 *   CB_I8_VNNI    AVX512-VNNI vpdpbusd: u8 x s8 with x offset by +128 (qx ^ 0x80, stored so by the row's
 *              quantization where VNNI sums it), the offset's products
 *              taken back exactly with each output's weight sum (colsum * 128, modulo 2^32: the wrapped
 *              intermediate is exact once the true sum fits in int32).
 *   CB_I8_AMX     AMX-INT8 tdpbssd (s8 x s8 in 16 x 16 int32 tiles), after asking Linux for the tile state;
 *              a group of fewer than I8_AMX_MIN_ROWS rows (a decode step's last rows) goes through VNNI
 *              where the CPU has it, which gives the same sums for less work than a 16-row tile.
 * The ISA variants are compiled on every x86 build (target attributes) and run only where the CPU
 * reports the feature; the engine serves one only after it equalled CB_I8_SCALAR on the user's CPU.
 *
 * Weights are packed once (i8_pack_weight), the only copy the engine keeps: blocks of I8_BLOCK = 32
 * outputs, K padded with zeros to Kp (a multiple of 64, an AMX tile's row), quads of k interleaved,
 * and each block's 32 weight sums and scales after its weights:
 *     block = int8 w[Kp / 4][32 outputs][4]  int32 colsum[32]  float scale[32]     (Kp * 32 + 256 bytes)
 * A gated block holds 16 gate outputs (lanes 0-15) and the matching 16 up outputs (lanes 16-31).
 *
 *   i8_pack_weight    q [n, K] int8 and scales [n] -> outputs of a packed matrix (plain, gate or up)
 *   i8_unpack_weight  the inverse, exactly (q and scales)
 *   i8_quantize_rows  the activation quantization alone (tests model it)
 *   i8_linear         y [M, N] (fp32 or bf16), gated silu, gated raw [M, 2N], or the int32 sums [M, N]
 *   i8_variant_runs   whether a variant can run on this CPU
 */
#include <stdlib.h>

#include "cbrun_abi.h"
#include "vec.h"

#define I8_BLOCK 32
#define I8_ROWS 16 /* rows of x per step: one AMX tile's rows; the vector variants go 8 (or 4) at a time */
#define I8_KALIGN 64
#define I8_TAIL (I8_BLOCK * 8) /* colsum int32[32] + scale float[32] */
#ifndef I8_K_STEP
#define I8_K_STEP 512 /* k per step: one step of a block's weights (16 KiB) stays in L1 while a chunk's rows pass */
#endif
#ifndef I8_CHUNK_BYTES
#define I8_CHUNK_BYTES (512 << 10) /* quantized x per row chunk: stays in L2 while the weight blocks pass */
#endif
#define I8_MIN_CHUNK 64
#ifndef I8_AMX_MIN_ROWS
#define I8_AMX_MIN_ROWS 8 /* fewer rows: VNNI instead of a padded tile (measured: 1 row ran faster on VNNI) */
#endif

#define I8_SMALLEST 7.88860905e-31f /* 2^-100: smaller rows quantize to zero */

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define I8_HAS_X86 1
#include <immintrin.h>
#else
#define I8_HAS_X86 0
#endif
#include "amx_state.h"
#define I8_HAS_AMX CB_HAS_AMX_SOURCE

typedef int32_t i8_tile[I8_ROWS][I8_BLOCK];

int64_t i8_inner_padded(int64_t K) { return (K + I8_KALIGN - 1) / I8_KALIGN * I8_KALIGN; }

/* Whether no int32 partial sum can overflow at K: K * 127 * 128 < 2^31 (K <= 132104). */
int i8_inner_fits(int64_t K) { return K >= 1 && K * 127 * 128 < ((int64_t)1 << 31); }

static inline int64_t i8_block_bytes(int64_t Kp) { return Kp * I8_BLOCK + I8_TAIL; }

/* ---- the variants: rows (<= I8_ROWS, Kp apart) against k quads q0 .. q1 - 1 of one block, continuing the
 * int32 sums in `out` (from zero where q0 = 0). The sums are raw: CB_I8_VNNI's still carry the +128 offset,
 * which i8_emit takes back once, after the last step. ---------------------------------------------------- */

static void i8_rows_scalar(const int8_t* xq, int64_t Kp, const int8_t* w, int rows, int64_t q0, int64_t q1,
                           i8_tile out) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < I8_BLOCK; ++j) {
      int32_t acc = q0 ? out[r][j] : 0;
      for (int64_t q = q0; q < q1; ++q)
        for (int i = 0; i < 4; ++i) acc += (int32_t)xq[r * Kp + 4 * q + i] * (int32_t)w[(q * I8_BLOCK + j) * 4 + i];
      out[r][j] = acc;
    }
}

#if I8_HAS_X86
/* CB_I8_AVX2: 4 rows x 8 outputs a step. One 16-byte load is 4 outputs x 4 k, widened to 16 int16; a row's quad
 * broadcast and widened the same way; vpmaddwd gives each output two int32 lanes (k0 + k1, k2 + k3). */
__attribute__((target("avx2"))) static void i8_rows_avx2(const int8_t* xq, int64_t Kp, const int8_t* w, int rows,
                                                         int64_t q0, int64_t q1, i8_tile out) {
  for (int r0 = 0; r0 < rows; r0 += 4) {
    const int n = rows - r0 < 4 ? rows - r0 : 4;
    for (int g = 0; g < I8_BLOCK; g += 8) {
      __m256i acc[4][2];
      for (int r = 0; r < 4; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (int64_t q = q0; q < q1; ++q) {
        const int8_t* wq = w + (q * I8_BLOCK + g) * 4;
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)wq));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wq + 16)));
        for (int r = 0; r < 4; ++r) {
          if (r >= n) break;
          int32_t quad;
          memcpy(&quad, xq + (r0 + r) * Kp + 4 * q, 4);
          const __m256i xb = _mm256_cvtepi8_epi16(_mm_set1_epi32(quad));
          acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(xb, w0));
          acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(xb, w1));
        }
      }
      for (int r = 0; r < n; ++r) {
        int32_t lanes[16];
        _mm256_storeu_si256((__m256i*)lanes, acc[r][0]);
        _mm256_storeu_si256((__m256i*)(lanes + 8), acc[r][1]);
        for (int j = 0; j < 8; ++j) {
          const int32_t sum = lanes[2 * j] + lanes[2 * j + 1];
          out[r0 + r][g + j] = q0 ? out[r0 + r][g + j] + sum : sum;
        }
      }
    }
  }
}

/* CB_I8_VNNI: 8 rows x 32 outputs a step in 16 zmm accumulators; per quad two 64-byte weight loads and one
 * broadcast load per row, 16 vpdpbusd. The rows come offset (qx ^ 0x80: qx + 128 as u8, i8_quantize_row), so a
 * quad's broadcast is a load alone; an xor and a broadcast from a general register per row would take the
 * vector ports vpdpbusd runs on (one in three of their slots). */
#define I8_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define DEFINE_VNNI_ROWS(R)                                                                                  \
  I8_VNNI_TARGET static inline __attribute__((always_inline)) void vnni_rows_##R(                            \
      const int8_t* xq, int64_t Kp, const int8_t* w, int64_t q0, int64_t q1, int32_t (*out)[I8_BLOCK]) {     \
    __m512i acc[R][2];                                                                                       \
    for (int r = 0; r < R; ++r) {                                                                            \
      acc[r][0] = q0 ? _mm512_loadu_si512(out[r]) : _mm512_setzero_si512();                                  \
      acc[r][1] = q0 ? _mm512_loadu_si512(out[r] + 16) : _mm512_setzero_si512();                             \
    }                                                                                                        \
    for (int64_t q = q0; q < q1; ++q) {                                                                      \
      const __m512i w0 = _mm512_loadu_si512(w + q * I8_BLOCK * 4);                                           \
      const __m512i w1 = _mm512_loadu_si512(w + q * I8_BLOCK * 4 + 64);                                      \
      for (int r = 0; r < R; ++r) {                                                                          \
        int32_t quad; /* 4 of the row's k, stored offset (qx + 128 as u8) by the quantization */             \
        memcpy(&quad, xq + r * Kp + 4 * q, 4);                                                               \
        const __m512i xb = _mm512_set1_epi32(quad); /* a load-port broadcast: no shuffle-port uop */         \
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);                                                  \
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);                                                  \
      }                                                                                                      \
    }                                                                                                        \
    for (int r = 0; r < R; ++r) {                                                                            \
      _mm512_storeu_si512(out[r], acc[r][0]);                                                                \
      _mm512_storeu_si512(out[r] + 16, acc[r][1]);                                                           \
    }                                                                                                        \
  }
DEFINE_VNNI_ROWS(1)
DEFINE_VNNI_ROWS(2)
DEFINE_VNNI_ROWS(3)
DEFINE_VNNI_ROWS(4)
DEFINE_VNNI_ROWS(5)
DEFINE_VNNI_ROWS(6)
DEFINE_VNNI_ROWS(7)
DEFINE_VNNI_ROWS(8)

I8_VNNI_TARGET static void i8_rows_vnni(const int8_t* xq, int64_t Kp, const int8_t* w, int rows, int64_t q0,
                                        int64_t q1, i8_tile out) {
  for (int r0 = 0; r0 < rows; r0 += 8) {
    const int8_t* x = xq + r0 * Kp;
    switch (rows - r0 < 8 ? rows - r0 : 8) {
      case 1: vnni_rows_1(x, Kp, w, q0, q1, out + r0); break;
      case 2: vnni_rows_2(x, Kp, w, q0, q1, out + r0); break;
      case 3: vnni_rows_3(x, Kp, w, q0, q1, out + r0); break;
      case 4: vnni_rows_4(x, Kp, w, q0, q1, out + r0); break;
      case 5: vnni_rows_5(x, Kp, w, q0, q1, out + r0); break;
      case 6: vnni_rows_6(x, Kp, w, q0, q1, out + r0); break;
      case 7: vnni_rows_7(x, Kp, w, q0, q1, out + r0); break;
      default: vnni_rows_8(x, Kp, w, q0, q1, out + r0); break;
    }
  }
}
#endif

#if I8_HAS_AMX
/* CB_I8_AMX: tdpbssd on 16 rows x 16 outputs per tile, two C tiles per block (tmm0, tmm1), A in tmm2, B in tmm3
 * and tmm4; a step covers 16 quads (64 k). x rows past `rows` are read from the scratch's zeroed pad rows
 * (i8_linear pads the row count to a multiple of I8_ROWS) and never stored. */
#define I8_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} i8_tile_config;

I8_AMX_TARGET static void i8_amx_configure(void) {
  i8_tile_config config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 5; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

I8_AMX_TARGET static void i8_rows_amx(const int8_t* xq, int64_t Kp, const int8_t* w, int rows, int64_t q0,
                                      int64_t q1, i8_tile out) {
  (void)rows;
  if (q0) {
    _tile_loadd(0, out[0], I8_BLOCK * 4);
    _tile_loadd(1, out[0] + 16, I8_BLOCK * 4);
  } else {
    _tile_zero(0);
    _tile_zero(1);
  }
  for (int64_t q = q0; q < q1; q += 16) {
    _tile_loadd(2, xq + 4 * q, Kp);
    _tile_loadd(3, w + q * I8_BLOCK * 4, I8_BLOCK * 4);
    _tile_loadd(4, w + q * I8_BLOCK * 4 + 64, I8_BLOCK * 4);
    _tile_dpbssd(0, 2, 3);
    _tile_dpbssd(1, 2, 4);
  }
  _tile_stored(0, out[0], I8_BLOCK * 4);
  _tile_stored(1, out[0] + 16, I8_BLOCK * 4);
}

I8_AMX_TARGET static void i8_amx_release(void) { _tile_release(); }

#endif

int i8_variant_runs(int variant) {
  if (variant == CB_I8_SCALAR) return 1;
#if I8_HAS_X86
  __builtin_cpu_init();
  if (variant == CB_I8_AVX2) return __builtin_cpu_supports("avx2");
  if (variant == CB_I8_VNNI)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
#endif
#if I8_HAS_AMX
  if (variant == CB_I8_AMX) return cb_amx_runs(CB_AMX_INT8);
#endif
  return 0;
}

typedef void (*i8_rows_fn)(const int8_t* xq, int64_t Kp, const int8_t* w, int rows, int64_t q0, int64_t q1,
                           i8_tile out);

static i8_rows_fn i8_rows_for(int variant) {
  if (!i8_variant_runs(variant)) return 0;
#if I8_HAS_X86
  if (variant == CB_I8_AVX2) return i8_rows_avx2;
  if (variant == CB_I8_VNNI) return i8_rows_vnni;
#endif
#if I8_HAS_AMX
  if (variant == CB_I8_AMX) return i8_rows_amx;
#endif
  return i8_rows_scalar;
}

#if I8_HAS_X86
#define I8_ROWS_VNNI i8_rows_vnni
#else
#define I8_ROWS_VNNI ((i8_rows_fn)0)
#endif

/* The variant that sums row m's group of rows (groups start at multiples of I8_ROWS: the row chunks are
 * multiples of it): a group of fewer than I8_AMX_MIN_ROWS rows goes to small_fn. */
static inline i8_rows_fn i8_group_fn(i8_rows_fn rows_fn, i8_rows_fn small_fn, int64_t M, int64_t m) {
  const int64_t first = m - m % I8_ROWS, rows = M - first < I8_ROWS ? M - first : I8_ROWS;
  return rows < I8_AMX_MIN_ROWS ? small_fn : rows_fn;
}

/* ---- packing ------------------------------------------------------------------------------------------ */

static inline int64_t i8_block_of(int64_t n, int role) { return role == CB_ROLE_PLAIN ? n / I8_BLOCK : n / (I8_BLOCK / 2); }
static inline int i8_lane_of(int64_t n, int role) {
  if (role == CB_ROLE_PLAIN) return (int)(n % I8_BLOCK);
  return (int)(n % (I8_BLOCK / 2)) + (role == CB_ROLE_UP ? I8_BLOCK / 2 : 0);
}

/* Bytes of a packed matrix of N outputs over K (gated: N gate and N up outputs); zeroed by the caller. */
int64_t i8_packed_size(int64_t N, int64_t K, int gated) {
  const int64_t per_block = gated ? I8_BLOCK / 2 : I8_BLOCK;
  return (N + per_block - 1) / per_block * i8_block_bytes(i8_inner_padded(K));
}

/* Rows q [rows, K] int8 (ldq apart) and their scales become outputs first .. first + rows - 1 of `role`:
 * their weight lanes, weight sums and scales; nothing else is written. Threads take whole blocks. */
int i8_pack_weight(const int8_t* qw, int64_t ldq, const float* scales, int64_t rows, int64_t K, int role,
                   int64_t first, int8_t* packed, int threads) {
  if (rows < 1 || !i8_inner_fits(K) || first < 0 || ldq < K || role < CB_ROLE_PLAIN || role > CB_ROLE_UP) return CB_BAD_ARGS;
  const int64_t Kp = i8_inner_padded(K), bytes = i8_block_bytes(Kp);
  const int64_t b0 = i8_block_of(first, role), b1 = i8_block_of(first + rows - 1, role) + 1;
  _Pragma("omp parallel for num_threads(threads) schedule(static)")
  for (int64_t b = b0; b < b1; ++b) {
    const int per_block = role == CB_ROLE_PLAIN ? I8_BLOCK : I8_BLOCK / 2;
    const int64_t n0 = b * per_block < first ? first : b * per_block;
    const int64_t n1 = (b + 1) * per_block < first + rows ? (b + 1) * per_block : first + rows;
    int8_t* dst = packed + b * bytes;
    int32_t* colsum = (int32_t*)(dst + Kp * I8_BLOCK);
    float* scale = (float*)(colsum + I8_BLOCK);
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* src = qw + (n - first) * ldq;
      const int j = i8_lane_of(n, role);
      int32_t sum = 0;
      for (int64_t k = 0; k < Kp; ++k) {
        const int8_t v = k < K ? src[k] : 0;
        dst[(k / 4 * I8_BLOCK + j) * 4 + k % 4] = v;
        sum += v;
      }
      colsum[j] = sum;
      scale[j] = scales[n - first];
    }
  }
  return 0;
}

/* The inverse of i8_pack_weight: outputs first .. first + count - 1 (or ids[i]) of `role` into q [count, K]
 * (ldo apart) and scales [count]. */
int i8_unpack_weight(const int8_t* packed, int64_t K, int role, int64_t first, const int64_t* ids, int64_t count,
                     int8_t* qw, int64_t ldo, float* scales, int threads) {
  if (count < 0 || !i8_inner_fits(K) || ldo < K || role < CB_ROLE_PLAIN || role > CB_ROLE_UP) return CB_BAD_ARGS;
  const int64_t Kp = i8_inner_padded(K), bytes = i8_block_bytes(Kp);
  _Pragma("omp parallel for num_threads(threads) schedule(static)")
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = ids ? ids[i] : first + i;
    const int8_t* src = packed + i8_block_of(n, role) * bytes;
    const int j = i8_lane_of(n, role);
    for (int64_t k = 0; k < K; ++k) qw[i * ldo + k] = src[(k / 4 * I8_BLOCK + j) * 4 + k % 4];
    scales[i] = ((const float*)(src + Kp * I8_BLOCK + I8_BLOCK * 4))[j];
  }
  return 0;
}

/* ---- the activations ---------------------------------------------------------------------------------- */

static inline float i8_read(const void* x, int x_bf16, int64_t at) {
  if (!x_bf16) return ((const float*)x)[at];
  union { uint32_t u; float f; } c = {(uint32_t)((const uint16_t*)x)[at] << 16};
  return c.f;
}

/* 16 of a row's values as fp32 (bf16 widened exactly). */
static inline v16f i8_read16(const void* x, int x_bf16, int64_t at) {
  return x_bf16 ? load16_bf16((const uint16_t*)x + at) : load16_f32((const float*)x + at);
}

/* One value's quantization, clamped as the header says; NaN passes the clamp, as in the vector form. */
static inline int8_t i8_quantize_one(float value, float inv) {
  float v = value * inv;
  v = v > 127.f ? 127.f : v;
  v = v < -127.f ? -127.f : v;
  return (int8_t)(int32_t)rintf(v);
}

typedef int8_t v16c __attribute__((vector_size(16)));

/* Row m of x (bf16 or fp32) into xq[m] (Kp int8, the pad zero) and sx[m], by the header's arithmetic, 16 lanes
 * at a time with a scalar tail. Each value goes through the same operations in both: the max of |x| (exact in
 * any order; a NaN is never taken, as `a > amax` is false for it), one product by 127 / amax, the clamp, and
 * round-half-to-even, which for |v| <= 127 is (v + 1.5 * 2^23) - 1.5 * 2^23 (exact while |v| < 2^22); the
 * clamp (a blend of bits) stands between the product and the add, so no FMA can fuse them. (With AVX-512F the
 * body rounds by vcvtps2dq instead and leaves out the clamp, which changes no value there: the same bytes, see
 * the loop.) Every byte, the pad included, is stored xor `offset`: 0, or 0x80 for CB_I8_VNNI's u8 rows
 * (qx + 128), so the row is written once. */
static void i8_quantize_row(const void* x, int64_t ldx, int x_bf16, int64_t m, int64_t K, int64_t Kp, int8_t* xq,
                            float* sx, uint8_t offset) {
  const int64_t row = m * ldx, body = K / 16 * 16;
  v16f wide = splat16(0.f);
  for (int64_t k = 0; k < body; k += 16) {
    const v16f a = (v16f)((v16i)i8_read16(x, x_bf16, row + k) & 0x7fffffff);
    wide = vmax16(a, wide); /* a > wide ? a : wide, lane by lane: a NaN is never taken */
  }
  float amax = 0.f;
  for (int j = 0; j < 16; ++j) amax = wide[j] > amax ? wide[j] : amax;
  for (int64_t k = body; k < K; ++k) {
    const float a = fabsf(i8_read(x, x_bf16, row + k));
    amax = a > amax ? a : amax;
  }
  int8_t* dst = xq + m * Kp;
  if (!(amax >= I8_SMALLEST && amax <= 3.40282347e38f)) { /* tiny, infinite or NaN: a zero row */
    memset(dst, offset, Kp);
    sx[m] = 0.f;
    return;
  }
  memset(dst + K, offset, Kp - K);
  const v16c flip = (v16c){0} + (int8_t)offset;
  sx[m] = amax / 127.f;
  const float inv = 127.f / amax;
#if I8_HAS_X86 && defined(__AVX512F__) && !defined(I8_PORTABLE_QUANTIZE)
  /* With AVX-512F, three instructions: the product, vcvtps2dq (round to nearest even under the default MXCSR,
   * as the form below rounds) and vpmovdb. The clamp is left out because it changes no value here: |x| <= amax
   * gives |x * inv| <= 127 * (1 + 2^-24)^2, which rounds to 127; a NaN becomes 0x80000000, then byte 0, in both
   * forms. (-DI8_PORTABLE_QUANTIZE builds the form below, which the tests compare with this one.) */
  for (int64_t k = 0; k < body; k += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps((__m512)i8_read16(x, x_bf16, row + k), _mm512_set1_ps(inv)));
    const v16c bytes = (v16c)_mm512_cvtepi32_epi8(q) ^ flip;
    memcpy(dst + k, &bytes, sizeof bytes);
  }
#else
  const v16f magic = splat16(12582912.f), top = splat16(127.f), bottom = splat16(-127.f);
  for (int64_t k = 0; k < body; k += 16) {
    v16f v = i8_read16(x, x_bf16, row + k) * splat16(inv);
    const v16i over = v > top, under = v < bottom;
    v = (v16f)(((v16i)top & over) | ((v16i)v & ~over));
    v = (v16f)(((v16i)bottom & under) | ((v16i)v & ~under));
    const v16i q = __builtin_convertvector((v + magic) - magic, v16i);
    const v16c bytes = __builtin_convertvector(q, v16c) ^ flip; /* |q| <= 127: the narrowing is exact */
    memcpy(dst + k, &bytes, sizeof bytes);
  }
#endif
  for (int64_t k = body; k < K; ++k) dst[k] = (int8_t)(i8_quantize_one(i8_read(x, x_bf16, row + k), inv) ^ offset);
}

/* x [M, K] (rows ldx apart, bf16 or fp32) -> xq [M, Kp] int8 and sx [M]: what i8_linear does first. */
int i8_quantize_rows(const void* x, int64_t ldx, int x_bf16, int64_t M, int64_t K, int8_t* xq, float* sx,
                     int threads) {
  if (M < 0 || !i8_inner_fits(K) || ldx < K) return CB_BAD_ARGS;
  const int64_t Kp = i8_inner_padded(K);
  _Pragma("omp parallel for num_threads(threads) schedule(static)")
  for (int64_t m = 0; m < M; ++m) i8_quantize_row(x, ldx, x_bf16, m, K, Kp, xq, sx, 0);
  return 0;
}

/* ---- the epilogue ------------------------------------------------------------------------------------- */

typedef struct {
  const float *bias, *up_bias; /* fp32 [N] or NULL */
  int mode, y_bf16;
  void* y;
  int64_t ldy, N, Kp;
} i8_target;

/* `cols` values into y at `at`: fp32, or bf16 rounded once. */
static inline void i8_store_row(void* y, int64_t at, int y_bf16, const float* values, int cols) {
  if (y_bf16)
    for (int j = 0; j < cols; ++j) ((uint16_t*)y)[at + j] = f32_to_bf16(values[j]);
  else
    memcpy((float*)y + at, values, sizeof(float) * cols);
}

/* One fused multiply-add per lane (one rounding, as fmaf): the instruction where the build has AVX-512F, else
 * fmaf lane by lane (-DI8_PORTABLE_FMA forces that form, which the tests compare with the instruction's). */
static inline v16f i8_fma16(v16f a, v16f b, v16f c) {
#if I8_HAS_X86 && defined(__AVX512F__) && !defined(I8_PORTABLE_FMA)
  return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  v16f r;
  for (int j = 0; j < 16; ++j) r[j] = fmaf(a[j], b[j], c[j]);
  return r;
#endif
}

/* 16 lanes into y at `at`, `cols` (<= 16) of them stored: fp32, or bf16 rounded once (store16_bf16: the same
 * rounding as f32_to_bf16, lane by lane). */
static inline void i8_store16(void* y, int64_t at, int y_bf16, v16f values, int cols) {
  if (cols == 16) {
    store16_output(y, at, y_bf16, values);
  } else {
    float lanes[16];
    store16_f32(lanes, values);
    i8_store_row(y, at, y_bf16, lanes, cols);
  }
}

/* Rows m.. of block b: the raw sums made true (CB_I8_VNNI's less 128 * colsum, in uint32: modulo 2^32), scaled
 * (+ bias), gated or not, stored, 16 lanes at a time. */
static void i8_emit(const i8_target* t, const int8_t* block, const float* sx, int64_t b, int64_t m, int rows,
                    i8_tile acc, int offset_sums) {
  const int32_t* colsum = (const int32_t*)(block + t->Kp * I8_BLOCK);
  const float* sw = (const float*)(colsum + I8_BLOCK);
  v16u fix[2] = {{0}, {0}}; /* what the offset added to each output's sums */
  if (offset_sums) {
    memcpy(fix, colsum, sizeof fix);
    fix[0] <<= 7, fix[1] <<= 7;
  }
  const v16f scale[2] = {load16_f32(sw), load16_f32(sw + 16)};
  const int gated = t->mode == CB_MODE_SILU || t->mode == CB_MODE_RAW;
  const int per_block = gated ? I8_BLOCK / 2 : I8_BLOCK;
  const int64_t n0 = b * per_block;
  const int cols = t->N - n0 < per_block ? (int)(t->N - n0) : per_block;
  float bias[I8_BLOCK] = {0}; /* plain: the block's biases; gated: gate's, then up's; 0 past N or without one */
  if (t->bias) memcpy(bias, t->bias + n0, sizeof(float) * cols);
  if (gated && t->up_bias) memcpy(bias + I8_BLOCK / 2, t->up_bias + n0, sizeof(float) * cols);
  const v16f shift[2] = {load16_f32(bias), load16_f32(bias + 16)};
  for (int r = 0; r < rows; ++r) {
    const int64_t at = (m + r) * t->ldy + n0;
    v16i sums[2];
    for (int h = 0; h < 2; ++h) {
      v16u raw;
      memcpy(&raw, acc[r] + 16 * h, sizeof raw);
      sums[h] = (v16i)(raw - fix[h]);
    }
    if (t->mode == CB_MODE_INT) {
      memcpy((int32_t*)t->y + at, sums, sizeof(int32_t) * cols);
      continue;
    }
    const v16f row_scale = splat16(sx[m + r]);
    v16f value[2]; /* fmaf((float)acc, sx * sw, bias): lanes past cols have zero weights and scales, so 0 */
    for (int h = 0; h < 2; ++h)
      value[h] = i8_fma16(__builtin_convertvector(sums[h], v16f), row_scale * scale[h], shift[h]);
    if (!gated) {
      i8_store16(t->y, at, t->y_bf16, value[0], cols < 16 ? cols : 16);
      if (cols > 16) i8_store16(t->y, at + 16, t->y_bf16, value[1], cols - 16);
    } else if (t->mode == CB_MODE_RAW) {
      i8_store16(t->y, at, t->y_bf16, value[0], cols);
      i8_store16(t->y, at + t->N, t->y_bf16, value[1], cols);
    } else {
      i8_store16(t->y, at, t->y_bf16, value[0] / (splat16(1.f) + exp16(-value[0])) * value[1], cols);
    }
  }
}

/* ---- the driver --------------------------------------------------------------------------------------- */

/* y = the mode's function of x [M, K] (rows ldx apart, bf16 or fp32) and the packed W of N outputs over K; y
 * rows ldy apart (fp32 or bf16; int32 in CB_MODE_INT). xq: scratch of i8_scratch_bytes(M, K); sx: M floats.
 * Returns 0, CB_BAD_ARGS, CB_NO_MEMORY, or CB_NO_VARIANT where this CPU cannot run it.
 *
 * Threads quantize the rows, then split the work by output blocks within a chunk of rows, never by k; the
 * int32 sums of a chunk's rows are carried from one K step to the next, and none of that changes a sum. */
int64_t i8_scratch_bytes(int64_t M, int64_t K) { return (M + I8_ROWS - 1) / I8_ROWS * I8_ROWS * i8_inner_padded(K); }

static int i8_linear_run(const void* x, int64_t ldx, int x_bf16, const int8_t* packed, int64_t N, int64_t K,
                         int mode, const float* bias, const float* up_bias, void* y, int64_t ldy, int y_bf16,
                         int64_t M, int8_t* xq, float* sx, int variant, int threads) {
  if (M < 0 || N < 1 || !i8_inner_fits(K) || ldx < K || mode < CB_MODE_PLAIN || mode > CB_MODE_INT)
    return CB_BAD_ARGS;
  const i8_rows_fn rows_fn = i8_rows_for(variant);
  if (!rows_fn) return CB_NO_VARIANT;
  /* small row groups of CB_I8_AMX on VNNI (the same sums), where this CPU has it */
  const i8_rows_fn small_fn = variant == CB_I8_AMX && i8_variant_runs(CB_I8_VNNI) ? i8_rows_for(CB_I8_VNNI) : rows_fn;
  const int tiles_used = variant == CB_I8_AMX && (M >= I8_AMX_MIN_ROWS || small_fn == rows_fn);
  if (M == 0) return 0;
  const int gated = mode == CB_MODE_SILU || mode == CB_MODE_RAW;
  const int64_t Kp = i8_inner_padded(K), bytes = i8_block_bytes(Kp), quads = Kp / 4;
  const int64_t blocks = (N + (gated ? I8_BLOCK / 2 : I8_BLOCK) - 1) / (gated ? I8_BLOCK / 2 : I8_BLOCK);
  const int64_t padded_rows = (M + I8_ROWS - 1) / I8_ROWS * I8_ROWS;
  int64_t chunk = I8_CHUNK_BYTES / Kp;
  chunk = chunk < I8_MIN_CHUNK ? I8_MIN_CHUNK : chunk - chunk % I8_ROWS;
  const int64_t step = I8_K_STEP / 4;
  const i8_target target = {bias, up_bias, mode, y_bf16, y, ldy, N, Kp};
  int failed = 0;
  _Pragma("omp parallel num_threads(threads)") {
    const int thread = omp_get_thread_num(), count = omp_get_num_threads();
    for (int64_t m = thread; m < padded_rows; m += count) {
      if (m < M)
        i8_quantize_row(x, ldx, x_bf16, m, K, Kp, xq, sx, i8_group_fn(rows_fn, small_fn, M, m) == I8_ROWS_VNNI ? 0x80 : 0);
      else if (tiles_used)
        memset(xq + m * Kp, 0, Kp); /* pad rows: read by the AMX tiles, never stored */
    }
#if I8_HAS_AMX
    if (tiles_used) i8_amx_configure();
#endif
    i8_tile one, *tiles = step < quads ? malloc(sizeof(i8_tile) * (chunk / I8_ROWS + 1)) : &one;
    if (!tiles) {
      _Pragma("omp atomic write")
      failed = 1;
    }
    _Pragma("omp barrier")
    for (int64_t m0 = 0; m0 < M && !failed; m0 += chunk) {
      const int64_t m1 = m0 + chunk < M ? m0 + chunk : M;
      _Pragma("omp for schedule(static)")
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* w = packed + b * bytes;
        for (int64_t q0 = 0; q0 < quads; q0 += step) { /* this step's weights stay in L1 for every row group */
          const int64_t q1 = q0 + step < quads ? q0 + step : quads;
          for (int64_t m = m0; m < m1; m += I8_ROWS) {
            const int rows = m1 - m < I8_ROWS ? (int)(m1 - m) : I8_ROWS;
            i8_tile* tile = step < quads ? &tiles[(m - m0) / I8_ROWS] : &one;
            const i8_rows_fn fn = i8_group_fn(rows_fn, small_fn, M, m); /* the same for every step */
            fn(xq + m * Kp, Kp, w, rows, q0, q1, *tile);
            if (q1 == quads) {
              i8_emit(&target, w, sx, b, m, rows, *tile, fn == I8_ROWS_VNNI);
            }
          }
        }
      }
    }
    if (tiles != &one) free(tiles);
#if I8_HAS_AMX
    if (tiles_used) i8_amx_release();
#endif
  }
  return failed ? CB_NO_MEMORY : 0;
}

/* The entry point: `scratch` i8_scratch_bytes for the quantized rows, `row_scales` [M] (cbrun_abi.h). */
int i8_linear(const cb_linear_params* a) {
  return i8_linear_run(a->x, a->ldx, a->x_bf16, a->packed, a->N, a->K, a->mode, a->bias, a->up_bias, a->y, a->ldy,
                       a->y_bf16, a->M, a->scratch, a->row_scales, a->variant, a->threads);
}

int i8_block_outputs(void) { return I8_BLOCK; }
