"""Time bf16 paged attention per call, through each variant of AMX's order that runs here (or the one that serves).

Shapes: decode steps (one row per sequence, every row its own keys) of SmolLM2 (9 query / 3 KV heads of 64),
Qwen2.5-0.5B (14 / 2 of 64) and a 128-head shape (16 / 2), and one 256-token prefill chunk of SmolLM2, on pages
that follow each other in the pool. Prints the best of 5 runs of 10 calls, in milliseconds, on the process's
torch threads (set with --threads). With PYTHONPATH at another checkout it times that checkout's kernels, so
two versions compare in one session (its variant names may differ: it then times the one serving there). The
keys lie as an engine's pools hold them with this checkout (paired where a vector variant serves); --key-rows
times key rows instead (what the tiles read, and what checkouts before paired keys read).

    python scripts/bf16_attention_ms.py [--threads 2] [--variants amx,twin] [--key-rows]
"""

from __future__ import annotations

import argparse
import time

import torch

from cbrun.engine.backends.cpu.fused.attention_tasks import SequenceRows, plan_tasks
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.metadata import PagedRows

PAGE = 16


def case(kernels, heads: int, kv_heads: int, dim: int, lengths: list[int], chunk: int | None = None) -> tuple:
    """kernels.attend's arguments: decode rows over `lengths` keys, or one prefill chunk ending at lengths[0]."""
    gen = torch.Generator().manual_seed(0)
    pages_each = [(n + PAGE - 1) // PAGE for n in lengths]
    total = sum(pages_each) + 1
    k_pool = torch.randn(kv_heads, total, PAGE, dim, generator=gen).bfloat16()
    v_pool = torch.randn(kv_heads, total, PAGE, dim, generator=gen).bfloat16()
    tables = torch.zeros(len(lengths), max(pages_each), dtype=torch.long)
    first = 0
    for s, pages in enumerate(pages_each):
        tables[s, :pages] = torch.arange(first, first + pages)
        first += pages
    if chunk is None:
        seqs = [
            SequenceRows(s, n - 1, 1, tables[s, :p].tolist(), 0) for s, (n, p) in enumerate(zip(lengths, pages_each))
        ]
        row_seq, kv_len = torch.arange(len(lengths)), torch.tensor(lengths)
    else:
        n = lengths[0]
        seqs = [SequenceRows(0, n - chunk, chunk, tables[0, : pages_each[0]].tolist(), 0)]
        row_seq, kv_len = torch.zeros(chunk, dtype=torch.long), torch.arange(n - chunk + 1, n + 1)
    q = torch.randn(len(row_seq), heads, dim, generator=gen).bfloat16()
    zeros = torch.zeros(len(row_seq), dtype=torch.long)
    paged = PagedRows(tables, row_seq, torch.zeros(len(lengths), dtype=torch.long), kv_len, zeros)
    return q, k_pool, v_pool, paged, plan_tasks(seqs, PAGE, kernels.segment, windowed=False), dim**-0.5


def with_paired_keys(kernels, args: tuple) -> tuple:
    """case's arguments with the key pool rewritten pair-major (write_kv(paired=True)), as an engine's pools."""
    k_pool = args[1]
    heads, blocks, page, dim = k_pool.shape
    paired = torch.empty_like(k_pool)
    kernels.write_kv(paired, k_pool.view(heads, blocks * page, dim), torch.arange(blocks * page), paired=True)
    return (args[0], paired, *args[2:])


def best_ms(kernels, args: tuple, **options) -> float:
    for _ in range(3):
        kernels.attend(*args, **options)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            kernels.attend(*args, **options)
        best = min(best, (time.perf_counter() - start) / 10)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default="", help="comma-separated (default: the one that serves)")
    parser.add_argument("--key-rows", action="store_true", help="keys row by row, not paired")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("no C compiler here: the compiled attention cannot run")
    serving = kernels.attend_dp_variant
    variants = [v for v in options.variants.split(",") if v] or [serving]
    shapes = [
        ("decode, 9/3 heads of 64, 64 rows x 300 keys", (9, 3, 64, [300] * 64)),
        ("decode, 14/2 heads of 64, 32 rows x 600 keys", (14, 2, 64, [600] * 32)),
        ("decode, 16/2 heads of 128, 32 rows x 600 keys", (16, 2, 128, [600] * 32)),
        ("prefill chunk, 9/3 heads of 64, 256 tokens", (9, 3, 64, [256], 256)),
    ]
    print(f"{kernels.build_name}, {options.threads} threads, serving: {serving}")
    for name, shape in shapes:
        rows = case(kernels, *shape)
        timings = []
        for variant in variants:
            kernels.attend_dp_variant = variant
            paired = not options.key_rows and getattr(kernels, "paired_keys_for", None)
            if paired and kernels.paired_keys_for(torch.bfloat16, shape[2]):
                ms = best_ms(kernels, with_paired_keys(kernels, rows), paired_keys=True)
                timings.append(f"{variant} {ms:.3f} ms")
            else:
                timings.append(f"{variant} {best_ms(kernels, rows):.3f} ms" + (" (key rows)" if paired else ""))
        kernels.attend_dp_variant = serving
        print(f"{name}: " + ", ".join(timings))


if __name__ == "__main__":
    main()
