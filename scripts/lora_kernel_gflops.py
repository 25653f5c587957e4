"""GFLOP/s of the rank-16 LoRA deltas of one layer's q|k|v: the grouped call (lora.c) against the fp32 linear
kernel run twice per member (A, then B: the path adapters took before the grouped call).

    python scripts/lora_kernel_gflops.py                    # SmolLM2-135M's q|k|v (K 576 -> 576, 192, 192)
    python scripts/lora_kernel_gflops.py --inner 896 --widths 896,128,128 --rank 16   # Qwen2.5-0.5B's

bf16 activations and outputs as in a bf16 model; one adapter on every row; the best of a few hundred calls
each, so the figure includes each call's fixed cost (what a decode step pays per layer).
"""

from __future__ import annotations

import argparse
import time

import torch

from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels


def _seconds(call, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inner", type=int, default=576)
    parser.add_argument("--widths", default="576,192,192")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", default="1,16,256,1536")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the compiled CPU kernels are unavailable")
    inner, rank, widths = args.inner, args.rank, [int(w) for w in args.widths.split(",")]
    pairs = [(torch.randn(rank, inner) * 0.02, torch.randn(rank, n) * 0.02) for n in widths]  # A, B^T
    b_rows = [bt.t().contiguous() for _, bt in pairs]  # B [N, r], as the fp32 linear reads it
    print(f"rank {rank}, K {inner} -> {widths}, {torch.get_num_threads()} threads")
    for tokens in (int(t) for t in args.rows.split(",")):
        flops = 2 * tokens * rank * (len(widths) * inner + sum(widths))
        grouped, linears = _measure(kernels, tokens, inner, pairs, b_rows)
        print(
            f"  {tokens:5d} rows: grouped {flops / grouped / 1e9:6.1f} GFLOP/s ({grouped * 1e3:7.3f} ms), "
            f"fp32 linears {flops / linears / 1e9:6.1f} GFLOP/s ({linears * 1e3:7.3f} ms)"
        )


def _measure(kernels, tokens: int, inner: int, pairs, b_rows) -> tuple[float, float]:
    """Seconds per call of the grouped call and of the per-member fp32 linears, on `tokens` rows."""
    x = torch.randn(tokens, inner).bfloat16()
    ys = [torch.zeros(tokens, bt.shape[1], dtype=torch.bfloat16) for _, bt in pairs]
    plan = kernels.lora.plan([torch.arange(tokens)], tokens)

    def per_member() -> None:
        wide = x.float()
        for (a, _), b, y in zip(pairs, b_rows, ys):
            y.copy_((y.float() + kernels.linear(kernels.linear(wide, a), b)).to(y.dtype))

    repeats = max(20, 3000 // tokens)
    operands = kernels.lora.pack([pairs], inner, [bt.shape[1] for _, bt in pairs])  # once, as a step's adapters are
    grouped = _seconds(lambda: kernels.lora.apply_packed(x, plan, operands, ys), repeats)
    return grouped, _seconds(per_member, repeats)


if __name__ == "__main__":
    main()
