"""min_tokens in the engine: EOS, stop ids and stop strings held back until that many tokens exist,
greedy parity with transformers' logits under the same hold, the model's logprobs kept, the same
bits alone or in a crowd, and bad values named."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import random_prompts, reference_logprobs, run_engine

from cbrun.engine import ConfigError, Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.sample.token_masks import without_tokens
from cbrun.models import load_model

needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="compiled CPU kernels unavailable")
CONFIG = EngineConfig(num_blocks=64)
MIN_TOKENS = 6


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32")[0]


@pytest.fixture(scope="module")
def prompt(llama):
    return random_prompts(llama[0].get_input_embeddings().weight.shape[0], [16], seed=6)[0]


def _free(llama, prompt, max_tokens=16):
    return run_engine(*llama, [prompt], [max_tokens], CONFIG, ignore_eos=True)[0]


@torch.inference_mode()
def _held_reference_greedy(model, prompt: list[int], held: int, min_tokens: int, count: int) -> list[int]:
    """transformers' logits, `held` set to -inf while fewer than min_tokens tokens exist, argmax token by token."""
    ids: list[int] = list(prompt)
    for step in range(count):
        logits = model(torch.tensor([ids])).logits[0, -1].float()  # [V]
        if step < min_tokens:
            logits[held] = float("-inf")
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_min_tokens_keeps_going_past_a_stop_the_model_emits_at_step_two(llama, reference, prompt, how):
    model, tokenizer = llama
    free = _free(llama, prompt)
    stop = free.token_ids[1]  # what the model emits greedily at step 2, declared a stop
    first = free.token_ids.index(stop)
    sampling = {"stop_token_ids": (stop,), "ignore_eos": True} if how == "stop_token_ids" else {}
    if how == "eos":
        model.generation_config.eos_token_id = stop
    try:
        ended = run_engine(model, tokenizer, [prompt], [16], CONFIG, **sampling)[0]
        held = run_engine(model, tokenizer, [prompt], [16], CONFIG, min_tokens=MIN_TOKENS, **sampling)[0]
    finally:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    assert ended.token_ids == free.token_ids[: first + 1] and ended.finish_reason == "stop"
    assert len(held.token_ids) >= MIN_TOKENS and stop not in held.token_ids[:MIN_TOKENS]
    assert held.token_ids[:first] == free.token_ids[:first]
    assert held.token_ids == _held_reference_greedy(reference, prompt, stop, MIN_TOKENS, len(held.token_ids))
    if held.finish_reason == "stop":  # from min_tokens on, the stop ends it again
        assert held.token_ids[-1] == stop and stop not in held.token_ids[:-1]
    else:
        assert held.finish_reason == "length" and len(held.token_ids) == 16


def test_logprobs_stay_the_models_unless_masked_logprobs(llama, reference, prompt):
    model, tokenizer = llama
    stop = _free(llama, prompt).token_ids[1]
    sampling = dict(min_tokens=MIN_TOKENS, stop_token_ids=(stop,), ignore_eos=True)
    held = run_engine(model, tokenizer, [prompt], [10], CONFIG, **sampling)[0]
    masked = run_engine(model, tokenizer, [prompt], [10], CONFIG, masked_logprobs=True, **sampling)[0]
    assert masked.token_ids == held.token_ids
    assert held.logprobs == pytest.approx(reference_logprobs(reference, prompt, held.token_ids), abs=1e-4)
    # the hold took the stop token's probability away, so each held token's masked logprob is higher
    assert all(masked.logprobs[i] > held.logprobs[i] for i in range(MIN_TOKENS))
    after = range(MIN_TOKENS, len(held.token_ids))
    assert [masked.logprobs[i] for i in after] == [held.logprobs[i] for i in after]  # no hold: same bits


def test_stop_strings_do_not_end_the_request_before_min_tokens(llama, prompt):
    model, tokenizer = llama
    free = _free(llama, prompt, max_tokens=24)
    early = tokenizer.decode(free.token_ids[:2], skip_special_tokens=True)
    assert len(early) >= 2, "the tiny model should produce some text"
    stop = early[-2:]  # complete by the second token
    ended = run_engine(model, tokenizer, [prompt], [24], CONFIG, ignore_eos=True, stop=(stop,))[0]
    held = run_engine(model, tokenizer, [prompt], [24], CONFIG, ignore_eos=True, stop=(stop,), min_tokens=8)[0]
    assert ended.finish_reason == "stop" and len(ended.token_ids) <= 2
    assert len(held.token_ids) >= 8 and held.token_ids == free.token_ids[: len(held.token_ids)]
    before = tokenizer.decode(free.token_ids[:7], skip_special_tokens=True)  # no stop string may end in this text
    if held.finish_reason == "stop":
        assert len(held.text) > len(before) - len(stop) and held.text == free.text[: len(held.text)]
    else:
        assert held.finish_reason == "length" and held.text == free.text


@needs_kernels  # the torch reference backend is not batch invariant, even for free requests
def test_held_request_gives_the_same_bits_alone_and_in_a_crowd(llama, prompt):
    model, tokenizer = llama
    stop = _free(llama, prompt).token_ids[1]
    target = SamplingParams(
        max_tokens=20, temperature=0.9, seed=11, min_tokens=12, stop_token_ids=(stop,), top_logprobs=3
    )
    vocab = model.get_input_embeddings().weight.shape[0]
    others = random_prompts(vocab, [5 + 9 * i for i in range(10)], seed=3)
    crowd = [
        SamplingParams(max_tokens=24, temperature=0.8, seed=i, min_tokens=3 * (i % 3), stop_token_ids=(stop, i))
        for i in range(10)
    ]
    with Engine(model, tokenizer, EngineConfig(num_blocks=128, backend="cpu")) as engine:
        alone = engine.generate_batch([prompt], target)[0]
    with Engine(model, tokenizer, EngineConfig(num_blocks=128, backend="cpu", max_batch_tokens=48)) as engine:
        for i, (other, params) in enumerate(zip(others, crowd)):
            engine.add_request(other, params, request_id=f"other{i}")
            if i == 4:
                engine.add_request(prompt, target, request_id="target")
        together = engine.get_result("target", timeout=600)
    assert len(alone.token_ids) >= 12
    assert together.token_ids == alone.token_ids
    assert together.logprobs == alone.logprobs  # exact: same bits
    assert together.top_logprobs == alone.top_logprobs


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
        ({"min_tokens": 1.5}, "min_tokens must be an integer >= 0"),
        ({"min_tokens": True}, "min_tokens must be an integer >= 0"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens must be an integer >= 0 and <= max_tokens \(4\), got 5"),
    ],
)
def test_bad_min_tokens_raise_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        SamplingParams(**fields)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_held_ids_leave_a_packed_mask_without_them_unless_a_grammar_allows_nothing_else():
    held = without_tokens(None, (0, 31, 33, 63), vocab_size=64)  # bit 31 is int32's sign bit
    allowed = ((held[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(-1)  # [64]
    assert set(torch.nonzero(~allowed).view(-1).tolist()) == {0, 31, 33, 63}
    grammar = torch.tensor([1 << 5, 0], dtype=torch.int32)  # allows token 5 only
    assert torch.equal(without_tokens(grammar, (5,), vocab_size=64), grammar)  # the grammar wins
    assert torch.equal(without_tokens(grammar, (6,), vocab_size=64), grammar)
