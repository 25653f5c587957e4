"""The trainer's forward gives the rollout's bits (issue 34, item 1).

`ExactLogprobs` wraps a trainer's transformers model; on a padded batch of
mixed-length rows its logprobs must equal, bit for bit (`==` on the floats),
what the engine's `generate` recorded when it sampled those tokens and what
its `score` gives them, in fp32 and bf16, whatever the padding (left or
right) and whatever else is in the batch; its gradients must be the stock
model's within rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.models import load_model
from cbrun.training import ExactLogprobs

PROMPTS = [[1] + list(range(40, 40 + n)) for n in (40, 3, 21, 150)]  # past pages (16) and attention segments (128)
SAMPLED = SamplingParams(max_tokens=20, temperature=1.0, seed=5, ignore_eos=True)


def rollouts(model_dir, dtype: str) -> tuple[list, list]:
    """The engine's sampled completions (token ids, logprobs) and score's logprobs of the same tokens."""
    model, tokenizer = load_model(str(model_dir), dtype=dtype)
    with Engine(model, tokenizer, EngineConfig()) as engine:
        ids = [engine.add_request(p, SAMPLED, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
        done = {r.request_id: r for r in (engine.get_result(timeout=600) for _ in ids)}
        generated = [(done[i].token_ids, done[i].logprobs) for i in ids]
        scored = [out.logprobs for out in engine.score_batch(PROMPTS, [[tokens] for tokens, _ in generated])]
    return generated, scored


def padded(rows: list[list[int]], left: list[bool], extra: int = 3) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """rows in one [B, L] batch (pad id 0), each padded on the left or the right; also each row's offset."""
    length = max(map(len, rows)) + extra
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    offsets = []
    for b, (row, on_left) in enumerate(zip(rows, left)):
        offset = length - len(row) if on_left else 0
        ids[b, offset : offset + len(row)] = torch.tensor(row)
        mask[b, offset : offset + len(row)] = 1
        offsets.append(offset)
    return ids, mask, offsets


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma_hybrid"])
def model_dir(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def test_trainer_logprobs_equal_generate_and_score_bitwise_on_a_padded_batch(model_dir, dtype):
    generated, scored = rollouts(model_dir, dtype)
    trainer, _ = load_model(str(model_dir), dtype=dtype)
    trainer.train()
    exact = ExactLogprobs(trainer, dtype)
    rows = [prompt + tokens for prompt, (tokens, _) in zip(PROMPTS, generated)]
    ids, mask, offsets = padded(rows, left=[False, True, True, False])
    out = exact(ids, mask)  # with grad: the joined graph's values
    for b, (prompt, (tokens, sampled_logprobs)) in enumerate(zip(PROMPTS, generated)):
        first = offsets[b] + len(prompt)
        mine = out.logprobs[b, first : first + len(tokens)].tolist()
        assert scored[b] == sampled_logprobs  # score == generate (the engine's own promise)
        assert mine == sampled_logprobs, f"row {b}: trainer differs from the rollout"
    assert out.scored.sum() == sum(len(r) - 1 for r in rows)
    assert out.logprobs.requires_grad and trainer.training  # the caller's mode is given back


def test_a_rows_logprobs_do_not_depend_on_its_batch_or_its_padding(tiny_llama_dir, dtype):
    trainer, _ = load_model(str(tiny_llama_dir), dtype=dtype)
    exact = ExactLogprobs(trainer, dtype)
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 400, (n,), generator=generator).tolist() for n in (70, 5, 33, 129, 2)]
    with torch.no_grad():
        ids, mask, offsets = padded(rows, left=[True, False, True, False, True])
        crowd = exact(ids, mask).logprobs
        for b, row in enumerate(rows):
            for left in (False, True):
                one, one_mask, (offset,) = padded([row], left=[left], extra=7)
                alone = exact(one, one_mask).logprobs[0, offset + 1 : offset + len(row)]
                assert alone.tolist() == crowd[b, offsets[b] + 1 : offsets[b] + len(row)].tolist()


def test_gradients_are_the_stock_models_within_rounding(tiny_qwen3_dir, dtype):
    trainer, _ = load_model(str(tiny_qwen3_dir), dtype=dtype)
    stock = copy.deepcopy(trainer)
    exact = ExactLogprobs(trainer, dtype)
    generator = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 400, (n,), generator=generator).tolist() for n in (40, 9, 25)]
    ids, mask, _ = padded(rows, left=[False, True, False])
    advantages = torch.tensor([[0.5], [-1.0], [2.0]])
    out = exact(ids, mask)
    (-(out.logprobs * advantages).sum()).backward()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = stock(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1].float()
    reference = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0] * out.scored[:, 1:]
    (-(reference * advantages).sum()).backward()
    tolerance = {"float32": 1e-4, "bfloat16": 5e-2}[dtype]
    assert (out.logprobs[:, 1:] - reference).abs().max().item() < tolerance  # the values: within rounding
    checked = 0
    for (name, mine), theirs in zip(trainer.named_parameters(), stock.parameters()):
        assert mine.grad is not None, name
        scale = theirs.grad.abs().max().item() or 1.0
        assert (mine.grad.float() - theirs.grad.float()).abs().max().item() <= tolerance * scale, name
        checked += 1
    assert checked == len(list(stock.parameters()))


def test_logprobs_follow_the_trainers_optimizer_step(tiny_llama_dir, dtype):
    trainer, _ = load_model(str(tiny_llama_dir), dtype=dtype)
    exact = ExactLogprobs(trainer, dtype)
    rows = [PROMPTS[0][:30], PROMPTS[3][:90]]
    ids, mask, _ = padded(rows, left=[False, False])
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.05)
    before = exact(ids, mask)
    (-before.logprobs.sum()).backward()
    optimizer.step()
    with torch.no_grad():
        after = exact(ids, mask).logprobs
    assert not torch.equal(after, before.logprobs.detach())  # the new weights were packed
    model, tokenizer = load_model(str(tiny_llama_dir), dtype=dtype)  # an engine given the trained weights
    with Engine(model, tokenizer, EngineConfig()) as engine:
        engine.update_weights(trainer.state_dict())
        scored = engine.score_batch([row[:1] for row in rows], [[row[1:]] for row in rows])
    for b, row in enumerate(rows):
        assert after[b, 1 : len(row)].tolist() == scored[b].logprobs


def test_the_model_stays_the_callers_outside_a_call(tiny_llama_dir, dtype):
    trainer, _ = load_model(str(tiny_llama_dir), dtype=dtype)
    fresh, _ = load_model(str(tiny_llama_dir), dtype=dtype)
    implementation = trainer.config._attn_implementation
    exact = ExactLogprobs(trainer, dtype)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        exact(ids)
        assert torch.equal(trainer(ids).logits, fresh(ids).logits)  # stock forwards, stock attention
    assert trainer.config._attn_implementation == implementation
    for (name, mine), theirs in zip(trainer.named_parameters(), fresh.parameters()):
        assert torch.equal(mine, theirs), name  # nothing dropped, nothing moved
    exact.close()
    assert all("forward" not in module.__dict__ for module in trainer.modules())


def test_fp32_master_weights_give_a_bf16_engines_bits_and_get_the_gradients(tiny_llama_dir):
    """A trainer that keeps fp32 weights for a bf16 engine: the values are the bf16 engine's (synced from the
    fp32 state dict), the gradients reach the fp32 parameters."""
    master, _ = load_model(str(tiny_llama_dir), dtype="float32")
    step_in_place = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in master.parameters():  # the master moved past the checkpoint: the sync rounds it
            parameter.add_(0.01 * torch.randn(parameter.shape, generator=step_in_place))
    exact = ExactLogprobs(master, "bfloat16")
    model, tokenizer = load_model(str(tiny_llama_dir), dtype="bfloat16")
    with Engine(model, tokenizer, EngineConfig()) as engine:
        engine.update_weights(master.state_dict())
        scored = engine.score_batch(PROMPTS[:2], [[PROMPTS[3][:30]], [PROMPTS[2]]])
    rows = [PROMPTS[0] + PROMPTS[3][:30], PROMPTS[1] + PROMPTS[2]]
    ids, mask, offsets = padded(rows, left=[True, False])
    out = exact(ids, mask)
    for b, (prompt, completion) in enumerate(zip(PROMPTS[:2], (PROMPTS[3][:30], PROMPTS[2]))):
        first = offsets[b] + len(prompt)
        assert out.logprobs[b, first : first + len(completion)].tolist() == scored[b].logprobs
    out.logprobs.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in master.parameters())
    assert all(p.dtype == torch.float32 and p.stride() != (0, 0) for p in master.parameters())  # untouched


def test_dtypes_the_engine_does_not_compute_are_refused(tiny_llama_dir):
    trainer, _ = load_model(str(tiny_llama_dir), dtype="float32")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ExactLogprobs(trainer, "float16")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ExactLogprobs(trainer.to(torch.float16))
