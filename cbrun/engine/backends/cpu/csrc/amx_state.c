/* See amx_state.h. */
#include "amx_state.h"

#if CB_HAS_AMX_SOURCE
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

/* CPUID leaf 7 EDX: bit 22 AMX-BF16, bit 24 AMX-TILE, bit 25 AMX-INT8; then arch_prctl(ARCH_REQ_XCOMP_PERM). */
static int amx_features(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1)) return 0;
  const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
  return (d >> 22 & 1 ? CB_AMX_BF16 : 0) | (d >> 25 & 1 ? CB_AMX_INT8 : 0);
}

int cb_amx_runs(int what) {
  static int features = -1; /* the first call (the kernels' load) sets it; later calls only read */
  if (features < 0) features = amx_features();
  return (features & what) == what;
}
#else
int cb_amx_runs(int what) {
  (void)what;
  return 0;
}
#endif
