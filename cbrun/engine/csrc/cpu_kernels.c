/* CPU kernels for the engine's hot path, called through ctypes.
 *
 * 1. paged_decode_{f32,bf16}: attention for rows with one query token each
 *    (decodes, short chunks over a cached context), keys and values read in
 *    place from the page pool (no gather copy).
 *
 *      q          [B, H, D]            query of each row
 *      k, v       [H_kv, NB, P, D]     one layer's key and value pages
 *      tables     [B, max_pages] int64 block ids; page i holds positions (first_page + i) * P ...
 *      kv_len     [B] int64            keys at positions < kv_len are visible ...
 *      kv_lo      [B] int64            ... and at positions >= kv_lo (sliding window; else 0)
 *      first_page [B] int64            logical page index of tables[b][0]
 *      out        [B, H, D]
 *
 *    Work is split over (row, kv head) pairs. Each streams its keys and values
 *    once, in chunks of up to 64 keys (spanning pages when pages are small),
 *    with an online softmax over its G = H / H_kv query heads (flash-decoding
 *    style): scores of a chunk, 8 keys per transposing reduction, one rescale
 *    of the running sum and accumulator, then the weighted values. The aim is
 *    one pass over the pages at full vector width, with fp32 accumulation;
 *    the next chunk is prefetched while one computes.
 *
 * 2. paged_write: store new tokens' K/V rows at their flat slots (any element size).
 *
 * 3. sample_rows_f32: per logits row, in one parallel pass over the vocabulary:
 *    max, argmax, log-sum-exp at the row's temperature, and (for sampled rows)
 *    the inverse-CDF draw for a given uniform number.
 *
 * 4. linear_f32: small-batch fp32 linear layers that read weights in place.
 *
 * Written with GCC/Clang vector extensions, so the compiler emits AVX2,
 * AVX-512 or NEON as the build machine allows (-march=native). Plain C with
 * OpenMP and no torch headers: it builds in a second or two.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define MAX_GD 4096 /* G * D per (row, kv head) */
#define SEG 64      /* keys scored per online-softmax segment */
#define MAX_G 64    /* query heads per kv head */

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

/* [sum(a[0]), ..., sum(a[7])]: pairwise lane sums, 7 shuffle pairs for 8 vectors */
static inline v8f reduce8(const v8f* a) {
  v8f s[4];
  for (int i = 0; i < 4; ++i) /* [x01, y01, x23, y23, x45, y45, x67, y67] of x = a[2i], y = a[2i+1] */
    s[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           SHUFFLE(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  v8f u[2];
  for (int i = 0; i < 2; ++i) /* sums of lane quarters: [w0..w3 low halves, w0..w3 high halves] */
    u[i] = SHUFFLE(s[2 * i], s[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           SHUFFLE(s[2 * i], s[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return SHUFFLE(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Type-dependent pieces: a dot product with a key row, value rows added into
 * accumulators, and the output store. C = D / 8 vectors per head row. */
#define DEFINE_ROW_OPS(SUFFIX, T, LOADV)                                                               \
  static inline float dot_##SUFFIX(const v8f* q, const T* key, int64_t C) {                            \
    v8f a0 = splat(0.f), a1 = splat(0.f);                                                             \
    int64_t c = 0;                                                                                     \
    for (; c + 1 < C; c += 2) {                                                                        \
      a0 += q[c] * LOADV(key + c * 8);                                                                 \
      a1 += q[c + 1] * LOADV(key + c * 8 + 8);                                                         \
    }                                                                                                  \
    if (c < C) a0 += q[c] * LOADV(key + c * 8);                                                        \
    return hsum(a0 + a1);                                                                              \
  }                                                                                                    \
  /* scores of 8 consecutive keys: 8 independent FMA chains, one transposing reduction */               \
  static inline v8f dot8_##SUFFIX(const v8f* q, const T* keys, int64_t C) {                            \
    v8f a[8];                                                                                          \
    for (int j = 0; j < 8; ++j) a[j] = splat(0.f);                                                     \
    for (int64_t c = 0; c < C; ++c) {                                                                  \
      const v8f qc = q[c];                                                                             \
      for (int j = 0; j < 8; ++j) a[j] += qc * LOADV(keys + j * C * 8 + c * 8);                        \
    }                                                                                                  \
    return reduce8(a);                                                                                 \
  }                                                                                                    \
  /* acc[C] += sum_j w[j] * values[j] */                                                                \
  static inline void accumulate_##SUFFIX(v8f* restrict acc, const float* w, const T* values, int64_t n,  \
                                         int64_t C) {                                                  \
    v8f a[MAX_GD / 8];                                                                                 \
    for (int64_t c = 0; c < C; ++c) a[c] = acc[c];                                                     \
    for (int64_t j = 0; j < n; ++j) {                                                                  \
      const v8f weight = splat(w[j]);                                                                  \
      const T* row = values + j * C * 8;                                                               \
      for (int64_t c = 0; c < C; ++c) a[c] += weight * LOADV(row + c * 8);                             \
    }                                                                                                  \
    for (int64_t c = 0; c < C; ++c) acc[c] = a[c];                                                     \
  }

DEFINE_ROW_OPS(f32, float, load_f32)
DEFINE_ROW_OPS(bf16, uint16_t, load_bf16)

/* Prefetch into L2 the key and value rows of the chunk of up to SEG keys at
 * position `start` (rows of `row_bytes`; pages of P rows found through `table`). */
static inline void prefetch_chunk(const void* k, const void* v, const int64_t* table, int64_t first,
                                  int64_t start, int64_t hi, int64_t P, int64_t row_bytes) {
  const int64_t end = hi - start < SEG ? hi : start + SEG;
  for (int64_t pos = start; pos < end;) {
    const int64_t in_page = pos % P;
    const int64_t cnt = P - in_page < end - pos ? P - in_page : end - pos;
    const int64_t offset = (table[pos / P - first] * P + in_page) * row_bytes;
    for (int64_t off = 0; off < cnt * row_bytes; off += 64) {
      __builtin_prefetch((const char*)k + offset + off, 0, 2);
      __builtin_prefetch((const char*)v + offset + off, 0, 2);
    }
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

/* One (row, kv head): G query heads against keys [lo, hi) of one sequence,
 * in segments of at most SEG keys that never cross a page. */
#define DEFINE_DECODE_TASK(SUFFIX, T, LOADV, STORE)                                                      \
  static inline __attribute__((always_inline)) void decode_task_##SUFFIX(                                \
      const T* q, const T* k, const T* v, const int64_t* table, int64_t first, int64_t lo, int64_t hi,   \
      T* out, int64_t G, int64_t D, int64_t P, float scale) {                                            \
    const int64_t C = D / 8;                                                                             \
    v8f qf[MAX_GD / 8], acc[MAX_GD / 8];                                                                 \
    float scores[SEG];                                                                                   \
    float m[MAX_G], l[MAX_G];                                                                            \
    for (int64_t i = 0; i < G * C; ++i) {                                                                \
      qf[i] = LOADV(q + i * 8) * splat(scale);                                                           \
      acc[i] = splat(0.f);                                                                               \
    }                                                                                                    \
    for (int64_t g = 0; g < G; ++g) { m[g] = -INFINITY; l[g] = 0.f; }                                    \
    /* chunks of up to SEG keys, which may span several pages; each chunk is    \
     * scored page piece by page piece, then one softmax update, then values */ \
    for (int64_t start = lo; start < hi;) {                                                              \
      const int64_t n = hi - start < SEG ? hi - start : SEG;                                             \
      if (start + n < hi) prefetch_chunk(k, v, table, first, start + n, hi, P, D * (int64_t)sizeof(T));  \
      for (int64_t g = 0; g < G; ++g) { /* later heads find the chunk in L1/L2 */                        \
        for (int64_t pos = start; pos < start + n;) {                                                    \
          const int64_t in_page = pos % P;                                                               \
          const int64_t cnt = P - in_page < start + n - pos ? P - in_page : start + n - pos;             \
          const T* keys = k + (table[pos / P - first] * P + in_page) * D;                                \
          float* s = scores + (pos - start);                                                             \
          int64_t j = 0;                                                                                 \
          for (; j + 8 <= cnt; j += 8) store_f32(s + j, dot8_##SUFFIX(qf + g * C, keys + j * D, C));     \
          for (; j < cnt; ++j) s[j] = dot_##SUFFIX(qf + g * C, keys + j * D, C);                         \
          pos += cnt;                                                                                    \
        }                                                                                                \
        const float correction = online_softmax(scores, n, m + g, l + g);                                \
        if (correction != 1.f)                                                                           \
          for (int64_t c = 0; c < C; ++c) acc[g * C + c] *= splat(correction);                           \
        for (int64_t pos = start; pos < start + n;) {                                                    \
          const int64_t in_page = pos % P;                                                               \
          const int64_t cnt = P - in_page < start + n - pos ? P - in_page : start + n - pos;             \
          const T* vals = v + (table[pos / P - first] * P + in_page) * D;                                \
          accumulate_##SUFFIX(acc + g * C, scores + (pos - start), vals, cnt, C);                        \
          pos += cnt;                                                                                    \
        }                                                                                                \
      }                                                                                                  \
      start += n;                                                                                        \
    }                                                                                                    \
    for (int64_t g = 0; g < G; ++g) {                                                                    \
      const v8f inv = splat(l[g] > 0.f ? 1.f / l[g] : 0.f);                                              \
      for (int64_t c = 0; c < C; ++c) STORE(out + g * D + c * 8, acc[g * C + c] * inv);                  \
    }                                                                                                    \
  }                                                                                                      \
                                                                                                         \
  void paged_decode_##SUFFIX(const T* q, const T* k, const T* v, const int64_t* tables,                  \
                             const int64_t* kv_len, const int64_t* kv_lo, const int64_t* first_page,     \
                             T* out, int64_t B, int64_t H, int64_t D, int64_t Hkv, int64_t NB, int64_t P, \
                             int64_t max_pages, float scale, int threads) {                              \
    const int64_t G = H / Hkv;                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                               \
    for (int64_t task = 0; task < B * Hkv; ++task) {                                                     \
      const int64_t b = task / Hkv, h = task % Hkv;                                                      \
      const int64_t offset = (b * H + h * G) * D;                                                        \
      const T* kh = k + h * NB * P * D;                                                                  \
      const T* vh = v + h * NB * P * D;                                                                  \
      const int64_t* table = tables + b * max_pages;                                                     \
      /* constant head sizes let the compiler keep accumulators in registers */                          \
      if (D == 64)                                                                                       \
        decode_task_##SUFFIX(q + offset, kh, vh, table, first_page[b], kv_lo[b], kv_len[b], out + offset, \
                             G, 64, P, scale);                                                           \
      else if (D == 128)                                                                                 \
        decode_task_##SUFFIX(q + offset, kh, vh, table, first_page[b], kv_lo[b], kv_len[b], out + offset, \
                             G, 128, P, scale);                                                          \
      else                                                                                               \
        decode_task_##SUFFIX(q + offset, kh, vh, table, first_page[b], kv_lo[b], kv_len[b], out + offset, \
                             G, D, P, scale);                                                            \
    }                                                                                                    \
  }

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

DEFINE_DECODE_TASK(f32, float, load_f32, store_f32)
DEFINE_DECODE_TASK(bf16, uint16_t, load_bf16, store_bf16)

int64_t paged_decode_max_gd(void) { return MAX_GD; }

/* pool [H_kv, NB * P, D] (contiguous); src [H_kv, T, D] with strides (head, token) in
 * elements and unit stride along D; slots [T]. Copies T * H_kv rows of D elements. */
void paged_write(char* pool, const char* src, const int64_t* slots, int64_t T, int64_t Hkv, int64_t D,
                 int64_t slots_per_head, int64_t head_stride, int64_t token_stride, int64_t elem) {
  const int64_t row = D * elem;
  for (int64_t h = 0; h < Hkv; ++h)
    for (int64_t t = 0; t < T; ++t)
      memcpy(pool + (h * slots_per_head + slots[t]) * row, src + (h * head_stride + t * token_stride) * elem, row);
}

/* Sampling, one row of fp32 logits per sequence.
 *   inv_temp[r]  1 / temperature (1 for greedy rows)
 *   uniform[r]   the row's draw in [0, 1), or a negative number for greedy rows
 * Outputs: token[r] (argmax, or the inverse-CDF draw of softmax(x * inv_temp)),
 *          normalizer[r] = logsumexp(x * inv_temp), so a logprob is x * inv_temp - normalizer.
 * scratch: [threads, V] floats for the exponentials of sampled rows. */
void sample_rows_f32(const float* logits, int64_t N, int64_t V, int64_t row_stride, const float* inv_temp,
                     const double* uniform, int64_t* token, float* normalizer, float* scratch, int threads) {
  _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
  for (int64_t r = 0; r < N; ++r) {
    const float* x = logits + r * row_stride;
    const float t = inv_temp[r];
    float* e = scratch + (int64_t)omp_get_thread_num() * V;
    float best = -INFINITY;
    int64_t best_index = 0;
    for (int64_t i = 0; i < V; ++i)
      if (x[i] > best) { best = x[i]; best_index = i; } /* first maximum, as torch.argmax */
    const float top = best * t;
    const int64_t V8 = V & ~(int64_t)7;
    v8f total = splat(0.f);
    for (int64_t i = 0; i < V8; i += 8) {
      v8f p = exp8(load_f32(x + i) * splat(t) - splat(top));
      store_f32(e + i, p);
      total += p;
    }
    float sum = hsum(total);
    for (int64_t i = V8; i < V; ++i) { e[i] = expf(x[i] * t - top); sum += e[i]; }
    normalizer[r] = top + logf(sum);
    if (uniform[r] < 0) { token[r] = best_index; continue; }
    /* inverse CDF: the first index whose running sum exceeds u * sum */
    const double target = uniform[r] * (double)sum;
    double running = 0.0;
    int64_t pick = -1, i = 0;
    for (; i < V8; i += 8) {
      const double block = (double)hsum(load_f32(e + i));
      if (running + block > target) break;
      running += block;
    }
    for (; i < V; ++i) {
      running += e[i];
      if (running > target && e[i] > 0.f) { pick = i; break; }
    }
    if (pick < 0) { /* float edge: the last token with any probability */
      for (pick = V - 1; pick > 0 && e[pick] == 0.f; --pick) {}
    }
    token[r] = pick;
  }
}

/* Small-M linear layer: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), fp32.
 *
 * At decode sizes (a few dozen rows) a BLAS GEMM spends as long repacking the
 * weight matrix on every call as it does multiplying. Here weights are read
 * once, in their own [N, K] layout, in tiles of NR rows that stay in L1 while
 * every MR-row tile of x (from L2) is multiplied against them (2 x 6 measured
 * best of 3x4, 4x3, 2x4, 2x6, 5x2, 1x8 on AVX2 at 8-64 rows); products are
 * accumulated along K in vector lanes and reduced once per output. */
#ifndef LIN_MR
#define LIN_MR 2
#endif
#ifndef LIN_NR
#define LIN_NR 6
#endif

/* Load a weight vector once into a register for all MR rows: left alone, compilers fold
 * the load into every FMA, which doubles the loads and makes the loop load-bound. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)
#endif

static inline __attribute__((always_inline)) void linear_tile(const float* x, int64_t ldx, const float* w,
                                                              int64_t K, float* y, int64_t ldy, int mr, int nr) {
  v8f acc[LIN_MR][LIN_NR];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = splat(0.f);
  const int64_t K8 = K & ~(int64_t)7;
  for (int64_t k = 0; k < K8; k += 8) {
    v8f xv[LIN_MR];
    for (int i = 0; i < mr; ++i) xv[i] = load_f32(x + i * ldx + k);
    for (int j = 0; j < nr; ++j) {
      v8f wv = load_f32(w + j * K + k);
      KEEP_IN_REGISTER(wv);
      for (int i = 0; i < mr; ++i) acc[i][j] += xv[i] * wv;
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = K8; k < K; ++k) s += x[i * ldx + k] * w[j * K + k];
      y[i * ldy + j] = s;
    }
}

static void linear_rows(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
                        int64_t M, int nr) {
  int64_t m = 0;
  for (; m + LIN_MR <= M; m += LIN_MR) {
    if (nr == LIN_NR) linear_tile(x + m * ldx, ldx, w, K, y + m * ldy, ldy, LIN_MR, LIN_NR);
    else linear_tile(x + m * ldx, ldx, w, K, y + m * ldy, ldy, LIN_MR, nr);
  }
  for (; m < M; ++m) linear_tile(x + m * ldx, ldx, w, K, y + m * ldy, ldy, 1, nr);
}

void linear_f32(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t M, int64_t N,
                int64_t K, int threads) {
  const int64_t tiles = (N + LIN_NR - 1) / LIN_NR;
  _Pragma("omp parallel for schedule(static) num_threads(threads)")
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n = t * LIN_NR;
    const int nr = (int)(N - n < LIN_NR ? N - n : LIN_NR);
    linear_rows(x, ldx, w + n * K, K, y + n, N, M, nr);
    if (bias)
      for (int64_t m = 0; m < M; ++m)
        for (int j = 0; j < nr; ++j) y[m * N + n + j] += bias[n + j];
  }
}
