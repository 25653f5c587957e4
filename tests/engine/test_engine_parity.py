"""Greedy parity with transformers' model.generate, and logprobs against a plain forward (fp32)."""

import copy

import pytest
from engine_helpers import load_pair, random_prompts, reference_greedy, reference_logprobs, run_engine, spread

from cbrun.engine import EngineConfig

# (page_size, max_batch_tokens, scheduler, max_requests_per_batch): every pair of values
# across the four knobs appears in at least one row (a pairwise covering set).
TINY_CONFIGS = [
    (16, 32, "fifo", 1),
    (16, 128, "prefill-first", 4),
    (16, 4096, "fifo", 64),
    (64, 32, "prefill-first", 64),
    (64, 128, "fifo", 1),
    (64, 4096, "prefill-first", 4),
    (256, 32, "fifo", 4),
    (256, 128, "prefill-first", 64),
    (256, 4096, "fifo", 1),
    (256, 4096, "prefill-first", 64),
    (16, 32, "prefill-first", 1),
]
# SmolLM2 runs every value of every knob except max_requests_per_batch=1 (one sequence per
# step is slow on a 135M model and is covered on the tiny models above).
SMOLLM_CONFIGS = [(16, 32, "fifo", 4), (64, 128, "prefill-first", 64), (256, 4096, "fifo", 64)]

NUM_PROMPTS = 32
# SmolLM2 takes half the prompts, with the same spread of lengths (1-600: chunked prefills over every page size)
# and completions of up to 32 tokens: each of its cases costs transformers' one-prompt-at-a-time reference in
# setup, and 16 prompts still keep the 4- and 64-request batches full and mixed in every config.
SMOLLM_PROMPTS, SMOLLM_MAX_TOKENS = 16, 32


def _case(engine_model, ref_model, tokenizer, count=NUM_PROMPTS, longest=64):
    """Engine copy, reference copy, tokenizer, prompts and their max_tokens."""
    vocab = ref_model.get_input_embeddings().weight.shape[0]
    prompts = random_prompts(vocab, spread(count, 1, 600), seed=vocab)
    return engine_model, ref_model, tokenizer, prompts, spread(count, 1, longest)


def _reference_greedy(case) -> list[list[int]]:
    """model.generate's greedy tokens for a case's prompts (a fixture of its own, so only the parity tests pay
    for it: the logprobs test needs none)."""
    _, ref_model, _, prompts, max_tokens = case
    return [reference_greedy(ref_model, p, m) for p, m in zip(prompts, max_tokens)]


@pytest.fixture(scope="module")
def llama_case(tiny_llama_dir):
    return _case(*load_pair(str(tiny_llama_dir)))


@pytest.fixture(scope="module")
def qwen3_case(tiny_qwen3_dir):
    return _case(*load_pair(str(tiny_qwen3_dir)))


@pytest.fixture(scope="module")
def smollm_case(smollm2):
    ref_model, tokenizer = smollm2
    engine_model = copy.deepcopy(ref_model)  # the engine switches its attention; keep the fixture's
    return _case(engine_model, ref_model, tokenizer, SMOLLM_PROMPTS, SMOLLM_MAX_TOKENS)


@pytest.fixture(scope="module")
def llama_refs(llama_case):
    return _reference_greedy(llama_case)


@pytest.fixture(scope="module")
def qwen3_refs(qwen3_case):
    return _reference_greedy(qwen3_case)


@pytest.fixture(scope="module")
def smollm_refs(smollm_case):
    return _reference_greedy(smollm_case)


def _check_parity(case, refs, page, budget, scheduler, max_requests):
    engine_model, _, tokenizer, prompts, max_tokens = case
    config = EngineConfig(
        page_size=page,
        max_batch_tokens=budget,
        scheduler=scheduler,
        max_requests_per_batch=max_requests,
        num_blocks=4096 // page * 8,
    )
    results = run_engine(engine_model, tokenizer, prompts, max_tokens, config)
    for prompt, result, ref in zip(prompts, results, refs):
        assert result.error is None
        assert result.token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
        assert result.finish_reason in ("stop", "length")
    return results


@pytest.mark.parametrize("page,budget,scheduler,max_requests", TINY_CONFIGS)
def test_greedy_matches_generate_tiny_llama(llama_case, llama_refs, page, budget, scheduler, max_requests):
    _check_parity(llama_case, llama_refs, page, budget, scheduler, max_requests)


@pytest.mark.parametrize("page,budget,scheduler,max_requests", TINY_CONFIGS)
def test_greedy_matches_generate_tiny_qwen3(qwen3_case, qwen3_refs, page, budget, scheduler, max_requests):
    _check_parity(qwen3_case, qwen3_refs, page, budget, scheduler, max_requests)


@pytest.mark.parametrize("page,budget,scheduler,max_requests", SMOLLM_CONFIGS)
def test_greedy_matches_generate_smollm2(smollm_case, smollm_refs, page, budget, scheduler, max_requests):
    _check_parity(smollm_case, smollm_refs, page, budget, scheduler, max_requests)


@pytest.mark.parametrize("case_name", ["llama_case", "qwen3_case", "smollm_case"])
def test_logprobs_match_plain_forward(request, case_name):
    case = request.getfixturevalue(case_name)
    engine_model, ref_model, tokenizer, prompts, max_tokens = case
    config = EngineConfig(page_size=64, max_batch_tokens=128, num_blocks=512)
    results = run_engine(engine_model, tokenizer, prompts[:12], max_tokens[:12], config)
    for prompt, result in zip(prompts, results):
        expected = reference_logprobs(ref_model, prompt, result.token_ids)
        assert len(result.logprobs) == len(result.token_ids)
        for got, want in zip(result.logprobs, expected):
            assert abs(got - want) < 1e-4
