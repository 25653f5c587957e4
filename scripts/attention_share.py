"""What share of a decode step attention takes at long contexts (issue 31's measurement).

    python scripts/attention_share.py --model random:qwen2.5-1.5b --contexts 2048,8192 --batch 8 --steps 32

For each context length L: a batch of prompts of L tokens is prefilled (max_tokens=1), then the same prompts
run again with `steps` more tokens (prefixes served from the cache, so the second run is the decode steps). The
CPU backend's attention calls are timed in both; the decode steps' attention time over their wall time is the
share. Run it on a quiet machine: it reports seconds, and other load changes them.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="random:qwen2.5-1.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", default="2048,8192")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()

    from cbrun.bench.random_model import is_random, random_model_dir
    from cbrun.engine import Engine, EngineConfig, SamplingParams
    from cbrun.engine.backends.cpu.backend import CpuBackend
    from cbrun.models import load_model

    spec = str(random_model_dir(args.model)) if is_random(args.model) else args.model
    model, tokenizer = load_model(spec, args.dtype, "cpu")
    spent = [0.0]
    attend = CpuBackend.attend_rows

    def timed(self, *a, **k):
        start = time.perf_counter()
        out = attend(self, *a, **k)
        spent[0] += time.perf_counter() - start
        return out

    CpuBackend.attend_rows = timed  # type: ignore[method-assign]
    contexts = [int(c) for c in args.contexts.split(",")]
    page = 16
    blocks = args.batch * (max(contexts) + args.steps + page) // page + 64
    with Engine(model, tokenizer, EngineConfig(num_blocks=blocks, max_batch_tokens=2048)) as engine:
        vocab = model.config.get_text_config().vocab_size
        for length in contexts:
            gen = torch.Generator().manual_seed(length)
            prompts = [torch.randint(10, vocab - 10, (length,), generator=gen).tolist() for _ in range(args.batch)]
            engine.generate_batch(prompts, SamplingParams(max_tokens=1, temperature=0.0))  # prefill, cached
            spent[0] = 0.0
            start = time.perf_counter()
            engine.generate_batch(prompts, SamplingParams(max_tokens=args.steps, temperature=0.0, ignore_eos=True))
            wall = time.perf_counter() - start
            print(
                f"context {length}: {args.batch} sequences x {args.steps} decode steps in {wall:.2f} s "
                f"({wall / args.steps * 1e3:.0f} ms a step); attention {spent[0]:.2f} s = "
                f"{spent[0] / wall:.0%} of the decode time",
                flush=True,
            )


if __name__ == "__main__":
    main()
