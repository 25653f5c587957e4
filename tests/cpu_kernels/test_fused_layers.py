"""The fused decoder-layer path: its kernels against torch, and its install-time probe."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.cpu.linear.methods import DP_TWIN, F32

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="no C compiler here: the torch path is used")


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 33, 64])  # pairs only, one panel, panels + an odd row, panels
@pytest.mark.parametrize("widths", [(24, 12, 12), (7,), (6, 1, 13)])
def test_linear_many_matches_concatenated_f_linear(rows, widths):
    """Several weights in one pass, every tile and panel remainder, a K tail, mixed biases, a strided input."""
    torch.manual_seed(1)
    in_features = 37
    x = torch.randn(rows, in_features + 5)[:, :in_features]
    weights = [torch.randn(n, in_features) for n in widths]
    biases = [torch.randn(n) if i % 2 == 0 else None for i, n in enumerate(widths)]
    got = kernels.linear_many(x, weights, biases)
    expected = torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=1)
    assert got.shape == (rows, sum(widths))
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 19, 64])
@pytest.mark.parametrize("features", [1, 3, 10])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_silu_matches_torch(rows, features, with_bias):
    torch.manual_seed(2)
    in_features = 43
    x = torch.randn(rows, in_features) * 2
    gate, up = torch.randn(features, in_features), torch.randn(features, in_features)
    gate_bias, up_bias = (torch.randn(features), torch.randn(features)) if with_bias else (None, None)
    got = kernels.gated_silu(x, gate, up, gate_bias, up_bias)
    expected = F.silu(F.linear(x, gate, gate_bias)) * F.linear(x, up, up_bias)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)


def _rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm formula."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


@pytest.mark.parametrize("dim", [64, 13])
def test_rmsnorm_rows_heads_and_residual_add(dim):
    torch.manual_seed(3)
    tokens, heads, eps = 5, 3, 1e-6
    wide = torch.randn(tokens, heads * dim + 4) * 3
    x = wide[:, : heads * dim]  # row stride != width
    weight = torch.randn(dim)
    normed, total = kernels.rmsnorm(x, weight, eps)
    assert total is x
    expected = _rms_norm(x.view(tokens, heads, dim), weight, eps).view(tokens, heads * dim)
    assert torch.allclose(normed, expected, atol=1e-5, rtol=1e-5)
    delta = torch.randn(tokens, heads * dim)
    normed, total = kernels.rmsnorm(x, weight, eps, delta=delta)
    assert torch.equal(total, x + delta)
    expected = _rms_norm((x + delta).view(tokens, heads, dim), weight, eps).view(tokens, heads * dim)
    assert torch.allclose(normed, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim", [64, 20])
def test_rope_is_bit_identical_to_transformers(dim):
    """Rotate-half rotary in place on q and k heads side by side in one row, as apply_rotary_pos_emb."""
    torch.manual_seed(4)
    tokens, heads, kv_heads = 6, 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    angles = torch.randn(tokens, dim // 2) * 5
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # [T, D]
    q = qkv[:, : heads * dim].view(tokens, heads, dim).transpose(0, 1)[None]  # [1, H, T, D]
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim).transpose(0, 1)[None]
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    values = qkv[:, (heads + kv_heads) * dim :].clone()
    kernels.rope(qkv, heads + kv_heads, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)  # q, k are views of qkv
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], values)  # v untouched


# -- install and probe ------------------------------------------------------------------


class _CountingKernels:
    """The kernels, counting calls by name (its facts and parts, such as `dp`, pass through as they are)."""

    def __init__(self, inner):
        import collections

        self.inner, self.calls = inner, collections.Counter()

    def __getattr__(self, name):
        function = getattr(self.inner, name)
        if not callable(function):
            return function

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return function(*args, **kwargs)

        return counted


def _load(directory, dtype="float32"):
    from cbrun.models import load_model

    model, _ = load_model(str(directory), dtype=dtype, device="cpu")
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_mistral_sliding_dir"])
def test_llama_style_layers_are_fused_and_compute_the_stock_function(fixture, dtype, request):
    """fp32: the stock function up to summation order. bf16: up to where it rounds (the stock forward rounds
    after every op, the fused one keeps the residual stream and the norms in fp32 within a layer)."""
    from cbrun.engine.backends.cpu.fused.layers import install_fused_layers
    from cbrun.engine.backends.cpu.linear.held_weights import HeldWeights

    model = _load(request.getfixturevalue(fixture), dtype)
    method, tolerance = (F32, 1e-4) if dtype == "float32" else (DP_TWIN, 6e-2)
    model.set_attn_implementation("sdpa")
    torch.manual_seed(7)
    spy = _CountingKernels(kernels)
    with torch.inference_mode():
        inputs = [torch.randint(3, 500, (1, n)) for n in (4, 265)]
        expected = [model(ids, use_cache=False).logits for ids in inputs]
        held = HeldWeights(model)
        installed = install_fused_layers(model, spy, method, held)
        assert [plan.layer for plan in installed] == list(model.model.layers)
        assert model.config._attn_implementation == "sdpa"  # the probe puts it back
        for ids, reference in zip(inputs, expected):
            spy.calls.clear()
            logits = model(ids, use_cache=False).logits
            assert logits.dtype == reference.dtype
            scale = reference.float().abs().max().item()
            assert torch.allclose(logits.float(), reference.float(), atol=tolerance * scale, rtol=tolerance)
            assert spy.calls["rope"] == len(installed)  # the fused forward ran in every layer
        held.restore()
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)


def test_layers_of_another_shape_are_left_alone(tiny_gemma_hybrid_dir):
    """Gemma3's layers have extra norms and a (1 + w) RMSNorm: not fused."""
    from cbrun.engine.backends.cpu.fused.layers import install_fused_layers
    from cbrun.engine.backends.cpu.linear.held_weights import HeldWeights

    model = _load(tiny_gemma_hybrid_dir)
    assert install_fused_layers(model, kernels, F32, HeldWeights(model)) == []


def test_a_layer_that_computes_something_else_fails_its_probe(tiny_llama_dir):
    """Same structure, different function (a norm with another formula): that layer keeps its forward."""
    from cbrun.engine.backends.cpu.fused.layers import install_fused_layers
    from cbrun.engine.backends.cpu.linear.held_weights import HeldWeights

    model = _load(tiny_llama_dir)
    odd = model.model.layers[1].post_attention_layernorm
    odd.forward = lambda hidden: odd.weight * hidden  # no normalization
    installed = install_fused_layers(model, kernels, F32, HeldWeights(model))
    assert [plan.layer for plan in installed] == [model.model.layers[0]]
    assert "forward" not in model.model.layers[1].__dict__


def test_silu_mul_matches_torch():
    torch.manual_seed(8)
    gate = torch.randn(70, 1000) * 4
    up = torch.randn(70, 1003)[:, :1000]  # row stride != width
    assert torch.allclose(kernels.silu_mul(gate, up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_a_model_that_cannot_switch_attention_is_not_fused(tiny_llama_dir, monkeypatch):
    """The probe needs its own attention; without it the layers keep their stock forward and nothing fails."""
    from cbrun.engine.backends.cpu.fused import probe as fused_probe
    from cbrun.engine.backends.cpu.fused.layers import install_fused_layers
    from cbrun.engine.backends.cpu.linear.held_weights import HeldWeights

    model = _load(tiny_llama_dir)
    original = model.set_attn_implementation

    def no_switch(name):
        if name == fused_probe.PROBE_ATTENTION:
            raise ValueError("this attention is not supported by this model")
        return original(name)

    monkeypatch.setattr(model, "set_attn_implementation", no_switch)
    before = model.config._attn_implementation
    assert install_fused_layers(model, kernels, F32, HeldWeights(model)) == []
    assert model.config._attn_implementation == before
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)


def test_layers_are_fused_where_torchs_sdpa_refuses_to_run(tiny_llama_dir, monkeypatch):
    """torch's bf16 SDPA raises under ATEN_CPU_CAPABILITY=avx2 on an AMX CPU ("pack_vnni2 is only supported when
    avx512 is supported"): the probe does not go through it, so the layers are fused there as everywhere."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from cbrun.engine.backends.cpu.fused.layers import install_fused_layers
    from cbrun.engine.backends.cpu.linear.held_weights import HeldWeights

    def refusing_sdpa(*args, **kwargs):
        raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", refusing_sdpa)
    model = _load(tiny_llama_dir, "bfloat16")
    model.set_attn_implementation("sdpa")
    installed = install_fused_layers(model, kernels, DP_TWIN, HeldWeights(model))
    assert [plan.layer for plan in installed] == list(model.model.layers)


def test_the_probes_attention_is_sdpas_causal_attention():
    from cbrun.engine.backends.cpu.fused.probe import probe_attention

    torch.manual_seed(3)
    q, k, v = torch.randn(1, 6, 9, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask, scale=0.25
    )  # [1, H, T, D]
    got, _ = probe_attention(None, q, k, v, None, 0.25)
    torch.testing.assert_close(got, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_layers_alike_but_for_their_weights_share_one_probe(tiny_llama_dir, monkeypatch):
    """An 8B model's 32 layers probe once; a layer that differs in anything but its weights probes on its own."""
    from cbrun.engine.backends.cpu.fused import layers as fused_layers, probe as fused_probe
    from cbrun.engine.backends.cpu.linear.held_weights import HeldWeights

    probed = []
    probe = fused_probe.probe
    monkeypatch.setattr(fused_layers, "probe", lambda layer, *args: probed.append(layer) or probe(layer, *args))
    model = _load(tiny_llama_dir)
    assert len(fused_layers.install_fused_layers(model, kernels, F32, HeldWeights(model))) == 2
    assert probed == [model.model.layers[0]]

    probed.clear()
    model = _load(tiny_llama_dir)
    model.model.layers[1].self_attn.scaling *= 2  # another setting: its own probe (which it passes)
    assert len(fused_layers.install_fused_layers(model, kernels, F32, HeldWeights(model))) == 2
    assert probed == list(model.model.layers)
