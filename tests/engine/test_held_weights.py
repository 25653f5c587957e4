"""One copy of the weights (issue 31): while the CPU backend is installed, the layer methods' packed matrices are
the model's linear weights, and nothing else holds them.

- the bytes held after install are at most 1.05x the parameters' (bf16 pair-dot packs, tied and untied heads);
- packing and unpacking a member are exact, and a fused matrix's member computes alone as in the whole;
- closing the engine gives the model its dense weights and its attention implementation back;
- `update_weights` writes straight into the packs, whole or in part, and the outputs equal a fresh engine's;
- a tied head keeps one table, and the embedding reads its rows from the head's packed matrix;
- sleep(level=2) and wake_up in bf16 give the same bits.
"""

from __future__ import annotations

import pytest
import torch
from helpers import save_tiny_model

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.models import load_model

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="compiled CPU kernels unavailable (no C compiler)")

# wide enough that the packs' padding (outputs to 32, inputs to even) stays well under 5% of the weights
_SHAPE = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=352,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
PROMPTS = [[1, *range(40, 40 + n)] for n in (37, 9, 20)]


@pytest.fixture(scope="module")
def qwen2_tied_dir(tmp_path_factory, tiny_tokenizer):
    """Qwen2 (q/k/v biases), tied embeddings: the head's pack is the embedding's table too."""
    from transformers import Qwen2Config

    config = Qwen2Config(num_hidden_layers=2, tie_word_embeddings=True, **_SHAPE)
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("qwen2-tied"))


@pytest.fixture(scope="module")
def llama_untied_dir(tmp_path_factory, tiny_tokenizer):
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, tie_word_embeddings=False, **_SHAPE)
    return save_tiny_model(config, tiny_tokenizer, tmp_path_factory.mktemp("llama-untied"))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once


def _outputs(engine: Engine) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=6, temperature=0.0)
    return [(r.token_ids, r.logprobs) for r in engine.generate_batch(PROMPTS, params)]


@pytest.mark.parametrize("fixture", ["qwen2_tied_dir", "llama_untied_dir"])
def test_bf16_engine_holds_one_copy_of_the_weights(fixture, request):
    model, tokenizer = load_model(str(request.getfixturevalue(fixture)), dtype="bfloat16")
    params = _param_bytes(model)
    with Engine(model, tokenizer, EngineConfig(num_blocks=32, backend="cpu")) as engine:
        backend = engine.core.backend
        held = backend.weight_bytes(model)
        dropped = [name for name, p in model.named_parameters() if p.dim() == 2 and p.stride() == (0, 0)]
        assert held <= 1.05 * params, (held, params)
        assert held >= params  # every weight is somewhere
        assert any("q_proj" in name for name in dropped) and any("down_proj" in name for name in dropped)
        assert "2 fused layers" in backend.describe() and engine.weight_bytes() == held


@pytest.mark.parametrize("fixture", ["qwen2_tied_dir", "llama_untied_dir"])
def test_closing_the_engine_gives_the_model_its_weights_back_bit_for_bit(fixture, request):
    model, tokenizer = load_model(str(request.getfixturevalue(fixture)), dtype="bfloat16")
    before = {name: _bits(t).clone() for name, t in model.state_dict().items()}
    attention = model.config._attn_implementation
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        stock = model.generate(ids, max_new_tokens=4, do_sample=False)
    with Engine(model, tokenizer, EngineConfig(num_blocks=32, backend="cpu")) as engine:
        _outputs(engine)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for name, bits in before.items():
        assert torch.equal(_bits(after[name]), bits), name
    assert not any("forward" in module.__dict__ for module in model.modules())
    assert model.config._attn_implementation == attention  # the model's own generate works again, as before
    with torch.inference_mode():
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), stock)


def test_a_tied_head_keeps_one_table_and_the_embedding_reads_it(qwen2_tied_dir):
    model, tokenizer = load_model(str(qwen2_tied_dir), dtype="bfloat16")
    table = model.get_input_embeddings().weight.detach().clone()
    ids = torch.tensor([[0, 5, 511, 5, 300]])
    with Engine(model, tokenizer, EngineConfig(num_blocks=32, backend="cpu")):
        embedding = model.get_input_embeddings()
        assert embedding.weight is model.get_output_embeddings().weight
        assert embedding.weight.stride() == (0, 0)  # no table of its own: the head's packed matrix serves it
        assert torch.equal(_bits(embedding(ids)), _bits(table[ids]))


@pytest.mark.parametrize("role", ["plain", "gate", "up"])
def test_packing_a_member_and_reading_it_back_is_exact(role):
    gen = torch.Generator().manual_seed(5)
    inner, width = 99, 70  # an odd K (a pad element) and a partial last block
    weight = torch.randn(width, inner, generator=gen).to(torch.bfloat16)
    weight[0, :4] = torch.tensor([1e-40, -0.0, float("inf"), float("nan")])  # denormal, signed zero, inf, nan
    packed = kernels.dp.packed(width + 10, inner, gated=role != "plain")
    first = 10 if role == "plain" else 0
    kernels.dp.pack_into(packed, inner, weight, role, first)
    assert torch.equal(_bits(kernels.dp.unpack(packed, inner, role, first, width)), _bits(weight))
    ids = torch.tensor([first + 69, first, first + 33])
    assert torch.equal(_bits(kernels.dp.unpack(packed, inner, role, ids=ids)), _bits(weight[[69, 0, 33]]))


@pytest.mark.parametrize("role", ["plain", "gate", "up"])
def test_packing_rows_of_a_wider_matrix_equals_packing_their_copy(role):
    """The pack moves 16 rows x 16 pairs at a time where it can (a transpose in registers) and a row at a time
    elsewhere: rows read at a stride wider than K, from any first output, give the same packed bits."""
    gen = torch.Generator().manual_seed(6)
    inner, width = 77, 53  # 38 pairs (two whole groups of 16, then 6) and a pad element
    wide = torch.randn(width, inner + 9, generator=gen).to(torch.bfloat16)
    first = 7 if role == "plain" else 0  # lanes 7..15 one by one, then whole groups of 16
    packs = []
    for weight in (wide[:, :inner], wide[:, :inner].contiguous()):
        packed = kernels.dp.packed(width + first, inner, gated=role != "plain")
        kernels.dp.pack_into(packed, inner, weight, role, first)
        packs.append(packed)
    assert torch.equal(packs[0], packs[1])
    assert torch.equal(_bits(kernels.dp.unpack(packs[0], inner, role, first, width)), _bits(wide[:, :inner]))


@pytest.mark.parametrize(
    "gated,widths", [(True, [48, 48]), (False, [64, 32, 40]), (False, [40, 32, 24])]
)  # members on whole blocks (computed from their own blocks) and not (sliced out of the whole)
def test_a_member_of_a_fused_method_computes_alone_as_in_the_whole(gated, widths):
    from cbrun.engine.backends.cpu.linear.methods import DP_TWIN

    gen = torch.Generator().manual_seed(6)
    weights = [torch.randn(n, 96, generator=gen).to(torch.bfloat16) for n in widths]
    biases = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in widths]
    method = DP_TWIN.make(kernels, weights, biases, gated=gated)
    x = torch.randn(21, 96, generator=gen).to(torch.bfloat16)
    for index, weight in enumerate(weights):
        alone = DP_TWIN.make(kernels, [weight], [biases[index]])
        assert torch.equal(_bits(method.member(index, x, torch.float32)), _bits(alone(x, torch.float32)))
        assert torch.equal(_bits(method.weight(index)), _bits(weight))
    if not gated:
        whole, start = method(x, torch.float32), widths[0]
        assert torch.equal(_bits(whole[:, start : start + widths[1]]), _bits(method.member(1, x, torch.float32)))


def test_replacing_a_member_in_place_equals_packing_the_new_weights():
    from cbrun.engine.backends.cpu.linear.methods import DP_TWIN

    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(48, 64, generator=gen).to(torch.bfloat16) for _ in range(2)]
    biases = [torch.randn(48, generator=gen).to(torch.bfloat16) for _ in range(2)]
    method = DP_TWIN.make(kernels, weights, biases, gated=True)
    new_up, new_bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen).to(torch.bfloat16)
    method.load(1, weight=new_up, bias=new_bias)  # fp32 in: converted to the method's bf16
    fresh = DP_TWIN.make(kernels, [weights[0], new_up.to(torch.bfloat16)], [biases[0], new_bias], gated=True)
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(_bits(method(x)), _bits(fresh(x)))


def _onednn_bf16_here() -> bool:
    """oneDNN's bf16 weight reorder needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT (torch refuses it on AVX2 CPUs)."""
    from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags

    flags = set(cpu_flags().split())
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


@pytest.mark.skipif(not _onednn_bf16_here(), reason="oneDNN's bf16 blocks need AVX-512 BW/VL/DQ or AVX-NE-CONVERT")
def test_onednn_blocks_hold_their_weights_and_give_them_back():
    from cbrun.engine.backends.cpu.linear.methods import ONEDNN_B64

    gen = torch.Generator().manual_seed(8)
    weights = [torch.randn(40, 64, generator=gen).to(torch.bfloat16) for _ in range(2)]
    method = ONEDNN_B64.make(kernels, weights, [None, None], gated=True)
    assert method.owns_weights and not method.serves_rows
    assert torch.equal(_bits(method.weight(1)), _bits(weights[1]))
    replaced = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    method.load(0, weight=replaced)
    assert torch.equal(_bits(method.weight(0)), _bits(replaced))
    assert torch.equal(_bits(method.weight(1)), _bits(weights[1]))


@pytest.mark.parametrize("partial", [False, True])
def test_bf16_update_weights_through_the_packs_equals_a_fresh_engine(qwen2_tied_dir, partial):
    """New weights (all, or one layer's q projection, a bias, a norm and the tied table) go straight into the packs;
    the engine then gives what an engine built on a model holding those weights gives, bit for bit."""
    model, tokenizer = load_model(str(qwen2_tied_dir), dtype="bfloat16")
    gen = torch.Generator().manual_seed(3)
    state = model.state_dict()
    names = (
        [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.self_attn.k_proj.bias",
            "model.layers.1.post_attention_layernorm.weight",
            "lm_head.weight",
        ]
        if partial
        else list(state)
    )
    new = {name: (state[name].float() + 0.05 * torch.randn(state[name].shape, generator=gen)) for name in names}
    config = EngineConfig(num_blocks=32, backend="cpu")
    with Engine(model, tokenizer, config) as engine:
        before = _outputs(engine)
        assert engine.update_weights(new) == len(new)
        updated = _outputs(engine)
    assert updated != before
    fresh_model, _ = load_model(str(qwen2_tied_dir), dtype="bfloat16")
    fresh_model.load_state_dict({name: t.to(torch.bfloat16) for name, t in new.items()}, strict=False)
    with Engine(fresh_model, tokenizer, config) as engine:
        assert _outputs(engine) == updated
    q_proj = "model.layers.0.self_attn.q_proj.weight"  # given in both cases; back in the model after close
    assert torch.equal(_bits(model.state_dict()[q_proj]), _bits(new[q_proj].to(torch.bfloat16)))


def test_a_bad_update_changes_nothing(llama_untied_dir):
    model, tokenizer = load_model(str(llama_untied_dir), dtype="bfloat16")
    with Engine(model, tokenizer, EngineConfig(num_blocks=32, backend="cpu")) as engine:
        before = _outputs(engine)
        good = {"model.layers.0.mlp.up_proj.weight": torch.zeros(352, 128)}
        with pytest.raises(ValueError, match="shape"):
            engine.update_weights({**good, "model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3)})
        with pytest.raises(KeyError, match="not a weight"):
            engine.update_weights({**good, "model.nope.weight": torch.zeros(3)})
        assert _outputs(engine) == before


def test_bf16_sleep_level_2_and_wake_up_give_the_same_bits(llama_untied_dir):
    model, tokenizer = load_model(str(llama_untied_dir), dtype="bfloat16")
    with Engine(model, tokenizer, EngineConfig(num_blocks=32, backend="cpu")) as engine:
        before = _outputs(engine)
        parked: dict = {}
        engine.sleep(level=2, weights_to=parked)
        assert parked and all(t.stride() != (0, 0) for t in parked.values())  # the dense weights, not placeholders
        engine.wake_up()
        assert _outputs(engine) == before
