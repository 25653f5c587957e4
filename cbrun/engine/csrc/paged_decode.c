/* Paged decode attention for CPU: one query token per sequence, keys and
 * values read in place from the page pool (no gather copy).
 *
 *   q          [B, H, D]            query of each sequence's new token
 *   k, v       [H_kv, NB, P, D]     one layer's key and value pages
 *   tables     [B, max_pages] int64 block ids; page i holds positions (first_page + i) * P ...
 *   kv_len     [B] int64            keys at positions < kv_len are visible ...
 *   kv_lo      [B] int64            ... and at positions >= kv_lo (sliding window; else 0)
 *   first_page [B] int64            logical page index of tables[b][0]
 *   out        [B, H, D]
 *   scratch    [threads, G * max_len] float, caller-allocated
 *
 * Work is split over (sequence, kv head) pairs; each computes the scores of
 * its G = H / H_kv query heads in one pass over the keys, a softmax, then
 * one pass over the values. fp32 accumulation for every storage type.
 * Plain C with OpenMP, called through ctypes: no torch headers, so it
 * builds in a second or two.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define MAX_GD 4096 /* G * D per (sequence, kv head) */

static inline float bf16_to_f32(uint16_t x) {
  union { uint32_t u; float f; } c;
  c.u = ((uint32_t)x) << 16;
  return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
  union { uint32_t u; float f; } c;
  c.f = f;
  uint32_t rounding = 0x7FFF + ((c.u >> 16) & 1); /* round to nearest even */
  return (uint16_t)((c.u + rounding) >> 16);
}

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                          \
  void NAME(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* kv_len,         \
            const int64_t* kv_lo, const int64_t* first_page, T* out, float* scratch, int64_t B,       \
            int64_t H, int64_t D, int64_t Hkv, int64_t NB, int64_t P, int64_t max_pages,             \
            int64_t max_len, float scale, int threads) {                                               \
    const int64_t G = H / Hkv;                                                                        \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                            \
    for (int64_t task = 0; task < B * Hkv; ++task) {                                                  \
      const int64_t b = task / Hkv, h = task % Hkv;                                                   \
      const int64_t lo = kv_lo[b], hi = kv_len[b], n = hi - lo;                                       \
      float qf[MAX_GD], acc[MAX_GD];                                                                  \
      float* scores = scratch + (int64_t)omp_get_thread_num() * G * max_len;                         \
      const int64_t* table = tables + b * max_pages;                                                  \
      const int64_t first = first_page[b];                                                            \
      if (n <= 0) continue;                                                                           \
      for (int64_t g = 0; g < G; ++g)                                                                 \
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = LOAD(q[(b * H + h * G + g) * D + d]) * scale; \
      for (int64_t pos = lo; pos < hi; ++pos) {                                                       \
        const T* key = k + ((h * NB + table[pos / P - first]) * P + pos % P) * D;                     \
        for (int64_t g = 0; g < G; ++g) {                                                             \
          const float* qg = qf + g * D;                                                               \
          float s = 0.f;                                                                              \
          _Pragma("omp simd reduction(+ : s)")                                                       \
          for (int64_t d = 0; d < D; ++d) s += qg[d] * LOAD(key[d]);                                  \
          scores[g * n + (pos - lo)] = s;                                                             \
        }                                                                                             \
      }                                                                                               \
      for (int64_t g = 0; g < G; ++g) {                                                               \
        float* row = scores + g * n;                                                                  \
        float mx = -INFINITY, sum = 0.f;                                                              \
        for (int64_t i = 0; i < n; ++i) mx = row[i] > mx ? row[i] : mx;                               \
        for (int64_t i = 0; i < n; ++i) { row[i] = expf(row[i] - mx); sum += row[i]; }                \
        const float inv = 1.f / sum;                                                                  \
        for (int64_t i = 0; i < n; ++i) row[i] *= inv;                                                \
      }                                                                                               \
      memset(acc, 0, sizeof(float) * G * D);                                                          \
      for (int64_t pos = lo; pos < hi; ++pos) {                                                       \
        const T* value = v + ((h * NB + table[pos / P - first]) * P + pos % P) * D;                   \
        for (int64_t g = 0; g < G; ++g) {                                                             \
          const float w = scores[g * n + (pos - lo)];                                                 \
          float* a = acc + g * D;                                                                     \
          _Pragma("omp simd")                                                                        \
          for (int64_t d = 0; d < D; ++d) a[d] += w * LOAD(value[d]);                                 \
        }                                                                                             \
      }                                                                                               \
      for (int64_t g = 0; g < G; ++g)                                                                 \
        for (int64_t d = 0; d < D; ++d) out[(b * H + h * G + g) * D + d] = STORE(acc[g * D + d]);    \
    }                                                                                                 \
  }

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)

DEFINE_DECODE(paged_decode_f32, float, LOAD_F32, STORE_F32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, bf16_to_f32, f32_to_bf16)

int64_t paged_decode_max_gd(void) { return MAX_GD; }
