/* AMX on this CPU and in this process: whether the CPU reports the tiles, and Linux's grant of the tile state,
 * asked for once per process (the bf16 and int8 linears share the answer). */
#ifndef CBRUN_AMX_STATE_H
#define CBRUN_AMX_STATE_H

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define CB_HAS_AMX_SOURCE 1 /* AMX code is compiled (target attributes) on every x86-64 Linux build */
#else
#define CB_HAS_AMX_SOURCE 0
#endif

#define CB_AMX_BF16 1 /* what cb_amx_runs asks for: the tiles and tdpbf16ps */
#define CB_AMX_INT8 2 /* the tiles and tdpbssd */

/* Whether this process can run AMX's `what` (CB_AMX_BF16 or CB_AMX_INT8): the CPU reports it and Linux granted
 * the tile state (asked once, at the first call; CPUID is asked once too: in a VM it traps to the hypervisor). */
int cb_amx_runs(int what);

#endif
