"""int8 (W8A8) against the model's own dtype on the same prompts: how much quality --quantization int8 costs.

    python scripts/int8_quality.py                      # the default model (SmolLM2-135M), bf16 vs int8
    python scripts/int8_quality.py -m Qwen/Qwen2.5-0.5B-Instruct --max-tokens 64 --json out.json

For each chat prompt the model's dtype generates greedily; then both engines score those tokens
teacher-forced (the same contexts, so one early divergence does not spoil the rest):
  - greedy agreement: the share of those tokens that are also the int8 model's argmax;
  - identical continuations: prompts whose whole greedy output is the same in int8;
  - mean and max |delta logprob| of the dense model's tokens under the int8 model;
  - perplexity of a fixed text (or --text FILE) under each.
Figures belong in docs/performance.md with the model, the CPU and this command.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for a good night's sleep.",
    "Translate 'good morning' into Spanish, French and German.",
    "What is 17 times 23? Show your steps.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "List the planets of the solar system in order.",
    "What are the main differences between a cat and a dog as pets?",
    "Suggest a name for a bakery and explain it.",
    "How do vaccines work?",
    "Write a short email asking for a meeting next Tuesday.",
    "What is the difference between weather and climate?",
    "Describe a sunset to someone who has never seen one.",
]

TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. Farmers "
    "who had lived there all their lives said they had never seen it climb so fast. By noon the bridge "
    "was closed, and the school sent the children home early. In the town, shopkeepers stacked sandbags "
    "against their doors while volunteers carried furniture to the upper floors of the library. The mayor "
    "spoke on the radio in the afternoon: the water would crest that evening, she said, and the old levee "
    "should hold. It did. When the sun came out the next day, people walked down to the edge of the flood "
    "to look at the brown water spread across the valley, quiet now, reflecting the sky."
)


def _chat(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def _score(model, tokenizer, config, prompts, completions, text_ids):
    """(per prompt: (logprobs, argmax ids) of its completion, teacher-forced; the text's perplexity; seconds)."""
    from cbrun.engine import Engine

    started = time.perf_counter()
    with Engine(model, tokenizer, config) as engine:
        scored = engine.score_batch(prompts, [[c] for c in completions], top_logprobs=1)
        text = engine.score_batch([text_ids[:1]], [[text_ids[1:]]])[0]
        kernels = engine.linear_kernels()
    per_prompt = [(list(out.logprobs), [top[0][0] for top in out.top_logprobs or []]) for out in scored]
    perplexity = math.exp(-sum(text.logprobs) / len(text.logprobs))
    return per_prompt, perplexity, time.perf_counter() - started, kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", default="smollm2-135m", help="a model spec, as cbrun generate's -m")
    parser.add_argument("--dtype", default="bfloat16", help="the dense dtype int8 is compared with")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--text", help="a text file whose perplexity is measured (default: a fixed paragraph)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    from cbrun.engine import Engine, EngineConfig, SamplingParams
    from cbrun.engine.backends.cpu.build.cpu_facts import cpu_model
    from cbrun.models import load_model

    model, tokenizer = load_model(args.model, dtype=args.dtype, device="cpu")
    prompts = [_chat(tokenizer, p) for p in PROMPTS]
    text_ids = tokenizer(Path(args.text).read_text() if args.text else TEXT)["input_ids"]
    dense_config = EngineConfig(num_blocks=256)
    with Engine(model, tokenizer, dense_config) as engine:
        greedy = engine.generate_batch(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    completions = [list(out.token_ids) for out in greedy]
    dense, dense_ppl, dense_s, dense_kernels = _score(model, tokenizer, dense_config, prompts, completions, text_ids)
    int8_config = EngineConfig(num_blocks=256, quantization="int8")
    with Engine(model, tokenizer, int8_config) as engine:  # the int8 model's own greedy outputs
        int8_greedy = engine.generate_batch(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    int8, int8_ppl, int8_s, int8_kernels = _score(model, tokenizer, int8_config, prompts, completions, text_ids)

    tokens = agree = 0
    deltas: list[float] = []
    for completion, (dense_lp, _), (int8_lp, int8_top) in zip(completions, dense, int8):
        tokens += len(completion)
        agree += sum(a == b for a, b in zip(completion, int8_top))
        deltas += [abs(a - b) for a, b in zip(dense_lp, int8_lp)]
    identical = sum(list(a.token_ids) == list(b.token_ids) for a, b in zip(greedy, int8_greedy))
    figures = {
        "model": args.model,
        "dtype": args.dtype,
        "cpu": cpu_model(),
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "tokens_scored": tokens,
        "greedy_agreement": agree / tokens if tokens else None,
        "identical_continuations": identical,
        "mean_abs_delta_logprob": sum(deltas) / len(deltas) if deltas else None,
        "max_abs_delta_logprob": max(deltas) if deltas else None,
        "perplexity": {args.dtype: dense_ppl, "int8": int8_ppl},
        "text_tokens": len(text_ids),
        "linear_kernels": {args.dtype: dense_kernels, "int8": int8_kernels},
        "scoring_seconds": {args.dtype: round(dense_s, 2), "int8": round(int8_s, 2)},
    }
    print(f"{args.model} on {figures['cpu']}: int8 W8A8 against {args.dtype}, {len(prompts)} chat prompts")
    print(f"  greedy agreement (teacher-forced)  {100 * figures['greedy_agreement']:.1f}% of {tokens} tokens")
    print(f"  identical greedy continuations     {identical} of {len(prompts)}")
    mean, most = figures["mean_abs_delta_logprob"], figures["max_abs_delta_logprob"]
    print(f"  |delta logprob| of {args.dtype} tokens   mean {mean:.4f}, max {most:.4f}")
    print(f"  perplexity of the text ({len(text_ids)} tokens)  {args.dtype} {dense_ppl:.3f}, int8 {int8_ppl:.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
