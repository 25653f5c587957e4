"""The linear methods' rates at a model's layer shapes: bf16 pair dots against every int8 variant this CPU runs.

    python scripts/int8_rate.py                        # Qwen2.5-0.5B's q|k|v, gate (one of the pair) and down
    python scripts/int8_rate.py --threads 2 --rows 1 16 256 --shapes 1536x1536 8960x1536 1536x8960

GFLOP/s (GOP/s for int8) of each method over the shapes (N x K), best of 5 calls per shape; int8 includes
the per-row activation quantization. Beside them (over 16 rows) torch._int_mm on the same shapes: the bench's int8
GEMM probe, int32 out, no quantization. Seconds, not minutes: a probe of the kernels, not of the engine.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from cbrun.engine.backends.cpu.build.cpu_facts import cpu_model
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.cpu.linear.int8 import INT8_METHODS
from cbrun.engine.backends.cpu.linear.methods import DP_ISA, DP_TWIN


def _best(layer, x, repeats: int = 5) -> float:
    layer(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        layer(x)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--shapes", nargs="+", default=["1152x896", "4864x896", "896x4864"], help="N x K each")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    assert kernels is not None, "the compiled CPU kernels cannot be built here"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=generator) / k**0.5).bfloat16() for n, k in shapes]
    bf16 = DP_ISA if kernels.dp.variant_runs("isa") else DP_TWIN
    methods = [bf16, *(m for m in INT8_METHODS.values() if m.runs_on(kernels) and m.variant != "scalar")]
    print(f"{cpu_model()}, {args.threads} threads, shapes {' '.join(args.shapes)}")
    for rows in args.rows:
        inputs = [torch.randn(rows, k, generator=generator).bfloat16() for _, k in shapes]
        flops = sum(2.0 * rows * n * k for n, k in shapes)
        rates = []
        for method in methods:
            layers = [method.make(kernels, [w], [None]) for w in weights]
            seconds = sum(_best(layer, x) for layer, x in zip(layers, inputs))
            rates.append(f"{method.name} {flops / seconds / 1e9:7.1f}")
        if rows >= 17:  # torch._int_mm takes more than 16 rows: the bench's int8 probe, without quantization
            pairs = [
                (
                    torch.randint(-127, 128, (rows, k), dtype=torch.int8),
                    torch.randint(-127, 128, (k, n), dtype=torch.int8),
                )
                for n, k in shapes
            ]
            seconds = sum(_best(lambda a, b=b: torch._int_mm(a, b), a) for a, b in pairs)
            rates.append(f"torch._int_mm {flops / seconds / 1e9:7.1f}")
        print(f"M={rows:<5d}" + " | ".join(rates))
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
