"""The machine's compute ceiling: model FLOPs per token against a measured GEMM rate.

A decoder's forward costs about 2 FLOPs per weight per token, so a token
costs 2 * (non-embedding parameters + LM head) FLOPs (the embedding lookup is
a gather, attention over the context is left out). Dividing the achieved
tokens/s times that cost by the GEMM rate torch reaches on this machine at
256 rows tells how close an engine runs to what the hardware can do. With
--quantization int8 the int8 rate is measured beside it: cbrun's own W8A8 kernel
(activation quantization included) and torch's int8 GEMM (`torch._int_mm`),
the best of them.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GEMM_ROWS = 256
SQUARE_SIZE = 2048


def model_gflop_per_token(model: Any) -> float:
    """2 * (non-embedding parameters + LM head weights) / 1e9, from the loaded model."""
    embed = model.get_input_embeddings().weight
    head_module = model.get_output_embeddings()
    head = head_module.weight if head_module is not None else embed
    skip = {id(embed), id(head)}
    body = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    return 2.0 * (body + head.numel()) / 1e9


def model_gemm_shapes(model: Any) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's linear layers plus the LM head (the shapes a step runs)."""
    import torch

    shapes: list[tuple[int, int]] = []
    for name, module in model.named_modules():
        layer = _layer_index(name)
        if isinstance(module, torch.nn.Linear) and layer in (None, 0):  # layer 0 stands for all layers
            shapes.append((module.in_features, module.out_features))
    return shapes


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for a, b in itertools.pairwise(parts):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


def measure_gemm_gflops(
    shapes: list[tuple[int, int]],
    dtype: torch.dtype,
    device: str = "cpu",
    rows: int = GEMM_ROWS,
    repeats: int = 5,
    budget_s: float = 2.0,
) -> float:
    """Best GFLOP/s of `rows` x K inputs through K -> N linear layers over `shapes` (summed FLOPs / summed time).

    Uses `F.linear` with [N, K] weights, the layout and kernel a model's
    forward uses (on some CPUs `matmul` with a [K, N] operand takes a far slower
    bf16 path). Repeats stop early once `budget_s` is spent.
    """
    import torch
    import torch.nn.functional as F

    inputs = [
        (torch.randn(rows, k, dtype=dtype, device=device), torch.randn(n, k, dtype=dtype, device=device))
        for k, n in shapes
    ]
    flops = sum(2.0 * rows * k * n for k, n in shapes)
    best = float("inf")
    spent = 0.0
    with torch.inference_mode():
        for a, w in inputs:  # warm-up: first calls pick kernels and allocate
            F.linear(a, w)
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            for a, w in inputs:
                F.linear(a, w)
            _sync(device)
            elapsed = time.perf_counter() - start
            best, spent = min(best, elapsed), spent + elapsed
            if spent > budget_s:
                break
    return flops / best / 1e9


def measure_int8_gops(
    shapes: list[tuple[int, int]], rows: int = GEMM_ROWS, repeats: int = 5, budget_s: float = 2.0
) -> dict[str, float]:
    """Best GOP/s of `rows` x K inputs through K -> N int8 layers over `shapes`: {"cbrun": the W8A8 kernel of the
    first int8 method this CPU runs (fp32 rows in, quantized per row, fp32 out), "torch": torch._int_mm on int8
    operands (int32 out; 0 where it cannot run)}. Repeats stop early once `budget_s` is spent."""
    import torch

    from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
    from cbrun.engine.backends.cpu.linear.int8 import INT8_METHODS

    generator = torch.Generator().manual_seed(0)
    layers = [(torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator)) for k, n in shapes]
    flops = sum(2.0 * rows * k * n for k, n in shapes)
    calls = []
    kernels = load_cpu_kernels()
    method = next((m for m in INT8_METHODS.values() if kernels is not None and m.runs_on(kernels)), None)
    if method is not None and kernels is not None:
        made = [(x, method.make(kernels, [w], [None])) for x, w in layers]
        calls.append(("cbrun", lambda: [layer(x) for x, layer in made]))
    quantized = [
        (torch.randint(-127, 128, x.shape, dtype=torch.int8), torch.randint(-127, 128, w.T.shape, dtype=torch.int8))
        for x, w in layers
    ]
    calls.append(("torch", lambda: [torch._int_mm(x, w) for x, w in quantized]))
    rates = {}
    for name, call in calls:
        try:
            call()  # warm-up
        except RuntimeError:  # this torch has no CPU int8 GEMM for these shapes (cbrun's own kernel must run)
            if name == "cbrun":
                raise
            rates[name] = 0.0
            continue
        best, spent = float("inf"), 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
            best, spent = min(best, elapsed), spent + elapsed
            if spent > budget_s:
                break
        rates[name] = flops / best / 1e9
    return rates


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def measure_ceiling(model: Any, run_dtype: torch.dtype, device: str = "cpu", quantization: str | None = None) -> dict:
    """GFLOP/token and GEMM rates: bf16 (the reference) and the run's dtype, each the best of model shapes and a
    square; with quantization "int8" (on CPU), the int8 rates too (measure_int8_gops)."""
    import torch

    shapes = model_gemm_shapes(model) or [(SQUARE_SIZE, SQUARE_SIZE)]
    rates: dict[str, dict[str, float]] = {}
    for dtype in dict.fromkeys([torch.bfloat16, run_dtype]):
        name = str(dtype).removeprefix("torch.")
        model_rate = measure_gemm_gflops(shapes, dtype, device)
        square_rate = measure_gemm_gflops([(SQUARE_SIZE, SQUARE_SIZE)], dtype, device)
        rates[name] = {
            "model_shapes": round(model_rate, 1),
            "square": round(square_rate, 1),
            "best": round(max(model_rate, square_rate), 1),
        }
    if quantization == "int8" and device == "cpu":
        model_rates = measure_int8_gops(shapes)
        square_rates = measure_int8_gops([(SQUARE_SIZE, SQUARE_SIZE)])
        rates["int8"] = {
            "model_shapes": round(model_rates.get("cbrun", 0.0), 1),
            "square": round(square_rates.get("cbrun", 0.0), 1),
            "torch_int_mm": round(max(model_rates["torch"], square_rates["torch"]), 1),
            "best": round(max(*model_rates.values(), *square_rates.values()), 1),
        }
    return {
        "gflop_per_token": model_gflop_per_token(model),
        "gemm_rows": GEMM_ROWS,
        "gemm_gflops": rates,
        "reference_dtype": "bfloat16",
    }


def ceiling_fraction(tokens_per_s: float, ceiling: dict, dtype: str = "bfloat16") -> float | None:
    """Computed tokens/s * GFLOP/token / GEMM GFLOP/s (the best rate measured in `dtype`)."""
    rate = ceiling.get("gemm_gflops", {}).get(dtype, {}).get("best")
    if not rate:
        return None
    return tokens_per_s * ceiling["gflop_per_token"] / rate
