"""A small GRPO-style RL loop on cbrun's vLLM-compatible API: sample, reward, train, update weights in place.

    python examples/rl_loop.py                      # a tiny random model, built here (seconds; what CI runs)
    python examples/rl_loop.py --model smollm2-135m --iterations 3

Each iteration: sample n = 8 completions per prompt with logprobs, score them with a reward in plain
Python, take a few optimizer steps with torch on the trainer's copy of the same model (the engine's
memory is given back meanwhile: `llm.sleep()`), then `llm.update_weights(trainer.state_dict())`.
It asserts that the engine's logprobs agree with the trainer's own forward (within --tolerance) and,
at the end, that the updated engine's tokens and logprobs equal a fresh engine's, loaded from the
trained weights, bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cbrun import LLM, SamplingParams
from cbrun.models import load_model

PROMPTS = [
    [{"role": "user", "content": "Name a fruit."}],
    [{"role": "user", "content": "Say something about the sea."}],
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Write one word."}],
]


def reward(text: str) -> float:
    """Plain Python: short answers that use the letter e score higher."""
    return text.lower().count("e") / (1 + len(text)) - 0.002 * len(text)


def build_tiny_model(folder: Path) -> Path:
    """A 2-layer random Llama with a byte-level BPE tokenizer and a chat template, saved as an HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    corpus = ["name a fruit apple pear", "the sea is deep and blue", "two plus two is four", "one word here"] * 8
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        corpus,
        trainer=trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<pad>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template="{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    )
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def sequence_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The trainer's own logprob of each completion token (temperature 1), with gradients. [len(completion)]"""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [len(completion), V]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def train(trainer, optimizer, rollouts, steps: int) -> float:
    """GRPO on one batch of rollouts: group-normalized advantages, on-policy policy-gradient steps."""
    trainer.train()
    loss_value = 0.0
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.zeros(())
        count = 0
        for prompt_ids, completions, advantages in rollouts:
            for tokens, advantage in zip(completions, advantages):
                if tokens and advantage:
                    loss = loss - advantage * sequence_logprobs(trainer, prompt_ids, tokens).sum()
                    count += 1
        if count:
            (loss / count).backward()
            optimizer.step()
        loss_value = float(loss.detach()) / max(count, 1)
    trainer.eval()
    return loss_value


def check_logprobs_agree(trainer, outputs, tolerance: float) -> float:
    """The largest |engine logprob - trainer logprob| over every sampled token; asserts it is within tolerance."""
    worst = 0.0
    with torch.no_grad():
        for out in outputs:
            for c in out.outputs:
                engine = torch.tensor([p[t].logprob for t, p in zip(c.token_ids, c.logprobs)])
                own = sequence_logprobs(trainer, out.prompt_token_ids, c.token_ids)
                worst = max(worst, float((engine - own).abs().max()))
    assert worst <= tolerance, f"engine and trainer logprobs differ by {worst:.2e} > {tolerance:.0e}"
    return worst


def fingerprint(outputs) -> list:
    return [(c.token_ids, [p[t].logprob for t, p in zip(c.token_ids, c.logprobs)]) for o in outputs for c in o.outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a cbrun model spec; default: a tiny random model built here")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per iteration")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--tolerance", type=float, default=1e-3, help="engine vs trainer logprobs, absolute")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="cbrun-rl-") as scratch:
        scratch = Path(scratch)
        spec = args.model or str(build_tiny_model(scratch / "tiny"))
        lr = args.lr if args.lr is not None else (1e-3 if args.model is None else 1e-5)
        llm = LLM(spec, dtype="float32", seed=0)
        trainer, tokenizer = load_model(spec, dtype="float32", device="cpu")  # the trainer's own copy
        optimizer = torch.optim.Adam(trainer.parameters(), lr=lr)
        params = SamplingParams(n=8, temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=1)

        for iteration in range(args.iterations):
            started = time.perf_counter()
            outputs = llm.chat(PROMPTS, params, use_tqdm=False)
            generated = time.perf_counter()
            worst = check_logprobs_agree(trainer, outputs, args.tolerance)
            rollouts, rewards = [], []
            for out in outputs:
                scores = [reward(c.text) for c in out.outputs]
                mean, spread = statistics.fmean(scores), statistics.pstdev(scores)
                rollouts.append(
                    (
                        out.prompt_token_ids,
                        [c.token_ids for c in out.outputs],
                        [(s - mean) / (spread + 1e-6) for s in scores],
                    )
                )
                rewards += scores
            checked = time.perf_counter()
            llm.sleep()  # the KV pool goes back to the OS while the trainer works
            loss = train(trainer, optimizer, rollouts, args.steps)
            llm.wake_up()
            trained = time.perf_counter()
            llm.update_weights(trainer.state_dict())
            updated = time.perf_counter()
            print(
                f"iteration {iteration}: mean reward {statistics.fmean(rewards):+.4f}, loss {loss:+.4f}, "
                f"engine vs trainer logprobs max |diff| {worst:.1e}; "
                f"generate {generated - started:.2f}s, train {trained - checked:.2f}s, "
                f"update {updated - trained:.2f}s (logprob check {checked - generated:.2f}s)",
                flush=True,
            )

        after_update = llm.chat(PROMPTS, params, use_tqdm=False)
        check_logprobs_agree(trainer, after_update, args.tolerance)
        trained_dir = scratch / "trained"
        trainer.save_pretrained(trained_dir)
        tokenizer.save_pretrained(trained_dir)
        llm.close()
        with LLM(str(trained_dir), dtype="float32", seed=0) as fresh:
            assert fingerprint(after_update) == fingerprint(fresh.chat(PROMPTS, params, use_tqdm=False)), (
                "the updated engine differs from a fresh engine with the trained weights"
            )
        print("after the last update: tokens and logprobs equal a fresh engine's bit for bit")


if __name__ == "__main__":
    main()
