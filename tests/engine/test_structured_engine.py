"""Structured outputs in the engine: every finished constrained output satisfies its constraint,
with the same bits alone or in a crowd, greedy parity with transformers' logits under the same
mask, the model's (or the masked) logprobs, and bad constraints failing their request only."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from engine_helpers import reference_logprobs

from cbrun.engine import ConfigError, Engine, EngineConfig, SamplingParams, StructuredSpec
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.grammar import grammar_text
from cbrun.models import load_model

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "reason": {"type": "string", "maxLength": 20},
    },
    "required": ["label", "confidence", "reason"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,4}"
CHOICES = ["yes", "no", "maybe so"]
needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="compiled CPU kernels unavailable")
PROMPTS = ["Review: great film.", "the cat sat", "Label this row", "x", "A much longer prompt about many things"]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32")


def _params(kind: str, **extra) -> SamplingParams:
    value = {"json_schema": SCHEMA, "regex": REGEX, "choice": CHOICES, "json_object": True}[kind]
    return SamplingParams(**{"max_tokens": 120, "temperature": 0.0, "structured": {kind: value}, **extra})


def assert_valid(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_every_finished_constrained_output_satisfies_its_constraint(tiny, backend):
    model, tokenizer = tiny
    kinds = ["json_schema", "regex", "choice", "json_object"]
    params = [_params(kind, temperature=t, seed=s, n=2) for kind in kinds for t, s in [(0.0, None), (1.0, 7), (0.8, 3)]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    with Engine(model, tokenizer, EngineConfig(num_blocks=128, backend=backend)) as engine:
        outs = engine.generate_batch(prompts, params)
    assert len(outs) == 2 * len(params)
    for index, out in enumerate(outs):
        kind = kinds[index // 6]
        assert out.error is None
        if kind == "json_object" and out.finish_reason == "length":  # unbounded: a random model may not close it
            assert out.structured_complete is False
            continue
        assert out.finish_reason == "stop" and out.structured_complete, (kind, out.text)
        assert_valid(kind, out.text)


def _run(model, tokenizer, entries, config=None):
    """entries: (prompt, params) pairs, run together; results by prompt index."""
    with Engine(model, tokenizer, config or EngineConfig(num_blocks=128)) as engine:
        ids = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(entries)]
        results = {r.request_id: r for r in (engine.get_result(timeout=600) for _ in ids)}
    return [results[i] for i in ids]


@needs_kernels  # the torch reference backend is not batch invariant, even for free requests
@pytest.mark.parametrize("masked_logprobs", [False, True])
def test_constrained_request_gives_the_same_bits_alone_and_in_a_crowd(tiny, masked_logprobs):
    model, tokenizer = tiny
    backend = "cpu"
    target = (
        "Review: great film.",
        _params("json_schema", temperature=1.0, seed=11, top_logprobs=3, masked_logprobs=masked_logprobs),
    )
    alone = _run(model, tokenizer, [target], EngineConfig(num_blocks=128, backend=backend))[0]
    crowd = [
        (PROMPTS[i % 5] * (1 + i % 3), _params(kind, temperature=0.9, seed=i))
        for i, kind in enumerate(["regex", "choice", "json_object", "json_schema"] * 2)
    ]
    crowd += [(PROMPTS[i], SamplingParams(max_tokens=40, temperature=1.0, seed=i)) for i in range(4)]
    together = _run(
        model,
        tokenizer,
        crowd[:5] + [target] + crowd[5:],
        EngineConfig(num_blocks=128, backend=backend, max_batch_tokens=64),
    )[5]
    assert together.token_ids == alone.token_ids
    assert together.logprobs == alone.logprobs  # exact: same bits
    assert together.top_logprobs == alone.top_logprobs
    assert together.text == alone.text
    jsonschema.validate(json.loads(alone.text), SCHEMA)


@torch.inference_mode()
def _masked_reference_greedy(model, tokenizer, prompt_ids: list[int], spec: StructuredSpec, max_tokens: int):
    """transformers' own logits, masked by an independent llguidance matcher, argmax token by token."""
    vocab = model.get_input_embeddings().weight.shape[0]
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), grammar_text(spec))
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    ids, out = list(prompt_ids), []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()  # [V]
        llguidance.torch.fill_next_token_bitmask(matcher, mask)
        bits = ((mask[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(-1)[:vocab]
        token = int(logits.masked_fill(~bits, float("-inf")).argmax())
        out.append(token)
        ids.append(token)
        assert matcher.consume_token(token)
        if matcher.is_stopped():
            break
    return out


@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice"])
def test_greedy_constrained_output_matches_masked_transformers_logits(tiny_llama_dir, kind):
    model, tokenizer = load_model(str(tiny_llama_dir), dtype="float32")
    reference_model, _ = load_model(str(tiny_llama_dir), dtype="float32")
    params = _params(kind, max_tokens=60)
    prompts = [list(tokenizer.encode(p)) for p in PROMPTS[:3]]
    outs = _run(model, tokenizer, [(p, params) for p in prompts])
    for prompt, out in zip(prompts, outs):
        expected = _masked_reference_greedy(reference_model, tokenizer, prompt, params.structured, 60)
        assert out.token_ids == expected


def test_logprobs_are_the_models_by_default_and_the_masked_ones_on_request(tiny_llama_dir):
    model, tokenizer = load_model(str(tiny_llama_dir), dtype="float32")
    reference_model, _ = load_model(str(tiny_llama_dir), dtype="float32")
    prompt = list(tokenizer.encode(PROMPTS[0]))
    model_lp, masked_lp = _run(
        model,
        tokenizer,
        [(prompt, _params("regex", top_logprobs=2)), (prompt, _params("regex", top_logprobs=2, masked_logprobs=True))],
    )
    assert model_lp.token_ids == masked_lp.token_ids
    expected = reference_logprobs(reference_model, prompt, model_lp.token_ids)
    assert model_lp.logprobs == pytest.approx(expected, abs=1e-4)
    # the masked distribution puts all its mass on allowed tokens: each logprob is higher, the last
    # tokens (forced by the grammar) near 0; alternatives are allowed tokens only
    assert all(m >= u - 1e-6 for m, u in zip(masked_lp.logprobs, model_lp.logprobs))
    assert any(m > u + 0.5 for m, u in zip(masked_lp.logprobs, model_lp.logprobs))
    text_first = tokenizer.decode([t for t, _ in masked_lp.top_logprobs[0]][:1])
    assert re.fullmatch(r"[a-z]+", text_first)


def test_max_tokens_before_the_grammar_completes_is_length_and_incomplete(tiny):
    model, tokenizer = tiny
    out = _run(model, tokenizer, [(PROMPTS[0], _params("json_schema", max_tokens=4))])[0]
    assert out.finish_reason == "length"
    assert out.structured_complete is False
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_stop_strings_and_n_samples_with_a_constraint(tiny):
    model, tokenizer = tiny
    outs = _run(
        model,
        tokenizer,
        [
            (PROMPTS[1], _params("json_schema", temperature=1.0, seed=5, n=3)),
            (PROMPTS[2], _params("json_schema", stop=('"confidence"',))),
        ],
    )
    samples = list(outs)  # get_result gives one sample per call; ids repeat
    complete = [o for o in samples if o.finish_reason == "stop" and o.structured_complete]
    for out in complete:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    stopped = next(o for o in samples if o.request_id == "r1")
    assert stopped.finish_reason == "stop" and stopped.structured_complete is False
    assert '"confidence"' not in stopped.text


def test_bad_constraints_fail_only_their_own_request(tiny):
    model, tokenizer = tiny
    bad = {
        "b-regex": {"structured": {"regex": "[a-z"}, "max_tokens": 8},
        "b-keyword": {"structured": {"json_schema": {"type": "array", "uniqueItems": True}}, "max_tokens": 8},
        "b-grammar": {"structured": {"grammar": 'start: "a" | undefined_rule'}, "max_tokens": 8},
        "b-choice": {"structured": {"choice": []}, "max_tokens": 8},
        "b-schema": {"structured": {"json_schema": "{not json"}, "max_tokens": 8},
    }
    with Engine(model, tokenizer, EngineConfig(num_blocks=128)) as engine:
        for rid, sampling in bad.items():
            engine.add_request(PROMPTS[0], sampling, request_id=rid)
        engine.add_request(PROMPTS[1], _params("choice"), request_id="good")
        results = {r.request_id: r for r in (engine.get_result(timeout=600) for _ in range(len(bad) + 1))}
    assert results["good"].text in CHOICES
    expected = {
        "b-regex": "unclosed character class",
        "b-keyword": "uniqueItems",
        "b-grammar": "undefined_rule",
        "b-choice": "empty",
        "b-schema": "not valid JSON",
    }
    for rid, needle in expected.items():
        assert results[rid].finish_reason == "error"
        assert needle in results[rid].error, results[rid].error


def test_each_distinct_constraint_compiles_once_per_engine(tiny):
    model, tokenizer = tiny
    with Engine(model, tokenizer, EngineConfig(num_blocks=128)) as engine:
        engine.generate_batch(
            [PROMPTS[i % 5] for i in range(12)], [_params("json_schema", max_tokens=8)] * 10 + [_params("choice")] * 2
        )
        # an equal schema written differently (key order, as text) is the same cache entry
        engine.generate_batch(
            [PROMPTS[0]],
            SamplingParams(max_tokens=4, structured={"json_schema": json.dumps(dict(reversed(list(SCHEMA.items()))))}),
        )
        assert engine.core.grammars.compiles == 2


def test_structured_spec_validates_its_shape():
    with pytest.raises(ConfigError, match="one structured output constraint"):
        SamplingParams(structured={"regex": "a", "choice": ["a"]})
    with pytest.raises(ConfigError, match="must be one of"):
        StructuredSpec("xml", "a")
    assert StructuredSpec("json_schema", '{"b": 1, "a": 2}') == StructuredSpec("json_schema", {"a": 2, "b": 1})


def test_real_model_labels_every_row_validly(smollm2):
    """SmolLM2: the shipped labelling schema, greedy and sampled; every completed row validates."""
    from pathlib import Path

    model, tokenizer = smollm2
    schema = json.loads((Path(__file__).resolve().parents[2] / "examples/bench/structured_schema.json").read_text())
    reviews = ["The kettle arrived broken and support never answered.", "Love these shoes, great value."]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Label this review as JSON: {r}"}], tokenize=False, add_generation_prompt=True
        )
        for r in reviews
    ]
    params = [
        SamplingParams(max_tokens=96, temperature=t, seed=1, n=2, structured={"json_schema": schema})
        for t in (0.0, 0.8)
    ]
    with Engine(model, tokenizer, EngineConfig(num_blocks=256)) as engine:
        outs = engine.generate_batch(prompts + prompts, params + params[::-1])
    completed = [o for o in outs if o.finish_reason == "stop"]
    assert len(completed) >= len(outs) // 2
    for out in completed:
        assert out.structured_complete
        jsonschema.validate(json.loads(out.text), schema)
