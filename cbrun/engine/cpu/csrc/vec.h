/* Vector helpers shared by the CPU kernels (GCC/Clang vector extensions: the
 * compiler emits AVX2, AVX-512 or NEON as the build machine allows). */
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

/* lane-wise max without the vector ?: (C++ only in GCC): blend through the comparison mask */
static inline v8f vmax(v8f a, v8f b) {
  v8i take_a = a > b;
  return (v8f)(((v8i)a & take_a) | ((v8i)b & ~take_a));
}

static inline v8f vmin(v8f a, v8f b) { return -vmax(-a, -b); }

/* exp(x) for 8 lanes, relative error about 2e-7 (Cephes expf polynomial). */
static inline v8f exp8(v8f x) {
  x = vmax(x, splat(-87.33654f));
  x = vmin(x, splat(88.3762626f));
  const v8f magic = splat(12582912.0f); /* 1.5 * 2^23: round to nearest */
  v8f n = (x * splat(1.44269504088896341f) + magic) - magic;
  v8f r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  v8f p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  return p * (v8f)bits;
}

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

static inline void store_bf16(uint16_t* p, v8f x) {
  for (int i = 0; i < 8; ++i) p[i] = f32_to_bf16(x[i]);
}

/* Load a vector once into a register for several uses: left alone, compilers fold
 * the load into every FMA, which doubles the loads and makes the loop load-bound. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)
#endif

#endif
