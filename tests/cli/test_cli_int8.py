"""--quantization int8 from the command line, cbrun info and the vLLM-compatible LLM: wired to the engine."""

from __future__ import annotations

import json

import pytest
from cli_helpers import by_key, engine_args, read_jsonl, write_jsonl

from cbrun.cli.app import main
from cbrun.cli.common import CliError, build_engine_config
from cbrun.engine.backends.cpu.kernels.loader import load_cpu_kernels
from cbrun.llm import LLM, SamplingParams
from cbrun.llm.params import UnsupportedFieldError

needs_kernels = pytest.mark.skipif(load_cpu_kernels() is None, reason="the compiled CPU kernels cannot be built here")


def test_the_quantization_option_reaches_the_engine_config_and_is_checked():
    assert build_engine_config(quantization="int8").quantization == "int8"
    assert build_engine_config().quantization is None
    with pytest.raises(CliError, match="quantization must be one of int8"):
        build_engine_config(quantization="int4")


@needs_kernels
def test_generate_with_int8_writes_every_row_and_refuses_other_schemes(tiny_llama_dir, tmp_path):
    prompts = [{"id": "a", "prompt": "the quick brown fox"}, {"id": "b", "input_ids": [1, 40, 41, 42]}]
    source, out = write_jsonl(tmp_path / "in.jsonl", prompts), tmp_path / "out.jsonl"
    assert main(["generate", str(source), str(out), *engine_args(tiny_llama_dir), "--quantization", "int8"]) == 0
    rows = by_key(read_jsonl(out))
    assert set(rows) == {("a", 0), ("b", 0)} and all(r["error"] is None for r in rows.values())
    assert main(["generate", str(source), str(out), *engine_args(tiny_llama_dir), "--quantization", "fp8"]) == 2


@needs_kernels
def test_info_shows_the_int8_method_and_its_self_check(capsys, tiny_qwen3_dir):
    assert main(["info", "--json"]) == 0
    int8 = json.loads(capsys.readouterr().out)["linear_methods"]["int8"]
    assert int8["method"].startswith("int8-") and int8["same_bits_on_every_cpu"]
    assert any(check["passed"] and check["method"] == int8["method"] for check in int8["checks"])
    assert main(["info", "--model", str(tiny_qwen3_dir), "--quantization", "int8"]) == 0
    assert "int8 W8A8 (every linear but the head)" in capsys.readouterr().out


@needs_kernels
def test_llm_takes_int8_and_refuses_other_schemes_by_name(tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="bfloat16", quantization="int8", num_gpu_blocks_override=64) as llm:
        out = llm.generate(["hello there"], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 4
        assert "int8 W8A8" in llm.engine.linear_kernels()
    with pytest.raises(UnsupportedFieldError, match="quantization"):
        LLM(str(tiny_llama_dir), quantization="awq")
