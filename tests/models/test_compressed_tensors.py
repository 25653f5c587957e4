"""compressed-tensors W8A8 checkpoints: written here from a tiny model as llmcompressor lays them out, loaded by
cbrun without the compressed-tensors package, and served in int8 exactly as quantize-at-load serves the same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cbrun.engine import Engine, EngineConfig, SamplingParams
from cbrun.engine.backends.cpu.kernels.int8 import quantize_weight
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.engine.backends.cpu.linear.int8 import PREQUANTIZED, Int8Linear
from cbrun.models import ModelLoadError, load_model

SCHEME = {
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
    "quantization_status": "compressed",
}


def _write_w8a8(source: Path, target: Path, quantize, scheme: dict = SCHEME) -> dict[str, tuple]:
    """A copy of `source` whose *_proj weights are int8 with a weight_scale [N, 1]; returns {name: (q, scale)}."""
    shutil.copytree(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    written, forms = {}, {}
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight"):
            q, scale = quantize(tensor.bfloat16())
            written[name], written[name + "_scale"] = q, scale[:, None]
            forms[name.removesuffix(".weight")] = (q, scale)
        else:
            written[name] = tensor
    save_file(written, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": scheme}))
    return forms


def _llmcompressor_style(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric int8: scale = amax / 127.5 (in bf16, as it saves them), q in [-128, 127]."""
    scale = (weight.float().abs().amax(dim=1) / 127.5).bfloat16().float()
    q = torch.round(weight.float() / scale[:, None]).clamp(-128, 127).to(torch.int8)
    q[0, :3] = -128  # the low end, which its rounding reaches at -127.5 (rare in a tiny random model: forced)
    return q, scale


def _greedy(model, tokenizer, **config) -> tuple:
    """Greedy tokens and logprobs of one prompt, and the int8 forms the engine packed ({method: [(q, scale)]})."""
    with Engine(model, tokenizer, EngineConfig(num_blocks=64, **config)) as engine:
        engine.add_request([5, 17, 3, 99, 42, 7, 250], SamplingParams(max_tokens=10, temperature=0.0), request_id="a")
        out = engine.get_result(timeout=600)
        methods = {getattr(m, "method", m) for m in engine.core.backend.linears.values()}
        forms = {m: [m.quantized(i) for i in range(len(m.widths))] for m in methods if isinstance(m, Int8Linear)}
    return list(out.token_ids), list(out.logprobs), forms


@pytest.mark.skipif(load_cpu_kernels() is None, reason="compiled CPU kernels unavailable (no C compiler)")
def test_a_w8a8_checkpoint_serves_what_quantize_at_load_serves(tiny_llama_dir, tmp_path):
    forms = _write_w8a8(tiny_llama_dir, tmp_path / "w8a8", quantize_weight)
    loaded, tokenizer = load_model(str(tmp_path / "w8a8"), dtype="bfloat16")
    q, scale = forms["model.layers.1.mlp.down_proj"]
    down = loaded.model.layers[1].mlp.down_proj.weight
    assert torch.equal(getattr(down, PREQUANTIZED)[0], q) and down.dtype == torch.bfloat16
    assert torch.equal(down, (q.float() * scale[:, None]).bfloat16())  # the dense model is the dequantized one
    dense, _ = load_model(str(tiny_llama_dir), dtype="bfloat16")
    from_checkpoint = _greedy(loaded, tokenizer, quantization="int8")
    at_load = _greedy(dense, tokenizer, quantization="int8")
    assert from_checkpoint[:2] == at_load[:2]  # tokens and logprobs, bit for bit
    assert len(from_checkpoint[0]) == 10


@pytest.mark.skipif(load_cpu_kernels() is None, reason="compiled CPU kernels unavailable (no C compiler)")
def test_a_checkpoints_own_scales_and_minus_128_are_packed_as_written(tiny_qwen3_dir, tmp_path):
    forms = _write_w8a8(tiny_qwen3_dir, tmp_path / "w8a8", _llmcompressor_style)
    assert any((q == -128).any() for q, _ in forms.values())
    model, tokenizer = load_model(str(tmp_path / "w8a8"), dtype="bfloat16")
    dense_run = _greedy(model, tokenizer)  # without --quantization: the dequantized weights in bf16
    tokens, _, packed = _greedy(model, tokenizer, quantization="int8")
    assert len(tokens) == 10 and len(dense_run[0]) == 10
    gate_up = next(packed[m] for m in packed if m.gated)  # a layer's gate|up, as the checkpoint wrote them
    layer = next(i for i in (0, 1) if torch.equal(gate_up[0][0], forms[f"model.layers.{i}.mlp.gate_proj"][0]))
    for (q, scale), name in zip(gate_up, ("gate_proj", "up_proj")):
        written_q, written_scale = forms[f"model.layers.{layer}.mlp.{name}"]
        assert torch.equal(q, written_q) and torch.equal(scale, written_scale)


def test_other_compressed_tensors_schemes_are_refused_by_name(tiny_llama_dir, tmp_path):
    four_bit = json.loads(json.dumps(SCHEME))
    four_bit["format"] = "pack-quantized"
    _write_w8a8(tiny_llama_dir, tmp_path / "w4", quantize_weight, four_bit)
    with pytest.raises(ModelLoadError, match="pack-quantized"):
        load_model(str(tmp_path / "w4"))
    grouped = json.loads(json.dumps(SCHEME))
    grouped["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    _write_w8a8(tiny_llama_dir, tmp_path / "grouped", quantize_weight, grouped)
    with pytest.raises(ModelLoadError, match="per output channel"):
        load_model(str(tmp_path / "grouped"))
