/* bf16 dot-product pairs (AVX512-BF16's vdpbf16ps) in portable code: the helpers the pair kernels of
 * linear_dpbf16.c and attention.c share. vdpbf16ps reads denormal inputs as zero and flushes denormal
 * results; the portable twins get the same by setting the CPU's flush modes for their FMAs
 * (dp_flush_on/dp_flush_restore), the plain-C references by flushing explicitly (dp_flush, dp_read). */
#ifndef CBRUN_DP_PAIRS_H
#define CBRUN_DP_PAIRS_H

#include <math.h>
#include <stdint.h>

#include "cbrun_abi.h" /* the variants of a pair kernel: CB_DP_SCALAR, CB_DP_TWIN, CB_DP_ISA */
#include "vec.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define DP_HAS_ISA_SOURCE 1 /* vdpbf16ps code is compiled (target attributes) on every x86 build */
#else
#define DP_HAS_ISA_SOURCE 0
#endif

/* Whether this CPU runs the instruction (AVX512-BF16). */
static inline int dp_isa_runs(void) {
#if DP_HAS_ISA_SOURCE
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return 0;
#endif
}

/* Whether this CPU runs a variant of the pair kernels (the reference and the twin run everywhere). */
static inline int dp_variant_supported(int variant) {
  return variant == CB_DP_SCALAR || variant == CB_DP_TWIN || (variant == CB_DP_ISA && dp_isa_runs());
}

static inline float dp_bf16_to_f32(uint16_t h) {
  union { uint32_t u; float f; } c;
  c.u = (uint32_t)h << 16;
  return c.f;
}

/* ---- flush modes -------------------------------------------------------------------------- */

#if defined(__x86_64__) || defined(__i386__)
#define DP_FLUSH_BITS 0x8040u /* MXCSR: FTZ (bit 15) and DAZ (bit 6) */
static inline unsigned dp_flush_on(void) {
  const unsigned old = __builtin_ia32_stmxcsr();
  __builtin_ia32_ldmxcsr(old | DP_FLUSH_BITS);
  return old;
}
static inline void dp_flush_restore(unsigned old) { __builtin_ia32_ldmxcsr(old); }
#elif defined(__aarch64__)
static inline unsigned dp_flush_on(void) { /* FPCR.FZ (bit 24): denormal inputs and results are zero */
  const unsigned old = (unsigned)__builtin_aarch64_get_fpcr();
  __builtin_aarch64_set_fpcr(old | (1u << 24));
  return old;
}
static inline void dp_flush_restore(unsigned old) { __builtin_aarch64_set_fpcr(old); }
#else
static inline unsigned dp_flush_on(void) { return 0; } /* no mode to set: the twin fails its check here */
static inline void dp_flush_restore(unsigned old) { (void)old; }
#endif

static inline float dp_flush(float v) { return fabsf(v) < 1.17549435e-38f ? copysignf(0.f, v) : v; }

static inline float dp_read(uint16_t h) { return dp_flush(dp_bf16_to_f32(h)); } /* denormals read as zero */

typedef uint32_t vNu __attribute__((vector_size(VEC * 4)));
typedef uint32_t vNu_mem __attribute__((vector_size(VEC * 4), aligned(4), may_alias));
static inline vNf twin_high(vNu v) { return (vNf)(v & 0xFFFF0000u); } /* element 2p+1 of each pair */
static inline vNf twin_low(vNu v) { return (vNf)(v << 16); }          /* element 2p */

static inline float twin_scalar_high(uint32_t u) {
  union { uint32_t u; float f; } c = {u & 0xFFFF0000u};
  return c.f;
}

static inline float twin_scalar_low(uint32_t u) {
  union { uint32_t u; float f; } c = {u << 16};
  return c.f;
}

/* ---- one pair of a chain: the arithmetic every pair kernel shares ------------------------------- *
 * Pair p of a and b (a[2p], a[2p+1] and b[2p], b[2p+1]) added to a chain as vdpbf16ps adds it:
 *     t = fma(a[2p+1], b[2p+1], acc)   acc = fma(a[2p], b[2p], t)
 * dp_pair_scalar flushes explicitly (the reference); dp_pair_twin is the same on vectors of lanes, each lane
 * its own chain, flushed by the modes the caller set (dp_flush_on) and fused where the build targets FMA. */
static inline float dp_pair_scalar(const uint16_t* a, const uint16_t* b, float acc) {
  const float t = dp_flush(fmaf(dp_read(a[1]), dp_read(b[1]), acc));
  return dp_flush(fmaf(dp_read(a[0]), dp_read(b[0]), t));
}

static inline __attribute__((always_inline)) vNf dp_pair_twin(vNf acc, vNf a_high, vNf b_high, vNf a_low,
                                                                vNf b_low) {
  acc += a_high * b_high; /* t = fma(a[2p+1], b[2p+1], acc) */
  acc += a_low * b_low;   /* acc = fma(a[2p], b[2p], t) */
  return acc;
}

#endif
