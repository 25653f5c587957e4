/* The sizes of the parameter structs (cbrun_abi.h), so that the loader can refuse a library whose structs
 * differ from kernel_abi.py's before any kernel reads one. */
#include <stddef.h>

#include "cbrun_abi.h"

int64_t cb_abi_size(int which) {
  switch (which) {
    case CB_ABI_ATTEND: return (int64_t)sizeof(cb_attend_params);
    case CB_ABI_LINEAR: return (int64_t)sizeof(cb_linear_params);
    case CB_ABI_DENSE: return (int64_t)sizeof(cb_dense_params);
    case CB_ABI_RMSNORM: return (int64_t)sizeof(cb_rmsnorm_params);
    case CB_ABI_SAMPLE: return (int64_t)sizeof(cb_sample_params);
    case CB_ABI_KV_WRITE: return (int64_t)sizeof(cb_kv_write_params);
    default: return -1;
  }
}
