"""GMAC/s of each bf16 linear method in AMX's order (linear_dpbf16.c) on this CPU, per shape and thread count.

    python scripts/bf16_method_gmacs.py                     # every method this CPU runs, 1 and 2 threads
    CBRUN_KERNEL_MARCH=x86-64-v3 python scripts/bf16_method_gmacs.py --methods twin   # the AVX2 build's twin

Each method computes the same bits (tests/cpu_kernels/); this says what each costs. The weights are packed
once, as the engine holds them; x is bf16; the best of a few timed passes, so a figure includes each call's
fixed cost, as a decode step pays it. The plain-C reference runs only on the small shapes (it is ~1 GMAC/s).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels

# (M, K, N): a decode row, small and middle row groups, and prefill chunks at the default model's and a 1.5B's shapes
SHAPES = [(1, 576, 1536), (8, 576, 1536), (16, 896, 4864), (64, 1536, 1536), (256, 576, 1536), (128, 4864, 896)]


def _seconds(call, budget: float = 0.3) -> float:
    """Best seconds per call over five passes of about `budget` / 5 seconds each."""
    call()
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-6)
    repeats = max(1, int(budget / 5 / once))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="amx,isa,twin,scalar", help="comma-separated; those that run here")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--shapes", default=None, help="M,K,N;M,K,N... in place of the built-in shapes")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the compiled CPU kernels are unavailable")
    dp = kernels.dp
    methods = [m for m in args.methods.split(",") if dp.variant_runs(m)]
    print(f"methods that run here: {', '.join(methods)}")
    for nthreads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(nthreads)
        print(f"{nthreads} thread(s), GMAC/s")
        print("  " + f"{'M, K, N':>18} " + " ".join(f"{m:>8}" for m in methods))
        shapes = [tuple(map(int, s.split(","))) for s in args.shapes.split(";")] if args.shapes else SHAPES
        for rows, inner, outputs in shapes:
            weight = (torch.randn(outputs, inner) * 0.02).bfloat16()
            packed = dp.pack(weight)
            x = torch.randn(rows, inner).bfloat16()
            cells = []
            for method in methods:
                if method == "scalar" and rows * inner * outputs > 2e7:
                    cells.append(f"{'-':>8}")
                    continue
                seconds = _seconds(partial(dp.linear, x, packed, outputs, inner, method))
                cells.append(f"{rows * inner * outputs / seconds / 1e9:8.1f}")
            print("  " + f"{f'{rows}, {inner}, {outputs}':>18} " + " ".join(cells))


if __name__ == "__main__":
    main()
