"""A small GRPO-style RL loop on cbrun's vLLM-compatible API: sample, reward, train, update weights in place.

    python examples/rl_loop.py                      # a tiny random model, built here (seconds; what CI runs)
    python examples/rl_loop.py --dtype bfloat16
    python examples/rl_loop.py --model smollm2-135m --iterations 3
    python examples/rl_loop.py --lora                # train a rank-8 PEFT LoRA adapter instead of the weights

Each iteration: sample n = 8 completions per prompt with logprobs, score them with a reward in plain
Python, take a few PPO-clipped optimizer steps with torch on the trainer's copy of the same model (the
engine's memory is given back meanwhile: `llm.sleep()`), then `llm.update_weights(trainer.state_dict())`.
The trainer's logprobs come from `cbrun.training.ExactLogprobs`: the engine's arithmetic on the trainer's
weights, with the stock model's gradients. So before the first optimizer step of an iteration the
policy ratio exp(trainer - rollout) is exactly 1 on every token, and each iteration prints
`on-policy max |ratio - 1|: 0.0`, in fp32 and bf16. At the end it asserts that the trainer gives the
updated engine's samples their rollout logprobs bit for bit, and that the updated engine's tokens and
logprobs equal a fresh engine's, loaded from the trained weights, bit for bit.

With --lora the trainer is a PEFT LoRA model (the base frozen, A and B trained), the engine holds the
adapter apart from the base (`enable_lora`; requests name it with `lora_request`), and each iteration ends
with `llm.update_lora("policy", get_peft_model_state_dict(trainer))` instead of update_weights; the fresh
engine at the end loads the adapter's saved PEFT directory. The ratio is exactly 1 there too.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cbrun import LLM, LoRARequest, SamplingParams
from cbrun.models import load_model
from cbrun.training import ExactLogprobs

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


class Rollouts:
    """One iteration's samples as a padded batch: prompt + completion per row, the rollout's logprobs at the
    completion tokens, and each row's group-normalized advantage."""

    def __init__(self, outputs, rewards: list[list[float]]) -> None:
        rows, old, advantages = [], [], []
        for out, scores in zip(outputs, rewards):
            mean, spread = statistics.fmean(scores), statistics.pstdev(scores)
            for c, score in zip(out.outputs, scores):
                rows.append((list(out.prompt_token_ids), list(c.token_ids)))
                old.append([p[t].logprob for t, p in zip(c.token_ids, c.logprobs)])
                advantages.append((score - mean) / (spread + 1e-6))
        length = max(len(p) + len(c) for p, c in rows)
        self.ids = torch.zeros(len(rows), length, dtype=torch.long)  # [B, L] right-padded
        self.mask = torch.zeros_like(self.ids)  # [B, L] 1 at real tokens
        self.completion = torch.zeros(len(rows), length, dtype=torch.bool)  # [B, L] the sampled tokens
        self.old = torch.zeros(len(rows), length)  # [B, L] the rollout's logprob of each sampled token
        for b, ((prompt, completion), logprobs) in enumerate(zip(rows, old)):
            end = len(prompt) + len(completion)
            self.ids[b, :end] = torch.tensor(prompt + completion)
            self.mask[b, :end] = 1
            self.completion[b, len(prompt) : end] = True
            self.old[b, len(prompt) : end] = torch.tensor(logprobs)
        self.advantages = torch.tensor(advantages)[:, None]  # [B, 1]


def train(exact: ExactLogprobs, optimizer, batch: Rollouts, steps: int, clip: float = 0.2) -> tuple[float, float]:
    """PPO-clipped GRPO steps on one batch; returns (the last loss, max |ratio - 1| before the first step).

    The trainer's logprobs come from `exact`: the engine's arithmetic, so on-policy the ratio is exactly 1."""
    exact.model.train()
    loss_value, gap = 0.0, float("nan")
    count = batch.completion.sum().clamp(min=1)
    for step in range(steps):
        optimizer.zero_grad()
        new = exact(batch.ids, batch.mask).logprobs  # [B, L]
        ratio = torch.exp(torch.where(batch.completion, new - batch.old, torch.zeros_like(new)))  # [B, L]
        if step == 0:
            gap = float((ratio.detach() - 1).abs().max())  # before any optimizer step: on-policy
        surrogate = torch.minimum(ratio * batch.advantages, ratio.clamp(1 - clip, 1 + clip) * batch.advantages)
        loss = -(surrogate * batch.completion).sum() / count
        loss.backward()
        optimizer.step()
        loss_value = float(loss.detach())
    exact.model.eval()
    return loss_value, gap


class Policy:
    """A PEFT LoRA adapter on every projection of the trainer's model, and how the engine is given it."""

    name, lora_int_id = "policy", 1

    def __init__(self, model, rank: int) -> None:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
        self.model = get_peft_model(model, config)
        self.request = LoRARequest(self.name, self.lora_int_id)

    def sync(self, llm: LLM) -> None:
        """The adapter's current A and B into the engine, in place: no file (added on the first call)."""
        from peft import get_peft_model_state_dict

        config = self.model.peft_config["default"].to_dict()
        llm.update_lora(self.name, get_peft_model_state_dict(self.model), config=config, lora_int_id=self.lora_int_id)


def fingerprint(outputs) -> list:
    return [(c.token_ids, [p[t].logprob for t, p in zip(c.token_ids, c.logprobs)]) for o in outputs for c in o.outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a cbrun model spec; default: a tiny random model built here")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="engine and trainer")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per iteration")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter, not the full weights")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="cbrun-rl-") as scratch:
        scratch = Path(scratch)
        spec = args.model or str(build_tiny_model(scratch / "tiny"))
        lr = args.lr if args.lr is not None else (1e-3 if args.model is None else 1e-5)
        trainer, tokenizer = load_model(spec, dtype=args.dtype, device="cpu")  # the trainer's own copy
        policy = Policy(trainer, args.lora_rank) if args.lora else None
        if policy is not None:
            trainer, lr = policy.model, (args.lr if args.lr is not None else 1e-2)
        llm = LLM(spec, dtype=args.dtype, seed=0, enable_lora=args.lora, max_lora_rank=args.lora_rank)
        sync = policy.sync if policy is not None else (lambda llm: llm.update_weights(trainer.state_dict()))
        if policy is not None:
            sync(llm)  # the engine holds the adapter as the trainer starts it
        exact = ExactLogprobs(trainer, args.dtype)  # its logprobs: the engine's arithmetic, with gradients
        optimizer = torch.optim.Adam([p for p in trainer.parameters() if p.requires_grad], lr=lr)
        params = SamplingParams(n=8, temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=1)
        lora = policy.request if policy is not None else None

        for iteration in range(args.iterations):
            started = time.perf_counter()
            outputs = llm.chat(PROMPTS, params, use_tqdm=False, lora_request=lora)
            generated = time.perf_counter()
            rewards = [[reward(c.text) for c in out.outputs] for out in outputs]
            batch = Rollouts(outputs, rewards)
            llm.sleep()  # the KV pool goes back to the OS while the trainer works
            loss, gap = train(exact, optimizer, batch, args.steps)
            llm.wake_up()
            trained = time.perf_counter()
            sync(llm)
            updated = time.perf_counter()
            print(f"on-policy max |ratio - 1|: {gap}", flush=True)
            mean_reward = statistics.fmean(r for group in rewards for r in group)
            print(
                f"iteration {iteration}: mean reward {mean_reward:+.4f}, loss {loss:+.4f}; "
                f"generate {generated - started:.2f}s, train {trained - generated:.2f}s, "
                f"update {updated - trained:.2f}s",
                flush=True,
            )

        after_update = llm.chat(PROMPTS, params, use_tqdm=False, lora_request=lora)
        with torch.no_grad():  # the updated engine's samples: the trainer gives them their rollout bits again
            batch = Rollouts(after_update, [[0.0] * len(out.outputs) for out in after_update])
            new = exact(batch.ids, batch.mask).logprobs
        assert torch.equal(new[batch.completion], batch.old[batch.completion]), "trainer and engine differ"
        trained_dir = scratch / "trained"
        trainer.save_pretrained(trained_dir)  # with --lora: the adapter's PEFT directory
        llm.close()
        if policy is None:
            tokenizer.save_pretrained(trained_dir)
            fresh = LLM(str(trained_dir), dtype=args.dtype, seed=0)
        else:
            fresh = LLM(spec, dtype=args.dtype, seed=0, enable_lora=True, max_lora_rank=args.lora_rank)
            lora = LoRARequest(policy.name, policy.lora_int_id, str(trained_dir))
        with fresh:
            assert fingerprint(after_update) == fingerprint(
                fresh.chat(PROMPTS, params, use_tqdm=False, lora_request=lora)
            ), "the updated engine differs from a fresh engine with the trained weights"
        print("after the last update: tokens and logprobs equal a fresh engine's bit for bit")


if __name__ == "__main__":
    main()
