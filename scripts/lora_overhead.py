"""What LoRA adapters cost a generation run: the same prompts with no adapter, all on one, and spread over several.

    python scripts/lora_overhead.py --model smollm2-135m --dtype bfloat16
    python scripts/lora_overhead.py --model qwen.gguf --rank 16 --adapters 4 --prompts 16 --output-len 32

Random adapters (A and B ~ N(0, 0.02)) on every q, k, v, o, gate, up and down projection; greedy decoding with
`max_tokens` fixed and EOS ignored, so each pass computes the same number of tokens. Prints output tokens per
second of each pass and its ratio to the pass without adapters (best of --repeats, the passes interleaved).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.models import load_model

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapter(model: torch.nn.Module, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A PEFT state dict of random A and B for every target linear of `model`."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in TARGETS:
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen) * 0.02
    return tensors


def _pass(engine: Engine, prompts: list[list[int]], loras: list[str | None], params: SamplingParams) -> float:
    """Seconds for one pass over every prompt."""
    start = time.perf_counter()
    ids = engine.add_requests(prompts, params, loras=loras)
    for _ in ids:
        out = engine.get_result(timeout=None)
        assert out.error is None, out.error
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    config = EngineConfig(enable_lora=True, max_lora_rank=args.rank, allow_block_sharing=False)
    with Engine(model, tokenizer, config) as engine:
        names = [f"lora{i}" for i in range(args.adapters)]
        for index, name in enumerate(names):
            engine.loras.add(name, _adapter(model, args.rank, index), config={"lora_alpha": 2 * args.rank})
        passes = {
            "no adapter": [None] * len(prompts),
            "one adapter": [names[0]] * len(prompts),
            f"{args.adapters} adapters + base": [
                ([None, *names])[i % (args.adapters + 1)] for i in range(len(prompts))
            ],
        }
        _pass(engine, prompts[:2], [None, names[0]], params)  # warm-up
        tokens = len(prompts) * args.output_len
        base = None
        print(
            f"{args.model} {args.dtype}, rank {args.rank}, {len(prompts)} prompts x {args.input_len} in / "
            f"{args.output_len} out; {engine.linear_kernels()}"
        )
        best = dict.fromkeys(passes, float("inf"))
        for _ in range(args.repeats):  # the passes interleaved, so a slow spell of a noisy machine hits them all
            for label, loras in passes.items():
                best[label] = min(best[label], _pass(engine, prompts, loras, params))
        for label, seconds in best.items():
            rate = tokens / seconds
            base = base or rate
            print(f"  {label:<22} {rate:8.1f} out tok/s  {rate / base:5.2f}x")


if __name__ == "__main__":
    main()
