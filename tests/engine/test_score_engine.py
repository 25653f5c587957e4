"""Scoring requests in the engine (issue 17): teacher-forced logprobs of given completions.

References are a plain transformers forward over prompt + completion
(`reference_logprobs`); the engine must agree within 1e-4 in fp32 whatever
the chunking, caching and preemption, and must give bitwise the logprobs
the sampler gives for the same logits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import load_pair, random_prompts, reference_logprobs

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.request import Request
from cbrun.engine.sample.sampler import sample
from cbrun.engine.sample.scoring import score_logits
from cbrun.engine.sampling_params import SamplingParams as Params
from cbrun.engine.step.model_runner import SCORE_CHUNK
from cbrun.models import load_model

VOCAB = 512
TOL = 1e-4


@torch.inference_mode()
def reference_prompt_logprobs(model, prompt: list[int]) -> list[float]:
    logits = model(torch.tensor([prompt])).logits[0].float()  # [P, V]
    logprobs = torch.log_softmax(logits[:-1], dim=-1)  # [P - 1, V]
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen3", "mistral_sliding", "gemma_hybrid"])
def pair(request):
    """(engine model, reference model, tokenizer) for each tiny architecture."""
    directory = request.getfixturevalue(f"tiny_{request.param}_dir")
    return load_pair(str(directory))


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_pair(str(tiny_llama_dir))


def _workload(seed: int):
    """Prompts of 1 to 90 tokens, each with completions of 1 to 120 tokens."""
    prompts = random_prompts(VOCAB, [1, 17, 40, 90], seed)
    completions = [
        random_prompts(VOCAB, lengths, seed + i + 1) for i, lengths in enumerate([[5], [1, 33], [120, 16, 7], [64]])
    ]
    return prompts, completions


@pytest.mark.parametrize("budget", [16, 1024])
def test_logprobs_equal_a_plain_forward_log_softmax(pair, budget):
    engine_model, ref_model, tokenizer = pair
    prompts, completions = _workload(seed=3)
    config = EngineConfig(page_size=16, num_blocks=256, max_batch_tokens=budget)
    with Engine(engine_model, tokenizer, config) as engine:
        outs = engine.score_batch(prompts, completions, prompt_logprobs=True)
    flat = [(p, c) for p, group in zip(prompts, completions) for c in group]
    assert len(outs) == len(flat)
    for out, (prompt, completion) in zip(outs, flat):
        assert out.error is None and out.token_ids == completion
        assert out.logprobs == pytest.approx(reference_logprobs(ref_model, prompt, completion), abs=TOL)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[1:] == pytest.approx(reference_prompt_logprobs(ref_model, prompt), abs=TOL)


def test_top_logprobs_are_the_reference_top_k(llama):
    engine_model, ref_model, tokenizer = llama
    prompt, completion = random_prompts(VOCAB, [30, 20], seed=8)
    with Engine(engine_model, tokenizer, EngineConfig(num_blocks=64)) as engine:
        out = engine.score_batch([prompt], [[completion]], top_logprobs=3)[0]
    with torch.inference_mode():
        logits = ref_model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    values, indices = torch.topk(torch.log_softmax(logits, dim=-1), 3, dim=-1)  # [C, 3]
    assert len(out.top_logprobs) == len(completion)
    for position, top in enumerate(out.top_logprobs):
        assert [t for t, _ in top] == indices[position].tolist()
        assert [lp for _, lp in top] == pytest.approx(values[position].tolist(), abs=TOL)


def test_is_greedy_is_true_exactly_for_greedy_completions(llama):
    engine_model, _, tokenizer = llama
    prompts = random_prompts(VOCAB, [12, 25, 40], seed=11)
    with Engine(engine_model, tokenizer, EngineConfig(num_blocks=128)) as engine:
        greedy = engine.generate_batch(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        sampled = engine.generate_batch(prompts, SamplingParams(max_tokens=20, seed=1, ignore_eos=True))
        altered = [g.token_ids[:-1] + [(g.token_ids[-1] + 1) % VOCAB] for g in greedy]
        groups = [[g.token_ids, s.token_ids, a] for g, s, a in zip(greedy, sampled, altered)]
        outs = engine.score_batch(prompts, groups)
    for index in range(len(prompts)):
        from_greedy, from_sampled, from_altered = outs[3 * index : 3 * index + 3]
        assert from_greedy.is_greedy is True
        assert from_altered.is_greedy is False
        assert from_sampled.is_greedy is False  # 20 tokens at temperature 1 over a random model
        assert from_greedy.logprobs == pytest.approx(greedy[index].logprobs, abs=TOL)


def test_eight_completions_of_one_prompt_compute_the_prompt_once(llama):
    engine_model, _, tokenizer = llama
    prompt = random_prompts(VOCAB, [70], seed=4)[0]  # 4 full pages of 16, then 6 tokens
    completions = random_prompts(VOCAB, [10 + i for i in range(8)], seed=5)
    with Engine(engine_model, tokenizer, EngineConfig(page_size=16, num_blocks=128)) as engine:
        outs = engine.score_batch([prompt], [completions])
        stats = engine.stats()
    cached = sorted(out.num_cached_tokens for out in outs)
    assert cached == [0] + [64] * 7
    computed = sum(len(prompt) + len(c) - 1 for c in completions) - 7 * 64
    assert stats.computed_prompt_tokens == computed
    assert stats.prefix_hit_tokens == 7 * 64


def test_prompt_logprobs_need_the_prompt_computed_so_nothing_is_cached_before_it(llama):
    engine_model, _, tokenizer = llama
    prompt = random_prompts(VOCAB, [70], seed=4)[0]
    completions = random_prompts(VOCAB, [10, 11], seed=5)
    with Engine(engine_model, tokenizer, EngineConfig(page_size=16, num_blocks=128)) as engine:
        outs = engine.score_batch([prompt], [completions], prompt_logprobs=True)
    assert [out.num_cached_tokens for out in outs] == [0, 0]
    assert outs[0].prompt_logprobs[1:] == pytest.approx(outs[1].prompt_logprobs[1:], abs=TOL)


def test_score_rows_are_projected_a_bounded_chunk_at_a_time(llama, monkeypatch):
    engine_model, ref_model, tokenizer = llama
    prompt, completion = random_prompts(VOCAB, [20, 700], seed=6)
    sizes: list[int] = []
    with Engine(engine_model, tokenizer, EngineConfig(num_blocks=128, max_batch_tokens=1024)) as engine:
        original = engine.core.runner._project

        def recording(rows):
            sizes.append(rows.shape[0])
            return original(rows)

        monkeypatch.setattr(engine.core.runner, "_project", recording)
        out = engine.score_batch([prompt], [[completion]])[0]
    assert max(sizes) <= SCORE_CHUNK and sum(sizes) == len(completion)
    assert out.logprobs == pytest.approx(reference_logprobs(ref_model, prompt, completion), abs=TOL)


def test_preempted_scoring_requests_finish_with_the_same_logprobs(llama):
    """Long greedy decodes grow into a small cache beside the scoring requests, so requests get
    preempted (soft reset) mid-way; scores must neither change nor repeat positions."""
    engine_model, ref_model, tokenizer = llama
    prompts = random_prompts(VOCAB, [30 + 9 * i for i in range(12)], seed=9)
    completions = random_prompts(VOCAB, [40 + 5 * i for i in range(12)], seed=10)
    config = EngineConfig(page_size=16, num_blocks=16, max_batch_tokens=64, safety_margin=0.0)
    decode = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    with Engine(engine_model, tokenizer, config) as engine:
        for i, prompt in enumerate(prompts[:3]):
            engine.add_request(prompt[:5], decode, request_id=f"g{i}")
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            engine.add_score_request(prompt, [completion], f"s{i}")
        outs = {o.request_id: o for o in (engine.get_result(timeout=300) for _ in range(3 + len(prompts)))}
        stats = engine.stats()
    assert stats.soft_resets > 0  # the cache really was too small for all at once
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        out = outs[f"s{i}"]
        assert out.error is None and len(out.logprobs) == len(completion)
        assert out.logprobs == pytest.approx(reference_logprobs(ref_model, prompt, completion), abs=TOL)


def test_bad_completions_fail_alone(llama):
    engine_model, _, tokenizer = llama
    prompt = random_prompts(VOCAB, [10], seed=1)[0]
    good = random_prompts(VOCAB, [5], seed=2)[0]
    with Engine(engine_model, tokenizer, EngineConfig(num_blocks=64)) as engine:
        outs = engine.score_batch([prompt], [[good, [], [3, VOCAB + 7], [1] * 3000]])
    assert outs[0].error is None and len(outs[0].logprobs) == 5
    assert "empty completion" in outs[1].error
    assert "outside the vocabulary" in outs[2].error
    assert "context" in outs[3].error
    assert all(o.finish_reason == "error" for o in outs[1:])


def _greedy_requests(count: int) -> list[Request]:
    params = Params(temperature=0.0, top_logprobs=2)
    return [Request(f"r{i}", 0, [1], params, 0, i) for i in range(count)]


@pytest.mark.parametrize("kernels", ["torch", "compiled"])
def test_score_logits_is_bitwise_the_samplers_logprob(kernels):
    compiled = load_cpu_kernels() if kernels == "compiled" else None
    if kernels == "compiled" and compiled is None:
        pytest.skip("compiled CPU kernels unavailable")
    logits = torch.randn(9, 4000, generator=torch.Generator().manual_seed(0)) * 4  # [N, V]
    picked = sample(logits, _greedy_requests(9), compiled)
    scored = score_logits(logits, torch.tensor(picked.token_ids), 2, compiled)
    assert scored.logprobs == picked.logprobs  # exact, not approximate
    assert scored.greedy == [True] * 9
    assert scored.top == picked.top


def _generate_then_score(model, tokenizer, dtype_name: str):
    prompts = random_prompts(VOCAB, [9, 23, 41, 60], seed=12)
    params = SamplingParams(max_tokens=24, seed=3, ignore_eos=True)  # temperature 1: logprobs as scored
    config = EngineConfig(page_size=16, num_blocks=128)
    with Engine(model, tokenizer, config) as engine:
        generated = engine.generate_batch(prompts, params)
    with Engine(model, tokenizer, config) as engine:
        scored = engine.score_batch(prompts, [[g.token_ids] for g in generated])
    return generated, scored


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scoring_what_generate_sampled_gives_bitwise_its_logprobs(tiny_llama_dir, dtype):
    """Generate decodes its tokens a few rows per step; scoring prefills them in chunks beside other
    requests. With batch-invariant kernels both give the same bits."""
    model, tokenizer = load_model(str(tiny_llama_dir), dtype=dtype)
    generated, scored = _generate_then_score(model, tokenizer, dtype)
    for g, s in zip(generated, scored):
        assert s.token_ids == g.token_ids
        assert s.logprobs == g.logprobs  # bitwise


def test_logprobs_equal_a_plain_forward_on_smollm2(smollm2):
    ref_model, tokenizer = smollm2
    engine_model = copy.deepcopy(ref_model)  # the engine switches its attention; keep the fixture's
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer(chat, add_special_tokens=False)["input_ids"]
    completions = [
        tokenizer(text, add_special_tokens=False)["input_ids"]
        for text in ("Red, green and blue.", "Blue, yellow and a very bright shade of orange.")
    ]
    with Engine(engine_model, tokenizer, EngineConfig(num_blocks=256, max_batch_tokens=32)) as engine:
        outs = engine.score_batch([prompt], [completions])
    for out, completion in zip(outs, completions):
        assert out.error is None
        assert out.logprobs == pytest.approx(reference_logprobs(ref_model, prompt, completion), abs=TOL)
