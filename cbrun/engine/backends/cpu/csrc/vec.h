/* Vector helpers shared by the CPU kernels (GCC/Clang vector extensions: the
 * compiler emits AVX2, AVX-512 or NEON as the build machine allows).
 *
 * v8f (8 fp32 lanes, 32 bytes) and its helpers serve every kernel. v16f (64 bytes)
 * and the vNf names below give linear.c the CPU's own width, VEC lanes: see the end. */
#ifndef CBRUN_VEC_H
#define CBRUN_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
/* unaligned views of memory, allowed to alias the element type */
typedef float v8f_mem __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t v8h_mem __attribute__((vector_size(16), aligned(2), may_alias));

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

static inline v8f load_f32(const float* p) { return *(const v8f_mem*)p; }

static inline v8f load_bf16(const uint16_t* p) {
  v8u wide = __builtin_convertvector(*(const v8h_mem*)p, v8u) << 16;
  return (v8f)wide;
}

static inline void store_f32(float* p, v8f x) { *(v8f_mem*)p = x; }

static inline float hsum(v8f x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

/* Lane-wise max and min without the vector ?: (C++ only in GCC): blend through the comparison mask.
 * A macro, so that every width gets the same operations (V: the float vector, I: its int32 twin). */
#define DEFINE_MAX_MIN(MAX, MIN, V, I)                                     \
  static inline V MAX(V a, V b) {                                          \
    I take_a = a > b;                                                      \
    return (V)(((I)a & take_a) | ((I)b & ~take_a));                        \
  }                                                                        \
  static inline V MIN(V a, V b) { return -MAX(-a, -b); }

/* exp(x) lane by lane, relative error about 2e-7 (Cephes expf polynomial). One text for every width,
 * so a lane gets the same bits from exp8 and exp16 (each lane runs the same operations in the same
 * order; the compiler contracts the same products into FMAs at either width). */
#define DEFINE_EXP(NAME, V, I, SPLAT, MAX, MIN)                             \
  static inline V NAME(V x) {                                               \
    x = MAX(x, SPLAT(-87.33654f));                                          \
    x = MIN(x, SPLAT(88.3762626f));                                         \
    const V magic = SPLAT(12582912.0f); /* 1.5 * 2^23: round to nearest */  \
    V n = (x * SPLAT(1.44269504088896341f) + magic) - magic;                \
    V r = x - n * SPLAT(0.693359375f);                                      \
    r = r - n * SPLAT(-2.12194440e-4f);                                     \
    V p = SPLAT(1.9875691500e-4f);                                          \
    p = p * r + SPLAT(1.3981999507e-3f);                                    \
    p = p * r + SPLAT(8.3334519073e-3f);                                    \
    p = p * r + SPLAT(4.1665795894e-2f);                                    \
    p = p * r + SPLAT(1.6666665459e-1f);                                    \
    p = p * r + SPLAT(5.0000001201e-1f);                                    \
    p = p * r * r + r + SPLAT(1.0f);                                        \
    I bits = (__builtin_convertvector(n, I) + 127) << 23;                   \
    return p * (V)bits;                                                     \
  }

DEFINE_MAX_MIN(vmax, vmin, v8f, v8i)
DEFINE_EXP(exp8, v8f, v8i, splat, vmax, vmin) /* exp(x) for 8 lanes */

static inline float max_of(v8f x) {
  float m = x[0];
  for (int i = 1; i < 8; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v8i){__VA_ARGS__})
#endif

static inline uint16_t f32_to_bf16(float f) {
  union { uint32_t u; float f; } c;
  c.f = f;
  if (isnan(f)) return (uint16_t)((c.u >> 16) | 0x40);
  uint32_t rounding = 0x7FFF + ((c.u >> 16) & 1); /* round to nearest even */
  return (uint16_t)((c.u + rounding) >> 16);
}

/* fp32 lanes as bf16, each lane f32_to_bf16's (round to nearest even, NaNs kept quiet), in vector operations: one
 * text for every width (V: the float vector, U: its uint32 twin, H: the uint16 vector of as many lanes). A scalar
 * loop, with its NaN branch per lane, was a fifth of a short attention row's time. */
#define DEFINE_STORE_BF16(NAME, V, U, H)                                  \
  static inline void NAME(uint16_t* p, V x) {                             \
    const U u = (U)x;                                                     \
    const U rounded = (u + (0x7FFFu + ((u >> 16) & 1u))) >> 16;           \
    const U nan = (U)(x != x);                                            \
    const U half = (nan & ((u >> 16) | 0x40u)) | (~nan & rounded);        \
    const H out = __builtin_convertvector(half, H);                       \
    memcpy(p, &out, sizeof out);                                          \
  }

typedef uint16_t v8h __attribute__((vector_size(16)));
DEFINE_STORE_BF16(store_bf16, v8f, v8u, v8h) /* 8 lanes: attention's output rows */

/* Load a vector once into a register for several uses: left alone, compilers fold
 * the load into every FMA, which doubles the loads and makes the loop load-bound. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)
#endif

/* 16 lanes (64 bytes): one zmm register where the compiler targets AVX-512F. Elsewhere the compiler
 * splits every operation into two 32-byte halves (two ymm on AVX2), lane for lane the same arithmetic. */
#if defined(__GNUC__) && !defined(__clang__) && !defined(__AVX512F__)
/* "AVX512F vector return changes the ABI": only between separately built objects, and these are static inline */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef float v16f_mem __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t v16h_mem __attribute__((vector_size(32), aligned(2), may_alias));

static inline v16f splat16(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v16f load16_f32(const float* p) { return *(const v16f_mem*)p; }

static inline v16f load16_bf16(const uint16_t* p) {
  v16u wide = __builtin_convertvector(*(const v16h_mem*)p, v16u) << 16;
  return (v16f)wide;
}

static inline void store16_f32(float* p, v16f x) { *(v16f_mem*)p = x; }

typedef uint16_t v16h __attribute__((vector_size(32)));
DEFINE_STORE_BF16(store16_bf16, v16f, v16u, v16h) /* 16 lanes: the linears' output rows */

/* 16 fp32 lanes into y (fp32, or bf16 when y_bf16) at element `at`: the linears' output rows. */
static inline void store16_output(void* y, int64_t at, int y_bf16, v16f x) {
  if (y_bf16)
    store16_bf16((uint16_t*)y + at, x);
  else
    store16_f32((float*)y + at, x);
}

DEFINE_MAX_MIN(vmax16, vmin16, v16f, v16i)
DEFINE_EXP(exp16, v16f, v16i, splat16, vmax16, vmin16) /* exp(x) for 16 lanes, the same bits per lane as exp8 */

/* VEC: the fp32 lanes of linear.c's vectors, vNf, chosen at compile time (the library is built per machine):
 * 16 where the compiler targets AVX-512F, 8 otherwise. -DCBRUN_VEC_WIDTH=8 or 16 forces one, for tests: a
 * 16-wide build on AVX2 is the same C, each vector two ymm halves (the "portable twin" of the AVX-512 build).
 * Every lane computes what it computes at the other width, so the width never changes an output. */
#ifndef CBRUN_VEC_WIDTH
#if defined(__AVX512F__)
#define CBRUN_VEC_WIDTH 16
#else
#define CBRUN_VEC_WIDTH 8
#endif
#endif
#define VEC CBRUN_VEC_WIDTH

#if VEC == 16
typedef v16f vNf;
static inline vNf splatN(float x) { return splat16(x); }
static inline vNf loadN_f32(const float* p) { return load16_f32(p); }
static inline vNf loadN_bf16(const uint16_t* p) { return load16_bf16(p); }
static inline void storeN_f32(float* p, vNf x) { store16_f32(p, x); }
static inline vNf expN(vNf x) { return exp16(x); }
#if defined(__AVX512F__) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KEEP_IN_REGISTER_N(v) __asm__("" : "+v"(v)) /* any of the 32 zmm registers */
#else
#define KEEP_IN_REGISTER_N(v) ((void)0) /* two halves: no single register to name */
#endif
#elif VEC == 8
typedef v8f vNf;
static inline vNf splatN(float x) { return splat(x); }
static inline vNf loadN_f32(const float* p) { return load_f32(p); }
static inline vNf loadN_bf16(const uint16_t* p) { return load_bf16(p); }
static inline void storeN_f32(float* p, vNf x) { store_f32(p, x); }
static inline vNf expN(vNf x) { return exp8(x); }
#define KEEP_IN_REGISTER_N(v) KEEP_IN_REGISTER(v)
#else
#error "CBRUN_VEC_WIDTH must be 8 or 16"
#endif

#endif
