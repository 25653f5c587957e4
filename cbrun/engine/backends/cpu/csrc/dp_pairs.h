/* bf16 dot-product pairs (AVX512-BF16's vdpbf16ps) in portable code: the helpers the pair kernels of
 * linear_dpbf16.c and attention.c share. vdpbf16ps reads denormal inputs as zero and flushes denormal
 * results; the portable twins get the same by setting the CPU's flush modes for their FMAs
 * (dp_flush_on/dp_flush_restore), the plain-C references by flushing explicitly (dp_flush, dp_read). */
#ifndef CBRUN_DP_PAIRS_H
#define CBRUN_DP_PAIRS_H

#include <math.h>
#include <stdint.h>

#include "vec.h"

/* The variants of a pair kernel: the plain-C reference, the portable twin, the instruction itself. */
#define DP_SCALAR 0
#define DP_TWIN 1
#define DP_ISA 2

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

#endif
