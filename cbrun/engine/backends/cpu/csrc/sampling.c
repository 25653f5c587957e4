#include <math.h>
#include <stdint.h>
#include <omp.h>

#include "cbrun_abi.h"
#include "vec.h"

/* Sampling, one row of fp32 logits per sequence (cb_sample_params in cbrun_abi.h: the arguments and shapes).
 * Outputs: token[r] (argmax, or the inverse-CDF draw of softmax(x * inv_temp) at uniform[r]),
 *          normalizer[r] = logsumexp(x * inv_temp), so a logprob is x * inv_temp - normalizer.
 * The fields are read into locals once: the loop's stores could alias *a, so the compiler would reload them. */
void sample_rows_f32(const cb_sample_params* a) {
  const float *logits = a->logits, *inv_temp = a->inv_temp;
  const double* uniform = a->uniform;
  int64_t* token = a->token;
  float *normalizer = a->normalizer, *scratch = a->scratch;
  const int64_t N = a->N, V = a->V, row_stride = a->row_stride;
  _Pragma("omp parallel for schedule(dynamic, 1) num_threads(a->threads)")
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

/* Structured outputs and min_tokens: logits[rows[i]][t] = -inf for every token t < vocab whose bit is clear in
 * masks[i] (packed: bit t % 32 of word t / 32; `words` words per row). An assignment per disallowed token, in
 * that row only: the same values as torch's masked_fill, in one pass instead of unpacking the bits to a tensor. */
void apply_token_masks(float* logits, int64_t ld, const int64_t* rows, const int32_t* masks, int64_t count,
                       int64_t words, int64_t vocab, int threads) {
  _Pragma("omp parallel for num_threads(threads) schedule(static)")
  for (int64_t i = 0; i < count; ++i) {
    float* row = logits + rows[i] * ld;
    const uint32_t* mask = (const uint32_t*)(masks + i * words);
    for (int64_t w = 0; w < words && w * 32 < vocab; ++w) {
      const uint32_t bits = mask[w];
      if (bits == 0xFFFFFFFFu) continue; /* all 32 allowed */
      const int64_t base = w * 32;
      if (base + 32 <= vocab) { /* a whole word: a select per lane, no branch (vectorizes) */
        for (int b = 0; b < 32; ++b) row[base + b] = ((bits >> b) & 1u) ? row[base + b] : -INFINITY;
        continue;
      }
      for (int b = 0; b < 32 && base + b < vocab; ++b)
        if (!((bits >> b) & 1u)) row[base + b] = -INFINITY;
    }
  }
}

/* Top-p's cut, one row of log-probs sorted in descending order per sequence: count[r] = the smallest c >= 1
 * with sum_{i < c} exp(lp[i]) >= p[r] * sum_i exp(lp[i]) (V if none), the number of leading tokens top-p keeps.
 * exp is exp8 lane by lane (the tail padded into one more vector) and the sums run in double in index order,
 * so the cut is the same on every CPU and build; torch's exp and softmax are not (their vector widths differ). */
void top_p_counts_f32(const float* lp, int64_t ld, const float* p, int64_t* count, int64_t N, int64_t V,
                      float* scratch, int threads) {
  _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
  for (int64_t r = 0; r < N; ++r) {
    const float* x = lp + r * ld;
    float* e = scratch + (int64_t)omp_get_thread_num() * (V + 8);
    for (int64_t i = 0; i < V; i += 8) {
      float lane[8];
      for (int l = 0; l < 8; ++l) lane[l] = i + l < V ? x[i + l] : -INFINITY;
      store_f32(e + i, exp8(load_f32(lane)));
      for (int l = 0; l < 8 && i + l < V; ++l)
        if (lane[l] == -INFINITY) e[i + l] = 0.f; /* a dropped token (exp8 clamps its input) */
    }
    double total = 0.0;
    for (int64_t i = 0; i < V; ++i) total += e[i];
    const double target = (double)p[r] * total;
    double before = 0.0;
    int64_t c = 1;
    for (; c < V; ++c) {
      before += e[c - 1];
      if (before >= target) break;
    }
    count[r] = c;
  }
}
