"""Contract with transformers: what our attention function receives, pinned.

If a transformers upgrade changes the arguments, shapes or kwargs passed to
registered attention functions, this test fails loudly instead of the engine
silently computing something else.
"""

import pytest
from transformers import AttentionInterface

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.step import attention
from cbrun.models import load_model

EXPECTED_KWARGS = {
    "llama": {"cbrun_backend", "cbrun_batch", "dropout", "position_ids", "scaling", "use_cache"},
    "qwen3": {"cbrun_backend", "cbrun_batch", "dropout", "position_ids", "scaling", "use_cache", "sliding_window"},
}


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_attention_receives_flat_new_tokens_and_our_batch(request, fixture):
    model, tokenizer = load_model(str(request.getfixturevalue(fixture)), dtype="float32")
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    calls = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, query.shape, key.shape, value.shape, attention_mask, dict(kwargs)))
        return attention.paged_attention(module, query, key, value, attention_mask, **kwargs)

    engine = Engine(model, tokenizer, EngineConfig(num_blocks=64))
    AttentionInterface.register(attention.ATTENTION_NAME, recording)
    try:
        outputs = engine.generate_batch([[1, 2, 3, 4, 5], [7, 8]], SamplingParams(max_tokens=2, temperature=0))
    finally:
        engine.destroy()
        attention.register()
    assert all(o.error is None for o in outputs)
    layers = config.num_hidden_layers
    assert len(calls) == 2 * layers  # one prefill step (7 tokens), one decode step (2 tokens)
    for index, (layer, q, k, v, mask, kwargs) in enumerate(calls):
        tokens = 7 if index < layers else 2
        assert layer == index % layers
        assert tuple(q) == (1, heads, tokens, head_dim)
        assert tuple(k) == tuple(v) == (1, kv_heads, tokens, head_dim)
        assert mask is None, "transformers must build no mask for our attention name"
        assert set(kwargs) == EXPECTED_KWARGS[config.model_type]
        assert kwargs["scaling"] == pytest.approx(head_dim**-0.5)
        assert kwargs["use_cache"] is False
        assert tuple(kwargs["position_ids"].shape) == (1, tokens)
        assert kwargs["cbrun_batch"].num_tokens == tokens
