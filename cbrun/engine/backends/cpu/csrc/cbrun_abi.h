/* The seam between the compiled kernels and Python: status codes, variant and role numbers, and the parameter
 * structs of the entry points that take many arguments. kernel_abi.py mirrors every definition here once (as
 * ctypes constants and Structures); tests/cpu_kernels/test_kernel_abi.py reads this file and checks that the
 * two agree, and the loader refuses a library whose struct sizes (cb_abi_size) differ from Python's. */
#ifndef CBRUN_ABI_H
#define CBRUN_ABI_H

#include <stdint.h>

/* ---- status codes: what every entry point that can refuse its input returns ---------------------------- */
#define CB_OK 0
#define CB_BAD_ARGS (-1)  /* arguments the kernel cannot handle: nothing written */
#define CB_NO_MEMORY (-2) /* scratch could not be allocated */
#define CB_NO_VARIANT (-3) /* this CPU cannot run the variant asked for */

/* ---- variants of the bf16 kernels (linear_dpbf16.c: AMX's order; attention.c: pair-dot scores) ------------- */
#define CB_DP_SCALAR 0 /* plain C: the reference */
#define CB_DP_TWIN 1   /* portable vectors under the CPU's flush modes */
#define CB_DP_ISA 2    /* vdpbf16ps (AVX512-BF16) */
#define CB_DP_AMX 3    /* tdpbf16ps (AMX-BF16): the linears only */

/* ---- variants of the int8 kernels (linear_int8.c) --------------------------------------------------------- */
#define CB_I8_SCALAR 0 /* plain C: the reference */
#define CB_I8_AVX2 1   /* vpmaddwd */
#define CB_I8_VNNI 2   /* AVX512-VNNI vpdpbusd */
#define CB_I8_AMX 3    /* AMX-INT8 tdpbssd */

/* ---- a weight's role in a packed matrix: all of a block, or a gated block's gate or up half -------------- */
#define CB_ROLE_PLAIN 0
#define CB_ROLE_GATE 1
#define CB_ROLE_UP 2

/* ---- what a packed linear computes ------------------------------------------------------------------------ */
#define CB_MODE_PLAIN 0 /* x @ W^T (+ bias), y [M, N] */
#define CB_MODE_SILU 1  /* silu(x @ Wg^T + bias) * (x @ Wu^T + up_bias), y [M, N] */
#define CB_MODE_RAW 2   /* the gate and up sums (+ biases) side by side, y [M, 2N] */
#define CB_MODE_INT 3   /* int8 only: the exact int32 sums of the quantized operands, y [M, N] int32 (tests) */

/* ---- paged attention (attention.c: paged_attend_f32, paged_attend_bf16, paged_attend_bf16dp) -------------- */
typedef struct {
  const void* q;               /* [R, H, D] rows ldq apart (heads D apart, unit stride) */
  const void* k;               /* [Hkv, NB, P, D] */
  const void* v;               /* [Hkv, NB, P, D] */
  const int64_t* tables;       /* [S, max_pages] */
  const int64_t* row_seq;      /* [R] */
  const int64_t* first_page;   /* [S] */
  const int64_t* kv_len;       /* [R] */
  const int64_t* kv_lo;        /* [R] */
  void* out;                   /* [R, H, D] */
  const int64_t* task_rows;    /* [R] */
  const int64_t* task_start;   /* [tasks + 1] */
  const int64_t* task_shared;  /* [tasks] */
  int64_t max_pages, R, S, H, D, Hkv, NB, P, tasks, ldq;
  float scale;
  int32_t variant; /* paged_attend_bf16dp: CB_DP_* (the others ignore it) */
  int32_t threads;
  int32_t paired_keys; /* paged_attend_bf16dp: k holds its pages' keys pair-major (attention_tile.h); else rows */
} cb_attend_params;

/* ---- K/V writes into the page pool (attention.c: paged_write) --------------------------------------------- */
typedef struct {
  void* pool;           /* [Hkv, slots_per_head, D] elements of elem bytes: a layer's [Hkv, NB, P, D] pool */
  const void* src;      /* [Hkv, T, D] the new tokens' rows, head_stride and token_stride elements apart */
  const int64_t* slots; /* [T] each token's flat slot in a head's slots_per_head = NB * P */
  int64_t T, Hkv, D, slots_per_head, head_stride, token_stride, elem;
  int64_t paired_page; /* 0: rows; P: bf16 keys written pair-major within pages of P slots (attention_tile.h) */
} cb_kv_write_params;

/* ---- a linear over a packed matrix (linear_dpbf16.c: dp_linear; linear_int8.c: i8_linear) ----------------- */
typedef struct {
  const void* x;        /* [M, K] rows ldx apart, bf16 (x_bf16) or fp32 */
  const void* packed;   /* the packed W (dp: bf16 pairs; int8: blocks with their column sums and scales) */
  const float* bias;    /* fp32 [N] or NULL */
  const float* up_bias; /* fp32 [N] or NULL (gated modes) */
  void* y;              /* [M, N] (CB_MODE_RAW: [M, 2N]) rows ldy apart, bf16 (y_bf16) or fp32 */
  void* scratch;        /* dp: dp_scratch_bytes for the rounded rows; int8: i8_scratch_bytes for the quantized rows */
  float* row_scales;    /* int8: [M] the rows' scales (dp: unused) */
  int64_t ldx, N, K, ldy, M;
  int32_t x_bf16, y_bf16, mode, variant, threads;
} cb_linear_params;

/* ---- a linear reading fp32 or bf16 weights in place (linear.c: linear_rows, gated_silu) ------------------- */
typedef struct {
  const void* x;           /* [M, K] rows ldx apart, bf16 (x_bf16) or fp32 */
  const void* const* w;    /* [count] weights, w[s] [n[s], K] contiguous, bf16 (w_bf16) or fp32 */
  const void* const* bias; /* [count] biases, bias[s] [n[s]] in the weights' type, or NULL */
  const int64_t* n;        /* [count] outputs of each weight */
  void* y;                 /* [M, sum n] rows ldy apart (gated_silu: [M, n[0]]), bf16 (y_bf16) or fp32 */
  float* xp;               /* x's panels: ceil(M / linear_panel_rows()) * linear_panel_rows() * K floats */
  int64_t ldx, ldy, M, K;
  int32_t count; /* linear_rows: 1 .. linear_max_segments(); gated_silu: 2, the gate then the up weight */
  int32_t x_bf16, w_bf16, y_bf16, threads;
} cb_dense_params;

/* ---- RMS norm of fp32 rows, after the residual add (layer_ops.c: rmsnorm_f32) ----------------------------- */
typedef struct {
  const float* x;     /* [T, heads * D] rows ldx apart */
  const float* delta; /* [T, heads * D] rows ldd apart, or NULL: with it, the rows of x + delta are normalized */
  float* sum_out;     /* [T, heads * D] rows lds apart: x + delta, stored (unused without delta) */
  const float* w;     /* [D] the norm's weight */
  float* out;         /* [T, heads * D] rows ldo apart */
  int64_t ldx, ldd, lds, ldo, T, heads, D;
  float eps;
  int32_t threads;
} cb_rmsnorm_params;

/* ---- sampling: one parallel pass per fp32 logits row (sampling.c: sample_rows_f32) ------------------------ */
typedef struct {
  const float* logits;   /* [N, V] rows row_stride apart */
  const float* inv_temp; /* [N] 1 / temperature (1 for greedy rows) */
  const double* uniform; /* [N] the row's draw in [0, 1), or a negative number for greedy rows */
  int64_t* token;        /* [N] out: the argmax, or the inverse-CDF draw of softmax(logits * inv_temp) */
  float* normalizer;     /* [N] out: logsumexp(logits * inv_temp) */
  float* scratch;        /* [threads, V] the exponentials of sampled rows */
  int64_t N, V, row_stride;
  int32_t threads;
} cb_sample_params;

/* Which struct cb_abi_size measures. */
#define CB_ABI_ATTEND 0
#define CB_ABI_LINEAR 1
#define CB_ABI_DENSE 2
#define CB_ABI_RMSNORM 3
#define CB_ABI_SAMPLE 4
#define CB_ABI_KV_WRITE 5

#endif
